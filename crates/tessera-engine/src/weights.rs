//! Loading the weights a part of the model needs — and only those.
//!
//! A [`LoadSpec`] names the layers, whether the embedding and the head are held, and which
//! experts of each MoE layer. Tensors outside the spec are never touched, so a process holding
//! layers `[0, L/2)` neither reads nor keeps the others. Matrices borrow the file's shared
//! mapping where the kernels use GGML rows as they are; Q4_0/Q8_0 are repacked by the kernels
//! into owned copies (of the loaded tensors only).

use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tessera_model::config::names;
use tessera_model::{GgmlType, GgufFile, ModelConfig, TensorInfo};

use crate::error::{EngineError, Result};
use crate::kernels::{dequantize, Matrix, MatrixBytes, WeightArena};

/// Which experts of each MoE layer a part holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExpertSelection {
    /// Every expert of every loaded layer.
    #[default]
    All,
    /// `ids[layer]` lists the experts held for absolute layer index `layer`; a layer past the
    /// end of the list holds none.
    PerLayer(Vec<Vec<usize>>),
}

impl ExpertSelection {
    /// The same expert ids in every layer.
    pub fn same_in_every_layer(ids: &[usize], n_layer: usize) -> Self {
        Self::PerLayer(vec![ids.to_vec(); n_layer])
    }

    pub fn holds(&self, layer: usize, expert: usize) -> bool {
        match self {
            Self::All => true,
            Self::PerLayer(v) => v.get(layer).is_some_and(|ids| ids.contains(&expert)),
        }
    }
}

/// What part of a model to load.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// Transformer layers held.
    pub layers: Range<usize>,
    /// The token embedding (the first stage).
    pub embed: bool,
    /// The output norm and head (the last stage; with tied embeddings this loads the embedding
    /// matrix as the head).
    pub head: bool,
    /// Experts held in each MoE layer.
    pub experts: ExpertSelection,
    /// The layers' non-expert weights: attention, norms, router, dense FFN. `false` for a part
    /// that only computes experts for others.
    pub dense: bool,
}

impl LoadSpec {
    /// The whole model.
    pub fn full(config: &ModelConfig) -> Self {
        Self::stage(config, 0..config.n_layer)
    }

    /// A pipeline stage: layers `layers`, with the embedding if it starts at 0 and the head if it
    /// ends at the last layer.
    pub fn stage(config: &ModelConfig, layers: Range<usize>) -> Self {
        Self {
            embed: layers.start == 0,
            head: layers.end == config.n_layer,
            layers,
            experts: ExpertSelection::All,
            dense: true,
        }
    }

    /// Only the experts `experts` of layers `layers`, nothing else (an expert worker).
    pub fn experts_only(layers: Range<usize>, experts: ExpertSelection) -> Self {
        Self {
            layers,
            embed: false,
            head: false,
            experts,
            dense: false,
        }
    }
}

/// The projections that make a layer's queries, keys and values.
#[derive(Debug)]
pub enum AttnProj {
    /// Separate query, key and value projections.
    Qkv { wq: Matrix, wk: Matrix, wv: Matrix },
    /// DeepSeek's latent attention (see [`tessera_model::Mla`]).
    Mla(MlaProj),
}

/// The matrices of multi-head latent attention (see [`crate::mla`]).
#[derive(Debug)]
pub struct MlaProj {
    /// The query's low-rank first stage (`attn_q_a`) and the norm of its output; `None` when
    /// `wq` is a plain `attn_q`.
    pub q_a: Option<(Matrix, Vec<f32>)>,
    /// `attn_q_b` (or `attn_q`): every head's query.
    pub wq: Matrix,
    /// `attn_kv_a_mqa`: the compressed latent and the shared rotated key part.
    pub kv_a: Matrix,
    pub kv_a_norm: Vec<f32>,
    /// Each head's key and value projections of the latent.
    pub heads: MlaHeads,
}

