//! From a backend's token events to the text a client sees: UTF-8 assembled across tokens
//! ([`Utf8Assembler`], the byte half of [`tessera_model::StreamDecoder`], since the tokenizer is
//! reached through the [`ServedModel`])
//! and stop strings cut out ([`StopMatcher`]). A stop string ends the request here: the handle
//! is dropped, which cancels the sequence in the backend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_model::Utf8Assembler;
use tessera_sampling::StopMatcher;
use tessera_sampling::TokenLogprobs;

use tessera_api::{Check, Event, FinishReason, RequestHandle, ServedModel, Usage};

/// A step of a request's text.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    /// More text (never empty).
    Text(String),
    Done {
        reason: FinishReason,
        usage: Usage,
        /// The backend's [`Check`] of the answer, where it makes one.
        check: Option<Check>,
    },
    Failed(String),
}

/// Turns one request's events into text pieces.
#[derive(Debug)]
pub struct TextStream {
    handle: Option<RequestHandle>,
    served: Arc<ServedModel>,
    utf8: Utf8Assembler,
    stop: StopMatcher,
    prompt_tokens: usize,
    /// Prompt tokens the backend did not prefill again ([`Event::PromptCached`]).
    cached_tokens: usize,
    tokens: usize,
    started: Instant,
    first_token: Option<Duration>,
    finished: bool,
    /// The backend's [`Event::Checked`], once it came.
    check: Option<Check>,
    /// A `Done` to return after the text that preceded it.
    deferred: Option<Piece>,
    /// Log-probabilities of tokens received and not yet taken ([`TextStream::take_logprobs`]).
    logprobs: Vec<TokenLogprobs>,
}

impl TextStream {
    pub fn new(
        handle: RequestHandle,
        served: Arc<ServedModel>,
        stop: &[String],
        prompt_tokens: usize,
        started: Instant,
    ) -> Self {
        Self {
            handle: Some(handle),
            served,
            utf8: Utf8Assembler::default(),
            stop: StopMatcher::new(stop.iter().cloned()),
            prompt_tokens,
            cached_tokens: 0,
            tokens: 0,
            started,
            first_token: None,
            finished: false,
            check: None,
            deferred: None,
            logprobs: Vec::new(),
        }
    }

    /// The log-probabilities of the tokens behind the text returned so far (and possibly of a
    /// few tokens whose text is still held back), when the request asked for them.
    pub fn take_logprobs(&mut self) -> Vec<TokenLogprobs> {
        std::mem::take(&mut self.logprobs)
    }

    /// Time from arrival to the first token, once there was one.
    pub fn ttft(&self) -> Option<Duration> {
        self.first_token
    }

    /// Tokens generated so far.
    pub fn completion_tokens(&self) -> usize {
        self.tokens
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// The stop string that ended the text, if one did.
    pub fn stop_sequence(&self) -> Option<&str> {
        self.stop.matched()
    }

    /// Whether a `Done` or `Failed` piece was returned.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// The next piece; `None` after `Done`/`Failed`. `on_token` is called once per token
    /// event (for throughput metrics) and `on_first` at the first.
    pub async fn next_piece(&mut self, on_token: &mut (dyn FnMut(bool) + Send)) -> Option<Piece> {
        if let Some(p) = self.deferred.take() {
            self.finished = true;
            return Some(p);
        }
        if self.finished {
            return None;
        }
        loop {
            let handle = self.handle.as_mut()?;
            let Some(event) = handle.next_event().await else {
                self.handle = None;
                self.finished = true;
                return Some(Piece::Failed("the backend dropped the request".into()));
            };
            let id = match event {
                Event::Token(id) => id,
                Event::PromptCached(n) => {
                    self.cached_tokens = n;
                    continue;
                }
                Event::Checked(c) => {
                    self.check = Some(c);
                    continue;
                }
                Event::TokenLogprobs(lp) => {
                    let id = lp.token;
                    self.logprobs.push(lp);
                    id
                }
                Event::Finished { reason, usage } => {
                    self.handle = None;
                    let mut tail = self.utf8.finish();
                    let step = self.stop.push(&tail);
                    tail = step.emit;
                    if !step.stopped {
                        tail.push_str(&self.stop.finish());
                    }
                    let reason = if step.stopped {
                        FinishReason::Stop
                    } else {
                        reason
                    };
                    self.tokens = usage.completion_tokens;
                    return Some(self.done_with_text(tail, reason));
                }
                Event::Failed { message } => {
                    self.handle = None;
                    self.finished = true;
                    return Some(Piece::Failed(message));
                }
            };
            self.tokens += 1;
            let first = self.first_token.is_none();
            if first {
                self.first_token = Some(self.started.elapsed());
            }
            on_token(first);
            let text = self.utf8.push(self.served.tokenizer.piece_bytes(id));
            let step = self.stop.push(&text);
            if step.stopped {
                // Cancel in the backend: the rest is not wanted.
                self.handle = None;
                return Some(self.done_with_text(step.emit, FinishReason::Stop));
            }
            if !step.emit.is_empty() {
                return Some(Piece::Text(step.emit));
            }
        }
    }

    /// `Done`, preceded by `text` if there is any (returned as `Text` now; `Done` next call).
    fn done_with_text(&mut self, text: String, reason: FinishReason) -> Piece {
        let usage = Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.tokens,
            cached_tokens: self.cached_tokens,
        };
        let done = Piece::Done {
            reason,
            usage,
            check: self.check,
        };
        if text.is_empty() {
            self.finished = true;
            done
        } else {
            self.deferred = Some(done);
            Piece::Text(text)
        }
    }
}
