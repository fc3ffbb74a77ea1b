//! Model configs and helpers shared by the integration tests.
#![allow(dead_code)]

use tessera_plan::{ModelProfile, Quant};

/// Benchmark-size Qwen3 dense model.
pub const QWEN3_DENSE_SMALL: &str = r#"{"model_type":"qwen3","hidden_size":1024,"num_hidden_layers":28,
 "num_attention_heads":16,"num_key_value_heads":8,"head_dim":128,"intermediate_size":3072,
 "vocab_size":32000,"tie_word_embeddings":true}"#;

/// Benchmark-size Qwen3 MoE model.
pub const QWEN3_MOE_SMALL: &str = r#"{"model_type":"qwen3_moe","hidden_size":1024,"num_hidden_layers":12,
 "num_attention_heads":16,"num_key_value_heads":4,"head_dim":128,"intermediate_size":3072,
 "moe_intermediate_size":512,"num_experts":64,"num_experts_per_tok":8,"vocab_size":32000,
 "tie_word_embeddings":true}"#;

/// Qwen3-30B-A3B.
pub const QWEN3_30B_A3B: &str = r#"{"model_type":"qwen3_moe","hidden_size":2048,"num_hidden_layers":48,
 "num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"intermediate_size":6144,
 "moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8,"vocab_size":151936,
 "tie_word_embeddings":false,"decoder_sparse_step":1,"mlp_only_layers":[]}"#;

/// Qwen3-235B-A22B.
pub const QWEN3_235B_A22B: &str = r#"{"model_type":"qwen3_moe","hidden_size":4096,"num_hidden_layers":94,
 "num_attention_heads":64,"num_key_value_heads":4,"head_dim":128,"intermediate_size":12288,
 "moe_intermediate_size":1536,"num_experts":128,"num_experts_per_tok":8,"vocab_size":151936,
 "tie_word_embeddings":false}"#;

/// Llama 3.1 8B.
pub const LLAMA_3_1_8B: &str = r#"{"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,
 "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"vocab_size":128256,
 "tie_word_embeddings":false}"#;

/// Qwen2.5 14B.
pub const QWEN2_5_14B: &str = r#"{"model_type":"qwen2","hidden_size":5120,"num_hidden_layers":48,
 "num_attention_heads":40,"num_key_value_heads":8,"intermediate_size":13824,"vocab_size":152064,
 "tie_word_embeddings":false}"#;

/// Mixtral 8x7B.
pub const MIXTRAL_8X7B: &str = r#"{"model_type":"mixtral","hidden_size":4096,"num_hidden_layers":32,
 "num_attention_heads":32,"num_key_value_heads":8,"intermediate_size":14336,"num_local_experts":8,
 "num_experts_per_tok":2,"vocab_size":32000,"tie_word_embeddings":false}"#;

pub fn model(config: &str, quant: Quant) -> ModelProfile {
    ModelProfile::from_hf_config(config, quant).expect("config parses")
}
