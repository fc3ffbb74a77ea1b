//! Running `/api/chat` and `/api/generate`, and writing their answers in Ollama's shape: one
//! JSON object, or NDJSON lines (each a piece of text or a tool call with `done: false`, the
//! last with `done: true`, `done_reason` and the counts and durations in nanoseconds).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};

use super::request::{parse_chat, parse_generate, OllamaRequest};
use super::{names_served, not_found, now_rfc3339, OllamaError};
use crate::openai::tools::ToolCall;
use crate::openai::ApiError;
use crate::respond::{self, Choice, ChoicePiece, Tracker};
use crate::server::Gateway;
use tessera_api::ClientId;
use tessera_api::Usage;

/// Which endpoint: the answer is `message` (chat) or `response` (generate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Generate,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Self::Chat => "/api/chat",
            Self::Generate => "/api/generate",
        }
    }
}

/// `POST /api/chat`.
pub(crate) async fn chat(
    State(gw): State<Arc<Gateway>>,
    Extension(client): Extension<ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    run(gw, client, body, Kind::Chat).await
}

/// `POST /api/generate`.
pub(crate) async fn generate(
    State(gw): State<Arc<Gateway>>,
    Extension(client): Extension<ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    run(gw, client, body, Kind::Generate).await
}

fn reject(t: &mut Tracker, e: ApiError) -> Response {
    t.record(e.status, Usage::default(), None, e.message.clone());
    OllamaError(e).into_response()
}

async fn run(
    gw: Arc<Gateway>,
    client: ClientId,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Response {
    let (seq, suffix) = gw.new_id();
    let mut t = Tracker::new(gw.clone(), format!("ollama-{suffix}"), kind.path(), client);
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return reject(&mut t, ApiError::body_rejected(&e));
        }
    };
    let parse = match kind {
        Kind::Chat => parse_chat,
        Kind::Generate => parse_generate,
    };
    let b = body.clone();
    let parsed = respond::off_thread_if_big(body.len(), move || parse(&b)).await;
    let OllamaRequest { req, load_only } = match parsed {
        Ok(r) => r,
        Err(e) => return reject(&mut t, e),
    };
    t.stream = req.stream;
    let served = gw.backend.model();
    if !names_served(&req.model, &served.id) {
        return reject(&mut t, not_found(&req.model));
    }
    let answer = Answer {
        kind,
        model: req.model.clone(),
    };
    if load_only {
        // Ollama's way of asking for a model to be loaded: it always is.
        t.record(200, Usage::default(), None, "load".into());
        let mut v = answer.line("", &[]);
        v["done"] = true.into();
        v["done_reason"] = "load".into();
        return Json(v).into_response();
    }
    // The limits table (stop strings, tools, …) is applied in `prepare`, as on every front end.
    let prepared = match respond::prepare_off_thread(&gw, &req, body.len()).await {
        Ok(p) => p,
        Err(e) => return reject(&mut t, e),
    };
    let n_prompt = prepared.prompt_tokens.len();
    let max_tokens = req
        .max_tokens
        .unwrap_or_else(|| served.context_length.saturating_sub(n_prompt).max(1));
    let mut choices = match respond::submit_choices(&gw, &t, seq, &req, &prepared, max_tokens) {
        Ok(c) => c,
        Err(e) => {
            let param = match kind {
                Kind::Chat => "messages",
                Kind::Generate => "prompt",
            };
            return reject(&mut t, respond::submit_error(e, param));
        }
    };
    t.started = true;
    gw.metrics.request_started();
    let choice = choices.remove(0);
    if req.stream {
        stream_answer(t, choice, answer)
    } else {
        whole_answer(t, choice, answer).await
    }
}

/// What every line of an answer repeats.
struct Answer {
    kind: Kind,
    /// The name the client asked for (Ollama echoes it, tag and all).
    model: String,
}

