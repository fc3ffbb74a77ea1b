//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), so clients
//! built for Claude (coding assistants, the `anthropic` SDK) can use a local model.
//!
//! A Messages body is translated into the same [`ParsedRequest`] the OpenAI endpoints build —
//! `system` and content blocks become chat messages, `tool_use` / `tool_result` blocks become
//! assistant tool calls and tool messages, `tools` / `tool_choice` map one to one — and runs
//! through the same generation path (the private `respond` module); only the wire format differs:
//! content blocks out, `stop_reason`, and the streamed event sequence (`message_start`,
//! `content_block_start` / `_delta` / `_stop` per block, `message_delta`, `message_stop`).
//! Every body parameter is honoured or refused with a 400 naming it ([`MESSAGES_PARAMS`]);
//! `metadata` and `service_tier` are accepted and ignored. Keys come as `x-api-key`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use crate::openai::tools::{Tool, ToolChoice};
use crate::openai::{self, ApiError, ParsedRequest, Prompt, ResponseFormat, Support};
use crate::respond::{self, Choice, ChoicePiece, Tracker};
use crate::server::Gateway;
use tessera_api::Usage;

/// Messages body parameters.
pub const MESSAGES_PARAMS: &[(&str, Support)] = &[
    ("model", Support::Honoured),
    ("messages", Support::Honoured),
    ("max_tokens", Support::Honoured),
    ("system", Support::Honoured),
    ("stop_sequences", Support::Honoured),
    ("stream", Support::Honoured),
    ("temperature", Support::Honoured),
    ("top_p", Support::Honoured),
    ("top_k", Support::Honoured),
    ("tools", Support::Honoured),
    ("tool_choice", Support::Honoured),
    // Structured outputs: {"type": "json_schema", "schema": {...}}, also as
    // `output_config.format` (the newer place).
    ("output_format", Support::Honoured),
    ("output_config", Support::Honoured),
    // Only {"type": "disabled"}: the served models do not think in separate blocks.
    ("thinking", Support::Honoured),
    ("metadata", Support::Ignored),
    ("service_tier", Support::Ignored),
    // A prompt-caching hint: caching changes no output.
    ("cache_control", Support::Ignored),
    ("container", Support::Refused),
    ("mcp_servers", Support::Refused),
    ("context_management", Support::Refused),
];

/// `count_tokens` body parameters.
const COUNT_PARAMS: &[(&str, Support)] = &[
    ("model", Support::Honoured),
    ("messages", Support::Honoured),
    ("system", Support::Honoured),
    ("tools", Support::Honoured),
    ("tool_choice", Support::Honoured),
    ("thinking", Support::Honoured),
    ("output_format", Support::Honoured),
    ("output_config", Support::Honoured),
    ("cache_control", Support::Ignored),
    ("context_management", Support::Refused),
    ("mcp_servers", Support::Refused),
];

/// An error in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), the
/// parameter named in the message since the shape has no field for it.
struct AnthropicError(ApiError);

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let e = self.0;
        let kind = match e.status {
            400 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        };
        let message = match &e.param {
            Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
            _ => e.message.clone(),
        };
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
        let mut r = (
            status,
            Json(json!({"type": "error", "error": {"type": kind, "message": message}})),
        )
            .into_response();
        if let Some(s) = e.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Text of a `system` value or of `tool_result` content: a string or text blocks.
fn blocks_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (i, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => out.push_str(b["text"].as_str().unwrap_or_default()),
                    other => {
                        return Err(bad(
                            &format!("{param}[{i}]"),
                            format!(
                                "content blocks of type '{}' are not supported here",
                                other.unwrap_or("?")
                            ),
                        ))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(bad(param, "expected a string or a list of content blocks")),
    }
}

