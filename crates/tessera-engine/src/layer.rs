//! One transformer layer, top to bottom. The supported families differ only in small ways,
//! marked where they happen:
//!
//! ```text
//! x  = h + Wo · attention(rope(norm_q(Wq·n + bq)), rope(norm_k(Wk·n + bk)), Wv·n + bv)
//!          where n = rms_norm(h) * attn_norm      (bq/bk/bv: Qwen2; norm_q/norm_k: Qwen3)
//! h' = x + FFN(rms_norm(x) * ffn_norm)            (dense SwiGLU, or routed experts)
//! ```
//!
//! Llama 4 skips RoPE in every fourth layer (NoPE, whose queries get a temperature at long
//! context) and RMS-normalises the rotated queries and keys without a weight.
//!
//! DeepSeek's latent attention makes q, k and v its own way (see [`tessera_model::Mla`]): one
//! cached latent per position that every head attends to through its own absorbed projections.
//! Its MoE layers add shared experts to the routed ones.

use crate::attention::{attend_fused, FusedScratch, HeadKv};
use crate::error::Result;
use crate::exec::{matmul_once, par_rows, pick, quantize_for, run_matmuls, MatmulJob};
use crate::kv::{KvCache, LayerView};
use crate::model::{Hidden, Model, Scratch, SeqStep};
use crate::moe::{reduce_expert_outputs, ExpertExecutor};
use crate::ops::{
    add_assign, attend_group, rms_norm_into, rms_norm_rows, rope_neox, rope_normal, sigmoid,
    softmax, swiglu_rows, AttnScratch, HeadRows,
};
use crate::run_ahead::Ahead;
use crate::weights::{AttnProj, Ffn};
use tessera_model::{ExpertGating, RopeStyle};

/// `&mut [f32]` written by attention tasks at disjoint places.
struct SharedOut(*mut f32, usize);
// SAFETY: each task writes only its own (row, head) slices; the borrow outlives the pool job.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

