//! What the kernel benches share: a deterministic generator, random but valid GGML weight
//! bytes, and CPU clocks (on a shared machine a CPU clock counts what this process ran, not the
//! time others held the cores). Each example uses part of it.
#![allow(dead_code)]

use tessera_model::GgmlType;

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Random valid GGML bytes: quant bytes random, scales small finite f16.
pub fn random_bytes(dtype: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols / dtype.block_size() * dtype.block_bytes();
    let mut v = vec![0u8; n];
    for c in v.chunks_mut(8) {
        let r = rng.next().to_le_bytes();
        c.copy_from_slice(&r[..c.len()]);
    }
    let small_f16 = |r: u64| (0x2000u16 | (r as u16 & 0x03ff)).to_le_bytes(); // ~0.008
    let bb = dtype.block_bytes();
    for b in v.chunks_exact_mut(bb) {
        match dtype {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
                b[..2].copy_from_slice(&small_f16(rng.next()))
            }
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q4_1 | GgmlType::Q5_1 => {
                b[..2].copy_from_slice(&small_f16(rng.next()));
                b[2..4].copy_from_slice(&small_f16(rng.next()));
            }
            GgmlType::Q6K => b[208..].copy_from_slice(&small_f16(rng.next())),
            GgmlType::Mxfp4 => b[0] = 118 + (rng.next() % 8) as u8,
            GgmlType::Iq4Nl
            | GgmlType::Iq4Xs
            | GgmlType::Iq2Xxs
            | GgmlType::Iq2Xs
            | GgmlType::Iq2S
            | GgmlType::Iq3Xxs
            | GgmlType::Iq3S => b[..2].copy_from_slice(&small_f16(rng.next())),
            GgmlType::Q2K => {
                b[80..82].copy_from_slice(&small_f16(rng.next()));
                b[82..84].copy_from_slice(&small_f16(rng.next()));
            }
            GgmlType::Q3K => b[108..110].copy_from_slice(&small_f16(rng.next())),
            GgmlType::F16 => {
                b.copy_from_slice(&(0x3000u16 | (rng.next() as u16 & 0x83ff)).to_le_bytes())
            }
            GgmlType::BF16 => {
                b.copy_from_slice(&(0x3e00u16 | (rng.next() as u16 & 0x807f)).to_le_bytes())
            }
            GgmlType::F32 => {
                b.copy_from_slice(&((rng.next() as f32 / u64::MAX as f32) - 0.5).to_le_bytes())
            }
        }
    }
    v
}

/// CPU seconds of `clock` (`libc::CLOCK_THREAD_CPUTIME_ID`: the calling thread's;
/// `libc::CLOCK_PROCESS_CPUTIME_ID`: every thread's).
pub fn cpu_seconds(clock: libc::clockid_t) -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a valid timespec to write into.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}