/// How a file stores each head's key and value projections of the latent.
#[derive(Debug)]
pub enum MlaHeads {
    /// `attn_k_b` (per head `kv_lora_rank × nope`: the key projection transposed, which carries
    /// a query into the latent's space) and `attn_v_b` (per head `v_head_dim × kv_lora_rank`).
    Absorbed { k_b: Vec<Matrix>, v_b: Vec<Matrix> },
    /// `attn_kv_b`: per head, `nope` key rows then `v_head_dim` value rows, `kv_lora_rank` wide.
    Stacked(Matrix),
}

impl AttnProj {
    fn resident_bytes(&self) -> usize {
        match self {
            Self::Qkv { wq, wk, wv } => {
                wq.resident_bytes() + wk.resident_bytes() + wv.resident_bytes()
            }
            Self::Mla(m) => {
                m.q_a
                    .as_ref()
                    .map_or(0, |(w, n)| w.resident_bytes() + n.len() * 4)
                    + m.wq.resident_bytes()
                    + m.kv_a.resident_bytes()
                    + m.kv_a_norm.len() * 4
                    + match &m.heads {
                        MlaHeads::Absorbed { k_b, v_b } => {
                            k_b.iter().chain(v_b).map(Matrix::resident_bytes).sum()
                        }
                        MlaHeads::Stacked(kv_b) => kv_b.resident_bytes(),
                    }
            }
        }
    }
}

/// Attention and norms of one layer, plus its dense FFN or MoE router (and shared experts).
#[derive(Debug)]
pub struct LayerCore {
    pub attn_norm: Vec<f32>,
    pub proj: AttnProj,
    pub wo: Matrix,
    /// Projection biases (Qwen2, gpt-oss).
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// Qwen3 per-head RMS norms of queries and keys.
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// gpt-oss: attention output bias.
    pub bo: Option<Vec<f32>>,
    /// gpt-oss: one sink logit per query head, an extra softmax term without a value.
    pub sinks: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// Dense FFN (`None` in MoE layers).
    pub ffn: Option<Ffn>,
    /// MoE router, `n_expert × n_embd` (`None` in dense layers).
    pub router: Option<Matrix>,
    /// gpt-oss: router bias, added to the logits.
    pub router_bias: Option<Vec<f32>>,
    /// DeepSeek-V3: the experts' selection bias (`exp_probs_b`), added to the gate's outputs
    /// to choose experts, not to weigh them.
    pub selection_bias: Option<Vec<f32>>,
    /// Shared experts (DeepSeek), one FFN run on every token of a MoE layer. They stay with
    /// the layer's dense weights, wherever its routed experts are.
    pub shared: Option<Ffn>,
}

/// Per-expert biases of gpt-oss's experts: added to the gate and up projections before the
/// activation and to the down projection's output.
#[derive(Debug, Clone)]
pub struct FfnBias {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

/// A SwiGLU feed-forward block: `down(silu(gate x) * up x)`. Also one expert.
#[derive(Debug)]
pub struct Ffn {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

impl Ffn {
    /// Bytes of its three matrices' allocations.
    pub(crate) fn allocated_bytes(&self) -> u64 {
        (self.gate.allocated_bytes() + self.up.allocated_bytes() + self.down.allocated_bytes())
            as u64
    }

