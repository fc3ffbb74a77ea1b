//! Running the layers ahead while a step waits for an expert's read.
//!
//! A streamed expert that no prediction read in time is missed: the step that needs it waits
//! for its read, a few milliseconds on a slow disk against a tenth of one for a layer's
//! compute, and each later miss of the step is found, and read, only when the step reaches its
//! layer. Meanwhile the computing thread runs the layers after the miss on an *estimate*: the
//! hidden state with the layer's experts that are in memory (the missing ones left out), then
//! each later layer's attention and routing as the step would run them, again with only the
//! experts in memory. The estimate differs from the step by the missing experts' share, so its
//! routing names most of the experts the coming layers will route to, where the routers
//! applied early to the current state name few of them on a model whose layers redraw the
//! state; those not in memory are read ahead, behind the awaited read, instead of each being
//! missed in turn, so the disk stays busy while the step computes. The estimate stops as soon
//! as the awaited reads are in, and the step resumes where it waited, computed exactly as
//! before: the estimate only chooses what is read. The keys and values it wrote at the step's
//! positions are forgotten (the step writes its own there).

use std::sync::Arc;

use tessera_model::ExpertGating;

use crate::error::Result;
use crate::expert_store::ExpertStore;
use crate::kv::KvCache;
use crate::model::{Hidden, Model, Scratch, SeqStep};
use crate::moe::{ExpertGroup, Routing};
use crate::ops::add_assign;
use crate::timeline::{Lane, SpanKind};
use crate::weights::Ffn;

/// What running ahead needs of the step: the layers it runs and its sequences' caches.
pub(crate) struct Ahead<'a, 'k> {
    /// The end of the layers the step runs (the estimate stops there).
    pub end: usize,
    pub batch: &'a [SeqStep],
    pub kv: &'a mut [&'k mut KvCache],
    /// The step's estimate so far.
    pub estimate: &'a mut Estimate,
}

/// A step's estimate, kept from one of its waits to the next.
#[derive(Default)]
pub(crate) struct Estimate {
    /// Made at the first wait.
    scratch: Option<Scratch>,
    /// Where the last wait's estimate stopped: its hidden state, the input of this layer. A
    /// later wait before that layer goes on from there instead of starting over, so a step
    /// estimates each layer once, however many times it waits: the estimate's compute takes
    /// the cores the readers build with.
    stopped: Option<(Hidden, usize)>,
}

/// Most rows a step may have to run ahead: decode steps (a row per sequence). A prompt's
/// layers are long enough to keep the disk busy, and its estimate would cost as much as them.
const AHEAD_MAX_ROWS: usize = 4;

impl Model {
    /// While the reads of `used` (layer `layer`'s experts) are not all in, runs the layers
    /// after `layer` on an estimate and reads ahead the experts it routes to that are not in
    /// memory (see the module doc). The estimate starts from `hidden` (the input of `layer`'s
    /// FFN, routed by `routing`), or goes on from where the step's last one stopped if that is
    /// past `layer + 1`. The estimate only chooses what is read: where it meets an error it ends, and the step
    /// goes on to meet whatever it meets itself.
    pub(crate) fn run_ahead(
        &self,
        layer: usize,
        hidden: &Hidden,
        routing: &Routing,
        used: &[usize],
        ahead: Ahead<'_, '_>,
    ) {
        let Some(store) = self.expert_store() else {
            return;
        };
        // Llama 4 weights the experts' inputs: its estimate would need the slots' rows.
        if !store.runs_ahead()
            || hidden.n_tokens > AHEAD_MAX_ROWS
            || self.config().gating == ExpertGating::SigmoidInput
            || layer + 1 >= ahead.end
            || store.arrived(layer, used)
        {
            return;
        }
        let span = store.timeline().begin();
        let est = ahead.estimate;
        let sc = est
            .scratch
            .get_or_insert_with(|| self.step_scratch(ahead.batch));
        let (mut h, from) = match est.stopped.take() {
            Some((h, next)) if next > layer + 1 => (h, next),
            _ => {
                let mut h = hidden.clone();
                if self
                    .estimate_ffn(store, layer, &mut h, Some(routing), sc)
                    .is_err()
                {
                    return;
                }
                (h, layer + 1)
            }
        };
        let mut ok = true;
        // The layer the estimate goes on from next.
        let mut next = from;
        while next < ahead.end && !store.arrived(layer, used) {
            next += 1;
            let l = next - 1;
            ok = self
                .attention(l, &mut h, ahead.batch, ahead.kv, sc)
                .and_then(|()| self.estimate_ffn(store, l, &mut h, None, sc))
                .is_ok();
            if !ok {
                break;
            }
        }
        for (s, c) in ahead.batch.iter().zip(ahead.kv.iter_mut()) {
            for l in from..next {
                c.truncate_layer(l, s.start_pos);
            }
        }
        let kind = SpanKind::RunAhead { layer, to: next };
        store.timeline().end(span, Lane::Compute, kind);
        if ok {
            est.stopped = Some((h, next));
        }
    }

