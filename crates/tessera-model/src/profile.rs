//! The model profile: what a model costs, in bytes and FLOPs, part by part — read from the GGUF
//! header alone. The planner places parts of the model by these figures; `tessera inspect`
//! prints them.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::{names, ModelConfig};
use crate::dtype::GgmlType;
use crate::error::Result;
use crate::gguf::GgufFile;

/// One tensor as the profile reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSummary {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub bytes: u64,
}

/// Weight bytes of one transformer layer, by part.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerBytes {
    /// Q, K, V, output projections, their biases and norms, and the attention norm.
    pub attention: u64,
    /// The FFN norm plus the dense FFN (0 for MoE layers except the norm).
    pub dense_ffn: u64,
    /// The MoE router (`ffn_gate_inp`).
    pub router: u64,
    /// Bytes of each expert (gate + up + down slices of the packed tensors), by expert index.
    pub experts: Vec<u64>,
}

impl LayerBytes {
    pub fn total(&self) -> u64 {
        self.attention + self.dense_ffn + self.router + self.experts.iter().sum::<u64>()
    }

    /// Bytes read per token at batch 1: everything except the experts not selected.
    pub fn active(&self, n_expert_used: usize) -> u64 {
        let per_expert = self.experts.first().copied().unwrap_or(0);
        self.attention + self.dense_ffn + self.router + per_expert * n_expert_used as u64
    }
}

/// What a model costs, read from its header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub file: PathBuf,
    pub file_bytes: u64,
    pub name: Option<String>,
    pub config: ModelConfig,
    /// The most common weight type among the matrices (e.g. "Q4_0").
    pub weight_type: String,
    pub tensors: Vec<TensorSummary>,
    pub layers: Vec<LayerBytes>,
    /// Token embedding table.
    pub embedding_bytes: u64,
    /// Output head matrix (0 when tied to the embedding, which the last stage then also needs).
    pub head_bytes: u64,
    pub output_norm_bytes: u64,
    /// K and V for one token across the layers whose cache grows with the context (all but
    /// sliding-window layers, which hold a fixed window), at F32; with MLA the latent and the
    /// rotated key part ([`ModelConfig::kv_cache_width`]).
    pub kv_bytes_per_token: u64,
    pub parameter_count: u64,
    /// Approximate FLOPs of one token's forward pass (2 per multiply-add of active weights).
    pub flops_per_token: u64,
}

