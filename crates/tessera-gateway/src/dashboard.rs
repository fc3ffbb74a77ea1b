//! The web dashboard: one HTML page, a stylesheet and a small script, all compiled into the
//! binary (`include_str!`), no CDN and no build step.
//!
//! The server renders the page with its current state already in it (every node, the plan,
//! the numbers), so it reads correctly without JavaScript and in a headless browser's first
//! DOM. `/api/status/stream` then pushes an update every second over server-sent events: the
//! raw numbers as JSON, plus the node, plan and request sections as HTML fragments rendered by
//! the same Rust functions — one renderer, no drift between first paint and live updates.
//! Everything here is read-only and public; the API key guards `/v1` only.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::header;
use axum::response::sse::Event as SseEvent;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use tessera_model::human_bytes;

use crate::metrics::GatewaySnapshot;
use crate::server::Gateway;
use tessera_api::{Assignment, ClusterStatus, Health, NodeStatus, PlanShape, PlanStatus};

const INDEX: &str = include_str!("../assets/index.html");
const STYLE: &str = include_str!("../assets/style.css");
const SCRIPT: &str = include_str!("../assets/app.js");

/// `/api/status`: everything the dashboard shows.
#[derive(Clone, Debug, Serialize)]
pub struct StatusReport {
    pub model: String,
    pub context_length: usize,
    pub auth_required: bool,
    pub cluster: ClusterStatus,
    pub gateway: GatewaySnapshot,
}

/// A status update as the page consumes it: numbers plus rendered sections.
#[derive(Clone, Debug, Serialize)]
struct Update {
    status: StatusReport,
    html: Sections,
}

#[derive(Clone, Debug, Serialize)]
struct Sections {
    nodes: String,
    plan: String,
    requests: String,
    kpis: String,
}

pub(crate) fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/", get(index))
        .route("/assets/style.css", get(style))
        .route("/assets/app.js", get(script))
        .route("/api/status", get(status))
        .route("/api/status/stream", get(status_stream))
}

fn report(gw: &Gateway) -> StatusReport {
    let m = gw.backend.model();
    StatusReport {
        model: m.id.clone(),
        context_length: m.context_length,
        auth_required: !gw.config.api_keys.is_empty(),
        cluster: worded(gw.backend.status()),
        gateway: gw.metrics.snapshot(),
    }
}

/// The status with its plan worded: a backend that reports the plan's [`PlanShape`] (the
/// coordinator) leaves `strategy` and `explanation` to this, so the sentences are written in
/// one place, next to the page that shows them.
pub fn worded(mut c: ClusterStatus) -> ClusterStatus {
    if let Some(p) = &mut c.plan {
        if let Some(shape) = &p.shape {
            let (strategy, explanation) = plan_words(shape, p.n_layers);
            p.strategy = strategy;
            p.explanation = explanation;
        }
    }
    c
}

/// A plan's strategy ("stage split", "2 cells, single node each") and the sentences that
/// explain it.
fn plan_words(shape: &PlanShape, n_layers: usize) -> (String, String) {
    let n = shape.ring.len();
    let strategy = match (n, shape.expert_split.is_some()) {
        (1, false) => "single node",
        (_, false) => "stage split",
        (1, true) => "expert split",
        (_, true) => "stage + expert split",
    };
    let ranges: Vec<String> = shape
        .ring
        .iter()
        .map(|s| format!("{} {}..{}", s.node, s.layers[0], s.layers[1]))
        .collect();
    let mut explanation = format!(
        "Stage split of {n_layers} layers over {n} node(s) in ring order: {}. The last stage \
         samples and hands each token to the first.",
        ranges.join(", ")
    );
    if let Some(split) = &shape.expert_split {
        let _ = write!(
            explanation,
            " Each MoE layer's experts are split by owner ({split}): the home stage routes and \
             sends each owner only its experts' tokens."
        );
    }
    if !shape.note.is_empty() {
        explanation.push(' ');
        explanation.push_str(&shape.note);
    }
    if shape.cells > 1 {
        let cells = shape.cells;
        return (
            format!("{cells} cells, {strategy} each"),
            format!(
                "{cells} cells, each a whole copy of the model that takes whole requests: every \
                 request runs on one ready cell, chosen among those with room for its KV cache \
                 by the requests each is running and its measured decode speed. A cell is \
                 re-planned alone when it loses a node; the others keep serving. {explanation}"
            ),
        );
    }
    (strategy.to_string(), explanation)
}

