//! OpenAI's wire format: the request bodies we accept, the responses and stream chunks we send,
//! and the error shape. Parsing is strict about types and ranges (a wrong type is a 400 naming
//! the field), and every parameter is either honoured or refused with a 400 naming it, except
//! the few bookkeeping ones OpenAI itself documents as having no effect on output (`user`,
//! `metadata`...): see [`CHAT_PARAMS`] and [`COMPLETION_PARAMS`]. This file parses and validates
//! requests (`messages`: a chat message's roles and content, `response_format`); `response`
//! builds what we send back, `tools` and [`logprobs`] their parts, `params` the table of
//! parameters and `error` the error shape.

use serde::Deserialize;
use serde_json::Value;
use tessera_sampling::SamplingParams;

mod error;
pub mod logprobs;
mod messages;
mod params;
mod response;
pub mod tools;

use messages::{chat_message, prediction, response_format};
pub use response::{
    chunk, full_response, tool_call_json, usage_chunk, usage_json, ChoiceOut, Delta, Endpoint,
    ResponseMeta,
};

use tools::{Tool, ToolChoice};

pub use error::ApiError;
pub(crate) use params::check_params;
pub use params::{asks_for_nothing, Support, CHAT_PARAMS, COMPLETION_PARAMS, LLAMA_CPP_ALIASES};

/// `stop`: one string or up to four.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum StopSpec {
    One(String),
    Many(Vec<String>),
}

/// A prompt for `/v1/completions`: text, one text in a list, or token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum PromptSpec {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

/// What the prompt is, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Chat messages as JSON objects (`role`, `content` as text, and `tool_calls`,
    /// `tool_call_id`, `name` where given), rendered by the chat template.
    Chat(Vec<Value>),
    Text(String),
    Tokens(Vec<u32>),
}

/// `response_format`.
#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON matching the schema (enforced whether or not `strict` is set).
    JsonSchema {
        name: String,
        schema: Value,
    },
}

/// A validated request to either endpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    pub model: String,
    pub prompt: Prompt,
    pub stream: bool,
    pub include_usage: bool,
    /// `None`: as many as fit the context (chat) — completions default to 16 as OpenAI's do.
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    /// Choices to generate (each its own sample: choice `i` uses [`choice_seed`]).
    pub n: usize,
    /// Log-probabilities with this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Completions: the prompt text precedes the completion.
    pub echo: bool,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub repeat_last_n: usize,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Token id → bias, validated against the vocabulary when tokenizing.
    pub logit_bias: Vec<(u32, f32)>,
    pub response_format: ResponseFormat,
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    /// The last message is the start of the assistant's reply, to be continued rather than
    /// closed (Anthropic's prefill; vLLM's `continue_final_message`).
    pub continue_final_message: bool,
    /// Chat's `prediction` (predicted outputs): the text the answer is expected to be close
    /// to, drafted from and checked, never changing the text.
    pub prediction: Option<String>,
}

impl ParsedRequest {
    /// A request with OpenAI's defaults (the other front ends fill it from their own bodies).
    pub fn new(model: String, prompt: Prompt) -> Self {
        Self {
            model,
            prompt,
            stream: false,
            include_usage: false,
            max_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            stop: Vec::new(),
            n: 1,
            logprobs: None,
            echo: false,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            response_format: ResponseFormat::Text,
            tools: Vec::new(),
            tool_choice: ToolChoice::None,
            parallel_tool_calls: true,
            continue_final_message: false,
            prediction: None,
        }
    }
}

/// The seed of choice `index` of a request with `seed`: choice 0 keeps the seed (so `n: 1`
/// and the first of `n: 3` agree), the others get distinct derived seeds.
pub fn choice_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        seed
    } else {
        tessera_sampling::splitmix64(seed ^ (index as u64).wrapping_mul(0x9E37_79B9))
    }
}

impl ParsedRequest {
    /// Sampling parameters for choice `index`.
    pub fn sampling(&self, default_seed: u64, index: usize) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: if self.temperature <= 0.0 {
                1
            } else {
                self.top_k
            },
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repetition_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: choice_seed(self.seed.unwrap_or(default_seed), index),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.clone(),
        }
    }
}

