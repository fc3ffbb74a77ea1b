//! Expert split with nodes that do not have the model file: of the packed expert tensors
//! (`blk.N.ffn_{gate,up,down}_exps.weight`), each node receives only the chunks overlapping its
//! own experts' byte ranges, and the split still generates exactly what one process does.
//! In process: the engine loading a part of a model reads only its experts' bytes (everything
//! else of a copy of the model is poisoned, and the part computes the same).
//!
//! The test models' packed expert tensors are smaller than the default 1 MiB chunk, so the
//! coordinator here chunks its manifest at 16 KiB (`--chunk-size`): one expert slice of
//! small-qwen3moe-Q8_0 is 68 KiB, 4.25 chunks, so expert boundaries fall inside chunks.

mod common;

use std::ops::Range;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::{bin, ids, model, reference_tokens, report_of, tokens_of, ExpertCluster, Proc};
use tessera_engine::{ExpertSelection, ExpertStreaming, Hidden, LoadSpec, Model, Routing};
use tessera_model::{GgufFile, ModelConfig, Tokenizer};
use tessera_node::store::expert_needs;
use tessera_node::Manifest;
use tessera_proto::StageAssignment;

const TIMEOUT: Duration = Duration::from_secs(120);
const CHUNK: u32 = 16 << 10;

/// An [`ExpertCluster`] whose coordinator chunks its manifest at [`CHUNK`] bytes.
fn start_cluster(model_path: &Path, experts: &str) -> ExpertCluster {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(bin());
    cmd.arg("coordinator")
        .arg("--model")
        .arg(model_path)
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("coord"))
        .args(["--experts", experts])
        .args(["--chunk-size", &CHUNK.to_string()])
        .env(common::JSON_LOGS.0, common::JSON_LOGS.1);
    let mut coordinator = Proc::from_command("coordinator", cmd, TIMEOUT);
    let join = coordinator.announced("join_token", "token");
    let operator = coordinator.announced("operator_token", "token");
    ExpertCluster {
        dir,
        coordinator,
        join,
        operator,
        nodes: Vec::new(),
        timeout: TIMEOUT,
    }
}

/// The tensors a node's assignment names: a stage's (`layers`, with the embedding and head),
/// or for an expert-only node (`layers` empty) the packed expert tensors of every layer.
fn assignment_names(m: &Manifest, layers: Range<usize>, n_layer: usize) -> Vec<String> {
    if layers.is_empty() {
        return m
            .layer_tensor_names(0..n_layer as u32)
            .into_iter()
            .filter(|n| n.ends_with("_exps.weight"))
            .collect();
    }
    let a = StageAssignment {
        epoch: 0,
        model: m.model_hash,
        stage: 0,
        n_stages: 1,
        embed: layers.start == 0,
        head: layers.end == n_layer,
        layers,
        next: None,
        prev: None,
        max_context: 1,
        kv_type: Default::default(),
        expert_budget: None,
    };
    tessera_node::agent::stage_tensor_names(m, &a)
}

#[test]
fn expert_nodes_without_the_file_receive_only_their_experts_chunks() {
    let path = model("test/small-qwen3moe-Q8_0.gguf");
    let g = GgufFile::open(&path).unwrap();
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let (n_layer, n_expert) = (cfg.n_layer, cfg.n_expert);
    assert_eq!(n_expert, 8);
    // The home stage holds a non-contiguous set; `b` two adjacent experts (sharing a chunk).
    let groups: [(&str, Vec<usize>); 3] = [
        ("a", vec![0, 3, 5]),
        ("b", vec![1, 2]),
        ("c", vec![4, 6, 7]),
    ];
    let split: Vec<String> = groups
        .iter()
        .map(|(n, e)| format!("{}@{n}", ids(e)))
        .collect();

    let prompt_text = "Once upon a time, in a quiet village";
    let prompt = Tokenizer::from_gguf(&g).unwrap().encode(prompt_text, true);
    let (n, chunk) = (8, 4);
    let want = reference_tokens(&path, &prompt, n, chunk);

    let mut c = start_cluster(&path, &split.join(","));
    for (name, _) in &groups {
        c.add_node(name, &[]);
    }
    let msgs = c.run_json(
        &[("a", 0..n_layer)],
        &[
            "-p",
            prompt_text,
            "-n",
            &n.to_string(),
            "--temperature",
            "0",
            "--prefill-chunk",
            &chunk.to_string(),
        ],
    );
    assert_eq!(tokens_of(&msgs), want, "tokens");

    // What each node should have received, from the same manifest the coordinator serves.
    let m = Manifest::from_gguf_with(&path, CHUNK, &mut |_, _| {}).unwrap();
    let report = report_of(&msgs);
    let places = report["stages"].as_array().unwrap();
    assert_eq!(places.len(), groups.len(), "{report}");
    for place in places {
        let name = place["name"].as_str().unwrap();
        let (_, experts) = groups.iter().find(|(n, _)| *n == name).unwrap();
        let layers = match place["layers"].as_str().unwrap() {
            "0..0" => 0..0,
            _ => 0..n_layer,
        };
        let names = assignment_names(&m, layers, n_layer);
        let needs = expert_needs(&g, &names, &vec![experts.clone(); n_layer]).unwrap();
        // The chunks covering its experts, its other tensors and the header.
        let bound = m.bytes_for_needs(&needs).unwrap();
        // The same, with whole packed expert tensors (what nodes used to receive).
        let whole = m.bytes_for(&names).unwrap();
        // The exact bytes it needs: the header, its other tensors, its experts' slices.
        let exact: u64 = m.header.len
            + needs
                .iter()
                .map(|n| match &n.range {
                    Some(r) => r.end - r.start,
                    None => m.tensor(&n.tensor).unwrap().len,
                })
                .sum::<u64>();
        let got = place["load"]["bytes_transferred"].as_u64().unwrap();
        eprintln!(
            "node {name} (experts {experts:?}, layers {}): received {got} bytes; its bytes \
             {exact}, their chunks {bound}, with whole packed tensors {whole}",
            place["layers"]
        );
        assert!(got <= bound, "{name}: received {got} > {bound}");
        assert!(got >= exact, "{name}: received {got} < {exact}");
        assert!(got < whole, "{name}: received {got}, whole tensors {whole}");
        assert_eq!(place["load"]["bytes_already_present"].as_u64(), Some(0));
        assert!(needs.iter().any(|n| n.range.is_some()), "{needs:?}");
    }
}

