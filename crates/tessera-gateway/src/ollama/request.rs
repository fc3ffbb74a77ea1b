//! Ollama's `/api/chat` and `/api/generate` bodies, read into the shared [`ParsedRequest`].
//!
//! As on the other front ends every field is honoured or refused with a 400 naming it, except
//! those that change no output: `keep_alive` (the model stays loaded whatever it says) and the
//! `options` that tune loading or threads (`num_ctx`, `num_gpu`, `num_thread`...). A sampling
//! option this engine does not have (`mirostat`, `typical_p`...) is accepted only at the value
//! that turns it off. Defaults are the engine's (as on `/v1/chat/completions`: temperature 1,
//! no top-k, no repeat penalty), not those an Ollama Modelfile would set.

use serde_json::{json, Value};

use crate::openai::tools::{self, ToolChoice};
use crate::openai::{self, ApiError, ParsedRequest, Prompt, ResponseFormat};

/// Most entries in `options.stop` (their matching runs on every token).
pub const MAX_STOP_STRINGS: usize = 16;

/// The body fields `/api/chat` takes.
const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "tools",
    "format",
    "options",
    "stream",
    "keep_alive",
    "think",
];

/// The body fields `/api/generate` takes.
const GENERATE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "suffix",
    "images",
    "format",
    "options",
    "system",
    "template",
    "context",
    "stream",
    "raw",
    "keep_alive",
    "think",
];

/// `options` that tune loading, memory or threads: they change no output, so they are
/// accepted and ignored.
pub(crate) const RUNTIME_OPTIONS: &[&str] = &[
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "numa",
    "num_keep",
];

/// Sampling `options` this engine does not implement, with the value that turns each off.
const OFF_OPTIONS: &[(&str, f64)] = &[
    ("typical_p", 1.0),
    ("tfs_z", 1.0),
    ("mirostat", 0.0),
    ("mirostat_tau", 5.0),
    ("mirostat_eta", 0.1),
];

/// What a chat or generate request asks for beyond the shared form.
#[derive(Clone, Debug)]
pub struct OllamaRequest {
    pub req: ParsedRequest,
    /// No prompt or messages: Ollama answers at once that the model is loaded.
    pub load_only: bool,
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, Some(param))
}

fn check_fields(v: &Value, allowed: &[&str]) -> Result<(), ApiError> {
    if let Some(o) = v.as_object() {
        if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(bad(k, format!("unknown field '{k}'")));
        }
    }
    Ok(())
}

/// `think`: only off (the served models do not think in a separate channel).
fn check_think(v: &Value) -> Result<(), ApiError> {
    match v.get("think") {
        None | Some(Value::Null | Value::Bool(false)) => Ok(()),
        Some(_) => Err(bad(
            "think",
            "'think' is not supported: the served model does not think in a separate channel \
             (only false is accepted)",
        )),
    }
}

/// `keep_alive`: a duration string (`"5m"`), seconds, or -1. The model stays loaded whatever
/// it says, so only its type is checked.
fn check_keep_alive(v: &Value) -> Result<(), ApiError> {
    match v.get("keep_alive") {
        None | Some(Value::Null | Value::String(_) | Value::Number(_)) => Ok(()),
        Some(_) => Err(bad(
            "keep_alive",
            "'keep_alive' must be a duration such as \"5m\" or a number of seconds",
        )),
    }
}

/// `format`: `"json"` (any JSON value, as Ollama: an object), a JSON schema, or `""`.
fn format(v: &Value) -> Result<ResponseFormat, ApiError> {
    match v.get("format") {
        None | Some(Value::Null) => Ok(ResponseFormat::Text),
        Some(Value::String(s)) if s.is_empty() => Ok(ResponseFormat::Text),
        Some(Value::String(s)) if s == "json" => Ok(ResponseFormat::JsonObject),
        Some(Value::Object(_)) => Ok(ResponseFormat::JsonSchema {
            name: "format".into(),
            schema: v["format"].clone(),
        }),
        Some(_) => Err(bad(
            "format",
            "'format' must be \"json\" or a JSON schema object",
        )),
    }
}

fn number(o: &serde_json::Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => Err(bad(
            &format!("options.{key}"),
            format!("options.{key} must be a number"),
        )),
    }
}

