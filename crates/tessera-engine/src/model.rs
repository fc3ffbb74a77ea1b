//! A loaded (part of a) model and its partial-execution API:
//! [`Model::embed`] → [`Model::run_layers`] → [`Model::head`]. A pipeline stage calls only the
//! parts it holds; a whole model calls all three ([`Model::forward`]).

use std::ops::Range;

use serde::{Deserialize, Serialize};
use tessera_model::{GgufFile, ModelConfig};

use crate::error::{EngineError, Result};
use crate::exec::matmul_once;
use crate::expert_store::{ExpertStats, ExpertStore, ExpertStreaming};
use crate::kernels::ThreadPool;
use crate::kv::{KvCache, KvShape, KvType};
use crate::moe::{ExpertExecutor, LocalExperts, Routing};
use crate::ops::{rms_norm, RopeTable};
use crate::run_ahead::{Ahead, Estimate};
use crate::timeline::{Lane, SpanKind};
use crate::weights::{LayerCore, LayerWeights, LoadSpec, ModelWeights};

/// Hidden states: `n_tokens` rows of `n_embd` floats, row-major.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Hidden {
    pub n_tokens: usize,
    pub n_embd: usize,
    pub data: Vec<f32>,
}

impl Hidden {
    pub fn zeros(n_tokens: usize, n_embd: usize) -> Self {
        Self {
            n_tokens,
            n_embd,
            data: vec![0.0; n_tokens * n_embd],
        }
    }

    pub fn row(&self, t: usize) -> &[f32] {
        &self.data[t * self.n_embd..(t + 1) * self.n_embd]
    }

    pub fn row_mut(&mut self, t: usize) -> &mut [f32] {
        &mut self.data[t * self.n_embd..(t + 1) * self.n_embd]
    }

    /// Rows `tokens` (in that order) as a new `Hidden`: what is sent to a part that computes
    /// the experts of those tokens.
    pub fn gather(&self, tokens: &[usize]) -> Self {
        let mut data = Vec::with_capacity(tokens.len() * self.n_embd);
        for &t in tokens {
            data.extend_from_slice(self.row(t));
        }
        Self {
            n_tokens: tokens.len(),
            n_embd: self.n_embd,
            data,
        }
    }

    /// Rows `rows` as a new `Hidden`.
    pub fn rows(&self, rows: Range<usize>) -> Self {
        Self {
            n_tokens: rows.len(),
            n_embd: self.n_embd,
            data: self.data[rows.start * self.n_embd..rows.end * self.n_embd].to_vec(),
        }
    }
}

/// Output logits: `n_tokens` rows of `vocab_size` floats.
#[derive(Clone, Debug, PartialEq)]
pub struct Logits {
    pub n_tokens: usize,
    pub vocab_size: usize,
    pub data: Vec<f32>,
}

impl Logits {
    pub fn row(&self, t: usize) -> &[f32] {
        &self.data[t * self.vocab_size..(t + 1) * self.vocab_size]
    }

    /// The last row (the next-token distribution after a prompt).
    pub fn last(&self) -> &[f32] {
        self.row(self.n_tokens - 1)
    }
}

/// How rows of a batch belong to sequences: the next `n_tokens` rows are positions
/// `start_pos..start_pos + n_tokens` of one sequence (with its own [`KvCache`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqStep {
    pub n_tokens: usize,
    pub start_pos: usize,
}

/// A loaded model, or the part of one a [`LoadSpec`] asked for.
pub struct Model {
    config: ModelConfig,
    weights: ModelWeights,
    pool: ThreadPool,
    /// Streamed experts (see [`Model::load_streaming`]).
    store: Option<ExpertStore>,
    /// Element type of the caches [`Model::new_kv`] makes.
    kv_type: KvType,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("arch", &self.config.arch)
            .field("spec", &self.weights.spec)
            .field("threads", &self.pool.n_threads())
            .finish()
    }
}

/// Scratch buffers for one `run_layers` call, reused by every layer.
#[derive(Default)]
pub(crate) struct Scratch {
    pub xn: Vec<f32>,
    /// FFN input (normed hidden), shared with expert executors.
    pub normed: Hidden,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub attn: Vec<f32>,
    pub proj: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub rope: RopeTable,
    /// For each row: (sequence index, position).
    pub rows: Vec<(usize, usize)>,
}

/// A model's thread pool; the first one also sets how this process's allocator keeps freed
/// memory ([`keep_freed_memory`]).
fn model_pool(threads: usize) -> ThreadPool {
    keep_freed_memory();
    ThreadPool::new(threads)
}

