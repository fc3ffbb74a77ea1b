//! One pipeline stage: a partial [`Model`] (a contiguous layer range, with the embedding on the
//! first stage and the head on the last), the KV caches of the sequences passing through it,
//! and the rules for what each input produces.
//!
//! Inputs are method calls ([`Stage::start`], [`Stage::handle_hidden`],
//! [`Stage::handle_token`]), outputs go to a sink as [`StageOutput`] values — hidden states for
//! the next stage, tokens for the first, and control messages for the coordinator. The agent
//! runs a stage on its own thread and wires the sink to the network; tests drive it directly.
//!
//! One exception, and it blocks: a stage given remote expert peers
//! ([`Stage::set_remote_experts`], an expert split) sends each MoE layer's routed rows to the
//! peers that hold the selected experts and waits for their replies inside the forward pass
//! (`crate::expert`), on this stage's thread, once per MoE layer per step. A peer whose link
//! fails, or that refuses, fails the step with its error; a silent one holds it until its
//! link does fail (the coordinator, which declares the node gone after a lease, plans around
//! it and resumes the runs). Without remote peers a step does no I/O.
//!
//! The ring for one sequence:
//!
//! 1. the first stage embeds the prompt in chunks of `prefill_chunk` tokens and runs its layers
//!    on each chunk, sending each chunk's hidden state on as soon as it is ready (so the next
//!    stage works on chunk *k* while this one works on chunk *k+1*);
//! 2. every stage runs its layers on what arrives and passes it on; the final prefill chunk
//!    carries [`StepEntry::SAMPLE`];
//! 3. the last stage applies the head to the last row of a `SAMPLE` entry and samples with the
//!    sequence's parameters and history (the draw depends only on seed and position) — masked
//!    by the sequence's grammar and with log-probabilities when it asked, through the same
//!    [`tessera_grammar::choose`] as `tessera serve` — reports the token to the coordinator
//!    and, unless the sequence is finished, sends it to the first stage as a [`RingToken`];
//! 4. the first stage embeds the token and the ring turns again.
//!
//! Each stage holds the KV cache of its layers per sequence and frees it on [`Stage::close`].
//!
//! Prompt-prefix reuse: a close that names the tokens the sequence fed keeps its cache
//! ([`PrefixCache`], LRU, within the KV budget: kept caches are dropped first when a new
//! sequence needs the room). [`Stage::open`] takes the kept cache sharing the longest prefix
//! with the new prompt and says how many positions it holds; the coordinator starts the
//! sequence at the fewest any stage holds ([`Stage::start`]'s `reuse`), and every other stage
//! cuts its cache to the position the first step arrives at. Kernels are batch-invariant, so
//! the positions kept equal those a fresh prefill computes: reuse changes no bit of the output.
//!
//! The sampling stage's own part (grammars, the draw and what a token leads to) is in
//! `sampling`; the tests, which drive stages directly, in `tests`.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tessera_engine::prefix_cache::{PrefixCache, Reuse};
use tessera_engine::{Hidden, KvCache, LocalExperts, Model, SeqStep};
use tessera_model::Tokenizer;

mod sampling;
mod seq;

use crate::expert::CacheDelta;
use sampling::Grammars;
use seq::SeqState;
pub use seq::{StageError, StageOutput};

use tessera_proto::{
    hash_f32s, BoundaryTrace, NodeToCoord, OpenSeq, RingToken, StageAssignment, StageSeqStats,
    StepEntry, StepHeader,
};

/// One loaded stage and its sequences.
pub struct Stage {
    assignment: StageAssignment,
    model: Model,
    seqs: HashMap<u64, SeqState>,
    /// Bytes of the memory budget left for KV caches (`None`: unbounded).
    kv_budget: Option<u64>,
    /// Expert split: the workers owning the experts of this stage's layers not held here.
    remote: Option<crate::expert::RemotePeers>,
    /// Last stage: what request grammars are compiled over (`None`: grammars are refused).
    grammars: Option<Grammars>,
    /// Finished sequences' caches of this stage's layers, kept for prompts that begin the same.
    kept: PrefixCache<KvCache>,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("stage", &self.assignment.stage)
            .field("layers", &self.assignment.layers)
            .field("open_seqs", &self.seqs.len())
            .finish()
    }
}

impl Stage {
    /// A stage over a model loaded for `assignment`; `kv_budget` bounds the KV caches it keeps.
    pub fn new(assignment: StageAssignment, model: Model, kv_budget: Option<u64>) -> Self {
        Self {
            assignment,
            model,
            seqs: HashMap::new(),
            kv_budget,
            remote: None,
            grammars: None,
            kept: PrefixCache::new(0),
        }
    }

