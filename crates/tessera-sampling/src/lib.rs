//! Choosing the next token from logits, with llama.cpp's semantics and order: penalties
//! (repetition, presence, frequency) and logit bias → top-k → top-p → min-p → temperature →
//! draw. The random draw for position `i` depends only on `(seed, i)`, so replaying a request
//! from its history reproduces its tokens (failover relies on this).
//!
//! [`sample`] is [`process_logits`] then [`sample_processed`]; a caller that masks tokens
//! (a grammar) or reports log-probabilities ([`token_logprobs`]) calls the two halves itself.
//!
//! [`speculate`] holds speculative decoding's pure parts: the acceptance rule that keeps the
//! text of one-token decoding, prompt lookup, and the adaptive draft length; [`prediction`]
//! drafts from a predicted answer the client sends.

#![forbid(unsafe_code)]

pub mod prediction;
pub mod speculate;

use serde::{Deserialize, Serialize};

mod validate;
pub use validate::{OutOfRange, SamplingParam};

/// A grammar the output must follow, as written by the client (serde: a cluster sends it to
/// its sampling stage, which compiles it with `tessera-grammar`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GrammarSpec {
    /// A JSON schema; the output is one JSON value matching it.
    JsonSchema(serde_json::Value),
    /// llguidance's lark dialect (`%json { … }` embeds a schema).
    Lark(String),
}

/// How to pick tokens. `temperature <= 0` is greedy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one (0: none).
    pub min_p: f32,
    /// llama.cpp's `repeat_penalty`: logits of recently seen tokens are divided by it when
    /// positive and multiplied when negative (1: off).
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the penalties look at (prompt included, as
    /// llama.cpp's `penalty_last_n`).
    pub repeat_last_n: usize,
    pub seed: u64,
    /// OpenAI's `presence_penalty`: subtracted once from the logit of every token seen in the
    /// window (0: off).
    pub presence_penalty: f32,
    /// OpenAI's `frequency_penalty`: subtracted from a token's logit once per occurrence in the
    /// window (0: off).
    pub frequency_penalty: f32,
    /// OpenAI's `logit_bias`: added to the logits of these token ids before sampling.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Always the most likely token.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 1,
            ..Self::default()
        }
    }
}

/// SplitMix64 finaliser: a good 64-bit mix.
pub fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The uniform draw in `[0, 1)` used at `position` for `seed`.
pub fn uniform(seed: u64, position: u64) -> f64 {
    let r = splitmix64(seed ^ splitmix64(position ^ 0xD1B5_4A32_D192_ED03));
    (r >> 11) as f64 / (1u64 << 53) as f64
}

