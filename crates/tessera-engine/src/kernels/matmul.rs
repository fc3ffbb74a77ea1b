//! Matmul drivers: split rows × tokens into pool tasks and call the per-ISA kernels.
//!
//! Work is split into units of one interleaved 16-row group times a range of tokens. Every
//! output element is computed by one kernel call whose arithmetic does not depend on the split,
//! so results are identical for any thread count or batch.

use tessera_model::GgmlType;

use super::matrix::{Matrix, GROUP};
use super::pool::ThreadPool;
use super::quant_acts::QuantizedActs;
use super::{isa, kernel, pair_kernel, GroupFn, Isa, SharedMut};

/// `out[t*rows + r] = dot(w.row(r), x[t*cols..(t+1)*cols])` for every token `t < n_tokens`.
///
/// # Panics
/// If `x.len() != n_tokens * w.cols()` or `out.len() < n_tokens * w.rows()`.
pub fn matmul(pool: &ThreadPool, w: &Matrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    matmul_rows(pool, w, 0, w.rows, x, n_tokens, out);
}

/// Rows `row_start..row_end` only: `out[t*(row_end-row_start) + (r-row_start)]`. Each result is
/// bit-identical to the one [`matmul`] gives for that row and token.
///
/// # Panics
/// On an invalid row range, `x.len() != n_tokens * w.cols()` or a short `out`.
pub fn matmul_rows(
    pool: &ThreadPool,
    w: &Matrix,
    row_start: usize,
    row_end: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) {
    let acts = QuantizedActs::new(pool, w.dtype, x, n_tokens, w.cols);
    matmul_rows_q(pool, w, row_start, row_end, &acts, out);
}

/// [`matmul_rows`] with activations quantized beforehand (quantize once, use for many experts).
///
/// # Panics
/// If `acts` do not fit `w` (width or weight type, see [`QuantizedActs::fits`]), on an invalid
/// row range, or a short `out`.
pub fn matmul_rows_q(
    pool: &ThreadPool,
    w: &Matrix,
    row_start: usize,
    row_end: usize,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    matmul_rows_isa(isa(), pool, w, row_start, row_end, acts, out);
}

/// One matmul of a batch run by [`matmul_many`]: rows `row_start..row_end` of `w` times `acts`,
/// into `out[t*(row_end-row_start) + (r-row_start)]`.
pub struct MatmulJob<'a> {
    pub w: &'a Matrix,
    pub row_start: usize,
    pub row_end: usize,
    pub acts: &'a QuantizedActs,
    pub out: &'a mut [f32],
}

/// Runs several independent matmuls in one pool dispatch (e.g. the gate and up projections of
/// all selected experts), saving a synchronisation per matmul. Results are identical to running
/// each job with [`matmul_rows_q`].
///
/// # Panics
/// As [`matmul_rows_q`], for any job.
pub fn matmul_many(pool: &ThreadPool, jobs: &mut [MatmulJob<'_>]) {
    let isa = isa();
    let threads = pool.n_threads();
    // Tasks in proportion to each job's rows, so many small jobs do not mean many tiny tasks.
    let total_rows: usize = jobs
        .iter()
        .map(|j| j.row_end.saturating_sub(j.row_start))
        .sum();
    let plans: Vec<Plan<'_>> = jobs
        .iter_mut()
        .filter_map(|j| {
            let rows = j.row_end.saturating_sub(j.row_start);
            let target = (threads * 8 * rows).div_ceil(total_rows.max(1)).max(1);
            Plan::new(
                isa,
                threads,
                target,
                j.w,
                j.row_start,
                j.row_end,
                j.acts,
                j.out,
            )
        })
        .collect();
    let mut starts = Vec::with_capacity(plans.len());
    let mut total = 0;
    for p in &plans {
        starts.push(total);
        total += p.n_tasks();
    }
    pool.run(total, |task| {
        let i = starts.partition_point(|&s| s <= task) - 1;
        plans[i].run(task - starts[i]);
    });
}

pub(crate) fn matmul_rows_isa(
    isa: Isa,
    pool: &ThreadPool,
    w: &Matrix,
    row_start: usize,
    row_end: usize,
    acts: &QuantizedActs,
    out: &mut [f32],
) {
    let threads = pool.n_threads();
    // Several tasks per thread: balances uneven progress when other processes share the
    // cores, and bounds how long a preempted worker can hold back the others.
    let target = threads * 8;
    if let Some(plan) = Plan::new(isa, threads, target, w, row_start, row_end, acts, out) {
        pool.run(plan.n_tasks(), |task| plan.run(task));
    }
}

/// One matmul cut into tasks.
struct Plan<'a> {
    kernel: GroupFn,
    /// Two neighbouring groups at once, for 3 or more tokens, where the ISA has such a kernel.
    pair: Option<GroupFn>,
    w: &'a Matrix,
    acts: &'a QuantizedActs,
    out: SharedMut<f32>,
    row_start: usize,
    row_end: usize,
    /// Row groups `u0..u1`, `units_per_task` per task; tokens split likewise.
    u0: usize,
    u1: usize,
    units_per_task: usize,
    unit_tasks: usize,
    token_tasks: usize,
    tokens_per_task: usize,
}