    /// Keeps up to `n` closed sequences' caches for prefix reuse (0, the default: none).
    pub fn set_prefix_cache(&mut self, n: usize) {
        self.kept = PrefixCache::new(n);
    }

    /// Caches kept for prefix reuse now.
    pub fn kept_caches(&self) -> usize {
        self.kept.len()
    }

    fn kept_bytes(&self) -> u64 {
        self.kept.values().map(|kv| kv.bytes() as u64).sum()
    }

    /// The model's tokenizer, so that the sampling stage can compile request grammars. The
    /// vocabulary is indexed on a thread of its own (a 150k-token vocabulary takes about a
    /// second), so the stage thread does not stall the ring for it; a grammar request that
    /// comes before it is done waits for it.
    pub fn set_tokenizer(&mut self, tokenizer: Tokenizer) {
        let g = Grammars {
            tokenizer: Arc::new(tokenizer),
            compiler: Arc::new(OnceLock::new()),
        };
        let early = Grammars {
            tokenizer: g.tokenizer.clone(),
            compiler: g.compiler.clone(),
        };
        // Without the thread, the first grammar request indexes it on the stage thread.
        let _ = std::thread::Builder::new()
            .name("grammar-index".into())
            .spawn(move || early.compiler());
        self.grammars = Some(g);
    }

    /// Expert split: computes the experts of this stage's layers that the model does not hold
    /// on `peers` (one request per contacted peer per MoE layer per step).
    pub fn set_remote_experts(&mut self, peers: crate::expert::RemotePeers) {
        self.remote = Some(peers);
    }

    /// Expert traffic so far (zero without an expert split).
    pub fn expert_traffic(&self) -> crate::expert::ExpertTraffic {
        self.remote.as_ref().map(|r| r.traffic).unwrap_or_default()
    }