fn whole(o: &serde_json::Map<String, Value>, key: &str) -> Result<Option<i64>, ApiError> {
    match number(o, key)? {
        None => Ok(None),
        Some(x) if x.fract() == 0.0 && x.abs() < 9.0e15 => Ok(Some(x as i64)),
        Some(x) => Err(bad(
            &format!("options.{key}"),
            format!("options.{key} must be an integer, not {x}"),
        )),
    }
}

/// `options` mapped onto the shared request's sampling fields.
fn apply_options(v: &Value, r: &mut ParsedRequest) -> Result<(), ApiError> {
    let o = match v.get("options") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(bad("options", "'options' must be an object")),
    };
    for (k, val) in o {
        let known = matches!(
            k.as_str(),
            "num_predict"
                | "temperature"
                | "top_k"
                | "top_p"
                | "min_p"
                | "seed"
                | "stop"
                | "repeat_penalty"
                | "repeat_last_n"
                | "presence_penalty"
                | "frequency_penalty"
                | "penalize_newline"
        ) || RUNTIME_OPTIONS.contains(&k.as_str());
        if known {
            continue;
        }
        match OFF_OPTIONS.iter().find(|(name, _)| name == k) {
            Some((_, off)) if val.is_null() || val.as_f64() == Some(*off) => {}
            Some((_, off)) => {
                return Err(bad(
                    &format!("options.{k}"),
                    format!(
                    "options.{k} is not supported by this server (only {off}, which turns it off)"
                ),
                ))
            }
            None => {
                return Err(bad(
                    &format!("options.{k}"),
                    format!("unknown option '{k}'"),
                ))
            }
        }
    }
    // -1: until the end of generation; -2: until the context is full. Both are our default.
    match whole(o, "num_predict")? {
        None | Some(-1 | -2) => {}
        Some(n) if n >= 1 => r.max_tokens = Some(n as usize),
        Some(n) => {
            return Err(bad(
                "options.num_predict",
                format!("options.num_predict must be at least 1, or -1 or -2 (got {n})"),
            ))
        }
    }
    // Ranges are checked once for every front end, by `SamplingParams::validate`.
    if let Some(t) = number(o, "temperature")? {
        r.temperature = t as f32;
    }
    if let Some(k) = whole(o, "top_k")? {
        // Ollama's 0 means "no top-k", as ours.
        r.top_k = usize::try_from(k)
            .map_err(|_| bad("options.top_k", "options.top_k must not be negative"))?;
    }
    if let Some(p) = number(o, "top_p")? {
        r.top_p = p as f32;
    }
    if let Some(p) = number(o, "min_p")? {
        r.min_p = p as f32;
    }
    if let Some(s) = whole(o, "seed")? {
        r.seed = Some(s as u64);
    }
    if let Some(p) = number(o, "repeat_penalty")? {
        r.repetition_penalty = p as f32;
    }
    if let Some(n) = whole(o, "repeat_last_n")? {
        // Ollama's -1 means the whole context.
        r.repeat_last_n = match n {
            -1 => u32::MAX as usize,
            n => usize::try_from(n).map_err(|_| {
                bad(
                    "options.repeat_last_n",
                    "options.repeat_last_n must be -1 or more",
                )
            })?,
        };
    }
    for (key, slot) in [
        ("presence_penalty", &mut r.presence_penalty),
        ("frequency_penalty", &mut r.frequency_penalty),
    ] {
        if let Some(p) = number(o, key)? {
            *slot = p as f32;
        }
    }
    // Newlines are never penalized apart from other tokens here; `true` would ask for that.
    if o.get("penalize_newline").and_then(Value::as_bool) == Some(true) {
        return Err(bad(
            "options.penalize_newline",
            "options.penalize_newline is not supported (only false)",
        ));
    }
    match o.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            if list.len() > MAX_STOP_STRINGS {
                return Err(bad(
                    "options.stop",
                    format!("options.stop: at most {MAX_STOP_STRINGS} stop strings"),
                ));
            }
            r.stop = list
                .iter()
                .map(|s| {
                    s.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| bad("options.stop", "options.stop must be strings"))
                })
                .collect::<Result<_, _>>()?;
        }
        Some(Value::String(s)) => r.stop = vec![s.clone()],
        Some(_) => {
            return Err(bad(
                "options.stop",
                "options.stop must be a list of strings",
            ))
        }
    }
    Ok(())
}

