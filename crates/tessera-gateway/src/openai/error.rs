//! OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP status
//! it goes with: what every refusal of the API is built from.

use serde_json::{json, Value};

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

    /// A body axum could not read (too large, not bytes), with the status it chose.
    pub fn body_rejected(e: &axum::extract::rejection::BytesRejection) -> Self {
        Self {
            status: e.status().as_u16(),
            ..Self::invalid(e.body_text(), None)
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