/// Overwrites every byte of `bytes` outside `keep` (absolute ranges) with 0xFF: NaN scales and
/// values for the float and quantized types alike.
fn poison_outside(bytes: &mut [u8], mut keep: Vec<Range<u64>>) {
    keep.sort_by_key(|r| r.start);
    let mut pos = 0usize;
    for r in keep {
        bytes[pos..r.start as usize].fill(0xFF);
        pos = pos.max(r.end as usize);
    }
    bytes[pos..].fill(0xFF);
}

/// The expert outputs of `held` experts of `layer` for a few tokens routed only to them.
fn expert_outputs(m: &Model, layer: usize, held: &[usize], n_embd: usize) -> Vec<Option<Vec<f32>>> {
    let n_tokens = 4;
    let mut x = Hidden::zeros(n_tokens, n_embd);
    for (i, v) in x.data.iter_mut().enumerate() {
        *v = ((i * 37 % 101) as f32 - 50.0) / 40.0;
    }
    let k = 2;
    let mut experts = Vec::new();
    for t in 0..n_tokens {
        experts.push(held[t % held.len()] as u32);
        experts.push(held[(t + 1) % held.len()] as u32);
    }
    let routing = Routing {
        n_tokens,
        k,
        experts,
        weights: vec![0.5; n_tokens * k],
    };
    m.moe_experts(layer, &x, &routing, &|e| held.contains(&e))
        .unwrap()
        .slots
}

#[test]
fn the_engine_reads_only_the_held_experts_bytes() {
    for name in [
        "test/small-qwen3moe-Q8_0.gguf",
        "test/small-qwen3moe-Q4_K.gguf",
    ] {
        let path = model(name);
        let g = GgufFile::open(&path).unwrap();
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        let held_ids = vec![0, 3, 5];
        let held = vec![held_ids.clone(); cfg.n_layer];
        let exps: Vec<String> = g
            .tensors()
            .iter()
            .map(|t| t.name.clone())
            .filter(|n| n.ends_with("_exps.weight"))
            .collect();
        // Keep the header and the held experts' exact slices; poison everything else.
        let mut keep: Vec<Range<u64>> = Vec::new();
        keep.push(0..g.data_offset());
        for need in expert_needs(&g, &exps, &held).unwrap() {
            let t = g.tensor(&need.tensor).unwrap();
            let r = need.range.unwrap();
            keep.push(t.offset + r.start..t.offset + r.end);
        }
        let mut bytes = std::fs::read(&path).unwrap();
        poison_outside(&mut bytes, keep);
        let dir = tempfile::tempdir().unwrap();
        let poisoned = dir.path().join("poisoned.gguf");
        std::fs::write(&poisoned, &bytes).unwrap();
        let pg = GgufFile::open(&poisoned).unwrap();

        let spec = LoadSpec::experts_only(0..cfg.n_layer, ExpertSelection::PerLayer(held));
        let original = Model::load(&g, spec.clone(), 1, &mut |_, _| {}).unwrap();
        let loaded = Model::load(&pg, spec.clone(), 1, &mut |_, _| {}).unwrap();
        // Streamed from disk, a budget of about one expert per layer: every use reads it.
        let per_expert = 3 * g.tensor(&exps[0]).unwrap().n_bytes / cfg.n_expert as u64;
        let streamed = Model::load_streaming(
            &pg,
            spec,
            ExpertStreaming::with_budget(4 * per_expert),
            1,
            &mut |_, _| {},
        )
        .unwrap();
        for layer in 0..cfg.n_layer {
            let want = expert_outputs(&original, layer, &held_ids, cfg.n_embd);
            assert!(
                want.iter().flatten().flatten().all(|v| v.is_finite()),
                "{name}: layer {layer}"
            );
            for (what, m) in [("loaded", &loaded), ("streamed", &streamed)] {
                // Bit-identical: no poisoned byte was read.
                let got = expert_outputs(m, layer, &held_ids, cfg.n_embd);
                assert!(got == want, "{name}, {what}: layer {layer} differs");
            }
        }
    }
}
