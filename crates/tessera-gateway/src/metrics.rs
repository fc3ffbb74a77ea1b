//! What the gateway measures itself — requests by outcome, time to first token, tokens per
//! second, the recent requests — and the Prometheus text of `/metrics`, which adds the
//! backend's [`ClusterStatus`] (queue, KV, per-node memory, bytes per link, plan epoch).
//!
//! Time to first token is measured here, from the request arriving to its first token leaving
//! the scheduler, so it includes tokenization and queueing: what a client sees.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use tessera_api::{unix_now, ClusterStatus};

/// Upper bounds of the time-to-first-token histogram, in seconds.
pub const TTFT_BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Seconds of tokens/s history kept (the dashboard's sparkline).
const RATE_WINDOW_S: usize = 120;
/// Requests kept for the dashboard's "recent requests" table.
const RECENT: usize = 40;

/// One finished (or refused) request, for the dashboard.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub id: String,
    /// Unix milliseconds when it arrived.
    pub at_ms: u64,
    pub endpoint: String,
    pub status: u16,
    pub stream: bool,
    pub prompt_tokens: usize,
    /// Prompt tokens taken from a kept cache instead of prefilled (prefix reuse).
    #[serde(default)]
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub ttft_ms: Option<f64>,
    pub duration_ms: f64,
    /// `stop`, `length`, `cancelled`, or the error message.
    pub outcome: String,
}

/// The gateway's numbers at one moment (part of `/api/status`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GatewaySnapshot {
    pub uptime_s: f64,
    pub requests_total: u64,
    /// Requests by HTTP status.
    pub by_status: BTreeMap<u16, u64>,
    pub in_flight: u64,
    /// Tokens per second over the last 10 seconds.
    pub tokens_per_s: f64,
    /// Tokens per second for each of the last seconds, oldest first.
    pub tokens_per_s_history: Vec<u64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub ttft_count: u64,
    pub ttft_sum_s: f64,
    /// Cumulative counts per bucket of [`TTFT_BUCKETS`].
    pub ttft_buckets: Vec<u64>,
    pub completion_tokens_total: u64,
    /// Prompt tokens of finished requests taken from kept caches (prefix reuse), all told.
    #[serde(default)]
    pub cached_tokens_total: u64,
    pub recent: Vec<RequestRecord>,
}

struct Inner {
    start: Instant,
    requests_total: u64,
    by_status: BTreeMap<u16, u64>,
    in_flight: u64,
    /// (second since start, tokens in that second), oldest first.
    rate: VecDeque<(u64, u64)>,
    ttft: Vec<f64>,
    ttft_buckets: [u64; TTFT_BUCKETS.len()],
    ttft_count: u64,
    ttft_sum: f64,
    completion_tokens_total: u64,
    cached_tokens_total: u64,
    recent: VecDeque<RequestRecord>,
}

/// The gateway's counters (shared by all handlers).
pub struct GatewayMetrics {
    inner: Mutex<Inner>,
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                start: Instant::now(),
                requests_total: 0,
                by_status: BTreeMap::new(),
                in_flight: 0,
                rate: VecDeque::new(),
                ttft: Vec::new(),
                ttft_buckets: [0; TTFT_BUCKETS.len()],
                ttft_count: 0,
                ttft_sum: 0.0,
                completion_tokens_total: 0,
                cached_tokens_total: 0,
                recent: VecDeque::new(),
            }),
        }
    }
}