/// A tool call as Ollama writes it: the arguments as an object (an empty one when a call cut
/// short left them incomplete).
fn tool_call_json(call: &ToolCall) -> Value {
    let arguments = serde_json::from_str::<Value>(&call.arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    json!({"function": {"name": call.name, "arguments": arguments}})
}

impl Answer {
    /// A line carrying `text` (and `calls`) that is not the last.
    fn line(&self, text: &str, calls: &[Value]) -> Value {
        let mut v = json!({"model": self.model, "created_at": now_rfc3339()});
        match self.kind {
            Kind::Chat => {
                let mut m = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    m["tool_calls"] = calls.into();
                }
                v["message"] = m;
            }
            Kind::Generate => v["response"] = text.into(),
        }
        v["done"] = false.into();
        v
    }

    /// The last line (or the whole answer), with why it ended and the counts.
    fn last(&self, t: &Tracker, ttft: Option<Duration>, finish: &str, usage: Usage) -> Value {
        let mut v = json!({"done": true});
        // A reply that ended in tool calls ended as Ollama's do: "stop".
        v["done_reason"] = if finish == "length" { "length" } else { "stop" }.into();
        let total = t.arrived.elapsed();
        let first = ttft.unwrap_or(total).min(total);
        v["total_duration"] = (total.as_nanos() as u64).into();
        v["load_duration"] = 0.into();
        v["prompt_eval_count"] = usage.prompt_tokens.into();
        v["prompt_eval_duration"] = (first.as_nanos() as u64).into();
        v["eval_count"] = usage.completion_tokens.into();
        v["eval_duration"] = ((total - first).as_nanos() as u64).into();
        v
    }
}

/// Merges `extra`'s fields into `v`.
fn merged(mut v: Value, extra: Value) -> Value {
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v
}

async fn whole_answer(mut t: Tracker, mut c: Choice, answer: Answer) -> Response {
    let mut text = String::new();
    let mut calls = Vec::new();
    loop {
        match c.next().await {
            Some(ChoicePiece::Content { text: s, .. }) => text.push_str(&s),
            Some(ChoicePiece::ToolCall { call, .. }) => calls.push(tool_call_json(&call)),
            Some(ChoicePiece::Done {
                finish,
                usage,
                check,
                ..
            }) => {
                t.record(200, usage, c.ttft(), finish.into());
                let last = answer.last(&t, c.ttft(), finish, usage);
                let mut whole = merged(answer.line(&text, &calls), last);
                crate::respond::mark(&mut whole, check);
                return crate::respond::with_check_header(Json(whole).into_response(), check);
            }
            Some(ChoicePiece::Failed(m)) => {
                return reject(
                    &mut t,
                    ApiError::internal(format!("generation failed: {m}")),
                )
            }
            None => {
                return reject(
                    &mut t,
                    ApiError::internal("generation ended without a result".into()),
                )
            }
        }
    }
}

/// A streamed answer: the choice's pieces as lines.
struct LineStream {
    t: Tracker,
    c: Choice,
    answer: Answer,
    done: bool,
}

impl LineStream {
    async fn next_line(&mut self) -> Option<Value> {
        if self.done {
            return None;
        }
        let line = match self.c.next().await {
            Some(ChoicePiece::Content { text, .. }) => self.answer.line(&text, &[]),
            Some(ChoicePiece::ToolCall { call, .. }) => {
                self.answer.line("", &[tool_call_json(&call)])
            }
            Some(ChoicePiece::Done {
                finish,
                usage,
                check,
                ..
            }) => {
                self.done = true;
                self.t.record(200, usage, self.c.ttft(), finish.into());
                let last = self.answer.last(&self.t, self.c.ttft(), finish, usage);
                let mut line = merged(self.answer.line("", &[]), last);
                crate::respond::mark(&mut line, check);
                line
            }
            Some(ChoicePiece::Failed(m)) => {
                self.done = true;
                let message = format!("generation failed: {m}");
                self.t.record(500, Usage::default(), None, message.clone());
                json!({ "error": message })
            }
            None => {
                self.done = true;
                return None;
            }
        };
        Some(line)
    }
}

fn stream_answer(t: Tracker, c: Choice, answer: Answer) -> Response {
    let st = LineStream {
        t,
        c,
        answer,
        done: false,
    };
    let lines = stream::unfold(st, |mut st| async move {
        let v = st.next_line().await?;
        let mut bytes = serde_json::to_vec(&v).unwrap_or_default();
        bytes.push(b'\n');
        Some((Ok::<_, Infallible>(Bytes::from(bytes)), st))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines.boxed()),
    )
        .into_response()
}