impl ModelProfile {
    /// Builds the profile of a parsed file; validates the architecture and tensor shapes.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let config = ModelConfig::from_gguf(g)?;
        let bytes_of = |name: &str| g.tensor(name).map_or(0, |t| t.n_bytes);
        let mut layers = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let mut lb = LayerBytes::default();
            for t in g.tensors() {
                let Some(rest) = t.name.strip_prefix(&format!("blk.{i}.")) else {
                    continue;
                };
                if rest.starts_with("attn") {
                    lb.attention += t.n_bytes;
                } else if rest.starts_with("ffn_gate_inp") {
                    lb.router += t.n_bytes;
                } else if rest.contains("_exps") {
                    if lb.experts.is_empty() {
                        lb.experts = vec![0; config.n_expert];
                    }
                    // Packed expert tensors are contiguous per expert.
                    let each = t.n_bytes / config.n_expert.max(1) as u64;
                    lb.experts.iter_mut().for_each(|e| *e += each);
                } else {
                    lb.dense_ffn += t.n_bytes;
                }
            }
            layers.push(lb);
        }
        let mut counts: Vec<(String, u64)> = Vec::new();
        for t in g.tensors().iter().filter(|t| t.shape.len() >= 2) {
            let name = GgmlType::name_of_id(t.type_id).to_string();
            match counts.iter_mut().find(|(n, _)| *n == name) {
                Some((_, c)) => *c += t.n_bytes,
                None => counts.push((name, t.n_bytes)),
            }
        }
        let weight_type = counts
            .into_iter()
            .max_by_key(|(_, c)| *c)
            .map(|(n, _)| n)
            .unwrap_or_else(|| "F32".into());

        let parameter_count = g.tensors().iter().map(|t| t.n_elements()).sum();
        // Sliding-window layers keep only their window, a constant: per token of a long context
        // only the full-attention layers grow.
        let growing = (0..config.n_layer)
            .filter(|&l| !config.is_swa_layer(l))
            .count();
        let kv_bytes_per_token = (growing * config.kv_cache_width() * 4) as u64;
        let flops_per_token = Self::estimate_flops(&config);
        Ok(Self {
            file: g.path().to_owned(),
            file_bytes: g.file_len(),
            name: g
                .meta("general.name")
                .and_then(|v| v.as_str())
                .map(str::to_string),
            weight_type,
            tensors: g
                .tensors()
                .iter()
                .map(|t| TensorSummary {
                    name: t.name.clone(),
                    dtype: GgmlType::name_of_id(t.type_id).to_string(),
                    shape: t.shape.clone(),
                    offset: t.offset,
                    bytes: t.n_bytes,
                })
                .collect(),
            layers,
            embedding_bytes: bytes_of(names::TOKEN_EMBD),
            head_bytes: bytes_of(names::OUTPUT),
            output_norm_bytes: bytes_of(names::OUTPUT_NORM),
            kv_bytes_per_token,
            parameter_count,
            flops_per_token,
            config,
        })
    }

    fn estimate_flops(c: &ModelConfig) -> u64 {
        let e = c.n_embd as u64;
        let attn = match c.mla {
            None => e * (c.q_dim() + 2 * c.kv_dim()) as u64 + c.q_dim() as u64 * e,
            Some(m) => {
                let (qr, kvr) = (m.q_lora_rank as u64, m.kv_lora_rank as u64);
                let q = if qr > 0 {
                    e * qr + qr * c.q_dim() as u64
                } else {
                    e * c.q_dim() as u64
                };
                let kv_a = e * (kvr + c.rope_dim as u64);
                let kv_b = kvr * (c.kv_dim() - c.n_head * c.rope_dim + c.v_dim()) as u64;
                q + kv_a + kv_b + c.attn_out_dim() as u64 * e
            }
        };
        let routed = 3 * e * c.n_ff_expert as u64 * c.n_expert_used as u64 + e * c.n_expert as u64;
        let shared = 3 * e * (c.n_ff_expert * c.n_expert_shared) as u64;
        let dense = 3 * e * c.n_ff as u64;
        let ffn: u64 = (0..c.n_layer)
            .map(|l| {
                if c.is_moe_layer(l) {
                    routed + shared
                } else {
                    dense
                }
            })
            .sum();
        2 * (c.n_layer as u64 * attn + ffn + e * c.vocab_size as u64)
    }

    /// Total weight bytes.
    pub fn weight_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// Weight bytes read per decoded token at batch 1 (experts not selected are not read).
    pub fn active_bytes_per_token(&self) -> u64 {
        let head = if self.head_bytes > 0 {
            self.head_bytes
        } else {
            self.embedding_bytes
        };
        self.layers
            .iter()
            .map(|l| l.active(self.config.n_expert_used))
            .sum::<u64>()
            + head
            + self.output_norm_bytes
    }

    /// Weight bytes a process holding layers `range` needs, including the embedding on the first
    /// stage and the head on the last.
    pub fn bytes_for_layers(&self, range: std::ops::Range<usize>) -> u64 {
        let mut b: u64 = self.layers[range.clone()]
            .iter()
            .map(LayerBytes::total)
            .sum();
        if range.start == 0 {
            b += self.embedding_bytes;
        }
        if range.end == self.config.n_layer {
            b += self.output_norm_bytes
                + if self.head_bytes > 0 {
                    self.head_bytes
                } else if range.start != 0 {
                    self.embedding_bytes
                } else {
                    0
                };
        }
        b
    }
}

/// Formats a byte count with binary units.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

