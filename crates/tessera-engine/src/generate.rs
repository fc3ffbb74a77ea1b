//! Generating text for one sequence: prefill the prompt in chunks, then decode token by token,
//! or, with a draft source ([`Generator::with_speculation`]), several tokens per forward pass
//! with the same text (see [`crate::speculate`]).

use std::time::{Duration, Instant};

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::speculate::keep_accepted;
use tessera_sampling::speculate::{settle, AdaptiveK, CostMeter, DraftSource};
use tessera_sampling::{sample, SamplingParams};

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `max_tokens` were generated.
    Length,
    /// An end-of-generation token was produced (not passed to the callback).
    EndOfGeneration,
    /// The callback asked to stop.
    Callback,
}

/// Counts and timings of one generation.
#[derive(Clone, Debug)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub stop: StopReason,
    /// What speculation did (all zero without a draft source).
    pub speculation: SpeculationStats,
}

/// Counts and timings of speculative decoding.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpeculationStats {
    /// Decode forward passes (each verifies zero or more drafts).
    pub verifications: usize,
    /// Draft tokens proposed and verified.
    pub drafted: usize,
    /// Draft tokens that stood.
    pub accepted: usize,
    /// Spent drafting.
    pub draft_time: Duration,
    /// Spent in the target's decode forward passes.
    pub verify_time: Duration,
}

impl SpeculationStats {
    /// Share of the drafted tokens that stood (0 when none was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }
}

/// A draft source and how many drafts to ask it for.
struct Speculation<'m> {
    source: Box<dyn DraftSource + 'm>,
    k: AdaptiveK,
    meter: CostMeter,
}

/// Generates for one sequence with a model that holds every layer.
pub struct Generator<'m> {
    model: &'m Model,
    kv: KvCache,
    params: SamplingParams,
    /// Every token of the sequence so far (prompt and generated).
    history: Vec<u32>,
    /// Tokens per prefill forward pass.
    pub prefill_chunk: usize,
    speculation: Option<Speculation<'m>>,
}

impl<'m> Generator<'m> {
    /// A generator with room for `capacity` positions.
    pub fn new(model: &'m Model, params: SamplingParams, capacity: usize) -> Self {
        Self {
            model,
            kv: model.new_kv(capacity),
            params,
            history: Vec::new(),
            prefill_chunk: 64,
            speculation: None,
        }
    }

    /// Drafts with `source`, `k` choosing how many tokens per verification. The text is the
    /// same as without; only the number of forward passes changes.
    pub fn with_speculation(mut self, source: Box<dyn DraftSource + 'm>, k: AdaptiveK) -> Self {
        self.speculation = Some(Speculation {
            source,
            k,
            meter: CostMeter::default(),
        });
        self
    }

    pub fn history(&self) -> &[u32] {
        &self.history
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// Feeds `prompt`, then generates up to `max_tokens`, calling `on_token` for each (return
    /// `false` to stop). Stops early at any of `eog` (end-of-generation ids).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        eog: &[u32],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<GenerationStats> {
        if prompt.is_empty() {
            return Err(EngineError::BadInput("empty prompt".into()));
        }
        let limit = self.kv.capacity();
        if self.kv.len() + prompt.len() > limit {
            return Err(EngineError::ContextOverflow {
                needed: self.kv.len() + prompt.len(),
                limit,
            });
        }
        let t0 = Instant::now();
        let mut logits = None;
        for chunk in prompt.chunks(self.prefill_chunk.max(1)) {
            logits = Some(self.model.forward_last(chunk, &mut self.kv)?);
            self.history.extend_from_slice(chunk);
        }
        let logits = logits.expect("prompt is not empty");
        let prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let mut spec = SpeculationStats::default();
        let mut generated = 0;
        let mut stop = StopReason::Length;
        // `row` is the distribution of the next position; after it is drawn, each round
        // verifies the drawn token and any drafts in one pass.
        let mut rows = logits;
        let mut drafts: Vec<u32> = Vec::new();
        'decode: loop {
            let params = &self.params;
            let history = &mut self.history;
            let mut ended = false;
            let settled = settle::<()>(&drafts, |i| {
                if generated >= max_tokens || ended {
                    return Ok(None);
                }
                let row = if drafts.is_empty() {
                    rows.last()
                } else {
                    rows.row(i)
                };
                let pos = history.len() as u64;
                let token = sample(row, params, history, pos);
                if eog.contains(&token) {
                    stop = StopReason::EndOfGeneration;
                    ended = true;
                    return Ok(None);
                }
                history.push(token);
                generated += 1;
                if !on_token(token) {
                    stop = StopReason::Callback;
                    ended = true;
                }
                Ok(Some(token))
            })
            .expect("drawing does not fail");
            if !drafts.is_empty() {
                let before = self.kv.len() - drafts.len() - 1;
                keep_accepted(&mut self.kv, before, settled.accepted);
                spec.drafted += drafts.len();
                spec.accepted += settled.accepted;
                if let Some(s) = &mut self.speculation {
                    s.k.record(settled);
                }
            }
            if ended || generated >= max_tokens || self.kv.len() >= limit {
                break 'decode;
            }
            // The last drawn token is not in the cache yet; drafts follow it.
            let last = *self.history.last().expect("a token was drawn");
            let room = (max_tokens - generated - 1).min(limit - self.kv.len() - 1);
            drafts = match &mut self.speculation {
                Some(s) if room > 0 => {
                    let k = s.k.next_k(&s.meter.costs(1)).min(room);
                    let t = Instant::now();
                    let mut d = if k > 0 {
                        s.source.propose(&self.history, k)
                    } else {
                        Vec::new()
                    };
                    d.truncate(k);
                    let took = t.elapsed();
                    spec.draft_time += took;
                    s.meter.record_draft(d.len(), took.as_secs_f64());
                    d
                }
                _ => Vec::new(),
            };
            let t = Instant::now();
            rows = if drafts.is_empty() {
                self.model.forward_last(&[last], &mut self.kv)?
            } else {
                self.model.verify(last, &drafts, &mut self.kv)?
            };
            let took = t.elapsed();
            spec.verify_time += took;
            spec.verifications += 1;
            if let Some(s) = &mut self.speculation {
                s.meter.record_forward(drafts.len() + 1, took.as_secs_f64());
            }
        }
        Ok(GenerationStats {
            prompt_tokens: prompt.len(),
            generated_tokens: generated,
            prefill_time,
            decode_time: t1.elapsed(),
            stop,
            speculation: spec,
        })
    }
}
