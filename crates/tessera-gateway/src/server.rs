//! The axum application: OpenAI endpoints under `/v1` (behind the API key when one is set),
//! `/health`, `/metrics`, and the dashboard (see [`crate::dashboard`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::backend::Backend;
use crate::metrics::{render_prometheus, unix_ms, GatewayMetrics};
use crate::openai::{ApiError, Endpoint};

/// How the gateway is exposed.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Required as `Authorization: Bearer KEY` on `/v1/*` when set.
    pub api_key: Option<String>,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            api_key: None,
            max_body_bytes: 4 << 20,
        }
    }
}

/// Refusing to start: a server reachable from other machines must have an API key.
#[derive(Debug, thiserror::Error)]
#[error(
    "{addr} is reachable beyond this machine: set an API key (--api-key or --api-key-file) or \
     bind to a loopback address such as 127.0.0.1"
)]
pub struct KeyRequired {
    pub addr: SocketAddr,
}

/// Checks the rule of the issue: an API key whenever the bind address is not loopback.
pub fn check_exposure(addr: SocketAddr, api_key: Option<&str>) -> Result<(), KeyRequired> {
    if addr.ip().is_loopback() || api_key.is_some_and(|k| !k.is_empty()) {
        Ok(())
    } else {
        Err(KeyRequired { addr })
    }
}

/// Shared state of every handler.
pub struct Gateway {
    pub(crate) backend: Arc<dyn Backend>,
    pub(crate) metrics: GatewayMetrics,
    pub(crate) config: GatewayConfig,
    next_id: AtomicU64,
    salt: u64,
    /// Flips to `true` when the server starts shutting down (ends the dashboard's streams).
    shutdown: tokio::sync::watch::Sender<bool>,
}

impl Gateway {
    pub fn new(backend: Arc<dyn Backend>, config: GatewayConfig) -> Arc<Self> {
        let salt =
            tessera_engine::sampling::splitmix64(unix_ms() ^ (u64::from(std::process::id()) << 32));
        Arc::new(Self {
            backend,
            metrics: GatewayMetrics::default(),
            config,
            next_id: AtomicU64::new(1),
            salt,
            shutdown: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Resolves once shutdown has begun.
    pub(crate) async fn shutting_down(&self) {
        let mut rx = self.shutdown.subscribe();
        let _ = rx.wait_for(|v| *v).await;
    }

    pub fn metrics(&self) -> &GatewayMetrics {
        &self.metrics
    }

    /// Mixed into default seeds so they differ between server runs.
    pub(crate) fn salt(&self) -> u64 {
        self.salt
    }

    /// A process-unique request number and its public id suffix (24 hex digits).
    pub(crate) fn new_id(&self) -> (u64, String) {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let a = tessera_engine::sampling::splitmix64(self.salt ^ n);
        let b = tessera_engine::sampling::splitmix64(a);
        (n, format!("{a:016x}{:08x}", b as u32))
    }
}

/// The whole application.
pub fn router(gateway: Arc<Gateway>) -> Router {
    let api = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/responses", post(crate::responses::create))
        .route("/tokenize", post(crate::tokens::tokenize))
        .route("/detokenize", post(crate::tokens::detokenize))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route_layer(middleware::from_fn_with_state(
            gateway.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(crate::dashboard::routes())
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(gateway.config.max_body_bytes))
        .with_state(gateway)
}

/// Serves the gateway on `listener` until `shutdown` completes, then stops accepting, ends
/// the dashboard's live streams and waits for requests in flight to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(gateway.clone());
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            gateway.shutdown.send_replace(true);
        })
        .await
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        let mut r = (status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

/// Compares without an early exit, so timing does not reveal the key.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn require_api_key(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let Some(key) = gw.config.api_key.as_deref() else {
        return next.run(req).await;
    };
    // OpenAI clients send `Authorization: Bearer KEY`, Anthropic's send `x-api-key: KEY`.
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim);
    match given {
        Some(g) if same_secret(g.as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => ApiError::unauthorized("Incorrect API key provided.").into_response(),
        None => ApiError::unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
        )
        .into_response(),
    }
}

fn model_json(gw: &Gateway) -> serde_json::Value {
    let m = gw.backend.model();
    json!({
        "id": m.id,
        "object": "model",
        "created": m.created,
        "owned_by": "tessera",
        "context_length": m.context_length,
    })
}

async fn list_models(State(gw): State<Arc<Gateway>>) -> Response {
    Json(json!({"object": "list", "data": [model_json(&gw)]})).into_response()
}

async fn get_model(
    State(gw): State<Arc<Gateway>>,
    axum::extract::Path(model): axum::extract::Path<String>,
) -> Response {
    if model == gw.backend.model().id {
        Json(model_json(&gw)).into_response()
    } else {
        ApiError::model_not_found(&model).into_response()
    }
}

async fn health(State(gw): State<Arc<Gateway>>) -> Response {
    let s = gw.backend.status();
    let epoch = s.plan.as_ref().map(|p| p.epoch);
    match s.not_serving {
        None => {
            Json(json!({"status": "ok", "model": s.model, "plan_epoch": epoch})).into_response()
        }
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(
                json!({"status": "unavailable", "reason": reason, "model": s.model,
                        "plan_epoch": epoch}),
            ),
        )
            .into_response(),
    }
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
    let text = render_prometheus(&gw.metrics.snapshot(), &gw.backend.status());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn chat_completions(
    State(gw): State<Arc<Gateway>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    crate::respond::generate(gw, Endpoint::Chat, body).await
}

async fn completions(
    State(gw): State<Arc<Gateway>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    crate::respond::generate(gw, Endpoint::Completion, body).await
}
