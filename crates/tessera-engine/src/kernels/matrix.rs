//! Weight matrices: validation, and the row-interleaved repack of Q4_0/Q8_0.
//!
//! Every type is repacked at load into groups of 16 rows, so that one vector load holds data
//! of 16 rows and each i32/f32 lane accumulates one row (no horizontal sums, and the same
//! per-row arithmetic whatever the batch). Float types store each column's 16 values together.
//!
//! F16 and BF16 also store their columns in the order the x86 kernels read them
//! ([`float_column`]): `scalar::float_row`'s lane chains (F16: lane `L` takes the columns
//! `L, 16 + L, 32 + L, 48 + L` of every 64; BF16 columns `2L + 1` and `2L`) are read four
//! lanes at a time over every 64-column block, so the columns of those four lanes in each
//! block (a "chunk": 16 F16 columns, 8 BF16, 512 and 256 bytes), each lane's side by side, are
//! stored together, block after block, then the next four lanes' ([`float_lane_order`]). A
//! decode pass then streams one run of memory, the whole group is read front to back, and a
//! prefill quarter's lanes are a quarter of the group's bytes, read in place. F32 keeps column
//! order (its AVX-512 decode sweeps every lane at once in column order).
//!
//! Q4_0/Q8_0: rows are taken in groups of [`GROUP`] (the last group padded
//! with zero rows). For each group and each 32-column block we store the 16 rows' f16 scales
//! (32 bytes), then the quant bytes in chunks of 4 per row: chunk `k` holds bytes `4k..4k+4` of
//! every row's block, row after row (64 bytes). One 64-byte load then gives 4 bytes of each of
//! 16 rows, which a broadcast activation word multiplies with `vpdpbusd`/`pmaddubsw` directly
//! into one i32 lane per row — no horizontal sums, and scales for 16 rows in one convert.
//!
//! Q4_K is interleaved the same way per 256-column block (2368 bytes): 16 f16 `d`, 16 f16
//! `dmin`, the decoded 6-bit scales `[sub-block][row]` (128 bytes) and mins (128 bytes), then
//! for each 32-byte chunk `c` of the quants, 8 runs of 4 bytes × 16 rows (512 bytes).
//! Q5_K is Q4_K's layout plus its `qh` bytes as 8 runs × 16 rows (512 bytes) before the quants.
//! Q6_K likewise ([`Q6K_X16`] bytes, exactly 16 GGML blocks): 16 f16 `d`, the i8 scales
//! `[sub-block][row]` (256 bytes), then for each half `n` and 4-byte column `l4` the ql runs at
//! bytes `64n+4l4` and `64n+32+4l4` and the qh run at `32n+4l4`, each for the 16 rows (64 bytes),
//! in the order the kernels read them.

use std::sync::Arc;

use tessera_model::GgmlType;

use super::scalar::{
    dequantize_block, f16_at, float_kind, q1_codes, scales_mins_k4, FLOAT_BF16, FLOAT_F16,
    FLOAT_F32,
};
use super::weight_buffer::{WeightArena, WeightBuffer};
use super::KernelError;

/// Rows per interleaved group.
pub(crate) const GROUP: usize = 16;
/// Offsets inside an interleaved Q4_K / Q5_K block of 16 rows.
pub(crate) const Q4K_DMIN: usize = 32;
pub(crate) const Q4K_SCALES: usize = 64;
pub(crate) const Q4K_MINS: usize = 192;
pub(crate) const Q5K_QH: usize = 320;

/// Q4_1 / Q5_1 are held widened, per 32-column block of 16 rows ([`Q1_X16`] bytes): the 16
/// f16 `d`, the 16 f16 `m` (at [`Q1_MIN`]), then the codes (0..31, one byte each, at
/// [`Q1_QS`]) as 8 runs of 4 × 16 rows like Q8_0's, so `pmaddubsw`/`vpdpbusd` take them as
/// unsigned bytes directly.
pub(crate) const Q1_X16: usize = GROUP * 36;
pub(crate) const Q1_MIN: usize = 32;
pub(crate) const Q1_QS: usize = 64;

/// Offset of the quants in an interleaved Q4_K (`five` = false) or Q5_K block.
pub(crate) const fn kx16_qs(five: bool) -> usize {
    if five {
        Q5K_QH + 512
    } else {
        Q5K_QH
    }
}