/// Applies the repetition penalty to `logits` for the last `repeat_last_n` tokens of `history`
/// (each distinct token once).
pub fn apply_repetition_penalty(logits: &mut [f32], history: &[u32], penalty: f32, last_n: usize) {
    if penalty == 1.0 || last_n == 0 {
        return;
    }
    let recent = &history[history.len().saturating_sub(last_n)..];
    let mut seen = std::collections::HashSet::new();
    for &t in recent {
        let t = t as usize;
        if t < logits.len() && seen.insert(t) {
            let l = &mut logits[t];
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }
}

/// OpenAI's presence and frequency penalties over the last `last_n` tokens of `history`:
/// `logit -= presence * [count > 0] + frequency * count`.
pub fn apply_presence_frequency(
    logits: &mut [f32],
    history: &[u32],
    presence: f32,
    frequency: f32,
    last_n: usize,
) {
    if (presence == 0.0 && frequency == 0.0) || last_n == 0 {
        return;
    }
    let recent = &history[history.len().saturating_sub(last_n)..];
    let mut counts = std::collections::BTreeMap::<u32, u32>::new();
    for &t in recent {
        *counts.entry(t).or_default() += 1;
    }
    for (t, n) in counts {
        if let Some(l) = logits.get_mut(t as usize) {
            *l -= presence + frequency * n as f32;
        }
    }
}

/// Everything that changes logits before the draw: the repetition, presence and frequency
/// penalties, then the logit bias. Sampling depends on the result only through the
/// (processed) logits, so a caller may mask tokens after this and before [`sample_processed`].
pub fn process_logits(logits: &mut [f32], params: &SamplingParams, history: &[u32]) {
    apply_repetition_penalty(logits, history, params.repeat_penalty, params.repeat_last_n);
    apply_presence_frequency(
        logits,
        history,
        params.presence_penalty,
        params.frequency_penalty,
        params.repeat_last_n,
    );
    for &(t, b) in &params.logit_bias {
        if let Some(l) = logits.get_mut(t as usize) {
            *l += b;
        }
    }
}

/// The log-probability of the chosen token and of the `top_n` most likely ones.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// Most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of `logits` (processed, at temperature 1, before top-k/top-p/min-p: the model's
/// distribution as penalties, bias and any mask left it) for `token` and the `top_n` best.
/// Masked tokens (`-inf`) never appear in `top`.
pub fn token_logprobs(logits: &[f32], token: u32, top_n: usize) -> TokenLogprobs {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| (l as f64 - max).exp())
        .sum();
    let lse = max + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    let mut top = Vec::new();
    if top_n > 0 {
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .collect();
        let by_logit = |a: &u32, b: &u32| {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        if ids.len() > top_n {
            ids.select_nth_unstable_by(top_n - 1, by_logit);
            ids.truncate(top_n);
        }
        ids.sort_by(by_logit);
        top = ids
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect();
    }
    TokenLogprobs {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top,
    }
}

/// Candidate tokens after filtering, most likely first, with their (possibly scaled) logits.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
}

impl Candidates {
    /// The tokens that can be drawn, sorted by logit descending (ties: lower id first).
    ///
    /// Masked tokens (`-inf`: a grammar forbids them) are left out: their weight is 0, so no
    /// draw changes, except the fallback to the last candidate when rounding leaves the
    /// cumulative sum below `u` — which must not land on a forbidden token. It also keeps the
    /// sort of a masked row to the few tokens allowed. A row with nothing finite keeps all.
    pub fn sorted(logits: &[f32]) -> Self {
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize] != f32::NEG_INFINITY)
            .collect();
        if ids.is_empty() {
            ids = (0..logits.len() as u32).collect();
        }
        ids.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        let logits = ids.iter().map(|&i| logits[i as usize]).collect();
        Self { ids, logits }
    }

    fn truncate(&mut self, n: usize) {
        let n = n.max(1);
        self.ids.truncate(n);
        self.logits.truncate(n);
    }

    /// Probabilities of the current candidates (softmax in f64).
    pub fn probs(&self) -> Vec<f64> {
        let max = self.logits[0] as f64;
        let e: Vec<f64> = self
            .logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|v| v / s).collect()
    }

    pub fn top_k(&mut self, k: usize) {
        if k > 0 && k < self.ids.len() {
            self.truncate(k);
        }
    }

    pub fn top_p(&mut self, p: f32) {
        if p >= 1.0 {
            return;
        }
        let probs = self.probs();
        let mut cum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if cum >= p as f64 {
                self.truncate(i + 1);
                return;
            }
        }
    }

    pub fn min_p(&mut self, p: f32) {
        if p <= 0.0 {
            return;
        }
        let threshold = self.logits[0] + p.ln();
        let keep = self.logits.iter().take_while(|&&l| l >= threshold).count();
        self.truncate(keep);
    }

    pub fn temperature(&mut self, t: f32) {
        for l in &mut self.logits {
            *l /= t;
        }
    }

    /// Draws a candidate with probability proportional to `softmax(logits)` using `u` in [0,1).
    pub fn draw(&self, u: f64) -> u32 {
        let probs = self.probs();
        let mut cum = 0.0;
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if u < cum {
                return self.ids[i];
            }
        }
        *self.ids.last().expect("at least one candidate")
    }
}

