//! OpenAI's Responses API (`POST /v1/responses`), stateless: nothing is stored, so
//! `previous_response_id`, `store: true` and `background` are refused; everything else a
//! request carries is honoured or refused by name ([`RESPONSES_PARAMS`]).
//!
//! `input` (a string, or message / `function_call` / `function_call_output` items) and
//! `instructions` become chat messages; flat function `tools`, `tool_choice`,
//! `parallel_tool_calls` and `text.format` (json_object / json_schema) map onto the chat
//! request, which runs through the shared generation path. Output is `message` and `function_call`
//! items; streamed, the documented event sequence (`response.created`, `.in_progress`,
//! `.output_item.added`, `.content_part.added`, `.output_text.delta` ... `.completed`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use crate::openai::tools::{self, Tool, ToolChoice};
use crate::openai::{self, ApiError, ParsedRequest, Prompt, ResponseFormat, Support};
use crate::respond::{self, Choice, ChoicePiece, Tracker};
use crate::server::Gateway;
use tessera_api::Usage;

/// Responses body parameters.
pub const RESPONSES_PARAMS: &[(&str, Support)] = &[
    ("model", Support::Honoured),
    ("input", Support::Honoured),
    ("instructions", Support::Honoured),
    ("max_output_tokens", Support::Honoured),
    ("temperature", Support::Honoured),
    ("top_p", Support::Honoured),
    ("tools", Support::Honoured),
    ("tool_choice", Support::Honoured),
    ("parallel_tool_calls", Support::Honoured),
    ("stream", Support::Honoured),
    ("stream_options", Support::Honoured),
    ("text", Support::Honoured),
    // Only false: nothing is stored.
    ("store", Support::Honoured),
    // "disabled", or "auto": a request that does not fit is refused either way (400), so
    // "auto" never drops input from an answer.
    ("truncation", Support::Honoured),
    // At least 1: calls past it are dropped (1 also asks for one call at a time).
    ("max_tool_calls", Support::Honoured),
    // Only false.
    ("background", Support::Honoured),
    ("user", Support::Ignored),
    ("metadata", Support::Ignored),
    ("safety_identifier", Support::Ignored),
    ("prompt_cache_key", Support::Ignored),
    ("service_tier", Support::Ignored),
    ("previous_response_id", Support::Refused),
    ("conversation", Support::Refused),
    ("include", Support::Refused),
    ("reasoning", Support::Refused),
    ("prompt", Support::Refused),
    ("top_logprobs", Support::Refused),
    ("prompt_cache_retention", Support::Refused),
];

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, Some(param))
}

fn text_of(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut t = String::new();
            for (i, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        t.push_str(p["text"].as_str().unwrap_or_default());
                    }
                    other => {
                        return Err(bad(
                            &format!("{param}[{i}]"),
                            format!(
                                "Content of type '{}' is not supported.",
                                other.unwrap_or("?")
                            ),
                        ))
                    }
                }
            }
            Ok(t)
        }
        _ => Err(bad(param, "Expected a string or a list of content parts.")),
    }
}

