mod common;
use serde_json::Value;
use tessera_engine::moe::{ExpertExecutor, ExpertOutputs, LocalExperts, Routing};
use tessera_engine::{Hidden, SeqStep};
use tessera_engine::ops::log_softmax;

struct Rec<'a>(LocalExperts<'a>, Vec<(usize, Hidden)>);
impl ExpertExecutor for Rec<'_> {
    fn run(&mut self, layer: usize, normed: &Hidden, routing: &Routing) -> tessera_engine::Result<Vec<ExpertOutputs>> {
        self.1.push((layer, normed.clone()));
        self.0.run(layer, normed, routing)
    }
}

#[test]
fn scratch_router_ties() {
    let name = std::env::var("SCRATCH_MODEL").unwrap_or("small-qwen3moe-Q8_0".into());
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(common::repo_root().join(format!("reference/{name}-public.json"))).unwrap()).unwrap();
    let g = common::open(doc["model"].as_str().unwrap());
    let model = common::full(&g, 2);
    let cfg = model.config().clone();
    for (ri, r) in doc["results"].as_array().unwrap().iter().enumerate() {
        let ids = |v: &Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
        let prompt = ids(&r["prompt_token_ids"]);
        let gen = ids(&r["generated_token_ids"]);
        let mut all = prompt.clone();
        all.extend_from_slice(&gen[..gen.len() - 1]);
        let mut kv = common::kv_for(&model);
        let mut h = model.embed(&all).unwrap();
        let mut rec = Rec(LocalExperts(&model), vec![]);
        model.run_layers(0..cfg.n_layer, &mut h, &[SeqStep { n_tokens: all.len(), start_pos: 0 }], &mut [&mut kv], &mut rec).unwrap();
        let logits = model.head(&h).unwrap();
        // per-position worst diff
        let mut next = 0;
        let mut worst_pos = vec![];
        for pos in r["top5"].as_array().unwrap() {
            let chosen = pos["chosen_id"].as_u64().unwrap() as u32;
            let off = gen[next..].iter().position(|&t| t == chosen).unwrap();
            let i = next + off; next = i + 1;
            let lp = log_softmax(logits.row(prompt.len() - 1 + i));
            let mut w = 0.0f64;
            for x in pos["top5"].as_array().unwrap() {
                let id = x["id"].as_u64().unwrap() as usize;
                w = w.max((lp[id] - x["logprob"].as_f64().unwrap()).abs());
            }
            worst_pos.push((prompt.len() - 1 + i, w));
        }
        let first_bad = worst_pos.iter().find(|x| x.1 > 0.005).copied();
        println!("prompt {ri}: len {} first bad row {:?}", prompt.len(), first_bad); if true { for x in &worst_pos { print!("{}:{:.1e} ", x.0, x.1); } println!(); }
        // near ties at router
        for (layer, normed) in &rec.1 {
            let mut logits = vec![0f32; normed.n_tokens * cfg.n_expert];
            let w = model.weights(); let _ = w;
            let routing = model.moe_route(*layer, normed).unwrap();
            let _ = &mut logits;
            // recompute probs via softmax of router: use moe_route's weights only; look at gaps using full probs
            let probs = model.moe_probs_scratch(*layer, normed);
            for t in 0..normed.n_tokens {
                let mut p: Vec<f32> = probs[t * cfg.n_expert..(t + 1) * cfg.n_expert].to_vec();
                p.sort_by(|a, b| b.total_cmp(a));
                let gap = p[cfg.n_expert_used - 1] - p[cfg.n_expert_used];
                if gap < 1e-3 {
                    println!("   layer {layer} row {t}: gap k/k+1 {gap:e} sel {:?} p {:?}", &routing.experts[t*routing.k..(t+1)*routing.k], &p[..4]);
                }
            }
        }
    }
}
