//! The axum application: OpenAI endpoints under `/v1`, `/health`, `/metrics`, and the
//! dashboard (see [`crate::dashboard`]). When an API key is set, everything but `/health`
//! requires it (`Authorization: Bearer KEY`, or HTTP Basic with the key as password so a
//! browser can open the dashboard): metrics, status and the dashboard show node addresses and
//! recent requests.
//!
//! Hostile clients are bounded here: a request's headers must arrive within
//! [`HEADER_READ_TIMEOUT`] (slowloris), at most [`MAX_CONNECTIONS`] are served at once and
//! [`MAX_CONNECTIONS_PER_ADDRESS`] from one address, bodies parse off the async workers past
//! a few KiB, every front end's requests are held to one table ([`crate::limits`]), and client
//! text echoed into an error or the recent-requests list is cut to [`MAX_ECHO_BYTES`].

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use serde_json::json;

use crate::admission::Admission;
use crate::api_keys::ApiKeys;
use crate::metrics::{render_prometheus, unix_ms, GatewayMetrics};
use crate::openai::{ApiError, Endpoint};
use tessera_api::Backend;
use tessera_api::ClientId;

/// How the gateway is exposed.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// One of these is required as `Authorization: Bearer KEY` on `/v1/*` when any is set.
    pub api_keys: ApiKeys,
    /// Sequences the backend can hold, running and waiting: each client (key, or address
    /// without keys) gets a fair share of them ([`crate::admission`]). `None`: no shares,
    /// only the backend's own queue limit.
    pub fair_share_of: Option<usize>,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// Web page origins (`https://app.example.com`, or `*`) allowed to call the API besides
    /// loopback pages ([`crate::cors`]).
    pub cors_origins: Vec<String>,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            api_keys: ApiKeys::default(),
            fair_share_of: None,
            max_body_bytes: crate::limits::LIMITS.max_body_bytes,
            cors_origins: Vec::new(),
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
pub fn check_exposure(addr: SocketAddr, api_keys: &ApiKeys) -> Result<(), KeyRequired> {
    if addr.ip().is_loopback() || !api_keys.is_empty() {
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
    pub(crate) admission: Option<Arc<Admission>>,
    next_id: AtomicU64,
    salt: u64,
    /// Flips to `true` when the server starts shutting down (ends the dashboard's streams).
    shutdown: tokio::sync::watch::Sender<bool>,
}

impl Gateway {
    pub fn new(backend: Arc<dyn Backend>, config: GatewayConfig) -> Arc<Self> {
        let salt = tessera_sampling::splitmix64(unix_ms() ^ (u64::from(std::process::id()) << 32));
        Arc::new(Self {
            backend,
            metrics: GatewayMetrics::default(),
            admission: config.fair_share_of.map(Admission::new),
            config,
            next_id: AtomicU64::new(1),
            salt,
            shutdown: tokio::sync::watch::Sender::new(false),
        })
    }

    /// Ends the dashboard's streams: the server is stopping (or this model is being
    /// unloaded, [`crate::models`]).
    pub fn begin_shutdown(&self) {
        self.shutdown.send_replace(true);
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
        let a = tessera_sampling::splitmix64(self.salt ^ n);
        let b = tessera_sampling::splitmix64(a);
        (n, format!("{a:016x}{:08x}", b as u32))
    }
}

/// Longest a client may take to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Most connections served at once; more wait in the listen backlog.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most connections one client address holds at once (half of [`MAX_CONNECTIONS`]); more are
/// closed as they arrive, so one host's idle sockets cannot take the slots every other client
/// needs, while a busy host (or every local client, on loopback) still has hundreds.
pub const MAX_CONNECTIONS_PER_ADDRESS: usize = MAX_CONNECTIONS / 2;

/// Connections open per client address.
#[derive(Default)]
struct PerAddress(std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>);

impl PerAddress {
    /// A slot for one more connection from `ip`, unless it holds its share already.
    fn admit(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<AddressSlot> {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= MAX_CONNECTIONS_PER_ADDRESS {
            return None;
        }
        *n += 1;
        Some(AddressSlot(self.clone(), ip))
    }
}

/// One connection's share of its address; given back when dropped.
struct AddressSlot(Arc<PerAddress>, std::net::IpAddr);

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.0 .0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.1);
            }
        }
    }
}
/// Most bytes of client text repeated in an error or a recent-request record.
pub const MAX_ECHO_BYTES: usize = 256;

/// `s` cut to at most `max` bytes at a character boundary, marked when cut.
pub fn clip(s: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if s.len() <= max {
        return s.into();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &s[..end], s.len()).into()
}

/// The whole application.
pub fn router(gateway: Arc<Gateway>) -> Router {
    let guarded = Router::new()
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(crate::embeddings::create))
        .route("/v1/messages", post(crate::anthropic::messages))
        .route("/v1/responses", post(crate::responses::create))
        .route("/tokenize", post(crate::tokens::tokenize))
        .route("/detokenize", post(crate::tokens::detokenize))
        .route(
            "/v1/messages/count_tokens",
            post(crate::anthropic::count_tokens),
        )
        .route("/metrics", get(metrics))
        .merge(crate::ollama::routes())
        .merge(crate::dashboard::routes())
        .route_layer(middleware::from_fn_with_state(
            gateway.clone(),
            require_api_key,
        ));
    Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(gateway.config.max_body_bytes))
        // Outermost: a browser's preflight carries no API key.
        .layer(middleware::from_fn_with_state(
            gateway.clone(),
            crate::cors::layer,
        ))
        .with_state(gateway)
}

