//! The key/value cache of one sequence, for the layers a process holds. F32, position-major
//! (`kv_dim` floats per position), grown in chunks up to a fixed capacity. Freeing is dropping.

use std::ops::Range;

use tessera_model::ModelConfig;

use crate::error::{EngineError, Result};

/// Positions added at a time when the cache grows.
const GROW_CHUNK: usize = 256;

#[derive(Debug, Clone)]
struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
    /// Positions holding valid entries.
    len: usize,
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
                    v: Vec::new(),
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
            .map(|e| (e.k.capacity() + e.v.capacity()) * 4)
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

    /// Stores keys and values (`n_tokens × kv_dim` each) at `start_pos..` of `layer` and returns
    /// the layer's keys and values for positions `0..start_pos + n_tokens`. Call
    /// [`KvCache::check_step`] first.
    pub(crate) fn append(
        &mut self,
        layer: usize,
        start_pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> (&[f32], &[f32]) {
        let d = self.kv_dim;
        let n = k.len() / d;
        let end = start_pos + n;
        let cap = self.capacity;
        let e = &mut self.entries[layer - self.layers.start];
        if e.k.len() < end * d {
            let want = end.div_ceil(GROW_CHUNK) * GROW_CHUNK;
            let want = want.min(cap).max(end) * d;
            e.k.reserve_exact(want - e.k.len());
            e.v.reserve_exact(want - e.v.len());
            e.k.resize(want, 0.0);
            e.v.resize(want, 0.0);
        }
        e.k[start_pos * d..end * d].copy_from_slice(k);
        e.v[start_pos * d..end * d].copy_from_slice(v);
        e.len = end;
        (&e.k[..end * d], &e.v[..end * d])
    }
}

impl KvCache {
    /// Keys and values of `layer` for the cached positions.
    pub(crate) fn view(&self, layer: usize) -> (&[f32], &[f32]) {
        let e = &self.entries[layer - self.layers.start];
        let n = e.len * self.kv_dim;
        (&e.k[..n], &e.v[..n])
    }
}
