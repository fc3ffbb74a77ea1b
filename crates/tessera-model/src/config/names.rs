//! Tensor names, in one place.

pub const TOKEN_EMBD: &str = "token_embd.weight";
pub const OUTPUT_NORM: &str = "output_norm.weight";
pub const OUTPUT: &str = "output.weight";
/// llama3-style RoPE frequency factors, one per rotated pair (optional).
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// The norm before a layer's feed-forward block: `ffn_norm` in most families,
/// `post_attention_norm` in gpt-oss.
pub fn ffn_norm(arch: super::Architecture) -> &'static str {
    match arch {
        super::Architecture::GptOss | super::Architecture::Glm4Moe => "post_attention_norm.weight",
        _ => "ffn_norm.weight",
    }
}

pub fn layer(i: usize, what: &str) -> String {
    format!("blk.{i}.{what}")
}
