//! Ollama's API beside OpenAI's and Anthropic's, so tools written for Ollama (Open WebUI,
//! editor plugins, home automation, the `ollama` Python and JS clients) can use the served
//! model.
//!
//! - `POST /api/chat` and `POST /api/generate`: parsed ([`request`]) into the same
//!   [`ParsedRequest`](crate::openai::ParsedRequest) the OpenAI endpoints build and run through
//!   the same generation path, over whatever [`Backend`](tessera_api::Backend) serves (one process or
//!   the cluster). `format` (`"json"` or a JSON schema) compiles to the grammar
//!   `response_format` does, `tools` read calls out of the text as on `/v1/chat/completions`,
//!   `options` map onto the sampling parameters, `keep_alive` is accepted (the model stays
//!   loaded). Answers stream as NDJSON (one JSON object a line, the last with `done: true` and
//!   the counts) unless `stream` is false ([`reply`]).
//! - `GET /api/tags`, `POST /api/show`, `GET /api/ps`, `GET /api/version`: the served model
//!   and this server, in Ollama's shapes.
//! - `POST /api/embed` and `/api/embeddings`: sequence embeddings (`embed.rs`), where the
//!   backend computes them (one process; a cluster answers 501). `POST /api/pull` of the
//!   served model says it is there; any other model is a 501 (models are chosen when the
//!   server starts).
//!
//! Errors are Ollama's `{"error": "..."}` with the HTTP status; the served model answers to its
//! name with or without the `:latest` tag.

mod embed;
mod reply;
pub mod request;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::openai::{self, ApiError};
use crate::server::{clip, Gateway, MAX_ECHO_BYTES};

/// The version `/api/version` reports: Tessera's own.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The routes, to merge under the API-key guard.
pub fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/api/chat", post(reply::chat))
        .route("/api/generate", post(reply::generate))
        .route("/api/tags", get(tags))
        .route("/api/show", post(show))
        .route("/api/ps", get(ps))
        .route("/api/version", get(version))
        .route("/api/embed", post(embed::embed))
        .route("/api/embeddings", post(embed::embeddings))
        .route("/api/pull", post(pull))
}

/// An error in Ollama's shape: `{"error": "..."}` with the status (the parameter named in the
/// message, as the shape has no field for it).
pub(crate) struct OllamaError(pub ApiError);

