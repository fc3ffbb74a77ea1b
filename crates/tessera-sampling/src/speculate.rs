//! Speculative decoding that never changes the text: the pure parts.
//!
//! A draft source ([`DraftSource`]) guesses the next few tokens; the target model computes the
//! logits of the last accepted token and of every draft in one forward pass (its kernels are
//! batch-invariant, so row `i` is bit-identical to what a one-token step would have produced);
//! then [`settle`] walks the rows in order and *draws* each position exactly as decoding one
//! token at a time would — same logits, same history, same `(seed, position)` randomness — and
//! accepts a draft iff it equals the draw. The first mismatch ends the walk: its draw is the
//! next token (so every verification yields at least one), and everything after it is
//! dropped. Greedy decoding is the case where the draw is the argmax. The text, and the
//! log-probabilities reported with it, are therefore those of plain decoding; only the number of
//! forward passes changes.
//!
//! How many tokens to draft ([`AdaptiveK`]) comes from the measured acceptance rate and the
//! measured costs ([`CostMeter`]): a draft is worth it when the tokens it is expected to win
//! pay for the extra rows and the drafting; when none is, speculation is off (k = 0) apart from
//! an occasional one-token probe, so a draft that rarely agrees costs almost nothing.

/// Something that guesses how a token sequence goes on.
pub trait DraftSource: Send {
    /// Up to `k` tokens likely to follow `history` (prompt and generated tokens so far); fewer
    /// or none when it has no guess.
    fn propose(&mut self, history: &[u32], k: usize) -> Vec<u32>;
}

/// The outcome of one verification.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settled {
    /// Drafts equal to the draw at their position (a prefix of the drafts): their positions
    /// stay in the KV cache, the rest are dropped.
    pub accepted: usize,
    /// Draft positions whose draw was compared with the draft (`accepted`, plus one for the
    /// mismatch when there was one): what the acceptance rate counts.
    pub judged: usize,
}

/// Walks the rows of a verification of `drafts`, as described in the module doc.
///
/// `draw(i)` draws the token for row `i` exactly as one-token decoding would (row 0 follows the
/// last accepted token, row `i` follows `drafts[i - 1]`) and records it; it returns `None` when
/// generation ends there (an end-of-generation token, the length limit, the client stopping),
/// which ends the walk too. Returns how many drafts were accepted.
pub fn settle<E>(
    drafts: &[u32],
    mut draw: impl FnMut(usize) -> Result<Option<u32>, E>,
) -> Result<Settled, E> {
    for i in 0..=drafts.len() {
        let Some(token) = draw(i)? else {
            return Ok(Settled {
                accepted: i,
                judged: i,
            });
        };
        if drafts.get(i) != Some(&token) {
            return Ok(Settled {
                accepted: i,
                judged: (i + 1).min(drafts.len()),
            });
        }
    }
    Ok(Settled {
        accepted: drafts.len(),
        judged: drafts.len(),
    })
}

/// Prompt lookup: drafts by finding the most recent earlier occurrence of the sequence's last
/// few tokens and proposing what followed it. No model; strong when the output copies its
/// input (code edits, quoting, structured output). Where what followed runs into the end of
/// the history (a text repeating with a period shorter than `k`), the guess goes on with the
/// same period, as an LZ77 copy overlapping itself: otherwise a token repeated over and over
/// would be drafted one at a time.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    /// Longest suffix tried first; shorter ones down to `min_ngram` after.
    pub max_ngram: usize,
    pub min_ngram: usize,
    /// How far back the search looks, in tokens (bounds the cost per step).
    pub window: usize,
}

impl Default for PromptLookup {
    fn default() -> Self {
        Self {
            max_ngram: 4,
            min_ngram: 2,
            window: 4096,
        }
    }
}

impl DraftSource for PromptLookup {
    fn propose(&mut self, history: &[u32], k: usize) -> Vec<u32> {
        if k == 0 {
            return Vec::new();
        }
        let from = history.len().saturating_sub(self.window);
        let h = &history[from..];
        for n in (self.min_ngram.max(1)..=self.max_ngram).rev() {
            if h.len() <= n {
                continue;
            }
            let suffix = &h[h.len() - n..];
            // Most recent occurrence first, not the suffix itself.
            if let Some(start) = (0..h.len() - n).rev().find(|&s| &h[s..s + n] == suffix) {
                // Token `len + i` is guessed as the one `period` before it.
                let period = h.len() - n - start;
                let mut drafts: Vec<u32> = h[start + n..].iter().take(k).copied().collect();
                while drafts.len() < k {
                    drafts.push(drafts[drafts.len() - period]);
                }
                return drafts;
            }
        }
        Vec::new()
    }
}

