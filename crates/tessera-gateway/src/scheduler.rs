//! Continuous batching as a pure state machine: which tokens of which sequences go into the
//! next forward pass, and what the logits that come back mean.
//!
//! The scheduler holds the running sequences (their token history and how much of it is in the
//! KV cache) but computes nothing and touches no channel: [`Scheduler::plan_step`] returns the
//! rows of the next batch as values, the caller runs the forward, and
//! [`Scheduler::handle_logits`] turns the logits into [`Output`]s (tokens, finishes). The
//! caller's per-sequence state (KV cache, event sender) rides along as the payload `T` and comes
//! back when a sequence leaves, so dropping it frees the KV. Tests drive it with `T = ()` and
//! made-up logits.
//!
//! Each step advances every decoding sequence by one token and spends what is left of the
//! token budget on prompt chunks of sequences still prefilling (oldest first), so a long prompt
//! never stalls the others for more than a chunk.
//!
//! Speculation: a sequence admitted [`Sequence::with_speculation`] gets drafts from the caller
//! before a step ([`Scheduler::draft`]); its decode row then carries them too, the forward pass
//! returns a logits row for each, and [`Scheduler::handle_logits`] keeps the drafts that equal
//! what one-token decoding draws ([`settle`]), so the tokens (and log-probabilities) are the
//! same as without. The caller then truncates each KV cache to [`Sequence::fed`]. Drafts are
//! cut where the grammar would refuse them; the grammar itself advances only over the tokens
//! drawn.

use tessera_sampling::speculate::{settle, AdaptiveK, DraftCosts};
use tessera_sampling::SamplingParams;
use tessera_sampling::TokenLogprobs;

use crate::grammar::{Grammar, GrammarError};
use tessera_api::{FinishReason, RequestId, SpeculationTotals, Usage};

/// Batch limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Sequences in the running batch at once.
    pub max_active: usize,
    /// Token rows per forward pass (decode rows plus prompt chunks).
    pub max_batch_tokens: usize,
    /// Largest prompt chunk of one sequence per step.
    pub prefill_chunk: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_active: 16,
            max_batch_tokens: 256,
            prefill_chunk: 128,
        }
    }
}

/// One running sequence.
#[derive(Debug)]
pub struct Sequence<T> {
    pub id: RequestId,
    /// Prompt then generated tokens.
    history: Vec<u32>,
    prompt_len: usize,
    /// Positions already in the KV cache (a prefix of `history`).
    fed: usize,
    /// Prompt positions that were in the KV cache when the sequence was admitted.
    cached: usize,
    generated: usize,
    max_tokens: usize,
    /// Positions the KV cache can hold.
    capacity: usize,
    params: SamplingParams,
    /// Report log-probabilities with this many alternatives.
    logprobs: Option<usize>,
    /// Constrains every draw.
    grammar: Option<Grammar>,
    /// Drafts to verify in the next step (after the history).
    drafts: Vec<u32>,
    /// Drafts how many tokens, when this sequence speculates.
    speculation: Option<AdaptiveK>,
    pub payload: T,
}

impl<T> Sequence<T> {
    /// A sequence about to be prefilled. `prompt` must not be empty and must fit `capacity`.
    pub fn new(
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        max_tokens: usize,
        capacity: usize,
        payload: T,
    ) -> Self {
        Self {
            id,
            prompt_len: prompt.len(),
            history: prompt,
            fed: 0,
            cached: 0,
            generated: 0,
            max_tokens,
            capacity,
            params,
            logprobs: None,
            grammar: None,
            drafts: Vec::new(),
            speculation: None,
            payload,
        }
    }

    /// Speculates: [`Scheduler::draft`] asks the caller for drafts, `k` says how many.
    pub fn with_speculation(mut self, k: AdaptiveK) -> Self {
        self.speculation = Some(k);
        self
    }

    /// Prompt and generated tokens so far.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Positions that stay in the KV cache: after [`Scheduler::handle_logits`], the caller
    /// truncates the cache to this (rejected drafts' positions go).
    pub fn fed(&self) -> usize {
        self.fed
    }

    /// The measured acceptance rate of this sequence's drafts, when it speculates.
    pub fn acceptance(&self) -> Option<f64> {
        self.speculation.as_ref().map(AdaptiveK::acceptance)
    }