/// `messages` (and `system`) as the chat messages the template renders.
fn chat_messages(v: &Value) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(s) = v.get("system").filter(|s| !s.is_null()) {
        out.push(json!({"role": "system", "content": blocks_text(s, "system")?}));
    }
    let msgs = v
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("messages", "messages: field required (a list of messages)"))?;
    if msgs.is_empty() {
        return Err(bad(
            "messages",
            "messages: at least one message is required",
        ));
    }
    for (i, m) in msgs.iter().enumerate() {
        let p = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(bad(
                &format!("{p}.role"),
                format!("{p}.role: '{role}' is not 'user' or 'assistant'"),
            ));
        }
        let blocks = match m.get("content") {
            Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
            Some(Value::Array(b)) => b.clone(),
            _ => {
                return Err(bad(
                    &format!("{p}.content"),
                    "expected a string or content blocks",
                ))
            }
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for (j, b) in blocks.iter().enumerate() {
            let bp = format!("{p}.content[{j}]");
            match (b.get("type").and_then(Value::as_str), role) {
                (Some("text"), _) => text.push_str(b["text"].as_str().unwrap_or_default()),
                (Some("tool_use"), "assistant") => calls.push(json!({
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": b.get("input").unwrap_or(&json!({})).to_string()},
                })),
                (Some("tool_result"), "user") => {
                    let id = b["tool_use_id"].as_str().ok_or_else(|| {
                        bad(&format!("{bp}.tool_use_id"), "tool_result needs tool_use_id")
                    })?;
                    let mut content = blocks_text(b.get("content").unwrap_or(&Value::Null), &format!("{bp}.content"))?;
                    if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                        content = format!("Error: {content}");
                    }
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                (Some("thinking" | "redacted_thinking"), "assistant") => {}
                (other, _) => {
                    return Err(bad(
                        &bp,
                        format!("{bp}: content blocks of type '{}' are not supported in {role} messages", other.unwrap_or("?")),
                    ))
                }
            }
        }
        if role == "assistant" {
            let mut a = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                a["tool_calls"] = calls.into();
            }
            out.push(a);
        } else if !text.is_empty() || !blocks.iter().any(|b| b["type"] == "tool_result") {
            out.push(json!({"role": "user", "content": text}));
        }
    }
    Ok(out)
}

fn tools(v: &Value) -> Result<(Vec<Tool>, ToolChoice, bool), ApiError> {
    let mut tools = Vec::new();
    if let Some(list) = v.get("tools").filter(|t| !t.is_null()) {
        let list = list
            .as_array()
            .ok_or_else(|| bad("tools", "tools: expected a list"))?;
        crate::limits::check_tool_count(list.len())?;
        for (i, t) in list.iter().enumerate() {
            if let Some(kind) = t.get("type").and_then(Value::as_str) {
                if kind != "custom" {
                    return Err(bad(
                        &format!("tools[{i}]"),
                        format!("tools[{i}]: server tools of type '{kind}' are not supported"),
                    ));
                }
            }
            let name = t["name"]
                .as_str()
                .ok_or_else(|| bad(&format!("tools[{i}].name"), "tool name required"))?;
            tools.push(Tool {
                name: name.to_string(),
                description: t["description"].as_str().map(str::to_string),
                parameters: t
                    .get("input_schema")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"})),
            });
        }
    }
    let (choice, parallel) = match v.get("tool_choice").filter(|c| !c.is_null()) {
        None if tools.is_empty() => (ToolChoice::None, true),
        None => (ToolChoice::Auto, true),
        Some(c) => {
            let parallel =
                c.get("disable_parallel_tool_use").and_then(Value::as_bool) != Some(true);
            let choice = match c.get("type").and_then(Value::as_str) {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => {
                    let n = c["name"]
                        .as_str()
                        .ok_or_else(|| bad("tool_choice", "tool_choice.name required"))?;
                    if !tools.iter().any(|t| t.name == n) {
                        return Err(bad(
                            "tool_choice",
                            format!("tool_choice: no tool named '{n}'"),
                        ));
                    }
                    ToolChoice::Named(n.to_string())
                }
                _ => {
                    return Err(bad(
                        "tool_choice",
                        "tool_choice.type must be auto, any, tool or none",
                    ))
                }
            };
            if choice != ToolChoice::None && tools.is_empty() {
                return Err(bad("tool_choice", "tool_choice requires tools"));
            }
            (choice, parallel)
        }
    };
    Ok((tools, choice, parallel))
}

