//! `cargo run --release -p tessera-engine --example bench -- MODEL.gguf [threads] [n_prompt]
//! [n_gen] [depth] [kv_type] [repetitions]`: the measurement of `tessera bench` without building
//! the CLI's network stack.
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args.get(1).expect(
        "usage: bench MODEL.gguf [threads] [n_prompt] [n_gen] [depth] [kv_type] [repetitions]",
    );
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let mut config = tessera_engine::bench::BenchConfig::new(arg(2, 2), arg(3, 64), arg(4, 64));
    config.depth = arg(5, 0);
    if let Some(t) = args.get(6) {
        config.kv_type = t.parse().unwrap_or_else(|e| panic!("{e}"));
    }
    config.repetitions = arg(7, tessera_engine::bench::REPEATS);
    let r = tessera_engine::bench::bench_config(path.as_ref(), &config)
        .unwrap_or_else(|e| panic!("{e}"));
    println!("{r}");
}