/// Bytes of an interleaved Q4_K (`five` = false) or Q5_K block of 16 rows.
pub(crate) const fn kx16_bytes(five: bool) -> usize {
    kx16_qs(five) + 2048
}
/// Bytes of one interleaved Q6_K block of 16 rows, and offsets inside it.
pub(crate) const Q6K_X16: usize = 16 * 210;
pub(crate) const Q6K_SCALES: usize = 32;
pub(crate) const Q6K_QS: usize = 288;

/// Offset of the (ql run A, ql run B, qh run) triple the kernels read together for half `n`
/// and 4-byte column `l4` of a Q6_K block: stored in that order so the stream is sequential.
pub(crate) const fn q6k_runs(n: usize, l4: usize) -> usize {
    Q6K_QS + 192 * (8 * n + l4)
}

/// The bytes a [`Matrix`] is built from.
#[derive(Clone)]
pub enum MatrixBytes {
    Owned(Vec<u8>),
    /// A range of a shared read-only buffer, e.g. an `Arc<memmap2::Mmap>` of the GGUF file.
    Shared {
        bytes: Arc<dyn AsRef<[u8]> + Send + Sync>,
        offset: usize,
        len: usize,
    },
}

impl MatrixBytes {
    /// The bytes, or `None` if a `Shared` range lies outside its buffer.
    fn get(&self) -> Option<&[u8]> {
        match self {
            Self::Owned(v) => Some(v),
            Self::Shared { bytes, offset, len } => {
                let all = (**bytes).as_ref();
                all.get(*offset..offset.checked_add(*len)?)
            }
        }
    }
}

impl std::fmt::Debug for MatrixBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Owned(v) => write!(f, "Owned({} bytes)", v.len()),
            Self::Shared { offset, len, .. } => write!(f, "Shared({len} bytes at {offset})"),
        }
    }
}

/// A weight matrix ready for [`matmul`](super::matmul()).
#[derive(Debug)]
pub struct Matrix {
    pub(crate) dtype: GgmlType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Row-interleaved groups of [`GROUP`] rows (layouts above), owned (in a slab shared with
    /// the model's other matrices where it was built by [`Matrix::new_in_arena`]).
    data: WeightBuffer,
}

impl Matrix {
    /// `bytes` are GGML row-major rows of `dtype`, `rows` × `cols`. They are repacked into an
    /// owned row-interleaved copy (the layouts above) and `bytes` is dropped, so a shared
    /// mapping can be released once every matrix is built.
    pub fn new(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        bytes: MatrixBytes,
    ) -> Result<Self, KernelError> {
        Self::build(dtype, rows, cols, bytes, WeightBuffer::from(Vec::new()))
    }

    /// [`Matrix::new`] building into `buf` (e.g. a range of an expert store's slot pool that an
    /// evicted expert gave back): a streamed expert's build then writes to memory already
    /// faulted in, on huge pages, instead of fresh 4 KiB pages.
    pub(crate) fn new_in(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        bytes: MatrixBytes,
        buf: WeightBuffer,
    ) -> Result<Self, KernelError> {
        Self::build(dtype, rows, cols, bytes, buf)
    }

    /// [`Matrix::new`] building into memory from `arena`: a model's matrices share its
    /// huge-page slabs (`weight_buffer`), which decode streams faster than 4 KiB pages.
    pub(crate) fn new_in_arena(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        bytes: MatrixBytes,
        arena: &mut WeightArena,
    ) -> Result<Self, KernelError> {
        // An invalid shape is refused by `build` before anything is taken from the arena.
        let buf = match Self::packed_len(dtype, rows, cols) {
            Some(len) => arena.take(len),
            None => WeightBuffer::from(Vec::new()),
        };
        Self::build(dtype, rows, cols, bytes, buf)
    }

    fn build(
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        bytes: MatrixBytes,
        buf: WeightBuffer,
    ) -> Result<Self, KernelError> {
        let bs = dtype.block_size();
        if cols == 0 || !cols.is_multiple_of(bs) {
            return Err(KernelError::BadCols {
                dtype,
                cols,
                block: bs,
            });
        }
        // Activations are quantized in blocks of 256 for K-quants (already implied) and 32 for
        // Q4_0/Q8_0 (implied); float types accept any width.
        let expected = (cols / bs)
            .checked_mul(dtype.block_bytes())
            .and_then(|r| r.checked_mul(rows))
            .ok_or(KernelError::TooLarge { rows, cols })?;
        let Some(src) = bytes.get() else {
            return Err(KernelError::BadRange);
        };
        if src.len() != expected {
            return Err(KernelError::BadLength {
                dtype,
                rows,
                cols,
                expected,
                got: src.len(),
            });
        }
        let (dtype, data) = match dtype {
            // Q5_0 is widened to Q8_0 (exact: a 5-bit code minus 16 fits an i8 under the same
            // scale) and runs Q8_0's kernels, whose float steps are those of ggml's Q5_0
            // `vec_dot` (per block `d·dy` times 8 lanes of 4 products, summed as
            // `hsum_float_8`). It is a fallback type for a few small matrices, so the wider
            // copy costs little.
            GgmlType::Q5_0 => {
                let q8 = widen_q5_0(src);
                let q8 = interleave(GgmlType::Q8_0, &q8, rows, cols, buf);
                (GgmlType::Q8_0, q8)
            }
            _ => (dtype, Self::repack(dtype, src, rows, cols, buf)),
        };
        Ok(Self {
            dtype,
            rows,
            cols,
            data,
        })
    }