fn check_thinking(v: &Value) -> Result<(), ApiError> {
    match v.get("thinking").filter(|t| !t.is_null()) {
        None => Ok(()),
        Some(t) if t["type"] == "disabled" => Ok(()),
        Some(_) => Err(bad(
            "thinking",
            "thinking: extended thinking is not supported by this server (only {\"type\": \"disabled\"})",
        )),
    }
}

fn output_format(v: &Value) -> Result<ResponseFormat, ApiError> {
    if let Some(c) = v.get("output_config").filter(|c| !c.is_null()) {
        let Some(o) = c.as_object() else {
            return Err(bad("output_config", "output_config: expected an object"));
        };
        if let Some(k) = o.keys().find(|k| *k != "format") {
            return Err(bad(
                "output_config",
                format!("output_config.{k} is not supported by this server"),
            ));
        }
        return output_format(&json!({"output_format": o.get("format")})).map_err(|_| {
            bad(
                "output_config",
                "output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
            )
        });
    }
    match v.get("output_format").filter(|t| !t.is_null()) {
        None => Ok(ResponseFormat::Text),
        Some(f) if f["type"] == "json_schema" && f["schema"].is_object() => {
            Ok(ResponseFormat::JsonSchema {
                name: "output".into(),
                schema: f["schema"].clone(),
            })
        }
        Some(_) => Err(bad(
            "output_format",
            "output_format: expected {\"type\": \"json_schema\", \"schema\": {...}}",
        )),
    }
}

/// Parses a Messages body into the shared request form.
pub fn parse_messages(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let v = openai::parse_value(body)?;
    openai::check_params(&v, MESSAGES_PARAMS)?;
    let model = openai::field::<String>(&v, "model")?
        .ok_or_else(|| bad("model", "model: field required"))?;
    let max = openai::field::<i64>(&v, "max_tokens")?
        .ok_or_else(|| bad("max_tokens", "max_tokens: field required"))?;
    if max < 1 {
        return Err(bad("max_tokens", "max_tokens: must be at least 1"));
    }
    check_thinking(&v)?;
    let messages = chat_messages(&v)?;
    // A conversation ending in an assistant turn is a prefill: the reply continues it.
    let prefill = messages
        .last()
        .is_some_and(|m| m["role"] == "assistant" && m.get("tool_calls").is_none());
    let mut r = ParsedRequest::new(model, Prompt::Chat(messages));
    r.continue_final_message = prefill;
    r.max_tokens = Some(max as usize);
    r.stream = openai::field::<bool>(&v, "stream")?.unwrap_or(false);
    r.temperature = openai::field(&v, "temperature")?.unwrap_or(1.0);
    r.top_p = openai::field(&v, "top_p")?.unwrap_or(1.0);
    if r.top_p == 0.0 {
        return Err(bad("top_p", "top_p: must be above 0"));
    }
    r.top_k = openai::count(&v, "top_k", i64::from(u32::MAX))?.unwrap_or(0);
    r.stop = openai::field::<Vec<String>>(&v, "stop_sequences")?.unwrap_or_default();
    let (tools, choice, parallel) = tools(&v)?;
    r.tools = tools;
    r.tool_choice = choice;
    r.parallel_tool_calls = parallel;
    r.response_format = output_format(&v)?;
    Ok(r)
}

/// Anthropic's `stop_reason` for a choice's end (a stop string is `stop_sequence`, named in
/// the message's `stop_sequence`).
fn stop_reason(finish: &str, stop_sequence: Option<&str>) -> &'static str {
    match finish {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ if stop_sequence.is_some() => "stop_sequence",
        _ => "end_turn",
    }
}