/// No guesses: speculation off.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoDraft;

impl DraftSource for NoDraft {
    fn propose(&mut self, _history: &[u32], _k: usize) -> Vec<u32> {
        Vec::new()
    }
}

/// Expected tokens one verification of `k` drafts yields when each draft is accepted with
/// probability `alpha` independently: the accepted prefix plus the draw after it.
pub fn expected_tokens(alpha: f64, k: usize) -> f64 {
    let a = alpha.clamp(0.0, 1.0);
    (0..=k).map(|i| a.powi(i as i32)).sum()
}

/// What a verification costs, in seconds, as measured ([`CostMeter`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DraftCosts {
    /// A forward pass without this sequence's drafts.
    pub step_secs: f64,
    /// Each extra row (draft) in the forward pass.
    pub row_secs: f64,
    /// Drafting one token.
    pub draft_token_secs: f64,
}

/// The `k` in `0..=max_k` with the most expected tokens per second; 0 when no draft beats
/// plain decoding.
pub fn best_k(alpha: f64, costs: &DraftCosts, max_k: usize) -> usize {
    let per_draft = costs.row_secs.max(0.0) + costs.draft_token_secs.max(0.0);
    let step = costs.step_secs.max(1e-12);
    let mut best = (0, 1.0 / step);
    for k in 1..=max_k {
        let rate = expected_tokens(alpha, k) / (step + k as f64 * per_draft);
        // A draft must win by a margin: noise in the estimates must not turn it on.
        if rate > best.1 * 1.02 {
            best = (k, rate);
        }
    }
    best.0
}

/// Draft length chosen per verification from the measured acceptance rate; see the module doc.
#[derive(Clone, Debug)]
pub struct AdaptiveK {
    max_k: usize,
    /// Decayed counts of draft positions judged and accepted.
    judged: f64,
    accepted: f64,
    /// Verifications in a row chosen without drafts, and after how many a probe is due.
    off_for: u32,
    probe_after: u32,
    /// Always `max_k` (measuring the mechanism, not serving).
    fixed: bool,
}

/// How much each new verification weighs against the past ones.
const DECAY: f64 = 0.9;
const FIRST_PROBE: u32 = 8;
/// Longest interval between probes of a cheap draft (prompt lookup), and of a costly one
/// (a draft model costing more than a tenth of a step per token).
const LAST_PROBE: u32 = 64;
const LAST_PROBE_COSTLY: u32 = 256;

impl AdaptiveK {
    /// Starts optimistic (half the drafts accepted), so speculation is tried.
    pub fn new(max_k: usize) -> Self {
        Self {
            max_k,
            judged: 2.0,
            accepted: 1.0,
            off_for: 0,
            probe_after: FIRST_PROBE,
            fixed: false,
        }
    }

    /// Always drafts `k` (for benchmarks of the mechanism).
    pub fn fixed(k: usize) -> Self {
        Self {
            fixed: true,
            ..Self::new(k)
        }
    }

    pub fn max_k(&self) -> usize {
        self.max_k
    }

    /// Always `max_k`, whatever the measurements.
    pub fn is_fixed(&self) -> bool {
        self.fixed
    }

    /// The measured acceptance rate per draft position (decayed).
    pub fn acceptance(&self) -> f64 {
        if self.judged <= 0.0 {
            0.0
        } else {
            self.accepted / self.judged
        }
    }

    /// Drafts to ask for in the next verification.
    pub fn next_k(&mut self, costs: &DraftCosts) -> usize {
        if self.fixed || self.max_k == 0 {
            return self.max_k;
        }
        let k = best_k(self.acceptance(), costs, self.max_k);
        if k > 0 {
            self.off_for = 0;
            self.probe_after = FIRST_PROBE;
            return k;
        }
        self.off_for += 1;
        if self.off_for >= self.probe_after {
            // Probe with one draft, less often each time a probe was not worth it.
            let last = if costs.draft_token_secs > 0.1 * costs.step_secs {
                LAST_PROBE_COSTLY
            } else {
                LAST_PROBE
            };
            self.off_for = 0;
            self.probe_after = (self.probe_after * 2).min(last);
            return 1;
        }
        0
    }

