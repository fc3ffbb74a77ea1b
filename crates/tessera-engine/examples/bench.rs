//! `cargo run --release -p tessera-engine --example bench -- MODEL.gguf [threads] [n_prompt] [n_gen]`
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .expect("usage: bench MODEL.gguf [threads] [n_prompt] [n_gen]");
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |s| s.parse().expect("a number"));
    let r = tessera_engine::bench::bench(path.as_ref(), arg(2, 2), arg(3, 64), arg(4, 64))
        .unwrap_or_else(|e| panic!("{e}"));
    println!("{r}");
}
