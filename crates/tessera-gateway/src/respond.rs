//! Running one generation request: its prompt prepared (chat template with tools, grammar,
//! checks against what the backend can do), its `n` choices submitted, and each choice's token
//! events turned into [`ChoicePiece`]s — text with its log-probabilities, tool calls, the end.
//! The OpenAI endpoints here (and the Anthropic and Responses front ends) format those pieces.
//!
//! Choice `i` is an independent backend request with seed [`choice_seed`]`(seed, i)`, so
//! choices differ when sampling, repeat exactly for the same seed, and choice 0 equals the
//! `n: 1` answer.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, BoxStream, Stream, StreamExt};
use serde_json::{json, Value};
use tessera_sampling::TokenLogprobs;
use tracing::Instrument;

use crate::grammar::{GrammarError, GrammarSpec};
use crate::metrics::{unix_ms, RequestRecord};
use crate::openai::tools::{
    self, Tool, ToolCall, ToolCallParser, ToolChoice, ToolEvent, ToolFormat,
};
use crate::openai::{
    self, ApiError, ChoiceOut, Delta, Endpoint, ParsedRequest, Prompt, ResponseFormat, ResponseMeta,
};
use crate::server::Gateway;
use crate::text::{Piece, TextStream};
use tessera_api::ClientId;
use tessera_api::{Check, GenerationRequest, ServedModel, SubmitError, Usage};
use tessera_grammar::Grammar;

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

/// A request ready to submit.
pub(crate) struct Prepared {
    pub prompt_tokens: Vec<u32>,
    pub grammar: Option<Grammar>,
    /// Read tool calls out of the text (tools given and `tool_choice` not `none`).
    pub tools: Option<(ToolFormat, Vec<Tool>)>,
    /// Completions with `echo`: the prompt text.
    pub echo: Option<String>,
}

/// The grammar a request's `tool_choice` or `response_format` asks for, and the parameter
/// that asked.
fn grammar_spec(req: &ParsedRequest, format: ToolFormat) -> Option<(GrammarSpec, &'static str)> {
    if let Some(g) = tools::tool_grammar(
        &req.tools,
        &req.tool_choice,
        req.parallel_tool_calls,
        format,
    ) {
        return Some((g, "tool_choice"));
    }
    match &req.response_format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some((
            GrammarSpec::JsonSchema(json!({"type": "object"})),
            "response_format",
        )),
        ResponseFormat::JsonSchema { schema, .. } => {
            Some((GrammarSpec::JsonSchema(schema.clone()), "response_format"))
        }
    }
}

/// Tokenizes, compiles the grammar and checks the request against the backend's features.
/// CPU work (templates, grammar compilation): call it off the async workers for big inputs.
pub(crate) fn prepare(gw: &Gateway, req: &ParsedRequest) -> Result<Prepared, ApiError> {
    crate::limits::check(req)?;
    // The one range check of every front end: the same value gets the same error everywhere.
    req.sampling(0, 0)
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string(), Some(e.param.name())))?;
    let m = gw.backend.model();
    let features = gw.backend.features();
    let format = ToolFormat::of(&m.template);
    let spec = grammar_spec(req, format);
    if req.logprobs.is_some() && !features.logprobs {
        return Err(ApiError::invalid(
            "'logprobs' is not supported by this backend (it does not report \
             log-probabilities).",
            Some("logprobs"),
        ));
    }
    if let Some((_, param)) = &spec {
        if !features.grammar {
            return Err(ApiError::invalid(
                format!(
                    "'{param}' needs constrained decoding, which this backend does not \
                     support."
                ),
                Some(param),
            ));
        }
    }
    let vocab = m.tokenizer.vocab_size();
    if let Some((id, _)) = req.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("Invalid 'logit_bias': token {id} is outside the vocabulary of {vocab}."),
            Some("logit_bias"),
        ));
    }
    let use_tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    let prompt_tokens = tokenize(&m, req, use_tools)?;
    if prompt_tokens.is_empty() {
        return Err(ApiError::invalid("The prompt is empty.", Some("prompt")));
    }
    let grammar = match spec {
        None => None,
        Some((spec, param)) => {
            let compiler = m
                .grammar_compiler()
                .map_err(|e| ApiError::invalid(e.to_string(), Some(param)))?;
            Some(compiler.compile(&spec).map_err(|e| match e {
                GrammarError::Invalid(msg) => {
                    ApiError::invalid(format!("Invalid schema or grammar: {msg}"), Some(param))
                }
                e => ApiError::invalid(e.to_string(), Some(param)),
            })?)
        }
    };
    let echo = match (&req.prompt, req.echo) {
        (Prompt::Text(t), true) => Some(t.clone()),
        (Prompt::Tokens(t), true) => Some(m.tokenizer.decode(t)),
        _ => None,
    };
    Ok(Prepared {
        prompt_tokens,
        grammar,
        tools: use_tools.then(|| (format, req.tools.clone())),
        echo,
    })
}