impl fmt::Display for ModelProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(f, "file          {}", self.file.display())?;
        if let Some(n) = &self.name {
            writeln!(f, "name          {n}")?;
        }
        writeln!(
            f,
            "architecture  {}{}",
            c.arch.gguf_name(),
            if c.is_moe() {
                " (mixture of experts)"
            } else {
                ""
            }
        )?;
        writeln!(
            f,
            "parameters    {:.2} M    weights {} ({})    file {}",
            self.parameter_count as f64 / 1e6,
            human_bytes(self.weight_bytes()),
            self.weight_type,
            human_bytes(self.file_bytes)
        )?;
        writeln!(
            f,
            "geometry      hidden {}, {} layers, {} heads / {} KV heads of {}, vocab {}, context {}",
            c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.vocab_size, c.context_length
        )?;
        if c.is_moe() {
            writeln!(
                f,
                "experts       {} per layer, {} used per token, expert FFN {}",
                c.n_expert, c.n_expert_used, c.n_ff_expert
            )?;
        } else {
            writeln!(f, "ffn           {}", c.n_ff)?;
        }
        writeln!(
            f,
            "rope          {:?}, theta {}, {} dims{}    rms eps {:e}    tied embeddings {}",
            c.rope_style,
            c.rope_theta,
            c.rope_dim,
            if c.rope_freq_factors {
                ", frequency factors (rope_freqs)"
            } else {
                ""
            },
            c.rms_eps,
            c.tied_embeddings
        )?;
        if c.rope_scaling != crate::RopeScaling::None {
            writeln!(f, "rope scaling  {:?}", c.rope_scaling)?;
        }
        let list = |keep: &dyn Fn(usize) -> bool| -> String {
            (0..c.n_layer)
                .filter(|&l| keep(l))
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        if c.attention_chunk > 0 {
            writeln!(
                f,
                "attention     chunks of {} in layers {} (the others see the whole context)",
                c.attention_chunk,
                list(&|l| c.is_swa_layer(l))
            )?;
        }
        if (0..c.n_layer).any(|l| !c.uses_rope(l)) {
            let rms = if c.rope_qk_rms_norm {
                "; rotated queries and keys RMS-normed without a weight"
            } else {
                ""
            };
            let temp = if c.attn_temperature.is_some() {
                ", their queries temperature-tuned"
            } else {
                ""
            };
            writeln!(
                f,
                "position      no RoPE in layers {}{temp}{rms}",
                list(&|l| !c.uses_rope(l))
            )?;
        }
        if c.sliding_window > 0 {
            let swa: Vec<String> = (0..c.n_layer)
                .filter(|&l| c.is_swa_layer(l))
                .map(|l| l.to_string())
                .collect();
            writeln!(
                f,
                "attention     window of {} in layers {} (the others see the whole context)",
                c.sliding_window,
                swa.join(",")
            )?;
        }
        if let Some(m) = c.mla {
            let q = if m.q_lora_rank > 0 {
                format!("queries through rank {}", m.q_lora_rank)
            } else {
                "a plain query projection".into()
            };
            let layout = if m.absorbed {
                "attn_k_b/attn_v_b"
            } else {
                "attn_kv_b"
            };
            writeln!(
                f,
                "attention     latent (MLA): KV latent of {}, keys {} ({} rotated), values {}, {q}; \
                 {layout}, {} cached per position",
                m.kv_lora_rank,
                c.head_dim,
                c.rope_dim,
                m.v_head_dim,
                c.kv_cache_width()
            )?;
        }
        if c.interleaves_moe() {
            writeln!(
                f,
                "moe layers    {} (dense {} of FFN {}), {} shared expert(s) of FFN {}",
                list(&|l| c.is_moe_layer(l)),
                list(&|l| !c.is_moe_layer(l)),
                c.n_ff,
                c.n_expert_shared,
                c.n_ff_expert * c.n_expert_shared
            )?;
        } else if c.is_moe() && (c.n_layer_dense_lead > 0 || c.n_expert_shared > 0) {
            writeln!(
                f,
                "moe layers    {}..{} ({} dense first), {} shared expert(s) of FFN {}",
                c.n_layer_dense_lead,
                c.n_layer,
                c.n_layer_dense_lead,
                c.n_expert_shared,
                c.n_ff_expert * c.n_expert_shared
            )?;
        }
        let sigmoid = matches!(
            c.gating,
            crate::ExpertGating::Sigmoid | crate::ExpertGating::SigmoidInput
        );
        if c.is_moe() && (sigmoid || c.expert_groups > 1) {
            let groups = if c.expert_groups > 1 {
                format!(
                    ", best {} of {} groups",
                    c.expert_groups_used, c.expert_groups
                )
            } else {
                String::new()
            };
            writeln!(
                f,
                "routing       {:?} gating{}{}{}, weights x{}",
                c.gating,
                if c.expert_selection_bias {
                    ", selection bias"
                } else {
                    ""
                },
                groups,
                if c.norm_topk_weights {
                    ", normalised"
                } else {
                    ""
                },
                c.expert_weights_scale
            )?;
        }
        if c.has_oss_biases() {
            writeln!(
                f,
                "extras        Q/K/V/output biases, a sink logit per head, router bias ({:?}), \
                 per-expert biases, {:?}",
                c.gating, c.activation
            )?;
        }
        writeln!(
            f,
            "per token     KV {} (F32)    active weights {}    ~{:.2} GFLOP",
            human_bytes(self.kv_bytes_per_token),
            human_bytes(self.active_bytes_per_token()),
            self.flops_per_token as f64 / 1e9
        )?;
        writeln!(
            f,
            "embedding     {}    head {}",
            human_bytes(self.embedding_bytes),
            if self.head_bytes > 0 {
                human_bytes(self.head_bytes)
            } else {
                "tied to embedding".into()
            }
        )?;
        writeln!(f)?;
        writeln!(
            f,
            "{:>5}  {:>12}  {:>12}  {:>12}  {:>14}  {:>12}",
            "layer", "attention", "dense ffn", "router", "experts", "total"
        )?;
        for (i, l) in self.layers.iter().enumerate() {
            let experts = if l.experts.is_empty() {
                "-".to_string()
            } else {
                format!("{} x {}", l.experts.len(), human_bytes(l.experts[0]))
            };
            writeln!(
                f,
                "{:>5}  {:>12}  {:>12}  {:>12}  {:>14}  {:>12}",
                i,
                human_bytes(l.attention),
                human_bytes(l.dense_ffn),
                human_bytes(l.router),
                experts,
                human_bytes(l.total())
            )?;
        }
        Ok(())
    }
}