    fn resident_bytes(&self) -> usize {
        self.gate.resident_bytes() + self.up.resident_bytes() + self.down.resident_bytes()
    }
}

/// One layer as held by this part.
#[derive(Debug)]
pub struct LayerWeights {
    pub core: Option<LayerCore>,
    /// `experts[e]` is expert `e` if held (empty for dense layers).
    pub experts: Vec<Option<Ffn>>,
    /// `expert_bias[e]`: the biases of expert `e` if held (or streamed) and the model has them.
    pub expert_bias: Vec<Option<FfnBias>>,
}

/// A token embedding left in the file's mapping, in GGML's layout: a lookup dequantizes the
/// rows it needs where they lie (the same values as the repacked matrix's rows), so the table
/// takes no memory of its own. Its pages are read into the page cache at load; the kernel lets
/// them go under memory pressure, to be read from the disk again by the lookups that need them:
/// what the planner counts an embedding on disk as (one row a token).
#[derive(Debug)]
pub struct TokenRows {
    dtype: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    map: Arc<memmap2::Mmap>,
    offset: usize,
}

impl TokenRows {
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Dequantizes row `row` into `out[..cols]`.
    ///
    /// # Panics
    /// If `row >= rows` or `out.len() < cols`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row {row} out of {}", self.rows);
        let at = self.offset + row * self.row_bytes;
        dequantize(
            self.dtype,
            &self.map[at..at + self.row_bytes],
            &mut out[..self.cols],
        );
    }
}

/// The weights of a part of a model.
#[derive(Debug)]
pub struct ModelWeights {
    pub spec: LoadSpec,
    /// Token embedding as a matrix, when it is the tied head this part holds (`embed` reads
    /// its rows too).
    pub token_embd: Option<Matrix>,
    /// Token embedding for `embed` otherwise: rows left in the file's mapping.
    pub token_rows: Option<TokenRows>,
    pub output_norm: Option<Vec<f32>>,
    /// Untied head.
    pub output: Option<Matrix>,
    /// RoPE frequency factors (llama3-style scaling), when the model has them; loaded by
    /// every part that holds a layer (they are `rope_dim / 2` floats).
    pub rope_freqs: Option<Vec<f32>>,
    /// `layers[i]` is layer `spec.layers.start + i`.
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// Loads what `spec` asks for. `progress(loaded_bytes, total_bytes)` is called after each
    /// tensor.
    pub fn load(
        g: &GgufFile,
        config: &ModelConfig,
        spec: LoadSpec,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<Self> {
        if spec.layers.start > spec.layers.end || spec.layers.end > config.n_layer {
            return Err(EngineError::BadInput(format!(
                "layer range {:?} is not within the model's {} layers",
                spec.layers, config.n_layer
            )));
        }
        let mut loader = Loader::new(g, progress);
        // Sum what will be read first, for the progress callback.
        loader.total = plan(g, config, &spec)?.iter().map(|(_, b)| b).sum();

        let tied_head = spec.head && config.tied_embeddings;
        let token_embd = if tied_head {
            Some(loader.matrix(names::TOKEN_EMBD)?)
        } else {
            None
        };
        let token_rows = if spec.embed && !tied_head {
            Some(loader.rows(names::TOKEN_EMBD)?)
        } else {
            None
        };
        let (output_norm, output) = if spec.head {
            let norm = loader.vector(names::OUTPUT_NORM)?;
            let out = if config.tied_embeddings {
                None
            } else {
                Some(loader.matrix(names::OUTPUT)?)
            };
            (Some(norm), out)
        } else {
            (None, None)
        };
        let rope_freqs = if config.rope_freq_factors && spec.dense && !spec.layers.is_empty() {
            Some(loader.vector(names::ROPE_FREQS)?)
        } else {
            None
        };
        let mut layers = Vec::with_capacity(spec.layers.len());
        for il in spec.layers.clone() {
            let l = |w: &str| names::layer(il, w);
            let core = if spec.dense {
                let qk_norm = config.has_qk_norm();
                let bias = config.has_qkv_bias();
                let oss = config.has_oss_biases();
                let mut opt_vec = |name: String, on: bool| -> Result<Option<Vec<f32>>> {
                    if on {
                        Ok(Some(loader.vector(&name)?))
                    } else {
                        Ok(None)
                    }
                };
                let bq = opt_vec(l("attn_q.bias"), bias)?;
                let bk = opt_vec(l("attn_k.bias"), bias)?;
                let bv = opt_vec(l("attn_v.bias"), bias)?;
                let q_norm = opt_vec(l("attn_q_norm.weight"), qk_norm)?;
                let k_norm = opt_vec(l("attn_k_norm.weight"), qk_norm)?;
                let bo = opt_vec(l("attn_output.bias"), oss)?;
                let sinks = opt_vec(l("attn_sinks.weight"), oss)?;
                let moe = config.is_moe_layer(il);
                let router_bias = opt_vec(l("ffn_gate_inp.bias"), oss && moe)?;
                let selection_bias =
                    opt_vec(l("exp_probs_b.bias"), moe && config.expert_selection_bias)?;
                let proj = match config.mla {
                    None => AttnProj::Qkv {
                        wq: loader.matrix(&l("attn_q.weight"))?,
                        wk: loader.matrix(&l("attn_k.weight"))?,
                        wv: loader.matrix(&l("attn_v.weight"))?,
                    },
                    Some(m) => AttnProj::Mla(MlaProj {
                        q_a: if m.q_lora_rank > 0 {
                            Some((
                                loader.matrix(&l("attn_q_a.weight"))?,
                                loader.vector(&l("attn_q_a_norm.weight"))?,
                            ))
                        } else {
                            None
                        },
                        wq: loader.matrix(&l(if m.q_lora_rank > 0 {
                            "attn_q_b.weight"
                        } else {
                            "attn_q.weight"
                        }))?,
                        kv_a: loader.matrix(&l("attn_kv_a_mqa.weight"))?,
                        kv_a_norm: loader.vector(&l("attn_kv_a_norm.weight"))?,
                        heads: load_mla_heads(&mut loader, config, m, il)?,
                    }),
                };
                let shared = if moe && config.n_expert_shared > 0 {
                    Some(Ffn {
                        gate: loader.matrix(&l("ffn_gate_shexp.weight"))?,
                        up: loader.matrix(&l("ffn_up_shexp.weight"))?,
                        down: loader.matrix(&l("ffn_down_shexp.weight"))?,
                    })
                } else {
                    None
                };
                Some(LayerCore {
                    attn_norm: loader.vector(&l("attn_norm.weight"))?,
                    proj,
                    wo: loader.matrix(&l("attn_output.weight"))?,
                    bq,
                    bk,
                    bv,
                    q_norm,
                    k_norm,
                    bo,
                    sinks,
                    ffn_norm: loader.vector(&l(names::ffn_norm(config.arch)))?,
                    ffn: if moe {
                        None
                    } else {
                        Some(Ffn {
                            gate: loader.matrix(&l("ffn_gate.weight"))?,
                            up: loader.matrix(&l("ffn_up.weight"))?,
                            down: loader.matrix(&l("ffn_down.weight"))?,
                        })
                    },
                    router: if moe {
                        Some(loader.matrix(&l("ffn_gate_inp.weight"))?)
                    } else {
                        None
                    },
                    router_bias,
                    selection_bias,
                    shared,
                })
            } else {
                None
            };
            let mut experts = Vec::new();
            if config.is_moe_layer(il) {
                for e in 0..config.n_expert {
                    experts.push(if spec.experts.holds(il, e) {
                        let n = config.n_expert;
                        Some(Ffn {
                            gate: loader.expert(&l("ffn_gate_exps.weight"), e, n)?,
                            up: loader.expert(&l("ffn_up_exps.weight"), e, n)?,
                            down: loader.expert(&l("ffn_down_exps.weight"), e, n)?,
                        })
                    } else {
                        None
                    });
                }
            }
            let expert_bias = load_expert_bias(&mut loader, config, &spec.experts, il)?;
            layers.push(LayerWeights {
                core,
                experts,
                expert_bias,
            });
        }
        Ok(Self {
            spec,
            token_embd,
            token_rows,
            output_norm,
            output,
            rope_freqs,
            layers,
        })
    }

    /// Bytes of weights this part keeps (owned copies and mapped ranges it uses; not the
    /// embedding rows left in the mapping, which the page cache holds as lookups touch them).
    pub fn resident_bytes(&self) -> usize {
        let m = |m: &Option<Matrix>| m.as_ref().map_or(0, Matrix::resident_bytes);
        let v = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| v.len() * 4);
        let mut b = m(&self.token_embd) + m(&self.output) + v(&self.output_norm);
        for l in &self.layers {
            if let Some(c) = &l.core {
                b += (c.attn_norm.len() + c.ffn_norm.len()) * 4;
                b += c.proj.resident_bytes() + c.wo.resident_bytes();
                b += v(&c.bq) + v(&c.bk) + v(&c.bv) + v(&c.q_norm) + v(&c.k_norm);
                b += v(&c.bo) + v(&c.sinks) + v(&c.router_bias) + v(&c.selection_bias);
                b += c.ffn.as_ref().map_or(0, Ffn::resident_bytes);
                b += c.shared.as_ref().map_or(0, Ffn::resident_bytes);
                b += m(&c.router);
            }
            b += l
                .experts
                .iter()
                .flatten()
                .map(Ffn::resident_bytes)
                .sum::<usize>();
            b += l
                .expert_bias
                .iter()
                .flatten()
                .map(|f| (f.gate.len() + f.up.len() + f.down.len()) * 4)
                .sum::<usize>();
        }
        b
    }
}

/// The key and value projections of MLA layer `il`, as the file stores them.
fn load_mla_heads(
    loader: &mut Loader<'_>,
    config: &ModelConfig,
    m: tessera_model::Mla,
    il: usize,
) -> Result<MlaHeads> {
    let l = |w: &str| names::layer(il, w);
    if !m.absorbed {
        return Ok(MlaHeads::Stacked(loader.matrix(&l("attn_kv_b.weight"))?));
    }
    let nh = config.n_head;
    let mut per_head = |name: &str| {
        (0..nh)
            .map(|h| loader.expert(&l(name), h, nh))
            .collect::<Result<Vec<_>>>()
    };
    let k_b = per_head("attn_k_b.weight")?;
    let v_b = per_head("attn_v_b.weight")?;
    Ok(MlaHeads::Absorbed { k_b, v_b })
}

/// The biases of the experts `held` selects in layer `il` (gpt-oss); empty when the model has
/// none. Loaded with the layer even when the experts' matrices are streamed: they are small.
pub(crate) fn load_expert_bias(
    loader: &mut Loader<'_>,
    config: &ModelConfig,
    held: &ExpertSelection,
    il: usize,
) -> Result<Vec<Option<FfnBias>>> {
    if !(config.is_moe_layer(il) && config.has_oss_biases()) {
        return Ok(Vec::new());
    }
    let n = config.n_expert;
    if !(0..n).any(|e| held.holds(il, e)) {
        return Ok(Vec::new());
    }
    let l = |w: &str| names::layer(il, w);
    let gate = loader.vector(&l("ffn_gate_exps.bias"))?;
    let up = loader.vector(&l("ffn_up_exps.bias"))?;
    let down = loader.vector(&l("ffn_down_exps.bias"))?;
    let (f, d) = (config.n_ff_expert, config.n_embd);
    if gate.len() != n * f || up.len() != n * f || down.len() != n * d {
        return Err(EngineError::Tensor {
            tensor: l("ffn_*_exps.bias"),
            what: format!("does not hold {n} experts' biases"),
        });
    }
    Ok((0..n)
        .map(|e| {
            held.holds(il, e).then(|| FfnBias {
                gate: gate[e * f..(e + 1) * f].to_vec(),
                up: up[e * f..(e + 1) * f].to_vec(),
                down: down[e * d..(e + 1) * d].to_vec(),
            })
        })
        .collect())
}

/// The tensors (name, bytes) `spec` reads; checks their types on the way.
fn plan(g: &GgufFile, config: &ModelConfig, spec: &LoadSpec) -> Result<Vec<(String, u64)>> {
    let mut out = Vec::new();
    // (name, numerator, denominator): the share of the tensor's bytes that is read.
    let mut add = |name: &str, num: u64, den: u64| -> Result<()> {
        let t = g.require_tensor(name)?;
        t.dtype(g.path())?;
        out.push((name.to_string(), t.n_bytes / den * num));
        Ok(())
    };
    if spec.embed || (spec.head && config.tied_embeddings) {
        add(names::TOKEN_EMBD, 1, 1)?;
    }
    if spec.head {
        add(names::OUTPUT_NORM, 1, 1)?;
        if !config.tied_embeddings {
            add(names::OUTPUT, 1, 1)?;
        }
    }
    if config.rope_freq_factors && spec.dense && !spec.layers.is_empty() {
        add(names::ROPE_FREQS, 1, 1)?;
    }
    let expected = config.expected_tensors();
    for il in spec.layers.clone() {
        let prefix = format!("blk.{il}.");
        for (name, _) in expected.iter().filter(|(n, _)| n.starts_with(&prefix)) {
            if name.contains("_exps.") {
                let held = (0..config.n_expert)
                    .filter(|&e| spec.experts.holds(il, e))
                    .count() as u64;
                if held > 0 && name.ends_with(".bias") {
                    add(name, 1, 1)?; // read whole (small), the held rows kept
                } else if held > 0 {
                    add(name, held, config.n_expert as u64)?;
                }
            } else if spec.dense {
                add(name, 1, 1)?;
            }
        }
    }
    Ok(out)
}

pub(crate) struct Loader<'a> {
    g: &'a GgufFile,
    total: u64,
    loaded: u64,
    progress: &'a mut dyn FnMut(u64, u64),
    /// Where the matrices are built: huge-page slabs shared by the model's matrices.
    arena: WeightArena,
}