fn sections(r: &StatusReport) -> Sections {
    Sections {
        nodes: render_nodes(&r.cluster),
        plan: render_plan(&r.cluster),
        requests: render_requests(&r.gateway),
        kpis: render_kpis(r),
    }
}

async fn index(State(gw): State<Arc<Gateway>>) -> Response {
    let r = report(&gw);
    let s = sections(&r);
    let (pill_class, pill_text) = match &r.cluster.not_serving {
        None => ("pill ok", "Serving".to_string()),
        Some(why) => ("pill bad", format!("Not serving: {why}")),
    };
    let epoch = r.cluster.plan.as_ref().map_or(0, |p| p.epoch);
    let page = INDEX
        .replace("{{MODEL}}", &esc(&r.model))
        .replace("{{PILL_CLASS}}", pill_class)
        .replace("{{PILL}}", &esc(&pill_text))
        .replace("{{EPOCH}}", &epoch.to_string())
        .replace("{{NODE_COUNT}}", &r.cluster.nodes.len().to_string())
        .replace(
            "{{AUTH}}",
            if r.auth_required {
                "API key required"
            } else {
                "open on loopback"
            },
        )
        .replace("{{KPIS}}", &s.kpis)
        .replace("{{NODES}}", &s.nodes)
        .replace("{{PLAN}}", &s.plan)
        .replace("{{REQUESTS}}", &s.requests);
    Html(page).into_response()
}

async fn style() -> Response {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE).into_response()
}

async fn script() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        SCRIPT,
    )
        .into_response()
}

async fn status(State(gw): State<Arc<Gateway>>) -> Response {
    Json(report(&gw)).into_response()
}

async fn status_stream(State(gw): State<Arc<Gateway>>) -> Response {
    let s = futures_util::stream::unfold((gw, true), |(gw, first)| async move {
        if !first {
            tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
                () = gw.shutting_down() => return None,
            }
        }
        let r = report(&gw);
        let u = Update {
            html: sections(&r),
            status: r,
        };
        let ev = SseEvent::default()
            .event("status")
            .data(serde_json::to_string(&u).unwrap_or_default());
        Some((Ok::<_, Infallible>(ev), (gw, false)))
    });
    axum::response::sse::Sse::new(s).into_response()
}

/// HTML-escapes text.
pub(crate) fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            _ => o.push(c),
        }
    }
    o
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        (part as f64 / whole as f64 * 100.0).clamp(0.0, 100.0)
    }
}

/// A bar segment's width: visible (at least 1%) whenever the part is not zero.
fn bar_pct(part: u64, whole: u64) -> f64 {
    if part == 0 {
        0.0
    } else {
        pct(part, whole).max(1.0)
    }
}

fn health_class(h: Health) -> (&'static str, &'static str) {
    match h {
        Health::Healthy => ("ok", "healthy"),
        Health::Degraded => ("warn", "degraded"),
        Health::Down => ("bad", "down"),
        Health::Unknown => ("muted", "unknown"),
    }
}

fn render_kpis(r: &StatusReport) -> String {
    let g = &r.gateway;
    let c = &r.cluster.counters;
    let ms = |v: Option<f64>| v.map_or("–".to_string(), |x| format!("{x:.0} ms"));
    let failed: u64 = g
        .by_status
        .iter()
        .filter(|(s, _)| **s >= 400)
        .map(|(_, n)| n)
        .sum();
    let mut o = String::new();
    let mut kpi = |id: &str, label: &str, value: String, sub: String| {
        let _ = write!(
            o,
            r#"<div class="kpi" id="kpi-{id}"><div class="kpi-label">{label}</div><div class="kpi-value">{value}</div><div class="kpi-sub">{sub}</div></div>"#,
            value = esc(&value),
            sub = esc(&sub),
        );
    };
    kpi(
        "tps",
        "Tokens / s",
        format!("{:.1}", g.tokens_per_s),
        if g.cached_tokens_total > 0 {
            format!(
                "{} tokens served · {} prompt tokens reused",
                g.completion_tokens_total, g.cached_tokens_total
            )
        } else {
            format!("{} tokens served", g.completion_tokens_total)
        },
    );
    kpi(
        "ttft",
        "Time to first token",
        ms(g.ttft_p50_ms),
        format!("p50 · p95 {}", ms(g.ttft_p95_ms)),
    );
    kpi(
        "queue",
        "Queue",
        format!("{} / {}", c.queue_depth, c.queue_capacity),
        format!(
            "{} of {} batch slots active",
            c.active_sequences, c.max_active_sequences
        ),
    );
    kpi(
        "kv",
        "KV cache",
        human_bytes(c.kv_bytes),
        format!("{} steps run", c.steps_total),
    );
    kpi(
        "requests",
        "Requests",
        g.requests_total.to_string(),
        format!(
            "{} in flight · {failed} failed · {} cancelled",
            g.in_flight, c.cancelled_total
        ),
    );
    o
}