/// `instructions` and `input` as chat messages.
fn messages(v: &Value) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = v.get("instructions").and_then(Value::as_str) {
        out.push(json!({"role": "system", "content": i}));
    }
    match v.get("input") {
        None | Some(Value::Null) => {
            return Err(bad("input", "Missing required parameter: 'input'."))
        }
        Some(Value::String(s)) => out.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                let p = format!("input[{i}]");
                match it.get("type").and_then(Value::as_str).unwrap_or("message") {
                    "message" => {
                        let role = it["role"].as_str().unwrap_or_default();
                        let role = match role {
                            "user" | "assistant" | "system" => role,
                            "developer" => "system",
                            _ => {
                                return Err(bad(
                                    &format!("{p}.role"),
                                    format!("Invalid role '{role}'."),
                                ))
                            }
                        };
                        let content = text_of(
                            it.get("content").unwrap_or(&Value::Null),
                            &format!("{p}.content"),
                        )?;
                        out.push(json!({"role": role, "content": content}));
                    }
                    "function_call" => {
                        let call = json!({
                            "id": it["call_id"],
                            "type": "function",
                            "function": {"name": it["name"], "arguments": it["arguments"].as_str().unwrap_or("{}")},
                        });
                        // Consecutive calls belong to one assistant turn.
                        match out.last_mut() {
                            Some(last)
                                if last["role"] == "assistant" && last["tool_calls"].is_array() =>
                            {
                                if let Some(a) = last["tool_calls"].as_array_mut() {
                                    a.push(call);
                                }
                            }
                            _ => out.push(
                                json!({"role": "assistant", "content": "", "tool_calls": [call]}),
                            ),
                        }
                    }
                    "function_call_output" => {
                        let output = match &it["output"] {
                            Value::String(s) => s.clone(),
                            other => text_of(other, &format!("{p}.output"))?,
                        };
                        out.push(json!({"role": "tool", "tool_call_id": it["call_id"], "content": output}));
                    }
                    other => {
                        return Err(bad(
                            &format!("{p}.type"),
                            format!("Input items of type '{other}' are not supported."),
                        ))
                    }
                }
            }
        }
        Some(_) => return Err(bad("input", "Expected a string or a list of input items.")),
    }
    Ok(out)
}

fn parse_tools(v: &Value) -> Result<(Vec<Tool>, ToolChoice), ApiError> {
    // Flat function tools, turned into the chat form and parsed the same way.
    let chat_tools: Option<Value> = match v.get("tools").filter(|t| !t.is_null()) {
        None => None,
        Some(Value::Array(list)) => Some({
            crate::limits::check_tool_count(list.len())?;
            list.iter()
                .map(|t| {
                    if t["type"] == "function" {
                        json!({"type": "function", "function": {
                            "name": t["name"], "description": t["description"], "parameters": t["parameters"]}})
                    } else {
                        t.clone()
                    }
                })
                .collect()
        }),
        Some(_) => return Err(bad("tools", "Invalid type for 'tools'.")),
    };
    let tools = match &chat_tools {
        Some(t) => tools::parse_tools(t)?,
        None => Vec::new(),
    };
    let choice = match v.get("tool_choice") {
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").cloned().unwrap_or(Value::Null);
            tools::parse_tool_choice(
                Some(&json!({"type": "function", "function": {"name": name}})),
                &tools,
            )?
        }
        other => tools::parse_tool_choice(other, &tools)?,
    };
    Ok((tools, choice))
}

fn text_format(v: &Value) -> Result<ResponseFormat, ApiError> {
    let Some(f) = v
        .get("text")
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null())
    else {
        if let Some(t) = v.get("text").filter(|t| !t.is_null()) {
            if let Some(k) = t
                .as_object()
                .and_then(|o| o.keys().find(|k| *k != "format" && *k != "verbosity"))
            {
                return Err(bad("text", format!("Unrecognized argument 'text.{k}'.")));
            }
        }
        return Ok(ResponseFormat::Text);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => Ok(ResponseFormat::JsonObject),
        Some("json_schema") => Ok(ResponseFormat::JsonSchema {
            name: f["name"].as_str().unwrap_or("output").to_string(),
            schema: f.get("schema").cloned().unwrap_or_else(|| json!({})),
        }),
        _ => Err(bad("text", "Invalid 'text.format.type'.")),
    }
}

/// Parses a Responses body into the shared request form.
pub fn parse_responses(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    parse_request(&openai::parse_value(body)?).map(|(r, _)| r)
}

/// What a response object repeats of its request (OpenAI echoes these settings), and the
/// request's `max_tool_calls`.
#[derive(Clone, Debug, Default)]
struct Echo {
    fields: serde_json::Map<String, Value>,
    max_tool_calls: Option<usize>,
}

