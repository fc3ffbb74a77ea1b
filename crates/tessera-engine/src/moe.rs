//! Mixture-of-experts: routing, expert compute, and the fixed-order reduction that makes split
//! execution bit-identical to unsplit execution.
//!
//! Floating-point addition is not associative, so experts computed on different machines can
//! only reproduce the unsplit layer exactly if partial results are combined in one fixed order.
//! Here nothing is pre-summed: an [`ExpertOutputs`] carries, for each token and each of its
//! top-k *slots*, the weighted output of that slot's expert (if this part computed it), and
//! [`reduce_expert_outputs`] adds the slots of every token in slot order `0..k` — exactly what
//! the unsplit layer does, because the unsplit layer is simply one part holding every expert.

use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::exec::{matmul_once, pick, quantize_for, run_matmuls, MatmulJob};
use crate::kernels::QuantizedActs;
use crate::model::{Hidden, Model};
use crate::ops::{add_assign, sigmoid, softmax, swiglu_oai_rows, swiglu_rows};
use crate::weights::{Ffn, FfnBias};
use tessera_model::{ExpertGating, FfnActivation};

/// The experts chosen for each token: `k` (expert id, weight) slots per token, most probable
/// first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Routing {
    pub n_tokens: usize,
    pub k: usize,
    /// `experts[t*k + s]`: the expert in slot `s` of token `t`.
    pub experts: Vec<u32>,
    /// `weights[t*k + s]`: its gate weight.
    pub weights: Vec<f32>,
}

impl Routing {
    /// Slots of token `t` as (expert, weight).
    pub fn token(&self, t: usize) -> impl Iterator<Item = (usize, f32)> + '_ {
        let r = t * self.k..(t + 1) * self.k;
        self.experts[r.clone()]
            .iter()
            .zip(&self.weights[r])
            .map(|(&e, &w)| (e as usize, w))
    }

    /// The (token, slot) pairs routed to expert `e`, in token order.
    pub fn members(&self, e: usize) -> Vec<(usize, usize)> {
        let mut members = Vec::new();
        for t in 0..self.n_tokens {
            for (s, (ex, _)) in self.token(t).enumerate() {
                if ex == e {
                    members.push((t, s));
                }
            }
        }
        members
    }

    /// Tokens with at least one slot routed to an expert `owned` accepts (what a part holding
    /// those experts must be sent).
    pub fn tokens_for(&self, owned: &dyn Fn(usize) -> bool) -> Vec<usize> {
        (0..self.n_tokens)
            .filter(|&t| self.token(t).any(|(e, _)| owned(e)))
            .collect()
    }

    /// The routing of `tokens` only (rows in that order).
    pub fn subset(&self, tokens: &[usize]) -> Self {
        let k = self.k;
        let mut r = Self {
            n_tokens: tokens.len(),
            k,
            experts: Vec::with_capacity(tokens.len() * k),
            weights: Vec::with_capacity(tokens.len() * k),
        };
        for &t in tokens {
            r.experts
                .extend_from_slice(&self.experts[t * k..(t + 1) * k]);
            r.weights
                .extend_from_slice(&self.weights[t * k..(t + 1) * k]);
        }
        r
    }

    /// Distinct experts used by any token, ascending.
    pub fn experts_used(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self.experts.iter().map(|&e| e as usize).collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// Weighted expert outputs computed by one part: `slots[t*k + s]` is `weight * expert(x_t)` for
/// slot `s` of token `t`, or `None` if another part computes that slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertOutputs {
    pub n_tokens: usize,
    pub k: usize,
    pub n_embd: usize,
    pub slots: Vec<Option<Vec<f32>>>,
}

impl ExpertOutputs {
    /// Outputs computed for a subset of a batch (row `i` is token `tokens[i]`, as produced from
    /// [`Routing::subset`] and [`Hidden::gather`]) placed in a batch of `n_tokens`; other
    /// tokens' slots are `None`. Expert outputs do not depend on which other tokens were
    /// computed with them, so this is bit-identical to computing the whole batch.
    pub fn expand(&self, tokens: &[usize], n_tokens: usize) -> Result<Self> {
        if tokens.len() != self.n_tokens || tokens.iter().any(|&t| t >= n_tokens) {
            return Err(EngineError::ExpertOutputs(format!(
                "{} rows cannot be placed at tokens {tokens:?} of {n_tokens}",
                self.n_tokens
            )));
        }
        let k = self.k;
        let mut slots = vec![None; n_tokens * k];
        for (i, &t) in tokens.iter().enumerate() {
            for s in 0..k {
                slots[t * k + s] = self.slots[i * k + s].clone();
            }
        }
        Ok(Self {
            n_tokens,
            k,
            n_embd: self.n_embd,
            slots,
        })
    }
}