    /// Adds to `h` the estimate of `layer`'s FFN: a dense FFN as it is; an MoE layer's routed
    /// experts that are in memory (by `routing`, else routed here, and the absent ones then
    /// read ahead) and its shared experts.
    fn estimate_ffn(
        &self,
        store: &ExpertStore,
        layer: usize,
        h: &mut Hidden,
        routing: Option<&Routing>,
        sc: &mut Scratch,
    ) -> Result<()> {
        let w = self.core(layer)?;
        self.ffn_input(layer, h, sc)?;
        let mut out = std::mem::take(&mut sc.proj);
        match &w.ffn {
            Some(ffn) => self.dense_ffn(ffn, &sc.normed, &mut sc.gate, &mut sc.up, &mut out),
            None => {
                let routed_here;
                let routing = match routing {
                    Some(r) => r,
                    None => {
                        routed_here = self.moe_route(layer, &sc.normed)?;
                        &routed_here
                    }
                };
                let used = self.held_experts(layer, routing);
                let held = store.peek(layer, &used);
                let mut absent = Vec::new();
                let mut groups: Vec<ExpertGroup> = Vec::new();
                let mut ffns: Vec<Arc<Ffn>> = Vec::new();
                for (&e, f) in used.iter().zip(held) {
                    match f {
                        Some(f) => {
                            groups.push((e, routing.members(e)));
                            ffns.push(f);
                        }
                        None => absent.push(e),
                    }
                }
                store.prefetch_ahead(layer, &absent);
                self.routed_estimate(layer, routing, &groups, &ffns, &sc.normed, &mut out)?;
                if let Some(shared) = &w.shared {
                    let mut s = std::mem::take(&mut sc.q);
                    self.dense_ffn(shared, &sc.normed, &mut sc.gate, &mut sc.up, &mut s);
                    add_assign(&mut out, &s);
                    sc.q = s;
                }
            }
        }
        add_assign(&mut h.data, &out);
        sc.proj = out;
        Ok(())
    }