/// The request fields a response object shows, with OpenAI's values where a request leaves
/// them out.
fn echo_of(v: &Value, r: &ParsedRequest) -> Result<Echo, ApiError> {
    let max_tool_calls = match openai::field::<i64>(v, "max_tool_calls")? {
        None => None,
        Some(n) if n >= 1 => Some(n as usize),
        Some(n) => {
            return Err(bad(
                "max_tool_calls",
                format!("Invalid 'max_tool_calls': {n} is below 1."),
            ))
        }
    };
    let given = |k: &str, default: Value| {
        v.get(k)
            .filter(|x| !x.is_null())
            .cloned()
            .unwrap_or(default)
    };
    let mut fields = serde_json::Map::new();
    fields.insert("tools".into(), given("tools", json!([])));
    fields.insert("tool_choice".into(), given("tool_choice", json!("auto")));
    fields.insert("parallel_tool_calls".into(), r.parallel_tool_calls.into());
    fields.insert(
        "max_tool_calls".into(),
        given("max_tool_calls", Value::Null),
    );
    fields.insert("instructions".into(), given("instructions", Value::Null));
    fields.insert(
        "max_output_tokens".into(),
        given("max_output_tokens", Value::Null),
    );
    fields.insert("temperature".into(), given("temperature", json!(1.0)));
    fields.insert("top_p".into(), given("top_p", json!(1.0)));
    fields.insert("truncation".into(), given("truncation", json!("disabled")));
    fields.insert(
        "text".into(),
        given("text", json!({"format": {"type": "text"}})),
    );
    fields.insert("metadata".into(), given("metadata", json!({})));
    fields.insert("store".into(), false.into());
    Ok(Echo {
        fields,
        max_tool_calls,
    })
}

/// Parses a Responses body (as JSON) into the shared request form and what its response
/// echoes.
fn parse_request(v: &Value) -> Result<(ParsedRequest, Echo), ApiError> {
    openai::check_params(v, RESPONSES_PARAMS)?;
    let model = openai::field::<String>(v, "model")?
        .ok_or_else(|| bad("model", "Missing required parameter: 'model'."))?;
    let mut r = ParsedRequest::new(model, Prompt::Chat(messages(v)?));
    r.stream = openai::field::<bool>(v, "stream")?.unwrap_or(false);
    r.max_tokens = match openai::field::<i64>(v, "max_output_tokens")? {
        None => None,
        Some(m) if m >= 1 => Some(m as usize),
        Some(m) => {
            return Err(bad(
                "max_output_tokens",
                format!("Invalid 'max_output_tokens': {m}."),
            ))
        }
    };
    r.temperature = openai::field(v, "temperature")?.unwrap_or(1.0);
    r.top_p = openai::field(v, "top_p")?.unwrap_or(1.0);
    if r.top_p == 0.0 {
        return Err(bad("top_p", "Invalid 'top_p': must be above 0."));
    }
    let (tools, choice) = parse_tools(v)?;
    r.tools = tools;
    r.tool_choice = choice;
    r.parallel_tool_calls = openai::field::<bool>(v, "parallel_tool_calls")?.unwrap_or(true);
    r.response_format = text_format(v)?;
    if openai::field::<bool>(v, "store")? == Some(true) {
        return Err(bad(
            "store",
            "'store' is not supported: this server is stateless.",
        ));
    }
    if openai::field::<bool>(v, "background")? == Some(true) {
        return Err(bad("background", "'background' is not supported."));
    }
    if let Some(t) = openai::field::<String>(v, "truncation")? {
        if t != "disabled" && t != "auto" {
            return Err(bad(
                "truncation",
                "Invalid 'truncation': expected 'auto' or 'disabled'.",
            ));
        }
    }
    if let Some(o) = v.get("stream_options").filter(|o| !o.is_null()) {
        if !r.stream {
            return Err(bad("stream_options", "'stream_options' needs 'stream'."));
        }
        if o.as_object()
            .is_some_and(|o| o.keys().any(|k| k != "include_obfuscation"))
        {
            return Err(bad(
                "stream_options",
                "Unrecognized 'stream_options' field.",
            ));
        }
    }
    let echo = echo_of(v, &r)?;
    if echo.max_tool_calls == Some(1) {
        r.parallel_tool_calls = false;
    }
    Ok((r, echo))
}

