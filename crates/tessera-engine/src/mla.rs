//! DeepSeek's multi-head latent attention (see [`tessera_model::Mla`]), run as llama.cpp runs
//! each layout.
//!
//! **Absorbed** (`attn_k_b`/`attn_v_b`, what current converters write): the cache holds one key
//! per position, `[c', rope(k_rope)]` with `c'` the normed latent, and its first `kv_lora_rank`
//! floats are the value (attention with one KV head):
//!
//! ```text
//! query_h  = [Wk_hᵀ · q_nope_h, rope(q_rope_h)]     score_h(p) = query_h · key(p) = expanded key's
//! out_h    = Wv_h · Σ_p softmax_h(p) c'(p)         = Σ_p softmax_h(p) · expanded value_h(p)
//! ```
//!
//! **Stacked** (`attn_kv_b`, older files): every head's key and value are expanded from the
//! latent by one matmul and cached, as llama.cpp does for these files. Running them absorbed
//! would cache 1/71 as much for DeepSeek-V3 (576 values a layer, not 40,960), but the rounding
//! differs from llama.cpp's expanded products: on the `tiny-deepseek2` fixture a teacher-forced
//! log-prob moved by 2e-2 and greedy tokens diverged at a near tie, so these files keep
//! llama.cpp's numerics.

use crate::exec::{quantize_for, run_matmuls, MatmulJob};
use crate::kernels::{Matrix, ThreadPool};
use crate::kv::KvCache;
use crate::model::{Model, Scratch, SeqStep};
use crate::ops::{rms_norm, rope_neox, rope_normal};
use crate::weights::{MlaHeads, MlaProj};
use tessera_model::RopeStyle;

/// Per-head widths of the absorbed products.
#[derive(Clone, Copy)]
struct Heads {
    n_head: usize,
    /// Non-rotated query/key width.
    nope: usize,
    v_head_dim: usize,
    kv_lora_rank: usize,
}

impl Model {
    /// Latent attention of `layer` from the normed input `sc.xn`: appends the step's latents to
    /// the caches and writes every head's output (`v_head_dim` each) to `sc.attn`.
    pub(crate) fn mla_attend(
        &self,
        m: &MlaProj,
        layer: usize,
        batch: &[SeqStep],
        kv: &mut [&mut KvCache],
        sc: &mut Scratch,
    ) {
        let cfg = self.config();
        let pool = self.pool();
        let mla = cfg.mla.expect("MLA weights are loaded for an MLA config");
        let n = sc.xn.len() / cfg.n_embd;
        let (e, eps) = (cfg.n_embd, cfg.rms_eps);
        let (hd, r, nh) = (cfg.head_dim, cfg.rope_dim, cfg.n_head);
        let g = Heads {
            n_head: nh,
            nope: hd - r,
            v_head_dim: cfg.v_head_dim(),
            kv_lora_rank: mla.kv_lora_rank,
        };
        let (nope, kvr, dv) = (g.nope, g.kv_lora_rank, g.v_head_dim);
        let (ca, qr) = (kvr + r, mla.q_lora_rank);
        // From the normed input: the latent with the shared rotated key, and the query's first
        // stage (or the whole query).
        let first_q = m.q_a.as_ref().map_or(&m.wq, |(qa, _)| qa);
        let acts = quantize_for(pool, &[m.kv_a.dtype(), first_q.dtype()], &sc.xn, n, e);
        sc.k.clear();
        sc.k.resize(n * ca, 0.0);
        let mut q = vec![0.0f32; n * nh * hd];
        let mut q_a = vec![0.0f32; n * qr];
        run_matmuls(
            pool,
            &mut [
                MatmulJob {
                    w: &m.kv_a,
                    acts: crate::exec::pick(&acts, m.kv_a.dtype()),
                    out: &mut sc.k,
                },
                MatmulJob {
                    w: first_q,
                    acts: crate::exec::pick(&acts, first_q.dtype()),
                    out: if m.q_a.is_some() { &mut q_a } else { &mut q },
                },
            ],
        );
        if let Some((_, norm)) = &m.q_a {
            for row in q_a.chunks_exact_mut(qr) {
                rms_norm(row, norm, eps);
            }
            let acts = quantize_for(pool, &[m.wq.dtype()], &q_a, n, qr);
            run_matmuls(
                pool,
                &mut [MatmulJob {
                    w: &m.wq,
                    acts: &acts[0],
                    out: &mut q,
                }],
            );
        }
        // The cached key of each position: the normed latent, then the rotated key part.
        let rope = match cfg.rope_style {
            RopeStyle::Normal => rope_normal,
            RopeStyle::Neox => rope_neox,
        };
        for t in 0..n {
            let (cos, sin) = sc.rope.row(t);
            let row = &mut sc.k[t * ca..(t + 1) * ca];
            rms_norm(&mut row[..kvr], &m.kv_a_norm, eps);
            rope(&mut row[kvr..], cos, sin);
        }
        let (k_b, v_b) = match &m.heads {
            MlaHeads::Absorbed { k_b, v_b } => (k_b, v_b),
            MlaHeads::Stacked(kv_b) => return self.mla_expanded(kv_b, g, q, layer, batch, kv, sc),
        };
        // Queries in the latent's space (head-major: all rows of head 0, then head 1, ...),
        // then the rotated part.
        let mut q_nope = vec![0.0f32; nh * n * nope];
        for t in 0..n {
            for h in 0..nh {
                let src = &q[(t * nh + h) * hd..(t * nh + h) * hd + nope];
                q_nope[(h * n + t) * nope..(h * n + t + 1) * nope].copy_from_slice(src);
            }
        }
        let q_lat = per_head_matmuls(pool, k_b, &q_nope, n);
        sc.q.clear();
        sc.q.resize(n * nh * ca, 0.0);
        for t in 0..n {
            let (cos, sin) = sc.rope.row(t);
            for h in 0..nh {
                let dst = &mut sc.q[(t * nh + h) * ca..(t * nh + h + 1) * ca];
                dst[..kvr].copy_from_slice(&q_lat[(h * n + t) * kvr..(h * n + t + 1) * kvr]);
                dst[kvr..].copy_from_slice(&q[(t * nh + h) * hd + nope..(t * nh + h + 1) * hd]);
                rope(&mut dst[kvr..], cos, sin);
            }
        }
        sc.v.clear();
        self.attend(layer, batch, kv, sc);
        // Each head's attended latent (head-major) into its value.
        let mut o_lat = vec![0.0f32; nh * n * kvr];
        for t in 0..n {
            for h in 0..nh {
                let src = &sc.attn[(t * nh + h) * kvr..(t * nh + h + 1) * kvr];
                o_lat[(h * n + t) * kvr..(h * n + t + 1) * kvr].copy_from_slice(src);
            }
        }
        let o = per_head_matmuls(pool, v_b, &o_lat, n);
        sc.attn.clear();
        sc.attn.resize(n * nh * dv, 0.0);
        for t in 0..n {
            for h in 0..nh {
                let src = &o[(h * n + t) * dv..(h * n + t + 1) * dv];
                sc.attn[(t * nh + h) * dv..(t * nh + h + 1) * dv].copy_from_slice(src);
            }
        }
    }
}