impl<'a> Loader<'a> {
    /// A loader that reports `(loaded, total)` to `progress` after each tensor, `total` 0
    /// until the caller sets it (small extras read after the main load leave it so).
    pub(crate) fn new(g: &'a GgufFile, progress: &'a mut dyn FnMut(u64, u64)) -> Self {
        Self {
            g,
            total: 0,
            loaded: 0,
            progress,
            arena: WeightArena::new(),
        }
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        Ok(self.g.require_tensor(name)?)
    }

    fn tick(&mut self, bytes: u64) {
        self.loaded += bytes;
        (self.progress)(self.loaded, self.total);
    }

    /// A 2-D tensor `[cols, rows]` left in the mapping, its rows read where they lie.
    fn rows(&mut self, name: &str) -> Result<TokenRows> {
        let info = self.info(name)?.clone();
        let bad = |what: String| EngineError::Tensor {
            tensor: name.into(),
            what,
        };
        let [cols, rows] = info.shape[..] else {
            return Err(bad(format!("shape {:?} is not a matrix", info.shape)));
        };
        let dtype = info.dtype(self.g.path())?;
        let (cols, rows) = (cols as usize, rows as usize);
        if cols == 0 || !cols.is_multiple_of(dtype.block_size()) {
            return Err(bad(format!("{cols} columns are not whole {dtype} blocks")));
        }
        let row_bytes = cols / dtype.block_size() * dtype.block_bytes();
        if info.n_bytes != (rows * row_bytes) as u64 {
            return Err(bad(format!(
                "{} bytes for {rows} rows of {row_bytes}",
                info.n_bytes
            )));
        }
        let range = info.offset..info.offset + info.n_bytes;
        let (map, offset) = self.g.mapped_range(&info.name, range)?;
        // The whole table is read into the page cache now, in the kernel's large reads
        // (`MADV_POPULATE_READ`, Linux 5.14 and later): a decode's new tokens would otherwise
        // each wait for a small random read at the disk's IOPS. bench-qwen3moe-q4_0 with every
        // expert in memory under the lab's eMMC, random tokens (nearly every token a new
        // page): 0.85 such reads a token, 1.0 ms between steps outside the lab against 1.3-1.6
        // under it. The table is a few percent of a model, read once at load; the kernel still
        // lets its pages go under memory pressure (the cold rows first).
        //
        // Then lookups touch a row a token, in no order. Without this advice each page a
        // lookup faults in brings the kernel's read-around with it (up to 128 KiB), which
        // fills the page cache with rows nobody asked for and takes a slow disk longer: a
        // new token's lookup under the lab's eMMC took 0.51 ms, 0.41 ms with it (one read at
        // the disk's IOPS). Advice only: a refusal changes nothing else.
        #[cfg(unix)]
        {
            let len = info.n_bytes as usize;
            #[cfg(target_os = "linux")]
            let _ = map.advise_range(memmap2::Advice::PopulateRead, offset, len);
            let _ = map.advise_range(memmap2::Advice::Random, offset, len);
        }
        self.tick(info.n_bytes);
        Ok(TokenRows {
            dtype,
            rows,
            cols,
            row_bytes,
            map,
            offset,
        })
    }

