//! `cargo run --release -p tessera-engine --example prefill_cpu -- MODEL.gguf [threads]
//! [n_prompt] [runs]`: the process CPU time of each prefill of `n_prompt` tokens (one model
//! load, then `runs` prefills from an empty cache), as its least and median. On a shared machine
//! CPU time moves less than wall time with what else runs, so two builds compare by running
//! this alternately; `tessera bench` stays the measure of speed.

use std::time::Instant;

/// User + system CPU seconds of this process so far.
fn process_cpu() -> f64 {
    // SAFETY: a zeroed rusage is valid, and getrusage only writes it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid `who` and out pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: prefill_cpu MODEL.gguf [threads] [n_prompt] [runs]");
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let (threads, n_prompt, runs) = (arg(2, 1), arg(3, 512), arg(4, 5));
    let g = tessera_model::GgufFile::open(path).expect("a GGUF file");
    let model = tessera_engine::Model::load_full(&g, threads).expect("a model");
    let vocab = model.config().vocab_size as u64;
    let prompt: Vec<u32> = (0..n_prompt as u64)
        .map(|i| (tessera_sampling::splitmix64((2 << 40) + i) % vocab) as u32)
        .collect();
    let mut kv = model.new_kv(n_prompt);
    // Warm up: every weight touched once, the allocator's buffers grown.
    model.forward_last(&prompt, &mut kv).expect("a prefill");
    let (mut cpu, mut wall) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        kv.truncate(0);
        let (c, t) = (process_cpu(), Instant::now());
        model.forward_last(&prompt, &mut kv).expect("a prefill");
        cpu.push(process_cpu() - c);
        wall.push(t.elapsed().as_secs_f64());
    }
    cpu.sort_by(f64::total_cmp);
    wall.sort_by(f64::total_cmp);
    println!(
        "prefill {n_prompt} x{runs}, {threads} thread(s): CPU ms least {:.0} median {:.0}; \
         wall ms least {:.0}",
        cpu[0] * 1e3,
        cpu[runs / 2] * 1e3,
        wall[0] * 1e3
    );
}