    /// Takes the outcome of a verification.
    pub fn record(&mut self, settled: Settled) {
        if settled.judged == 0 {
            return;
        }
        self.judged = self.judged * DECAY + settled.judged as f64;
        self.accepted = self.accepted * DECAY + settled.accepted as f64;
    }
}

/// Measured costs of forward passes and drafting, for [`AdaptiveK`]: a forward pass is fitted
/// as `a + b·rows` (decayed least squares over the passes seen), drafting as seconds per token.
#[derive(Clone, Debug, Default)]
pub struct CostMeter {
    n: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    draft_secs: f64,
    draft_tokens: f64,
}

/// Share of a one-row pass assumed for each extra row until passes of several sizes are seen.
const PRIOR_ROW_SHARE: f64 = 0.3;

impl CostMeter {
    /// Takes a forward pass of `rows` rows that took `secs`.
    pub fn record_forward(&mut self, rows: usize, secs: f64) {
        let (x, y) = (rows as f64, secs.max(0.0));
        let d = 0.98;
        self.n = self.n * d + 1.0;
        self.sx = self.sx * d + x;
        self.sy = self.sy * d + y;
        self.sxx = self.sxx * d + x * x;
        self.sxy = self.sxy * d + x * y;
    }

    /// Takes a drafting of `tokens` tokens that took `secs`.
    pub fn record_draft(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 {
            return;
        }
        let d = 0.9;
        self.draft_secs = self.draft_secs * d + secs.max(0.0);
        self.draft_tokens = self.draft_tokens * d + tokens as f64;
    }

    /// Seconds per drafted token measured so far (0 before any).
    pub fn draft_token_secs(&self) -> f64 {
        if self.draft_tokens > 0.0 {
            self.draft_secs / self.draft_tokens
        } else {
            0.0
        }
    }

    /// `(a, b)`: seconds of a pass as `a + b·rows`.
    fn fit(&self) -> (f64, f64) {
        if self.n <= 0.0 {
            return (1.0, PRIOR_ROW_SHARE);
        }
        let (mx, my) = (self.sx / self.n, self.sy / self.n);
        let var = self.sxx / self.n - mx * mx;
        let b = if var > 0.05 {
            ((self.sxy / self.n - mx * my) / var).max(0.0)
        } else {
            // All passes the same size so far: assume a share per row.
            my / mx.max(1.0) * PRIOR_ROW_SHARE
        };
        ((my - b * mx).max(my * 0.05), b)
    }

