//! The responses and stream chunks we send, in OpenAI's shapes: whole chat and completion
//! bodies, SSE chunks (role, content, tool-call and final deltas), and the usage object.

use serde::Serialize;
use serde_json::{json, Value};

use super::tools::ToolCall;
use tessera_api::Usage;

/// `usage` as OpenAI writes it.
pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
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

/// One choice of a whole (non-streamed) response.
#[derive(Clone, Debug, Default)]
pub struct ChoiceOut {
    pub index: usize,
    pub text: String,
    /// `(id, call)` in order.
    pub tool_calls: Vec<(String, ToolCall)>,
    /// `Some` when the request asked for log-probabilities.
    pub logprobs: Option<Value>,
    /// `stop`, `length` or `tool_calls`.
    pub finish: &'static str,
    /// Marked on the choice as `verified` ([`crate::respond::mark`]).
    pub check: Option<tessera_api::Check>,
}

/// The JSON of one tool call (`index` for stream deltas).
pub fn tool_call_json(id: &str, call: &ToolCall, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if let Some(i) = index {
        v["index"] = i.into();
    }
    v
}

fn object(m: &ResponseMeta, chunk: bool) -> &'static str {
    match (m.endpoint, chunk) {
        (Endpoint::Chat, false) => "chat.completion",
        (Endpoint::Chat, true) => "chat.completion.chunk",
        (Endpoint::Completion, _) => "text_completion",
    }
}

/// The whole (non-streamed) response.
pub fn full_response(m: &ResponseMeta, choices: &[ChoiceOut], usage: Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .map(|c| match m.endpoint {
            Endpoint::Chat => {
                let mut message = json!({
                    "role": "assistant",
                    "content": if c.text.is_empty() && !c.tool_calls.is_empty() {
                        Value::Null
                    } else {
                        c.text.clone().into()
                    },
                    "refusal": null,
                });
                if !c.tool_calls.is_empty() {
                    message["tool_calls"] = c
                        .tool_calls
                        .iter()
                        .map(|(id, call)| tool_call_json(id, call, None))
                        .collect();
                }
                json!({
                    "index": c.index,
                    "message": message,
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish,
                })
            }
            Endpoint::Completion => json!({
                "index": c.index,
                "text": c.text,
                "logprobs": c.logprobs,
                "finish_reason": c.finish,
            }),
        })
        .zip(choices)
        .map(|(mut v, c)| {
            crate::respond::mark(&mut v, c.check);
            v
        })
        .collect();
    json!({
        "id": m.id,
        "object": object(m, false),
        "created": m.created,
        "model": m.model,
        "system_fingerprint": null,
        "choices": choices,
        "usage": usage_json(usage),
    })
}

/// What one streamed chunk carries for its choice.
#[derive(Clone, Debug)]
pub enum Delta<'a> {
    /// Chat streams open each choice with the role.
    Role,
    Content(&'a str),
    /// One complete call: `(index among the choice's calls, id, call)`.
    ToolCall(usize, &'a str, &'a ToolCall),
    /// The closing chunk (empty delta) with the finish reason.
    Finish(&'a str),
}

/// One streamed chunk for choice `index`.
pub fn chunk(m: &ResponseMeta, index: usize, delta: Delta<'_>, logprobs: Option<Value>) -> Value {
    let finish = match delta {
        Delta::Finish(f) => Some(f),
        _ => None,
    };
    let choice = match m.endpoint {
        Endpoint::Chat => {
            let d = match delta {
                Delta::Role => json!({"role": "assistant", "content": ""}),
                Delta::Content(t) => json!({"content": t}),
                Delta::ToolCall(i, id, call) => {
                    json!({"tool_calls": [tool_call_json(id, call, Some(i))]})
                }
                Delta::Finish(_) => json!({}),
            };
            json!({"index": index, "delta": d, "logprobs": logprobs, "finish_reason": finish})
        }
        Endpoint::Completion => {
            let text = match delta {
                Delta::Content(t) => t,
                _ => "",
            };
            json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})
        }
    };
    json!({
        "id": m.id,
        "object": object(m, true),
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
        "object": object(m, true),
        "created": m.created,
        "model": m.model,
        "system_fingerprint": null,
        "choices": [],
        "usage": usage_json(usage),
    })
}