    /// Builds a matrix over `len` bytes at `offset` of the mapping.
    fn build(
        &mut self,
        info: &TensorInfo,
        rows: usize,
        cols: usize,
        offset: u64,
        len: u64,
    ) -> Result<Matrix> {
        let dtype = info.dtype(self.g.path())?;
        // A partial copy (a node's sparse file) refuses what it never received; a split model's
        // bytes lie in the mapping of the part that holds the tensor, at that part's offset.
        let (map, offset) = self.g.mapped_range(&info.name, offset..offset + len)?;
        let bytes = MatrixBytes::Shared {
            bytes: Arc::clone(&map) as Arc<dyn AsRef<[u8]> + Send + Sync>,
            offset,
            len: len as usize,
        };
        let m = Matrix::new_in_arena(dtype, rows, cols, bytes, &mut self.arena).map_err(|e| {
            EngineError::Tensor {
                tensor: info.name.clone(),
                what: e.to_string(),
            }
        })?;
        if matches!(
            dtype,
            GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Mxfp4
                | GgmlType::Iq4Nl
                | GgmlType::Iq4Xs
                | GgmlType::Q2K
                | GgmlType::Q3K
                | GgmlType::Iq2Xxs
                | GgmlType::Iq2Xs
                | GgmlType::Iq2S
                | GgmlType::Iq3Xxs
                | GgmlType::Iq3S
        ) {
            // The kernels keep an owned, repacked copy of these types: let the source pages go
            // so they are not counted twice in the resident set.
            #[cfg(unix)]
            // SAFETY: the mapping is private and read-only, so dropping its pages loses nothing;
            // a later read refaults them from the file.
            unsafe {
                let _ = map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    offset,
                    len as usize,
                );
            }
        }
        Ok(m)
    }

    /// A 2-D tensor `[cols, rows]` as a matrix.
    fn matrix(&mut self, name: &str) -> Result<Matrix> {
        let info = self.info(name)?.clone();
        let [cols, rows] = info.shape[..] else {
            return Err(EngineError::Tensor {
                tensor: name.into(),
                what: format!("shape {:?} is not a matrix", info.shape),
            });
        };
        let m = self.build(
            &info,
            rows as usize,
            cols as usize,
            info.offset,
            info.n_bytes,
        )?;
        self.tick(info.n_bytes);
        Ok(m)
    }

    /// Expert `e` of a packed 3-D tensor `[cols, rows, n_expert]`.
    fn expert(&mut self, name: &str, e: usize, n_expert: usize) -> Result<Matrix> {
        let info = self.info(name)?.clone();
        let [cols, rows, n] = info.shape[..] else {
            return Err(EngineError::Tensor {
                tensor: name.into(),
                what: format!("shape {:?} is not a stack of expert matrices", info.shape),
            });
        };
        if n as usize != n_expert || info.n_bytes % n != 0 {
            return Err(EngineError::Tensor {
                tensor: name.into(),
                what: format!("does not hold {n_expert} equal expert matrices"),
            });
        }
        let per = info.n_bytes / n;
        let m = self.build(
            &info,
            rows as usize,
            cols as usize,
            info.offset + per * e as u64,
            per,
        )?;
        self.tick(per);
        Ok(m)
    }

    /// A 1-D tensor as f32 (converted from its stored type).
    fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        let info = self.info(name)?.clone();
        let dtype = info.dtype(self.g.path())?;
        let bytes = self.g.tensor_bytes(&info)?;
        let n = info.n_elements() as usize;
        let mut out = vec![0.0f32; n];
        if dtype.bytes_for(n as u64) != Some(bytes.len() as u64) {
            return Err(EngineError::Tensor {
                tensor: name.into(),
                what: format!("{} bytes do not hold {n} {dtype} values", bytes.len()),
            });
        }
        dequantize(dtype, bytes, &mut out);
        self.tick(info.n_bytes);
        Ok(out)
    }
}