/// The response object (`status` `in_progress` while streaming starts).
#[allow(clippy::too_many_arguments)]
fn response_json(
    echo: &Echo,
    id: &str,
    model: &str,
    created: u64,
    status: &str,
    output: Vec<Value>,
    usage: Option<Usage>,
    incomplete: bool,
) -> Value {
    let mut r = json!({
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": null,
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "usage": usage.map(|u| json!({
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        })),
    });
    if let Some(o) = r.as_object_mut() {
        o.extend(echo.fields.clone());
    }
    r
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": []}])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments, "status": status})
}

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(gw): State<Arc<Gateway>>,
    axum::Extension(client): axum::Extension<tessera_api::ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (seq, suffix) = gw.new_id();
    let id = format!("resp_{suffix}");
    let mut t = Tracker::new(gw.clone(), id.clone(), "/v1/responses", client);
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return t.reject(ApiError::body_rejected(&e));
        }
    };
    let b = body.clone();
    let parsed = crate::respond::off_thread_if_big(body.len(), move || {
        openai::parse_value(&b).and_then(|v| parse_request(&v))
    })
    .await;
    let (req, echo) = match parsed {
        Ok(r) => r,
        Err(e) => return t.reject(e),
    };
    t.stream = req.stream;
    let served = gw.backend.model();
    if req.model != served.id {
        return t.reject(ApiError::model_not_found(&req.model));
    }
    let prepared = match respond::prepare_off_thread(&gw, &req, body.len()).await {
        Ok(p) => p,
        Err(e) => return t.reject(e),
    };
    let n_prompt = prepared.prompt_tokens.len();
    let max_tokens = req
        .max_tokens
        .unwrap_or_else(|| served.context_length.saturating_sub(n_prompt).max(1));
    let mut choices = match respond::submit_choices(&gw, &t, seq, &req, &prepared, max_tokens) {
        Ok(c) => c,
        Err(e) => return t.reject(respond::submit_error(e, "input")),
    };
    t.started = true;
    gw.metrics.request_started();
    let st = ResponseStream {
        t,
        c: choices.remove(0),
        echo,
        calls: 0,
        id,
        model: served.id.clone(),
        created: tessera_api::unix_now(),
        output: Vec::new(),
        text: String::new(),
        text_item: None,
        seq: 0,
        ready: VecDeque::new(),
        done: false,
        events: req.stream,
    };
    if req.stream {
        let s = stream::unfold(st, |mut st| async move {
            st.next().await.map(|e| (Ok::<_, Infallible>(e), st))
        });
        respond::sse(s.boxed())
    } else {
        st.whole().await
    }
}

/// A response being generated: its items so far, and (streamed) the events to send.
struct ResponseStream {
    t: Tracker,
    c: Choice,
    echo: Echo,
    /// Tool calls reported so far (those past `max_tool_calls` are dropped).
    calls: usize,
    id: String,
    model: String,
    created: u64,
    /// Finished output items.
    output: Vec<Value>,
    /// The open message item's text and (id, output index).
    text: String,
    text_item: Option<(String, usize)>,
    seq: u64,
    ready: VecDeque<SseEvent>,
    done: bool,
    /// Streaming: queue events (a whole response only collects items).
    events: bool,
}

impl ResponseStream {
    fn emit(&mut self, kind: &str, mut v: Value) {
        if !self.events {
            return;
        }
        v["type"] = kind.into();
        v["sequence_number"] = self.seq.into();
        self.seq += 1;
        self.ready
            .push_back(SseEvent::default().event(kind).data(v.to_string()));
    }

    fn close_text(&mut self) {
        let Some((item, index)) = self.text_item.take() else {
            return;
        };
        let text = std::mem::take(&mut self.text);
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        self.emit(
            "response.output_text.done",
            json!({"item_id": item, "output_index": index, "content_index": 0, "text": text}),
        );
        self.emit(
            "response.content_part.done",
            json!({"item_id": item, "output_index": index, "content_index": 0, "part": part}),
        );
        let done = message_item(&item, &text, "completed");
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        self.output.push(done);
    }