fn render_nodes(c: &ClusterStatus) -> String {
    if c.nodes.is_empty() {
        return r#"<p class="empty">No nodes have joined yet.</p>"#.into();
    }
    let mut o = String::new();
    for n in &c.nodes {
        let (cls, word) = health_class(n.health);
        let weights = n.used_bytes.saturating_sub(n.kv_bytes);
        let inv = &n.inventory;
        let mut facts = Vec::new();
        if !inv.cpu.is_empty() {
            facts.push(("CPU", inv.cpu.clone()));
        }
        if inv.threads > 0 {
            facts.push(("Threads", inv.threads.to_string()));
        }
        if inv.ram_bytes > 0 {
            facts.push(("RAM", human_bytes(inv.ram_bytes)));
        }
        if inv.vram_bytes > 0 {
            facts.push(("VRAM", human_bytes(inv.vram_bytes)));
        }
        if inv.mem_bandwidth > 0 {
            facts.push(("Mem BW", format!("{}/s", human_bytes(inv.mem_bandwidth))));
        }
        if !inv.notes.is_empty() {
            facts.push(("Features", inv.notes.join(" · ")));
        }
        if let Some(a) = &n.address {
            facts.push(("Address", a.clone()));
        }
        if let Some(ms) = n.last_seen_ms {
            facts.push(("Last seen", format!("{ms} ms ago")));
        }
        let _ = write!(
            o,
            r#"<article class="node" id="node-{id}" data-node-id="{id}" data-health="{word}">
<header><span class="dot {cls}"></span><h3>{name}</h3><span class="tag {cls}">{word}</span></header>
<div class="node-id">{id}</div>
<dl>"#,
            id = esc(&n.id),
            name = esc(&n.name),
        );
        for (k, v) in facts {
            let _ = write!(o, "<dt>{k}</dt><dd>{}</dd>", esc(&v));
        }
        let _ = write!(
            o,
            r#"</dl>
<div class="bar-label"><span>Memory</span><span>{used} of {budget} budget</span></div>
<div class="bar" title="weights {w}, KV {kv}"><div class="seg weights" style="width:{pw:.2}%"></div><div class="seg kv" style="width:{pk:.2}%"></div></div>
<div class="legend"><span><i class="sw weights"></i>weights {w}</span><span><i class="sw kv"></i>KV {kv}</span></div>
<div class="holds"><span>Holds</span> {holds}</div>
</article>"#,
            used = human_bytes(n.used_bytes),
            budget = human_bytes(n.budget_bytes),
            w = human_bytes(weights),
            kv = human_bytes(n.kv_bytes),
            pw = bar_pct(weights, n.budget_bytes),
            pk = bar_pct(n.kv_bytes, n.budget_bytes),
            holds = esc(&holds(n, c.plan.as_ref())),
        );
    }
    o
}