fn tool_use_block(id: &str, name: &str, arguments: &str) -> Value {
    let input: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

/// `toolu_…` ids instead of the OpenAI path's `call_…`.
fn tool_id(id: &str) -> String {
    format!("toolu_{}", id.trim_start_matches("call_"))
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(gw): State<Arc<Gateway>>,
    axum::Extension(client): axum::Extension<tessera_api::ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (seq, suffix) = gw.new_id();
    let id = format!("msg_{suffix}");
    let mut t = Tracker::new(gw.clone(), id.clone(), "/v1/messages", client);
    let reject = |t: &mut Tracker, e: ApiError| {
        t.record(e.status, Usage::default(), None, e.message.clone());
        AnthropicError(e).into_response()
    };
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return reject(&mut t, ApiError::body_rejected(&e));
        }
    };
    let req = match respond::parse_off_thread(&body, parse_messages).await {
        Ok(r) => r,
        Err(e) => return reject(&mut t, e),
    };
    t.stream = req.stream;
    let served = gw.backend.model();
    if req.model != served.id {
        return reject(&mut t, ApiError::model_not_found(&req.model));
    }
    let prepared = match respond::prepare_off_thread(&gw, &req, body.len()).await {
        Ok(p) => p,
        Err(e) => return reject(&mut t, e),
    };
    let max_tokens = req.max_tokens.unwrap_or(1);
    let mut choices = match respond::submit_choices(&gw, &t, seq, &req, &prepared, max_tokens) {
        Ok(c) => c,
        Err(e) => return reject(&mut t, respond::submit_error(e, "messages")),
    };
    t.started = true;
    gw.metrics.request_started();
    let choice = choices.remove(0);
    let n_prompt = prepared.prompt_tokens.len();
    if req.stream {
        stream_message(t, choice, id, served.id.clone(), n_prompt)
    } else {
        whole_message(t, choice, id, served.id.clone()).await
    }
}

async fn whole_message(mut t: Tracker, mut c: Choice, id: String, model: String) -> Response {
    // Blocks in the order they were generated: text, then a call, then text again...
    let mut text = String::new();
    let mut blocks = Vec::new();
    loop {
        match c.next().await {
            Some(ChoicePiece::Content { text: s, .. }) => text.push_str(&s),
            Some(ChoicePiece::ToolCall { id, call, .. }) => {
                if !text.is_empty() {
                    blocks.push(json!({"type": "text", "text": std::mem::take(&mut text)}));
                }
                blocks.push(tool_use_block(&tool_id(&id), &call.name, &call.arguments));
            }
            Some(ChoicePiece::Done {
                finish,
                usage,
                stop_sequence,
                check,
                ..
            }) => {
                t.record(200, usage, c.ttft(), finish.into());
                let mut content = blocks;
                if !text.is_empty() || content.is_empty() {
                    content.push(json!({"type": "text", "text": text}));
                }
                let mut message = json!({
                    "id": id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": content,
                    "stop_reason": stop_reason(finish, stop_sequence.as_deref()),
                    "stop_sequence": stop_sequence,
                    "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
                });
                respond::mark(&mut message, check);
                return respond::with_check_header(Json(message).into_response(), check);
            }
            Some(ChoicePiece::Failed(m)) => {
                let e = ApiError::internal(format!("generation failed: {m}"));
                t.record(500, Usage::default(), None, e.message.clone());
                return AnthropicError(e).into_response();
            }
            None => {
                let e = ApiError::internal("generation ended without a result".into());
                t.record(500, Usage::default(), None, e.message.clone());
                return AnthropicError(e).into_response();
            }
        }
    }
}

fn event(kind: &str, v: Value) -> SseEvent {
    SseEvent::default().event(kind).data(v.to_string())
}

/// The streamed message's state: which block is open.
struct MessageStream {
    t: Tracker,
    c: Choice,
    /// Index of the next block; `Some(kind)` while a block is open.
    next_block: usize,
    open: Option<&'static str>,
    ready: std::collections::VecDeque<SseEvent>,
    done: bool,
}