fn model(v: &Value) -> Result<String, ApiError> {
    openai::field::<String>(v, "model")?
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("model", "model is required"))
}

/// Ollama streams unless told not to.
fn stream(v: &Value) -> Result<bool, ApiError> {
    Ok(openai::field::<bool>(v, "stream")?.unwrap_or(true))
}

/// Refuses a non-empty list or string field this server cannot use.
fn refuse_nonempty(v: &Value, key: &str, why: &str) -> Result<(), ApiError> {
    let empty = match v.get(key) {
        None | Some(Value::Null) => true,
        Some(Value::Array(a)) => a.is_empty(),
        Some(Value::String(s)) => s.is_empty(),
        Some(_) => false,
    };
    if empty {
        Ok(())
    } else {
        Err(bad(key, format!("'{key}' is not supported: {why}")))
    }
}

/// One Ollama chat message as the chat message the template renders.
fn chat_message(m: &Value, i: usize) -> Result<Value, ApiError> {
    let p = format!("messages[{i}]");
    let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
    if !matches!(role, "system" | "user" | "assistant" | "tool") {
        return Err(bad(
            &format!("{p}.role"),
            format!("{p}.role: '{role}' is not system, user, assistant or tool"),
        ));
    }
    refuse_nonempty(m, "images", "the served model reads text only")
        .map_err(|e| bad(&format!("{p}.images"), e.message))?;
    let content = match m.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => {
            return Err(bad(
                &format!("{p}.content"),
                format!("{p}.content must be a string"),
            ))
        }
    };
    let mut out = json!({"role": role, "content": content});
    if role == "tool" {
        // Ollama names the tool, not a call id.
        if let Some(name) = m.get("tool_name").and_then(Value::as_str) {
            out["name"] = name.into();
        }
    }
    if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
        let calls = calls
            .as_array()
            .filter(|_| role == "assistant")
            .ok_or_else(|| {
                bad(
                    &format!("{p}.tool_calls"),
                    "tool_calls must be a list, on an assistant message",
                )
            })?;
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(j, c)| {
                let f = &c["function"];
                let name = f["name"].as_str().ok_or_else(|| {
                    bad(
                        &format!("{p}.tool_calls[{j}].function.name"),
                        "a tool call needs function.name",
                    )
                })?;
                let arguments = match &f["arguments"] {
                    Value::String(s) => s.clone(),
                    Value::Null => "{}".into(),
                    other => other.to_string(),
                };
                Ok(json!({"id": format!("call_{i}_{j}"), "type": "function",
                          "function": {"name": name, "arguments": arguments}}))
            })
            .collect::<Result<_, ApiError>>()?;
        out["tool_calls"] = calls.into();
    }
    Ok(out)
}

/// Parses an `/api/chat` body.
pub fn parse_chat(body: &[u8]) -> Result<OllamaRequest, ApiError> {
    let v = openai::parse_value(body)?;
    check_fields(&v, CHAT_FIELDS)?;
    check_think(&v)?;
    check_keep_alive(&v)?;
    let messages = match v.get("messages") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, m)| chat_message(m, i))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("messages", "'messages' must be a list")),
    };
    let load_only = messages.is_empty();
    let mut r = ParsedRequest::new(model(&v)?, Prompt::Chat(messages));
    r.stream = stream(&v)?;
    r.response_format = format(&v)?;
    if let Some(t) = v.get("tools").filter(|t| !t.is_null()) {
        r.tools = tools::parse_tools(t)?;
        if !r.tools.is_empty() {
            r.tool_choice = ToolChoice::Auto;
        }
    }
    apply_options(&v, &mut r)?;
    Ok(OllamaRequest { req: r, load_only })
}