/// Picks the token at `position` (the index in the sequence the token will occupy) from `logits`
/// given the sequence so far (`history`, for the repetition penalty).
pub fn sample(logits: &[f32], params: &SamplingParams, history: &[u32], position: u64) -> u32 {
    let mut logits = logits.to_vec();
    process_logits(&mut logits, params, history);
    sample_processed(&logits, params, position)
}

/// The draw after [`process_logits`]: greedy, or top-k → top-p → min-p → temperature → draw.
pub fn sample_processed(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    if params.temperature <= 0.0 || params.top_k == 1 {
        return argmax(logits) as u32;
    }
    let mut c = Candidates::sorted(logits);
    c.top_k(params.top_k);
    c.top_p(params.top_p);
    c.min_p(params.min_p);
    c.temperature(params.temperature);
    c.draw(uniform(params.seed, position))
}

/// Watches streamed text for stop strings: says how much is safe to emit now, holding back any
/// tail that could be the start of a stop string.
///
/// Each stop string keeps a Knuth–Morris–Pratt state (how much of it the text's tail already
/// matches), so a pushed byte costs O(1) amortized per stop string: a token costs O(its bytes
/// × stop strings), never a rescan of the pending text against every prefix. Clients choose
/// the stop strings; their cost must not depend on how hostile they are.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<StopString>,
    pending: String,
    stopped: bool,
    /// Which of `stops` ended the text (Anthropic's `stop_sequence` names it).
    matched: Option<usize>,
}

/// One stop string with its failure function and how much of it the text's tail matches.
#[derive(Clone, Debug)]
struct StopString {
    text: String,
    /// `fail[i]`: the longest proper prefix of `text[..=i]` that is also its suffix.
    fail: Vec<usize>,
    matched: usize,
}

impl StopString {
    fn new(text: String) -> Self {
        let bytes = text.as_bytes();
        let mut fail = vec![0; bytes.len()];
        let mut k = 0;
        for i in 1..bytes.len() {
            while k > 0 && bytes[i] != bytes[k] {
                k = fail[k - 1];
            }
            if bytes[i] == bytes[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Self {
            text,
            fail,
            matched: 0,
        }
    }

    /// Advances over `b`; true when the whole string has just been matched.
    fn step(&mut self, b: u8) -> bool {
        let bytes = self.text.as_bytes();
        if self.matched == bytes.len() {
            self.matched = self.fail[self.matched - 1];
        }
        while self.matched > 0 && bytes[self.matched] != b {
            self.matched = self.fail[self.matched - 1];
        }
        if bytes[self.matched] == b {
            self.matched += 1;
        }
        self.matched == bytes.len()
    }
}

/// What [`StopMatcher::push`] allows.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text safe to emit now.
    pub emit: String,
    /// A stop string was hit: `emit` ends just before it and generation should stop.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            stops: stops
                .into_iter()
                .map(Into::into)
                .filter(|s: &String| !s.is_empty())
                .map(StopString::new)
                .collect(),
            ..Self::default()
        }
    }

    /// Feeds more generated text. The first stop string to be completed ends the text, just
    /// before where it starts.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                emit: String::new(),
                stopped: true,
            };
        }
        let base = self.pending.len();
        self.pending.push_str(text);
        for (i, &b) in text.as_bytes().iter().enumerate() {
            let end = base + i + 1;
            // Every state advances; of the strings that end here, the longest starts earliest
            // (and the first listed among equals).
            let mut hit: Option<(usize, usize)> = None;
            for (k, s) in self.stops.iter_mut().enumerate() {
                if s.step(b) && hit.is_none_or(|(_, len)| s.text.len() > len) {
                    hit = Some((k, s.text.len()));
                }
            }
            if let Some((k, len)) = hit {
                self.stopped = true;
                self.matched = Some(k);
                let emit = self.pending[..end - len].to_string();
                self.pending.clear();
                return StopStep {
                    emit,
                    stopped: true,
                };
            }
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let hold = self.stops.iter().map(|s| s.matched).max().unwrap_or(0);
        let cut = self.pending.len() - hold;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopStep {
            emit,
            stopped: false,
        }
    }

    /// End of generation: the held-back text (empty after a stop).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// The stop string that ended the text, once one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].text.as_str())
    }
}