impl MessageStream {
    fn close_block(&mut self) {
        if self.open.take().is_some() {
            self.ready.push_back(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": self.next_block - 1}),
            ));
        }
    }

    fn open_block(&mut self, kind: &'static str, block: Value) {
        self.close_block();
        self.ready.push_back(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.next_block, "content_block": block}),
        ));
        self.open = Some(kind);
        self.next_block += 1;
    }

    async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            match self.c.next().await {
                Some(ChoicePiece::Content { text, .. }) => {
                    if self.open != Some("text") {
                        self.open_block("text", json!({"type": "text", "text": ""}));
                    }
                    self.ready.push_back(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.next_block - 1,
                               "delta": {"type": "text_delta", "text": text}}),
                    ));
                }
                Some(ChoicePiece::ToolCall { id, call, .. }) => {
                    self.open_block(
                        "tool_use",
                        json!({"type": "tool_use", "id": tool_id(&id), "name": call.name, "input": {}}),
                    );
                    self.ready.push_back(event(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.next_block - 1,
                               "delta": {"type": "input_json_delta", "partial_json": call.arguments}}),
                    ));
                }
                Some(ChoicePiece::Done {
                    finish,
                    usage,
                    stop_sequence,
                    check,
                    ..
                }) => {
                    if self.next_block == 0 {
                        self.open_block("text", json!({"type": "text", "text": ""}));
                    }
                    self.close_block();
                    self.t.record(200, usage, self.c.ttft(), finish.into());
                    let mut delta = json!({"type": "message_delta",
                           "delta": {"stop_reason": stop_reason(finish, stop_sequence.as_deref()),
                                     "stop_sequence": stop_sequence},
                           "usage": {"output_tokens": usage.completion_tokens}});
                    respond::mark(&mut delta, check);
                    self.ready.push_back(event("message_delta", delta));
                    self.ready
                        .push_back(event("message_stop", json!({"type": "message_stop"})));
                    self.done = true;
                }
                Some(ChoicePiece::Failed(m)) => {
                    let e = ApiError::internal(format!("generation failed: {m}"));
                    self.t
                        .record(500, Usage::default(), None, e.message.clone());
                    self.ready.push_back(event(
                        "error",
                        json!({"type": "error", "error": {"type": "api_error", "message": e.message}}),
                    ));
                    self.done = true;
                }
                None => self.done = true,
            }
        }
    }
}

fn stream_message(t: Tracker, c: Choice, id: String, model: String, n_prompt: usize) -> Response {
    let start = event(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": n_prompt, "output_tokens": 0}}}),
    );
    let st = MessageStream {
        t,
        c,
        next_block: 0,
        open: None,
        ready: [start].into(),
        done: false,
    };
    let s = stream::unfold(st, |mut st| async move {
        st.next().await.map(|e| (Ok::<_, Infallible>(e), st))
    });
    respond::sse(s.boxed())
}

/// `POST /v1/messages/count_tokens`.
pub(crate) async fn count_tokens(
    State(gw): State<Arc<Gateway>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => return AnthropicError(ApiError::invalid(e.body_text(), None)).into_response(),
    };
    let len = body.len();
    let counted = respond::off_thread_if_big(len, move || {
        let v = openai::parse_value(&body)?;
        openai::check_params(&v, COUNT_PARAMS)?;
        let model = openai::field::<String>(&v, "model")?
            .ok_or_else(|| bad("model", "model: field required"))?;
        if model != gw.backend.model().id {
            return Err(ApiError::model_not_found(&model));
        }
        check_thinking(&v)?;
        let mut r = ParsedRequest::new(model, Prompt::Chat(chat_messages(&v)?));
        let (tools, choice, parallel) = tools(&v)?;
        r.tools = tools;
        r.tool_choice = choice;
        r.parallel_tool_calls = parallel;
        respond::prompt_tokens(&gw, &r)
    })
    .await;
    match counted {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => AnthropicError(e).into_response(),
    }
}
