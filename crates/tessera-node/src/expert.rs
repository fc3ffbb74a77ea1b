//! Expert-split execution of mixture-of-experts layers across nodes.
//!
//! The home stage of a MoE layer runs attention and the router; then, for each step, it sends
//! every peer that owns at least one of the step's selected experts **one** request (the
//! normed rows of only the tokens routed to that peer, with their routing), computes the
//! experts it holds itself meanwhile, collects each peer's [`ExpertReply`] and reduces all
//! slots in the engine's fixed slot order ([`tessera_engine::reduce_expert_outputs`]), so the
//! result is bit-identical to one process holding every expert. A peer that owns none of a
//! step's selected experts gets no traffic for that layer.
//!
//! Wire format (little-endian; frames on a [`stream::EXPERT`](tessera_proto::stream::EXPERT)
//! stream, home → worker [`frame::EXPERT_REQ`], worker → home [`frame::EXPERT_OUT`] or
//! [`frame::EXPERT_ERR`]):
//!
//! * request: `u16 version, u32 layer, u32 n_tokens, u32 k, u32 n_embd`, then
//!   `n_tokens·k` `u32` expert ids, `n_tokens·k` `f32` gate weights, `n_tokens·n_embd` `f32`
//!   normed rows;
//! * reply: `u16 version, u32 layer, u32 n_tokens, u32 k, u32 n_embd`, then the owner's
//!   [`ServeCounters`] (five `u64`s: lookups, misses, disk bytes, read wait ns, serve ns), then
//!   `n_tokens·k` `u8` flags (1: the slot is computed here), then `n_embd` `f32`s per flagged
//!   slot in slot order.

use std::time::Instant;

use tessera_engine::{EngineError, ExpertExecutor, ExpertOutputs, Hidden, Model, Routing};

use tessera_proto::{frame, FrameDecodeError, OwnerExpertStats};

/// Version of the expert frames' layout (2: replies carry the owner's [`ServeCounters`]).
pub const EXPERT_WIRE_VERSION: u16 = 2;

const HEAD: usize = 2 + 4 * 4;

/// Most tokens × slots one request may carry (a 64 MiB frame limit holds far fewer rows).
const MAX_SLOTS: usize = 1 << 20;

/// One layer's expert work for one worker.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertRequest {
    pub layer: u32,
    pub normed: Hidden,
    pub routing: Routing,
}

/// A worker's slot outputs for one request.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertReply {
    pub layer: u32,
    pub outputs: ExpertOutputs,
    /// What computing it cost the worker.
    pub counters: ServeCounters,
}

/// What a computation did to a model's streamed experts: the store's counters after it less
/// those before (all zero when the model streams none). A stage counts its own steps with it;
/// an owner, each request it computes ([`ServeCounters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CacheDelta {
    pub lookups: u64,
    pub misses: u64,
    pub disk_bytes: u64,
    pub read_wait_ns: u64,
}

impl CacheDelta {
    pub(crate) fn between(
        before: Option<tessera_engine::expert_store::ExpertStats>,
        after: Option<tessera_engine::expert_store::ExpertStats>,
    ) -> Self {
        let (Some(b), Some(a)) = (before, after) else {
            return Self::default();
        };
        Self {
            lookups: a.lookups.saturating_sub(b.lookups),
            misses: a.misses.saturating_sub(b.misses),
            disk_bytes: a.bytes_read.saturating_sub(b.bytes_read),
            read_wait_ns: a.read_wait_us.saturating_sub(b.read_wait_us) * 1_000,
        }
    }

    /// One of `n` sequences' share of a step's counts (as compute time is shared).
    pub(crate) fn share(self, n: u64) -> Self {
        let n = n.max(1);
        Self {
            lookups: self.lookups / n,
            misses: self.misses / n,
            disk_bytes: self.disk_bytes / n,
            read_wait_ns: self.read_wait_ns / n,
        }
    }

    /// Adds the counts to a stage's own streamed experts of `phase`.
    pub(crate) fn add_to(self, phase: &mut tessera_proto::PhaseStats) {
        phase.expert_lookups += self.lookups;
        phase.expert_misses += self.misses;
        phase.expert_disk_bytes += self.disk_bytes;
        phase.expert_read_wait_ns += self.read_wait_ns;
    }
}