/// What a node holds under the plan, in words ("stage 2 of 3: layers 4–7, head"), from its
/// assignment and its expert cache's counters: backends report data, the dashboard words it.
pub fn holds(n: &NodeStatus, plan: Option<&PlanStatus>) -> String {
    let Some(p) = plan else {
        return "nothing".into();
    };
    let Some(a) = p.assignments.iter().find(|a| a.node_id == n.id) else {
        return "nothing".into();
    };
    let [start, end] = a.layers;
    // Stages are counted within the node's own cell (a whole copy of the model).
    let stages: Vec<&Assignment> = p
        .assignments
        .iter()
        .filter(|s| s.layers[1] > s.layers[0] && s.cell == a.cell)
        .collect();
    let mut words = if p.cells.len() > 1 {
        format!("cell {}: ", a.cell)
    } else {
        String::new()
    };
    words += &if end <= start {
        format!("experts only: {} per MoE layer", a.experts)
    } else if stages.len() == 1 {
        format!("all {} layers", p.n_layers)
    } else {
        let i = stages.iter().position(|s| s.node_id == n.id).unwrap_or(0);
        format!(
            "stage {} of {}: layers {start}–{}",
            i + 1,
            stages.len(),
            end - 1
        )
    };
    if a.embed {
        words.push_str(", embedding");
    }
    if a.head {
        words.push_str(", head");
    }
    if end > start && p.n_experts > 0 && a.experts < p.n_experts {
        words.push_str(&format!(
            ", {} of {} experts per layer",
            a.experts, p.n_experts
        ));
    } else if end > start && p.n_experts > 0 && stages.len() == 1 {
        words.push_str(&format!(", all {} experts per layer", p.n_experts));
    }
    if a.weight_bytes > 0 {
        words.push_str(&format!(" ({})", human_bytes(a.weight_bytes)));
    }
    if let Some(c) = &n.expert_cache {
        words.push_str(&format!(
            "; experts streamed from disk ({} in memory at most): {} hits, {} misses, {} read, \
             {:.1} s waiting for reads",
            human_bytes(c.budget_bytes),
            c.hits,
            c.misses,
            human_bytes(c.disk_bytes),
            c.read_wait_us as f64 / 1e6
        ));
    }
    words
}

fn render_plan(c: &ClusterStatus) -> String {
    let Some(p) = &c.plan else {
        return r#"<div id="plan" data-epoch="0"><p class="empty">No plan yet: the planner is waiting for nodes.</p></div>"#.into();
    };
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<div id="plan" data-epoch="{epoch}" data-strategy="{strategy}">
<div class="plan-head"><span class="epoch">Epoch {epoch}</span><span class="strategy">{strategy}</span><span class="muted">{layers} layers{experts}</span></div>
<div class="plan-rows">
<div class="plan-row axis"><div class="who"></div><div class="track axis-track"><span style="left:0%">0</span>{half}<span style="left:100%">{layers}</span></div><div class="mem"></div></div>"#,
        epoch = p.epoch,
        strategy = esc(&p.strategy),
        layers = p.n_layers,
        half = if p.n_layers >= 4 && p.n_layers % 2 == 0 {
            format!(r#"<span style="left:50%">{}</span>"#, p.n_layers / 2)
        } else {
            String::new()
        },
        experts = if p.n_experts > 0 {
            format!(" · {} experts per layer", p.n_experts)
        } else {
            String::new()
        },
    );
    for (i, a) in p.assignments.iter().enumerate() {
        let name = c
            .nodes
            .iter()
            .find(|n| n.id == a.node_id)
            .map_or(a.node_id.as_str(), |n| n.name.as_str());
        let n_layers = p.n_layers.max(1) as f64;
        let [l0, l1] = a.layers;
        let left = l0 as f64 / n_layers * 100.0;
        let width = (l1.saturating_sub(l0)) as f64 / n_layers * 100.0;
        let mut what = Vec::new();
        if l1 > l0 {
            what.push(format!("layers {l0}–{}", l1 - 1));
        }
        if a.experts > 0 {
            what.push(format!("{} experts/layer", a.experts));
        }
        if a.embed {
            what.push("embedding".into());
        }
        if a.head {
            what.push("head".into());
        }
        // Experts held per layer, drawn under the layers they belong to (all layers for a node
        // that holds only experts).
        let experts_bar = if p.n_experts > 0 && a.experts > 0 {
            let (el, ew) = if l1 > l0 { (left, width) } else { (0.0, 100.0) };
            format!(
                r#"<div class="experts c{c}" style="left:{el:.2}%;width:{ew:.2}%" title="{e} of {n} experts per layer"><i style="width:{f:.2}%"></i></div>"#,
                c = i % 6,
                e = a.experts,
                n = p.n_experts,
                f = pct(a.experts as u64, p.n_experts as u64),
            )
        } else {
            String::new()
        };
        let track_class = if experts_bar.is_empty() {
            ""
        } else {
            " with-experts"
        };
        let _ = write!(
            o,
            r#"<div class="plan-row" data-node-id="{id}">
<div class="who"><b>{name}</b><small>{what}</small></div>
<div class="track{track_class}"><div class="layers c{color}" style="left:{left:.2}%;width:{width:.2}%">{label}</div>{experts_bar}</div>
<div class="mem"><div class="bar small"><div class="seg weights" style="width:{pm:.2}%"></div></div><small>{wb} / {bb}</small></div>
</div>"#,
            id = esc(&a.node_id),
            name = esc(name),
            what = esc(&what.join(" · ")),
            color = i % 6,
            label = if l1 > l0 {
                format!("{l0}–{}", l1 - 1)
            } else {
                String::new()
            },
            pm = bar_pct(a.weight_bytes, a.budget_bytes),
            wb = human_bytes(a.weight_bytes),
            bb = human_bytes(a.budget_bytes),
        );
    }
    let _ = write!(o, "</div>{}", render_cells(p, c));
    let _ = write!(
        o,
        r#"<div class="explain"><h4>Why this plan</h4><p>{}</p></div>
</div>"#,
        esc(&p.explanation).replace('\n', "<br>")
    );
    o
}