impl<'a> Plan<'a> {
    /// Validates the call and cuts it into about `target` tasks; `None` when there is nothing
    /// to compute.
    #[allow(clippy::too_many_arguments)]
    fn new(
        isa: Isa,
        threads: usize,
        target: usize,
        w: &'a Matrix,
        row_start: usize,
        row_end: usize,
        acts: &'a QuantizedActs,
        out: &'a mut [f32],
    ) -> Option<Self> {
        assert!(
            row_start <= row_end && row_end <= w.rows,
            "bad row range {row_start}..{row_end} of {}",
            w.rows
        );
        assert!(
            acts.fits(w.dtype),
            "activations do not fit {} weights",
            w.dtype
        );
        assert_eq!(acts.cols, w.cols, "activation width != matrix cols");
        assert!(isa.available(), "{isa:?} is not available on this machine");
        let n_rows = row_end - row_start;
        let nt = acts.n_tokens;
        assert!(out.len() >= nt * n_rows, "output too short");
        if n_rows == 0 || nt == 0 {
            return None;
        }
        let kernel = kernel(isa, w.dtype);
        let pair = pair_kernel(isa, w.dtype);
        // Units: the interleaved groups of 16 rows the range touches.
        let (u0, u1) = (row_start / GROUP, row_end.div_ceil(GROUP));
        let n_units = u1 - u0;
        let units_per_task = n_units.div_ceil(target).max(1);
        let unit_tasks = n_units.div_ceil(units_per_task);
        // Few row units (a small matrix or row range) but many tokens: split the tokens too.
        let token_tasks = if threads > 1 && unit_tasks * 2 <= target && nt > 8 {
            (target / unit_tasks).min(nt.div_ceil(8)).max(1)
        } else {
            1
        };
        let tokens_per_task = nt.div_ceil(token_tasks);
        let token_tasks = nt.div_ceil(tokens_per_task);
        Some(Self {
            kernel,
            pair,
            w,
            acts,
            out: SharedMut::new(&mut out[..nt * n_rows]),
            row_start,
            row_end,
            u0,
            u1,
            units_per_task,
            unit_tasks,
            token_tasks,
            tokens_per_task,
        })
    }

    fn n_tasks(&self) -> usize {
        self.unit_tasks * self.token_tasks
    }

