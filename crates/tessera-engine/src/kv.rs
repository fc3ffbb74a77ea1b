//! The key/value cache of one sequence, for the layers a process holds, in one of three element
//! types ([`KvType`]), grown in chunks up to a fixed capacity. Freeing is dropping.
//!
//! Layouts, per layer (why: each is what its attention path reads fastest):
//! - **F32**: keys and values position-major (`kv_dim` floats per position). Attention over it
//!   follows llama.cpp's non-flash path bit for bit ([`crate::ops::attend_group`]); the
//!   reference tests against llama.cpp run on it.
//! - **F16**: keys in tiles of [`TILE`] positions, transposed within the tile (for each KV head,
//!   `head_dim` rows of `TILE` positions), so the fused attention reads a tile of one head's keys
//!   as one contiguous run and scores `TILE` positions per vector lane; values in the same tiles,
//!   position-major within the tile (for each KV head, `TILE` rows of `v_head_dim`), so a tile
//!   of one head's values is one contiguous run too (a head's rows `kv_width` apart, 2 KiB on a
//!   Qwen3, stalled the value loads: a new page every other row).
//! - **Q8_0**: keys and values position-major in blocks of 32 (llama.cpp's `q8_0`: an f16 scale
//!   and 32 signed bytes), each head's slice a whole number of blocks.
//!
//! The geometry is a [`KvShape`] (KV heads and the key/value widths per head), so attention
//! variants whose keys and values differ in width fit the same cache. DeepSeek's MLA caches one
//! "head" per position, its key the normed latent followed by the rotated key part, and its
//! value the latent itself: the first `v_head_dim` floats of the key, read from the key storage
//! rather than stored twice ([`KvShape::shared_v`]), as llama.cpp's MLA cache does.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use tessera_model::ModelConfig;

use crate::error::{EngineError, Result};
use crate::kernels::quantize_row_q8_0;

/// Positions added at a time when the cache grows (a multiple of [`TILE`]).
const GROW_CHUNK: usize = 256;

/// Positions per key tile in the F16 layout (and per step of the fused attention).
pub const TILE: usize = 64;

const _: () = assert!(GROW_CHUNK.is_multiple_of(TILE));

pub use tessera_model::kv::{KvShape, KvType, KvTypeUnfit};

/// Storage of one layer's keys or values.
#[derive(Debug, Clone)]
enum Rows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    /// Per-block scales and quants.
    Q8_0 {
        d: Vec<f16>,
        q: Vec<i8>,
    },
}

impl Rows {
    fn new(t: KvType) -> Self {
        match t {
            KvType::F32 => Self::F32(Vec::new()),
            KvType::F16 => Self::F16(Vec::new()),
            KvType::Q8_0 => Self::Q8_0 {
                d: Vec::new(),
                q: Vec::new(),
            },
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Self::F32(v) => v.capacity() * 4,
            Self::F16(v) => v.capacity() * 2,
            Self::Q8_0 { d, q } => d.capacity() * 2 + q.capacity(),
        }
    }

    /// Grows to exactly `elements` values (zeros).
    fn grow(&mut self, elements: usize) {
        fn to<T: Clone>(v: &mut Vec<T>, n: usize, zero: T) {
            if v.len() < n {
                v.reserve_exact(n - v.len());
                v.resize(n, zero);
            }
        }
        match self {
            Self::F32(v) => to(v, elements, 0.0),
            Self::F16(v) => to(v, elements, f16::ZERO),
            Self::Q8_0 { d, q } => {
                to(q, elements, 0);
                to(d, elements / 32, f16::ZERO);
            }
        }
    }

    /// Stores `x` at element offset `at` (position-major layouts).
    fn put(&mut self, at: usize, x: &[f32]) {
        match self {
            Self::F32(v) => v[at..at + x.len()].copy_from_slice(x),
            Self::F16(v) => v[at..at + x.len()].convert_from_f32_slice(x),
            Self::Q8_0 { d, q } => {
                let mut ds = [0.0f32; 64];
                let mut sums = [0i32; 64];
                for (c, xc) in x.chunks(64 * 32).enumerate() {
                    let b0 = at / 32 + c * 64;
                    let n = xc.len() / 32;
                    let qs = &mut q[b0 * 32..(b0 + n) * 32];
                    quantize_row_q8_0(xc, &mut ds[..n], qs, &mut sums[..n]);
                    for (o, &s) in d[b0..b0 + n].iter_mut().zip(&ds[..n]) {
                        *o = f16::from_f32(s);
                    }
                }
            }
        }
    }
}

#[derive(Debug, Clone)]
struct LayerKv {
    k: Rows,
    v: Rows,
    /// Positions holding valid entries.
    len: usize,
    /// Positions allocated.
    allocated: usize,
}

/// Keys and values of one sequence for layers `layers`.
#[derive(Debug, Clone)]
pub struct KvCache {
    layers: Range<usize>,
    shape: KvShape,
    kv_type: KvType,
    capacity: usize,
    entries: Vec<LayerKv>,
}

