//! Running a command under a deadline, reading a client's JSON messages, and the greedy tokens
//! of one process.

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_engine::{Generator, Model, SamplingParams};
use tessera_model::{GgufFile, Tokenizer};

/// Runs `cmd` to the end; panics (with its stderr) if it takes longer than `timeout`.
pub fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Output {
    let mut child = cmd.spawn().expect("spawning");
    let deadline = Instant::now() + timeout;
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("timed out: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn tokens_of(msgs: &[Value]) -> Vec<u32> {
    msgs.iter()
        .filter(|m| m["type"] == "token" && m["token"].as_u64() != Some(u64::from(u32::MAX)))
        .map(|m| m["token"].as_u64().unwrap() as u32)
        .collect()
}

pub fn report_of(msgs: &[Value]) -> &Value {
    msgs.iter()
        .find(|m| m["type"] == "done")
        .unwrap_or_else(|| panic!("no report in {msgs:?}"))
}

/// Greedy tokens of one process, as `tessera generate` computes them.
pub fn reference_tokens(path: &Path, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let g = GgufFile::open(path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let mut eog: Vec<u32> = (0..tok.vocab_size() as u32)
        .filter(|&t| tok.is_end_of_generation(t))
        .collect();
    eog.extend(tok.bos_id());
    let m = Model::load_full(&g, 1).unwrap();
    let mut gen = Generator::new(&m, SamplingParams::greedy(), prompt.len() + n);
    gen.prefill_chunk = chunk;
    let mut out = Vec::new();
    gen.generate(prompt, n, &eog, &mut |t| {
        out.push(t);
        true
    })
    .unwrap();
    out
}