pub(crate) fn parse_value(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(
            format!(
                "We could not parse the JSON body of your request ({e}). The OpenAI API \
                 expects a JSON payload."
            ),
            None,
        )
    })?;
    if !v.is_object() {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
        ));
    }
    Ok(v)
}

/// Checks a typed field by itself first, so the error names it.
pub(crate) fn field<T: serde::de::DeserializeOwned>(
    v: &Value,
    name: &str,
) -> Result<Option<T>, ApiError> {
    match v.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => serde_json::from_value(x.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid(format!("Invalid value for '{name}': {e}"), Some(name))),
    }
}

/// A number in `range`, or a 400 naming it.
pub(crate) fn count(v: &Value, name: &str, max: i64) -> Result<Option<usize>, ApiError> {
    match field::<i64>(v, name)? {
        None => Ok(None),
        Some(x) if (0..=max).contains(&x) => Ok(Some(x as usize)),
        Some(x) => Err(ApiError::invalid(
            format!("Invalid '{name}': {x} is not between 0 and {max}."),
            Some(name),
        )),
    }
}

/// Most choices per request ([`crate::limits::LIMITS`]).
pub const MAX_N: i64 = crate::limits::LIMITS.max_n as i64;
/// Most alternatives per token (`top_logprobs`), as OpenAI ([`crate::limits::LIMITS`]).
pub const MAX_TOP_LOGPROBS: i64 = crate::limits::LIMITS.max_top_logprobs as i64;

/// The fields both endpoints share.
fn common(
    v: &Value,
    prompt: Prompt,
    default_max: Option<usize>,
) -> Result<ParsedRequest, ApiError> {
    let model = field::<String>(v, "model")?
        .ok_or_else(|| ApiError::invalid("you must provide a model parameter", Some("model")))?;
    let stream = field::<bool>(v, "stream")?.unwrap_or(false);
    let include_usage = match v.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            for k in o.keys() {
                if k != "include_usage" && k != "include_obfuscation" {
                    return Err(ApiError::invalid(
                        format!("Unrecognized argument 'stream_options.{k}'."),
                        Some("stream_options"),
                    ));
                }
            }
            if !stream {
                return Err(ApiError::invalid(
                    "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                    Some("stream_options"),
                ));
            }
            o.get("include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false)
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'stream_options'.",
                Some("stream_options"),
            ))
        }
    };
    let max = match field::<i64>(v, "max_completion_tokens")? {
        Some(m) => Some((m, "max_completion_tokens")),
        None => match field::<i64>(v, "max_tokens")? {
            Some(m) => Some((m, "max_tokens")),
            // llama.cpp's spelling; its -1 means "until the context is full", our default.
            None => field::<i64>(v, "n_predict")?
                .filter(|&m| m != -1)
                .map(|m| (m, "n_predict")),
        },
    };
    let max_tokens = match max {
        Some((m, name)) if m < 1 => {
            return Err(ApiError::invalid(
                format!("Invalid '{name}': integer below minimum value. Expected a value >= 1, but got {m} instead."),
                Some(name),
            ))
        }
        Some((m, _)) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        // `n_predict: -1` asks for no limit, even where OpenAI's default is 16.
        None if field::<i64>(v, "n_predict")? == Some(-1) => None,
        None => default_max,
    };
    // Types are checked here, ranges once for every front end by `SamplingParams::validate`
    // (in `respond::prepare`).
    let temperature = field::<f32>(v, "temperature")?.unwrap_or(1.0);
    let top_p = field::<f32>(v, "top_p")?.unwrap_or(1.0);
    let stop = match field::<StopSpec>(v, "stop")? {
        None => Vec::new(),
        Some(StopSpec::One(s)) => vec![s],
        Some(StopSpec::Many(v)) => v,
    };
    if stop.len() > 4 {
        return Err(ApiError::invalid(
            "Invalid 'stop': at most 4 stop sequences are allowed.",
            Some("stop"),
        ));
    }
    let n = match field::<i64>(v, "n")? {
        None => 1,
        Some(n) if (1..=MAX_N).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(
                format!("Invalid 'n': {n} is not between 1 and {MAX_N}."),
                Some("n"),
            ))
        }
    };
    let logit_bias = match field::<std::collections::BTreeMap<String, f32>>(v, "logit_bias")? {
        None => Vec::new(),
        Some(m) => {
            let mut out = Vec::with_capacity(m.len());
            for (k, b) in m {
                let id = k.parse::<u32>().map_err(|_| {
                    ApiError::invalid(
                        format!("Invalid 'logit_bias': key '{k}' is not a token id."),
                        Some("logit_bias"),
                    )
                })?;
                out.push((id, b));
            }
            out
        }
    };
    let top_k = count(v, "top_k", i64::from(u32::MAX))?.unwrap_or(0);
    let repetition_penalty = match field::<f32>(v, "repetition_penalty")? {
        Some(p) => p,
        None => field::<f32>(v, "repeat_penalty")?.unwrap_or(1.0),
    };
    Ok(ParsedRequest {
        model,
        prompt,
        stream,
        include_usage,
        max_tokens,
        temperature,
        top_p,
        seed: field::<i64>(v, "seed")?.map(|s| s as u64),
        stop,
        n,
        logprobs: None,
        echo: false,
        top_k,
        min_p: field::<f32>(v, "min_p")?.unwrap_or(0.0),
        repetition_penalty,
        repeat_last_n: count(v, "repeat_last_n", i64::from(u32::MAX))?.unwrap_or(64),
        presence_penalty: field::<f32>(v, "presence_penalty")?.unwrap_or(0.0),
        frequency_penalty: field::<f32>(v, "frequency_penalty")?.unwrap_or(0.0),
        logit_bias,
        response_format: ResponseFormat::Text,
        tools: Vec::new(),
        tool_choice: ToolChoice::None,
        parallel_tool_calls: true,
        continue_final_message: false,
        prediction: None,
    })
}

