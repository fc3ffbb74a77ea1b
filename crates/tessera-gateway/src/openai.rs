//! OpenAI's wire format: the request bodies we accept, the responses and stream chunks we send,
//! and the error shape. Parsing is strict about types and ranges (a wrong type is a 400 naming
//! the field) and lenient about fields we do not use (`user`, `presence_penalty`, ... are
//! accepted and ignored, as other OpenAI-compatible servers do).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tessera_engine::SamplingParams;
use tessera_model::ChatMessage;

use crate::backend::{FinishReason, Usage};

/// An error in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` plus the status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for `Retry-After` (429, 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: 404,
            message: format!("The model `{model}` does not exist or you do not have access to it."),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    pub fn not_found(path: &str) -> Self {
        Self {
            status: 404,
            message: format!("Unknown request URL: {path}."),
            kind: "invalid_request_error",
            param: None,
            code: Some("unknown_url"),
            retry_after: None,
        }
    }

    pub fn unauthorized(message: &str) -> Self {
        Self {
            status: 401,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    pub fn queue_full(message: String, retry_after: u64) -> Self {
        Self {
            status: 429,
            message,
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
            retry_after: Some(retry_after),
        }
    }

    pub fn unavailable(message: String) -> Self {
        Self {
            status: 503,
            message,
            kind: "server_error",
            param: None,
            code: Some("service_unavailable"),
            retry_after: Some(5),
        }
    }

    pub fn internal(message: String) -> Self {
        Self {
            status: 500,
            message,
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

/// `stop`: one string or up to four.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum StopSpec {
    One(String),
    Many(Vec<String>),
}

/// Message content: a string, or a list of parts of which the text parts are used.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
struct MessageIn {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

/// A prompt for `/v1/completions`: text, one text in a list, or token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum PromptSpec {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Clone, Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The fields both endpoints share.
#[derive(Clone, Debug, Deserialize)]
struct Common {
    model: String,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<StopSpec>,
    #[serde(default)]
    n: Option<i64>,
}

#[derive(Clone, Debug, Deserialize)]
struct ChatBody {
    messages: Vec<MessageIn>,
}

#[derive(Clone, Debug, Deserialize)]
struct CompletionBody {
    prompt: PromptSpec,
}

/// What the prompt is, before tokenization.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Chat(Vec<ChatMessage>),
    Text(String),
    Tokens(Vec<u32>),
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
}

impl ParsedRequest {
    /// Sampling parameters: OpenAI's knobs only (no top-k, min-p or repetition penalty).
    pub fn sampling(&self, default_seed: u64) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: if self.temperature <= 0.0 { 1 } else { 0 },
            top_p: self.top_p,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            seed: self.seed.unwrap_or(default_seed),
        }
    }
}

/// Turns a serde error into a 400, naming the field where serde says which.
fn from_serde(e: &serde_json::Error) -> ApiError {
    let msg = e.to_string();
    let param = msg
        .split_once("missing field `")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(f, _)| f.to_string());
    ApiError {
        param,
        ..ApiError::invalid(format!("Invalid request body: {msg}"), None)
    }
}

fn parse_value(body: &[u8]) -> Result<Value, ApiError> {
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
fn field<T: serde::de::DeserializeOwned>(v: &Value, name: &str) -> Result<Option<T>, ApiError> {
    match v.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => serde_json::from_value(x.clone())
            .map(Some)
            .map_err(|e| ApiError::invalid(format!("Invalid value for '{name}': {e}"), Some(name))),
    }
}

fn common(v: &Value) -> Result<Common, ApiError> {
    // Type-check the common fields one by one for precise messages.
    field::<String>(v, "model")?;
    field::<bool>(v, "stream")?;
    field::<i64>(v, "max_tokens")?;
    field::<i64>(v, "max_completion_tokens")?;
    field::<f32>(v, "temperature")?;
    field::<f32>(v, "top_p")?;
    field::<i64>(v, "seed")?;
    field::<i64>(v, "n")?;
    field::<StopSpec>(v, "stop")?;
    if v.get("model").is_none_or(Value::is_null) {
        return Err(ApiError::invalid(
            "you must provide a model parameter",
            Some("model"),
        ));
    }
    serde_json::from_value(v.clone()).map_err(|e| from_serde(&e))
}

fn finish_common(
    c: Common,
    prompt: Prompt,
    default_max: Option<usize>,
) -> Result<ParsedRequest, ApiError> {
    if let Some(n) = c.n {
        if n != 1 {
            return Err(ApiError::invalid("Only n=1 is supported.", Some("n")));
        }
    }
    let max = c.max_completion_tokens.or(c.max_tokens);
    let max_tokens = match max {
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(
                format!("Invalid 'max_tokens': integer below minimum value. Expected a value >= 1, but got {m} instead."),
                Some("max_tokens"),
            ))
        }
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        None => default_max,
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(
            format!("Invalid 'temperature': {temperature} is not between 0 and 2."),
            Some("temperature"),
        ));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(
            format!("Invalid 'top_p': {top_p} is not in (0, 1]."),
            Some("top_p"),
        ));
    }
    let stop = match c.stop {
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
    Ok(ParsedRequest {
        model: c.model,
        prompt,
        stream: c.stream.unwrap_or(false),
        include_usage: c.stream_options.is_some_and(|o| o.include_usage),
        max_tokens,
        temperature,
        top_p,
        seed: c.seed.map(|s| s as u64),
        stop,
    })
}