    /// The row-interleaved copy of `src` (the layouts above); not for Q5_0 (widened first).
    fn repack(
        dtype: GgmlType,
        src: &[u8],
        rows: usize,
        cols: usize,
        buf: WeightBuffer,
    ) -> WeightBuffer {
        match dtype {
            GgmlType::Q4_0 | GgmlType::Q8_0 => interleave(dtype, src, rows, cols, buf),
            GgmlType::Q5_0 => unreachable!("Q5_0 is widened to Q8_0 before the repack"),
            GgmlType::Q4_1 => interleave_q1(false, src, rows, cols, buf),
            GgmlType::Q5_1 => interleave_q1(true, src, rows, cols, buf),
            GgmlType::Q4K => interleave_q45k(src, rows, cols, false, buf),
            GgmlType::Q5K => interleave_q45k(src, rows, cols, true, buf),
            GgmlType::Q6K => interleave_q6k(src, rows, cols, buf),
            GgmlType::Iq4Xs => super::iq4xs::interleave(src, rows, cols, buf),
            GgmlType::Q2K => super::k23::interleave(false, src, rows, cols, buf),
            GgmlType::Q3K => super::k23::interleave(true, src, rows, cols, buf),
            GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => super::iq23::interleave(dtype, src, rows, cols, buf),
            GgmlType::Mxfp4 | GgmlType::Iq4Nl => {
                super::lut4::interleave(super::lut4::is_nl(dtype), src, rows, cols, buf)
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                interleave_float(dtype, src, rows, cols, buf)
            }
        }
    }

    /// Bytes the repacked copy of a `rows` × `cols` matrix of `dtype` takes (what
    /// [`Matrix::resident_bytes`] will report once built), without building it; `None` when the
    /// shape is not valid for the type. Lets a cache budget experts before reading them.
    pub fn packed_len(dtype: GgmlType, rows: usize, cols: usize) -> Option<usize> {
        let bs = dtype.block_size();
        if cols == 0 || !cols.is_multiple_of(bs) {
            return None;
        }
        let groups = rows.div_ceil(GROUP);
        let per_group = match dtype {
            GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Mxfp4 | GgmlType::Iq4Nl => {
                (cols / 32).checked_mul(GROUP * dtype.block_bytes())
            }
            // Widened to Q8_0 at load.
            GgmlType::Q5_0 => (cols / 32).checked_mul(GROUP * GgmlType::Q8_0.block_bytes()),
            GgmlType::Q4_1 | GgmlType::Q5_1 => (cols / 32).checked_mul(Q1_X16),
            GgmlType::Q4K => (cols / 256).checked_mul(kx16_bytes(false)),
            GgmlType::Q5K => (cols / 256).checked_mul(kx16_bytes(true)),
            GgmlType::Q6K => (cols / 256).checked_mul(Q6K_X16),
            GgmlType::Iq4Xs => (cols / 256).checked_mul(super::iq4xs::X16),
            GgmlType::Q2K => (cols / 256).checked_mul(super::k23::x16(false)),
            GgmlType::Q3K => (cols / 256).checked_mul(super::k23::x16(true)),
            GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => {
                (cols / 256).checked_mul(super::iq23::Layout::for_dtype(dtype).x16())
            }
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                cols.checked_mul(GROUP * dtype.block_bytes())
            }
        }?;
        groups.checked_mul(per_group)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn dtype(&self) -> GgmlType {
        self.dtype
    }

    /// Bytes this matrix keeps alive (its repacked copy, padding rows included).
    pub fn resident_bytes(&self) -> usize {
        self.data.len()
    }