/// The plan's cells, when it holds more than one: each cell's state, nodes, requests running
/// and measured decode speed.
fn render_cells(p: &PlanStatus, c: &ClusterStatus) -> String {
    if p.cells.len() < 2 {
        return String::new();
    }
    let name = |id: &String| {
        c.nodes
            .iter()
            .find(|n| n.id == *id)
            .map_or(id.as_str(), |n| n.name.as_str())
            .to_string()
    };
    let mut o = String::from(
        r#"<table id="cells"><thead><tr><th>Cell</th><th>Epoch</th><th>State</th><th>Nodes</th><th>Running</th><th>Decode tok/s</th></tr></thead><tbody>"#,
    );
    for cell in &p.cells {
        let nodes: Vec<String> = cell.nodes.iter().map(name).collect();
        let _ = write!(
            o,
            r#"<tr data-cell="{}"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            cell.cell,
            cell.cell,
            cell.epoch,
            esc(&cell.state),
            esc(&nodes.join(" → ")),
            cell.active,
            if cell.decode_tokens_per_s > 0.0 {
                format!("{:.1}", cell.decode_tokens_per_s)
            } else {
                "–".into()
            },
        );
    }
    o.push_str("</tbody></table>");
    o
}

fn render_requests(g: &GatewaySnapshot) -> String {
    if g.recent.is_empty() {
        return r#"<tr class="empty-row"><td colspan="8">No requests yet. Try <code>curl</code> or any OpenAI client against <code>/v1</code>.</td></tr>"#.into();
    }
    let mut o = String::new();
    for r in &g.recent {
        let secs = (r.at_ms / 1000) % 86_400;
        let time = format!(
            "{:02}:{:02}:{:02}",
            secs / 3600,
            (secs / 60) % 60,
            secs % 60
        );
        let cls = if r.status >= 400 {
            "fail"
        } else if r.outcome == "cancelled" {
            "cancel"
        } else {
            "okrow"
        };
        let _ = write!(
            o,
            r#"<tr class="{cls}"><td>{time}</td><td class="mono">{id}</td><td>{ep}{st}</td><td><span class="code s{s100}">{status}</span></td><td class="num">{pt}{cached} → {ct}</td><td class="num">{ttft}</td><td class="num">{dur:.0} ms</td><td class="outcome">{outcome}</td></tr>"#,
            id = esc(&r.id),
            ep = esc(&r.endpoint),
            st = if r.stream {
                " <small>stream</small>"
            } else {
                ""
            },
            s100 = r.status / 100,
            status = r.status,
            pt = r.prompt_tokens,
            cached = if r.cached_tokens > 0 {
                format!(" <small>({} reused)</small>", r.cached_tokens)
            } else {
                String::new()
            },
            ct = r.completion_tokens,
            ttft = r.ttft_ms.map_or("–".into(), |t| format!("{t:.0} ms")),
            dur = r.duration_ms,
            outcome = esc(&r.outcome),
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::{Assignment, ExpertCacheStatus, NodeStatus, PlanStatus};

    /// The words come from the plan's assignments: a stage's place in the ring, its layers
    /// (inclusive), the embedding and head, a partial expert share, and streaming counters.
    #[test]
    fn what_a_node_holds_is_worded_from_its_assignment() {
        let mut c = crate::testing::three_node_status("m", 12);
        let plan = c.plan.clone().unwrap();
        let words: Vec<String> = c.nodes.iter().map(|n| holds(n, Some(&plan))).collect();
        let [l0, l1, l2] = plan
            .assignments
            .iter()
            .map(|a| a.layers)
            .collect::<Vec<_>>()[..]
        else {
            panic!("three assignments")
        };
        assert!(
            words[0].starts_with(&format!("stage 1 of 3: layers 0–{}, embedding", l0[1] - 1)),
            "{}",
            words[0]
        );
        assert!(
            words[1].starts_with(&format!("stage 2 of 3: layers {}–{} (", l1[0], l1[1] - 1)),
            "{}",
            words[1]
        );
        assert!(
            words[2].starts_with(&format!("stage 3 of 3: layers {}–11, head", l2[0])),
            "{}",
            words[2]
        );
        assert_eq!(holds(&c.nodes[0], None), "nothing");
        // An expert-only node, and a stage streaming its experts from disk.
        let mut p = plan.clone();
        p.n_experts = 8;
        for a in &mut p.assignments {
            a.experts = 8;
        }
        p.assignments[1].experts = 4;
        p.assignments.push(Assignment {
            node_id: "x".into(),
            experts: 4,
            ..Default::default()
        });
        c.nodes[1].expert_cache = Some(ExpertCacheStatus {
            budget_bytes: 1 << 20,
            hits: 7,
            misses: 3,
            ..Default::default()
        });
        let x = NodeStatus {
            id: "x".into(),
            ..c.nodes[0].clone()
        };
        assert_eq!(holds(&x, Some(&p)), "experts only: 4 per MoE layer");
        let w = holds(&c.nodes[1], Some(&p));
        assert!(w.contains(", 4 of 8 experts per layer"), "{w}");
        assert!(
            w.contains("experts streamed from disk (1.00 MiB in memory at most): 7 hits, 3 misses"),
            "{w}"
        );
    }

    #[test]
    fn cells_are_listed_and_each_node_is_worded_within_its_cell() {
        use tessera_api::CellStatus;
        let c = ClusterStatus {
            nodes: vec![
                NodeStatus {
                    id: "n1".into(),
                    name: "alpha".into(),
                    ..NodeStatus::default()
                },
                NodeStatus {
                    id: "n2".into(),
                    name: "beta".into(),
                    ..NodeStatus::default()
                },
            ],
            plan: Some(PlanStatus {
                epoch: 4,
                strategy: "2 cells".into(),
                n_layers: 8,
                assignments: vec![
                    Assignment {
                        node_id: "n1".into(),
                        layers: [0, 8],
                        ..Assignment::default()
                    },
                    Assignment {
                        node_id: "n2".into(),
                        cell: 1,
                        layers: [0, 8],
                        ..Assignment::default()
                    },
                ],
                cells: vec![
                    CellStatus {
                        cell: 0,
                        epoch: 4,
                        state: "ready".into(),
                        nodes: vec!["n1".into()],
                        active: 3,
                        decode_tokens_per_s: 12.5,
                    },
                    CellStatus {
                        cell: 1,
                        epoch: 5,
                        state: "loading".into(),
                        nodes: vec!["n2".into()],
                        ..CellStatus::default()
                    },
                ],
                ..PlanStatus::default()
            }),
            ..ClusterStatus::default()
        };
        let plan = render_plan(&c);
        assert!(plan.contains(
            r#"<tr data-cell="0"><td>0</td><td>4</td><td>ready</td><td>alpha</td><td>3</td><td>12.5</td></tr>"#
        ), "{plan}");
        assert!(plan.contains(
            r#"<tr data-cell="1"><td>1</td><td>5</td><td>loading</td><td>beta</td><td>0</td><td>–</td></tr>"#
        ));
        // Each node holds all layers of its own cell, not stage 2 of 2.
        assert_eq!(holds(&c.nodes[1], c.plan.as_ref()), "cell 1: all 8 layers");
    }

    #[test]
    fn every_node_and_the_plan_are_rendered_escaped() {
        let c = ClusterStatus {
            nodes: vec![
                NodeStatus {
                    id: "n1".into(),
                    name: "<box>".into(),
                    health: Health::Healthy,
                    budget_bytes: 100,
                    used_bytes: 50,
                    ..NodeStatus::default()
                },
                NodeStatus {
                    id: "n2".into(),
                    name: "two".into(),
                    health: Health::Down,
                    ..NodeStatus::default()
                },
            ],
            plan: Some(PlanStatus {
                epoch: 7,
                strategy: "stage split".into(),
                n_layers: 8,
                assignments: vec![Assignment {
                    node_id: "n1".into(),
                    layers: [0, 4],
                    ..Assignment::default()
                }],
                explanation: "because".into(),
                ..PlanStatus::default()
            }),
            ..ClusterStatus::default()
        };
        let nodes = render_nodes(&c);
        assert!(nodes.contains(r#"id="node-n1""#) && nodes.contains(r#"id="node-n2""#));
        assert!(nodes.contains("&lt;box&gt;") && !nodes.contains("<box>"));
        let plan = render_plan(&c);
        assert!(plan.contains(r#"data-epoch="7""#));
        assert!(plan.contains("layers 0–3") && plan.contains("because"));
    }

    fn ring(stages: &[(&str, usize, usize)]) -> Vec<tessera_api::RingStage> {
        stages
            .iter()
            .map(|&(node, a, b)| tessera_api::RingStage {
                node: node.into(),
                layers: [a, b],
            })
            .collect()
    }

    /// A plan reported as data gets its strategy and sentences here, the ones the coordinator
    /// used to write: its ring by name and layers, its expert split, the operator's note.
    #[test]
    fn a_plans_shape_is_worded_by_the_dashboard() {
        let mut c = crate::testing::three_node_status("m", 5);
        let p = c.plan.as_mut().unwrap();
        p.shape = Some(PlanShape {
            ring: ring(&[("alpha", 0, 3), ("beta", 3, 5)]),
            expert_split: Some("0-3@alpha,4-7@gamma".into()),
            cells: 1,
            note: "Chosen by hand.".into(),
        });
        let p = worded(c).plan.unwrap();
        assert_eq!(p.strategy, "stage + expert split");
        assert_eq!(
            p.explanation,
            "Stage split of 5 layers over 2 node(s) in ring order: alpha 0..3, beta 3..5. The \
             last stage samples and hands each token to the first. Each MoE layer's experts are \
             split by owner (0-3@alpha,4-7@gamma): the home stage routes and sends each owner \
             only its experts' tokens. Chosen by hand."
        );
    }

    /// Cells: the count and each cell's strategy, and why whole requests go to one cell.
    #[test]
    fn a_plan_of_cells_is_worded_as_cells() {
        let mut c = crate::testing::three_node_status("m", 5);
        c.plan.as_mut().unwrap().shape = Some(PlanShape {
            ring: ring(&[("alpha", 0, 5)]),
            expert_split: None,
            cells: 2,
            note: String::new(),
        });
        let p = worded(c).plan.unwrap();
        assert_eq!(p.strategy, "2 cells, single node each");
        assert!(
            p.explanation.starts_with(
                "2 cells, each a whole copy of the model that takes whole requests: every request"
            ) && p.explanation.ends_with(
                "Stage split of 5 layers over 1 node(s) in ring order: alpha 0..5. The last stage \
                 samples and hands each token to the first."
            ),
            "{}",
            p.explanation
        );
    }

    /// A backend that words its own plan (one process) keeps its words.
    #[test]
    fn a_plan_without_a_shape_keeps_the_backends_words() {
        let c = crate::testing::three_node_status("m", 5);
        let before = c.plan.clone().unwrap();
        let after = worded(c).plan.unwrap();
        assert_eq!(after.strategy, before.strategy);
        assert_eq!(after.explanation, before.explanation);
    }
}