/// What one request cost the worker that computed it: its streamed experts' counters across
/// the computation and the computation's time. They let the home tell a slow owner's disk or
/// compute from its link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeCounters {
    pub(crate) cache: CacheDelta,
    pub serve_ns: u64,
}

/// Bytes of [`ServeCounters`] on the wire.
const COUNTERS_LEN: usize = 5 * 8;

impl ServeCounters {
    fn encode(&self, out: &mut Vec<u8>) {
        let c = &self.cache;
        for v in [
            c.lookups,
            c.misses,
            c.disk_bytes,
            c.read_wait_ns,
            self.serve_ns,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    fn decode(b: &[u8]) -> Self {
        let at = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        Self {
            cache: CacheDelta {
                lookups: at(0),
                misses: at(1),
                disk_bytes: at(2),
                read_wait_ns: at(3),
            },
            serve_ns: at(4),
        }
    }
}

fn head(layer: u32, n: usize, k: usize, d: usize, cap: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEAD + cap);
    out.extend_from_slice(&EXPERT_WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&layer.to_le_bytes());
    out.extend_from_slice(&(n as u32).to_le_bytes());
    out.extend_from_slice(&(k as u32).to_le_bytes());
    out.extend_from_slice(&(d as u32).to_le_bytes());
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Parses the common header; checks version and width, returns `(layer, n, k, d)`.
fn parse_head(
    payload: &[u8],
    n_embd: usize,
) -> Result<(u32, usize, usize, usize), FrameDecodeError> {
    if payload.len() < HEAD {
        return Err(FrameDecodeError::Short {
            len: payload.len(),
            need: HEAD,
        });
    }
    let version = u16::from_le_bytes([payload[0], payload[1]]);
    if version != EXPERT_WIRE_VERSION {
        return Err(FrameDecodeError::BadWidth {
            got: version as usize,
            expected: EXPERT_WIRE_VERSION as usize,
        });
    }
    let layer = u32_at(payload, 2);
    let n = u32_at(payload, 6) as usize;
    let k = u32_at(payload, 10) as usize;
    let d = u32_at(payload, 14) as usize;
    if d != n_embd {
        return Err(FrameDecodeError::BadWidth {
            got: d,
            expected: n_embd,
        });
    }
    if n.checked_mul(k).is_none_or(|s| s > MAX_SLOTS) || k == 0 {
        return Err(FrameDecodeError::Overflow);
    }
    Ok((layer, n, k, d))
}

impl ExpertRequest {
    pub fn encode(&self) -> Vec<u8> {
        let (n, k, d) = (self.routing.n_tokens, self.routing.k, self.normed.n_embd);
        let mut out = head(self.layer, n, k, d, n * k * 8 + n * d * 4);
        for e in &self.routing.experts {
            out.extend_from_slice(&e.to_le_bytes());
        }
        tessera_net::frame::extend_f32s_le(&mut out, &self.routing.weights);
        tessera_net::frame::extend_f32s_le(&mut out, &self.normed.data);
        out
    }

    /// Decodes a request, checking every length against the header before allocating.
    pub fn decode(payload: &[u8], n_embd: usize) -> Result<Self, FrameDecodeError> {
        let (layer, n, k, d) = parse_head(payload, n_embd)?;
        let expected = n * k * 8 + n * d * 4;
        let got = payload.len() - HEAD;
        if got != expected {
            return Err(FrameDecodeError::BadPayload { got, expected });
        }
        let body = &payload[HEAD..];
        let experts: Vec<u32> = (0..n * k).map(|i| u32_at(body, 4 * i)).collect();
        let weights = tessera_net::frame::f32s_from_le_bytes(&body[n * k * 4..n * k * 8])
            .expect("multiple of 4");
        let data =
            tessera_net::frame::f32s_from_le_bytes(&body[n * k * 8..]).expect("multiple of 4");
        Ok(Self {
            layer,
            normed: Hidden {
                n_tokens: n,
                n_embd: d,
                data,
            },
            routing: Routing {
                n_tokens: n,
                k,
                experts,
                weights,
            },
        })
    }
}

impl ExpertReply {
    pub fn encode(&self) -> Vec<u8> {
        let o = &self.outputs;
        let present = o.slots.iter().filter(|s| s.is_some()).count();
        let mut out = head(
            self.layer,
            o.n_tokens,
            o.k,
            o.n_embd,
            COUNTERS_LEN + o.slots.len() + present * o.n_embd * 4,
        );
        self.counters.encode(&mut out);
        out.extend(o.slots.iter().map(|s| u8::from(s.is_some())));
        for v in o.slots.iter().flatten() {
            tessera_net::frame::extend_f32s_le(&mut out, v);
        }
        out
    }

    pub fn decode(payload: &[u8], n_embd: usize) -> Result<Self, FrameDecodeError> {
        let (layer, n, k, d) = parse_head(payload, n_embd)?;
        let flags_at = HEAD + COUNTERS_LEN;
        let flags_end = flags_at + n * k;
        if payload.len() < flags_end {
            return Err(FrameDecodeError::Short {
                len: payload.len(),
                need: flags_end,
            });
        }
        let counters = ServeCounters::decode(&payload[HEAD..flags_at]);
        let flags = &payload[flags_at..flags_end];
        let present = flags.iter().filter(|&&f| f != 0).count();
        let expected = present * d * 4;
        let got = payload.len() - flags_end;
        if got != expected {
            return Err(FrameDecodeError::BadPayload { got, expected });
        }
        let mut at = flags_end;
        let slots = flags
            .iter()
            .map(|&f| {
                (f != 0).then(|| {
                    let v = tessera_net::frame::f32s_from_le_bytes(&payload[at..at + d * 4])
                        .expect("multiple of 4");
                    at += d * 4;
                    v
                })
            })
            .collect();
        Ok(Self {
            layer,
            outputs: ExpertOutputs {
                n_tokens: n,
                k,
                n_embd: d,
                slots,
            },
            counters,
        })
    }
}

/// Computes a request on a worker's model: the slots whose expert it holds.
pub fn serve_request(model: &Model, req: &ExpertRequest) -> tessera_engine::Result<ExpertReply> {
    let layer = req.layer as usize;
    let before = model.expert_stats();
    let started = Instant::now();
    let outputs = model.moe_experts(layer, &req.normed, &req.routing, &|e| {
        model.holds_expert(layer, e)
    })?;
    let serve_ns = started.elapsed().as_nanos() as u64;
    Ok(ExpertReply {
        layer: req.layer,
        outputs,
        counters: ServeCounters {
            cache: CacheDelta::between(before, model.expert_stats()),
            serve_ns,
        },
    })
}

/// Answers one request frame payload: `(frame kind, payload)` to send back.
pub fn answer(model: &Model, payload: &[u8]) -> (u16, Vec<u8>) {
    let n_embd = model.config().n_embd;
    match ExpertRequest::decode(payload, n_embd)
        .map_err(|e| e.to_string())
        .and_then(|req| serve_request(model, &req).map_err(|e| e.to_string()))
    {
        Ok(reply) => (frame::EXPERT_OUT, reply.encode()),
        Err(e) => (frame::EXPERT_ERR, e.into_bytes()),
    }
}

/// A bidirectional frame channel to one expert worker (a network stream, or in memory).
pub trait ExpertLink: Send {
    /// Sends one frame.
    fn send(&mut self, kind: u16, payload: Vec<u8>) -> Result<(), String>;
    /// Receives the next frame.
    fn recv(&mut self) -> Result<(u16, Vec<u8>), String>;
}

/// One worker as a home stage sees it.
pub struct RemotePeer {
    pub name: String,
    /// `experts[layer]`: the experts it owns.
    pub experts: Vec<Vec<usize>>,
    pub link: Box<dyn ExpertLink>,
}

/// Round trips and bytes of the remote expert path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertTraffic {
    /// Requests sent (each answered by one reply): one per contacted peer per MoE layer.
    pub round_trips: u64,
    /// Request and reply frame bytes (8-byte frame headers included).
    pub bytes: u64,
    /// MoE layer executions with at least one expert computed on the home node.
    pub local_parts: u64,
    /// What the owners' replies said their computations cost, and the home's wait for them.
    pub owners: OwnerExpertStats,
}

/// The peers of a home stage and its traffic counters.
pub struct RemotePeers {
    pub peers: Vec<RemotePeer>,
    pub traffic: ExpertTraffic,
}

impl RemotePeers {
    pub fn new(peers: Vec<RemotePeer>) -> Self {
        Self {
            peers,
            traffic: ExpertTraffic::default(),
        }
    }