    /// Bytes of its allocation (at least [`Matrix::resident_bytes`]: a matrix built into a
    /// reused, larger buffer keeps all of it).
    pub(crate) fn allocated_bytes(&self) -> usize {
        self.data.capacity()
    }

    /// Bytes of one GGML row.
    pub(crate) fn row_bytes(&self) -> usize {
        self.cols / self.dtype.block_size() * self.dtype.block_bytes()
    }

    /// Bytes of interleaved group `g`.
    pub(crate) fn group(&self, g: usize) -> &[u8] {
        let gb = match self.dtype {
            GgmlType::Q4_1 | GgmlType::Q5_1 => self.cols / 32 * Q1_X16,
            GgmlType::Q4K => self.cols / 256 * kx16_bytes(false),
            GgmlType::Q5K => self.cols / 256 * kx16_bytes(true),
            GgmlType::Q6K => self.cols / 256 * Q6K_X16,
            GgmlType::Iq4Xs => self.cols / 256 * super::iq4xs::X16,
            GgmlType::Q2K => self.cols / 256 * super::k23::x16(false),
            GgmlType::Q3K => self.cols / 256 * super::k23::x16(true),
            GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => self.cols / 256 * super::iq23::Layout::for_dtype(self.dtype).x16(),
            _ => self.row_bytes() * GROUP,
        };
        &self.data[g * gb..(g + 1) * gb]
    }

    /// The bytes of `k` neighbouring groups from `g` (a group's bytes are [`Self::group`]'s).
    pub(crate) fn groups(&self, g: usize, k: usize) -> &[u8] {
        let gb = self.group(0).len();
        &self.data[g * gb..(g + k) * gb]
    }