/// Parses a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let v = parse_value(body)?;
    check_params(&v, CHAT_PARAMS)?;
    let mut r = common(&v, Prompt::Chat(Vec::new()), None)?;
    let messages = match v.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'messages'.",
                Some("messages"),
            ))
        }
        Some(Value::Array(m)) => m,
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'messages': expected an array of messages.",
                Some("messages"),
            ))
        }
    };
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            Some("messages"),
        ));
    }
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| chat_message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    r.prompt = Prompt::Chat(messages);
    let logprobs = field::<bool>(&v, "logprobs")?.unwrap_or(false);
    let top = count(&v, "top_logprobs", MAX_TOP_LOGPROBS)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid(
            "'top_logprobs' requires 'logprobs' to be true.",
            Some("top_logprobs"),
        ));
    }
    r.logprobs = logprobs.then(|| top.unwrap_or(0));
    r.response_format = response_format(&v)?;
    if let Some(m) = field::<Vec<String>>(&v, "modalities")? {
        if m.iter().any(|x| x != "text") {
            return Err(ApiError::invalid(
                "Only the 'text' modality is supported.",
                Some("modalities"),
            ));
        }
    }
    if field::<bool>(&v, "store")? == Some(true) {
        return Err(ApiError::invalid(
            "'store' is not supported: this server keeps no completions.",
            Some("store"),
        ));
    }
    if let Some(t) = v.get("tools").filter(|t| !t.is_null()) {
        r.tools = tools::parse_tools(t)?;
    }
    r.tool_choice = tools::parse_tool_choice(v.get("tool_choice"), &r.tools)?;
    r.parallel_tool_calls = field::<bool>(&v, "parallel_tool_calls")?.unwrap_or(true);
    r.continue_final_message = field::<bool>(&v, "continue_final_message")?.unwrap_or(false);
    r.prediction = prediction(&v)?;
    if r.response_format != ResponseFormat::Text
        && matches!(r.tool_choice, ToolChoice::Required | ToolChoice::Named(_))
    {
        return Err(ApiError::invalid(
            "A forced tool call ('tool_choice') cannot be combined with 'response_format'.",
            Some("response_format"),
        ));
    }
    Ok(r)
}