/// One layer's cached keys and values, as the attention reads them (see the module doc for the
/// layouts). `len` positions are valid.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LayerView<'a> {
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    F16 {
        /// Tiles of [`TILE`] positions: `[tile][kv head][k_head_dim][TILE]`.
        k_tiles: &'a [f16],
        /// Tiles of [`TILE`] positions: `[tile][kv head][TILE][v_head_dim]`.
        v_tiles: &'a [f16],
    },
    Q8_0 {
        kd: &'a [f16],
        kq: &'a [i8],
        vd: &'a [f16],
        vq: &'a [i8],
    },
}

impl KvCache {
    /// An empty cache of `kv_type` for `layers` of a model, holding at most `capacity` positions
    /// (clamped to the model's context length). Errors if the type cannot hold the model's
    /// heads ([`KvType::check`]).
    pub fn new(
        config: &ModelConfig,
        layers: Range<usize>,
        capacity: usize,
        kv_type: KvType,
    ) -> Result<Self> {
        Self::with_shape(
            KvShape::from_config(config),
            layers,
            capacity.min(config.context_length),
            kv_type,
        )
    }

    /// An empty cache of any geometry.
    pub fn with_shape(
        shape: KvShape,
        layers: Range<usize>,
        capacity: usize,
        kv_type: KvType,
    ) -> Result<Self> {
        kv_type.check(shape)?;
        let n = layers.len();
        Ok(Self {
            layers,
            shape,
            kv_type,
            capacity,
            entries: vec![
                LayerKv {
                    k: Rows::new(kv_type),
                    v: Rows::new(kv_type),
                    len: 0,
                    allocated: 0,
                };
                n
            ],
        })
    }

    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// The most positions this cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Lets the cache hold up to `capacity` positions from now on (never fewer than it holds):
    /// a cache kept for prefix reuse serves a sequence that may run longer than its first.
    /// Memory still grows only as positions are written.
    pub fn set_capacity(&mut self, capacity: usize) {
        let held = self.entries.iter().map(|e| e.len).max().unwrap_or(0);
        self.capacity = capacity.max(held);
    }

    /// Positions every layer holds: what can be kept of a cache after a step that failed
    /// part-way (its first layers written, the rest not).
    pub fn len_in_every_layer(&self) -> usize {
        self.entries.iter().map(|e| e.len).min().unwrap_or(0)
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

    /// Forgets positions from `n` on in `layer` alone: a run-ahead's keys and values are an
    /// estimate's, not the sequence's (see `crate::run_ahead`).
    pub(crate) fn truncate_layer(&mut self, layer: usize, n: usize) {
        if self.layers.contains(&layer) {
            let e = &mut self.entries[layer - self.layers.start];
            e.len = e.len.min(n);
        }
    }

    /// Positions `layer` holds.
    #[cfg(test)]
    pub(crate) fn len_in_layer(&self, layer: usize) -> usize {
        self.entries[layer - self.layers.start].len
    }

    /// Bytes allocated for keys and values.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.k.bytes() + e.v.bytes()).sum()
    }