impl GatewayMetrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn request_started(&self) {
        self.lock().in_flight += 1;
    }

    /// A generation request ended (or was refused); `started` says whether
    /// [`GatewayMetrics::request_started`] was called for it.
    pub fn request_finished(&self, record: RequestRecord, started: bool) {
        let mut m = self.lock();
        if started {
            m.in_flight = m.in_flight.saturating_sub(1);
        }
        m.requests_total += 1;
        m.cached_tokens_total += record.cached_tokens as u64;
        *m.by_status.entry(record.status).or_default() += 1;
        if m.recent.len() == RECENT {
            m.recent.pop_front();
        }
        m.recent.push_back(record);
    }

    pub fn first_token(&self, ttft: Duration) {
        let s = ttft.as_secs_f64();
        let mut m = self.lock();
        m.ttft_count += 1;
        m.ttft_sum += s;
        for (b, &le) in m.ttft_buckets.iter_mut().zip(TTFT_BUCKETS.iter()) {
            if s <= le {
                *b += 1;
            }
        }
        // Quantiles over the most recent 1000 samples.
        if m.ttft.len() == 1000 {
            m.ttft.remove(0);
        }
        m.ttft.push(s);
    }

    pub fn tokens(&self, n: u64) {
        let mut m = self.lock();
        let sec = m.start.elapsed().as_secs();
        m.completion_tokens_total += n;
        match m.rate.back_mut() {
            Some((s, c)) if *s == sec => *c += n,
            _ => m.rate.push_back((sec, n)),
        }
        while m
            .rate
            .front()
            .is_some_and(|(s, _)| s + RATE_WINDOW_S as u64 <= sec)
        {
            m.rate.pop_front();
        }
    }

    pub fn snapshot(&self) -> GatewaySnapshot {
        let m = self.lock();
        let elapsed = m.start.elapsed();
        let now = elapsed.as_secs();
        let mut history = vec![0u64; RATE_WINDOW_S];
        for &(s, c) in &m.rate {
            let age = now.saturating_sub(s) as usize;
            if age < RATE_WINDOW_S {
                history[RATE_WINDOW_S - 1 - age] = c;
            }
        }
        // The current second is partial: average the 10 before it.
        let window = 10.min(now as usize).max(1);
        let recent: u64 = history[RATE_WINDOW_S - 1 - window..RATE_WINDOW_S - 1]
            .iter()
            .sum();
        let mut sorted = m.ttft.clone();
        sorted.sort_by(f64::total_cmp);
        let q = |p: f64| {
            (!sorted.is_empty())
                .then(|| sorted[((sorted.len() - 1) as f64 * p).round() as usize] * 1000.0)
        };
        GatewaySnapshot {
            uptime_s: elapsed.as_secs_f64(),
            requests_total: m.requests_total,
            by_status: m.by_status.clone(),
            in_flight: m.in_flight,
            tokens_per_s: recent as f64 / window as f64,
            tokens_per_s_history: history[RATE_WINDOW_S - 61..].to_vec(),
            ttft_p50_ms: q(0.5),
            ttft_p95_ms: q(0.95),
            ttft_count: m.ttft_count,
            ttft_sum_s: m.ttft_sum,
            ttft_buckets: m.ttft_buckets.to_vec(),
            completion_tokens_total: m.completion_tokens_total,
            cached_tokens_total: m.cached_tokens_total,
            recent: m.recent.iter().rev().cloned().collect(),
        }
    }
}

/// Unix milliseconds now.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(unix_now() * 1000, |d| d.as_millis() as u64)
}

