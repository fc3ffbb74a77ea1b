//! Embedding requests on the engine thread, between generation steps.
//!
//! Each turn of the engine loop runs at most one embedding pass of at most `budget` token
//! rows (the scheduler's `max_batch_tokens`, what a generation step may hold), then the
//! generation step: a large embedding request delays decoding by one bounded pass per token
//! rather than by its whole length. A pass packs inputs first come, first served — many short
//! inputs of several requests share one pass; a long input is split over several, its KV cache
//! kept between them ([`EmbedQueue::partial`]). Kernels are batch-invariant and a
//! [`Pooler`] gives the same bits however a sequence is chunked, so every vector equals
//! [`Model::sequence_embedding`] of that input alone.

use std::collections::VecDeque;

use tessera_api::{EmbeddingRequest, EmbeddingSender, Embeddings};
use tessera_engine::embedding::pool_rows;
use tessera_engine::{KvCache, LocalExperts, Model, Pooler, Pooling, SeqStep};

/// One request being embedded.
pub(crate) struct EmbedJob {
    pub(crate) req: EmbeddingRequest,
    pub(crate) reply: EmbeddingSender,
    /// The vectors of its first inputs, in order.
    done: Vec<Vec<f32>>,
}

impl EmbedJob {
    pub(crate) fn new(req: EmbeddingRequest, reply: EmbeddingSender) -> Self {
        let done = Vec::with_capacity(req.inputs.len());
        Self { req, reply, done }
    }

    fn is_complete(&self) -> bool {
        self.done.len() == self.req.inputs.len()
    }
}

/// An input run part way: its cache and what its rows pooled so far.
struct Partial {
    kv: KvCache,
    pooler: Pooler,
}

/// The embedding work the engine thread holds, first come, first served.
pub(crate) struct EmbedQueue {
    pooling: Pooling,
    jobs: VecDeque<EmbedJob>,
    /// The front job's next input, when a pass ran only part of it.
    partial: Option<Partial>,
}

/// One input's rows in a pass: positions `start..start + n` of input `input` of job `job`.
struct Segment {
    job: usize,
    input: usize,
    start: usize,
    n: usize,
}

impl EmbedQueue {
    pub(crate) fn new(pooling: Pooling) -> Self {
        Self {
            pooling,
            jobs: VecDeque::new(),
            partial: None,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.jobs.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    pub(crate) fn push(&mut self, job: EmbedJob) {
        self.jobs.push_back(job);
    }

    /// KV bytes held between passes.
    pub(crate) fn kv_bytes(&self) -> usize {
        self.partial.as_ref().map_or(0, |p| p.kv.bytes())
    }

    /// Drops the jobs whose client has gone (the front's partial input with it); their count.
    pub(crate) fn drop_cancelled(&mut self) -> usize {
        let before = self.jobs.len();
        if self.jobs.front().is_some_and(|j| j.reply.is_closed()) {
            self.partial = None;
        }
        self.jobs.retain(|j| !j.reply.is_closed());
        before - self.jobs.len()
    }

    /// Tells every job why it cannot be answered, and empties the queue.
    pub(crate) fn fail_all(&mut self, message: &str) {
        self.partial = None;
        for j in self.jobs.drain(..) {
            let _ = j.reply.send(Err(message.to_string()));
        }
    }

    /// The next pass: inputs in order, `budget` rows at most.
    fn plan(&self, budget: usize) -> Vec<Segment> {
        let mut segments = Vec::new();
        let mut left = budget;
        for (j, job) in self.jobs.iter().enumerate() {
            for i in job.done.len()..job.req.inputs.len() {
                if left == 0 {
                    return segments;
                }
                let start = match (&self.partial, segments.is_empty()) {
                    (Some(p), true) => p.pooler.rows(),
                    _ => 0,
                };
                let n = (job.req.inputs[i].len() - start).min(left);
                left -= n;
                segments.push(Segment {
                    job: j,
                    input: i,
                    start,
                    n,
                });
            }
        }
        segments
    }

    /// Runs one pass of at most `budget` rows and answers the jobs it completes. Returns the
    /// rows run. A failed pass fails the jobs it held.
    pub(crate) fn step(&mut self, model: &Model, budget: usize) -> usize {
        let segments = self.plan(budget.max(1));
        if segments.is_empty() {
            return 0;
        }
        let n_embd = model.config().n_embd;
        let mut states: Vec<Partial> = Vec::with_capacity(segments.len());
        for (k, s) in segments.iter().enumerate() {
            let state = match self.partial.take() {
                Some(p) if k == 0 => p,
                _ => Partial {
                    kv: model.new_kv(self.jobs[s.job].req.inputs[s.input].len()),
                    pooler: Pooler::new(self.pooling, n_embd),
                },
            };
            states.push(state);
        }
        if let Err(e) = self.run_pass(model, &segments, &mut states) {
            tracing::error!(error = %e, "embedding pass failed; failing its requests");
            let held = segments.last().map_or(0, |s| s.job + 1);
            self.partial = None;
            for j in self.jobs.drain(..held) {
                let _ = j
                    .reply
                    .send(Err(format!("computing embeddings failed: {e}")));
            }
            return 0;
        }
        for (s, state) in segments.iter().zip(states) {
            let len = self.jobs[s.job].req.inputs[s.input].len();
            if state.pooler.rows() == len {
                self.jobs[s.job].done.push(state.pooler.finish());
            } else {
                // Only the last segment can stop short of its input's end.
                self.partial = Some(state);
            }
        }
        while self.jobs.front().is_some_and(EmbedJob::is_complete) {
            let job = self.jobs.pop_front().expect("checked above");
            let prompt_tokens = job.req.inputs.iter().map(Vec::len).sum();
            tracing::debug!(request = job.req.id, prompt_tokens, "embedded");
            let _ = job.reply.send(Ok(Embeddings {
                vectors: job.done,
                prompt_tokens,
            }));
        }
        segments.iter().map(|s| s.n).sum()
    }

    /// One forward pass over the segments' tokens, each row pooled into its state.
    fn run_pass(
        &self,
        model: &Model,
        segments: &[Segment],
        states: &mut [Partial],
    ) -> tessera_engine::Result<()> {
        let mut tokens = Vec::new();
        let mut batch = Vec::with_capacity(segments.len());
        for s in segments {
            let input = &self.jobs[s.job].req.inputs[s.input];
            tokens.extend_from_slice(&input[s.start..s.start + s.n]);
            batch.push(SeqStep {
                n_tokens: s.n,
                start_pos: s.start,
            });
        }
        let mut hidden = model.embed(&tokens)?;
        {
            let mut kvs: Vec<&mut KvCache> = states.iter_mut().map(|p| &mut p.kv).collect();
            model.run_layers(
                0..model.config().n_layer,
                &mut hidden,
                &batch,
                &mut kvs,
                &mut LocalExperts(model),
            )?;
        }
        let mut row = 0;
        for (s, state) in segments.iter().zip(states.iter_mut()) {
            let len = self.jobs[s.job].req.inputs[s.input].len();
            pool_rows(model, &mut state.pooler, &hidden.rows(row..row + s.n), len)?;
            row += s.n;
        }
        Ok(())
    }
}