// x86-64 only: the CI's aarch64 tests run under qemu-user, which does not carry `madvise`
// advice to the host's kernel (there this test failed as it does without the advice).
#[cfg(all(test, target_os = "linux", target_arch = "x86_64"))]
mod tests {
    use std::os::fd::AsRawFd as _;

    use tessera_model::{GgufFile, ModelConfig};

    use super::*;

    /// Pages of `bytes` (inside a mapping) in the page cache, and all its pages.
    fn resident(bytes: &[u8]) -> (usize, usize) {
        const PAGE: usize = 4096;
        let start = bytes.as_ptr() as usize / PAGE * PAGE;
        let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(PAGE);
        let mut vec = vec![0u8; (end - start) / PAGE];
        // SAFETY: the range is page-aligned and lies in a live mapping (rounded out to whole
        // pages of it); `vec` has a byte per page.
        let r = unsafe { libc::mincore(start as *mut libc::c_void, end - start, vec.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        (vec.iter().filter(|&&b| b & 1 == 1).count(), vec.len())
    }

    /// The token embedding's pages are in the page cache once the model is loaded, though no
    /// lookup has touched them: a decode's new token finds its row in memory instead of waiting
    /// for a small read at a slow disk's IOPS. The model is a fresh copy whose cached pages are
    /// dropped first (and checked gone), so nothing but the load can have read them.
    #[test]
    fn the_token_embedding_is_in_the_page_cache_after_load() {
        // On a disk: a tmpfs's pages are its storage and cannot be dropped.
        let tmp = std::env::temp_dir();
        let c = std::ffi::CString::new(tmp.to_str().unwrap()).unwrap();
        // SAFETY: statfs fills the plain struct it is given, from a valid C string.
        let on_tmpfs = unsafe {
            let mut st: libc::statfs = std::mem::zeroed();
            libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type == libc::TMPFS_MAGIC
        };
        let base = if on_tmpfs {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        } else {
            tmp
        };
        let dir = tempfile::tempdir_in(base).unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::copy(
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/stories260K.gguf"),
            &path,
        )
        .unwrap();
        let g = GgufFile::open(&path).unwrap();
        // After the header is parsed: its pages' read-around brought the rest of this small
        // file in. Pages the header's parse mapped stay; the table's are dropped.
        let file = std::fs::File::open(&path).unwrap();
        file.sync_all().unwrap();
        // SAFETY: plain advice on an open descriptor.
        let r = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        assert!(
            !cfg.tied_embeddings,
            "the test needs rows left in the mapping"
        );
        let info = g.tensor(names::TOKEN_EMBD).unwrap().clone();
        let range = info.offset..info.offset + info.n_bytes;
        let (map, offset) = g.mapped_range(&info.name, range).unwrap();
        let table = &map[offset..offset + info.n_bytes as usize];
        let (before, pages) = resident(table);
        assert!(
            before < pages,
            "the copy's pages were not dropped ({before} of {pages} resident): nothing to show"
        );
        // The embedding alone (a first stage of no layers): loading other tensors would fault
        // their pages in, and their read-around would bring in this small file's table too.
        let spec = LoadSpec::stage(&cfg, 0..0);
        let w = ModelWeights::load(&g, &cfg, spec, &mut |_, _| {}).unwrap();
        assert!(w.token_rows.is_some());
        assert_eq!(resident(table), (pages, pages));
    }
}
