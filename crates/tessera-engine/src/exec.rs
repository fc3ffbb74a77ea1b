//! Running several matmuls as one parallel job.
//!
//! At decode time each matmul is small (one token), so issuing them one by one would pay the
//! thread pool's start/finish cost many times per layer. [`run_matmuls`] cuts every job into
//! chunks of rows and runs all chunks of all jobs in one pool job. Results are bit-identical to
//! separate `matmul` calls (the kernels compute each row the same way for any row range).

use crate::kernels::{matmul_rows_q, Matrix, QuantizedActs, ThreadPool};

/// Rows per task when jobs are fused (a multiple of the kernels' 16-row groups).
const CHUNK_ROWS: usize = 64;
/// Jobs with at most this many tokens are fused; larger ones have enough work on their own.
const FUSE_MAX_TOKENS: usize = 4;

/// One matmul: `out[t*w.rows() + r] = w.row(r) · acts[t]`.
pub struct MatmulJob<'a> {
    pub w: &'a Matrix,
    pub acts: &'a QuantizedActs,
    pub out: &'a mut [f32],
}

/// A `&mut [f32]` written by pool tasks at disjoint places.
struct SharedOut(*mut f32, usize);
// SAFETY: tasks write disjoint elements; the borrow outlives the pool job.
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

/// Runs every job; see the module doc.
pub fn run_matmuls(pool: &ThreadPool, jobs: &mut [MatmulJob<'_>]) {
    let fuse = pool.n_threads() > 1
        && jobs.len() > 1
        && jobs.iter().all(|j| j.acts.n_tokens() <= FUSE_MAX_TOKENS);
    if !fuse {
        for j in jobs.iter_mut() {
            matmul_rows_q(pool, j.w, 0, j.w.rows(), j.acts, j.out);
        }
        return;
    }
    // Split each job into (weights, activations) read by every task and an output pointer that
    // tasks write at disjoint places, so no `&mut` is shared.
    let mut tasks = Vec::new();
    let mut specs = Vec::with_capacity(jobs.len());
    let mut outs = Vec::with_capacity(jobs.len());
    for (ji, j) in jobs.iter_mut().enumerate() {
        let (rows, nt) = (j.w.rows(), j.acts.n_tokens());
        assert!(j.out.len() >= rows * nt, "output too short");
        specs.push((j.w, j.acts));
        outs.push(SharedOut(j.out.as_mut_ptr(), j.out.len()));
        let mut r = 0;
        while r < rows {
            let e = (r + CHUNK_ROWS).min(rows);
            tasks.push((ji, r, e));
            r = e;
        }
    }
    pool.run(tasks.len(), |i| {
        let (ji, r0, r1) = tasks[i];
        let (w, acts) = specs[ji];
        let (rows, nt) = (w.rows(), acts.n_tokens());
        let mut tmp = [0.0f32; CHUNK_ROWS * FUSE_MAX_TOKENS];
        let n = r1 - r0;
        // Nested use of the pool runs inline on this thread.
        matmul_rows_q(pool, w, r0, r1, acts, &mut tmp[..n * nt]);
        for t in 0..nt {
            // SAFETY: rows r0..r1 of token t belong to this task only.
            let dst = unsafe { outs[ji].slice(t * rows + r0, n) };
            dst.copy_from_slice(&tmp[t * n..(t + 1) * n]);
        }
    });
}

/// Quantizes `x` once for `w`'s type and multiplies (convenience for a single matmul).
pub fn matmul_once(pool: &ThreadPool, w: &Matrix, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let acts = QuantizedActs::new(pool, w.dtype(), x, n_tokens, w.cols());
    matmul_rows_q(pool, w, 0, w.rows(), &acts, out);
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