    /// Bytes a cache of `kv_type` and `shape` holds for `positions` positions of `n_layers`
    /// layers once fully grown (what a budget must reserve).
    pub fn bytes_for(kv_type: KvType, shape: KvShape, n_layers: usize, positions: usize) -> u64 {
        let allocated = positions.div_ceil(TILE) * TILE;
        (n_layers * kv_type.bytes_per_position(shape)) as u64 * allocated as u64
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

    /// Stores keys (`n_tokens × k_width`) and values (`n_tokens × v_width`, empty with
    /// [`KvShape::shared_v`]) at `start_pos..` of `layer`. Call [`KvCache::check_step`] first.
    pub(crate) fn append(&mut self, layer: usize, start_pos: usize, k: &[f32], v: &[f32]) {
        let (kw, vw) = (self.shape.k_width(), self.shape.v_width());
        let (nkv, dk, dv) = (
            self.shape.n_head_kv,
            self.shape.k_head_dim,
            self.shape.v_head_dim,
        );
        let n = k.len() / kw;
        debug_assert_eq!(v.len(), n * vw);
        let end = start_pos + n;
        let cap = self.capacity;
        let e = &mut self.entries[layer - self.layers.start];
        if e.allocated < end {
            // Whole tiles, so the tiled key layout always holds complete tiles.
            let want = end.div_ceil(GROW_CHUNK) * GROW_CHUNK;
            let want = want
                .min(cap.div_ceil(TILE) * TILE)
                .max(end.div_ceil(TILE) * TILE);
            e.k.grow(want * kw);
            e.v.grow(want * vw);
            e.allocated = want;
        }
        for t in 0..n {
            let pos = start_pos + t;
            let (kr, vr) = (&k[t * kw..(t + 1) * kw], &v[t * vw..(t + 1) * vw]);
            match &mut e.k {
                Rows::F16(kt) => {
                    // Transposed within the tile: [tile][head][dim][slot].
                    let (tile, slot) = (pos / TILE, pos % TILE);
                    for h in 0..nkv {
                        let base = (tile * nkv + h) * dk * TILE + slot;
                        for (i, &x) in kr[h * dk..(h + 1) * dk].iter().enumerate() {
                            kt[base + i * TILE] = f16::from_f32(x);
                        }
                    }
                }
                rows => rows.put(pos * kw, kr),
            }
            match &mut e.v {
                _ if vw == 0 => {}
                Rows::F16(vt) => {
                    // [tile][head][slot][dim].
                    let (tile, slot) = (pos / TILE, pos % TILE);
                    for h in 0..nkv {
                        let at = ((tile * nkv + h) * TILE + slot) * dv;
                        vt[at..at + dv].convert_from_f32_slice(&vr[h * dv..(h + 1) * dv]);
                    }
                }
                rows => rows.put(pos * vw, vr),
            }
        }
        e.len = end;
    }

    /// Keys and values of `layer` for the cached positions (whole tiles for the tiled layout).
    pub(crate) fn view(&self, layer: usize) -> (LayerView<'_>, usize) {
        let e = &self.entries[layer - self.layers.start];
        let (kw, vw) = (self.shape.k_width(), self.shape.v_width());
        let n = e.len;
        let view = match (&e.k, &e.v) {
            (Rows::F32(k), Rows::F32(v)) => LayerView::F32 {
                k: &k[..n * kw],
                v: &v[..n * vw],
            },
            (Rows::F16(k), Rows::F16(v)) => LayerView::F16 {
                k_tiles: &k[..n.div_ceil(TILE) * TILE * kw],
                v_tiles: &v[..n.div_ceil(TILE) * TILE * vw],
            },
            (Rows::Q8_0 { d: kd, q: kq }, Rows::Q8_0 { d: vd, q: vq }) => LayerView::Q8_0 {
                kd: &kd[..n * kw / 32],
                kq: &kq[..n * kw],
                vd: &vd[..n * vw / 32],
                vq: &vq[..n * vw],
            },
            _ => unreachable!("keys and values of a layer share one type"),
        };
        (view, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> KvShape {
        KvShape {
            n_head_kv: 2,
            k_head_dim: 32,
            v_head_dim: 64,
            shared_v: false,
        }
    }

    #[test]
    fn kv_type_names_round_trip() {
        for t in KvType::ALL {
            assert_eq!(t.to_string().parse::<KvType>(), Ok(t));
        }
        let err = "q4".parse::<KvType>().unwrap_err();
        assert!(err.contains("f16, q8_0 or f32"), "{err}");
    }

    #[test]
    fn q8_0_refuses_heads_that_are_not_whole_blocks() {
        let s = KvShape {
            n_head_kv: 4,
            k_head_dim: 8,
            v_head_dim: 8,
            shared_v: false,
        };
        let err = KvCache::with_shape(s, 0..1, 16, KvType::Q8_0).unwrap_err();
        assert!(err.to_string().contains("multiples of 32"), "{err}");
        assert!(KvCache::with_shape(s, 0..1, 16, KvType::F16).is_ok());
    }

    #[test]
    fn bytes_follow_the_type() {
        let s = shape();
        for t in KvType::ALL {
            let mut c = KvCache::with_shape(s, 0..2, 1000, t).unwrap();
            let (k, v) = (
                vec![0.5f32; 3 * s.k_width()],
                vec![0.25f32; 3 * s.v_width()],
            );
            for l in 0..2 {
                c.append(l, 0, &k, &v);
            }
            // Grown by one chunk of 256 positions.
            assert_eq!(c.bytes() as u64, KvCache::bytes_for(t, s, 2, 256), "{t}");
        }
        assert_eq!(KvType::Q8_0.bytes_per_position(s), (64 + 128) / 32 * 34);
    }

    #[test]
    fn stored_values_read_back() {
        let s = shape();
        let mut c = KvCache::with_shape(s, 3..4, 300, KvType::F16).unwrap();
        // Small integers: exact in f16.
        let k: Vec<f32> = (0..70 * s.k_width()).map(|i| (i % 1000) as f32).collect();
        let v: Vec<f32> = (0..70 * s.v_width()).map(|i| -((i % 999) as f32)).collect();
        c.append(3, 0, &k, &v);
        let (LayerView::F16 { k_tiles, v_tiles }, 70) = c.view(3) else {
            panic!("f16 view of 70 positions")
        };
        // Position 65, head 1, dim 5: tile 1, slot 1.
        let (pos, h, i) = (65, 1, 5);
        let at = ((pos / TILE) * 2 + h) * 32 * TILE + i * TILE + pos % TILE;
        assert_eq!(k_tiles[at].to_f32(), k[pos * 64 + h * 32 + i]);
        // Position 65, head 1, dim 7 of the values: tile 1, slot 1.
        let at = ((pos / TILE) * 2 + h) * TILE * 64 + (pos % TILE) * 64 + 7;
        assert_eq!(v_tiles[at].to_f32(), v[pos * 128 + 64 + 7]);
    }
}
