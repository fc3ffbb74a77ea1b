//! Choosing the next token from logits, with llama.cpp's semantics and order: repetition
//! penalty → top-k → top-p → min-p → temperature → draw. The random draw for position `i`
//! depends only on `(seed, i)`, so replaying a request from its history reproduces its tokens
//! (failover relies on this).

use serde::{Deserialize, Serialize};

use crate::ops::argmax;

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
    /// How many of the most recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
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

/// Candidate tokens after filtering, most likely first, with their (possibly scaled) logits.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
}

impl Candidates {
    /// All tokens, sorted by logit descending (ties: lower id first).
    pub fn sorted(logits: &[f32]) -> Self {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
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
    apply_repetition_penalty(
        &mut logits,
        history,
        params.repeat_penalty,
        params.repeat_last_n,
    );
    if params.temperature <= 0.0 || params.top_k == 1 {
        return argmax(&logits) as u32;
    }
    let mut c = Candidates::sorted(&logits);
    c.top_k(params.top_k);
    c.top_p(params.top_p);
    c.min_p(params.min_p);
    c.temperature(params.temperature);
    c.draw(uniform(params.seed, position))
}

/// Watches streamed text for stop strings: says how much is safe to emit now, holding back any
/// tail that could be the start of a stop string.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
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
                .collect(),
            ..Self::default()
        }
    }

    /// Feeds more generated text.
    pub fn push(&mut self, text: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                emit: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(text);
        // The earliest complete stop string wins.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            self.stopped = true;
            let emit = self.pending[..at].to_string();
            self.pending.clear();
            return StopStep {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > hold && self.pending.ends_with(&s[..i]) {
                    hold = i;
                }
            }
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 42,
        }
    }

    #[test]
    fn same_seed_and_position_give_same_draw() {
        assert_eq!(uniform(7, 3), uniform(7, 3));
        assert_ne!(uniform(7, 3), uniform(7, 4));
        assert_ne!(uniform(7, 3), uniform(8, 3));
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = params(1.0, 0, 1.0, 0.0);
        for pos in 0..20 {
            assert_eq!(sample(&logits, &p, &[], pos), sample(&logits, &p, &[], pos));
        }
        // Different positions draw differently somewhere.
        let draws: std::collections::HashSet<u32> =
            (0..50).map(|pos| sample(&logits, &p, &[], pos)).collect();
        assert!(draws.len() > 1);
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
    fn params_roundtrip_through_json() {
        let p = params(0.7, 20, 0.9, 0.05);
        let s = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<SamplingParams>(&s).unwrap(), p);
        let d: SamplingParams = serde_json::from_str("{\"seed\": 5}").unwrap();
        assert_eq!(d.seed, 5);
        assert_eq!(d.top_k, 40);
    }

    #[test]
    fn stop_matcher_holds_back_prefixes() {
        let mut m = StopMatcher::new(["</s>", "\n\n"]);
        assert_eq!(m.push("Hello <").emit, "Hello ");
        assert_eq!(m.push("b").emit, "<b");
        let s = m.push(" wor\n");
        assert_eq!(s.emit, " wor");
        let s = m.push("\nrest");
        assert!(s.stopped);
        assert_eq!(s.emit, "");
        assert!(m.push("more").stopped);
        let mut m = StopMatcher::new(["STOP"]);
        let s = m.push("abcST");
        assert_eq!((s.emit.as_str(), s.stopped), ("abc", false));
        let s = m.push("OPxyz");
        assert_eq!((s.emit.as_str(), s.stopped), ("", true));
        let mut m = StopMatcher::new(["zz"]);
        assert_eq!(m.push("éz").emit, "é");
        assert_eq!(m.finish(), "z");
    }
}
