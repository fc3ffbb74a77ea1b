//! Generating text for one sequence: prefill the prompt in chunks, then decode token by token.

use std::time::{Duration, Instant};

use crate::error::{EngineError, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sampling::{sample, SamplingParams};

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
        }
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
        let mut logits = logits.expect("prompt is not empty");
        let prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let mut generated = 0;
        let mut stop = StopReason::Length;
        while generated < max_tokens {
            let pos = self.history.len() as u64;
            let token = sample(logits.last(), &self.params, &self.history, pos);
            if eog.contains(&token) {
                stop = StopReason::EndOfGeneration;
                break;
            }
            self.history.push(token);
            generated += 1;
            if !on_token(token) {
                stop = StopReason::Callback;
                break;
            }
            if generated == max_tokens || self.kv.len() >= limit {
                break;
            }
            logits = self.model.forward_last(&[token], &mut self.kv)?;
        }
        Ok(GenerationStats {
            prompt_tokens: prompt.len(),
            generated_tokens: generated,
            prefill_time,
            decode_time: t1.elapsed(),
            stop,
        })
    }
}