/// Serves the gateway on `listener` until `shutdown` completes, then stops accepting, ends
/// the dashboard's live streams and waits for requests in flight to finish.
///
/// Each connection is served by hyper with a [`HEADER_READ_TIMEOUT`]; at most
/// [`MAX_CONNECTIONS`] at once.
pub async fn serve(
    listener: tokio::net::TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(gateway.clone());
    serve_app(listener, app, shutdown, move || gateway.begin_shutdown()).await
}

/// [`serve`] for any router (several models' [`crate::models::pool_router`]): `on_stop` runs
/// once the listener is closed, before the open connections finish.
pub async fn serve_app(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_stop: impl FnOnce(),
) -> std::io::Result<()> {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let per_address = Arc::new(PerAddress::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut conns = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let (stream, address_slot, peer_ip) = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, peer)) => match per_address.admit(peer.ip()) {
                    Some(slot) => (s, slot, peer.ip()),
                    // Dropping the socket closes it: this address has its share.
                    None => continue,
                },
                // Out of descriptors and the like: wait instead of spinning.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // The peer's address rides on every request, for fair admission without keys.
        let svc = hyper_util::service::TowerToHyperService::new(tower::ServiceExt::map_request(
            app.clone(),
            move |mut req: axum::http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(PeerAddress(peer_ip));
                req
            },
        ));
        let mut stop = stop_rx.clone();
        conns.spawn(async move {
            let _permit = permit;
            let _address_slot = address_slot;
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            let conn = http.serve_connection(hyper_util::rt::TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { let _ = stop.wait_for(|v| *v).await; } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
        while conns.try_join_next().is_some() {}
    }
    drop(listener);
    on_stop();
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

impl IntoResponse for ApiError {
    fn into_response(mut self) -> Response {
        // Messages may quote what the client sent (a model name, a serde error's value).
        if self.message.len() > MAX_ECHO_BYTES {
            self.message = clip(&self.message, MAX_ECHO_BYTES).into_owned();
        }
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

/// The key a request presents: `Bearer KEY`, or HTTP Basic with the key as password (what a
/// browser sends for the dashboard after its login prompt).
fn presented_key(req: &Request) -> Option<Vec<u8>> {
    // OpenAI clients send `Authorization: Bearer KEY`, Anthropic's send `x-api-key: KEY`.
    if let Some(k) = req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(k.trim().as_bytes().to_vec());
    }
    let v = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?;
    if let Some(k) = v.strip_prefix("Bearer ") {
        return Some(k.trim().as_bytes().to_vec());
    }
    let decoded = base64_decode(v.strip_prefix("Basic ")?.trim())?;
    let colon = decoded.iter().position(|&b| b == b':')?;
    Some(decoded[colon + 1..].to_vec())
}

/// Standard base64 (with or without padding); `None` if malformed.
fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let s = s.trim_end_matches('=').as_bytes();
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    for chunk in s.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= val(c)? << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        match chunk.len() {
            4 => out.extend_from_slice(&bytes[1..4]),
            3 => out.extend_from_slice(&bytes[1..3]),
            2 => out.push(bytes[1]),
            _ => return None,
        }
    }
    Some(out)
}

/// The address a connection came from (set by [`serve`] on each of its requests).
#[derive(Clone, Copy, Debug)]
struct PeerAddress(std::net::IpAddr);

/// Checks the key, and tells the handlers whom the request counts against ([`ClientId`]).
/// The refusal of `req` when it presents none of `config`'s keys (and keys are required).
pub(crate) fn refuse_without_key(config: &GatewayConfig, req: &Request) -> Option<Response> {
    if config.api_keys.is_empty() {
        return None;
    }
    match presented_key(req) {
        Some(g) if config.api_keys.find(&g).is_some() => None,
        Some(_) => Some(ApiError::unauthorized("Incorrect API key provided.").into_response()),
        None => Some(
            ApiError::unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
            )
            .into_response(),
        ),
    }
}

async fn require_api_key(State(gw): State<Arc<Gateway>>, mut req: Request, next: Next) -> Response {
    if gw.config.api_keys.is_empty() {
        let client = match req.extensions().get::<PeerAddress>() {
            Some(p) => ClientId::Address(p.0),
            None => ClientId::Unknown,
        };
        req.extensions_mut().insert(client);
        return next.run(req).await;
    }
    let api = req.uri().path().starts_with("/v1/");
    let mut refused = match presented_key(&req) {
        Some(g) => match gw.config.api_keys.find(&g) {
            Some(k) => {
                let client = ClientId::Key(k.name.clone());
                req.extensions_mut().insert(client);
                return next.run(req).await;
            }
            None => ApiError::unauthorized("Incorrect API key provided.").into_response(),
        },
        None => ApiError::unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'.",
        )
        .into_response(),
    };
    if !api {
        // A browser asks for the key (as the password) and sends it from then on.
        refused.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            HeaderValue::from_static("Basic realm=\"tessera\", charset=\"UTF-8\""),
        );
    }
    refused
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
        ApiError::model_not_found(&clip(&model, MAX_ECHO_BYTES)).into_response()
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
    let mut text = render_prometheus(&gw.metrics.snapshot(), &gw.backend.status());
    text.push_str(&crate::metrics::render_speculation(
        gw.backend.speculation(),
    ));
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
    Extension(client): Extension<ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    crate::respond::generate(gw, Endpoint::Chat, client, body).await
}

async fn completions(
    State(gw): State<Arc<Gateway>>,
    Extension(client): Extension<ClientId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    crate::respond::generate(gw, Endpoint::Completion, client, body).await
}
