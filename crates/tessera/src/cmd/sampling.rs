//! The sampling flags `tessera generate` and `tessera run` share.

use tessera_sampling::SamplingParams;

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
    /// Subtract this from the logit of every token already in the last 64 (OpenAI's
    /// `presence_penalty`, -2 to 2; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Subtract this once per occurrence in the last 64 tokens (OpenAI's `frequency_penalty`,
    /// -2 to 2; 0: off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// Random seed: the same seed, prompt and settings give the same text.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    /// The parameters, checked against the ranges every front end shares (the HTTP API's
    /// error, word for word).
    pub fn params(&self) -> anyhow::Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            ..SamplingParams::default()
        };
        params.validate()?;
        Ok(params)
    }
}