    /// Dequantizes one row into `out[..cols]` (embedding lookup).
    ///
    /// # Panics
    /// If `row >= rows` or `out.len() < cols`.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows, "row {row} out of {}", self.rows);
        let out = &mut out[..self.cols];
        let (g, r) = (row / GROUP, row % GROUP);
        let data = self.group(g);
        match self.dtype {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
                let es = self.dtype.block_bytes();
                let (k, np) = (float_kind(self.dtype), self.cols / 64 * 64);
                for (i, y) in out.iter_mut().enumerate() {
                    let o = (float_column(k, i, np) * GROUP + r) * es;
                    dequantize_block(self.dtype, &data[o..o + es], std::slice::from_mut(y));
                }
            }
            GgmlType::Q4K | GgmlType::Q5K => {
                let five = self.dtype == GgmlType::Q5K;
                let (x16, qs) = (kx16_bytes(five), kx16_qs(five));
                for (b, y) in out.chunks_exact_mut(256).enumerate() {
                    let blk = &data[b * x16..(b + 1) * x16];
                    let (d, dmin) = (f16_at(blk, 2 * r), f16_at(blk, Q4K_DMIN + 2 * r));
                    for c in 0..4 {
                        // Same float ops as the GGML-layout decoder, so identical values.
                        let sub = |j: usize| {
                            let sc = blk[Q4K_SCALES + 16 * j + r];
                            let m = blk[Q4K_MINS + 16 * j + r];
                            (d * sc as f32, dmin * m as f32)
                        };
                        let ((d1, m1), (d2, m2)) = (sub(2 * c), sub(2 * c + 1));
                        for l in 0..32 {
                            let o = 64 * (l / 4) + 4 * r + l % 4;
                            let q = blk[qs + 512 * c + o];
                            let (mut lo, mut hi) = (q & 0xF, q >> 4);
                            if five {
                                let h = blk[Q5K_QH + o];
                                lo |= ((h >> (2 * c)) & 1) << 4;
                                hi |= ((h >> (2 * c + 1)) & 1) << 4;
                            }
                            y[64 * c + l] = d1 * lo as f32 - m1;
                            y[64 * c + 32 + l] = d2 * hi as f32 - m2;
                        }
                    }
                }
            }
            GgmlType::Q6K => {
                for (b, y) in out.chunks_exact_mut(256).enumerate() {
                    let blk = &data[b * Q6K_X16..(b + 1) * Q6K_X16];
                    let d = f16_at(blk, 2 * r);
                    for (e, y) in y.iter_mut().enumerate() {
                        let sc = blk[Q6K_SCALES + 16 * (e / 16) + r] as i8;
                        // Same float ops as the GGML-layout decoder, so identical values.
                        *y = d * sc as f32 * (q6k_x16_quant(blk, r, e) - 32) as f32;
                    }
                }
            }
            GgmlType::Q2K | GgmlType::Q3K => {
                let three = self.dtype == GgmlType::Q3K;
                let x16 = super::k23::x16(three);
                for (b, y) in out.chunks_exact_mut(256).enumerate() {
                    let blk = &data[b * x16..(b + 1) * x16];
                    for (e, y) in y.iter_mut().enumerate() {
                        *y = super::k23::x16_value(three, blk, r, e);
                    }
                }
            }
            GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => {
                let x16 = super::iq23::Layout::for_dtype(self.dtype).x16();
                for (b, y) in out.chunks_exact_mut(256).enumerate() {
                    let blk = &data[b * x16..(b + 1) * x16];
                    for (e, y) in y.iter_mut().enumerate() {
                        *y = super::iq23::x16_value(self.dtype, blk, r, e);
                    }
                }
            }
            GgmlType::Iq4Xs => {
                let x16 = super::iq4xs::X16;
                for (b, y) in out.chunks_exact_mut(256).enumerate() {
                    let blk = &data[b * x16..(b + 1) * x16];
                    for (e, y) in y.iter_mut().enumerate() {
                        *y = super::iq4xs::x16_value(blk, r, e);
                    }
                }
            }
            GgmlType::Mxfp4 | GgmlType::Iq4Nl => {
                let nl = super::lut4::is_nl(self.dtype);
                let x16 = super::lut4::x16(nl);
                for (b, y) in out.chunks_exact_mut(32).enumerate() {
                    let blk = &data[b * x16..(b + 1) * x16];
                    for (e, y) in y.iter_mut().enumerate() {
                        *y = super::lut4::x16_value(nl, blk, r, e);
                    }
                }
            }
            GgmlType::Q5_0 => unreachable!("a Q5_0 matrix is held as Q8_0"),
            GgmlType::Q4_1 | GgmlType::Q5_1 => {
                for (b, y) in out.chunks_exact_mut(32).enumerate() {
                    let blk = &data[b * Q1_X16..(b + 1) * Q1_X16];
                    let (d, m) = (f16_at(blk, 2 * r), f16_at(blk, Q1_MIN + 2 * r));
                    for (e, y) in y.iter_mut().enumerate() {
                        let q = blk[Q1_QS + 64 * (e / 4) + 4 * r + e % 4];
                        // Same float ops as the GGML-layout decoder, so identical values.
                        *y = q as f32 * d + m;
                    }
                }
            }
            GgmlType::Q4_0 | GgmlType::Q8_0 => {
                let bb = self.dtype.block_bytes();
                let qb = bb - 2;
                let mut blk = [0u8; 34];
                for (b, y) in out.chunks_exact_mut(32).enumerate() {
                    let src = &data[b * GROUP * bb..(b + 1) * GROUP * bb];
                    blk[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
                    for k in 0..qb / 4 {
                        let o = 2 * GROUP + 64 * k + 4 * r;
                        blk[2 + 4 * k..6 + 4 * k].copy_from_slice(&src[o..o + 4]);
                    }
                    dequantize_block(self.dtype, &blk[..bb], y);
                }
            }
        }
    }
}

/// GGML Q5_0 blocks (f16 `d`, 32 high bits, 16 bytes of nibbles: element `j < 16` is the low
/// nibble of byte `j` with bit `j`, element `16 + j` the high nibble with bit `16 + j`) as the
/// Q8_0 blocks of the same values: the same `d`, the codes minus 16 as i8.
fn widen_q5_0(src: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() / 22 * 34);
    for b in src.chunks_exact(22) {
        out.extend_from_slice(&b[..2]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let code = |j: usize, nib: u8| ((nib | (((qh >> j) & 1) as u8) << 4) as i8 - 16) as u8;
        out.extend((0..16).map(|j| code(j, b[6 + j] & 0xF)));
        out.extend((0..16).map(|j| code(16 + j, b[6 + j] >> 4)));
    }
    out
}