/// Index of the largest value (the first one on ties): greedy decoding's choice.
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `uniform(7, 3)` and `uniform(0, 0)` as f64 bits, as the generator gives them today.
    const UNIFORM_7_3: u64 = 0x3fe8_bb4a_85ea_d133;
    const UNIFORM_0_0: u64 = 0x3fe3_1793_6753_ec9b;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 42,
            ..SamplingParams::default()
        }
    }

    /// Failover replays a request on other processes, possibly another build: the draw at a
    /// position must depend on `(seed, position)` alone — not on what was drawn before, in
    /// which order, or on the history when no penalty applies — and the generator must not
    /// change under us (pinned values). The token drawn is the one an independent inverse-CDF
    /// over the softmax gives for that draw.
    #[test]
    fn same_seed_and_position_give_same_draw() {
        // Pinned: a changed generator would change every replayed sampled request.
        assert_eq!(uniform(7, 3).to_bits(), UNIFORM_7_3);
        assert_eq!(uniform(0, 0).to_bits(), UNIFORM_0_0);
        assert_ne!(uniform(7, 3), uniform(7, 4));
        assert_ne!(uniform(7, 3), uniform(8, 3));

        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = params(0.7, 0, 1.0, 0.0);
        // Independent reference: softmax of logits / T in f64, ids by logit descending (ties:
        // lower id), first cumulative probability above u.
        let reference = |u: f64| -> u32 {
            let mut ids: Vec<usize> = (0..logits.len()).collect();
            ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
            let scaled: Vec<f64> = ids.iter().map(|&i| (logits[i] / 0.7) as f64).collect();
            let e: Vec<f64> = scaled.iter().map(|l| (l - scaled[0]).exp()).collect();
            let sum: f64 = e.iter().sum();
            let mut cum = 0.0;
            for (k, v) in e.iter().enumerate() {
                cum += v / sum;
                if u < cum {
                    return ids[k] as u32;
                }
            }
            ids[ids.len() - 1] as u32
        };
        let forward: Vec<u32> = (0..64).map(|pos| sample(&logits, &p, &[], pos)).collect();
        for (pos, &t) in forward.iter().enumerate() {
            assert_eq!(t, reference(uniform(p.seed, pos as u64)), "position {pos}");
        }
        // Drawn backwards, interleaved with another seed's draws, with a history: the same.
        let other = SamplingParams {
            seed: 99,
            ..p.clone()
        };
        for pos in (0..64u64).rev() {
            let _ = sample(&logits, &other, &[], pos);
            let history: Vec<u32> = (0..pos as u32).collect();
            assert_eq!(sample(&logits, &p, &history, pos), forward[pos as usize]);
        }
        // Different positions draw differently somewhere, and another seed differs somewhere.
        let distinct: std::collections::HashSet<u32> = forward.iter().copied().collect();
        assert!(distinct.len() > 1);
        assert!((0..64).any(|pos| sample(&logits, &other, &[], pos) != forward[pos as usize]));
    }

    #[test]
    fn uniform_is_in_unit_interval() {
        for i in 0..1000 {
            let u = uniform(i * 31, i);
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let logits = vec![0.1, 3.0, -2.0, 2.9];
        assert_eq!(sample(&logits, &SamplingParams::greedy(), &[], 0), 1);
        assert_eq!(sample(&logits, &params(0.0, 0, 1.0, 0.0), &[], 5), 1);
    }

    #[test]
    fn top_k_keeps_k_best() {
        let mut c = Candidates::sorted(&[0.0, 5.0, 1.0, 4.0, 3.0]);
        c.top_k(2);
        assert_eq!(c.ids, vec![1, 3]);
        // With top_k 2 only those two can ever be drawn.
        let p = params(1.0, 2, 1.0, 0.0);
        for pos in 0..200 {
            let t = sample(&[0.0, 5.0, 1.0, 4.0, 3.0], &p, &[], pos);
            assert!(t == 1 || t == 3);
        }
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_p() {
        // probabilities ~ 0.5, 0.25, 0.125, 0.125
        let l = [2f32.ln() * 2.0, 2f32.ln(), 0.0, 0.0];
        let mut c = Candidates::sorted(&l);
        c.top_p(0.7);
        assert_eq!(c.ids, vec![0, 1]);
        let mut c = Candidates::sorted(&l);
        c.top_p(0.5);
        assert_eq!(c.ids, vec![0]);
        let mut c = Candidates::sorted(&l);
        c.top_p(1.0);
        assert_eq!(c.ids.len(), 4);
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // relative probabilities 1, 0.5, 0.05
        let l = [0.0, 0.5f32.ln(), 0.05f32.ln()];
        let mut c = Candidates::sorted(&l);
        c.min_p(0.1);
        assert_eq!(c.ids, vec![0, 1]);
        let mut c = Candidates::sorted(&l);
        c.min_p(0.6);
        assert_eq!(c.ids, vec![0]);
    }

    #[test]
    fn repetition_penalty_follows_llama_cpp() {
        let mut l = vec![2.0, -2.0, 1.0];
        apply_repetition_penalty(&mut l, &[0, 1, 0], 2.0, 64);
        assert_eq!(l, vec![1.0, -4.0, 1.0]);
        // Only the last n tokens count.
        let mut l = vec![2.0, -2.0, 1.0];
        apply_repetition_penalty(&mut l, &[0, 1, 2], 2.0, 1);
        assert_eq!(l, vec![2.0, -2.0, 0.5]);
        // It can change the greedy choice.
        let p = SamplingParams {
            repeat_penalty: 3.0,
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&[2.0, 1.0], &p, &[0], 0), 1);
    }

    #[test]
    fn presence_frequency_and_bias_follow_openai() {
        let mut l = vec![1.0, 1.0, 1.0];
        apply_presence_frequency(&mut l, &[0, 0, 1], 0.5, 0.25, 64);
        assert_eq!(l, vec![1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0]);
        let p = SamplingParams {
            logit_bias: vec![(2, 100.0)],
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&[5.0, 1.0, 0.0], &p, &[], 0), 2);
        let p = SamplingParams {
            presence_penalty: 2.0,
            ..SamplingParams::greedy()
        };
        assert_eq!(sample(&[2.0, 1.0], &p, &[0], 0), 1);
    }

    #[test]
    fn logprobs_are_log_softmax_without_masked_tokens() {
        let l = [0.0f32, 1.0, f32::NEG_INFINITY, 2.0f32.ln()];
        let lp = token_logprobs(&l, 1, 5);
        let z = (1.0f64 + 1f64.exp() + 2.0).ln();
        assert!((lp.logprob as f64 - (1.0 - z)).abs() < 1e-6);
        assert_eq!(
            lp.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 0]
        );
        let total: f64 = lp.top.iter().map(|t| (t.1 as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert!(token_logprobs(&l, 1, 0).top.is_empty());
    }

    #[test]
    fn params_roundtrip_through_json() {
        let p = params(0.7, 20, 0.9, 0.05);
        let s = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<SamplingParams>(&s).unwrap(), p);
        let d: SamplingParams = serde_json::from_str("{\"seed\": 5}").unwrap();
        assert_eq!(d.seed, 5);
        assert_eq!(d.top_k, 40);
    }

    /// Candidates are the finite tokens by (logit descending, id); masked ones (`-inf`) are
    /// never drawn, not even as the fallback of a sum that rounding left short.
    #[test]
    fn candidates_leave_masked_tokens_out() {
        let logits: Vec<f32> = (0..5000u32)
            .map(|i| match splitmix64(u64::from(i)) % 7 {
                0 => f32::NEG_INFINITY,
                r => (splitmix64(u64::from(i) ^ 99) % 50) as f32 / (r as f32),
            })
            .collect();
        let mut ids: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .collect();
        ids.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        let c = Candidates::sorted(&logits);
        assert_eq!(c.ids, ids);
        // A `u` past the cumulative sum (as rounding can leave it) falls back to an allowed token.
        assert!(logits[c.draw(1.0) as usize].is_finite());
        let masked = [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY, 1.0];
        assert_eq!(Candidates::sorted(&masked).ids, vec![1, 3]);
        assert_eq!(
            Candidates::sorted(&[f32::NEG_INFINITY; 3]).ids,
            vec![0, 1, 2]
        );
    }

    #[test]
    fn stop_matcher_holds_back_prefixes() {
        let mut m = StopMatcher::new(["</s>", "\n\n"]);
        assert_eq!(m.push("Hello <").emit, "Hello ");
        assert_eq!(m.push("b").emit, "<b");
        let s = m.push(" wor\n");
        assert_eq!(s.emit, " wor");
        assert_eq!(m.matched(), None);
        let s = m.push("\nrest");
        assert!(s.stopped);
        assert_eq!(s.emit, "");
        assert_eq!(
            m.matched(),
            Some("\n\n"),
            "the stop string that ended it is named"
        );
        assert!(m.push("more").stopped);
        let mut m = StopMatcher::new(["STOP"]);
        let s = m.push("abcST");
        assert_eq!((s.emit.as_str(), s.stopped), ("abc", false));
        let s = m.push("OPxyz");
        assert_eq!((s.emit.as_str(), s.stopped), ("", true));
        let mut m = StopMatcher::new(["zz"]);
        assert_eq!(m.push("éz").emit, "é");
        assert_eq!(m.finish(), "z");
        assert_eq!(m.matched(), None);
        // The earliest in the text wins, whatever the list order.
        let mut m = StopMatcher::new(["cd", "b"]);
        assert!(m.push("abcd").stopped);
        assert_eq!(m.matched(), Some("b"));
        // Overlapping starts: "aab" after "aaa" (the failure function, not a restart).
        let mut m = StopMatcher::new(["aab"]);
        assert_eq!(m.push("xaaa").emit, "xa");
        let s = m.push("b!");
        assert_eq!((s.emit.as_str(), s.stopped), ("", true));
        // Several strings: the first to complete ends the text.
        let mut m = StopMatcher::new(["abcd", "bc"]);
        let s = m.push("zabcd");
        assert_eq!((s.emit.as_str(), s.stopped), ("za", true));
    }

    /// The matcher against the obvious quadratic definition on many random streams.
    #[test]
    fn stop_matcher_agrees_with_a_rescan_of_the_whole_text() {
        let mut seed = 7u64;
        let mut next = move |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let alphabet = ['a', 'b', 'é'];
        for _ in 0..2000 {
            let mut word =
                |len: u64| -> String { (0..len).map(|_| alphabet[next(3) as usize]).collect() };
            let n_stops = 1 + word(1).len() % 3;
            let stops: Vec<String> = (0..n_stops)
                .map(|i| word(1 + (i as u64 * 7 + 3) % 4))
                .collect();
            let pieces: Vec<String> = (0..5u64).map(|i| word(i % 4)).collect();
            let mut m = StopMatcher::new(stops.iter().cloned());
            let mut out = String::new();
            let mut stopped = false;
            for p in &pieces {
                let s = m.push(p);
                out.push_str(&s.emit);
                if s.stopped {
                    stopped = true;
                    break;
                }
            }
            if !stopped {
                out.push_str(&m.finish());
            }
            // Reference: the earliest end of any stop string in the whole text.
            let all: String = pieces.concat();
            let first_end = stops
                .iter()
                .filter_map(|s| all.find(s.as_str()).map(|at| (at + s.len(), at)))
                .min_by_key(|&(end, at)| (end, std::cmp::Reverse(end - at)));
            let want = first_end.map_or(all.as_str(), |(_, at)| &all[..at]);
            assert_eq!(out, want, "stops {stops:?} pieces {pieces:?}");
            assert_eq!(stopped, first_end.is_some());
        }
    }
}