/// A forward pass allocates and frees tens of MiB per layer (an MoE layer's per-expert
/// activations and outputs: about 60 MiB at 512 tokens of a 64-expert bench model). With
/// glibc's defaults, blocks past its adaptive mmap threshold are unmapped when freed and the
/// heap's top is handed back past 2× that, so each layer faulted its buffers in again, page by
/// page: 48 thousand page faults per 512-token prefill of that model, each a few µs of kernel
/// time (2-7% of the prefill's CPU time on a Zen 5 VM). Serving blocks up to 32 MiB
/// (glibc's largest mmap threshold) from the heap, and trimming its top only past 64 MiB free,
/// leaves none after the first pass (32 MiB did as well; at most that much freed memory stays
/// resident, little beside an expert budget). Process-wide and once.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes glibc's allocation thresholds; any value is valid
            // (a refused one leaves the default).
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
            }
        });
    }
}

impl Model {
    /// Loads the part of `g` that `spec` describes, computing with `threads` threads.
    pub fn load(
        g: &GgufFile,
        spec: LoadSpec,
        threads: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let config = ModelConfig::from_gguf(g)?;
        let weights = ModelWeights::load(g, &config, spec, progress)?;
        Ok(Self {
            config,
            weights,
            pool: model_pool(threads),
            store: None,
            kv_type: KvType::default(),
        })
    }

    /// As [`Model::load`], but the experts `spec` selects are not loaded: they are streamed
    /// from the file through an [`ExpertStore`] that keeps at most `streaming.budget_bytes` of
    /// them in memory. Outputs are bit-identical to a full load. Errors if the budget cannot
    /// hold one expert. A model without experts loads as with [`Model::load`].
    pub fn load_streaming(
        g: &GgufFile,
        spec: LoadSpec,
        streaming: ExpertStreaming,
        threads: usize,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        let config = ModelConfig::from_gguf(g)?;
        if !config.is_moe() {
            return Self::load(g, spec, threads, progress);
        }
        // Validate the layer range (and the budget) before reading anything.
        let mut lazy = spec.clone();
        lazy.experts = crate::weights::ExpertSelection::PerLayer(Vec::new());
        let mut weights = ModelWeights::load(g, &config, lazy, progress)?;
        let store = ExpertStore::open(g, &config, &spec, streaming)?;
        // The streamed experts' biases (gpt-oss) are small: loaded now, kept resident.
        let mut quiet = |_: u64, _: u64| {};
        let mut loader = crate::weights::Loader::new(g, &mut quiet);
        for (lw, il) in weights.layers.iter_mut().zip(spec.layers.clone()) {
            lw.expert_bias =
                crate::weights::load_expert_bias(&mut loader, &config, &spec.experts, il)?;
        }
        weights.spec = spec;
        Ok(Self {
            config,
            weights,
            pool: model_pool(threads),
            store: Some(store),
            kv_type: KvType::default(),
        })
    }

    /// Counters of the expert store, when experts are streamed.
    pub fn expert_stats(&self) -> Option<ExpertStats> {
        self.store.as_ref().map(ExpertStore::stats)
    }

    /// Blocks until the expert store's cache holds what its budget allows
    /// ([`ExpertStreaming::fill`]); returns at once where no expert is streamed or filling is
    /// off. A model that fits is read whole by its load; this is the same for one that streams.
    pub fn wait_experts_filled(&self) {
        if let Some(store) = &self.store {
            store.wait_filled();
        }
    }

    pub(crate) fn expert_store(&self) -> Option<&ExpertStore> {
        self.store.as_ref()
    }

    /// The first layer after `layer` in this part that routes to experts (`layer + 1`, or
    /// past Llama 4's dense layers between MoE ones): the one whose experts to read ahead.
    pub(crate) fn next_moe_layer(&self, layer: usize) -> Option<usize> {
        (layer + 1..self.spec().layers.end).find(|&l| self.config().is_moe_layer(l))
    }

