//! The axum application: OpenAI endpoints under `/v1` (behind the API key when one is set),
//! `/health`, `/metrics`, and the dashboard (see [`crate::dashboard`]).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use serde_json::json;
use tracing::Instrument;

use crate::backend::{Backend, GenerationRequest, SubmitError, Usage};
use crate::metrics::{render_prometheus, unix_ms, GatewayMetrics, RequestRecord};
use crate::openai::{self, ApiError, Endpoint, ParsedRequest, Prompt, ResponseMeta};
use crate::text::{Piece, TextStream};

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

    /// A process-unique request number and its public id suffix (24 hex digits).
    fn new_id(&self) -> (u64, String) {
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
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
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
    generate(gw, Endpoint::Chat, body).await
}

async fn completions(
    State(gw): State<Arc<Gateway>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(gw, Endpoint::Completion, body).await
}

/// What a request's record needs, kept from arrival to the end.
struct Tracker {
    gw: Arc<Gateway>,
    id: String,
    endpoint: Endpoint,
    stream: bool,
    arrived: Instant,
    at_ms: u64,
    started: bool,
    recorded: bool,
}

impl Tracker {
    fn record(
        &mut self,
        status: u16,
        usage: Usage,
        ttft: Option<std::time::Duration>,
        outcome: String,
    ) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        let duration_ms = self.arrived.elapsed().as_secs_f64() * 1000.0;
        tracing::info!(
            request = %self.id,
            status,
            prompt_tokens = usage.prompt_tokens,
            completion_tokens = usage.completion_tokens,
            duration_ms = format_args!("{duration_ms:.1}"),
            outcome = %outcome,
            "request finished"
        );
        self.gw.metrics.request_finished(
            RequestRecord {
                id: self.id.clone(),
                at_ms: self.at_ms,
                endpoint: self.endpoint.path().into(),
                status,
                stream: self.stream,
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                ttft_ms: ttft.map(|d| d.as_secs_f64() * 1000.0),
                duration_ms,
                outcome,
            },
            self.started,
        );
    }

    fn reject(&mut self, e: ApiError) -> Response {
        self.record(e.status, Usage::default(), None, e.message.clone());
        e.into_response()
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        // Dropped before finishing: the client went away mid-request.
        self.record(200, Usage::default(), None, "cancelled".into());
    }
}

fn submit_error(e: SubmitError, endpoint: Endpoint) -> ApiError {
    match e {
        SubmitError::QueueFull { retry_after, .. } => {
            ApiError::queue_full(e.to_string(), retry_after.as_secs().max(1))
        }
        SubmitError::ContextTooLong { .. } => {
            let param = match endpoint {
                Endpoint::Chat => "messages",
                Endpoint::Completion => "prompt",
            };
            ApiError::invalid(e.to_string(), Some(param)).with_code("context_length_exceeded")
        }
        SubmitError::NotServing { .. } => ApiError::unavailable(e.to_string()),
        SubmitError::Invalid(m) => ApiError::invalid(m, None),
    }
}

fn tokenize(gw: &Gateway, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
    let m = gw.backend.model();
    match prompt {
        Prompt::Chat(messages) => m
            .template
            .encode(&m.tokenizer, messages, true)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages"))),
        Prompt::Text(t) => Ok(m.tokenizer.encode(t, true)),
        Prompt::Tokens(t) => {
            let v = m.tokenizer.vocab_size();
            match t.iter().find(|&&id| id as usize >= v) {
                Some(bad) => Err(ApiError::invalid(
                    format!("Token id {bad} is outside the vocabulary of {v}."),
                    Some("prompt"),
                )),
                None => Ok(t.clone()),
            }
        }
    }
}

async fn generate(
    gw: Arc<Gateway>,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (n, suffix) = gw.new_id();
    let id = format!("{}{suffix}", endpoint.id_prefix());
    let span = tracing::info_span!("request", id = %id);
    let mut t = Tracker {
        gw: gw.clone(),
        id: id.clone(),
        endpoint,
        stream: false,
        arrived: Instant::now(),
        at_ms: unix_ms(),
        started: false,
        recorded: false,
    };
    async move {
        let body = match body {
            Ok(b) => b,
            Err(e) => {
                let status = e.status().as_u16();
                return t.reject(ApiError {
                    status,
                    ..ApiError::invalid(e.body_text(), None)
                });
            }
        };
        let parsed = match endpoint {
            Endpoint::Chat => openai::parse_chat(&body),
            Endpoint::Completion => openai::parse_completion(&body),
        };
        let req = match parsed {
            Ok(r) => r,
            Err(e) => return t.reject(e),
        };
        t.stream = req.stream;
        let served = gw.backend.model();
        if req.model != served.id {
            return t.reject(ApiError::model_not_found(&req.model));
        }
        // Large prompts are tokenized off the async workers, so they do not stall other streams.
        let tokenized = if body.len() > 16 << 10 {
            let (g, p) = (gw.clone(), req.prompt.clone());
            tokio::task::spawn_blocking(move || tokenize(&g, &p))
                .await
                .unwrap_or_else(|e| Err(ApiError::internal(format!("tokenizer failed: {e}"))))
        } else {
            tokenize(&gw, &req.prompt)
        };
        let prompt_tokens = match tokenized {
            Ok(p) if p.is_empty() => {
                return t.reject(ApiError::invalid("The prompt is empty.", Some("prompt")))
            }
            Ok(p) => p,
            Err(e) => return t.reject(e),
        };
        let n_prompt = prompt_tokens.len();
        let max_tokens = req
            .max_tokens
            .unwrap_or_else(|| served.context_length.saturating_sub(n_prompt).max(1));
        let handle = match gw.backend.submit(GenerationRequest {
            id: n,
            prompt_tokens,
            params: req.sampling(n ^ gw.salt),
            max_tokens,
        }) {
            Ok(h) => h,
            Err(e) => {
                tracing::info!(error = %e, "refused");
                return t.reject(submit_error(e, endpoint));
            }
        };
        tracing::info!(
            seq = n,
            endpoint = endpoint.path(),
            stream = req.stream,
            prompt_tokens = n_prompt,
            max_tokens,
            "accepted"
        );
        t.started = true;
        gw.metrics.request_started();
        let text = TextStream::new(handle, served.clone(), &req.stop, n_prompt, t.arrived);
        let meta = ResponseMeta {
            endpoint,
            id,
            created: crate::backend::unix_now(),
            model: served.id.clone(),
        };
        if req.stream {
            stream_response(t, text, meta, &req)
        } else {
            whole_response(t, text, meta).await
        }
    }
    .instrument(span)
    .await
}