impl SharedOut {
    /// # Safety
    /// No other task may access `start..start + len` at the same time.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.1, "out of bounds");
        // SAFETY: in bounds (checked); exclusive (the caller's contract).
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

impl Model {
    /// Self-attention block of `layer` with its residual connection.
    pub(crate) fn attention(
        &self,
        layer: usize,
        hidden: &mut Hidden,
        batch: &[SeqStep],
        kv: &mut [&mut KvCache],
        sc: &mut Scratch,
    ) -> Result<()> {
        let cfg = self.config();
        let w = self.core(layer)?;
        let pool = self.pool();
        let (n, e) = (hidden.n_tokens, cfg.n_embd);
        let hd = cfg.head_dim;
        let (qd, kvd, vd) = (cfg.q_dim(), cfg.kv_dim(), cfg.v_dim());

        // Norm and Q/K/V projections (activations quantized once per weight type).
        sc.xn.clear();
        sc.xn.extend_from_slice(&hidden.data[..n * e]);
        par_rows(pool, &mut sc.xn, e, |_, rows| {
            rms_norm_rows(rows, e, Some(&w.attn_norm), cfg.rms_eps)
        });
        sc.q.resize(n * qd, 0.0);
        sc.k.resize(n * kvd, 0.0);
        sc.v.resize(n * vd, 0.0);
        let (wq, wk, wv) = match &w.proj {
            AttnProj::Qkv { wq, wk, wv } => (wq, wk, wv),
            AttnProj::Mla(m) => {
                self.mla_attend(m, layer, batch, kv, sc);
                return self.project(layer, hidden, sc);
            }
        };
        let acts = quantize_for(pool, &[wq.dtype(), wk.dtype(), wv.dtype()], &sc.xn, n, e);
        run_matmuls(
            pool,
            &mut [
                MatmulJob {
                    w: wq,
                    acts: pick(&acts, wq.dtype()),
                    out: &mut sc.q,
                },
                MatmulJob {
                    w: wk,
                    acts: pick(&acts, wk.dtype()),
                    out: &mut sc.k,
                },
                MatmulJob {
                    w: wv,
                    acts: pick(&acts, wv.dtype()),
                    out: &mut sc.v,
                },
            ],
        );
        // Qwen2: projection biases.
        for (buf, bias, width) in [
            (&mut sc.q, &w.bq, qd),
            (&mut sc.k, &w.bk, kvd),
            (&mut sc.v, &w.bv, vd),
        ] {
            if let Some(b) = bias {
                for row in buf.chunks_exact_mut(width) {
                    add_assign(row, b);
                }
            }
        }
        // Per token, in parallel: Qwen3's RMS norm of each head's query and key, RoPE at the
        // row's position, then Llama 4's unweighted RMS norm of each rotated head.
        let rope = cfg.uses_rope(layer).then_some(match cfg.rope_style {
            RopeStyle::Normal => rope_normal as fn(&mut [f32], &[f32], &[f32]),
            RopeStyle::Neox => rope_neox,
        });
        let table = &sc.rope;
        for (buf, width, norm) in [(&mut sc.q, qd, &w.q_norm), (&mut sc.k, kvd, &w.k_norm)] {
            par_rows(pool, buf, width, |t0, rows| {
                if let Some(norm) = norm {
                    rms_norm_rows(rows, hd, Some(norm), cfg.rms_eps);
                }
                let Some(rope) = rope else { return };
                for (j, row) in rows.chunks_exact_mut(width).enumerate() {
                    let (cos, sin) = table.row(t0 + j);
                    for head in row.chunks_exact_mut(hd) {
                        rope(head, cos, sin);
                    }
                }
                if cfg.rope_qk_rms_norm {
                    rms_norm_rows(rows, hd, None, cfg.rms_eps);
                }
            });
        }
        if rope.is_none() {
            if let Some(temp) = cfg.attn_temperature {
                // Llama 4's NoPE layers: queries warmed by the position's temperature.
                for t in 0..n {
                    let f = temp.factor(sc.rows[t].1);
                    sc.q[t * qd..(t + 1) * qd].iter_mut().for_each(|x| *x *= f);
                }
            }
        }
        self.attend(layer, batch, kv, sc);
        self.project(layer, hidden, sc)
    }

