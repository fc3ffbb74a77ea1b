//! The key/value cache of one sequence, for the layers a process holds. F32; keys
//! position-major (`kv_dim` floats per position), values transposed (one row of positions per
//! value dimension, as llama.cpp stores them without flash attention, so attention reads each
//! output dimension's values contiguously); grown in chunks up to a fixed capacity. Freeing is
//! dropping.

use std::ops::Range;

use tessera_model::ModelConfig;

use crate::error::{EngineError, Result};

/// Positions added at a time when the cache grows.
const GROW_CHUNK: usize = 256;

#[derive(Debug, Clone)]
struct LayerKv {
    k: Vec<f32>,
    /// Values transposed: dimension `i` of position `p` at `v_t[i * v_stride + p]`.
    v_t: Vec<f32>,
    /// Positions allocated per row of `v_t`.
    v_stride: usize,
    /// Positions holding valid entries.
    len: usize,
}

/// The cached keys and values of one layer (see [`KvCache::view`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerView<'a> {
    /// Position-major keys, `kv_dim` floats per cached position.
    pub keys: &'a [f32],
    /// Transposed values: dimension `i` of position `p` at `values_t[i * v_stride + p]`.
    pub values_t: &'a [f32],
    pub v_stride: usize,
}

/// Keys and values of one sequence for layers `layers`.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Range<usize>,
    kv_dim: usize,
    capacity: usize,
    entries: Vec<LayerKv>,
}

impl KvCache {
    /// An empty cache for `layers` of a model, holding at most `capacity` positions (clamped to
    /// the model's context length).
    pub fn new(config: &ModelConfig, layers: Range<usize>, capacity: usize) -> Self {
        let n = layers.len();
        Self {
            layers,
            kv_dim: config.kv_dim(),
            capacity: capacity.min(config.context_length),
            entries: vec![
                LayerKv {
                    k: Vec::new(),
                    v_t: Vec::new(),
                    v_stride: 0,
                    len: 0,
                };
                n
            ],
        }
    }

    /// A cache for every layer with the model's full context.
    pub fn for_model(config: &ModelConfig) -> Self {
        Self::new(config, 0..config.n_layer, config.context_length)
    }

    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// The most positions this cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions cached (of the first layer held; all layers agree after a full step).
    pub fn len(&self) -> usize {
        self.entries.first().map_or(0, |e| e.len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets positions from `n` on (for rewinding a sequence).
    pub fn truncate(&mut self, n: usize) {
        for e in &mut self.entries {
            e.len = e.len.min(n);
        }
    }

    /// Bytes allocated for keys and values.
    pub fn bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|e| (e.k.capacity() + e.v_t.capacity()) * 4)
            .sum()
    }

    /// Checks that `n_tokens` positions starting at `start_pos` can be written to `layer`.
    pub(crate) fn check_step(&self, layer: usize, start_pos: usize, n_tokens: usize) -> Result<()> {
        if !self.layers.contains(&layer) {
            return Err(EngineError::BadInput(format!(
                "the KV cache holds layers {:?}, not layer {layer}",
                self.layers
            )));
        }
        let e = &self.entries[layer - self.layers.start];
        if start_pos > e.len {
            return Err(EngineError::BadInput(format!(
                "layer {layer}: step starts at position {start_pos} but only {} are cached",
                e.len
            )));
        }
        let needed = start_pos + n_tokens;
        if needed > self.capacity {
            return Err(EngineError::ContextOverflow {
                needed,
                limit: self.capacity,
            });
        }
        Ok(())
    }

    /// Stores keys and values (`n_tokens × kv_dim` each, position-major) at `start_pos..` of
    /// `layer`. Call [`KvCache::check_step`] first.
    pub(crate) fn append(&mut self, layer: usize, start_pos: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        let n = k.len() / d;
        let end = start_pos + n;
        let cap = self.capacity;
        let e = &mut self.entries[layer - self.layers.start];
        if e.v_stride < end {
            let want = (end.div_ceil(GROW_CHUNK) * GROW_CHUNK).min(cap).max(end);
            e.k.reserve_exact(want * d - e.k.len());
            e.k.resize(want * d, 0.0);
            // Re-lay the transposed values out with the longer rows.
            let mut v_t = vec![0.0f32; d * want];
            for i in 0..d {
                let old = &e.v_t[i * e.v_stride..i * e.v_stride + e.len];
                v_t[i * want..i * want + e.len].copy_from_slice(old);
            }
            e.v_t = v_t;
            e.v_stride = want;
        }
        e.k[start_pos * d..end * d].copy_from_slice(k);
        for (t, row) in v.chunks_exact(d).enumerate() {
            for (i, &x) in row.iter().enumerate() {
                e.v_t[i * e.v_stride + start_pos + t] = x;
            }
        }
        e.len = end;
    }
}

impl KvCache {
    /// Keys and values of `layer` for the cached positions.
    pub(crate) fn view(&self, layer: usize) -> LayerView<'_> {
        let e = &self.entries[layer - self.layers.start];
        LayerView {
            keys: &e.k[..e.len * self.kv_dim],
            values_t: &e.v_t,
            v_stride: e.v_stride,
        }
    }
}
