//! Plain-text tables of a plan and its explanation, for `tessera plan`.

use crate::plan::{PlanOutcome, Summary, Terms};
use crate::resources::Source;
use std::fmt::Write;

fn table(out: &mut String, header: &[&str], rows: &[Vec<String>]) {
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |out: &mut String, cells: &[String]| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = w[i]))
            .collect();
        let _ = writeln!(out, "  {}", s.join("  ").trim_end());
    };
    line(
        out,
        &header.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
    );
    line(out, &w.iter().map(|&n| "-".repeat(n)).collect::<Vec<_>>());
    for r in rows {
        line(out, r);
    }
}

fn ms(s: f64) -> String {
    format!("{:.2}", s * 1e3)
}

fn terms_row(name: &str, t: &Terms) -> Vec<String> {
    vec![
        name.to_string(),
        ms(t.compute_s),
        ms(t.memory_s),
        ms(t.disk_s),
        ms(t.latency_s),
        ms(t.transfer_s),
        ms(t.total_s),
    ]
}

fn summary_row(s: &Summary) -> Vec<String> {
    vec![
        s.strategy.to_string(),
        format!("{:.2}", s.decode_tokens_per_s),
        format!("{:.2}", s.ttft_s),
        format!("{:.2}", s.throughput_tokens_per_s),
        format!("{:.2}", s.network_s_per_token * 1e3),
        s.binding.clone(),
        s.description.clone(),
    ]
}

/// Renders the plan, its predicted terms, the runners-up, the rejected candidates and the evidence.
pub fn render_text(o: &PlanOutcome) -> String {
    let p = &o.plan;
    let e = &o.explanation;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Plan for {} (epoch {}, hash {})",
        p.model,
        p.epoch,
        &p.hash[..16.min(p.hash.len())]
    );
    let _ = writeln!(out, "Chosen: {} — {}", p.strategy, e.chosen.description);
    let _ = writeln!(
        out,
        "Objective {:?}: decode {:.2} tok/s at batch 1, time to first token {:.2} s for {} prompt tokens, \
         {:.2} tok/s at {} concurrent requests ({:.2} each); bound by {}",
        e.objective,
        p.predicted.decode_tokens_per_s,
        p.predicted.ttft_s,
        p.predicted.prompt_tokens,
        p.predicted.throughput_tokens_per_s,
        p.predicted.concurrency,
        p.predicted.per_request_tokens_per_s(),
        p.predicted.decode.binding()
    );
    let _ = writeln!(out, "\nAssignments");
    let rows: Vec<Vec<String>> = p
        .cells
        .iter()
        .enumerate()
        .flat_map(|(i, c)| {
            c.assignments.iter().map(move |a| {
                vec![
                    i.to_string(),
                    a.node.clone(),
                    a.describe(),
                    a.memory.vram.to_string(),
                    a.memory.ram.to_string(),
                    a.memory.disk.to_string(),
                    format!("{} / {}", a.memory.total, a.memory.budget),
                ]
            })
        })
        .collect();
    table(
        &mut out,
        &[
            "cell",
            "node",
            "holds",
            "VRAM",
            "RAM",
            "disk",
            "memory / budget",
        ],
        &rows,
    );

    let _ = writeln!(
        out,
        "\nPredicted decode step (ms per token; per tier the larger of compute and memory binds)"
    );
    let mut rows: Vec<Vec<String>> = p
        .predicted
        .stages
        .iter()
        .map(|s| terms_row(&format!("{} ({})", s.node, s.part), &s.terms))
        .collect();
    for h in &p.predicted.hops {
        rows.push(terms_row(
            &format!("{} -> {} (x{})", h.from, h.to, h.per_token),
            &h.terms,
        ));
    }
    rows.push(terms_row("total", &p.predicted.decode));
    table(
        &mut out,
        &[
            "where", "compute", "memory", "disk", "latency", "transfer", "total",
        ],
        &rows,
    );

    if !e.alternatives.is_empty() {
        let _ = writeln!(out, "\nRunners-up");
        let rows: Vec<Vec<String>> = e.alternatives.iter().map(summary_row).collect();
        table(
            &mut out,
            &[
                "strategy",
                "decode tok/s",
                "ttft s",
                "agg tok/s",
                "hops ms",
                "bound by",
                "plan",
            ],
            &rows,
        );
    }
    if !e.rejected.is_empty() {
        let _ = writeln!(out, "\nRejected");
        for r in &e.rejected {
            let _ = writeln!(out, "  - [{}] {}", r.strategy, r.reason);
        }
    }
    if !e.notes.is_empty() {
        let _ = writeln!(out, "\nNotes");
        for n in &e.notes {
            let _ = writeln!(out, "  - {n}");
        }
    }
    let _ = writeln!(out, "\nEvidence");
    let rows: Vec<Vec<String>> = p
        .evidence
        .iter()
        .map(|ev| {
            let src = match &ev.source {
                Source::Estimate { .. } => "estimate (profile)".to_string(),
                Source::Declared => "declared (cluster file)".to_string(),
                Source::Measured { at_unix_s, method } => {
                    format!("measured at {at_unix_s} ({method})")
                }
            };
            vec![
                ev.subject.clone(),
                ev.quantity.clone(),
                ev.value.clone(),
                src,
            ]
        })
        .collect();
    table(&mut out, &["subject", "quantity", "value", "source"], &rows);
    out
}