    /// Appends this step's keys `sc.k` and values `sc.v` to the caches and attends with the
    /// roped queries `sc.q`, writing every head's output to `sc.attn`. The widths are the
    /// cache's ([`crate::kv::KvShape`]): keys `k_head_dim` per KV head, `n_head / n_head_kv` query heads
    /// per KV head, `v_head_dim` of output per query head.
    pub(crate) fn attend(
        &self,
        layer: usize,
        batch: &[SeqStep],
        kv: &mut [&mut KvCache],
        sc: &mut Scratch,
    ) {
        let cfg = self.config();
        let pool = self.pool();
        let shape = self.kv_shape();
        let (nh, nkv) = (cfg.n_head, shape.n_head_kv);
        let (hd, dv) = (shape.k_head_dim, shape.v_head_dim);
        let (kvd, vd) = (shape.k_width(), shape.v_width());
        let (qd, od) = (nh * hd, nh * dv);
        let n = sc.q.len() / qd;
        let sinks = self.core(layer).ok().and_then(|w| w.sinks.as_ref());
        // Append this step's keys and values to each sequence's cache.
        let mut row = 0;
        for (s, c) in batch.iter().zip(kv.iter_mut()) {
            let (rk, rv) = (
                row * kvd..(row + s.n_tokens) * kvd,
                row * vd..(row + s.n_tokens) * vd,
            );
            c.append(layer, s.start_pos, &sc.k[rk], &sc.v[rv]);
            row += s.n_tokens;
        }
        // Causal attention, in parallel: per (row, KV head) over an F32 cache (llama.cpp's
        // numerics), per (sequence, block of rows, KV head) fused over F16/Q8_0.
        let views: Vec<(LayerView<'_>, usize)> = kv.iter().map(|c| c.view(layer)).collect();
        sc.attn.resize(n * od, 0.0);
        let out = SharedOut(sc.attn.as_mut_ptr(), sc.attn.len());
        let (q, rows) = (&sc.q, &sc.rows);
        let scale = cfg.attention_scale();
        let group = nh / nkv;
        // Work items: rows × KV head × a run of at most 16 of its query heads (MLA's one KV
        // head serves every query head: split, a decode step still spreads over the threads).
        // Each query vector's result is the same in any item (see `attention.rs`). A block of
        // rows makes about 64 query vectors per item: each key/value tile is converted to f32
        // once per item (at 16 the conversion was a tenth of a 2,048-token prefill's attention).
        let heads = group.min(16);
        let mut items = Vec::new();
        let mut row = 0;
        let block = (64 / group).max(1);
        for (i, st) in batch.iter().enumerate() {
            let step = match views[i].0 {
                LayerView::F32 { .. } => 1,
                _ => block,
            };
            // Head-major: a task's consecutive items read the same head's keys and values
            // (from cache, not memory, after the first).
            for kh in 0..nkv {
                for h0 in (0..group).step_by(heads) {
                    // Query heads `h..h + g` (absolute), all of KV head `kh`.
                    let (h, g) = (kh * group + h0, heads.min(group - h0));
                    for r0 in (row..row + st.n_tokens).step_by(step) {
                        let r1 = (r0 + step).min(row + st.n_tokens);
                        items.push((r0..r1, kh, h, g));
                    }
                }
            }
            row += st.n_tokens;
        }
        let n_tasks = items.len().min(pool.n_threads() * 8);
        pool.run(n_tasks, |task| {
            let (i0, i1) = (
                items.len() * task / n_tasks,
                items.len() * (task + 1) / n_tasks,
            );
            let mut scratch = AttnScratch::default();
            let mut fused = FusedScratch::default();
            let (mut qs, mut os, mut spans, mut head_sinks) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for &(ref rs, kh, h, g) in &items[i0..i1] {
                let (seq, _) = rows[rs.start];
                let (view, len) = views[seq];
                if let LayerView::F32 { k, v } = view {
                    let t = rs.start;
                    let pos = rows[t].1;
                    let o = t * qd + h * hd;
                    // SAFETY: heads h..h + g of row t belong to this task only.
                    let dst = unsafe { out.slice(t * od + h * dv, g * dv) };
                    attend_group(
                        dst,
                        &q[o..o + g * hd],
                        HeadRows {
                            data: k,
                            stride: kvd,
                            offset: kh * hd,
                            width: hd,
                        },
                        // Shared values (MLA) are the first `dv` floats of each key.
                        if shape.shared_v {
                            HeadRows {
                                data: k,
                                stride: kvd,
                                offset: kh * hd,
                                width: dv,
                            }
                        } else {
                            HeadRows {
                                data: v,
                                stride: vd,
                                offset: kh * dv,
                                width: dv,
                            }
                        },
                        pos + 1,
                        scale,
                        cfg.attention_start(layer, pos),
                        sinks.map(|s| &s[h..h + g]),
                        &mut scratch,
                    );
                    continue;
                }
                qs.clear();
                spans.clear();
                head_sinks.clear();
                for t in rs.clone() {
                    let o = t * qd + h * hd;
                    qs.extend_from_slice(&q[o..o + g * hd]);
                    let pos = rows[t].1;
                    let first = cfg.attention_start(layer, pos);
                    spans.extend((0..g).map(|_| first..pos + 1));
                    if let Some(s) = sinks {
                        head_sinks.extend_from_slice(&s[h..h + g]);
                    }
                }
                os.resize(spans.len() * dv, 0.0);
                let head = HeadKv {
                    view,
                    shape,
                    head: kh,
                    len,
                };
                let these_sinks = sinks.map(|_| &head_sinks[..]);
                attend_fused(&mut os, &qs, &spans, these_sinks, head, scale, &mut fused);
                for (j, t) in rs.clone().enumerate() {
                    // SAFETY: heads h..h + g of row t belong to this task only.
                    let dst = unsafe { out.slice(t * od + h * dv, g * dv) };
                    dst.copy_from_slice(&os[j * g * dv..(j + 1) * g * dv]);
                }
            }
        });
    }

    /// The output projection of every head's output `sc.attn`, added to `hidden`.
    fn project(&self, layer: usize, hidden: &mut Hidden, sc: &mut Scratch) -> Result<()> {
        let cfg = self.config();
        let w = self.core(layer)?;
        let pool = self.pool();
        let (n, e, od) = (hidden.n_tokens, cfg.n_embd, cfg.attn_out_dim());
        // Output projection and residual.
        sc.proj.resize(n * e, 0.0);
        let acts = quantize_for(pool, &[w.wo.dtype()], &sc.attn, n, od);
        run_matmuls(
            pool,
            &mut [MatmulJob {
                w: &w.wo,
                acts: &acts[0],
                out: &mut sc.proj,
            }],
        );
        if let Some(bo) = &w.bo {
            for row in sc.proj.chunks_exact_mut(e) {
                add_assign(row, bo);
            }
        }
        add_assign(&mut hidden.data, &sc.proj);
        Ok(())
    }

    /// The FFN's input, `sc.normed`: each row of `hidden` RMS-normed with `layer`'s FFN norm.
    pub(crate) fn ffn_input(&self, layer: usize, hidden: &Hidden, sc: &mut Scratch) -> Result<()> {
        let cfg = self.config();
        let w = self.core(layer)?;
        let (n, e) = (hidden.n_tokens, cfg.n_embd);
        let normed = &mut sc.normed;
        normed.n_tokens = n;
        normed.n_embd = e;
        normed.data.clear();
        normed.data.extend_from_slice(&hidden.data[..n * e]);
        par_rows(self.pool(), &mut normed.data, e, |_, rows| {
            rms_norm_rows(rows, e, Some(&w.ffn_norm), cfg.rms_eps)
        });
        Ok(())
    }

    /// Feed-forward block of `layer` (dense or MoE) with its residual connection. With `ahead`,
    /// a step that waits for an expert's read runs the layers after it on an estimate
    /// meanwhile (see [`crate::run_ahead`]).
    pub(crate) fn feed_forward(
        &self,
        layer: usize,
        hidden: &mut Hidden,
        experts: &mut dyn ExpertExecutor,
        sc: &mut Scratch,
        ahead: Option<Ahead<'_, '_>>,
    ) -> Result<()> {
        let w = self.core(layer)?;
        self.ffn_input(layer, hidden, sc)?;
        let normed = &sc.normed;
        match &w.ffn {
            Some(ffn) => {
                let mut out = std::mem::take(&mut sc.proj);
                self.dense_ffn(ffn, normed, &mut sc.gate, &mut sc.up, &mut out);
                add_assign(&mut hidden.data, &out);
                sc.proj = out;
            }
            None => {
                let routing = self.moe_route(layer, normed)?;
                if let Some(store) = self.expert_store() {
                    // This layer's misses first: queued now, read while the next layer's
                    // prediction is made and the resident experts compute.
                    let used = self.held_experts(layer, &routing);
                    store.fetch(layer, &used);
                    if store.prefetching() {
                        self.prefetch_next(layer, hidden)?;
                    }
                    if let Some(ahead) = ahead.filter(|_| experts.all_local()) {
                        self.run_ahead(layer, hidden, &routing, &used, ahead);
                    }
                }
                let parts = experts.run(layer, normed, &routing)?;
                let mut out = reduce_expert_outputs(&parts)?;
                // Shared experts beside the routed ones: (routed + shared) + residual, as
                // llama.cpp adds them.
                if let Some(shared) = &w.shared {
                    let mut s = std::mem::take(&mut sc.proj);
                    self.dense_ffn(shared, &sc.normed, &mut sc.gate, &mut sc.up, &mut s);
                    add_assign(&mut out.data, &s);
                    sc.proj = s;
                }
                add_assign(&mut hidden.data, &out.data);
            }
        }
        Ok(())
    }

    /// `out = down(silu(gate x) * up x)` for every row of `normed` (`gate`, `up`: scratch).
    pub(crate) fn dense_ffn(
        &self,
        ffn: &Ffn,
        normed: &Hidden,
        gate: &mut Vec<f32>,
        up: &mut Vec<f32>,
        out: &mut Vec<f32>,
    ) {
        let pool = self.pool();
        let (n, e) = (normed.n_tokens, normed.n_embd);
        let f = ffn.gate.rows();
        gate.resize(n * f, 0.0);
        up.resize(n * f, 0.0);
        let acts = quantize_for(
            pool,
            &[ffn.gate.dtype(), ffn.up.dtype()],
            &normed.data,
            n,
            e,
        );
        run_matmuls(
            pool,
            &mut [
                MatmulJob {
                    w: &ffn.gate,
                    acts: pick(&acts, ffn.gate.dtype()),
                    out: gate,
                },
                MatmulJob {
                    w: &ffn.up,
                    acts: pick(&acts, ffn.up.dtype()),
                    out: up,
                },
            ],
        );
        swiglu_rows(gate, up, f);
        let acts = quantize_for(pool, &[ffn.down.dtype()], gate, n, f);
        out.resize(n * e, 0.0);
        run_matmuls(
            pool,
            &mut [MatmulJob {
                w: &ffn.down,
                acts: &acts[0],
                out,
            }],
        );
    }

    /// Predicts the experts of the next MoE layer (`layer + 1`, or past Llama 4's dense layer
    /// between) by applying its router early to `hidden` (the input of layer `layer`'s FFN,
    /// normed with the next MoE layer's FFN norm), and hands the prediction to the expert store:
    /// every expert in some token's top k, with its predicted probability (the most any token
    /// gives it), most probable first. The store reads the most probable ones ahead while this
    /// layer computes.
    fn prefetch_next(&self, layer: usize, hidden: &Hidden) -> Result<()> {
        let (Some(store), Some(next)) = (self.expert_store(), self.next_moe_layer(layer)) else {
            return Ok(());
        };
        let Ok(core) = self.core(next) else {
            return Ok(());
        };
        let Some(router) = &core.router else {
            return Ok(());
        };
        let cfg = self.config();
        let (n, ne, k) = (hidden.n_tokens, cfg.n_expert, cfg.n_expert_used);
        let mut pred = Hidden::zeros(n, cfg.n_embd);
        for t in 0..n {
            rms_norm_into(pred.row_mut(t), hidden.row(t), &core.ffn_norm, cfg.rms_eps);
        }
        let mut probs = vec![0.0f32; n * ne];
        matmul_once(store.predict_pool(), router, &pred.data, n, &mut probs);
        let mut best = vec![f32::NEG_INFINITY; ne];
        let mut order: Vec<usize> = Vec::with_capacity(ne);
        for p in probs.chunks_exact_mut(ne) {
            match cfg.gating {
                ExpertGating::Sigmoid | ExpertGating::SigmoidInput => {
                    p.iter_mut().for_each(|x| *x = sigmoid(*x))
                }
                ExpertGating::Softmax | ExpertGating::SoftmaxWeight => softmax(p),
            }
            if let Some(b) = &core.selection_bias {
                add_assign(p, b);
            }
            order.clear();
            order.extend(0..ne);
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            for &e in &order[..k.min(ne)] {
                best[e] = best[e].max(p[e]);
            }
        }
        let mut predicted: Vec<(usize, f32)> = (0..ne)
            .filter(|&e| best[e] > f32::NEG_INFINITY && self.holds_expert(next, e))
            .map(|e| (e, best[e]))
            .collect();
        predicted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        store.prefetch_ranked(next, &predicted);
        Ok(())
    }
}