    /// Costs for a sequence in a pass of `base_rows` rows without its drafts.
    pub fn costs(&self, base_rows: usize) -> DraftCosts {
        let (a, b) = self.fit();
        DraftCosts {
            step_secs: a + b * base_rows.max(1) as f64,
            row_secs: b,
            draft_token_secs: self.draft_token_secs(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `settle` over made-up draws: `truth[i]` is what row `i` draws.
    fn run(drafts: &[u32], truth: &[u32]) -> (Settled, Vec<u32>) {
        let mut out = Vec::new();
        let s = settle::<()>(drafts, |i| {
            out.push(truth[i]);
            Ok(Some(truth[i]))
        })
        .unwrap();
        (s, out)
    }

    #[test]
    fn a_draft_that_always_agrees_is_accepted_in_full_plus_the_bonus_draw() {
        let (s, out) = run(&[5, 6, 7], &[5, 6, 7, 8]);
        assert_eq!(
            s,
            Settled {
                accepted: 3,
                judged: 3
            }
        );
        assert_eq!(out, vec![5, 6, 7, 8]);
    }

    #[test]
    fn a_wrong_draft_is_cut_at_the_first_mismatch_and_the_draw_replaces_it() {
        let (s, out) = run(&[5, 9, 7], &[5, 6, 7, 8]);
        assert_eq!(
            s,
            Settled {
                accepted: 1,
                judged: 2
            }
        );
        assert_eq!(out, vec![5, 6]);
        let (s, out) = run(&[1, 2], &[5, 6, 7]);
        assert_eq!(s.accepted, 0);
        assert_eq!(out, vec![5]);
        // No drafts: plain decoding, one draw.
        let (s, out) = run(&[], &[5]);
        assert_eq!((s.accepted, s.judged), (0, 0));
        assert_eq!(out, vec![5]);
    }

    #[test]
    fn the_walk_ends_where_generation_ends() {
        let mut drawn = 0;
        let s = settle::<()>(&[5, 6, 7], |i| {
            drawn += 1;
            Ok((i < 1).then_some([5, 6][i]))
        })
        .unwrap();
        assert_eq!(s.accepted, 1);
        assert_eq!(drawn, 2);
    }

    #[test]
    fn prompt_lookup_proposes_what_followed_the_last_occurrence() {
        let mut p = PromptLookup::default();
        let h = [1, 2, 3, 4, 5, 9, 9, 2, 3];
        assert_eq!(p.propose(&h, 2), vec![4, 5]);
        assert_eq!(p.propose(&h, 0), Vec::<u32>::new());
        assert_eq!(p.propose(&[1, 2, 3], 4), Vec::<u32>::new());
    }

    #[test]
    fn prompt_lookup_goes_on_with_the_period_of_a_repeating_text() {
        let mut p = PromptLookup::default();
        // What followed "2 3" runs to the end of the history: the text repeats every 6.
        let h = [1, 2, 3, 4, 5, 9, 9, 2, 3];
        assert_eq!(p.propose(&h, 6), vec![4, 5, 9, 9, 2, 3]);
        assert_eq!(p.propose(&h, 10), vec![4, 5, 9, 9, 2, 3, 4, 5, 9, 9]);
        // One token over and over: k of it, not one.
        assert_eq!(p.propose(&[7, 8, 8, 8], 5), vec![8; 5]);
        // Two alternating.
        assert_eq!(p.propose(&[6, 1, 2, 1, 2, 1, 2], 3), vec![1, 2, 1]);
    }

    fn costs(draft: f64) -> DraftCosts {
        DraftCosts {
            step_secs: 1.0,
            row_secs: 0.1,
            draft_token_secs: draft,
        }
    }

    #[test]
    fn k_grows_with_acceptance_and_is_zero_when_drafts_do_not_pay() {
        assert_eq!(best_k(0.0, &costs(0.0), 8), 0);
        assert!(best_k(0.9, &costs(0.0), 8) >= 4);
        assert!(best_k(0.6, &costs(0.0), 8) < best_k(0.9, &costs(0.0), 8));
        // A draft as costly as the target never pays in one process.
        assert_eq!(best_k(0.99, &costs(1.0), 8), 0);
    }

    #[test]
    fn adaptive_k_turns_a_bad_draft_off_and_probes_rarely() {
        let mut a = AdaptiveK::new(8);
        let c = costs(0.05);
        let mut drafted = 0;
        for _ in 0..400 {
            let k = a.next_k(&c);
            drafted += k;
            if k > 0 {
                a.record(Settled {
                    accepted: 0,
                    judged: 1,
                });
            }
        }
        assert!(a.acceptance() < 0.1);
        // After the first verifications, only probes of one draft every 64 steps.
        assert!(drafted < 40, "{drafted}");
        let mut good = AdaptiveK::new(8);
        for _ in 0..20 {
            let k = good.next_k(&c);
            good.record(Settled {
                accepted: k,
                judged: k,
            });
        }
        assert_eq!(good.next_k(&c), 8);
        assert_eq!(AdaptiveK::fixed(3).next_k(&costs(10.0)), 3);
    }

    #[test]
    fn the_cost_meter_fits_a_cost_per_row() {
        let mut m = CostMeter::default();
        for rows in [1, 3, 1, 5, 2, 1, 4] {
            m.record_forward(rows, 0.010 + 0.002 * rows as f64);
        }
        m.record_draft(4, 0.004);
        let c = m.costs(1);
        assert!((c.row_secs - 0.002).abs() < 1e-6, "{c:?}");
        assert!((c.step_secs - 0.012).abs() < 1e-6, "{c:?}");
        assert!((c.draft_token_secs - 0.001).abs() < 1e-9);
    }
}
