//! Running one generation request: its prompt prepared (chat template with tools, grammar,
//! checks against what the backend can do), its `n` choices submitted, and each choice's token
//! events turned into [`ChoicePiece`]s — text with its log-probabilities, tool calls, the end.
//! The OpenAI endpoints here (and the Anthropic and Responses front ends) format those pieces.
//!
//! Choice `i` is an independent backend request with seed [`choice_seed`]`(seed, i)`, so
//! choices differ when sampling, repeat exactly for the same seed, and choice 0 equals the
//! `n: 1` answer.
//!
//! [`prepare`] makes a request ready (prompt, tools, grammar, off the async workers when big);
//! [`streaming`] writes a streamed response's SSE body; the whole response is here.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::Value;
use tessera_sampling::TokenLogprobs;
use tracing::Instrument;

use crate::metrics::{unix_ms, RequestRecord};
use crate::openai::tools::{ToolCall, ToolCallParser, ToolEvent};
use crate::openai::{self, ApiError, ChoiceOut, Endpoint, ParsedRequest, ResponseMeta};
use crate::server::Gateway;
use crate::text::{Piece, TextStream};
use tessera_api::ClientId;
use tessera_api::{Check, GenerationRequest, ServedModel, SubmitError, Usage};

/// What a request's record needs, kept from arrival to the end.
pub(crate) struct Tracker {
    pub(crate) gw: Arc<Gateway>,
    pub(crate) id: String,
    pub(crate) path: &'static str,
    pub(crate) stream: bool,
    pub(crate) arrived: Instant,
    at_ms: u64,
    pub(crate) started: bool,
    pub(crate) recorded: bool,
    /// Whom its sequences count against ([`crate::admission`]).
    pub(crate) client: ClientId,
}

impl Tracker {
    pub(crate) fn new(gw: Arc<Gateway>, id: String, path: &'static str, client: ClientId) -> Self {
        Self {
            gw,
            id,
            path,
            client,
            stream: false,
            arrived: Instant::now(),
            at_ms: unix_ms(),
            started: false,
            recorded: false,
        }
    }

