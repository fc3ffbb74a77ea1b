//! `POST /tokenize` and `POST /detokenize` as llama-server has them: text to the model's token
//! ids (optionally with each token's text) and back.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::limits::LIMITS;
use crate::openai::{self, ApiError, Support};
use crate::server::Gateway;

const TOKENIZE_PARAMS: &[(&str, Support)] = &[
    ("content", Support::Honoured),
    ("add_special", Support::Honoured),
    ("parse_special", Support::Honoured),
    ("with_pieces", Support::Honoured),
    ("model", Support::Honoured),
];

const DETOKENIZE_PARAMS: &[(&str, Support)] =
    &[("tokens", Support::Honoured), ("model", Support::Honoured)];

fn body_value(
    body: Result<Bytes, BytesRejection>,
    table: &[(&str, Support)],
) -> Result<Value, ApiError> {
    let body = body.map_err(|e| ApiError::invalid(e.body_text(), None))?;
    let v = openai::parse_value(&body)?;
    openai::check_params(&v, table)?;
    Ok(v)
}

fn check_model(gw: &Gateway, v: &Value) -> Result<(), ApiError> {
    match openai::field::<String>(v, "model")? {
        Some(m) if m != gw.backend.model().id => Err(ApiError::model_not_found(&m)),
        _ => Ok(()),
    }
}

/// `{"content", "add_special"?, "parse_special"?, "with_pieces"?}` → `{"tokens": [...]}`
/// (with `with_pieces`: `[{"id", "piece"}]`, the piece a string, or its bytes when they are
/// not UTF-8 on their own).
pub(crate) async fn tokenize(
    State(gw): State<Arc<Gateway>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let len = body.as_ref().map_or(0, Bytes::len);
    let run = move || -> Result<Value, ApiError> {
        let v = body_value(body, TOKENIZE_PARAMS)?;
        check_model(&gw, &v)?;
        let content = openai::field::<String>(&v, "content")?.ok_or_else(|| {
            ApiError::invalid("Missing required parameter: 'content'.", Some("content"))
        })?;
        let max = LIMITS.max_tokenize_bytes;
        if content.len() > max {
            return Err(crate::limits::over("content", "bytes", content.len(), max));
        }
        let add_special = openai::field::<bool>(&v, "add_special")?.unwrap_or(false);
        let parse_special = openai::field::<bool>(&v, "parse_special")?.unwrap_or(true);
        let with_pieces = openai::field::<bool>(&v, "with_pieces")?.unwrap_or(false);
        let m = gw.backend.model();
        let ids = if parse_special {
            m.tokenizer.encode_with_specials(&content, add_special)
        } else {
            m.tokenizer.encode(&content, add_special)
        };
        let tokens: Vec<Value> = if with_pieces {
            ids.iter()
                .map(|&id| {
                    let bytes = m.tokenizer.piece_bytes(id);
                    let piece = match std::str::from_utf8(bytes) {
                        Ok(s) => json!(s),
                        Err(_) => json!(bytes),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect()
        } else {
            ids.iter().map(|&id| json!(id)).collect()
        };
        Ok(json!({"tokens": tokens}))
    };
    match crate::respond::off_thread_if_big(len, run).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `{"tokens": [...]}` → `{"content": "..."}`.
pub(crate) async fn detokenize(
    State(gw): State<Arc<Gateway>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let len = body.as_ref().map_or(0, Bytes::len);
    let run = move || -> Result<Value, ApiError> {
        let v = body_value(body, DETOKENIZE_PARAMS)?;
        check_model(&gw, &v)?;
        let ids = openai::field::<Vec<u32>>(&v, "tokens")?.ok_or_else(|| {
            ApiError::invalid("Missing required parameter: 'tokens'.", Some("tokens"))
        })?;
        let m = gw.backend.model();
        let vocab = m.tokenizer.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(
                format!("Token id {bad} is outside the vocabulary of {vocab}."),
                Some("tokens"),
            ));
        }
        Ok(json!({"content": m.tokenizer.decode(&ids)}))
    };
    match crate::respond::off_thread_if_big(len, run).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
