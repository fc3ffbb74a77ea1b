//! Ollama's `POST /api/embed` and its older `POST /api/embeddings`, over the same inputs,
//! limits and backend call as `/v1/embeddings` ([`crate::embeddings`]).
//!
//! - `/api/embed` takes `input` (a string or a list of strings) and answers `embeddings`, one
//!   unit vector per input, as Ollama does. `truncate` (default true) cuts an input longer
//!   than the context to fit; false refuses it with a 400.
//! - `/api/embeddings` takes one `prompt` and answers one `embedding`, not normalized, as
//!   Ollama's does (an empty prompt answers an empty vector: it only loads the model).
//!
//! `keep_alive` and the `options` that tune loading or threads are accepted (they change no
//! output); any other option, sampling ones included, is refused naming it, since nothing is
//! sampled. `dimensions` is refused (the vectors have the model's width).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use serde::Serialize;
use serde_json::Value;

use super::{names_served, not_found, tagged, OllamaError};
use crate::embeddings::EmbedInputs;
use crate::embeddings::{compute, json_response, l2_normalize, parse_inputs, tokenize};
use crate::openai::{self, ApiError};
use crate::respond::{off_thread_if_big, Tracker};
use tessera_api::ClientId;
use tessera_api::Usage;

const EMBED_FIELDS: &[&str] = &[
    "model",
    "input",
    "truncate",
    "options",
    "keep_alive",
    "dimensions",
];
const EMBEDDINGS_FIELDS: &[&str] = &["model", "prompt", "options", "keep_alive"];

fn bad(param: &str, message: impl Into<String>) -> ApiError {
    ApiError::invalid(message, Some(param))
}

/// Checks the fields and the model; the served model's tagged name.
fn common(gw: &super::Gateway, v: &Value, fields: &[&str]) -> Result<String, ApiError> {
    if let Some(o) = v.as_object() {
        if let Some(k) = o.keys().find(|k| !fields.contains(&k.as_str())) {
            return Err(bad(k, format!("unknown field '{k}'")));
        }
    }
    if !matches!(v.get("dimensions"), None | Some(Value::Null)) {
        return Err(bad(
            "dimensions",
            "dimensions is not supported: the vectors have the model's own width",
        ));
    }
    let _ = openai::field::<Value>(v, "keep_alive")?;
    if let Some(options) = v.get("options").filter(|o| !o.is_null()) {
        let Some(o) = options.as_object() else {
            return Err(bad("options", "options must be an object"));
        };
        if let Some(k) = o
            .keys()
            .find(|k| !super::request::RUNTIME_OPTIONS.contains(&k.as_str()))
        {
            return Err(bad(
                "options",
                format!("option '{k}' does not apply to embeddings (nothing is sampled)"),
            ));
        }
    }
    let model =
        openai::field::<String>(v, "model")?.ok_or_else(|| bad("model", "model is required"))?;
    let served = gw.backend.model();
    if !names_served(&model, &served.id) {
        return Err(not_found(&model));
    }
    Ok(tagged(&served.id))
}

/// The tokenized inputs of `/api/embed` or `/api/embeddings` (`legacy`).
fn parse(gw: &super::Gateway, body: &[u8], legacy: bool) -> Result<Parsed, ApiError> {
    let v = openai::parse_value(body)?;
    let fields = if legacy {
        EMBEDDINGS_FIELDS
    } else {
        EMBED_FIELDS
    };
    let model = common(gw, &v, fields)?;
    let m = gw.backend.model();
    let inputs = if legacy {
        match openai::field::<String>(&v, "prompt")? {
            None => return Err(bad("prompt", "prompt is required")),
            Some(p) if p.is_empty() => Vec::new(),
            Some(p) => tokenize(&m, EmbedInputs::Texts(vec![p]), true, "prompt")?,
        }
    } else {
        let truncate = openai::field::<bool>(&v, "truncate")?.unwrap_or(true);
        let inputs = parse_inputs(v.get("input"), "input", false)?;
        tokenize(&m, inputs, truncate, "input")?
    };
    Ok(Parsed { model, inputs })
}

struct Parsed {
    model: String,
    inputs: Vec<Vec<u32>>,
}

#[derive(Serialize)]
struct EmbedAnswer {
    model: String,
    embeddings: Vec<Vec<f32>>,
    total_duration: u64,
    load_duration: u64,
    prompt_eval_count: usize,
}

#[derive(Serialize)]
struct EmbeddingsAnswer {
    embedding: Vec<f32>,
}

/// Parses, runs and records one request; the vectors (not normalized) and the model name.
async fn run(
    gw: &Arc<super::Gateway>,
    client: ClientId,
    path: &'static str,
    body: Result<Bytes, BytesRejection>,
    legacy: bool,
) -> Result<(String, Vec<Vec<f32>>, usize), Response> {
    let (seq, suffix) = gw.new_id();
    let mut t = Tracker::new(gw.clone(), format!("embd-{suffix}"), path, client);
    let reject = |t: &mut Tracker, e: ApiError| {
        t.record(e.status, Usage::default(), None, e.message.clone());
        OllamaError(e).into_response()
    };
    let body = body.map_err(|e| reject(&mut t, ApiError::body_rejected(&e)))?;
    let (g, b) = (gw.clone(), body.clone());
    let parsed = off_thread_if_big(body.len(), move || parse(&g, &b, legacy))
        .await
        .map_err(|e| reject(&mut t, e))?;
    if parsed.inputs.is_empty() {
        t.record(200, Usage::default(), None, "loaded".into());
        return Ok((parsed.model, Vec::new(), 0));
    }
    let out = compute(gw, &t.client, seq, parsed.inputs)
        .await
        .map_err(|e| reject(&mut t, e))?;
    let usage = Usage {
        prompt_tokens: out.prompt_tokens,
        ..Usage::default()
    };
    t.record(
        200,
        usage,
        None,
        format!("{} embeddings", out.vectors.len()),
    );
    Ok((parsed.model, out.vectors, out.prompt_tokens))
}

/// `POST /api/embed`.
pub(super) async fn embed(
    State(gw): State<Arc<super::Gateway>>,
    Extension(client): Extension<ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let started = Instant::now();
    match run(&gw, client, "/api/embed", body, false).await {
        Ok((model, mut vectors, prompt_tokens)) => {
            for v in &mut vectors {
                l2_normalize(v);
            }
            json_response(&EmbedAnswer {
                model,
                embeddings: vectors,
                total_duration: started.elapsed().as_nanos() as u64,
                load_duration: 0,
                prompt_eval_count: prompt_tokens,
            })
        }
        Err(r) => r,
    }
}

/// `POST /api/embeddings` (Ollama's older endpoint: one prompt, not normalized).
pub(super) async fn embeddings(
    State(gw): State<Arc<super::Gateway>>,
    Extension(client): Extension<ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match run(&gw, client, "/api/embeddings", body, true).await {
        Ok((_, vectors, _)) => json_response(&EmbeddingsAnswer {
            embedding: vectors.into_iter().next().unwrap_or_default(),
        }),
        Err(r) => r,
    }
}
