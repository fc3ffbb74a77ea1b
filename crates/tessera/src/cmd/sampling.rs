//! The sampling flags `tessera generate` and `tessera run` share.

use tessera_engine::SamplingParams;

#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 picks the most likely token every time (greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P.
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens less likely than MIN_P times the most likely one.
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Penalise recently generated tokens (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Random seed: the same seed, prompt and settings give the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            ..SamplingParams::default()
        }
    }
}