    /// The whole model.
    pub fn load_full(g: &GgufFile, threads: usize) -> Result<Self> {
        let config = ModelConfig::from_gguf(g)?;
        Self::load(g, LoadSpec::full(&config), threads, &mut |_, _| {})
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn spec(&self) -> &LoadSpec {
        &self.weights.spec
    }

    pub fn weights(&self) -> &ModelWeights {
        &self.weights
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }

    /// Bytes of weights this part keeps resident (see [`ModelWeights::resident_bytes`]), with
    /// the streamed experts held now.
    pub fn resident_bytes(&self) -> usize {
        self.weights.resident_bytes()
            + self
                .store
                .as_ref()
                .map_or(0, |s| s.resident_bytes() as usize)
    }

    /// Whether this part holds (or streams) expert `expert` of layer `layer`.
    pub fn holds_expert(&self, layer: usize, expert: usize) -> bool {
        if self.store.is_some() {
            return self.weights.spec.layers.contains(&layer)
                && self.config.is_moe_layer(layer)
                && expert < self.config.n_expert
                && self.weights.spec.experts.holds(layer, expert);
        }
        self.layer_weights(layer)
            .ok()
            .and_then(|l| l.experts.get(expert))
            .is_some_and(Option::is_some)
    }

    /// The experts `routing` uses in layer `layer` that this part holds (or streams).
    pub(crate) fn held_experts(&self, layer: usize, routing: &Routing) -> Vec<usize> {
        routing
            .experts_used()
            .into_iter()
            .filter(|&e| self.holds_expert(layer, e))
            .collect()
    }

    /// Sets the element type of the KV caches [`Model::new_kv`] makes (F16 unless set). Errors
    /// if this model's heads cannot use it (Q8_0 needs head widths that are multiples of 32).
    pub fn set_kv_type(&mut self, kv_type: KvType) -> Result<()> {
        kv_type.check(self.kv_shape())?;
        self.kv_type = kv_type;
        Ok(())
    }

    /// [`Model::set_kv_type`], by value.
    pub fn with_kv_type(mut self, kv_type: KvType) -> Result<Self> {
        self.set_kv_type(kv_type)?;
        Ok(self)
    }

    /// Element type of the caches [`Model::new_kv`] makes.
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// Geometry of this model's KV cache per layer.
    pub fn kv_shape(&self) -> KvShape {
        KvShape::from_config(&self.config)
    }

    /// Bytes of KV cache for `positions` positions of the layers this part holds, fully grown.
    pub fn kv_bytes_for(&self, positions: usize) -> u64 {
        KvCache::bytes_for(
            self.kv_type,
            self.kv_shape(),
            self.weights.spec.layers.len(),
            positions.min(self.config.context_length),
        )
    }

    /// A fresh KV cache (of [`Model::kv_type`]) for the layers this part holds, for up to
    /// `capacity` positions.
    pub fn new_kv(&self, capacity: usize) -> KvCache {
        KvCache::new(
            &self.config,
            self.weights.spec.layers.clone(),
            capacity,
            self.kv_type,
        )
        .expect("the KV type was checked against this model when it was set")
    }

    pub(crate) fn layer_weights(&self, layer: usize) -> Result<&LayerWeights> {
        let loaded = self.weights.spec.layers.clone();
        if !loaded.contains(&layer) {
            return Err(EngineError::LayersNotLoaded {
                requested: layer..layer + 1,
                loaded,
            });
        }
        Ok(&self.weights.layers[layer - loaded.start])
    }

    pub(crate) fn core(&self, layer: usize) -> Result<&LayerCore> {
        self.layer_weights(layer)?
            .core
            .as_ref()
            .ok_or(EngineError::NotLoaded {
                what: "the layer's attention and norm weights",
            })
    }

    /// Looks up the embeddings of `tokens`.
    pub fn embed(&self, tokens: &[u32]) -> Result<Hidden> {
        let w = &self.weights;
        let rows: &dyn Fn(usize, &mut [f32]) = match (&w.token_rows, &w.token_embd) {
            (Some(r), _) => &|t, out| r.dequantize_row(t, out),
            (None, Some(m)) if w.spec.embed => &|t, out| m.dequantize_row(t, out),
            _ => {
                return Err(EngineError::NotLoaded {
                    what: "the token embedding",
                })
            }
        };
        let mut h = Hidden::zeros(tokens.len(), self.config.n_embd);
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= self.config.vocab_size {
                return Err(EngineError::BadToken {
                    token: t,
                    vocab_size: self.config.vocab_size,
                });
            }
            rows(t as usize, h.row_mut(i));
        }
        Ok(h)
    }

