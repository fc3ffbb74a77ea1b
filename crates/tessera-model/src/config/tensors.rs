//! The tensors an architecture reads, with the shapes its hyperparameters imply, and the check
//! of a GGUF file's tensors against them.

use super::{names, ModelConfig};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

impl ModelConfig {
    /// Every tensor the architecture reads, with the shape (GGML order) the hyperparameters imply.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<u64>)> {
        let (e, q, kv) = (
            self.n_embd as u64,
            self.q_dim() as u64,
            self.kv_dim() as u64,
        );
        let mut out = vec![
            (
                names::TOKEN_EMBD.to_string(),
                vec![e, self.vocab_size as u64],
            ),
            (names::OUTPUT_NORM.to_string(), vec![e]),
        ];
        if self.rope_freq_factors {
            out.push((
                names::ROPE_FREQS.to_string(),
                vec![self.rope_dim as u64 / 2],
            ));
        }
        if !self.tied_embeddings {
            out.push((names::OUTPUT.to_string(), vec![e, self.vocab_size as u64]));
        }
        for i in 0..self.n_layer {
            let l = |w: &str| names::layer(i, w);
            out.push((l("attn_norm.weight"), vec![e]));
            if let Some(m) = self.mla {
                let (qr, kvr) = (m.q_lora_rank as u64, m.kv_lora_rank as u64);
                if qr > 0 {
                    out.push((l("attn_q_a.weight"), vec![e, qr]));
                    out.push((l("attn_q_a_norm.weight"), vec![qr]));
                    out.push((l("attn_q_b.weight"), vec![qr, q]));
                } else {
                    out.push((l("attn_q.weight"), vec![e, q]));
                }
                let (nope, nh) = ((self.head_dim - self.rope_dim) as u64, self.n_head as u64);
                let dv = m.v_head_dim as u64;
                out.push((
                    l("attn_kv_a_mqa.weight"),
                    vec![e, kvr + self.rope_dim as u64],
                ));
                out.push((l("attn_kv_a_norm.weight"), vec![kvr]));
                if m.absorbed {
                    out.push((l("attn_k_b.weight"), vec![nope, kvr, nh]));
                    out.push((l("attn_v_b.weight"), vec![kvr, dv, nh]));
                } else {
                    out.push((l("attn_kv_b.weight"), vec![kvr, nh * (nope + dv)]));
                }
                out.push((l("attn_output.weight"), vec![self.attn_out_dim() as u64, e]));
            } else {
                out.push((l("attn_q.weight"), vec![e, q]));
                out.push((l("attn_k.weight"), vec![e, kv]));
                out.push((l("attn_v.weight"), vec![e, kv]));
                out.push((l("attn_output.weight"), vec![q, e]));
            }
            if self.has_qkv_bias() {
                out.push((l("attn_q.bias"), vec![q]));
                out.push((l("attn_k.bias"), vec![kv]));
                out.push((l("attn_v.bias"), vec![kv]));
            }
            if self.has_oss_biases() {
                out.push((l("attn_output.bias"), vec![e]));
                out.push((l("attn_sinks.weight"), vec![self.n_head as u64]));
            }
            if self.has_qk_norm() {
                out.push((l("attn_q_norm.weight"), vec![self.head_dim as u64]));
                out.push((l("attn_k_norm.weight"), vec![self.head_dim as u64]));
            }
            out.push((l(names::ffn_norm(self.arch)), vec![e]));
            if self.is_moe_layer(i) {
                let (n, f) = (self.n_expert as u64, self.n_ff_expert as u64);
                out.push((l("ffn_gate_inp.weight"), vec![e, n]));
                out.push((l("ffn_gate_exps.weight"), vec![e, f, n]));
                out.push((l("ffn_up_exps.weight"), vec![e, f, n]));
                out.push((l("ffn_down_exps.weight"), vec![f, e, n]));
                if self.expert_selection_bias {
                    out.push((l("exp_probs_b.bias"), vec![n]));
                }
                if self.n_expert_shared > 0 {
                    let fs = f * self.n_expert_shared as u64;
                    out.push((l("ffn_gate_shexp.weight"), vec![e, fs]));
                    out.push((l("ffn_up_shexp.weight"), vec![e, fs]));
                    out.push((l("ffn_down_shexp.weight"), vec![fs, e]));
                }
                if self.has_oss_biases() {
                    out.push((l("ffn_gate_inp.bias"), vec![n]));
                    out.push((l("ffn_gate_exps.bias"), vec![f, n]));
                    out.push((l("ffn_up_exps.bias"), vec![f, n]));
                    out.push((l("ffn_down_exps.bias"), vec![e, n]));
                }
            } else {
                let f = self.n_ff as u64;
                out.push((l("ffn_gate.weight"), vec![e, f]));
                out.push((l("ffn_up.weight"), vec![e, f]));
                out.push((l("ffn_down.weight"), vec![f, e]));
            }
        }
        out
    }

    pub(super) fn check_tensors(&self, g: &GgufFile) -> Result<()> {
        for (name, expected) in self.expected_tensors() {
            let t = g.require_tensor(&name)?;
            if t.shape != expected {
                return Err(ModelError::ShapeMismatch {
                    path: g.path().to_owned(),
                    tensor: name,
                    found: t.shape.clone(),
                    expected,
                });
            }
        }
        Ok(())
    }
}
