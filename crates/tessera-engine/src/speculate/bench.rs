//! `tessera bench --draft`: speculative decoding against plain decoding, in the same run, on
//! the same prompt: acceptance rate, tokens per verification, the draft's cost, and the speedup.
//! Both runs must produce the same tokens; the report says whether they did.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::generate::{GenerationStats, Generator, SpeculationStats};
use crate::model::Model;
use tessera_sampling::speculate::{AdaptiveK, DraftSource};
use tessera_sampling::SamplingParams;

/// What [`bench_speculation`] measured (times: the mean over the repetitions).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SpeculationReport {
    /// Where drafts came from (`lookup`, `self`, a file name).
    pub draft: String,
    /// Most drafts per verification, and whether k was fixed there.
    pub max_k: usize,
    pub fixed_k: bool,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Plain decoding, one token per forward pass.
    pub baseline_tok_s: f64,
    /// With speculation.
    pub speculative_tok_s: f64,
    /// `speculative_tok_s / baseline_tok_s`.
    pub speedup: f64,
    /// Accepted over drafted tokens.
    pub acceptance_rate: f64,
    pub drafted: usize,
    pub accepted: usize,
    /// Decode forward passes with speculation (each verifies 0..=k drafts).
    pub verifications: usize,
    /// Generated tokens per decode forward pass.
    pub tokens_per_verification: f64,
    /// Drafting time per drafted token.
    pub draft_ms_per_token: f64,
    /// Share of the speculative decode time spent drafting.
    pub draft_share: f64,
    /// The speedup if drafting were free (`baseline time / verification time`): the
    /// mechanism's ceiling for this acceptance rate on this machine.
    pub speedup_without_draft_cost: f64,
    /// The two runs produced the same tokens (they must).
    pub same_tokens: bool,
}

impl fmt::Display for SpeculationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "draft {} (k {} {}), prompt {} tokens, {} generated",
            self.draft,
            if self.fixed_k { "=" } else { "≤" },
            self.max_k,
            self.prompt_tokens,
            self.generated_tokens
        )?;
        writeln!(
            f,
            "  decode: {:.1} tok/s without speculation, {:.1} tok/s with: {:.2}×",
            self.baseline_tok_s, self.speculative_tok_s, self.speedup
        )?;
        writeln!(
            f,
            "  acceptance {:.1}% ({} of {} drafts), {:.2} tokens per verification ({} verifications)",
            100.0 * self.acceptance_rate,
            self.accepted,
            self.drafted,
            self.tokens_per_verification,
            self.verifications
        )?;
        writeln!(
            f,
            "  draft cost {:.3} ms a token, {:.1}% of the decode time; {:.2}× if drafting were free",
            self.draft_ms_per_token,
            100.0 * self.draft_share,
            self.speedup_without_draft_cost
        )?;
        write!(
            f,
            "  same tokens as without speculation: {}",
            if self.same_tokens { "yes" } else { "NO" }
        )
    }
}

/// How [`bench_speculation`] runs.
pub struct SpeculationBench<'a> {
    pub prompt: &'a [u32],
    pub n_gen: usize,
    /// End-of-generation tokens (a run may stop before `n_gen`).
    pub eog: &'a [u32],
    pub params: SamplingParams,
    /// Timed runs of each kind (alternating); their mean is reported.
    pub repetitions: usize,
    /// A fresh draft source and k controller per speculative run.
    pub drafter: &'a mut dyn FnMut() -> (Box<dyn DraftSource>, AdaptiveK),
    /// Named in the report.
    pub draft_name: String,
}

fn run(
    model: &Model,
    b: &SpeculationBench<'_>,
    spec: Option<(Box<dyn DraftSource + '_>, AdaptiveK)>,
) -> Result<(Vec<u32>, GenerationStats)> {
    let capacity = (b.prompt.len() + b.n_gen + 1).min(model.config().context_length);
    let mut g = Generator::new(model, b.params.clone(), capacity);
    g.prefill_chunk = 256;
    if let Some((source, k)) = spec {
        g = g.with_speculation(source, k);
    }
    let mut out = Vec::new();
    let stats = g.generate(b.prompt, b.n_gen, b.eog, &mut |t| {
        out.push(t);
        true
    })?;
    Ok((out, stats))
}

/// Runs plain and speculative decoding of `b.prompt`, alternating, and compares them.
pub fn bench_speculation(model: &Model, b: &mut SpeculationBench<'_>) -> Result<SpeculationReport> {
    let reps = b.repetitions.max(1);
    let mut base_time = Duration::ZERO;
    let mut spec_time = Duration::ZERO;
    let mut spec = SpeculationStats::default();
    let mut same = true;
    let mut tokens = 0;
    let mut max_k = 0;
    let mut fixed = false;
    for _ in 0..reps {
        let (plain, ps) = run(model, b, None)?;
        let (source, k) = (b.drafter)();
        max_k = k.max_k();
        fixed = k.is_fixed();
        let (fast, ss) = run(model, b, Some((source, k)))?;
        same &= plain == fast;
        tokens = plain.len();
        base_time += ps.decode_time;
        spec_time += ss.decode_time;
        let s = ss.speculation;
        spec.verifications += s.verifications;
        spec.drafted += s.drafted;
        spec.accepted += s.accepted;
        spec.draft_time += s.draft_time;
        spec.verify_time += s.verify_time;
    }
    let per = |d: Duration| d.as_secs_f64() / reps as f64;
    // Decode tokens: the first comes from the prefill's logits, the rest from decode passes.
    let rate = |d: Duration| tokens as f64 / per(d).max(1e-9);
    let baseline = rate(base_time);
    let speculative = rate(spec_time);
    let verifications = spec.verifications as f64 / reps as f64;
    Ok(SpeculationReport {
        draft: b.draft_name.clone(),
        max_k,
        fixed_k: fixed,
        prompt_tokens: b.prompt.len(),
        generated_tokens: tokens,
        baseline_tok_s: baseline,
        speculative_tok_s: speculative,
        speedup: speculative / baseline.max(1e-9),
        acceptance_rate: spec.acceptance_rate(),
        drafted: spec.drafted / reps,
        accepted: spec.accepted / reps,
        verifications: spec.verifications / reps,
        tokens_per_verification: tokens.saturating_sub(1) as f64 / verifications.max(1.0),
        draft_ms_per_token: if spec.drafted == 0 {
            0.0
        } else {
            1e3 * spec.draft_time.as_secs_f64() / spec.drafted as f64
        },
        draft_share: spec.draft_time.as_secs_f64() / spec_time.as_secs_f64().max(1e-9),
        speedup_without_draft_cost: base_time.as_secs_f64()
            / spec.verify_time.as_secs_f64().max(1e-9),
        same_tokens: same,
    })
}