/// Merges the parts' outputs and sums each token's slots in slot order. Every slot must be
/// supplied by exactly one part.
pub fn reduce_expert_outputs(parts: &[ExpertOutputs]) -> Result<Hidden> {
    let first = parts
        .first()
        .ok_or_else(|| EngineError::ExpertOutputs("no parts to reduce".into()))?;
    let (n, k, d) = (first.n_tokens, first.k, first.n_embd);
    for p in parts {
        if (p.n_tokens, p.k, p.n_embd) != (n, k, d) || p.slots.len() != n * k {
            return Err(EngineError::ExpertOutputs(format!(
                "parts disagree on shape: {}x{}x{} vs {n}x{k}x{d}",
                p.n_tokens, p.k, p.n_embd
            )));
        }
    }
    let mut out = Hidden::zeros(n, d);
    for t in 0..n {
        let row = out.row_mut(t);
        for s in 0..k {
            let mut found: Option<&Vec<f32>> = None;
            for p in parts {
                if let Some(v) = &p.slots[t * k + s] {
                    if found.is_some() {
                        return Err(EngineError::ExpertOutputs(format!(
                            "token {t} slot {s} supplied by more than one part"
                        )));
                    }
                    if v.len() != d {
                        return Err(EngineError::ExpertOutputs(format!(
                            "token {t} slot {s} has {} values, not {d}",
                            v.len()
                        )));
                    }
                    found = Some(v);
                }
            }
            let v = found.ok_or_else(|| {
                EngineError::ExpertOutputs(format!("token {t} slot {s} was not computed"))
            })?;
            if s == 0 {
                row.copy_from_slice(v);
            } else {
                for (o, &x) in row.iter_mut().zip(v) {
                    *o += x;
                }
            }
        }
    }
    Ok(out)
}

/// Computes the experts of one MoE layer for a batch, wherever they live.
pub trait ExpertExecutor {
    /// The outputs of every slot of `routing`, possibly as several parts.
    fn run(
        &mut self,
        layer: usize,
        normed: &Hidden,
        routing: &Routing,
    ) -> Result<Vec<ExpertOutputs>>;

    /// Whether every expert runs on the model itself (so it may run the layers ahead on its
    /// own experts while it waits for a read, see `crate::run_ahead`).
    fn all_local(&self) -> bool {
        false
    }
}

/// Runs every expert on the model itself.
pub struct LocalExperts<'a>(pub &'a Model);

impl ExpertExecutor for LocalExperts<'_> {
    fn run(
        &mut self,
        layer: usize,
        normed: &Hidden,
        routing: &Routing,
    ) -> Result<Vec<ExpertOutputs>> {
        Ok(vec![self
            .0
            .moe_experts(layer, normed, routing, &|_| true)?])
    }

    fn all_local(&self) -> bool {
        true
    }
}

/// Runs each expert on whichever of several separately loaded parts holds it (each part
/// computes the experts it holds); for tests and for a single process holding several parts.
pub struct PartExperts<'a>(pub Vec<&'a Model>);

impl ExpertExecutor for PartExperts<'_> {
    fn run(
        &mut self,
        layer: usize,
        normed: &Hidden,
        routing: &Routing,
    ) -> Result<Vec<ExpertOutputs>> {
        self.0
            .iter()
            .map(|m| m.moe_experts(layer, normed, routing, &|e| m.holds_expert(layer, e)))
            .collect()
    }
}