/// Parses a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let v = parse_value(body)?;
    check_params(&v, COMPLETION_PARAMS)?;
    let mut r = common(&v, Prompt::Tokens(Vec::new()), Some(16))?;
    if v.get("prompt").is_none_or(Value::is_null) {
        return Err(ApiError::invalid(
            "Missing required parameter: 'prompt'.",
            Some("prompt"),
        ));
    }
    let spec: PromptSpec = serde_json::from_value(v["prompt"].clone()).map_err(|_| {
        ApiError::invalid(
            "Invalid 'prompt': expected a string, a list of one string, or a list of token ids.",
            Some("prompt"),
        )
    })?;
    let prompt = match spec {
        PromptSpec::Text(t) => Prompt::Text(t),
        PromptSpec::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
        PromptSpec::Texts(_) => {
            return Err(ApiError::invalid(
                "Only one prompt per request is supported.",
                Some("prompt"),
            ))
        }
        PromptSpec::Tokens(t) => Prompt::Tokens(t),
    };
    r.prompt = prompt;
    r.logprobs = count(&v, "logprobs", MAX_TOP_LOGPROBS)?;
    r.echo = field::<bool>(&v, "echo")?.unwrap_or(false);
    if r.echo && r.logprobs.is_some() {
        return Err(ApiError::invalid(
            "'echo' with 'logprobs' is not supported (prompt tokens are not scored).",
            Some("echo"),
        ));
    }
    if let Some(b) = field::<i64>(&v, "best_of")? {
        if b != r.n as i64 {
            return Err(ApiError::invalid(
                "'best_of' must equal 'n': choices are sampled, not ranked.",
                Some("best_of"),
            ));
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_request_parses_with_openai_defaults() {
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"stop":"\n","user":"x"}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![json!({"role": "user", "content": "Hi"})])
        );
        assert_eq!((r.temperature, r.top_p, r.stream), (1.0, 1.0, false));
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert_eq!(r.max_tokens, None);
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_tokens":5,"temperature":0}"#,
        )
        .unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Chat(vec![json!({"role": "user", "content": "ab"})])
        );
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling(3, 0).top_k, 1);
    }

    #[test]
    fn malformed_requests_are_400_naming_the_field() {
        let e = parse_chat(b"{not json").unwrap_err();
        assert_eq!((e.status, e.kind), (400, "invalid_request_error"));
        let e = parse_chat(br#"{"model":"m","messages":"hi"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = parse_chat(br#"{"model":"m","messages":[],"temperature":"hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = parse_chat(br#"{"messages":[{"role":"user","content":"x"}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("model"));
        let e = parse_chat(br#"{"model":"m","messages":[]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = parse_chat(br#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse_completion(br#"{"model":"m","prompt":"x","max_tokens":0}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = parse_completion(br#"{"model":"m","prompt":"x","n":17}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = parse_completion(br#"[1,2]"#).unwrap_err();
        assert_eq!(e.status, 400);
    }

    /// A value each parameter accepts (for refused ones: any non-null value).
    fn sample_value(name: &str, chat: bool) -> Value {
        match name {
            "logprobs" if !chat => json!(2),
            "model" => json!("m"),
            "messages" => json!([{"role": "user", "content": "Hi"}]),
            "prompt" => json!("Hi"),
            "stream" | "logprobs" | "parallel_tool_calls" | "echo" | "continue_final_message" => {
                json!(true)
            }
            "stream_options" => json!({"include_usage": true}),
            "max_tokens" | "max_completion_tokens" | "n_predict" => json!(7),
            "temperature" => json!(0.5),
            "top_p" => json!(0.9),
            "seed" => json!(11),
            "stop" => json!(["x"]),
            "n" | "best_of" => json!(1),
            "top_logprobs" => json!(3),
            "logit_bias" => json!({"5": 2.5}),
            "presence_penalty" => json!(0.5),
            "frequency_penalty" => json!(0.25),
            "response_format" => json!({"type": "json_object"}),
            "prediction" => json!({"type": "content", "content": "Hi"}),
            "tools" => json!([{"type": "function", "function": {"name": "f"}}]),
            "tool_choice" => json!("auto"),
            "modalities" => json!(["text"]),
            "store" => json!(false),
            "top_k" => json!(5),
            "min_p" => json!(0.1),
            "repetition_penalty" | "repeat_penalty" => json!(1.3),
            "repeat_last_n" => json!(32),
            _ => json!("x"),
        }
    }

    /// Every parameter of both tables is fed alone (beside the required ones): honoured and
    /// ignored ones parse, refused ones are a 400 naming them, and unknown ones are refused.
    #[test]
    fn every_parameter_is_honoured_ignored_or_refused_by_name() {
        for (table, parse, required, chat) in [
            (
                CHAT_PARAMS,
                parse_chat as fn(&[u8]) -> Result<ParsedRequest, ApiError>,
                ["model", "messages"],
                true,
            ),
            (
                COMPLETION_PARAMS,
                parse_completion,
                ["model", "prompt"],
                false,
            ),
        ] {
            let base = || {
                let mut o = serde_json::Map::new();
                for r in required {
                    o.insert(r.into(), sample_value(r, chat));
                }
                o
            };
            let plain = parse(Value::Object(base()).to_string().as_bytes()).unwrap();
            for &(name, support) in table {
                let mut o = base();
                o.insert(name.into(), sample_value(name, chat));
                if name == "stream_options" {
                    o.insert("stream".into(), json!(true));
                }
                if name == "top_logprobs" {
                    o.insert("logprobs".into(), json!(true));
                }
                if name == "tool_choice" {
                    o.insert("tools".into(), sample_value("tools", chat));
                }
                let r = parse(Value::Object(o).to_string().as_bytes());
                match support {
                    Support::Refused => {
                        let e = r.expect_err(name);
                        assert_eq!((e.status, e.param.as_deref()), (400, Some(name)));
                    }
                    Support::Ignored => assert_eq!(r.expect(name), plain, "{name}"),
                    Support::Honoured => {
                        let r = r.unwrap_or_else(|e| panic!("{name}: {e:?}"));
                        // Required fields and explicit defaults aside, honouring shows.
                        let defaults = [
                            "model",
                            "messages",
                            "prompt",
                            "modalities",
                            "store",
                            "n",
                            "best_of",
                            "tool_choice",
                            "parallel_tool_calls",
                        ];
                        if !defaults.contains(&name) {
                            assert_ne!(r, plain, "{name} had no effect on the parsed request");
                        }
                    }
                }
            }
            let mut o = base();
            o.insert("frobnicate".into(), json!(1));
            let e = parse(Value::Object(o).to_string().as_bytes()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("frobnicate"));
        }
    }

    #[test]
    fn sampling_knobs_reach_the_sampler() {
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":0.7,
                "top_k":5,"min_p":0.1,"repetition_penalty":1.3,"repeat_last_n":8,
                "presence_penalty":0.5,"frequency_penalty":-0.5,"logit_bias":{"3":-100},"seed":9,"n":3}"#,
        )
        .unwrap();
        let p = r.sampling(0, 0);
        assert_eq!(
            (p.top_k, p.min_p, p.repeat_penalty, p.repeat_last_n),
            (5, 0.1, 1.3, 8)
        );
        assert_eq!((p.presence_penalty, p.frequency_penalty), (0.5, -0.5));
        assert_eq!((p.logit_bias.clone(), p.seed), (vec![(3, -100.0)], 9));
        let seeds: std::collections::HashSet<u64> = (0..3).map(|i| r.sampling(0, i).seed).collect();
        assert_eq!(seeds.len(), 3, "each choice samples with its own seed");
        let e = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
        let e = parse_chat(br#"{"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_logprobs"));
    }

    #[test]
    fn completion_prompt_forms() {
        let r = parse_completion(br#"{"model":"m","prompt":["Once"]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("Once".into()));
        assert_eq!(r.max_tokens, Some(16));
        let r = parse_completion(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
    }

    #[test]
    fn error_body_has_openai_shape() {
        let b = ApiError::model_not_found("gpt-9").body();
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "model");
    }
}