    /// Runs layers `layers` over `hidden` in place. `batch` says which rows belong to which
    /// sequence (in order), `kv[i]` is the cache of sequence `i`, `experts` computes MoE experts.
    /// Nothing is modified if the inputs are refused.
    pub fn run_layers(
        &self,
        layers: Range<usize>,
        hidden: &mut Hidden,
        batch: &[SeqStep],
        kv: &mut [&mut KvCache],
        experts: &mut dyn ExpertExecutor,
    ) -> Result<()> {
        let loaded = self.weights.spec.layers.clone();
        if layers.start > layers.end || layers.start < loaded.start || layers.end > loaded.end {
            return Err(EngineError::LayersNotLoaded {
                requested: layers,
                loaded,
            });
        }
        for l in layers.clone() {
            self.core(l)?;
        }
        let n: usize = batch.iter().map(|s| s.n_tokens).sum();
        if n != hidden.n_tokens || hidden.n_embd != self.config.n_embd {
            return Err(EngineError::BadInput(format!(
                "batch covers {n} rows but hidden is {}x{} (model width {})",
                hidden.n_tokens, hidden.n_embd, self.config.n_embd
            )));
        }
        if kv.len() != batch.len() {
            return Err(EngineError::BadInput(format!(
                "{} sequences but {} KV caches",
                batch.len(),
                kv.len()
            )));
        }
        for (s, c) in batch.iter().zip(kv.iter()) {
            let needed = s.start_pos + s.n_tokens;
            if needed > self.config.context_length {
                return Err(EngineError::ContextOverflow {
                    needed,
                    limit: self.config.context_length,
                });
            }
            for l in layers.clone() {
                c.check_step(l, s.start_pos, s.n_tokens)?;
            }
        }
        if n == 0 {
            return Ok(());
        }
        let timeline = self.expert_store().map(|s| s.timeline());
        let span = timeline.and_then(|t| t.begin());
        let mut sc = self.step_scratch(batch);
        let mut estimate = Estimate::default();
        for l in layers.clone() {
            self.attention(l, hidden, batch, kv, &mut sc)?;
            let ahead = Ahead {
                end: layers.end,
                batch,
                kv: &mut *kv,
                estimate: &mut estimate,
            };
            self.feed_forward(l, hidden, experts, &mut sc, Some(ahead))?;
        }
        if let Some(t) = timeline {
            t.end(span, Lane::Compute, SpanKind::Step { rows: n });
        }
        Ok(())
    }

    /// A step's scratch: its rows (sequence, position) and their rotary table.
    pub(crate) fn step_scratch(&self, batch: &[SeqStep]) -> Scratch {
        let mut sc = Scratch::default();
        for (i, s) in batch.iter().enumerate() {
            sc.rows
                .extend((s.start_pos..s.start_pos + s.n_tokens).map(|p| (i, p)));
        }
        sc.rope.fill_scaled(
            sc.rows.iter().map(|&(_, p)| p),
            self.config.rope_dim,
            self.config.rope_theta,
            self.config.rope_scaling,
            self.weights.rope_freqs.as_deref(),
        );
        sc
    }

    /// The output norm of every row of `hidden`: the final hidden states, what the head
    /// multiplies and what embeddings pool ([`crate::embedding`]).
    pub fn output_norm(&self, hidden: &Hidden) -> Result<Hidden> {
        let norm = self
            .weights
            .output_norm
            .as_ref()
            .ok_or(EngineError::NotLoaded { what: "the head" })?;
        let mut x = hidden.clone();
        for row in x.data.chunks_exact_mut(self.config.n_embd) {
            rms_norm(row, norm, self.config.rms_eps);
        }
        Ok(x)
    }

    /// Output norm and head: logits for every row of `hidden`.
    pub fn head(&self, hidden: &Hidden) -> Result<Logits> {
        let x = self.output_norm(hidden)?.data;
        let w = self
            .weights
            .output
            .as_ref()
            .or(self.weights.token_embd.as_ref())
            .ok_or(EngineError::NotLoaded { what: "the head" })?;
        let v = self.config.vocab_size;
        let mut data = vec![0.0f32; hidden.n_tokens * v];
        matmul_once(&self.pool, w, &x, hidden.n_tokens, &mut data);
        Ok(Logits {
            n_tokens: hidden.n_tokens,
            vocab_size: v,
            data,
        })
    }

    /// Runs a whole model over `tokens` appended to the sequence in `kv`; logits for every
    /// token.
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache) -> Result<Logits> {
        let h = self.forward_hidden(tokens, kv)?;
        self.head(&h)
    }

    /// As [`Model::forward`], but only the last token's logits (what generation needs).
    pub fn forward_last(&self, tokens: &[u32], kv: &mut KvCache) -> Result<Logits> {
        let h = self.forward_hidden(tokens, kv)?;
        self.head(&h.rows(h.n_tokens.saturating_sub(1)..h.n_tokens))
    }

    fn forward_hidden(&self, tokens: &[u32], kv: &mut KvCache) -> Result<Hidden> {
        if tokens.is_empty() {
            return Err(EngineError::BadInput("no tokens to run".into()));
        }
        let step = SeqStep {
            n_tokens: tokens.len(),
            start_pos: kv.len(),
        };
        let needed = step.start_pos + step.n_tokens;
        let limit = kv.capacity().min(self.config.context_length);
        if needed > limit {
            return Err(EngineError::ContextOverflow { needed, limit });
        }
        let mut h = self.embed(tokens)?;
        self.run_layers(
            0..self.config.n_layer,
            &mut h,
            &[step],
            &mut [kv],
            &mut LocalExperts(self),
        )?;
        Ok(h)
    }
}
