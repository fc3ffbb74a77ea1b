//! Several models behind one address (`tessera serve -m A -m B --models-memory SIZE`): each
//! request goes to the model its `model` field names, loaded on first use. When the next model
//! does not fit the memory budget, the least recently used idle models are unloaded first; a
//! model with requests in flight is never unloaded, so a request that finds no room gets 503
//! saying which models hold it.
//!
//! Each loaded model has a whole [`Gateway`] of its own (its backend, admission, metrics); the
//! [`ModelPool`]'s router only picks one and hands the request over. Requests that name no
//! model (the dashboard, `/metrics`, `/api/status`) go to the model used last. The model lists
//! (`/v1/models`, Ollama's `/api/tags` and `/api/ps`) are the pool's own.
//!
//! Which models to unload is [`choose_evictions`], a pure function.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::json;

use crate::openai::ApiError;
use crate::server::{router, Gateway, GatewayConfig};
use tessera_api::Backend;

/// Loads one model's backend (blocking: it reads the weights).
pub type Loader = Arc<dyn Fn() -> Result<Arc<dyn Backend>, String> + Send + Sync>;

/// A model the pool may serve.
#[derive(Clone)]
pub struct ModelSpec {
    /// The name clients use in `model`.
    pub name: String,
    /// What it holds once loaded, counted against the budget (its weights).
    pub bytes: u64,
    pub load: Loader,
}

/// A loaded model, as [`choose_evictions`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resident {
    pub name: String,
    pub bytes: u64,
    /// Requests in flight: a busy model is never unloaded.
    pub busy: bool,
    /// Higher is more recent.
    pub last_used: u64,
}

/// Why a model cannot be loaded now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoRoom {
    /// Larger than the whole budget.
    TooLarge { bytes: u64, budget: u64 },
    /// The busy models hold too much of the budget.
    Busy { held_by: Vec<String> },
}

/// The models to unload, least recently used first, so that `want` bytes fit `budget`
/// beside what stays.
pub fn choose_evictions(
    resident: &[Resident],
    want: u64,
    budget: u64,
) -> Result<Vec<String>, NoRoom> {
    if want > budget {
        return Err(NoRoom::TooLarge {
            bytes: want,
            budget,
        });
    }
    let mut used: u64 = resident.iter().map(|r| r.bytes).sum();
    let mut idle: Vec<&Resident> = resident.iter().filter(|r| !r.busy).collect();
    idle.sort_by_key(|r| r.last_used);
    let mut out = Vec::new();
    for r in idle {
        if used + want <= budget {
            break;
        }
        used -= r.bytes;
        out.push(r.name.clone());
    }
    if used + want > budget {
        let held_by = resident
            .iter()
            .filter(|r| r.busy)
            .map(|r| r.name.clone())
            .collect();
        return Err(NoRoom::Busy { held_by });
    }
    Ok(out)
}

struct Loaded {
    name: String,
    bytes: u64,
    gateway: Arc<Gateway>,
    app: Router,
    /// Requests handed to it whose responses are not finished.
    in_flight: Arc<AtomicUsize>,
    last_used: u64,
}

#[derive(Default)]
struct PoolState {
    loaded: Vec<Loaded>,
    clock: u64,
}

/// Several models, loaded on demand within a memory budget.
pub struct ModelPool {
    specs: Vec<ModelSpec>,
    budget: u64,
    config: GatewayConfig,
    state: Mutex<PoolState>,
    /// One load at a time (two requests for an unloaded model load it once).
    loading: tokio::sync::Mutex<()>,
}

