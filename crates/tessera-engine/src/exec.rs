//! Running several matmuls as one parallel job.
//!
//! At decode time each matmul is small (one token), so issuing them one by one would pay the
//! thread pool's start/finish cost many times per layer. [`run_matmuls`] runs all jobs as one
//! pool job ([`matmul_many`]: a few large tasks per thread, in proportion to each job's rows;
//! many small tasks cost more in claiming and in cold memory streams than they gain in balance).
//! Results are bit-identical to separate `matmul` calls (the kernels compute each row the same
//! way for any row range).

use crate::kernels::{
    self, matmul_many, matmul_rows_q, Matrix, QuantizedActs, SharedMut, ThreadPool, WORTH_SHARING,
};

/// One matmul: `out[t*w.rows() + r] = w.row(r) · acts[t]`.
pub struct MatmulJob<'a> {
    pub w: &'a Matrix,
    pub acts: &'a QuantizedActs,
    pub out: &'a mut [f32],
}

/// Runs every job; see the module doc.
pub fn run_matmuls(pool: &ThreadPool, jobs: &mut [MatmulJob<'_>]) {
    if let [j] = jobs {
        matmul_rows_q(pool, j.w, 0, j.w.rows(), j.acts, j.out);
        return;
    }
    let mut many: Vec<kernels::MatmulJob<'_>> = jobs
        .iter_mut()
        .map(|j| kernels::MatmulJob {
            w: j.w,
            row_start: 0,
            row_end: j.w.rows(),
            acts: j.acts,
            out: &mut *j.out,
        })
        .collect();
    matmul_many(pool, &mut many);
}

/// Quantizes `x` once for `w`'s type and multiplies (convenience for a single matmul).
pub fn matmul_once(pool: &ThreadPool, w: &Matrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let acts = QuantizedActs::new(pool, w.dtype(), x, n_tokens, w.cols());
    matmul_rows_q(pool, w, 0, w.rows(), &acts, out);
}

/// Runs `f(first_row, rows)` over runs of whole `width`-float rows of `data` that together
/// cover it once: one run per pool thread when there is enough to share (a prompt's
/// per-token norms and rotations), else one run on this thread. Row-wise work gives the same
/// bits however the rows are split.
pub fn par_rows(
    pool: &ThreadPool,
    data: &mut [f32],
    width: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    assert!(width > 0 && data.len().is_multiple_of(width));
    let n = data.len() / width;
    let tasks = if data.len() >= WORTH_SHARING {
        pool.n_threads().min(n)
    } else {
        1
    };
    if tasks <= 1 {
        return f(0, data);
    }
    let shared = SharedMut::new(data);
    pool.run(tasks, |task| {
        let (r0, r1) = (n * task / tasks, n * (task + 1) / tasks);
        // SAFETY: the tasks' row ranges are disjoint.
        let rows = unsafe { shared.range(r0 * width, (r1 - r0) * width) };
        f(r0, rows)
    });
}

/// `x` quantized once for each distinct activation kind the weight types `dtypes` consume.
pub fn quantize_for(
    pool: &ThreadPool,
    dtypes: &[tessera_model::GgmlType],
    x: &[f32],
    n_tokens: usize,
    cols: usize,
) -> Vec<QuantizedActs> {
    let mut set: Vec<QuantizedActs> = Vec::with_capacity(1);
    for &d in dtypes {
        if !set.iter().any(|a| a.fits(d)) {
            set.push(QuantizedActs::new(pool, d, x, n_tokens, cols));
        }
    }
    set
}

/// The activations in `set` that fit weights of `dtype`.
///
/// # Panics
/// If none does (the set was built without `dtype`).
pub fn pick(set: &[QuantizedActs], dtype: tessera_model::GgmlType) -> &QuantizedActs {
    set.iter()
        .find(|a| a.fits(dtype))
        .expect("activations quantized for this weight type")
}
