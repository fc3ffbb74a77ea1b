//! The one endpoint: an OpenAI-compatible HTTP API with continuous batching, Prometheus
//! metrics and a live web dashboard, in front of a [`Backend`].
//!
//! # A request's path
//!
//! 1. **HTTP** ([`server`]): `POST /v1/chat/completions` arrives (after the API-key check when a
//!    key is set). The body is parsed strictly ([`openai`]); a malformed body is a 400 in
//!    OpenAI's error shape, an unknown `model` a 404. The messages go through the model's chat
//!    template and tokenizer ([`ServedModel`]).
//! 2. **Admission** ([`Backend::submit`]): the backend checks the context limit (400) and its
//!    bounded queue (429 with `Retry-After`), or says it is not serving (503), and otherwise
//!    returns a [`RequestHandle`] at once.
//! 3. **Scheduling** ([`scheduler`], driven by the backend, e.g. `tessera_local`'s engine
//!    thread): each step puts every running sequence into *one* forward pass — one token for
//!    each decoding sequence, prompt chunks for new ones — samples, and sends each its token as
//!    an [`Event`].
//! 4. **Text** ([`text`]): the gateway assembles UTF-8 across tokens and cuts stop strings,
//!    then answers with one JSON body or with SSE chunks ending `data: [DONE]`.
//! 5. **Cancellation**: if the client goes away, the response stream is dropped, which drops
//!    the handle and closes the event channel; the backend sees it closed before its next step
//!    and drops the sequence with its KV cache.
//!
//! `tessera_local`'s crate documentation shows the whole server in a dozen lines, over its
//! single-process backend.
//!
//! The same path serves the other front ends: [`anthropic`] (Messages), [`responses`]
//! (OpenAI's Responses API), [`ollama`] (Ollama's `/api/chat` and `/api/generate`) and
//! `/tokenize`/`/detokenize`. Embeddings ([`embeddings`]: `/v1/embeddings`, Ollama's
//! `/api/embed`) take their own path to the backend, [`Backend::embed`]. Each parses its body into one request form, whose `n` choices, tool calls ([`openai::tools`]), log-probabilities and grammar
//! ([`grammar`], llguidance masks applied by the [`scheduler`] before each draw) are handled
//! once; every parameter is honoured or refused with a 400 naming it.
//!
//! The distributed coordinator plugs in by implementing [`Backend`] (submit tokenized requests,
//! stream token events, watch for closed channels, report a [`ClusterStatus`]); everything in
//! this crate above that trait is shared. The trait and the types it speaks live in
//! [`tessera_api`], so a backend (the coordinator) implements it without compiling this server.
//!
//! [`Backend`]: tessera_api::Backend
//! [`Backend::submit`]: tessera_api::Backend::submit
//! [`Backend::embed`]: tessera_api::Backend::embed
//! [`ServedModel`]: tessera_api::ServedModel
//! [`RequestHandle`]: tessera_api::RequestHandle
//! [`Event`]: tessera_api::Event
//! [`ClusterStatus`]: tessera_api::ClusterStatus

#![forbid(unsafe_code)]

pub mod admission;
pub mod anthropic;
pub mod api_keys;
pub mod cors;
pub mod dashboard;
pub mod embeddings;
pub mod grammar;
pub mod limits;
pub mod metrics;
pub mod models;
pub mod ollama;
pub mod openai;
mod respond;
pub mod responses;
pub mod scheduler;
pub mod server;
pub mod testing;
pub mod text;
mod tokens;

pub use api_keys::{ApiKeys, KeyFileError};
pub use scheduler::SchedulerConfig;
pub use server::{check_exposure, router, serve, serve_app, Gateway, GatewayConfig, KeyRequired};