    fn handle(&mut self, piece: ChoicePiece) {
        match piece {
            ChoicePiece::Content { text, .. } => {
                if self.text_item.is_none() {
                    let item = format!("msg_{}_{}", &self.id[5..], self.output.len());
                    let index = self.output.len();
                    self.emit("response.output_item.added", json!({"output_index": index, "item": message_item(&item, "", "in_progress")}));
                    self.emit(
                        "response.content_part.added",
                        json!({"item_id": item, "output_index": index, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}}),
                    );
                    self.text_item = Some((item, index));
                }
                if let Some((item, index)) = self.text_item.clone() {
                    self.emit("response.output_text.delta", json!({"item_id": item, "output_index": index, "content_index": 0, "delta": text}));
                }
                self.text.push_str(&text);
            }
            ChoicePiece::ToolCall { id, call, .. } => {
                if self.echo.max_tool_calls.is_some_and(|m| self.calls >= m) {
                    return;
                }
                self.calls += 1;
                self.close_text();
                let index = self.output.len();
                let item = format!("fc_{}", id.trim_start_matches("call_"));
                self.emit("response.output_item.added", json!({"output_index": index, "item": call_item(&item, &id, &call.name, "", "in_progress")}));
                self.emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": item, "output_index": index, "delta": call.arguments}),
                );
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": item, "output_index": index, "arguments": call.arguments}),
                );
                let done = call_item(&item, &id, &call.name, &call.arguments, "completed");
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": done}),
                );
                self.output.push(done);
            }
            ChoicePiece::Done {
                finish,
                usage,
                check,
                ..
            } => {
                self.close_text();
                let incomplete = finish == "length";
                let status = if incomplete {
                    "incomplete"
                } else {
                    "completed"
                };
                self.t.record(200, usage, self.c.ttft(), finish.into());
                let mut r = response_json(
                    &self.echo,
                    &self.id,
                    &self.model,
                    self.created,
                    status,
                    self.output.clone(),
                    Some(usage),
                    incomplete,
                );
                crate::respond::mark(&mut r, check);
                let kind = if incomplete {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                self.emit(kind, json!({"response": r}));
                self.done = true;
            }
            ChoicePiece::Failed(m) => {
                let e = ApiError::internal(format!("generation failed: {m}"));
                self.t
                    .record(500, Usage::default(), None, e.message.clone());
                let mut r = response_json(
                    &self.echo,
                    &self.id,
                    &self.model,
                    self.created,
                    "failed",
                    self.output.clone(),
                    None,
                    false,
                );
                r["error"] = json!({"code": "server_error", "message": e.message});
                self.emit("response.failed", json!({"response": r}));
                self.done = true;
            }
        }
    }

    async fn next(&mut self) -> Option<SseEvent> {
        if self.seq == 0 {
            let r = response_json(
                &self.echo,
                &self.id,
                &self.model,
                self.created,
                "in_progress",
                Vec::new(),
                None,
                false,
            );
            self.emit("response.created", json!({"response": r.clone()}));
            self.emit("response.in_progress", json!({"response": r}));
        }
        loop {
            if let Some(e) = self.ready.pop_front() {
                return Some(e);
            }
            if self.done {
                return None;
            }
            match self.c.next().await {
                Some(p) => self.handle(p),
                None => self.done = true,
            }
        }
    }

    async fn whole(mut self) -> Response {
        let mut last = None;
        while let Some(p) = self.c.next().await {
            let end = matches!(p, ChoicePiece::Done { .. } | ChoicePiece::Failed(_));
            if let ChoicePiece::Failed(m) = &p {
                return self
                    .t
                    .reject(ApiError::internal(format!("generation failed: {m}")));
            }
            if let ChoicePiece::Done {
                finish,
                usage,
                check,
                ..
            } = &p
            {
                last = Some((*finish, *usage, *check));
            }
            self.handle(p);
            if end {
                break;
            }
        }
        let Some((finish, usage, check)) = last else {
            return self.t.reject(ApiError::internal(
                "generation ended without a result".into(),
            ));
        };
        let incomplete = finish == "length";
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        let mut r = response_json(
            &self.echo,
            &self.id,
            &self.model,
            self.created,
            status,
            self.output.clone(),
            Some(usage),
            incomplete,
        );
        crate::respond::mark(&mut r, check);
        crate::respond::with_check_header(Json(r).into_response(), check)
    }
}