fn token_counter(gw: &Arc<Gateway>, arrived: Instant) -> impl FnMut(bool) + Send + 'static {
    let gw = gw.clone();
    move |first| {
        if first {
            gw.metrics.first_token(arrived.elapsed());
        }
        gw.metrics.tokens(1);
    }
}

async fn whole_response(mut t: Tracker, mut text: TextStream, meta: ResponseMeta) -> Response {
    let mut out = String::new();
    let mut count = token_counter(&t.gw, t.arrived);
    while let Some(piece) = text.next_piece(&mut count).await {
        match piece {
            Piece::Text(s) => out.push_str(&s),
            Piece::Done { reason, usage } => {
                t.record(200, usage, text.ttft(), reason.as_str().into());
                return Json(openai::full_response(&meta, &out, reason, usage)).into_response();
            }
            Piece::Failed(m) => {
                return t.reject(ApiError::internal(format!("generation failed: {m}")));
            }
        }
    }
    t.reject(ApiError::internal(
        "generation ended without a result".into(),
    ))
}

/// Where a stream is.
enum Phase {
    /// Chat streams open with a chunk carrying the role.
    Role,
    Body,
    /// The usage chunk (`stream_options.include_usage`), then `[DONE]`.
    Usage(Usage),
    Done,
    End,
}

struct StreamState {
    t: Tracker,
    text: TextStream,
    meta: ResponseMeta,
    phase: Phase,
    include_usage: bool,
    count: Box<dyn FnMut(bool) + Send>,
}

fn data(v: &serde_json::Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream_response(
    t: Tracker,
    text: TextStream,
    meta: ResponseMeta,
    req: &ParsedRequest,
) -> Response {
    let count = Box::new(token_counter(&t.gw, t.arrived));
    let phase = match meta.endpoint {
        Endpoint::Chat => Phase::Role,
        Endpoint::Completion => Phase::Body,
    };
    let span = tracing::info_span!("stream", id = %meta.id);
    let state = StreamState {
        t,
        text,
        meta,
        phase,
        include_usage: req.include_usage,
        count,
    };
    let s = stream::unfold(state, move |mut st| {
        let span = span.clone();
        async move {
            next_sse(&mut st)
                .await
                .map(|e| (Ok::<_, Infallible>(e), st))
        }
        .instrument(span)
    });
    sse(s)
}

fn sse<S>(s: S) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    let mut r = Sse::new(s).into_response();
    r.headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}

async fn next_sse(st: &mut StreamState) -> Option<SseEvent> {
    loop {
        match std::mem::replace(&mut st.phase, Phase::End) {
            Phase::Role => {
                st.phase = Phase::Body;
                return Some(data(&openai::chunk(&st.meta, true, Some(""), None)));
            }
            Phase::Body => match st.text.next_piece(&mut st.count).await {
                Some(Piece::Text(s)) => {
                    st.phase = Phase::Body;
                    return Some(data(&openai::chunk(&st.meta, false, Some(&s), None)));
                }
                Some(Piece::Done { reason, usage }) => {
                    st.t.record(200, usage, st.text.ttft(), reason.as_str().into());
                    st.phase = if st.include_usage {
                        Phase::Usage(usage)
                    } else {
                        Phase::Done
                    };
                    return Some(data(&openai::chunk(&st.meta, false, None, Some(reason))));
                }
                Some(Piece::Failed(m)) => {
                    let e = ApiError::internal(format!("generation failed: {m}"));
                    let usage = Usage {
                        prompt_tokens: st.text.prompt_tokens(),
                        completion_tokens: st.text.completion_tokens(),
                    };
                    st.t.record(500, usage, st.text.ttft(), e.message.clone());
                    st.phase = Phase::Done;
                    return Some(data(&e.body()));
                }
                None => st.phase = Phase::Done,
            },
            Phase::Usage(u) => {
                st.phase = Phase::Done;
                return Some(data(&openai::usage_chunk(&st.meta, u)));
            }
            Phase::Done => {
                st.phase = Phase::End;
                return Some(SseEvent::default().data("[DONE]"));
            }
            Phase::End => return None,
        }
    }
}

impl Drop for StreamState {
    fn drop(&mut self) {
        if !self.t.recorded {
            let usage = Usage {
                prompt_tokens: self.text.prompt_tokens(),
                completion_tokens: self.text.completion_tokens(),
            };
            tracing::info!(request = %self.t.id, "client disconnected mid-stream");
            self.t
                .record(200, usage, self.text.ttft(), "cancelled".into());
        }
    }
}