/// How many tokens the request's prompt is (tools included), without generating.
pub(crate) fn prompt_tokens(gw: &Gateway, req: &ParsedRequest) -> Result<usize, ApiError> {
    crate::limits::check(req)?;
    // The one range check of every front end: the same value gets the same error everywhere.
    req.sampling(0, 0)
        .validate()
        .map_err(|e| ApiError::invalid(e.to_string(), Some(e.param.name())))?;
    let m = gw.backend.model();
    let use_tools = !req.tools.is_empty() && req.tool_choice != ToolChoice::None;
    tokenize(&m, req, use_tools).map(|t| t.len())
}

fn tokenize(m: &ServedModel, req: &ParsedRequest, use_tools: bool) -> Result<Vec<u32>, ApiError> {
    let tools: &[Tool] = if use_tools { &req.tools } else { &[] };
    match &req.prompt {
        Prompt::Chat(messages) if req.continue_final_message => {
            continue_final_message(m, messages, tools)
        }
        Prompt::Chat(messages) => {
            let (messages, defs) = tools::prepare_messages(messages.clone(), tools, &m.template);
            m.template
                .encode_json(&m.tokenizer, &messages, defs.as_deref(), true)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
        }
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

/// The conversation up to its last message, an assistant turn begun by the client, rendered
/// for generation with that turn's text after the assistant's opening: the model continues
/// the reply instead of starting a new one (the template would close the turn).
fn continue_final_message(
    m: &ServedModel,
    messages: &[Value],
    tools: &[Tool],
) -> Result<Vec<u32>, ApiError> {
    let (last, earlier) = match messages.split_last() {
        Some((l, e))
            if l["role"] == "assistant" && l.get("tool_calls").is_none_or(Value::is_null) =>
        {
            (l, e)
        }
        _ => {
            return Err(ApiError::invalid(
                "To continue the final message it must be an assistant message without tool \
                 calls.",
                Some("messages"),
            ))
        }
    };
    let (earlier, defs) = tools::prepare_messages(earlier.to_vec(), tools, &m.template);
    let mut tokens = m
        .template
        .encode_json(&m.tokenizer, &earlier, defs.as_deref(), true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    // The begun reply is client text: tokenized as text, without a BOS.
    let begun = last["content"].as_str().unwrap_or_default();
    tokens.extend(m.tokenizer.encode(begun, false));
    Ok(tokens)
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

/// A body parsed by `parse` (a front end's parser), on a blocking thread when it is larger
/// than [`crate::limits::RequestLimits::inline_bytes`]: parsing is linear, but a few MiB of
/// JSON still take milliseconds the async workers owe to every other connection.
pub(crate) async fn parse_off_thread(
    body: &Bytes,
    parse: fn(&[u8]) -> Result<ParsedRequest, ApiError>,
) -> Result<ParsedRequest, ApiError> {
    let b = body.clone();
    off_thread_if_big(body.len(), move || parse(&b)).await
}

/// `work` for a body of `body_len` bytes: inline when small, otherwise on a blocking thread
/// (anything that grows with the input: parsing, templates, tokenizing, grammars).
pub(crate) async fn off_thread_if_big<T: Send + 'static>(
    body_len: usize,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    if body_len <= crate::limits::LIMITS.inline_bytes {
        return work();
    }
    tokio::task::spawn_blocking(work).await.unwrap_or_else(|e| {
        Err(ApiError::internal(format!(
            "the request's work failed: {e}"
        )))
    })
}

/// [`prepare`], on a blocking thread when it may take a while (big bodies, grammars).
pub(crate) async fn prepare_off_thread(
    gw: &Arc<Gateway>,
    req: &ParsedRequest,
    body_len: usize,
) -> Result<Prepared, ApiError> {
    let heavy = body_len > crate::limits::LIMITS.inline_bytes
        || req.response_format != ResponseFormat::Text
        || matches!(req.tool_choice, ToolChoice::Required | ToolChoice::Named(_));
    if !heavy {
        return prepare(gw, req);
    }
    let (g, r) = (gw.clone(), req.clone());
    tokio::task::spawn_blocking(move || prepare(&g, &r))
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("preparing failed: {e}"))))
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

/// The SSE body of a streamed response.
struct StreamState {
    t: Tracker,
    meta: ResponseMeta,
    served: Arc<ServedModel>,
    pieces:
        stream::SelectAll<BoxStream<'static, (usize, ChoicePiece, Option<std::time::Duration>)>>,
    /// Events ready to send.
    ready: VecDeque<SseEvent>,
    include_usage: bool,
    usages: Vec<Option<Usage>>,
    /// Text length per choice (completions' `text_offset`).
    offsets: Vec<usize>,
    ttft: Option<std::time::Duration>,
    ended: bool,
}

fn data(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

pub(crate) fn sse<S>(s: S) -> Response
where
    S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static,
{
    let mut r = Sse::new(s).into_response();
    r.headers_mut().insert(
        "x-accel-buffering",
        axum::http::HeaderValue::from_static("no"),
    );
    r
}

/// A choice as a stream of its pieces (with the choice's time to first token).
pub(crate) fn choice_stream(
    c: Choice,
) -> BoxStream<'static, (usize, ChoicePiece, Option<std::time::Duration>)> {
    stream::unfold(Some(c), |c| async move {
        let mut c = c?;
        let p = c.next().await?;
        let end = matches!(p, ChoicePiece::Done { .. } | ChoicePiece::Failed(_));
        let item = (c.index, p, c.ttft());
        Some((item, (!end).then_some(c)))
    })
    .boxed()
}

fn stream_response(
    t: Tracker,
    choices: Vec<Choice>,
    meta: ResponseMeta,
    include_usage: bool,
    echo: Option<String>,
    served: Arc<ServedModel>,
) -> Response {
    let n = choices.len();
    let mut ready = VecDeque::new();
    let mut offsets = vec![0; n];
    for c in &choices {
        match meta.endpoint {
            Endpoint::Chat => {
                ready.push_back(data(&openai::chunk(&meta, c.index, Delta::Role, None)))
            }
            Endpoint::Completion => {
                if let Some(e) = &echo {
                    offsets[c.index] = e.len();
                    ready.push_back(data(&openai::chunk(
                        &meta,
                        c.index,
                        Delta::Content(e),
                        None,
                    )));
                }
            }
        }
    }
    let span = tracing::info_span!("stream", id = %meta.id);
    let state = StreamState {
        t,
        meta,
        served,
        pieces: stream::select_all(choices.into_iter().map(choice_stream)),
        ready,
        include_usage,
        usages: vec![None; n],
        offsets,
        ttft: None,
        ended: false,
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

impl StreamState {
    fn lp(&mut self, index: usize, tokens: &[TokenLogprobs], text_len: usize) -> Option<Value> {
        if tokens.is_empty() {
            return None;
        }
        let v = logprobs_json(
            &self.served,
            self.meta.endpoint,
            tokens,
            self.offsets[index],
        );
        self.offsets[index] += text_len;
        Some(v)
    }
}

async fn next_sse(st: &mut StreamState) -> Option<SseEvent> {
    loop {
        if let Some(e) = st.ready.pop_front() {
            return Some(e);
        }
        if st.ended {
            return None;
        }
        match st.pieces.next().await {
            Some((index, piece, ttft)) => {
                st.ttft = st.ttft.or(ttft);
                match piece {
                    ChoicePiece::Content { text, logprobs } => {
                        let lp = st.lp(index, &logprobs, text.len());
                        if lp.is_none() {
                            st.offsets[index] += text.len();
                        }
                        let c = openai::chunk(&st.meta, index, Delta::Content(&text), lp);
                        st.ready.push_back(data(&c));
                    }
                    ChoicePiece::ToolCall { index: k, id, call } => {
                        let c =
                            openai::chunk(&st.meta, index, Delta::ToolCall(k, &id, &call), None);
                        st.ready.push_back(data(&c));
                    }
                    ChoicePiece::Done {
                        finish,
                        usage,
                        logprobs,
                        check,
                        ..
                    } => {
                        st.usages[index] = Some(usage);
                        let lp = st.lp(index, &logprobs, 0);
                        let mut c = openai::chunk(&st.meta, index, Delta::Finish(finish), lp);
                        mark(&mut c["choices"][0], check);
                        st.ready.push_back(data(&c));
                    }
                    ChoicePiece::Failed(m) => {
                        let e = ApiError::internal(format!("generation failed: {m}"));
                        let usage = total(&st.usages.iter().flatten().copied().collect::<Vec<_>>());
                        st.t.record(500, usage, st.ttft, e.message.clone());
                        st.ready.push_back(data(&e.body()));
                        st.ready.push_back(SseEvent::default().data("[DONE]"));
                        st.ended = true;
                    }
                }
            }
            None => {
                st.ended = true;
                let usages: Vec<Usage> = st.usages.iter().flatten().copied().collect();
                let usage = total(&usages);
                if !st.t.recorded {
                    st.t.record(200, usage, st.ttft, "stop".into());
                    if st.include_usage {
                        st.ready
                            .push_back(data(&openai::usage_chunk(&st.meta, usage)));
                    }
                    st.ready.push_back(SseEvent::default().data("[DONE]"));
                }
            }
        }
    }
}

impl Drop for StreamState {
    fn drop(&mut self) {
        if !self.t.recorded {
            tracing::info!(request = %self.t.id, "client disconnected mid-stream");
            let usage = total(&self.usages.iter().flatten().copied().collect::<Vec<_>>());
            self.t.record(200, usage, self.ttft, "cancelled".into());
        }
    }
}