    pub fn assignment(&self) -> &StageAssignment {
        &self.assignment
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// Sequences currently open.
    pub fn open_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// KV bytes allocated now, over all sequences and the caches kept for reuse.
    pub fn kv_bytes(&self) -> u64 {
        self.seqs.values().map(|s| s.kv.bytes() as u64).sum::<u64>() + self.kept_bytes()
    }

    fn is_first(&self) -> bool {
        self.assignment.embed
    }

    fn is_last(&self) -> bool {
        self.assignment.head
    }

    /// Worst-case KV bytes for a sequence of `positions` on this stage's layers.
    pub fn kv_bytes_for(&self, positions: usize) -> u64 {
        tessera_engine::KvCache::bytes_for(
            self.model.kv_type(),
            self.model.kv_shape(),
            self.assignment.layers.len(),
            positions,
        )
    }

    /// Opens a sequence: allocates (lazily) its KV cache, within the budget, starting from the
    /// kept cache that shares the longest prefix with the prompt. Returns how many prompt
    /// positions that cache holds (0: none), for the coordinator to agree on with the other
    /// stages.
    pub fn open(&mut self, open: OpenSeq) -> Result<usize, StageError> {
        let seq = open.seq;
        if self.seqs.contains_key(&seq) {
            return Err(StageError::AlreadyOpen(seq));
        }
        if open.prompt.is_empty() {
            return Err(StageError::BadStep {
                seq,
                what: "empty prompt".into(),
            });
        }
        let capacity = (open.prompt.len() + open.max_new_tokens)
            .min(self.assignment.max_context)
            .min(self.model.config().context_length);
        if open.prompt.len() > capacity {
            return Err(StageError::BadStep {
                seq,
                what: format!(
                    "prompt of {} tokens exceeds the context limit of {capacity}",
                    open.prompt.len()
                ),
            });
        }
        let needed = self.kv_bytes_for(capacity);
        let reserved: u64 = self.seqs.values().map(|s| s.reserved).sum();
        let grammar = sampling::grammar_for(self.grammars.as_ref(), self.is_last(), &open)?;
        // An expert-only node holds no layers, hence no positions to reuse.
        let reuse = if self.assignment.layers.is_empty() {
            None
        } else {
            self.kept.take(&open.prompt)
        };
        if let Some(budget) = self.kv_budget {
            // Kept caches give way to sequences, the least recently used first.
            while reserved + needed + self.kept_bytes() > budget && self.kept.pop_oldest().is_some()
            {
            }
            let available = budget.saturating_sub(reserved);
            if needed > available {
                return Err(StageError::OverBudget {
                    seq,
                    needed,
                    available,
                });
            }
        }
        let (kv, cached) = match reuse {
            Some(Reuse { mut kv, reused }) => {
                kv.truncate(reused);
                kv.set_capacity(capacity);
                (kv, reused)
            }
            None => (self.model.new_kv(capacity), 0),
        };
        let history = if self.is_last() {
            open.prompt.clone()
        } else {
            Vec::new()
        };
        self.seqs.insert(
            seq,
            SeqState {
                stats: StageSeqStats {
                    stage: self.assignment.stage,
                    ..Default::default()
                },
                open,
                kv,
                history,
                generated: 0,
                reserved: needed,
                sent_at: None,
                finished: false,
                grammar,
                unstarted: true,
                broken: false,
                unverified: 0,
                drafts: Vec::new(),
            },
        );
        Ok(cached)
    }

    /// Ends a sequence and frees its KV cache; its statistics, if it was open. With `keep` (the
    /// tokens the sequence fed, in order) the cache is kept for reuse instead, cut to the
    /// positions it holds of them.
    pub fn close(&mut self, seq: u64, keep: &[u32]) -> Option<StageSeqStats> {
        let mut s = self.seqs.remove(&seq)?;
        s.stats.kv_bytes = s.kv.bytes() as u64;
        // Draft positions past the last agreement hold guesses, not the sequence's tokens.
        let n =
            s.kv.len_in_every_layer()
                .saturating_sub(s.unverified)
                .min(keep.len());
        if n > 0 && !s.broken && !self.assignment.layers.is_empty() {
            s.kv.truncate(n);
            self.kept.put(keep[..n].to_vec(), s.kv);
        }
        Some(s.stats)
    }

    /// First stage: prefills the prompt from position `reuse` on (the positions before it
    /// come from the kept cache [`Stage::open`] found) in chunks, emitting each chunk's output
    /// as it is ready.
    pub fn start(
        &mut self,
        seq: u64,
        reuse: usize,
        sink: &mut dyn FnMut(StageOutput),
    ) -> Result<(), StageError> {
        if !self.is_first() {
            return Err(StageError::WrongStage("embed (it is not the first stage)"));
        }
        let (prompt, chunk) = {
            let s = self.seqs.get(&seq).ok_or(StageError::UnknownSeq(seq))?;
            if !s.unstarted {
                return Err(StageError::BadStep {
                    seq,
                    what: "already started".into(),
                });
            }
            if reuse > s.kv.len() || reuse >= s.open.prompt.len() {
                return Err(StageError::BadStep {
                    seq,
                    what: format!(
                        "start at position {reuse}, but {} prompt positions are cached here",
                        s.kv.len()
                    ),
                });
            }
            (s.open.prompt[reuse..].to_vec(), s.open.prefill_chunk.max(1))
        };
        let n_chunks = prompt.len().div_ceil(chunk);
        for (i, tokens) in prompt.chunks(chunk).enumerate() {
            let entry = StepEntry {
                seq,
                start_pos: (reuse + i * chunk) as u32,
                n_tokens: tokens.len() as u32,
                flags: if i + 1 == n_chunks {
                    StepEntry::SAMPLE
                } else {
                    0
                },
            };
            let t = Instant::now();
            let hidden = self.model.embed(tokens)?;
            self.step(vec![entry], hidden, t, sink)?;
        }
        Ok(())
    }

    /// First stage: a token came back around the ring; embed it and run on.
    pub fn handle_token(
        &mut self,
        tok: RingToken,
        sink: &mut dyn FnMut(StageOutput),
    ) -> Result<(), StageError> {
        if !self.seqs.contains_key(&tok.seq) {
            return Err(StageError::UnknownSeq(tok.seq));
        }
        match self.handle_tokens(vec![tok], sink).pop() {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// First stage: tokens of several sequences that came back around the ring, run as one
    /// batch (one forward pass, one hidden-state frame). Returns the sequences that could not
    /// take part, with why; tokens of sequences no longer open are dropped silently (a
    /// cancelled sequence may still have a token in flight).
    pub fn handle_tokens(
        &mut self,
        toks: Vec<RingToken>,
        sink: &mut dyn FnMut(StageOutput),
    ) -> Vec<(u64, StageError)> {
        if !self.is_first() {
            return toks
                .iter()
                .map(|t| {
                    (
                        t.seq,
                        StageError::WrongStage("take tokens (it is not the first stage)"),
                    )
                })
                .collect();
        }
        let mut errors = Vec::new();
        let mut batch: Vec<RingToken> = Vec::with_capacity(toks.len());
        for t in toks {
            let Some(s) = self.seqs.get_mut(&t.seq) else {
                continue;
            };
            if batch.iter().any(|b| b.seq == t.seq) {
                errors.push((
                    t.seq,
                    StageError::BadStep {
                        seq: t.seq,
                        what: "two tokens of one sequence in one step".into(),
                    },
                ));
                continue;
            }
            if t.drafts.len() > s.open.speculate {
                errors.push((
                    t.seq,
                    StageError::BadStep {
                        seq: t.seq,
                        what: format!(
                            "{} drafts for a sequence that speculates {}",
                            t.drafts.len(),
                            s.open.speculate
                        ),
                    },
                ));
                continue;
            }
            if let Some(sent) = s.sent_at.take() {
                s.stats.ring_wait_ns += sent.elapsed().as_nanos() as u64;
                s.stats.ring_waits += 1;
            }
            batch.push(t);
        }
        if batch.is_empty() {
            return errors;
        }
        let t = Instant::now();
        // Each sequence's token, then its drafts: one micro-batch of 1 + drafts rows.
        let tokens: Vec<u32> = batch
            .iter()
            .flat_map(|t| std::iter::once(t.token).chain(t.drafts.iter().copied()))
            .collect();
        let result = self
            .model
            .embed(&tokens)
            .map_err(StageError::from)
            .and_then(|hidden| {
                let entries = batch
                    .iter()
                    .map(|t| StepEntry {
                        seq: t.seq,
                        start_pos: t.pos,
                        n_tokens: 1 + t.drafts.len() as u32,
                        flags: if t.drafts.is_empty() {
                            StepEntry::SAMPLE
                        } else {
                            StepEntry::SAMPLE | StepEntry::VERIFY
                        },
                    })
                    .collect();
                self.step(entries, hidden, t, sink)
            });
        if let Err(e) = result {
            let msg = e.to_string();
            errors.extend(batch.iter().map(|t| {
                (
                    t.seq,
                    StageError::BadStep {
                        seq: t.seq,
                        what: msg.clone(),
                    },
                )
            }));
        }
        errors
    }

    /// Any stage but the first: hidden states from the previous stage.
    pub fn handle_hidden(
        &mut self,
        header: StepHeader,
        data: Vec<f32>,
        sink: &mut dyn FnMut(StageOutput),
    ) -> Result<(), StageError> {
        if self.is_first() {
            return Err(StageError::WrongStage(
                "take hidden states (it is the first stage)",
            ));
        }
        let count = data.iter().filter(|x| !x.is_finite()).count();
        if count > 0 {
            return Err(StageError::NonFinite {
                from: self.assignment.prev.as_ref().map_or_else(
                    || "the previous stage".to_string(),
                    |p| format!("the previous stage (node {})", p.node_id),
                ),
                count,
                len: data.len(),
            });
        }
        let n_embd = self.model.config().n_embd;
        let hidden = Hidden {
            n_tokens: header.n_rows(),
            n_embd,
            data,
        };
        self.step(header.entries, hidden, Instant::now(), sink)
    }

    /// Runs this stage's layers on `hidden` (rows of `entries`, in order) and emits what
    /// follows: the hidden state on, or (last stage) samples.
    fn step(
        &mut self,
        entries: Vec<StepEntry>,
        mut hidden: Hidden,
        started: Instant,
        sink: &mut dyn FnMut(StageOutput),
    ) -> Result<(), StageError> {
        // Take the sequences out of the map so their caches can be borrowed together.
        let mut states = Vec::with_capacity(entries.len());
        let mut refused = None;
        for e in &entries {
            match self.seqs.remove(&e.seq) {
                Some(mut s) if !s.finished => {
                    if s.unstarted && e.start_pos as usize <= s.kv.len() {
                        // The ring starts past the positions every stage has kept.
                        s.kv.truncate(e.start_pos as usize);
                        s.unstarted = false;
                    }
                    let expected = s.kv.len();
                    // After a verification the step starts where the agreement ended: the
                    // drafts' positions past it are dropped, not recomputed.
                    let agreed = expected.saturating_sub(s.unverified)..=expected;
                    let start = e.start_pos as usize;
                    if !agreed.contains(&start) || e.n_tokens == 0 {
                        refused = Some(StageError::BadStep {
                            seq: e.seq,
                            what: format!(
                                "step at position {} for {} tokens, but {expected} positions are cached",
                                e.start_pos, e.n_tokens
                            ),
                        });
                    } else if start < expected {
                        s.kv.truncate(start);
                    }
                    states.push(s);
                }
                Some(s) => {
                    refused = Some(StageError::BadStep {
                        seq: e.seq,
                        what: "the sequence has finished".into(),
                    });
                    states.push(s);
                }
                None => {
                    refused = Some(StageError::UnknownSeq(e.seq));
                    break;
                }
            }
        }
        if let Some(err) = refused {
            for s in states {
                self.seqs.insert(s.open.seq, s);
            }
            return Err(err);
        }
        let batch: Vec<SeqStep> = entries
            .iter()
            .map(|e| SeqStep {
                n_tokens: e.n_tokens as usize,
                start_pos: e.start_pos as usize,
            })
            .collect();
        let traffic_before = self.expert_traffic();
        let cache_before = self.model.expert_stats();
        let result = {
            let mut kvs: Vec<&mut KvCache> = states.iter_mut().map(|s| &mut s.kv).collect();
            match self.remote.as_mut() {
                Some(r) => self.model.run_layers(
                    self.assignment.layers.clone(),
                    &mut hidden,
                    &batch,
                    &mut kvs,
                    &mut r.executor(&self.model),
                ),
                None => self.model.run_layers(
                    self.assignment.layers.clone(),
                    &mut hidden,
                    &batch,
                    &mut kvs,
                    &mut LocalExperts(&self.model),
                ),
            }
        };
        let traffic = {
            let now = self.expert_traffic();
            (
                now.round_trips - traffic_before.round_trips,
                now.bytes - traffic_before.bytes,
                now.owners.since(&traffic_before.owners),
            )
        };
        let cache = CacheDelta::between(cache_before, self.model.expert_stats());
        if let Err(e) = result {
            for mut s in states {
                s.broken = true;
                self.seqs.insert(s.open.seq, s);
            }
            return Err(e.into());
        }
        let after_layer = self.assignment.layers.end;
        let stage = self.assignment.stage;
        let is_last = self.is_last();
        let mut row = 0usize;
        let mut outputs = Vec::new();
        for (e, s) in entries.iter().zip(states.iter_mut()) {
            let rows = row..row + e.n_tokens as usize;
            row = rows.end;
            s.unverified = if e.verify() {
                e.n_tokens as usize - 1
            } else {
                0
            };
            if s.open.trace {
                let slice = &hidden.data[rows.start * hidden.n_embd..rows.end * hidden.n_embd];
                outputs.push(StageOutput::Control(NodeToCoord::Trace(BoundaryTrace {
                    seq: e.seq,
                    stage,
                    after_layer,
                    start_pos: e.start_pos as usize,
                    n_tokens: e.n_tokens as usize,
                    hash: hash_f32s(slice),
                })));
            }
            if is_last && e.verify() {
                // Every row: row 0 draws the next token, row i checks draft i.
                let logits = self.model.head(&hidden.rows(rows))?;
                outputs.extend(sampling::verify(s, &logits));
            } else if is_last && e.sample() {
                let logits = self.model.head(&hidden.rows(rows.end - 1..rows.end))?;
                outputs.extend(sampling::verify(s, &logits));
            }
        }
        let compute_ns = started.elapsed().as_nanos() as u64;
        // Account compute to the phase of the first entry's sequence(s).
        for (e, s) in entries.iter().zip(states.iter_mut()) {
            let phase = if (e.start_pos as usize) < s.open.prompt.len() {
                &mut s.stats.prefill
            } else {
                s.stats.decode_step_share_micro += 1_000_000 / entries.len() as u64;
                &mut s.stats.decode
            };
            phase.steps += 1;
            phase.tokens += u64::from(e.n_tokens);
            phase.compute_ns += compute_ns / entries.len() as u64;
            phase.expert_round_trips += traffic.0;
            phase.expert_bytes += traffic.1;
            phase.owners.add(&traffic.2.share(entries.len() as u64));
            cache.share(entries.len() as u64).add_to(phase);
        }
        if !is_last {
            let header = StepHeader {
                n_embd: hidden.n_embd as u32,
                entries: entries.clone(),
            };
            let frame_bytes = (tessera_net::frame::HEADER_LEN
                + header.encoded_len()
                + hidden.data.len() * 4) as u64;
            for (e, s) in entries.iter().zip(states.iter_mut()) {
                let phase = if (e.start_pos as usize) < s.open.prompt.len() {
                    &mut s.stats.prefill
                } else {
                    &mut s.stats.decode
                };
                phase.bytes_sent += frame_bytes / entries.len() as u64;
                phase.frames_sent += 1;
                if e.sample() {
                    s.sent_at = Some(Instant::now());
                }
            }
            outputs.push(StageOutput::Hidden(header, hidden.data));
        }
        for s in states {
            self.seqs.insert(s.open.seq, s);
        }
        for o in outputs {
            sink(o);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
