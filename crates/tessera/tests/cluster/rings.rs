//! Stage rings of one, two and three node processes, concurrent runs sharing a ring, and seeded
//! sampling across stages: tokens, boundary hidden states and printed text equal to one
//! process's.

use std::process::{Command, Stdio};

use crate::common::{
    bin, model, reference_boundaries, reference_tokens, report_of, run_with_timeout, tokens_of,
    traces_of,
};
use crate::{run_client, Cluster, TIMEOUT};
use tessera_model::{GgufFile, Tokenizer};

fn split_ends(split: &str) -> Vec<usize> {
    split
        .split(',')
        .map(|r| r.split_once("..").unwrap().1.parse().unwrap())
        .collect()
}

/// Clusters of one, two and three node processes on `model_name`, each running a ring of as
/// many stages: tokens equal to one process, every boundary's hidden state equal bit for bit,
/// and the printed text equal to `tessera generate`'s.
fn rings_match_one_process(model_name: &str, prompt_text: &str, splits: &[&str]) {
    let path = model(model_name);
    let g = GgufFile::open(&path).unwrap();
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let n = 12;
    let chunk = 3; // several prefill chunks, pipelined across stages
    let want = reference_tokens(&path, &prompt, n, chunk);
    let generated_text = run_with_timeout(
        {
            let mut cmd = Command::new(bin());
            cmd.args(["generate", "-m"])
                .arg(&path)
                .args([
                    "-p",
                    prompt_text,
                    "-n",
                    &n.to_string(),
                    "--temperature",
                    "0",
                    "-t",
                    "1",
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            cmd
        },
        TIMEOUT,
    );
    assert!(generated_text.status.success());
    let mut c = Cluster::start(&path);
    for (split, name) in splits.iter().zip(["a", "b", "c"]) {
        // One more node process for each split: 1, 2, 3 nodes, as many stages.
        c.add_node(name, &[]);
        assert_eq!(split.split(',').count(), c.nodes.len());
        let (out, msgs) = c.run_json(&[
            "-p",
            prompt_text,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
            "--split",
            split,
            "--trace",
            "--prefill-chunk",
            &chunk.to_string(),
        ]);
        assert!(
            out.status.success(),
            "{split}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let started = msgs.iter().find(|m| m["type"] == "started").unwrap();
        let sent: Vec<u32> = serde_json::from_value(started["prompt_tokens"].clone()).unwrap();
        assert_eq!(sent, prompt, "{split}: prompt tokens");
        assert_eq!(tokens_of(&msgs), want, "{model_name} split {split}: tokens");
        let got = traces_of(&msgs);
        let expected = reference_boundaries(&path, &prompt, &want, chunk, &split_ends(split));
        assert_eq!(got, expected, "{model_name} split {split}: boundary hashes");
        let report = report_of(&msgs);
        assert_eq!(report["generated"].as_u64().unwrap() as usize, want.len());

        // The plain text output is what `tessera generate` prints (default prefill chunks).
        let run = c.run(&[
            "-p",
            prompt_text,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
            "--split",
            split,
        ]);
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&generated_text.stdout),
            "{model_name} split {split}: text"
        );
    }
}

#[test]
fn stage_rings_of_1_2_3_nodes_match_one_process_on_stories260k() {
    rings_match_one_process(
        "stories260K.gguf",
        "Once upon a time, there was a little dog",
        &["0..5", "0..3,3..5", "0..1,1..3,3..5"],
    );
}

#[test]
fn stage_rings_of_1_2_3_nodes_match_one_process_on_synthetic_qwen3() {
    rings_match_one_process(
        "test/small-qwen3-Q8_0.gguf",
        "The quick brown fox jumps over the lazy dog",
        &["0..3", "0..1,1..3", "0..1,1..2,2..3"],
    );
}

#[test]
fn concurrent_runs_share_the_ring_and_each_matches_one_process() {
    let path = model("stories260K.gguf");
    let prompts = [
        "Once upon a time",
        "The cat sat",
        "Lily and Ben went to the park",
    ];
    let generate = |p: &str| {
        let out = run_with_timeout(
            {
                let mut cmd = Command::new(bin());
                cmd.args(["generate", "-t", "1", "-m"])
                    .arg(&path)
                    .args(["-p", p, "-n", "40", "--temperature", "0"])
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null());
                cmd
            },
            TIMEOUT,
        );
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let want: Vec<String> = prompts.iter().map(|p| generate(p)).collect();
    let mut c = Cluster::start(&path);
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    let (join, client_dir) = (c.operator.as_str(), c.dir.path().join("client"));
    let client_dir = client_dir.as_path();
    let got: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                scope.spawn(move || {
                    let out = run_client(
                        join,
                        client_dir,
                        &[
                            "-p",
                            p,
                            "-n",
                            "40",
                            "--temperature",
                            "0",
                            "--split",
                            "0..2,2..5",
                        ],
                    );
                    assert!(
                        out.status.success(),
                        "{}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                    String::from_utf8_lossy(&out.stdout).into_owned()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
}

#[test]
fn seeded_sampling_across_stages_matches_one_process() {
    let path = model("stories260K.gguf");
    let flags = [
        "-p",
        "Once upon a time",
        "-n",
        "24",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "--repeat-penalty",
        "1.1",
    ];
    let gen = run_with_timeout(
        {
            let mut cmd = Command::new(bin());
            cmd.args(["generate", "-t", "1", "-m"])
                .arg(&path)
                .args(flags)
                .stdout(Stdio::piped())
                .stderr(Stdio::null());
            cmd
        },
        TIMEOUT,
    );
    assert!(gen.status.success());
    let mut c = Cluster::start(&path);
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    let run = c.run(&[&flags[..], &["--split", "0..3,3..5"]].concat());
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&gen.stdout)
    );
}