/// Repacks GGML Q4_1 (`five` = false) / Q5_1 rows into the widened layout of [`Q1_X16`].
fn interleave_q1(
    five: bool,
    src: &[u8],
    rows: usize,
    cols: usize,
    buf: WeightBuffer,
) -> WeightBuffer {
    let bb = if five { 24 } else { 20 };
    let nb = cols / 32;
    let row_bytes = nb * bb;
    assert!(
        src.len() >= rows * row_bytes,
        "source shorter than its shape"
    );
    // Padding rows stay zero: d = m = 0 contributes nothing.
    let mut out = buf.zeroed(rows.div_ceil(GROUP) * nb * Q1_X16);
    for (g, gdst) in out.chunks_exact_mut(nb * Q1_X16).enumerate() {
        for r in 0..GROUP.min(rows - g * GROUP) {
            let row = &src[(g * GROUP + r) * row_bytes..][..row_bytes];
            for (s, dst) in row.chunks_exact(bb).zip(gdst.chunks_exact_mut(Q1_X16)) {
                dst[2 * r..2 * r + 2].copy_from_slice(&s[..2]);
                dst[Q1_MIN + 2 * r..Q1_MIN + 2 * r + 2].copy_from_slice(&s[2..4]);
                let codes = q1_codes(five, s);
                for (k, c) in codes.chunks_exact(4).enumerate() {
                    let o = Q1_QS + 64 * k + 4 * r;
                    dst[o..o + 4].copy_from_slice(c);
                }
            }
        }
    }
    out
}

/// Repacks GGML Q4_0/Q8_0 rows into the interleaved group layout described above.
fn interleave(
    dtype: GgmlType,
    src: &[u8],
    rows: usize,
    cols: usize,
    buf: WeightBuffer,
) -> WeightBuffer {
    match dtype {
        GgmlType::Q4_0 => interleave_q0::<18>(src, rows, cols, buf),
        _ => interleave_q0::<34>(src, rows, cols, buf),
    }
}

/// [`interleave`] for blocks of `BB` bytes (an f16 scale, then the quants).
///
/// This runs on the critical path when experts are streamed from disk (every miss is repacked
/// before use), so it writes the destination in order, one 16-row block at a time, through
/// fixed-size arrays: the moves compile to plain loads and stores without bounds checks (a
/// `copy_from_slice` of a run-time length is a `memcpy` call per 4 bytes, twice as slow).
fn interleave_q0<const BB: usize>(
    src: &[u8],
    rows: usize,
    cols: usize,
    buf: WeightBuffer,
) -> WeightBuffer {
    let runs = (BB - 2) / 4;
    let nb = cols / 32;
    let row_bytes = nb * BB;
    let groups = rows.div_ceil(GROUP);
    let group_bytes = nb * GROUP * BB;
    assert!(
        src.len() >= rows * row_bytes,
        "source shorter than its shape"
    );
    // Padding rows (a last group of fewer than 16) stay zero: scale 0 contributes nothing.
    let mut out = buf.zeroed(groups * group_bytes);
    for (g, gdst) in out.chunks_exact_mut(group_bytes).enumerate() {
        let n_rows = GROUP.min(rows - g * GROUP);
        let gsrc = &src[g * GROUP * row_bytes..(g * GROUP + n_rows) * row_bytes];
        for (b, dst) in gdst.chunks_exact_mut(GROUP * BB).enumerate() {
            let (scales, quants) = dst.split_at_mut(2 * GROUP);
            let scales: &mut [u8; 2 * GROUP] = scales.try_into().expect("scales");
            for r in 0..n_rows {
                let s: &[u8; BB] = gsrc[r * row_bytes + b * BB..][..BB]
                    .try_into()
                    .expect("block");
                scales[2 * r] = s[0];
                scales[2 * r + 1] = s[1];
                for (k, run) in quants.chunks_exact_mut(64).take(runs).enumerate() {
                    let run: &mut [u8; 64] = run.try_into().expect("run");
                    for i in 0..4 {
                        run[4 * r + i] = s[2 + 4 * k + i];
                    }
                }
            }
        }
    }
    out
}

/// Repacks GGML Q4_K / Q5_K rows into the interleaved layout described above.
fn interleave_q45k(
    src: &[u8],
    rows: usize,
    cols: usize,
    five: bool,
    buf: WeightBuffer,
) -> WeightBuffer {
    let nb = cols / 256;
    let (x16, qs) = (kx16_bytes(five), kx16_qs(five));
    let bb = if five { 176 } else { 144 };
    let groups = rows.div_ceil(GROUP);
    let mut out = buf.zeroed(groups * nb * x16);
    for (g, gdst) in out.chunks_exact_mut(nb * x16).enumerate() {
        for (b, dst) in gdst.chunks_exact_mut(x16).enumerate() {
            for r in 0..GROUP {
                let row = g * GROUP + r;
                if row >= rows {
                    break; // padding rows stay zero: d = dmin = 0
                }
                let s = &src[(row * nb + b) * bb..(row * nb + b + 1) * bb];
                dst[2 * r..2 * r + 2].copy_from_slice(&s[0..2]);
                dst[Q4K_DMIN + 2 * r..Q4K_DMIN + 2 * r + 2].copy_from_slice(&s[2..4]);
                let (sc, m) = scales_mins_k4(&s[4..16]);
                for j in 0..8 {
                    dst[Q4K_SCALES + 16 * j + r] = sc[j];
                    dst[Q4K_MINS + 16 * j + r] = m[j];
                }
                let (sh, sq) = if five {
                    (&s[16..48], &s[48..])
                } else {
                    (&s[0..0], &s[16..])
                };
                for k in 0..8 {
                    if five {
                        let o = Q5K_QH + 64 * k + 4 * r;
                        dst[o..o + 4].copy_from_slice(&sh[4 * k..4 * k + 4]);
                    }
                    for c in 0..4 {
                        let o = qs + 512 * c + 64 * k + 4 * r;
                        dst[o..o + 4].copy_from_slice(&sq[32 * c + 4 * k..32 * c + 4 * k + 4]);
                    }
                }
            }
        }
    }
    out
}