/// Group-limited routing (DeepSeek-V3): the experts form `groups` equal groups of consecutive
/// ids, each scored by the sum of its two best selection scores; all but the `used` best groups
/// (ties: lower group) are masked to minus infinity.
fn mask_groups(select: &mut [f32], groups: usize, used: usize) {
    let per = select.len() / groups;
    let score = |g: &[f32]| -> f32 {
        let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &x in g {
            if x > a {
                (a, b) = (x, a);
            } else if x > b {
                b = x;
            }
        }
        if per == 1 {
            a
        } else {
            a + b
        }
    };
    let scores: Vec<f32> = select.chunks_exact(per).map(score).collect();
    let mut order: Vec<usize> = (0..groups).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    for &g in &order[used..] {
        select[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
    }
}

/// An expert and the (row, slot) pairs it computes, in row order.
pub(crate) type ExpertGroup = (usize, Vec<(usize, usize)>);

/// Lower bound applied to the sum of the selected weights before renormalising (llama.cpp).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

impl Model {
    /// The router of MoE layer `layer`: the gate's outputs (softmax over all experts' logits, or
    /// each logit's sigmoid), the top `k` by those plus the selection bias when the model has
    /// one (ties: lower id), within the best expert groups when routing is group-limited; their
    /// weights are the gate's outputs, renormalised to sum to one when the model asks for it,
    /// then scaled by [`ModelConfig::expert_weights_scale`]. For gpt-oss
    /// ([`ExpertGating::SoftmaxWeight`]): the top `k` biased logits and the softmax of those `k`.
    /// For Llama 4 ([`ExpertGating::SigmoidInput`]): the top `k` logits and their sigmoids
    /// (which [`Model::moe_experts`] applies to the experts' inputs).
    ///
    /// [`ModelConfig::expert_weights_scale`]: tessera_model::ModelConfig::expert_weights_scale
    pub fn moe_route(&self, layer: usize, normed: &Hidden) -> Result<Routing> {
        let cfg = self.config();
        let core = self.core(layer)?;
        let router = core.router.as_ref().ok_or_else(|| {
            EngineError::BadInput(format!("layer {layer} is not a mixture-of-experts layer"))
        })?;
        let (n, ne, k) = (normed.n_tokens, cfg.n_expert, cfg.n_expert_used);
        let mut probs = vec![0.0f32; n * ne];
        matmul_once(self.pool(), router, &normed.data, n, &mut probs);
        let mut experts = Vec::with_capacity(n * k);
        let mut weights = Vec::with_capacity(n * k);
        let mut order: Vec<usize> = Vec::with_capacity(ne);
        let mut select = vec![0.0f32; ne];
        for p in probs.chunks_exact_mut(ne) {
            if let Some(b) = &core.router_bias {
                add_assign(p, b);
            }
            // Llama 4 selects by the logits themselves (its sigmoid comes after the top k).
            if cfg.gating == ExpertGating::SigmoidInput {
                select.copy_from_slice(p);
            }
            match cfg.gating {
                ExpertGating::Softmax => softmax(p),
                ExpertGating::Sigmoid | ExpertGating::SigmoidInput => {
                    p.iter_mut().for_each(|x| *x = sigmoid(*x))
                }
                ExpertGating::SoftmaxWeight => {}
            }
            if cfg.gating != ExpertGating::SigmoidInput {
                select.copy_from_slice(p);
            }
            if let Some(b) = &core.selection_bias {
                add_assign(&mut select, b);
            }
            if cfg.expert_groups > 1 {
                mask_groups(&mut select, cfg.expert_groups, cfg.expert_groups_used);
            }
            order.clear();
            order.extend(0..ne);
            order.sort_by(|&a, &b| select[b].total_cmp(&select[a]).then(a.cmp(&b)));
            let sel = &order[..k];
            let mut w: Vec<f32> = sel.iter().map(|&e| p[e]).collect();
            if cfg.gating == ExpertGating::SoftmaxWeight {
                softmax(&mut w);
            }
            if cfg.norm_topk_weights {
                let sum = (w.iter().map(|&x| x as f64).sum::<f64>() as f32).max(MIN_WEIGHT_SUM);
                for x in &mut w {
                    *x /= sum;
                }
            }
            if cfg.expert_weights_scale != 1.0 && cfg.expert_weights_scale != 0.0 {
                for x in &mut w {
                    *x *= cfg.expert_weights_scale;
                }
            }
            experts.extend(sel.iter().map(|&e| e as u32));
            weights.extend(w);
        }
        Ok(Routing {
            n_tokens: n,
            k,
            experts,
            weights,
        })
    }

    /// Computes the slots of `routing` whose expert satisfies `owned` (each such expert once,
    /// for all the tokens routed to it, reading its weights once). An owned expert that this
    /// part does not hold is an error. A slot's output is its weight times the expert's output,
    /// or, for Llama 4 ([`ExpertGating::SigmoidInput`]), the expert's output of its input times
    /// the weight; either way it depends only on the token's row and its slot, so the parts of
    /// a split compute what the whole layer would.
    pub fn moe_experts(
        &self,
        layer: usize,
        normed: &Hidden,
        routing: &Routing,
        owned: &dyn Fn(usize) -> bool,
    ) -> Result<ExpertOutputs> {
        let cfg = self.config();
        let (n, k, d) = (routing.n_tokens, routing.k, cfg.n_embd);
        if normed.n_tokens != n || normed.n_embd != d {
            return Err(EngineError::BadInput(format!(
                "routing for {n} tokens, hidden {}x{}",
                normed.n_tokens, normed.n_embd
            )));
        }
        let lw = self.layer_weights(layer)?;
        let store = self.expert_store();
        // Tokens (and their slot) per expert, in token order.
        let mut groups: Vec<(usize, Vec<(usize, usize)>)> = Vec::new();
        for e in routing.experts_used() {
            if e >= cfg.n_expert {
                return Err(EngineError::BadInput(format!(
                    "routing names expert {e} of {}",
                    cfg.n_expert
                )));
            }
            if !owned(e) {
                continue;
            }
            let held = if store.is_some() {
                self.holds_expert(layer, e)
            } else {
                lw.experts.get(e).and_then(Option::as_ref).is_some()
            };
            if !held {
                return Err(EngineError::ExpertNotLoaded { layer, expert: e });
            }
            groups.push((e, routing.members(e)));
        }
        // Llama 4: every (token, slot) has its own input row, the token's row times the slot's
        // weight; the experts run on those rows (member `i` of the rewritten groups is row `i`
        // of `weighted`) and their outputs are the slots' as they are.
        let weight_input = cfg.gating == ExpertGating::SigmoidInput;
        let (weighted_rows, regrouped);
        let (normed, run): (&Hidden, &[ExpertGroup]) = if weight_input {
            let mut rows = Hidden::zeros(groups.iter().map(|(_, m)| m.len()).sum(), d);
            let mut rg = Vec::with_capacity(groups.len());
            let mut r = 0;
            for (e, members) in &groups {
                let mut rm = Vec::with_capacity(members.len());
                for &(t, s) in members {
                    let wt = routing.weights[t * k + s];
                    for (o, &x) in rows.row_mut(r).iter_mut().zip(normed.row(t)) {
                        *o = x * wt;
                    }
                    rm.push((r, s));
                    r += 1;
                }
                rg.push((*e, rm));
            }
            (weighted_rows, regrouped) = (rows, rg);
            (&weighted_rows, &regrouped)
        } else {
            (normed, &groups)
        };
        let down: Vec<Vec<f32>> = match store {
            None => {
                let ffns: Vec<&Ffn> = groups
                    .iter()
                    .map(|(e, _)| lw.experts[*e].as_ref().expect("checked above"))
                    .collect();
                self.expert_ffns(normed, run, &ffns, &lw.expert_bias)
            }
            Some(store) => {
                let slots_owned: Vec<u32> = routing
                    .experts
                    .iter()
                    .copied()
                    .filter(|&e| owned(e as usize))
                    .collect();
                store.observe(layer, n, &slots_owned);
                if !self.spec().dense {
                    // No router here to predict the next MoE layer with: use its last routing.
                    if let Some(next) = self.next_moe_layer(layer) {
                        store.prefetch(next, store.last_used(next));
                    }
                }
                // The experts already in memory first, in chunks the layer's cache can hold at
                // once (so built experts alive stay within the budget), while the misses' reads
                // (queued by `observe`) proceed; then each miss as soon as it is read. Each
                // expert's output depends only on its own weights and tokens, so the order is
                // invisible in the result.
                let ids: Vec<usize> = groups.iter().map(|(e, _)| *e).collect();
                let resident = store.resident(layer, &ids);
                let ready: Vec<usize> = (0..groups.len()).filter(|&i| resident[i]).collect();
                let later = (0..groups.len()).filter(|&i| !resident[i]);
                let mut batches: Vec<Vec<usize>> = ready
                    .chunks(store.chunk_limit(layer))
                    .map(<[usize]>::to_vec)
                    .collect();
                batches.extend(later.map(|i| vec![i]));
                let mut outs: Vec<Option<Vec<f32>>> = vec![None; groups.len()];
                for batch in batches {
                    let part: Vec<(usize, Vec<(usize, usize)>)> =
                        batch.iter().map(|&i| run[i].clone()).collect();
                    let part_ids: Vec<usize> = part.iter().map(|(e, _)| *e).collect();
                    let held = store.get_many(layer, &part_ids)?;
                    let ffns: Vec<&Ffn> = held.iter().map(|f| &**f).collect();
                    let outs_part = self.expert_ffns(normed, &part, &ffns, &lw.expert_bias);
                    for (&i, out) in batch.iter().zip(outs_part) {
                        outs[i] = Some(out);
                    }
                }
                outs.into_iter()
                    .map(|o| o.expect("every expert group computed"))
                    .collect()
            }
        };
        let mut slots: Vec<Option<Vec<f32>>> = vec![None; n * k];
        for ((_, members), out) in groups.iter().zip(&down) {
            for (i, &(t, s)) in members.iter().enumerate() {
                let out = &out[i * d..(i + 1) * d];
                slots[t * k + s] = Some(if weight_input {
                    out.to_vec()
                } else {
                    let wt = routing.weights[t * k + s];
                    out.iter().map(|&v| v * wt).collect()
                });
            }
        }
        Ok(ExpertOutputs {
            n_tokens: n,
            k,
            n_embd: d,
            slots,
        })
    }

    /// `down(act(gate x, up x))` of each expert `ffns[i]` for the tokens of `groups[i]`
    /// (rows in member order): gate and up of all experts as one parallel job, then down.
    /// `bias[e]`, when the model has expert biases, is added to expert `e`'s three projections.
    pub(crate) fn expert_ffns(
        &self,
        normed: &Hidden,
        groups: &[(usize, Vec<(usize, usize)>)],
        ffns: &[&Ffn],
        bias: &[Option<FfnBias>],
    ) -> Vec<Vec<f32>> {
        let bias_of = |i: usize| bias.get(groups[i].0).and_then(Option::as_ref);
        let cfg = self.config();
        let pool = self.pool();
        let d = cfg.n_embd;
        let ffn = |i: usize| ffns[i];
        // gate and up for every expert, as one parallel job. The input rows are quantized once
        // (quantization is per row, so a gathered row equals the row quantized on its own) and
        // each expert takes its tokens' rows, or all of them as they are (e.g. one token).
        let f = cfg.n_ff_expert;
        let mut dtypes = Vec::new();
        for i in 0..groups.len() {
            dtypes.extend([ffn(i).gate.dtype(), ffn(i).up.dtype()]);
        }
        let all = quantize_for(pool, &dtypes, &normed.data, normed.n_tokens, d);
        let acts: Vec<Option<Vec<QuantizedActs>>> = groups
            .iter()
            .map(|(_, members)| {
                let tokens: Vec<usize> = members.iter().map(|&(t, _)| t).collect();
                let everyone = tokens.len() == normed.n_tokens
                    && tokens.iter().enumerate().all(|(i, &t)| i == t);
                (!everyone).then(|| all.iter().map(|a| a.gather(&tokens)).collect())
            })
            .collect();
        let acts: Vec<&[QuantizedActs]> =
            acts.iter().map(|a| a.as_deref().unwrap_or(&all)).collect();
        let mut gate: Vec<Vec<f32>> = groups.iter().map(|(_, m)| vec![0.0; m.len() * f]).collect();
        let mut up: Vec<Vec<f32>> = groups.iter().map(|(_, m)| vec![0.0; m.len() * f]).collect();
        {
            let mut jobs = Vec::with_capacity(2 * groups.len());
            for (i, (a, (g, u))) in acts
                .iter()
                .zip(gate.iter_mut().zip(up.iter_mut()))
                .enumerate()
            {
                let w = ffn(i);
                jobs.push(MatmulJob {
                    w: &w.gate,
                    acts: pick(a, w.gate.dtype()),
                    out: g,
                });
                jobs.push(MatmulJob {
                    w: &w.up,
                    acts: pick(a, w.up.dtype()),
                    out: u,
                });
            }
            run_matmuls(pool, &mut jobs);
        }
        // down, as one parallel job.
        let mut acts = Vec::with_capacity(groups.len());
        for (i, (((_, members), g), u)) in groups.iter().zip(&mut gate).zip(&mut up).enumerate() {
            if let Some(b) = bias_of(i) {
                for (gr, ur) in g.chunks_exact_mut(f).zip(u.chunks_exact_mut(f)) {
                    add_assign(gr, &b.gate);
                    add_assign(ur, &b.up);
                }
            }
            match cfg.activation {
                FfnActivation::Swiglu => swiglu_rows(g, u, f),
                FfnActivation::SwigluOai { alpha, limit } => swiglu_oai_rows(g, u, alpha, limit),
            }
            acts.push(quantize_for(
                pool,
                &[ffn(i).down.dtype()],
                g,
                members.len(),
                f,
            ));
        }
        let mut down: Vec<Vec<f32>> = groups.iter().map(|(_, m)| vec![0.0; m.len() * d]).collect();
        {
            let mut jobs = Vec::with_capacity(groups.len());
            for (i, (a, o)) in acts.iter().zip(down.iter_mut()).enumerate() {
                jobs.push(MatmulJob {
                    w: &ffn(i).down,
                    acts: &a[0],
                    out: o,
                });
            }
            run_matmuls(pool, &mut jobs);
        }
        for (i, o) in down.iter_mut().enumerate() {
            if let Some(b) = bias_of(i) {
                for row in o.chunks_exact_mut(d) {
                    add_assign(row, &b.down);
                }
            }
        }
        down
    }
}