impl ModelPool {
    pub fn new(specs: Vec<ModelSpec>, budget: u64, config: GatewayConfig) -> Arc<Self> {
        Arc::new(Self {
            specs,
            budget,
            config,
            state: Mutex::default(),
            loading: tokio::sync::Mutex::new(()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loaded model `name`'s router and its in-flight counter, marked used now.
    fn take(&self, name: &str) -> Option<(Router, Arc<AtomicUsize>)> {
        let mut st = self.state();
        st.clock += 1;
        let now = st.clock;
        let m = st.loaded.iter_mut().find(|m| m.name == name)?;
        m.last_used = now;
        m.in_flight.fetch_add(1, Ordering::SeqCst);
        Some((m.app.clone(), m.in_flight.clone()))
    }

    /// Model `name`, loaded if it is not (unloading idle ones to make room).
    async fn get(&self, name: &str) -> Result<(Router, Arc<AtomicUsize>), ApiError> {
        if let Some(m) = self.take(name) {
            return Ok(m);
        }
        let _one = self.loading.lock().await;
        if let Some(m) = self.take(name) {
            return Ok(m);
        }
        let spec = self
            .specs
            .iter()
            .find(|s| s.name == name)
            .cloned()
            .ok_or_else(|| ApiError::model_not_found(name))?;
        let evicted = {
            let mut st = self.state();
            let resident: Vec<Resident> = st
                .loaded
                .iter()
                .map(|m| Resident {
                    name: m.name.clone(),
                    bytes: m.bytes,
                    busy: m.in_flight.load(Ordering::SeqCst) > 0,
                    last_used: m.last_used,
                })
                .collect();
            let names = choose_evictions(&resident, spec.bytes, self.budget)
                .map_err(|e| no_room(name, &e))?;
            let (gone, kept) = std::mem::take(&mut st.loaded)
                .into_iter()
                .partition(|m| names.contains(&m.name));
            st.loaded = kept;
            gone
        };
        for m in evicted {
            tracing::info!(event = "model_unloaded", model = %m.name, "unloaded {} to make room for {name}", m.name);
            m.gateway.begin_shutdown();
            // Dropping a backend joins its threads: not on an async worker.
            tokio::task::spawn_blocking(move || drop(m)).await.ok();
        }
        let load = spec.load.clone();
        let backend = tokio::task::spawn_blocking(move || load())
            .await
            .map_err(|e| ApiError::internal(format!("loading {name}: {e}")))?
            .map_err(|e| ApiError::internal(format!("loading {name}: {e}")))?;
        tracing::info!(event = "model_loaded", model = %name, bytes = spec.bytes, "loaded {name}");
        let gateway = Gateway::new(backend, self.config.clone());
        let mut st = self.state();
        st.loaded.push(Loaded {
            name: name.to_string(),
            bytes: spec.bytes,
            app: router(gateway.clone()),
            gateway,
            in_flight: Arc::default(),
            last_used: 0,
        });
        drop(st);
        self.take(name)
            .ok_or_else(|| ApiError::internal(format!("{name} was unloaded as it loaded")))
    }

    /// The model used last (loading the first configured one when none is loaded).
    async fn current(&self) -> Result<(Router, Arc<AtomicUsize>), ApiError> {
        let name = {
            let st = self.state();
            st.loaded
                .iter()
                .max_by_key(|m| m.last_used)
                .map(|m| m.name.clone())
        };
        match name {
            Some(n) => self.get(&n).await,
            None => self.get(&self.specs[0].name).await,
        }
    }

    /// Tells every loaded model's gateway that the server is stopping.
    pub fn begin_shutdown(&self) {
        for m in &self.state().loaded {
            m.gateway.begin_shutdown();
        }
    }

    fn loaded_names(&self) -> Vec<(String, u64)> {
        self.state()
            .loaded
            .iter()
            .map(|m| (m.name.clone(), m.bytes))
            .collect()
    }
}

fn no_room(name: &str, e: &NoRoom) -> ApiError {
    let mut err = ApiError::unavailable(match e {
        NoRoom::TooLarge { bytes, budget } => format!(
            "model {name} needs {bytes} bytes, more than the whole --models-memory budget of \
             {budget}"
        ),
        NoRoom::Busy { held_by } => format!(
            "model {name} does not fit the --models-memory budget beside the models serving \
             requests now ({}); retry when they finish",
            held_by.join(", ")
        ),
    });
    err.param = Some("model".into());
    err
}

/// The pool's router: the model lists, and every other request handed to its model.
pub fn pool_router(pool: Arc<ModelPool>) -> Router {
    Router::new().fallback(dispatch).with_state(pool)
}

/// The `model` a request names: its JSON body's `model` (or Ollama's older `name`), or the
/// path's last segment for `GET /v1/models/{model}`.
fn named_model(path: &str, body: &[u8]) -> Option<String> {
    if let Some(m) = path.strip_prefix("/v1/models/") {
        return Some(m.to_string());
    }
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<String>,
        name: Option<String>,
    }
    let n: Named = serde_json::from_slice(body).ok()?;
    n.model.or(n.name)
}

async fn dispatch(State(pool): State<Arc<ModelPool>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    if req.method() == Method::GET {
        match path.as_str() {
            "/v1/models" | "/api/tags" | "/api/ps" => {
                if let Some(refused) = crate::server::refuse_without_key(&pool.config, &req) {
                    return refused;
                }
                return lists(&pool, &path);
            }
            _ => {}
        }
    }
    let (parts, body) = req.into_parts();
    let bytes: Bytes = match axum::body::to_bytes(body, pool.config.max_body_bytes).await {
        Ok(b) => b,
        // As a single model's gateway answers a body over its limit: 413.
        Err(_) => {
            return ApiError {
                status: 413,
                ..ApiError::invalid(
                    format!(
                        "the request body is larger than {} bytes",
                        pool.config.max_body_bytes
                    ),
                    None,
                )
            }
            .into_response()
        }
    };
    let name = {
        let (path, body) = (path.clone(), bytes.clone());
        crate::respond::off_thread_if_big(bytes.len(), move || Ok(named_model(&path, &body)))
            .await
            .unwrap_or(None)
    };
    // Ollama's clients add a tag; the model answers with or without `:latest`.
    let name = name.map(|n| n.strip_suffix(":latest").map_or(n.clone(), str::to_string));
    let picked = match name {
        Some(n) if pool.specs.iter().any(|s| s.name == n) => pool.get(&n).await,
        // Unnamed, or a name no model has: the current model answers (its own 404 for an
        // unknown name, in the front end's shape).
        _ => pool.current().await,
    };
    let (app, in_flight) = match picked {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let guard = InFlight(in_flight);
    let req = Request::from_parts(parts, Body::from(bytes));
    let response = match tower::ServiceExt::oneshot(app, req).await {
        Ok(r) => r,
        Err(never) => match never {},
    };
    // The model counts as busy until the response's last byte has gone.
    response.map(|body| {
        Body::from_stream(body.into_data_stream().map(move |chunk| {
            let _held = &guard;
            chunk
        }))
    })
}

/// Counts a request in flight until dropped.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lists(pool: &ModelPool, path: &str) -> Response {
    let loaded = pool.loaded_names();
    match path {
        "/v1/models" => {
            let data: Vec<_> = pool
                .specs
                .iter()
                .map(|s| json!({"id": s.name, "object": "model", "created": 0, "owned_by": "tessera"}))
                .collect();
            Json(json!({"object": "list", "data": data})).into_response()
        }
        "/api/tags" => {
            let models: Vec<_> = pool
                .specs
                .iter()
                .map(|s| json!({"name": s.name, "model": s.name, "size": s.bytes}))
                .collect();
            Json(json!({ "models": models })).into_response()
        }
        _ => {
            let models: Vec<_> = loaded
                .iter()
                .map(|(n, b)| json!({"name": n, "model": n, "size": b}))
                .collect();
            Json(json!({ "models": models })).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(name: &str, bytes: u64, busy: bool, last_used: u64) -> Resident {
        Resident {
            name: name.into(),
            bytes,
            busy,
            last_used,
        }
    }

    #[test]
    fn nothing_is_unloaded_while_the_new_model_fits() {
        let loaded = [r("a", 40, false, 1)];
        assert_eq!(choose_evictions(&loaded, 50, 100), Ok(vec![]));
    }

    #[test]
    fn the_least_recently_used_idle_model_goes_first() {
        let loaded = [r("a", 40, false, 2), r("b", 40, false, 1)];
        assert_eq!(choose_evictions(&loaded, 50, 100), Ok(vec!["b".into()]));
        // Enough room needs both gone: oldest first.
        assert_eq!(
            choose_evictions(&loaded, 90, 100),
            Ok(vec!["b".into(), "a".into()])
        );
    }

    #[test]
    fn a_busy_model_stays_even_when_it_is_the_oldest() {
        let loaded = [r("a", 40, true, 1), r("b", 40, false, 2)];
        assert_eq!(choose_evictions(&loaded, 50, 100), Ok(vec!["b".into()]));
        let both_busy = [r("a", 40, true, 1), r("b", 40, true, 2)];
        assert_eq!(
            choose_evictions(&both_busy, 50, 100),
            Err(NoRoom::Busy {
                held_by: vec!["a".into(), "b".into()]
            })
        );
    }

    #[test]
    fn a_model_larger_than_the_budget_is_refused_whatever_is_loaded() {
        assert_eq!(
            choose_evictions(&[], 101, 100),
            Err(NoRoom::TooLarge {
                bytes: 101,
                budget: 100
            })
        );
    }

    #[test]
    fn the_model_is_read_from_the_body_or_the_path() {
        assert_eq!(
            named_model("/v1/chat/completions", br#"{"model":"m","messages":[]}"#),
            Some("m".into())
        );
        assert_eq!(
            named_model("/api/show", br#"{"name":"o"}"#),
            Some("o".into())
        );
        assert_eq!(named_model("/v1/models/x", b""), Some("x".into()));
        assert_eq!(named_model("/metrics", b""), None);
        assert_eq!(named_model("/v1/chat/completions", b"not json"), None);
    }
}