    /// An executor computing `local`'s held experts on `local` and the rest on the peers.
    pub fn executor<'a>(&'a mut self, local: &'a Model) -> RemoteExperts<'a> {
        RemoteExperts { local, peers: self }
    }
}

/// The [`ExpertExecutor`] of a home stage in an expert split.
pub struct RemoteExperts<'a> {
    local: &'a Model,
    peers: &'a mut RemotePeers,
}

/// Why a remote expert worker's answer was not used.
#[derive(Debug, thiserror::Error)]
pub enum ExpertPeerFault {
    /// The worker said it could not run the request.
    #[error("{0}")]
    Refused(String),
    /// Sending to it or reading from it failed.
    #[error("{0}")]
    Link(String),
    #[error("unexpected frame {0:#06x}")]
    UnexpectedFrame(u16),
    #[error("{0}")]
    Malformed(String),
    #[error("reply for layer {got} to a request for {asked}")]
    WrongLayer { got: usize, asked: usize },
    /// NaN or infinity in its outputs: it would spread through every later layer.
    #[error("layer {layer}: {count} non-finite expert outputs (NaN or infinity)")]
    NonFinite { layer: usize, count: usize },
}

fn remote_err(name: &str, fault: ExpertPeerFault) -> EngineError {
    EngineError::ExpertPeer {
        peer: name.to_string(),
        fault: Box::new(fault),
    }
}