    fn run(&self, task: usize) {
        let Self {
            w,
            acts,
            ref out,
            row_start,
            row_end,
            ..
        } = *self;
        let n_rows = row_end - row_start;
        let nt = acts.n_tokens;
        let (ut, tt) = (task / self.token_tasks, task % self.token_tasks);
        let units = self.u0 + ut * self.units_per_task
            ..(self.u0 + (ut + 1) * self.units_per_task).min(self.u1);
        let tokens = tt * self.tokens_per_task..((tt + 1) * self.tokens_per_task).min(nt);
        let f = self.kernel;
        // Tokens per kernel call: kernels that unpack a group's weights before their token
        // loop (IQ2/IQ3) do it once per call, and so do the AVX2 float kernels that reorder
        // them (a copy of the group per call: a few percent of a 64-token call) and the x86
        // Q6_K tiles that sum the weights' offsets (3-4% of a dense prefill's samples at 64).
        const TCHUNK: usize = 64;
        let tchunk = match w.dtype {
            GgmlType::F16 | GgmlType::BF16 | GgmlType::F32 => 4 * TCHUNK,
            GgmlType::Q6K => 8 * TCHUNK,
            _ => TCHUNK,
        };
        // On the stack up to TCHUNK tokens (decode does not pay for a larger buffer, nor for
        // zeroing one: 4 KiB per task cost ~1% of a decode step in a profile).
        let mut tiny = [0f32; GROUP * 2];
        // Groups per kernel call at most: a pair kernel takes two.
        let per_call = if self.pair.is_some() { 2 } else { 1 };
        let mut small = Vec::new();
        let mut large = Vec::new();
        let buf: &mut [f32] = match tchunk.min(tokens.len()) {
            n if n <= 2 => &mut tiny,
            n if n <= TCHUNK => {
                small.resize(per_call * GROUP * TCHUNK, 0.0);
                &mut small
            }
            n => {
                large.resize(per_call * GROUP * n, 0.0);
                &mut large
            }
        };
        // Kernel `f` on `k` groups from `g` (1, or 2 for a pair kernel) for tokens t..t+n, its
        // output (`buf[(j*k + i)*16 + r]`) copied out.
        let mut call = |f: GroupFn, k: usize, g: usize, t: usize, n: usize| {
            let data = w.groups(g, k);
            // SAFETY: the ISA is available (checked in `new`); the kernel reads
            // `data` (k whole groups) and acts for tokens t..t+n, all in bounds.
            unsafe { f(data, acts, t, n, &mut buf[..k * n * GROUP]) };
            for i in 0..k {
                let gi = g + i;
                let rows = (gi * GROUP).max(row_start)..((gi + 1) * GROUP).min(row_end);
                let (r0, len) = (rows.start, rows.len());
                for j in 0..n {
                    // SAFETY: each (token, row) belongs to exactly one task.
                    let dst = unsafe { out.range((t + j) * n_rows + r0 - row_start, len) };
                    let src = &buf[(j * k + i) * GROUP + r0 - gi * GROUP..][..len];
                    if len == GROUP {
                        // A whole group: a fixed 64-byte copy, inlined (not a memmove call).
                        let d: &mut [f32; GROUP] = dst.try_into().expect("GROUP long");
                        *d = src.try_into().expect("GROUP long");
                    } else {
                        dst.copy_from_slice(src);
                    }
                }
            }
        };
        let chunks = (tokens.start..tokens.end)
            .step_by(tchunk)
            .map(|t| (t, (tokens.end - t).min(tchunk)));
        if matches!(w.dtype, GgmlType::F16 | GgmlType::BF16 | GgmlType::F32) {
            // Float prefill tiles stream a call's activations once per group (a 256-token
            // chunk of 3,072 columns: 3 MiB), so each chunk is taken by every group before the
            // next, where group by group the whole batch was read again for each group: past
            // what L3 keeps at 2,048 tokens. On a Zen 5 VM (examples/float_prefill, dense
            // bench layer, F16, 2 threads, CPU clock, alternated): 2,048 tokens AVX2 77-81 ->
            // 92-94 GFLOP/s a thread, AVX-512 112-115 -> 128-131; 512 tokens unchanged.
            for (t, n) in chunks {
                let mut g = units.start;
                while g < units.end {
                    match self.pair {
                        Some(pf) if n >= 3 && g + 1 < units.end => {
                            call(pf, 2, g, t, n);
                            g += 2;
                        }
                        _ => {
                            call(f, 1, g, t, n);
                            g += 1;
                        }
                    }
                }
            }
        } else {
            for g in units {
                for (t, n) in chunks.clone() {
                    call(f, 1, g, t, n);
                }
            }
        }
    }
}