    /// `out` = the weighted sum of the outputs of the experts `ffns` (for their `groups`'
    /// tokens) over the tokens of `normed`.
    fn routed_estimate(
        &self,
        layer: usize,
        routing: &Routing,
        groups: &[ExpertGroup],
        ffns: &[Arc<Ffn>],
        normed: &Hidden,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let d = normed.n_embd;
        out.clear();
        out.resize(normed.n_tokens * d, 0.0);
        if groups.is_empty() {
            return Ok(());
        }
        let lw = self.layer_weights(layer)?;
        let refs: Vec<&Ffn> = ffns.iter().map(|f| &**f).collect();
        let outs = self.expert_ffns(normed, groups, &refs, &lw.expert_bias);
        for ((_, members), o) in groups.iter().zip(&outs) {
            for (i, &(t, s)) in members.iter().enumerate() {
                let wt = routing.weights[t * routing.k + s];
                let row = &mut out[t * d..(t + 1) * d];
                for (acc, &v) in row.iter_mut().zip(&o[i * d..(i + 1) * d]) {
                    *acc += wt * v;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tessera_model::{GgufFile, ModelConfig};

    use crate::expert_store::tests::small_moe;
    use crate::expert_store::ExpertStreaming;
    use crate::model::Model;
    use crate::weights::LoadSpec;

    /// A model streaming its experts through room for two a layer, nothing read before the
    /// first request, every read of its store taking `delay` (a slow disk).
    fn slow_streamed(g: &GgufFile, cfg: &ModelConfig, run_ahead: bool, delay: Duration) -> Model {
        let probe = ExpertStreaming {
            fill: false,
            ..ExpertStreaming::with_budget(u64::MAX / 2)
        };
        let spec = LoadSpec::full(cfg);
        let eb = Model::load_streaming(g, spec.clone(), probe, 1, &mut |_, _| {})
            .unwrap()
            .expert_stats()
            .unwrap()
            .expert_bytes;
        let st = ExpertStreaming {
            fill: false,
            pinned_fraction: 0.0,
            run_ahead,
            ..ExpertStreaming::with_budget(eb * 2 * cfg.n_layer as u64)
        };
        let m = Model::load_streaming(g, spec, st, 2, &mut |_, _| {}).unwrap();
        *m.expert_store().unwrap().faults().delay.lock().unwrap() = delay;
        m
    }

    fn argmax(row: &[f32]) -> u32 {
        let best = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1));
        best.map_or(0, |(i, _)| i as u32)
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Every read slow: each step that misses runs the layers ahead while it waits and reads
    /// ahead what its estimate routes to, and every logit of the prompt and of greedy decoding
    /// is bit for bit the full model's, as it is without running ahead.
    #[test]
    fn a_step_runs_ahead_while_it_waits_and_computes_what_it_would_without() {
        let (g, cfg) = small_moe();
        let full = Model::load_full(&g, 2).unwrap();
        for run_ahead in [true, false] {
            let s = slow_streamed(&g, &cfg, run_ahead, Duration::from_millis(20));
            let (mut kv_a, mut kv_b) = (full.new_kv(64), s.new_kv(64));
            let mut a = full.forward(&[1, 2, 3], &mut kv_a).unwrap();
            let mut b = s.forward(&[1, 2, 3], &mut kv_b).unwrap();
            for step in 0..4 {
                assert_eq!(bits(&a.data), bits(&b.data), "step {step}, {run_ahead}");
                let t = argmax(a.last());
                a = full.forward(&[t], &mut kv_a).unwrap();
                b = s.forward(&[t], &mut kv_b).unwrap();
            }
            assert_eq!(kv_b.len_in_every_layer(), 7);
            let st = s.expert_stats().unwrap();
            assert!(st.misses > 0, "{st:?}");
            if run_ahead {
                assert!(st.ahead_queued > 0, "{st:?}");
            } else {
                assert_eq!(st.ahead_queued, 0, "{st:?}");
            }
        }
    }

    /// A step whose read fails after it ran the layers beyond ahead leaves none of the
    /// estimate's keys and values in the cache: every layer holds the positions before the
    /// step, or the step's own where it ran them, so the sequence can be kept up to where all
    /// layers agree.
    #[test]
    fn a_step_that_fails_after_running_ahead_leaves_no_estimate_in_the_cache() {
        let (g, cfg) = small_moe();
        assert!(
            cfg.n_layer >= 3,
            "the test needs layers after the failing one"
        );
        let s = slow_streamed(&g, &cfg, true, Duration::from_millis(20));
        let store = s.expert_store().unwrap();
        let mut kv = s.new_kv(64);
        s.forward(&[1, 2], &mut kv).unwrap();
        *store.faults().failing_layer.lock().unwrap() = Some(1);
        let before = store.stats().ahead_queued;
        // Layer 1's experts for this token are not in memory (room for two a layer, the
        // prompt's two tokens used more), so the step waits there, runs ahead, then fails.
        let mut failed_at = None;
        for t in [5, 6, 7, 8] {
            let pos = kv.len_in_every_layer();
            if s.forward(&[t], &mut kv).is_err() {
                failed_at = Some(pos);
                break;
            }
        }
        let pos = failed_at.expect("no step needed a read of layer 1");
        assert!(store.stats().ahead_queued > before, "{:?}", store.stats());
        assert_eq!(kv.len_in_every_layer(), pos);
        for l in 2..cfg.n_layer {
            assert_eq!(kv.len_in_layer(l), pos, "layer {l}");
        }
    }
}