/// Parses an `/api/generate` body: the prompt through the chat template (with `system`), or
/// as it is with `raw`.
pub fn parse_generate(body: &[u8]) -> Result<OllamaRequest, ApiError> {
    let v = openai::parse_value(body)?;
    check_fields(&v, GENERATE_FIELDS)?;
    check_think(&v)?;
    check_keep_alive(&v)?;
    refuse_nonempty(&v, "images", "the served model reads text only")?;
    refuse_nonempty(&v, "suffix", "fill-in-the-middle is not served")?;
    refuse_nonempty(
        &v,
        "template",
        "the model's own chat template is used (or none, with raw)",
    )?;
    refuse_nonempty(
        &v,
        "context",
        "send the conversation to /api/chat instead (the context list is deprecated)",
    )?;
    let prompt = openai::field::<String>(&v, "prompt")?.unwrap_or_default();
    let system = openai::field::<String>(&v, "system")?;
    let raw = openai::field::<bool>(&v, "raw")?.unwrap_or(false);
    let load_only = prompt.is_empty();
    let prompt = if raw {
        if system.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(bad(
                "system",
                "'system' needs the chat template, which 'raw' turns off",
            ));
        }
        Prompt::Text(prompt)
    } else {
        let mut m = Vec::new();
        if let Some(s) = system.filter(|s| !s.is_empty()) {
            m.push(json!({"role": "system", "content": s}));
        }
        m.push(json!({"role": "user", "content": prompt}));
        Prompt::Chat(m)
    };
    let mut r = ParsedRequest::new(model(&v)?, prompt);
    r.stream = stream(&v)?;
    r.response_format = format(&v)?;
    apply_options(&v, &mut r)?;
    Ok(OllamaRequest { req: r, load_only })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<OllamaRequest, ApiError> {
        parse_chat(v.to_string().as_bytes())
    }

    #[test]
    fn options_become_sampling_parameters() {
        let r = chat(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "options": {"num_predict": 7, "temperature": 0, "top_k": 5, "top_p": 0.5,
                        "seed": 3, "stop": ["\n"], "repeat_penalty": 1.2, "num_ctx": 4096,
                        "mirostat": 0},
            "keep_alive": "5m", "stream": false}),
        )
        .unwrap()
        .req;
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.temperature, 0.0);
        assert_eq!((r.top_k, r.top_p, r.seed), (5, 0.5, Some(3)));
        assert_eq!(r.stop, vec!["\n".to_string()]);
        assert_eq!(r.repetition_penalty, 1.2);
        assert!(!r.stream);
    }

    #[test]
    fn options_that_would_change_the_answer_unhonoured_are_refused_by_name() {
        for (opt, val) in [
            ("mirostat", json!(2)),
            ("typical_p", json!(0.5)),
            ("bogus", json!(1)),
        ] {
            let e = chat(json!({"model": "m", "messages": [], "options": {opt: val}})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(format!("options.{opt}").as_str()));
        }
        let e = chat(json!({"model": "m", "messages": [], "think": true})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("think"));
    }

    #[test]
    fn format_is_json_or_a_schema() {
        let r = chat(json!({"model": "m", "messages": [], "format": "json"})).unwrap();
        assert_eq!(r.req.response_format, ResponseFormat::JsonObject);
        assert!(r.load_only);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let r = chat(json!({"model": "m", "messages": [], "format": schema})).unwrap();
        assert!(matches!(
            r.req.response_format,
            ResponseFormat::JsonSchema { .. }
        ));
    }

    #[test]
    fn tool_calls_and_results_in_the_history_become_chat_messages() {
        let r = chat(json!({"model": "m", "messages": [
            {"role": "user", "content": "add"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "add", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "2", "tool_name": "add"}],
            "tools": [{"type": "function", "function": {"name": "add"}}]}))
        .unwrap()
        .req;
        let Prompt::Chat(m) = &r.prompt else {
            panic!("a chat prompt")
        };
        assert_eq!(m[1]["tool_calls"][0]["function"]["arguments"], "{\"a\":1}");
        assert_eq!(m[2]["name"], "add");
        assert_eq!(r.tool_choice, ToolChoice::Auto);
    }

    #[test]
    fn generate_uses_the_template_unless_raw() {
        let r = parse_generate(br#"{"model": "m", "prompt": "hi", "system": "be brief"}"#)
            .unwrap()
            .req;
        assert!(matches!(&r.prompt, Prompt::Chat(m) if m.len() == 2));
        assert!(r.stream);
        let r = parse_generate(br#"{"model": "m", "prompt": "hi", "raw": true}"#)
            .unwrap()
            .req;
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        assert!(parse_generate(br#"{"model": "m", "prompt": "x", "images": ["aGk="]}"#).is_err());
    }
}