    pub(crate) fn record(
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
        // Outcomes may quote client text; the recent-requests list keeps only a bounded echo.
        let outcome = crate::server::clip(&outcome, crate::server::MAX_ECHO_BYTES).into_owned();
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
                endpoint: self.path.into(),
                status,
                stream: self.stream,
                prompt_tokens: usage.prompt_tokens,
                cached_tokens: usage.cached_tokens,
                completion_tokens: usage.completion_tokens,
                ttft_ms: ttft.map(|d| d.as_secs_f64() * 1000.0),
                duration_ms,
                outcome,
            },
            self.started,
        );
    }

    pub(crate) fn reject(&mut self, e: ApiError) -> Response {
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

pub(crate) fn submit_error(e: SubmitError, prompt_param: &str) -> ApiError {
    match e {
        SubmitError::QueueFull { retry_after, .. } => {
            ApiError::queue_full(e.to_string(), retry_after.as_secs().max(1))
        }
        SubmitError::ContextTooLong { .. } => ApiError::invalid(e.to_string(), Some(prompt_param))
            .with_code("context_length_exceeded"),
        SubmitError::NotServing { .. } => ApiError::unavailable(e.to_string()),
        SubmitError::Invalid(m) => ApiError::invalid(m, None),
        // One of its own sequences finishing frees a place; a second is a fair guess.
        SubmitError::OverShare(_) => ApiError::queue_full(e.to_string(), 1),
        SubmitError::Unsupported(m) => ApiError {
            status: 501,
            ..ApiError::invalid(m, None)
        },
    }
}

/// What a choice produces, in order: content and tool calls, then `Done` or `Failed`.
#[derive(Clone, Debug)]
pub(crate) enum ChoicePiece {
    Content {
        text: String,
        logprobs: Vec<TokenLogprobs>,
    },
    ToolCall {
        /// Among this choice's calls.
        index: usize,
        id: String,
        call: ToolCall,
    },
    Done {
        /// `stop`, `length` or `tool_calls`.
        finish: &'static str,
        usage: Usage,
        /// Scores of tokens whose text never came out (held back, cut by a stop string).
        logprobs: Vec<TokenLogprobs>,
        /// The stop string that ended the text (Anthropic reports it; OpenAI only says `stop`).
        stop_sequence: Option<String>,
        /// Whether a second worker reproduced the answer, where the backend checks ([`mark`]).
        check: Option<Check>,
    },
    Failed(String),
}

/// One choice being generated.
pub(crate) struct Choice {
    pub index: usize,
    text: TextStream,
    tools: Option<ToolCallParser>,
    queue: VecDeque<ChoicePiece>,
    calls: usize,
    call_prefix: String,
    /// Scores of tokens whose text the tool parser still holds.
    held: Vec<TokenLogprobs>,
    /// The request asked for log-probabilities (an empty list is shown rather than `null`).
    pub wants_logprobs: bool,
    count: Box<dyn FnMut(bool) + Send>,
    /// Its place in the client's fair share, given back when the choice is dropped.
    _admitted: Option<crate::admission::Permit>,
}

impl Choice {
    /// The next piece; `None` after `Done` or `Failed`.
    pub async fn next(&mut self) -> Option<ChoicePiece> {
        loop {
            if let Some(p) = self.queue.pop_front() {
                return Some(p);
            }
            let piece = self.text.next_piece(&mut self.count).await?;
            let mut lp = self.text.take_logprobs();
            match piece {
                Piece::Text(s) => match &mut self.tools {
                    None => self.queue.push_back(ChoicePiece::Content {
                        text: s,
                        logprobs: lp,
                    }),
                    Some(parser) => {
                        self.held.append(&mut lp);
                        let events = parser.push(&s);
                        self.push_tool_events(events);
                    }
                },
                Piece::Done {
                    reason,
                    usage,
                    check,
                } => {
                    if let Some(parser) = &mut self.tools {
                        let events = parser.finish();
                        self.push_tool_events(events);
                    }
                    let finish = if self.calls > 0 && reason == tessera_api::FinishReason::Stop {
                        "tool_calls"
                    } else {
                        reason.as_str()
                    };
                    self.held.append(&mut lp);
                    self.queue.push_back(ChoicePiece::Done {
                        finish,
                        usage,
                        logprobs: std::mem::take(&mut self.held),
                        stop_sequence: self.text.stop_sequence().map(str::to_owned),
                        check,
                    });
                }
                Piece::Failed(m) => self.queue.push_back(ChoicePiece::Failed(m)),
            }
        }
    }

    fn push_tool_events(&mut self, events: Vec<ToolEvent>) {
        for e in events {
            match e {
                ToolEvent::Content(text) => self.queue.push_back(ChoicePiece::Content {
                    text,
                    logprobs: std::mem::take(&mut self.held),
                }),
                ToolEvent::Call(call) => {
                    let index = self.calls;
                    self.calls += 1;
                    self.queue.push_back(ChoicePiece::ToolCall {
                        index,
                        id: format!("{}{}_{index}", self.call_prefix, self.index),
                        call,
                    });
                }
            }
        }
    }

    pub fn ttft(&self) -> Option<std::time::Duration> {
        self.text.ttft()
    }
}

fn token_counter(gw: &Arc<Gateway>, arrived: Instant) -> Box<dyn FnMut(bool) + Send> {
    let gw = gw.clone();
    Box::new(move |first| {
        if first {
            gw.metrics.first_token(arrived.elapsed());
        }
        gw.metrics.tokens(1);
    })
}

/// Submits the request's `n` choices. `seq` is the request's number (its default seed).
pub(crate) fn submit_choices(
    gw: &Arc<Gateway>,
    t: &Tracker,
    seq: u64,
    req: &ParsedRequest,
    prepared: &Prepared,
    max_tokens: usize,
) -> Result<Vec<Choice>, SubmitError> {
    let served = gw.backend.model();
    let default_seed = seq ^ gw.salt();
    let mut choices = Vec::with_capacity(req.n);
    for i in 0..req.n {
        // A place first: a refused choice never reaches the backend, and the places of the
        // choices before it are given back as `choices` drops.
        let admitted = match &gw.admission {
            Some(a) => Some(a.admit(&t.client).map_err(SubmitError::OverShare)?),
            None => None,
        };
        let id = if i == 0 { seq } else { gw.new_id().0 };
        let mut g = GenerationRequest::new(
            id,
            prepared.prompt_tokens.clone(),
            req.sampling(default_seed, i),
            max_tokens,
        );
        g.logprobs = req.logprobs;
        g.grammar = prepared.grammar.clone();
        g.prediction = prepared.prediction.clone();
        let handle = gw.backend.submit(g)?;
        choices.push(Choice {
            index: i,
            text: TextStream::new(
                handle,
                served.clone(),
                &req.stop,
                prepared.prompt_tokens.len(),
                t.arrived,
            ),
            tools: prepared
                .tools
                .as_ref()
                .map(|(f, tools)| ToolCallParser::new(*f, tools)),
            queue: VecDeque::new(),
            calls: 0,
            call_prefix: format!("call_{}_", &t.id[t.id.len().saturating_sub(16)..]),
            held: Vec::new(),
            wants_logprobs: req.logprobs.is_some(),
            count: token_counter(gw, t.arrived),
            _admitted: admitted,
        });
    }
    Ok(choices)
}

/// Marks an answer object with its [`Check`]: `"verified": true|false` where the backend
/// checks its workers' answers (sealed mode), nothing where it does not. Every front end marks
/// its final object (and the last event of a stream) this way.
pub(crate) fn mark(object: &mut Value, check: Option<Check>) {
    if let Some(c) = check {
        object["verified"] = c.is_verified().into();
    }
}

/// The header that marks a whole (non-streamed) response the same way as [`mark`].
pub(crate) const VERIFIED_HEADER: &str = "x-tessera-verified";

/// `response` with the [`VERIFIED_HEADER`] of `check`, where there is one.
pub(crate) fn with_check_header(mut response: Response, check: Option<Check>) -> Response {
    if let Some(c) = check {
        let v = if c.is_verified() { "true" } else { "false" };
        response
            .headers_mut()
            .insert(VERIFIED_HEADER, axum::http::HeaderValue::from_static(v));
    }
    response
}

/// The usage of a request: the prompt once, completions summed over choices.
fn total(usages: &[Usage]) -> Usage {
    Usage {
        prompt_tokens: usages.first().map_or(0, |u| u.prompt_tokens),
        completion_tokens: usages.iter().map(|u| u.completion_tokens).sum(),
        cached_tokens: usages.first().map_or(0, |u| u.cached_tokens),
    }
}

/// `POST /v1/chat/completions` and `/v1/completions`.
pub(crate) async fn generate(
    gw: Arc<Gateway>,
    endpoint: Endpoint,
    client: ClientId,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let (seq, suffix) = gw.new_id();
    let id = format!("{}{suffix}", endpoint.id_prefix());
    let span = tracing::info_span!("request", id = %id);
    let mut t = Tracker::new(gw.clone(), id.clone(), endpoint.path(), client);
    async move {
        let body = match body {
            Ok(b) => b,
            Err(e) => {
                return t.reject(ApiError::body_rejected(&e));
            }
        };
        let parser = match endpoint {
            Endpoint::Chat => openai::parse_chat,
            Endpoint::Completion => openai::parse_completion,
        };
        let parsed = parse_off_thread(&body, parser).await;
        let req = match parsed {
            Ok(r) => r,
            Err(e) => return t.reject(e),
        };
        t.stream = req.stream;
        let served = gw.backend.model();
        if req.model != served.id {
            let model = crate::server::clip(&req.model, crate::server::MAX_ECHO_BYTES);
            return t.reject(ApiError::model_not_found(&model));
        }
        let prepared = match prepare_off_thread(&gw, &req, body.len()).await {
            Ok(p) => p,
            Err(e) => return t.reject(e),
        };
        let n_prompt = prepared.prompt_tokens.len();
        let max_tokens = req
            .max_tokens
            .unwrap_or_else(|| served.context_length.saturating_sub(n_prompt).max(1));
        let choices = match submit_choices(&gw, &t, seq, &req, &prepared, max_tokens) {
            Ok(c) => c,
            Err(e) => {
                tracing::info!(error = %e, "refused");
                let param = match endpoint {
                    Endpoint::Chat => "messages",
                    Endpoint::Completion => "prompt",
                };
                return t.reject(submit_error(e, param));
            }
        };
        tracing::info!(
            seq,
            endpoint = endpoint.path(),
            stream = req.stream,
            prompt_tokens = n_prompt,
            max_tokens,
            n = req.n,
            "accepted"
        );
        t.started = true;
        gw.metrics.request_started();
        let meta = ResponseMeta {
            endpoint,
            id,
            created: tessera_api::unix_now(),
            model: served.id.clone(),
        };
        let echo = prepared.echo.clone();
        if req.stream {
            stream_response(t, choices, meta, req.include_usage, echo, served)
        } else {
            whole_response(t, choices, meta, echo, served).await
        }
    }
    .instrument(span)
    .await
}

/// The logprobs JSON of `tokens` for this endpoint (`offset`: completions' text offset).
fn logprobs_json(
    served: &ServedModel,
    endpoint: Endpoint,
    tokens: &[TokenLogprobs],
    offset: usize,
) -> Value {
    match endpoint {
        Endpoint::Chat => openai::logprobs::chat(&served.tokenizer, tokens),
        Endpoint::Completion => openai::logprobs::completion(&served.tokenizer, tokens, offset),
    }
}

async fn whole_response(
    mut t: Tracker,
    choices: Vec<Choice>,
    meta: ResponseMeta,
    echo: Option<String>,
    served: Arc<ServedModel>,
) -> Response {
    let mut outs = Vec::with_capacity(choices.len());
    let mut usages = Vec::new();
    let mut ttft = None;
    for mut c in choices {
        let mut out = ChoiceOut {
            index: c.index,
            text: echo.clone().unwrap_or_default(),
            ..ChoiceOut::default()
        };
        let mut lps: Vec<TokenLogprobs> = Vec::new();
        loop {
            match c.next().await {
                Some(ChoicePiece::Content { text, mut logprobs }) => {
                    out.text.push_str(&text);
                    lps.append(&mut logprobs);
                }
                Some(ChoicePiece::ToolCall { id, call, .. }) => out.tool_calls.push((id, call)),
                Some(ChoicePiece::Done {
                    finish,
                    usage,
                    mut logprobs,
                    check,
                    ..
                }) => {
                    lps.append(&mut logprobs);
                    out.finish = finish;
                    out.check = check;
                    usages.push(usage);
                    break;
                }
                Some(ChoicePiece::Failed(m)) => {
                    return t.reject(ApiError::internal(format!("generation failed: {m}")));
                }
                None => {
                    return t.reject(ApiError::internal(
                        "generation ended without a result".into(),
                    ))
                }
            }
        }
        ttft = ttft.or(c.ttft());
        let offset = echo.as_ref().map_or(0, String::len);
        out.logprobs = c
            .wants_logprobs
            .then(|| logprobs_json(&served, meta.endpoint, &lps, offset));
        outs.push(out);
    }
    let usage = total(&usages);
    let reasons: Vec<&str> = outs.iter().map(|o| o.finish).collect();
    t.record(200, usage, ttft, reasons.join(","));
    let check = Check::all(outs.iter().map(|o| o.check));
    with_check_header(
        Json(openai::full_response(&meta, &outs, usage)).into_response(),
        check,
    )
}
mod prepare;
mod streaming;

pub(crate) use prepare::{
    off_thread_if_big, parse_off_thread, prepare_off_thread, prompt_tokens, Prepared,
};
pub(crate) use streaming::sse;
use streaming::stream_response;