impl IntoResponse for OllamaError {
    fn into_response(self) -> Response {
        let e = self.0;
        let mut message = match &e.param {
            Some(p) if !e.message.contains(p.as_str()) => format!("{p}: {}", e.message),
            _ => e.message.clone(),
        };
        if message.len() > MAX_ECHO_BYTES {
            message = clip(&message, MAX_ECHO_BYTES).into_owned();
        }
        let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
        let mut r = (status, Json(json!({ "error": message }))).into_response();
        if let Some(s) = e.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

/// Whether a client's model name means the served model (`NAME` or `NAME:latest`).
pub(crate) fn names_served(asked: &str, served: &str) -> bool {
    asked == served || asked.strip_suffix(":latest") == Some(served)
}

/// The served model's name as Ollama lists it: with a tag.
fn tagged(served: &str) -> String {
    if served.contains(':') {
        served.to_string()
    } else {
        format!("{served}:latest")
    }
}

/// Unix seconds (and nanoseconds) as RFC 3339 in UTC, as Ollama writes `created_at`.
pub(crate) fn rfc3339(secs: u64, nanos: u32) -> String {
    // Days since 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{nanos:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Now, as [`rfc3339`].
pub(crate) fn now_rfc3339() -> String {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    rfc3339(d.as_secs(), d.subsec_nanos())
}

/// What Ollama's `details` says; the architecture and sizes are not known to the gateway,
/// so only the format is given.
fn details() -> Value {
    json!({"parent_model": "", "format": "gguf", "family": "", "families": null,
           "parameter_size": "", "quantization_level": ""})
}

fn model_entry(gw: &Gateway) -> Value {
    let m = gw.backend.model();
    let name = tagged(&m.id);
    json!({
        "name": name,
        "model": name,
        "modified_at": rfc3339(m.created, 0),
        "details": details(),
    })
}

/// `GET /api/tags`: the served model.
async fn tags(State(gw): State<Arc<Gateway>>) -> Response {
    Json(json!({ "models": [model_entry(&gw)] })).into_response()
}

/// `GET /api/ps`: the served model, loaded for as long as the server runs.
async fn ps(State(gw): State<Arc<Gateway>>) -> Response {
    let mut e = model_entry(&gw);
    e["context_length"] = gw.backend.model().context_length.into();
    // Ollama's "never unloads" is a far-future expiry.
    e["expires_at"] = "2318-08-23T00:00:00Z".into();
    Json(json!({ "models": [e] })).into_response()
}

/// `GET /api/version`.
async fn version() -> Response {
    Json(json!({ "version": VERSION })).into_response()
}

/// The model a body names (`model`, or the older `name`), refused unless it is the served one.
fn asked_model(gw: &Gateway, body: &Result<Bytes, BytesRejection>) -> Result<String, ApiError> {
    let body = body
        .as_ref()
        .map_err(|e| ApiError::invalid(e.body_text(), None))?;
    let v = openai::parse_value(body)?;
    let model = openai::field::<String>(&v, "model")?
        .or(openai::field::<String>(&v, "name")?)
        .ok_or_else(|| ApiError::invalid("model is required", Some("model")))?;
    let served = gw.backend.model();
    if names_served(&model, &served.id) {
        Ok(model)
    } else {
        Err(not_found(&model))
    }
}

/// Ollama's 404 for a model it does not have.
pub(crate) fn not_found(model: &str) -> ApiError {
    ApiError {
        status: 404,
        ..ApiError::invalid(
            format!("model '{}' not found", clip(model, MAX_ECHO_BYTES)),
            None,
        )
    }
}

/// `POST /api/show`: what is known of the served model.
async fn show(State(gw): State<Arc<Gateway>>, body: Result<Bytes, BytesRejection>) -> Response {
    if let Err(e) = asked_model(&gw, &body) {
        return OllamaError(e).into_response();
    }
    let m = gw.backend.model();
    // Tool calls are read out of the text whatever the template (one without tool support
    // gets the tools described in a system message).
    let mut capabilities = vec!["completion", "tools"];
    if gw.backend.features().embeddings {
        capabilities.push("embedding");
    }
    Json(json!({
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": details(),
        "model_info": {"general.context_length": m.context_length},
        "capabilities": capabilities,
        "modified_at": rfc3339(m.created, 0),
    }))
    .into_response()
}

/// `POST /api/pull`: the served model is already here; nothing else can be fetched by name
/// through this API.
async fn pull(State(gw): State<Arc<Gateway>>, body: Result<Bytes, BytesRejection>) -> Response {
    match asked_model(&gw, &body) {
        Ok(_) => Json(json!({ "status": "success" })).into_response(),
        Err(e) if e.status == 404 => OllamaError(ApiError {
            status: 501,
            ..ApiError::invalid(
                "pulling models through the API is not supported: this server serves the \
                 model it was started with",
                Some("model"),
            )
        })
        .into_response(),
        Err(e) => OllamaError(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0, 0), "1970-01-01T00:00:00.000000000Z");
        // 2024-02-29 12:34:56 UTC, a leap day.
        assert_eq!(rfc3339(1_709_210_096, 5), "2024-02-29T12:34:56.000000005Z");
        assert_eq!(rfc3339(951_782_400, 0), "2000-02-29T00:00:00.000000000Z");
    }

    #[test]
    fn the_served_model_answers_with_or_without_its_tag() {
        assert!(names_served("stories260K", "stories260K"));
        assert!(names_served("stories260K:latest", "stories260K"));
        assert!(!names_served("stories260K:7b", "stories260K"));
        assert_eq!(tagged("qwen3:8b"), "qwen3:8b");
    }
}