impl Model {
    /// The stacked layout (see the module doc): from the step's `[c', rope(k_rope)]` rows in
    /// `sc.k` and the unrotated queries `q`, every head's key `[Wk_h · c', rope(k_rope)]` and
    /// value `Wv_h · c'` are expanded by one matmul, cached, and attended to.
    #[allow(clippy::too_many_arguments)]
    fn mla_expanded(
        &self,
        kv_b: &Matrix,
        g: Heads,
        q: Vec<f32>,
        layer: usize,
        batch: &[SeqStep],
        kv: &mut [&mut KvCache],
        sc: &mut Scratch,
    ) {
        let cfg = self.config();
        let pool = self.pool();
        let (nh, nope, dv, kvr) = (g.n_head, g.nope, g.v_head_dim, g.kv_lora_rank);
        let (hd, ca) = (cfg.head_dim, kvr + cfg.rope_dim);
        let latent = std::mem::take(&mut sc.k);
        let n = latent.len() / ca;
        let mut c = Vec::with_capacity(n * kvr);
        for row in latent.chunks_exact(ca) {
            c.extend_from_slice(&row[..kvr]);
        }
        let per = nope + dv;
        let mut expanded = vec![0.0f32; n * nh * per];
        let acts = quantize_for(pool, &[kv_b.dtype()], &c, n, kvr);
        run_matmuls(
            pool,
            &mut [MatmulJob {
                w: kv_b,
                acts: &acts[0],
                out: &mut expanded,
            }],
        );
        let rope = match cfg.rope_style {
            RopeStyle::Normal => rope_normal,
            RopeStyle::Neox => rope_neox,
        };
        sc.q = q;
        sc.k = vec![0.0f32; n * nh * hd];
        sc.v.clear();
        sc.v.resize(n * nh * dv, 0.0);
        for t in 0..n {
            let (cos, sin) = sc.rope.row(t);
            let k_rope = &latent[t * ca + kvr..(t + 1) * ca];
            for h in 0..nh {
                let th = t * nh + h;
                let src = &expanded[th * per..(th + 1) * per];
                let k = &mut sc.k[th * hd..(th + 1) * hd];
                k[..nope].copy_from_slice(&src[..nope]);
                k[nope..].copy_from_slice(k_rope);
                sc.v[th * dv..(th + 1) * dv].copy_from_slice(&src[nope..]);
                rope(&mut sc.q[th * hd + nope..(th + 1) * hd], cos, sin);
            }
        }
        self.attend(layer, batch, kv, sc);
    }
}

/// `w[h] · x_h` for every head `h`, `x` head-major (`n` rows of `w[h].cols()` per head), as one
/// parallel job; the result head-major (`n` rows of `w[h].rows()`).
fn per_head_matmuls(pool: &ThreadPool, w: &[Matrix], x: &[f32], n: usize) -> Vec<f32> {
    let (cols, rows) = (w[0].cols(), w[0].rows());
    let acts: Vec<_> = w
        .iter()
        .enumerate()
        .map(|(h, wh)| {
            quantize_for(
                pool,
                &[wh.dtype()],
                &x[h * n * cols..(h + 1) * n * cols],
                n,
                cols,
            )
        })
        .collect();
    let mut out = vec![0.0f32; w.len() * n * rows];
    let mut jobs: Vec<MatmulJob<'_>> = out
        .chunks_exact_mut(n * rows)
        .zip(w.iter().zip(&acts))
        .map(|(out, (w, a))| MatmulJob {
            w,
            acts: &a[0],
            out,
        })
        .collect();
    run_matmuls(pool, &mut jobs);
    drop(jobs);
    out
}