    /// Reports log-probabilities (`Some(top_n)`) and/or follows a grammar.
    pub fn with_options(mut self, logprobs: Option<usize>, grammar: Option<Grammar>) -> Self {
        self.logprobs = logprobs;
        self.grammar = grammar;
        self
    }

    /// Starts with the first `n` prompt positions already in the KV cache (a reused prefix);
    /// at least the last prompt token must still be fed, for its logits.
    pub fn with_cached_prefix(mut self, n: usize) -> Self {
        assert!(n < self.prompt_len, "the last prompt token must be fed");
        self.fed = n;
        self.cached = n;
        self
    }

    /// The tokens whose positions are in the KV cache, in order.
    pub fn fed_tokens(&self) -> &[u32] {
        &self.history[..self.fed]
    }

    /// Draws the token at `position` from `row`, masked by the grammar if there is one.
    fn choose(
        &mut self,
        row: &[f32],
        position: u64,
    ) -> Result<(u32, Option<TokenLogprobs>), GrammarError> {
        crate::grammar::choose(
            row,
            &self.params,
            &self.history,
            position,
            self.grammar.as_mut(),
            self.logprobs,
        )
    }

    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.generated,
            cached_tokens: self.cached,
        }
    }

    /// Still feeding its prompt.
    pub fn is_prefilling(&self) -> bool {
        self.fed < self.prompt_len
    }
}

/// Rows of one sequence in the next forward pass: `history[start_pos..start_pos + n_tokens]`
/// (whose last `drafts` tokens are drafts, past the history).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepItem {
    /// Index into [`Scheduler::active_mut`] (items come in increasing order).
    pub seq: usize,
    pub start_pos: usize,
    pub n_tokens: usize,
    /// The last row's logits are needed (a decode step, or the last chunk of a prompt).
    pub wants_logits: bool,
    /// Drafts at the end of the rows: their rows' logits are needed too.
    pub drafts: usize,
}

impl StepItem {
    /// Logits rows this item needs: the last `1 + drafts` rows, or none.
    pub fn logits_rows(&self) -> usize {
        if self.wants_logits {
            1 + self.drafts
        } else {
            0
        }
    }
}

/// What a step produced for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    Token {
        id: RequestId,
        token: u32,
        /// When the request asked for log-probabilities.
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        id: RequestId,
        reason: FinishReason,
        usage: Usage,
    },
    /// The sequence cannot go on (its grammar reached a dead end); it leaves the batch.
    Failed { id: RequestId, message: String },
}

/// The running batch. See the module docs.
#[derive(Debug)]
pub struct Scheduler<T> {
    config: SchedulerConfig,
    active: Vec<Sequence<T>>,
    speculation: SpeculationTotals,
}

impl<T> Scheduler<T> {
    pub fn new(config: SchedulerConfig) -> Self {
        Self {
            config: SchedulerConfig {
                max_active: config.max_active.max(1),
                max_batch_tokens: config.max_batch_tokens.max(1),
                prefill_chunk: config.prefill_chunk.max(1),
            },
            active: Vec::new(),
            speculation: SpeculationTotals::default(),
        }
    }

    pub fn speculation(&self) -> SpeculationTotals {
        self.speculation
    }

    /// Asks for drafts for every decoding sequence that speculates: `propose(history, k,
    /// payload)` returns up to `k` tokens to follow `history` (`k` from the sequence's
    /// [`AdaptiveK`] and `costs`, within its token and context limits). Drafts the grammar
    /// refuses are cut off.
    pub fn draft(
        &mut self,
        costs: &DraftCosts,
        mut propose: impl FnMut(&[u32], usize, &mut T) -> Vec<u32>,
    ) {
        for s in &mut self.active {
            s.drafts.clear();
            if s.is_prefilling() {
                continue;
            }
            let Some(spec) = &mut s.speculation else {
                continue;
            };
            // The draw after the drafts is a token too; every draft takes a position.
            let room = s
                .max_tokens
                .saturating_sub(s.generated + 1)
                .min(s.capacity.saturating_sub(s.history.len()));
            let k = spec.next_k(costs).min(room);
            if k == 0 {
                continue;
            }
            let mut drafts = propose(&s.history, k, &mut s.payload);
            drafts.truncate(k);
            if let Some(g) = &mut s.grammar {
                let ok = g.valid_prefix(&drafts);
                drafts.truncate(ok);
            }
            s.drafts = drafts;
        }
    }

    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Whether another sequence may join the batch.
    pub fn has_room(&self) -> bool {
        self.active.len() < self.config.max_active
    }