/// Escapes a Prometheus label value.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The Prometheus text of speculative decoding's totals (empty when the backend does not
/// speculate).
pub fn render_speculation(t: Option<tessera_api::SpeculationTotals>) -> String {
    let Some(t) = t else {
        return String::new();
    };
    let rate = if t.drafted == 0 {
        0.0
    } else {
        t.accepted as f64 / t.drafted as f64
    };
    let per_verification = if t.verifications == 0 {
        0.0
    } else {
        (t.accepted + t.verifications) as f64 / t.verifications as f64
    };
    let mut o = String::new();
    for (name, kind, help, value) in [
        (
            "tessera_speculation_verifications_total",
            "counter",
            "Decode rows that carried draft tokens to verify.",
            t.verifications.to_string(),
        ),
        (
            "tessera_speculation_draft_tokens_total",
            "counter",
            "Draft tokens verified.",
            t.drafted.to_string(),
        ),
        (
            "tessera_speculation_accepted_tokens_total",
            "counter",
            "Draft tokens accepted (equal to the token drawn at their position).",
            t.accepted.to_string(),
        ),
        (
            "tessera_speculation_acceptance_rate",
            "gauge",
            "Accepted over verified draft tokens since start.",
            format!("{rate:.4}"),
        ),
        (
            "tessera_speculation_tokens_per_verification",
            "gauge",
            "Tokens produced per verification with drafts (accepted drafts plus the draw).",
            format!("{per_verification:.4}"),
        ),
    ] {
        let _ = writeln!(
            o,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
    o
}

/// The Prometheus text exposition of everything.
pub fn render_prometheus(g: &GatewaySnapshot, c: &ClusterStatus) -> String {
    let mut o = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, value) in samples {
            let _ = writeln!(o, "{name}{labels} {value}");
        }
    };
    let one = |v: String| vec![(String::new(), v)];
    metric(
        "tessera_requests_total",
        "counter",
        "Generation requests answered, by HTTP status.",
        &g.by_status
            .iter()
            .map(|(s, n)| (format!("{{status=\"{s}\"}}"), n.to_string()))
            .collect::<Vec<_>>(),
    );
    metric(
        "tessera_requests_in_flight",
        "gauge",
        "Generation requests being answered now.",
        &one(g.in_flight.to_string()),
    );
    metric(
        "tessera_tokens_per_second",
        "gauge",
        "Generated tokens per second over the last 10 seconds.",
        &one(format!("{:.3}", g.tokens_per_s)),
    );
    metric(
        "tessera_completion_tokens_total",
        "counter",
        "Tokens streamed to clients.",
        &one(g.completion_tokens_total.to_string()),
    );
    metric(
        "tessera_prompt_cached_tokens_total",
        "counter",
        "Prompt tokens taken from kept KV caches instead of prefilled (prefix reuse).",
        &one(g.cached_tokens_total.to_string()),
    );
    let mut h: Vec<(String, String)> = TTFT_BUCKETS
        .iter()
        .zip(&g.ttft_buckets)
        .map(|(le, n)| (format!("_bucket{{le=\"{le}\"}}"), n.to_string()))
        .collect();
    h.push(("_bucket{le=\"+Inf\"}".into(), g.ttft_count.to_string()));
    h.push(("_sum".into(), format!("{:.6}", g.ttft_sum_s)));
    h.push(("_count".into(), g.ttft_count.to_string()));
    metric(
        "tessera_time_to_first_token_seconds",
        "histogram",
        "From a request arriving to its first generated token.",
        &h,
    );
    let k = &c.counters;
    metric(
        "tessera_queue_depth",
        "gauge",
        "Requests waiting for a batch slot.",
        &one(k.queue_depth.to_string()),
    );
    metric(
        "tessera_queue_capacity",
        "gauge",
        "Requests that may wait before 429.",
        &one(k.queue_capacity.to_string()),
    );
    metric(
        "tessera_active_sequences",
        "gauge",
        "Sequences in the running batch.",
        &one(k.active_sequences.to_string()),
    );
    metric(
        "tessera_kv_cache_bytes",
        "gauge",
        "KV cache bytes held by all sequences on all nodes.",
        &one(k.kv_bytes.to_string()),
    );
    metric(
        "tessera_steps_total",
        "counter",
        "Forward steps run by the scheduler.",
        &one(k.steps_total.to_string()),
    );
    metric(
        "tessera_prompt_tokens_total",
        "counter",
        "Prompt tokens prefilled.",
        &one(k.prompt_tokens_total.to_string()),
    );
    metric(
        "tessera_generated_tokens_total",
        "counter",
        "Tokens generated by the backend.",
        &one(k.generated_tokens_total.to_string()),
    );
    metric(
        "tessera_cancelled_total",
        "counter",
        "Sequences dropped because their client went away.",
        &one(k.cancelled_total.to_string()),
    );
    metric(
        "tessera_serving",
        "gauge",
        "1 when a plan is serving requests.",
        &one(u8::from(c.not_serving.is_none()).to_string()),
    );
    metric(
        "tessera_plan_epoch",
        "gauge",
        "Epoch of the plan being served (0: none).",
        &one(c.plan.as_ref().map_or(0, |p| p.epoch).to_string()),
    );
    let cells = c.plan.as_ref().map_or(&[][..], |p| &p.cells[..]);
    let cell = |f: &dyn Fn(&tessera_api::CellStatus) -> String| -> Vec<(String, String)> {
        cells
            .iter()
            .map(|x| {
                (
                    format!("{{cell=\"{}\",epoch=\"{}\"}}", x.cell, x.epoch),
                    f(x),
                )
            })
            .collect()
    };
    metric(
        "tessera_cells_ready",
        "gauge",
        "Cells (whole copies of the model) ready to take requests.",
        &one(if cells.is_empty() {
            u8::from(c.not_serving.is_none()) as usize
        } else {
            cells.iter().filter(|x| x.state == "ready").count()
        }
        .to_string()),
    );
    metric(
        "tessera_cell_active_sequences",
        "gauge",
        "Requests a cell is running.",
        &cell(&|x| x.active.to_string()),
    );
    metric(
        "tessera_cell_decode_tokens_per_second",
        "gauge",
        "A cell's measured decode speed per request (moving average; 0: not measured yet).",
        &cell(&|x| format!("{:.3}", x.decode_tokens_per_s)),
    );
    let node = |f: &dyn Fn(&tessera_api::NodeStatus) -> u64| -> Vec<(String, String)> {
        c.nodes
            .iter()
            .map(|n| {
                (
                    format!("{{node=\"{}\",name=\"{}\"}}", label(&n.id), label(&n.name)),
                    f(n).to_string(),
                )
            })
            .collect()
    };
    metric(
        "tessera_node_memory_used_bytes",
        "gauge",
        "Bytes a node uses for weights and KV.",
        &node(&|n| n.used_bytes),
    );
    metric(
        "tessera_node_memory_budget_bytes",
        "gauge",
        "Bytes a node lets Tessera use.",
        &node(&|n| n.budget_bytes),
    );
    metric(
        "tessera_node_kv_bytes",
        "gauge",
        "KV cache bytes on a node.",
        &node(&|n| n.kv_bytes),
    );
    metric(
        "tessera_node_up",
        "gauge",
        "1 when the node is healthy.",
        &node(&|n| u64::from(n.health == tessera_api::Health::Healthy)),
    );
    let cache = |f: &dyn Fn(&tessera_api::ExpertCacheStatus) -> String| -> Vec<(String, String)> {
        c.nodes
            .iter()
            .filter_map(|n| {
                let x = n.expert_cache.as_ref()?;
                Some((
                    format!("{{node=\"{}\",name=\"{}\"}}", label(&n.id), label(&n.name)),
                    f(x),
                ))
            })
            .collect()
    };
    let seconds = |us: u64| format!("{:.6}", us as f64 / 1e6);
    metric(
        "tessera_expert_cache_hits_total",
        "counter",
        "Expert lookups a node served from memory (expert streaming).",
        &cache(&|x| x.hits.to_string()),
    );
    metric(
        "tessera_expert_cache_misses_total",
        "counter",
        "Expert lookups a node read from disk (expert streaming).",
        &cache(&|x| x.misses.to_string()),
    );
    metric(
        "tessera_expert_disk_bytes_total",
        "counter",
        "Bytes of experts a node read from disk (expert streaming).",
        &cache(&|x| x.disk_bytes.to_string()),
    );
    metric(
        "tessera_expert_read_wait_seconds_total",
        "counter",
        "Time a node's computations waited for expert reads (expert streaming); its rate is the share of time spent waiting for the disk.",
        &cache(&|x| seconds(x.read_wait_us)),
    );
    metric(
        "tessera_expert_disk_busy_seconds_total",
        "counter",
        "Time a node had at least one expert read in progress (expert streaming); its rate is how busy streaming keeps the disk.",
        &cache(&|x| seconds(x.disk_busy_us)),
    );
    metric(
        "tessera_link_bytes_total",
        "counter",
        "Bytes sent over a link between nodes.",
        &c.links
            .iter()
            .map(|l| {
                (
                    format!("{{from=\"{}\",to=\"{}\"}}", label(&l.from), label(&l.to)),
                    l.bytes_total.to_string(),
                )
            })
            .collect::<Vec<_>>(),
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_are_counted_with_their_load_and_speed() {
        let cell = |cell: usize, epoch: u64, state: &str, active: usize, speed: f64| {
            tessera_api::CellStatus {
                cell,
                epoch,
                state: state.into(),
                active,
                decode_tokens_per_s: speed,
                ..Default::default()
            }
        };
        let c = ClusterStatus {
            plan: Some(tessera_api::PlanStatus {
                cells: vec![cell(0, 3, "ready", 2, 9.5), cell(1, 6, "loading", 0, 0.0)],
                ..Default::default()
            }),
            ..ClusterStatus::default()
        };
        let text = render_prometheus(&GatewayMetrics::default().snapshot(), &c);
        assert!(text.contains("\ntessera_cells_ready 1\n"), "{text}");
        assert!(text.contains("tessera_cell_active_sequences{cell=\"0\",epoch=\"3\"} 2\n"));
        assert!(text.contains("tessera_cell_active_sequences{cell=\"1\",epoch=\"6\"} 0\n"));
        assert!(
            text.contains("tessera_cell_decode_tokens_per_second{cell=\"0\",epoch=\"3\"} 9.500\n")
        );
        // A plan of one cell is one cell, ready when the backend serves.
        let text = render_prometheus(
            &GatewayMetrics::default().snapshot(),
            &ClusterStatus::default(),
        );
        assert!(text.contains("\ntessera_cells_ready 1\n"));
    }

    #[test]
    fn expert_cache_counters_are_rendered_per_streaming_node() {
        let c = ClusterStatus {
            nodes: vec![
                tessera_api::NodeStatus {
                    id: "n1".into(),
                    name: "a".into(),
                    ..Default::default()
                },
                tessera_api::NodeStatus {
                    id: "n2".into(),
                    name: "b".into(),
                    expert_cache: Some(tessera_api::ExpertCacheStatus {
                        budget_bytes: 1 << 20,
                        hits: 10,
                        misses: 38,
                        disk_bytes: 4096,
                        read_wait_us: 1_500_000,
                        disk_busy_us: 250,
                        peak_bytes: 1 << 20,
                    }),
                    ..Default::default()
                },
            ],
            ..ClusterStatus::default()
        };
        let text = render_prometheus(&GatewayMetrics::default().snapshot(), &c);
        assert!(text.contains("tessera_expert_cache_hits_total{node=\"n2\",name=\"b\"} 10"));
        assert!(text.contains("tessera_expert_cache_misses_total{node=\"n2\",name=\"b\"} 38"));
        assert!(text.contains("tessera_expert_disk_bytes_total{node=\"n2\",name=\"b\"} 4096"));
        assert!(text
            .contains("tessera_expert_read_wait_seconds_total{node=\"n2\",name=\"b\"} 1.500000"));
        assert!(text
            .contains("tessera_expert_disk_busy_seconds_total{node=\"n2\",name=\"b\"} 0.000250"));
        assert!(!text.contains("tessera_expert_cache_hits_total{node=\"n1\""));
    }

    #[test]
    fn ttft_histogram_is_cumulative() {
        let m = GatewayMetrics::default();
        m.first_token(Duration::from_millis(3));
        m.first_token(Duration::from_millis(70));
        let s = m.snapshot();
        assert_eq!(s.ttft_count, 2);
        assert_eq!(s.ttft_buckets[0], 1); // <= 5 ms
        assert_eq!(s.ttft_buckets[4], 2); // <= 100 ms
        let text = render_prometheus(&s, &ClusterStatus::default());
        assert!(text.contains("tessera_time_to_first_token_seconds_bucket{le=\"0.005\"} 1"));
        assert!(text.contains("tessera_time_to_first_token_seconds_count 2"));
        assert!(text.contains("# TYPE tessera_plan_epoch gauge\ntessera_plan_epoch 0"));
    }

    #[test]
    fn recent_requests_are_bounded_newest_first() {
        let m = GatewayMetrics::default();
        for i in 0..(RECENT + 5) {
            m.request_finished(
                RequestRecord {
                    id: i.to_string(),
                    at_ms: 0,
                    endpoint: "/v1/completions".into(),
                    status: 200,
                    stream: false,
                    prompt_tokens: 3,
                    cached_tokens: 2,
                    completion_tokens: 1,
                    ttft_ms: None,
                    duration_ms: 1.0,
                    outcome: "stop".into(),
                },
                false,
            );
        }
        let s = m.snapshot();
        assert_eq!(s.recent.len(), RECENT);
        assert_eq!(s.recent[0].id, (RECENT + 4).to_string());
        assert_eq!(s.by_status[&200], (RECENT + 5) as u64);
        // Reused prompt tokens are counted over every request, not only the recent ones.
        assert_eq!(s.cached_tokens_total, 2 * (RECENT + 5) as u64);
        let text = render_prometheus(&s, &ClusterStatus::default());
        let want = format!("tessera_prompt_cached_tokens_total {}", 2 * (RECENT + 5));
        assert!(text.contains(&want), "{text}");
    }
}
