//! An in-memory twin of a cluster backend, for tests and demos of everything above the
//! [`Backend`] trait without running a model: it answers each request with a scripted token
//! sequence (optionally paced), honours cancellation, and reports whatever [`ClusterStatus`]
//! it was given — for instance three nodes under a stage-split plan, as the coordinator will.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tessera_api::{
    Assignment, Backend, BackendCounters, ClusterStatus, Event, FinishReason, GenerationRequest,
    Health, InventorySummary, LinkStatus, NodeStatus, PlanStatus, RequestHandle, ServedModel,
    SubmitError, Usage,
};

/// See the module docs.
pub struct ScriptedBackend {
    served: Arc<ServedModel>,
    status: Mutex<ClusterStatus>,
    /// Tokens every request generates (cut at `max_tokens`).
    script: Vec<u32>,
    /// Pause before each token.
    pace: Duration,
}

impl ScriptedBackend {
    pub fn new(served: ServedModel, status: ClusterStatus, script: Vec<u32>) -> Self {
        Self {
            served: Arc::new(served),
            status: Mutex::new(status),
            script,
            pace: Duration::ZERO,
        }
    }

    /// Waits `pace` before each token.
    pub fn paced(mut self, pace: Duration) -> Self {
        self.pace = pace;
        self
    }

    /// Changes the reported status (e.g. to `not_serving`, or a new plan epoch).
    pub fn set_status(&self, f: impl FnOnce(&mut ClusterStatus)) {
        f(&mut self
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner));
    }
}

impl Backend for ScriptedBackend {
    fn model(&self) -> Arc<ServedModel> {
        self.served.clone()
    }

    fn submit(&self, req: GenerationRequest) -> Result<RequestHandle, SubmitError> {
        if let Some(reason) = self.status().not_serving {
            return Err(SubmitError::NotServing { reason });
        }
        let (handle, tx) = RequestHandle::channel(req.id);
        let tokens: Vec<u32> = self.script.iter().copied().take(req.max_tokens).collect();
        let reason = if tokens.len() == req.max_tokens {
            FinishReason::Length
        } else {
            FinishReason::Stop
        };
        let pace = self.pace;
        let prompt_tokens = req.prompt_tokens.len();
        std::thread::spawn(move || {
            for &t in &tokens {
                std::thread::sleep(pace);
                if tx.is_closed() || tx.send(Event::Token(t)).is_err() {
                    return;
                }
            }
            let _ = tx.send(Event::Finished {
                reason,
                usage: Usage {
                    prompt_tokens,
                    completion_tokens: tokens.len(),
                    cached_tokens: 0,
                },
            });
        });
        Ok(handle)
    }

    fn status(&self) -> ClusterStatus {
        self.status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// A plausible three-node stage split of an `n_layers`-layer model, as the coordinator would
/// report it (for demos and dashboard tests).
pub fn three_node_status(model: &str, n_layers: usize) -> ClusterStatus {
    let gib = 1u64 << 30;
    let machines = [
        (
            "a1f3",
            "studio-mac",
            "Apple M2 Max",
            12,
            32 * gib,
            0,
            24 * gib,
        ),
        (
            "b7c9",
            "gaming-pc",
            "AMD Ryzen 7 5800X",
            16,
            32 * gib,
            12 * gib,
            20 * gib,
        ),
        (
            "c2e8",
            "old-server",
            "Intel Xeon E5-2680 v4",
            28,
            64 * gib,
            0,
            40 * gib,
        ),
    ];
    let cuts = [0, n_layers * 2 / 5, n_layers * 3 / 4, n_layers];
    let per_layer = 180 << 20;
    let mut nodes = Vec::new();
    let mut assignments = Vec::new();
    for (i, (id, name, cpu, threads, ram, vram, budget)) in machines.into_iter().enumerate() {
        let layers = [cuts[i], cuts[i + 1]];
        let weight_bytes = (layers[1] - layers[0]) as u64 * per_layer;
        let kv = 96 << 20;
        nodes.push(NodeStatus {
            id: id.into(),
            name: name.into(),
            address: Some(format!("192.0.2.{}:7070", 10 + i)),
            health: Health::Healthy,
            inventory: InventorySummary {
                cpu: cpu.into(),
                threads,
                ram_bytes: ram,
                vram_bytes: vram,
                mem_bandwidth: [200u64, 50, 60][i] * 1_000_000_000,
                notes: vec![],
            },
            budget_bytes: budget,
            used_bytes: weight_bytes + kv,
            kv_bytes: kv,
            last_seen_ms: Some(120 + 40 * i as u64),
            expert_cache: None,
        });
        assignments.push(Assignment {
            node_id: id.into(),
            cell: 0,
            layers,
            experts: 0,
            embed: i == 0,
            head: i == 2,
            weight_bytes,
            budget_bytes: budget,
        });
    }
    ClusterStatus {
        model: model.into(),
        not_serving: None,
        nodes,
        plan: Some(PlanStatus {
            epoch: 3,
            strategy: "stage split".into(),
            n_layers,
            n_experts: 0,
            assignments,
            explanation: "Three stages in a ring, layers in proportion to each node's measured \
                          memory bandwidth within its budget. A two-node split was rejected: \
                          the old server alone would hold 60% of the weights and set the pace."
                .into(),
            cells: Vec::new(),
            shape: None,
        }),
        links: vec![
            LinkStatus {
                from: "a1f3".into(),
                to: "b7c9".into(),
                bytes_total: 48 << 20,
                rtt_us: 310,
            },
            LinkStatus {
                from: "b7c9".into(),
                to: "c2e8".into(),
                bytes_total: 48 << 20,
                rtt_us: 420,
            },
        ],
        counters: BackendCounters {
            queue_capacity: 64,
            max_active_sequences: 16,
            ..BackendCounters::default()
        },
    }
}
