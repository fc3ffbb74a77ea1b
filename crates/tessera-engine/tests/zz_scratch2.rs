mod common;
use serde_json::Value;
use tessera_engine::moe::{ExpertExecutor, ExpertOutputs, Routing};
use tessera_engine::ops::log_softmax;
use tessera_engine::{Hidden, Model, SeqStep};

struct Alt<'a> {
    m: &'a Model,
    target: Option<(usize, usize, usize, usize)>, // layer,row,slot,rank
}
impl ExpertExecutor for Alt<'_> {
    fn run(&mut self, layer: usize, normed: &Hidden, routing: &Routing) -> tessera_engine::Result<Vec<ExpertOutputs>> {
        let mut r = routing.clone();
        if let Some((l, row, slot, rank)) = self.target {
            if l == layer && (slot == 7 || slot == 8) {
                let ne = self.m.config().n_expert;
                let probs = self.m.moe_probs_scratch(layer, normed);
                let k = r.k;
                for s in 0..k { let e = r.experts[row*k+s] as usize; r.weights[row*k+s] = if slot == 7 { probs[row*ne+e] } else if s == 0 { 1.0 } else { 0.0 }; }
            }
            if l == layer && slot < 7 {
                let ne = self.m.config().n_expert;
                let probs = self.m.moe_probs_scratch(layer, normed);
                let p = &probs[row * ne..(row + 1) * ne];
                let mut order: Vec<usize> = (0..ne).collect();
                order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
                let k = r.k;
                r.experts[row * k + slot] = order[rank] as u32;
                let sel: Vec<usize> = (0..k).map(|s| r.experts[row * k + s] as usize).collect();
                let sum = sel.iter().map(|&e| p[e] as f64).sum::<f64>() as f32;
                for s in 0..k {
                    r.weights[row * k + s] = p[sel[s]] / sum;
                }
            }
        }
        let mut o = self.m.moe_experts(layer, normed, &r, &|_| true)?;
        if let Some((l, row, 9, eps)) = self.target { if l == layer { for s in 0..2 { if let Some(v) = &mut o.slots[row*2+s] { for x in v.iter_mut() { *x *= 1.0 + eps as f32 * 1e-7; } } } } }
        Ok(vec![o])
    }
}

#[test]
fn scratch_swap_search() {
    let name = "small-qwen3moe-Q8_0";
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(common::repo_root().join(format!("reference/{name}-public.json"))).unwrap()).unwrap();
    let g = common::open(doc["model"].as_str().unwrap());
    let model = common::full(&g, 2);
    let cfg = model.config().clone();
    let r = &doc["results"][1];
    let ids = |v: &Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    let prompt = ids(&r["prompt_token_ids"]);
    let gen = ids(&r["generated_token_ids"]);
    let mut all = prompt.clone();
    all.extend_from_slice(&gen[..gen.len() - 1]);
    let eval = |target, all: &Vec<u32>| {
        let mut kv = common::kv_for(&model);
        let mut h = model.embed(all).unwrap();
        let mut ex = Alt { m: &model, target };
        model.run_layers(0..cfg.n_layer, &mut h, &[SeqStep { n_tokens: all.len(), start_pos: 0 }], &mut [&mut kv], &mut ex).unwrap();
        let logits = model.head(&h).unwrap();
        let mut next = 0;
        let mut w = 0.0f64;
        for pos in r["top5"].as_array().unwrap() {
            let chosen = pos["chosen_id"].as_u64().unwrap() as u32;
            let off = gen[next..].iter().position(|&t| t == chosen).unwrap();
            let i = next + off;
            next = i + 1;
            let lp = log_softmax(logits.row(prompt.len() - 1 + i));
            for x in pos["top5"].as_array().unwrap() {
                let id = x["id"].as_u64().unwrap() as usize;
                w = w.max((lp[id] - x["logprob"].as_f64().unwrap()).abs());
            }
        }
        w
    };
    println!("baseline {:e}", eval(None, &all));
    for l in 0..0 { for row in 5..=11 { for eps in [1usize, 10, 100] { println!("perturb layer {l} row {row} eps {eps}e-7: {:e}", eval(Some((l,row,9,eps)), &all)); } } }
    for p in 9..=8 { for tok in 0..cfg.vocab_size as u32 { let mut a2 = all.clone(); a2[p] = tok; let w = eval(None, &a2); if w < 0.02 { println!("pos {p} tok {tok}: {w:e}"); } } }
    for l in 0..cfg.n_layer {
        for row in 9..=11 {
            for v in [7usize, 8] { println!("variant {v} layer {l} row {row}: {:e}", eval(Some((l, row, v, 0)), &all)); }
            for slot in 0..2 {
                for rank in 2..8 {
                    let w = eval(Some((l, row, slot, rank)), &all);
                    if w < 0.06 { println!("layer {l} row {row} slot {slot} rank {rank}: {w:e}"); }
                }
            }
        }
    }
}