/// The unsigned 6-bit quant (0..64) of element `e` of row `r` in an interleaved Q6_K block.
pub(crate) fn q6k_x16_quant(blk: &[u8], r: usize, e: usize) -> i32 {
    let (n, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let (l4, i) = (l / 4, l % 4);
    // ql byte l of half n holds elements l (low nibble) and l+64 (high); byte l+32 holds l+32
    // and l+96; qh byte l holds the top 2 bits of all four, 2 bits each.
    let base = q6k_runs(n, l4) + 4 * r + i;
    let ql = blk[base + 64 * (k % 2)];
    let qh = blk[base + 128];
    let lo = if k < 2 { ql & 0xF } else { ql >> 4 };
    (lo | (((qh >> (2 * k)) & 3) << 4)) as i32
}

/// Repacks GGML Q6_K rows into the interleaved layout described above.
fn interleave_q6k(src: &[u8], rows: usize, cols: usize, buf: WeightBuffer) -> WeightBuffer {
    let nb = cols / 256;
    let groups = rows.div_ceil(GROUP);
    let mut out = buf.zeroed(groups * nb * Q6K_X16);
    for (g, gdst) in out.chunks_exact_mut(nb * Q6K_X16).enumerate() {
        for (b, dst) in gdst.chunks_exact_mut(Q6K_X16).enumerate() {
            for r in 0..GROUP {
                let row = g * GROUP + r;
                if row >= rows {
                    break; // padding rows stay zero: d = 0
                }
                let s = &src[(row * nb + b) * 210..(row * nb + b + 1) * 210];
                dst[2 * r..2 * r + 2].copy_from_slice(&s[208..210]);
                for j in 0..16 {
                    dst[Q6K_SCALES + 16 * j + r] = s[192 + j];
                }
                for n in 0..2 {
                    for l4 in 0..8 {
                        let o = q6k_runs(n, l4) + 4 * r;
                        let (a, h) = (64 * n + 4 * l4, 128 + 32 * n + 4 * l4);
                        dst[o..o + 4].copy_from_slice(&s[a..a + 4]);
                        dst[o + 64..o + 68].copy_from_slice(&s[a + 32..a + 36]);
                        dst[o + 128..o + 132].copy_from_slice(&s[h..h + 4]);
                    }
                }
            }
        }
    }
    out
}

/// Columns of each 64-column block that one of `scalar::float_row`'s lanes takes, for a float
/// group of kind `k`: F32 1 (lane `L`: `L`), F16 4 (`L, 16 + L, 32 + L, 48 + L`), BF16 2
/// (`2L + 1`, then `2L`). A row has `64 / float_lane_cols(k)` lanes.
pub(crate) const fn float_lane_cols(k: u8) -> usize {
    match k {
        FLOAT_F16 => 4,
        FLOAT_BF16 => 2,
        _ => 1,
    }
}

/// Columns per chunk of a float group of kind `k` (`scalar::FLOAT_*`; [`float_column`]): four
/// lanes' columns of a block, F16 16, BF16 8 (512 and 256 bytes); F32 0, kept in column order.
pub(crate) const fn float_chunk(k: u8) -> usize {
    match k {
        FLOAT_F16 | FLOAT_BF16 => 4 * float_lane_cols(k),
        _ => 0,
    }
}

/// `scalar::float_row`'s lanes (F32 64, F16 16, BF16 32) in the order the x86 kernels visit
/// them, `reduce16`'s tree quarter by quarter: for quarter `q` and `i` in `q, q + 8, q + 4,
/// q + 12`, F32 lanes `i, 32 + i, 16 + i, 48 + i`, F16 lane `i`, BF16 lanes `i, 16 + i`. Each
/// four in a row are a chunk of the stored group ([`float_column`]) and a decode pass; each
/// quarter of the order is a prefill quarter.
pub(crate) const fn float_lane_order(k: u8) -> [u8; 64] {
    let mut o = [0u8; 64];
    let mut at = 0;
    let mut q = 0;
    while q < 4 {
        let offs = [0, 8, 4, 12];
        let mut j = 0;
        while j < 4 {
            let i = (q + offs[j]) as u8;
            if k == FLOAT_BF16 {
                o[at] = i;
                o[at + 1] = 16 + i;
                at += 2;
            } else if k == FLOAT_F16 {
                o[at] = i;
                at += 1;
            } else {
                o[at] = i;
                o[at + 1] = 32 + i;
                o[at + 2] = 16 + i;
                o[at + 3] = 48 + i;
                at += 4;
            }
            j += 1;
        }
        q += 1;
    }
    o
}

/// Where lane `l` sits in [`float_lane_order`] of kind `k`.
#[inline(always)]
pub(crate) fn float_lane_position(k: u8, l: usize) -> usize {
    const fn inverse(o: [u8; 64], n: usize) -> [u8; 64] {
        let mut p = [0u8; 64];
        let mut i = 0;
        while i < n {
            p[o[i] as usize] = i as u8;
            i += 1;
        }
        p
    }
    const F32: [u8; 64] = inverse(float_lane_order(FLOAT_F32), 64);
    const F16: [u8; 64] = inverse(float_lane_order(FLOAT_F16), 16);
    const BF16: [u8; 64] = inverse(float_lane_order(FLOAT_BF16), 32);
    (match k {
        FLOAT_F16 => F16[l],
        FLOAT_BF16 => BF16[l],
        _ => F32[l],
    }) as usize
}

/// Where an F16/BF16 group with `nb` whole 64-column blocks stores the first column of the lane
/// at position `pos` of [`float_lane_order`] ([`float_column`]): its first column in block `b`
/// is `b` chunks on, its others of the block ([`float_lane_cols`]) beside it.
#[inline(always)]
pub(crate) fn float_lane_start(k: u8, pos: usize, nb: usize) -> usize {
    let chunk = float_chunk(k);
    pos / 4 * nb * chunk + pos % 4 * float_lane_cols(k)
}

/// Where a float group of kind `k` stores its column `e` (in columns from the group's start),
/// `np` being its columns in whole 64s. Within those, chunk `c` holds the columns of the lanes at
/// positions `4c..4c + 4` of [`float_lane_order`] of every 64-column block, each lane's in its
/// order (F16: `L, 16 + L, 32 + L, 48 + L`; BF16: `2L + 1`, then `2L`), block after block;
/// chunk `c + 1` follows. Columns past `np`, and every F32 column, stay in place.
#[inline(always)]
pub(crate) fn float_column(k: u8, e: usize, np: usize) -> usize {
    let chunk = float_chunk(k);
    if chunk == 0 || e >= np {
        return e;
    }
    let c = e % 64;
    // The lane that takes column c, and which of its columns of the block c is.
    let (lane, nth) = if k == FLOAT_BF16 {
        (c / 2, c.is_multiple_of(2) as usize)
    } else {
        (c % 16, c / 16)
    };
    float_lane_start(k, float_lane_position(k, lane), np / 64) + e / 64 * chunk + nth
}

/// Float weights: for each column, the 16 rows' values side by side (16 × `es` bytes), so one
/// load feeds 16 row accumulators with a broadcast activation; the columns where
/// [`float_column`] puts them.
fn interleave_float(
    dtype: GgmlType,
    src: &[u8],
    rows: usize,
    cols: usize,
    buf: WeightBuffer,
) -> WeightBuffer {
    let es = dtype.block_bytes();
    let (k, np) = (float_kind(dtype), cols / 64 * 64);
    let groups = rows.div_ceil(GROUP);
    let mut out = buf.zeroed(groups * cols * GROUP * es);
    for (g, gdst) in out.chunks_exact_mut(cols * GROUP * es).enumerate() {
        for r in 0..GROUP.min(rows - g * GROUP) {
            let row = &src[(g * GROUP + r) * cols * es..(g * GROUP + r + 1) * cols * es];
            for (i, v) in row.chunks_exact(es).enumerate() {
                let at = float_column(k, i, np) * GROUP + r;
                gdst[at * es..(at + 1) * es].copy_from_slice(v);
            }
        }
    }
    out
}