/// Parses a `/v1/chat/completions` body.
pub fn parse_chat(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let v = parse_value(body)?;
    let c = common(&v)?;
    match v.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "Missing required parameter: 'messages'.",
                Some("messages"),
            ))
        }
        Some(Value::Array(_)) => {}
        Some(_) => {
            return Err(ApiError::invalid(
                "Invalid type for 'messages': expected an array of messages.",
                Some("messages"),
            ))
        }
    }
    let b: ChatBody = serde_json::from_value(v).map_err(|e| ApiError {
        param: Some("messages".into()),
        ..ApiError::invalid(format!("Invalid 'messages': {e}"), None)
    })?;
    if b.messages.is_empty() {
        return Err(ApiError::invalid(
            "Invalid 'messages': empty array. Expected an array with minimum length 1.",
            Some("messages"),
        ));
    }
    let mut messages = Vec::with_capacity(b.messages.len());
    for (i, m) in b.messages.into_iter().enumerate() {
        if !matches!(
            m.role.as_str(),
            "system" | "developer" | "user" | "assistant" | "tool"
        ) {
            return Err(ApiError::invalid(
                format!("Invalid value for 'messages[{i}].role': '{}'.", m.role),
                Some(&format!("messages[{i}].role")),
            ));
        }
        let content = match m.content {
            None => String::new(),
            Some(Content::Text(t)) => t,
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::invalid(
                            format!("Content parts of type '{}' are not supported.", p.kind),
                            Some(&format!("messages[{i}].content")),
                        ));
                    }
                    t.push_str(p.text.as_deref().unwrap_or_default());
                }
                t
            }
        };
        messages.push(ChatMessage::new(m.role, content));
    }
    finish_common(c, Prompt::Chat(messages), None)
}

/// Parses a `/v1/completions` body.
pub fn parse_completion(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let v = parse_value(body)?;
    let c = common(&v)?;
    if v.get("prompt").is_none_or(Value::is_null) {
        return Err(ApiError::invalid(
            "Missing required parameter: 'prompt'.",
            Some("prompt"),
        ));
    }
    let b: CompletionBody = serde_json::from_value(v).map_err(|_| {
        ApiError::invalid(
            "Invalid 'prompt': expected a string, a list of one string, or a list of token ids.",
            Some("prompt"),
        )
    })?;
    let prompt = match b.prompt {
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
    finish_common(c, prompt, Some(16))
}

/// `usage` as OpenAI writes it.
pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// Which endpoint a response is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completion => "/v1/completions",
        }
    }

    pub fn id_prefix(self) -> &'static str {
        match self {
            Self::Chat => "chatcmpl-",
            Self::Completion => "cmpl-",
        }
    }
}

/// Fixed parts of every response of one request.
#[derive(Clone, Debug)]
pub struct ResponseMeta {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// The whole (non-streamed) response.
pub fn full_response(m: &ResponseMeta, text: &str, finish: FinishReason, usage: Usage) -> Value {
    let choice = match m.endpoint {
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": finish.as_str(),
        }),
        Endpoint::Completion => json!({
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish.as_str(),
        }),
    };
    json!({
        "id": m.id,
        "object": match m.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        },
        "created": m.created,
        "model": m.model,
        "system_fingerprint": null,
        "choices": [choice],
        "usage": usage_json(usage),
    })
}

/// One streamed chunk. For chat, `role` goes in the first chunk's delta; `text: None` with a
/// finish reason is the closing chunk (empty delta).
pub fn chunk(
    m: &ResponseMeta,
    role: bool,
    text: Option<&str>,
    finish: Option<FinishReason>,
) -> Value {
    let choice = match m.endpoint {
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), "assistant".into());
            }
            if let Some(t) = text {
                delta.insert("content".into(), t.into());
            }
            json!({
                "index": 0,
                "delta": delta,
                "logprobs": null,
                "finish_reason": finish.map(FinishReason::as_str),
            })
        }
        Endpoint::Completion => json!({
            "index": 0,
            "text": text.unwrap_or_default(),
            "logprobs": null,
            "finish_reason": finish.map(FinishReason::as_str),
        }),
    };
    json!({
        "id": m.id,
        "object": match m.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        },
        "created": m.created,
        "model": m.model,
        "system_fingerprint": null,
        "choices": [choice],
    })
}

/// The extra last chunk that `stream_options.include_usage` asks for.
pub fn usage_chunk(m: &ResponseMeta, usage: Usage) -> Value {
    json!({
        "id": m.id,
        "object": match m.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        },
        "created": m.created,
        "model": m.model,
        "system_fingerprint": null,
        "choices": [],
        "usage": usage_json(usage),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_request_parses_with_openai_defaults() {
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":"Hi"}],"stop":"\n","user":"x"}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Chat(vec![ChatMessage::new("user", "Hi")]));
        assert_eq!((r.temperature, r.top_p, r.stream), (1.0, 1.0, false));
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert_eq!(r.max_tokens, None);
        let r = parse_chat(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_tokens":5,"temperature":0}"#,
        )
        .unwrap();
        assert_eq!(r.prompt, Prompt::Chat(vec![ChatMessage::new("user", "ab")]));
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.sampling(3).top_k, 1);
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
        let e = parse_completion(br#"{"model":"m","prompt":"x","n":2}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = parse_completion(br#"[1,2]"#).unwrap_err();
        assert_eq!(e.status, 400);
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