impl ExpertExecutor for RemoteExperts<'_> {
    fn run(
        &mut self,
        layer: usize,
        normed: &Hidden,
        routing: &Routing,
    ) -> tessera_engine::Result<Vec<ExpertOutputs>> {
        let n_embd = normed.n_embd;
        // Send every contacted peer its one request first, so they compute in parallel with
        // each other and with the home node.
        let mut waiting: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, p) in self.peers.peers.iter_mut().enumerate() {
            let owned = p.experts.get(layer).cloned().unwrap_or_default();
            if owned.is_empty() {
                continue;
            }
            let tokens = routing.tokens_for(&|e| owned.binary_search(&e).is_ok());
            if tokens.is_empty() {
                continue;
            }
            let req = ExpertRequest {
                layer: layer as u32,
                normed: normed.gather(&tokens),
                routing: routing.subset(&tokens),
            };
            let payload = req.encode();
            self.peers.traffic.round_trips += 1;
            self.peers.traffic.bytes += (tessera_net::frame::HEADER_LEN + payload.len()) as u64;
            p.link
                .send(frame::EXPERT_REQ, payload)
                .map_err(|e| remote_err(&p.name, ExpertPeerFault::Link(e)))?;
            waiting.push((i, tokens));
        }
        let mut parts = Vec::with_capacity(waiting.len() + 1);
        let local = self.local;
        let held = routing
            .experts_used()
            .into_iter()
            .any(|e| local.holds_expert(layer, e));
        if held {
            self.peers.traffic.local_parts += 1;
            parts.push(
                local.moe_experts(layer, normed, routing, &|e| local.holds_expert(layer, e))?,
            );
        }
        // After the home's own part: what is left of the owners' time is the home's wait.
        let replies_from = Instant::now();
        let mut slowest_serve_ns = 0;
        for (i, tokens) in waiting {
            let p = &mut self.peers.peers[i];
            let (kind, payload) = p
                .link
                .recv()
                .map_err(|e| remote_err(&p.name, ExpertPeerFault::Link(e)))?;
            self.peers.traffic.bytes += (tessera_net::frame::HEADER_LEN + payload.len()) as u64;
            match kind {
                frame::EXPERT_OUT => {}
                frame::EXPERT_ERR => {
                    let why = String::from_utf8_lossy(&payload).into_owned();
                    return Err(remote_err(&p.name, ExpertPeerFault::Refused(why)));
                }
                k => return Err(remote_err(&p.name, ExpertPeerFault::UnexpectedFrame(k))),
            }
            let reply = ExpertReply::decode(&payload, n_embd)
                .map_err(|e| remote_err(&p.name, ExpertPeerFault::Malformed(e.to_string())))?;
            if reply.layer as usize != layer {
                let wrong = ExpertPeerFault::WrongLayer {
                    got: reply.layer as usize,
                    asked: layer,
                };
                return Err(remote_err(&p.name, wrong));
            }
            // A peer's NaN or infinity would spread through the reduction into every later
            // layer and sample garbage into a user's answer: fail the step, naming the peer.
            let bad = reply.outputs.slots.iter().flatten().flatten();
            let count = bad.filter(|x| !x.is_finite()).count();
            if count > 0 {
                return Err(remote_err(
                    &p.name,
                    ExpertPeerFault::NonFinite { layer, count },
                ));
            }
            // Counters a peer states: figures for reports only, summed without overflow
            // whatever it sends.
            let c = reply.counters.cache;
            self.peers.traffic.owners.add(&OwnerExpertStats {
                lookups: c.lookups,
                misses: c.misses,
                disk_bytes: c.disk_bytes,
                read_wait_ns: c.read_wait_ns,
                ..OwnerExpertStats::default()
            });
            slowest_serve_ns = slowest_serve_ns.max(reply.counters.serve_ns);
            parts.push(reply.outputs.expand(&tokens, routing.n_tokens)?);
        }
        self.peers.traffic.owners.add(&OwnerExpertStats {
            slowest_serve_ns,
            reply_wait_ns: replies_from.elapsed().as_nanos() as u64,
            ..OwnerExpertStats::default()
        });
        if parts.is_empty() {
            // No token routed anywhere cannot happen with k ≥ 1; keep the reducer's error.
            return Err(EngineError::ExpertOutputs(format!(
                "layer {layer}: no part computed any slot"
            )));
        }
        Ok(parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::mpsc;
    use std::sync::Arc;
    use tessera_engine::{ExpertSelection, Generator, LoadSpec};
    use tessera_model::{GgufFile, ModelConfig};
    use tessera_sampling::SamplingParams;

    fn model_path(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../models")
            .join(name)
    }

    /// A link to a worker thread over channels.
    struct MemLink {
        tx: mpsc::Sender<(u16, Vec<u8>)>,
        rx: mpsc::Receiver<(u16, Vec<u8>)>,
    }

    impl ExpertLink for MemLink {
        fn send(&mut self, kind: u16, payload: Vec<u8>) -> Result<(), String> {
            self.tx.send((kind, payload)).map_err(|e| e.to_string())
        }
        fn recv(&mut self) -> Result<(u16, Vec<u8>), String> {
            self.rx.recv().map_err(|e| e.to_string())
        }
    }

    fn spawn_worker(model: Arc<Model>) -> MemLink {
        let (req_tx, req_rx) = mpsc::channel::<(u16, Vec<u8>)>();
        let (out_tx, out_rx) = mpsc::channel();
        std::thread::spawn(move || {
            while let Ok((kind, payload)) = req_rx.recv() {
                assert_eq!(kind, frame::EXPERT_REQ);
                if out_tx.send(answer(&model, &payload)).is_err() {
                    break;
                }
            }
        });
        MemLink {
            tx: req_tx,
            rx: out_rx,
        }
    }

    #[test]
    fn frames_round_trip_and_malformed_ones_are_refused() {
        let req = ExpertRequest {
            layer: 3,
            normed: Hidden {
                n_tokens: 2,
                n_embd: 4,
                data: (0..8).map(|x| x as f32 * 0.5).collect(),
            },
            routing: Routing {
                n_tokens: 2,
                k: 2,
                experts: vec![1, 5, 0, 7],
                weights: vec![0.6, 0.4, 0.9, 0.1],
            },
        };
        let bytes = req.encode();
        assert_eq!(ExpertRequest::decode(&bytes, 4).unwrap(), req);
        assert!(ExpertRequest::decode(&bytes, 5).is_err());
        assert!(ExpertRequest::decode(&bytes[..bytes.len() - 1], 4).is_err());
        assert!(ExpertRequest::decode(&bytes[..5], 4).is_err());
        let reply = ExpertReply {
            layer: 3,
            outputs: ExpertOutputs {
                n_tokens: 2,
                k: 2,
                n_embd: 4,
                slots: vec![Some(vec![1.0; 4]), None, None, Some(vec![2.0; 4])],
            },
            counters: ServeCounters {
                cache: CacheDelta {
                    lookups: 3,
                    misses: 1,
                    disk_bytes: 1 << 20,
                    read_wait_ns: 250_000,
                },
                serve_ns: 900_000,
            },
        };
        let bytes = reply.encode();
        assert_eq!(bytes.len(), HEAD + COUNTERS_LEN + 4 + 2 * 16);
        assert_eq!(ExpertReply::decode(&bytes, 4).unwrap(), reply);
        assert!(ExpertReply::decode(&bytes[..bytes.len() - 4], 4).is_err());
    }

    /// The tiny MoE model split in two: a home model holding the even experts (and
    /// everything else), and a worker holding the odd experts (returned with their indices).
    fn home_and_worker() -> (GgufFile, ModelConfig, Model, Vec<usize>, Arc<Model>) {
        let g = GgufFile::open(model_path("test/tiny-qwen3moe-Q8_0.gguf")).unwrap();
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        let (a, b): (Vec<usize>, Vec<usize>) = (0..cfg.n_expert).partition(|e| e % 2 == 0);
        let mut spec = LoadSpec::full(&cfg);
        spec.experts = ExpertSelection::same_in_every_layer(&a, cfg.n_layer);
        let home = Model::load(&g, spec, 1, &mut |_, _| {}).unwrap();
        let worker = Arc::new(
            Model::load(
                &g,
                LoadSpec::experts_only(
                    0..cfg.n_layer,
                    ExpertSelection::same_in_every_layer(&b, cfg.n_layer),
                ),
                1,
                &mut |_, _| {},
            )
            .unwrap(),
        );
        (g, cfg, home, b, worker)
    }

    /// A home model holding half the experts plus an expert-only worker (over an in-memory
    /// link) generate exactly what one full model generates; every contacted worker gets one
    /// message per MoE layer per step.
    #[test]
    fn remote_experts_over_memory_links_equal_one_model() {
        let (g, cfg, home, b, worker) = home_and_worker();
        let mut peers = RemotePeers::new(vec![RemotePeer {
            name: "b".into(),
            experts: vec![b; cfg.n_layer],
            link: Box::new(spawn_worker(worker)),
        }]);
        let prompt = [1u32, 403, 407, 261, 378, 300, 42];
        let full = Model::load_full(&g, 1).unwrap();
        let mut want = Vec::new();
        Generator::new(&full, SamplingParams::greedy(), 64)
            .generate(&prompt, 6, &[], &mut |t| {
                want.push(t);
                true
            })
            .unwrap();
        // Greedy decode with the split executor.
        let mut kv = home.new_kv(64);
        let mut got = Vec::new();
        let mut tokens = prompt.to_vec();
        let mut pos = 0;
        for _ in 0..6 {
            let mut h = home.embed(&tokens).unwrap();
            let step = [tessera_engine::SeqStep {
                n_tokens: tokens.len(),
                start_pos: pos,
            }];
            home.run_layers(
                0..cfg.n_layer,
                &mut h,
                &step,
                &mut [&mut kv],
                &mut peers.executor(&home),
            )
            .unwrap();
            pos += tokens.len();
            let logits = home.head(&h.rows(h.n_tokens - 1..h.n_tokens)).unwrap();
            let t = tessera_engine::ops::argmax(logits.last()) as u32;
            got.push(t);
            tokens = vec![t];
        }
        assert_eq!(got, want);
        assert!(peers.traffic.round_trips > 0);
        assert!(peers.traffic.round_trips <= 6 * cfg.n_layer as u64);
    }

    /// An owner that streams its experts from disk says what each request cost it: summed at
    /// the home, its counters are the owner's own store counters over the run, so a slow
    /// split's owners can be told from its links.
    #[test]
    fn a_streaming_owner_reports_its_reads_with_each_reply() {
        let (g, cfg, home, b, _) = home_and_worker();
        let selection = ExpertSelection::same_in_every_layer(&b, cfg.n_layer);
        let spec = LoadSpec::experts_only(0..cfg.n_layer, selection);
        let load = |budget| {
            // Without reading ahead or filling every read is a miss's, within the request
            // that made it.
            let streaming = tessera_engine::ExpertStreaming {
                prefetch: false,
                fill: false,
                ..tessera_engine::ExpertStreaming::with_budget(budget)
            };
            Model::load_streaming(&g, spec.clone(), streaming, 1, &mut |_, _| {}).unwrap()
        };
        // Room for two of its experts: most lookups miss.
        let one = load(u64::MAX / 2).expert_stats().unwrap().expert_bytes;
        let worker = Arc::new(load(2 * one));
        let mut peers = RemotePeers::new(vec![RemotePeer {
            name: "b".into(),
            experts: vec![b; cfg.n_layer],
            link: Box::new(spawn_worker(worker.clone())),
        }]);
        let tokens = [1u32, 403, 407, 261, 378, 300, 42];
        let mut kv = home.new_kv(64);
        for (pos, t) in tokens.iter().enumerate() {
            let mut h = home.embed(&[*t]).unwrap();
            let step = [tessera_engine::SeqStep {
                n_tokens: 1,
                start_pos: pos,
            }];
            let mut exec = peers.executor(&home);
            home.run_layers(0..cfg.n_layer, &mut h, &step, &mut [&mut kv], &mut exec)
                .unwrap();
        }
        let owner = worker.expert_stats().unwrap();
        let reported = peers.traffic.owners;
        assert!(owner.misses > 0, "{owner:?}");
        assert_eq!(reported.lookups, owner.lookups);
        assert_eq!(reported.misses, owner.misses);
        assert_eq!(reported.disk_bytes, owner.bytes_read);
        assert!(reported.slowest_serve_ns > 0);
        // The home waits at least the owner's time less its own part, never more than it all.
        assert!(reported.reply_wait_ns > 0);
    }

    /// A link whose worker answers with a NaN in its first computed slot.
    struct PoisonedLink(MemLink, usize);

    impl ExpertLink for PoisonedLink {
        fn send(&mut self, kind: u16, payload: Vec<u8>) -> Result<(), String> {
            self.0.send(kind, payload)
        }
        fn recv(&mut self) -> Result<(u16, Vec<u8>), String> {
            let (kind, payload) = self.0.recv()?;
            let mut reply = ExpertReply::decode(&payload, self.1).map_err(|e| e.to_string())?;
            if let Some(v) = reply.outputs.slots.iter_mut().flatten().next() {
                v[0] = f32::NAN;
            }
            Ok((kind, reply.encode()))
        }
    }

    /// A peer's NaN never reaches the reduction: the step fails and names the peer.
    #[test]
    fn non_finite_expert_outputs_from_a_peer_fail_the_step_naming_it() {
        let (_, cfg, home, b, worker) = home_and_worker();
        let mut peers = RemotePeers::new(vec![RemotePeer {
            name: "liar".into(),
            experts: vec![b; cfg.n_layer],
            link: Box::new(PoisonedLink(spawn_worker(worker), cfg.n_embd)),
        }]);
        let tokens = [1u32, 403, 407, 261, 378, 300, 42];
        let mut kv = home.new_kv(64);
        let mut h = home.embed(&tokens).unwrap();
        let step = [tessera_engine::SeqStep {
            n_tokens: tokens.len(),
            start_pos: 0,
        }];
        let e = home
            .run_layers(
                0..cfg.n_layer,
                &mut h,
                &step,
                &mut [&mut kv],
                &mut peers.executor(&home),
            )
            .unwrap_err();
        let EngineError::ExpertPeer { peer, fault } = &e else {
            panic!("{e}")
        };
        assert_eq!(peer, "liar");
        assert!(
            matches!(
                fault.downcast_ref::<ExpertPeerFault>(),
                Some(ExpertPeerFault::NonFinite { layer: 0, .. })
            ),
            "{e}"
        );
    }
}