    pub fn is_idle(&self) -> bool {
        self.active.is_empty()
    }

    pub fn active(&self) -> &[Sequence<T>] {
        &self.active
    }

    pub fn active_mut(&mut self) -> &mut [Sequence<T>] {
        &mut self.active
    }

    /// Adds a sequence to the batch (the caller checks [`Scheduler::has_room`]).
    pub fn admit(&mut self, seq: Sequence<T>) {
        self.active.push(seq);
    }

    /// Removes and returns the sequences `gone` says are gone (e.g. their client left).
    pub fn take_where(&mut self, mut gone: impl FnMut(&Sequence<T>) -> bool) -> Vec<Sequence<T>> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.active.len() {
            if gone(&self.active[i]) {
                out.push(self.active.remove(i));
            } else {
                i += 1;
            }
        }
        out
    }

    /// The rows of the next forward pass (empty when idle).
    pub fn plan_step(&self) -> Vec<StepItem> {
        let mut items = Vec::new();
        let mut budget = self.config.max_batch_tokens;
        for (i, s) in self.active.iter().enumerate() {
            if !s.is_prefilling() {
                let n_tokens = s.history.len() - s.fed + s.drafts.len();
                items.push(StepItem {
                    seq: i,
                    start_pos: s.fed,
                    n_tokens,
                    wants_logits: true,
                    drafts: s.drafts.len(),
                });
                budget = budget.saturating_sub(n_tokens);
            }
        }
        for (i, s) in self.active.iter().enumerate() {
            if !s.is_prefilling() {
                continue;
            }
            let left = s.prompt_len - s.fed;
            // At least one chunk per step, so a batch of prompts always moves.
            let room = if items.is_empty() {
                self.config.prefill_chunk
            } else {
                budget.min(self.config.prefill_chunk)
            };
            let n = left.min(room);
            if n == 0 {
                break;
            }
            items.push(StepItem {
                seq: i,
                start_pos: s.fed,
                n_tokens: n,
                wants_logits: s.fed + n == s.prompt_len,
                drafts: 0,
            });
            budget = budget.saturating_sub(n);
        }
        items.sort_by_key(|it| it.seq);
        items
    }

    /// The tokens of `item` (history, then drafts).
    pub fn tokens(&self, item: &StepItem) -> impl Iterator<Item = u32> + '_ {
        let s = &self.active[item.seq];
        let real = item.n_tokens - item.drafts;
        s.history[item.start_pos..item.start_pos + real]
            .iter()
            .chain(&s.drafts[..item.drafts])
            .copied()
    }

    /// Takes the result of the forward pass for `items` (from the last [`Scheduler::plan_step`]):
    /// `logits` holds each item's [`StepItem::logits_rows`] last rows, in item order. Samples
    /// (settling drafts), and returns the outputs in item order plus the sequences that
    /// finished (their payloads to drop). The caller truncates each KV cache to
    /// [`Sequence::fed`].
    pub fn handle_logits(
        &mut self,
        items: &[StepItem],
        logits: &[&[f32]],
        is_end_of_generation: &dyn Fn(u32) -> bool,
    ) -> (Vec<Output>, Vec<Sequence<T>>) {
        let mut outputs = Vec::new();
        let mut done = Vec::new();
        let mut next_row = 0;
        for it in items {
            let s = &mut self.active[it.seq];
            let drafts = std::mem::take(&mut s.drafts);
            debug_assert_eq!(drafts.len(), it.drafts, "drafts changed since plan_step");
            s.fed = it.start_pos + it.n_tokens - it.drafts;
            if !it.wants_logits {
                continue;
            }
            let rows = &logits[next_row..next_row + 1 + it.drafts];
            next_row += rows.len();
            let mut finish = None;
            let mut failed = None;
            let settled = settle::<()>(&drafts[..it.drafts], |i| {
                if finish.is_some() || failed.is_some() {
                    return Ok(None);
                }
                let position = s.history.len() as u64;
                let chosen = s.choose(rows[i], position).and_then(|(token, logprobs)| {
                    if !is_end_of_generation(token) {
                        if let Some(g) = &mut s.grammar {
                            g.accept(token)?;
                        }
                    }
                    Ok((token, logprobs))
                });
                let (token, logprobs) = match chosen {
                    Ok(c) => c,
                    Err(e) => {
                        failed = Some(e.to_string());
                        return Ok(None);
                    }
                };
                if is_end_of_generation(token) {
                    finish = Some(FinishReason::Stop);
                    return Ok(None);
                }
                s.history.push(token);
                s.generated += 1;
                outputs.push(Output::Token {
                    id: s.id,
                    token,
                    logprobs,
                });
                // The new token needs one more position to be fed (the `i` drafts accepted
                // before it hold theirs).
                finish = if s.generated >= s.max_tokens || s.fed + i >= s.capacity {
                    Some(FinishReason::Length)
                } else {
                    // A complete grammar admits nothing more: the answer is done.
                    s.grammar
                        .as_ref()
                        .is_some_and(Grammar::is_finished)
                        .then_some(FinishReason::Stop)
                };
                Ok(Some(token))
            })
            .expect("drawing does not fail");
            s.fed += settled.accepted;
            if it.drafts > 0 {
                self.speculation.verifications += 1;
                self.speculation.drafted += it.drafts as u64;
                self.speculation.accepted += settled.accepted as u64;
                if let Some(k) = &mut s.speculation {
                    k.record(settled);
                }
            }
            if let Some(message) = failed {
                outputs.push(Output::Failed { id: s.id, message });
                done.push(s.id);
            } else if let Some(reason) = finish {
                outputs.push(Output::Finished {
                    id: s.id,
                    reason,
                    usage: s.usage(),
                });
                done.push(s.id);
            }
        }
        let finished = self.take_where(|s| done.contains(&s.id));
        (outputs, finished)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(id: RequestId, prompt_len: usize, max_tokens: usize) -> Sequence<()> {
        Sequence::new(
            id,
            (0..prompt_len as u32).collect(),
            SamplingParams::greedy(),
            max_tokens,
            64,
            (),
        )
    }

    /// Logits whose argmax is `token`.
    fn peak(token: u32) -> Vec<f32> {
        let mut l = vec![0.0; 10];
        l[token as usize] = 1.0;
        l
    }

    fn step(s: &mut Scheduler<()>, token: u32) -> (Vec<StepItem>, Vec<Output>, Vec<RequestId>) {
        let items = s.plan_step();
        let n = items.iter().filter(|i| i.wants_logits).count();
        let rows: Vec<Vec<f32>> = (0..n).map(|_| peak(token)).collect();
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let (out, fin) = s.handle_logits(&items, &refs, &|t| t == 9);
        (items, out, fin.iter().map(|f| f.id).collect())
    }

    #[test]
    fn long_prompt_is_prefilled_in_chunks_alongside_decodes() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_active: 4,
            max_batch_tokens: 8,
            prefill_chunk: 6,
        });
        s.admit(seq(1, 2, 5));
        let (items, out, _) = step(&mut s, 3);
        assert_eq!(items.len(), 1);
        assert_eq!(
            out,
            vec![Output::Token {
                id: 1,
                token: 3,
                logprobs: None
            }]
        );
        s.admit(seq(2, 20, 5));
        // Sequence 1 decodes one token; sequence 2 gets the rest of the budget (7 → chunk 6).
        let (items, out, _) = step(&mut s, 4);
        assert_eq!(
            items,
            vec![
                StepItem {
                    seq: 0,
                    start_pos: 2,
                    n_tokens: 1,
                    wants_logits: true,
                    drafts: 0,
                },
                StepItem {
                    seq: 1,
                    start_pos: 0,
                    n_tokens: 6,
                    wants_logits: false,
                    drafts: 0,
                },
            ]
        );
        assert_eq!(
            out,
            vec![Output::Token {
                id: 1,
                token: 4,
                logprobs: None
            }]
        );
        step(&mut s, 4);
        step(&mut s, 4);
        // 18 fed; the last chunk of 2 wants logits.
        let (items, out, _) = step(&mut s, 5);
        assert_eq!(
            items[1],
            StepItem {
                seq: 1,
                start_pos: 18,
                n_tokens: 2,
                wants_logits: true,
                drafts: 0,
            }
        );
        assert!(out.contains(&Output::Token {
            id: 2,
            token: 5,
            logprobs: None
        }));
    }

    #[test]
    fn finishes_on_max_tokens_and_end_of_generation() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        s.admit(seq(1, 3, 2));
        s.admit(seq(2, 3, 10));
        step(&mut s, 1);
        let (_, out, fin) = step(&mut s, 1);
        assert_eq!(fin, vec![1]);
        assert!(out.contains(&Output::Finished {
            id: 1,
            reason: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 3,
                completion_tokens: 2,
                cached_tokens: 0,
            },
        }));
        // Token 9 ends generation and is not emitted.
        let (_, out, fin) = step(&mut s, 9);
        assert_eq!(fin, vec![2]);
        assert_eq!(
            out,
            vec![Output::Finished {
                id: 2,
                reason: FinishReason::Stop,
                usage: Usage {
                    prompt_tokens: 3,
                    completion_tokens: 2,
                    cached_tokens: 0,
                },
            }]
        );
        assert!(s.is_idle());
    }

    #[test]
    fn stops_when_the_context_is_full() {
        let mut s: Scheduler<()> = Scheduler::new(SchedulerConfig::default());
        s.admit(Sequence::new(
            1,
            vec![0, 1, 2],
            SamplingParams::greedy(),
            100,
            5,
            (),
        ));
        let mut tokens = 0;
        loop {
            let (_, out, fin) = step(&mut s, 1);
            tokens += out
                .iter()
                .filter(|o| matches!(o, Output::Token { .. }))
                .count();
            if !fin.is_empty() {
                break;
            }
        }
        // Positions 0..5 hold the prompt and two generated tokens; the third is emitted last.
        assert_eq!(tokens, 3);
    }

    #[test]
    fn drafts_ride_the_decode_row_and_stand_up_to_the_first_mismatch() {
        let mut s = Scheduler::new(SchedulerConfig::default());
        s.admit(seq(1, 3, 10).with_speculation(AdaptiveK::fixed(3)));
        step(&mut s, 3);
        let costs = DraftCosts {
            step_secs: 1.0,
            row_secs: 0.0,
            draft_token_secs: 0.0,
        };
        s.draft(&costs, |history, k, _| {
            assert_eq!((history, k), (&[0, 1, 2, 3][..], 3));
            vec![4, 5, 6]
        });
        let items = s.plan_step();
        assert_eq!(
            items,
            vec![StepItem {
                seq: 0,
                start_pos: 3,
                n_tokens: 4,
                wants_logits: true,
                drafts: 3,
            }]
        );
        assert_eq!(s.tokens(&items[0]).collect::<Vec<_>>(), vec![3, 4, 5, 6]);
        // The model draws 4, 5, then 7 where the draft said 6: two drafts stand.
        let rows = [peak(4), peak(5), peak(7), peak(8)];
        let refs: Vec<&[f32]> = rows.iter().map(Vec::as_slice).collect();
        let (out, fin) = s.handle_logits(&items, &refs, &|_| false);
        assert!(fin.is_empty());
        let tokens: Vec<u32> = out
            .iter()
            .filter_map(|o| match o {
                Output::Token { token, .. } => Some(*token),
                _ => None,
            })
            .collect();
        assert_eq!(tokens, vec![4, 5, 7]);
        let q = &s.active()[0];
        assert_eq!(q.history(), &[0, 1, 2, 3, 4, 5, 7]);
        // Positions of 3, 4 and 5 stay in the cache; 6's is dropped and 7 is fed next.
        assert_eq!(q.fed(), 6);
        assert_eq!(
            s.speculation(),
            SpeculationTotals {
                verifications: 1,
                drafted: 3,
                accepted: 2
            }
        );
        // Drafts never run past max_tokens: 4 generated of 10, so at most 5 drafts.
        s.draft(&costs, |_, k, _| {
            assert!(k <= 3);
            vec![9; k]
        });
        let items = s.plan_step();
        assert_eq!((items[0].start_pos, items[0].n_tokens), (6, 4));
    }

    #[test]
    fn cancelled_sequences_leave_the_batch() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_active: 2,
            ..SchedulerConfig::default()
        });
        s.admit(seq(1, 3, 10));
        s.admit(seq(2, 3, 10));
        assert!(!s.has_room());
        let gone = s.take_where(|q| q.id == 1);
        assert_eq!(gone.len(), 1);
        assert!(s.has_room());
        let (items, _, _) = step(&mut s, 1);
        assert_eq!(items.len(), 1);
    }
}
