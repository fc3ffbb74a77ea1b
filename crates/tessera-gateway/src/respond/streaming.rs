//! The SSE body of a streamed response: the choices' pieces merged as they come, each formatted
//! for its endpoint, with usage at the end when asked.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, Stream, StreamExt};
use serde_json::Value;
use tessera_sampling::TokenLogprobs;
use tracing::Instrument;

use crate::openai::{self, ApiError, Delta, Endpoint, ResponseMeta};
use tessera_api::{ServedModel, Usage};

use super::{logprobs_json, mark, total, Choice, ChoicePiece, Tracker};

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

pub(super) fn stream_response(
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
