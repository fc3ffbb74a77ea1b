//! Guards the single-sequence generator: greedy output equals the reference, and it stops at
//! end-of-generation ids, at max tokens, and when the callback says so.

mod common;

use tessera_engine::{Generator, StopReason};
use tessera_sampling::SamplingParams;

#[test]
fn generator_stops_where_it_should() {
    let g = common::open("stories260K.gguf");
    let m = common::full(&g, 2);
    let prompt = [1u32, 403, 407, 261, 378];
    let run = |max: usize, eog: &[u32], stop_after: usize| {
        let mut gen = Generator::new(&m, SamplingParams::greedy(), 512);
        gen.prefill_chunk = 2;
        let mut got = Vec::new();
        let stats = gen
            .generate(&prompt, max, eog, &mut |t| {
                got.push(t);
                got.len() < stop_after
            })
            .unwrap();
        (got, stats)
    };
    let (all, stats) = run(12, &[], usize::MAX);
    assert_eq!((all.len(), stats.stop), (12, StopReason::Length));
    assert_eq!(stats.prompt_tokens, prompt.len());
    // Stopping at an end-of-generation id: the id is not emitted.
    let (got, stats) = run(12, &[all[3]], usize::MAX);
    assert_eq!(stats.stop, StopReason::EndOfGeneration);
    assert_eq!(
        got,
        all[..all.iter().position(|&t| t == all[3]).unwrap()].to_vec()
    );
    let (got, stats) = run(12, &[], 5);
    assert_eq!((got, stats.stop), (all[..5].to_vec(), StopReason::Callback));
}
