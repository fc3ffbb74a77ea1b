//! The in-memory network and the simulated nodes' side of it: delays, connections, messages
//! in both directions, and the ring's steps.

use super::*;

impl World {
    pub(super) fn latency(&mut self, node: usize) -> Duration {
        let base = self.ms(0, 3) + self.extra_latency;
        match self.nodes[node].partitioned_until {
            Some(t) if t > self.now => (t - self.now) + base,
            _ => base,
        }
    }

    /// When a message sent now on `node`'s stream in direction `up` arrives (in order).
    pub(super) fn arrival(&mut self, node: usize, up: bool) -> Duration {
        let t = self.now + self.latency(node);
        let clock = self.stream_clock.entry((node, up)).or_default();
        *clock = (*clock).max(t);
        *clock
    }

    pub(super) fn node_send(&mut self, node: usize, msg: NodeToCoord) {
        let Some(conn) = self.nodes[node].conn else {
            return;
        };
        let t = self.arrival(node, true);
        self.at(t, Ev::ToCoord { node, conn, msg });
    }

    /// The coordinator sends on its session with `node`; false if it has none.
    pub(super) fn coord_send(&mut self, node: usize, msg: CoordToNode) -> bool {
        let Some(conn) = self.coord_conn[node] else {
            return false;
        };
        if let CoordToNode::Assign(a) = &msg {
            self.given.insert((self.nodes[node].id, a.epoch));
        }
        let t = self.arrival(node, false);
        self.at(t, Ev::ToNode { node, conn, msg });
        true
    }

    pub(super) fn index(&self, id: NodeId) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    pub(super) fn connect(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        if !n.alive || n.conn.is_some() {
            return;
        }
        self.next_conn += 1;
        let conn = self.next_conn;
        n.conn = Some(conn);
        let life = n.incarnation;
        self.node_send(
            node,
            NodeToCoord::Listening {
                addr: "127.0.0.1:1".parse().expect("an address"),
                advertised: false,
            },
        );
        self.after(self.cfg.lease / 4, Ev::Beat { node, life });
    }

    // ---- the node side -------------------------------------------------------------------

    pub(super) fn node_receives(
        &mut self,
        node: usize,
        conn: u64,
        msg: CoordToNode,
    ) -> Result<(), Violation> {
        let n = &self.nodes[node];
        if !n.alive || n.conn != Some(conn) {
            return Ok(());
        }
        if let Some(until) = n.frozen_until.filter(|t| *t > self.now) {
            self.at(until, Ev::ToNode { node, conn, msg });
            return Ok(());
        }
        let life = n.incarnation;
        for effect in self.nodes[node].handle(msg) {
            match effect {
                NodeEffect::Reply(m) => self.node_send(node, m),
                NodeEffect::LoadLater(epoch) => {
                    let d = self.ms(1, 200);
                    self.after(d, Ev::LoadDone { node, life, epoch });
                }
                NodeEffect::RingStart(seq) => {
                    // The hidden state goes round the ring to the sampler.
                    if let Some(sampler) = self.sampler_of(node, seq) {
                        let life = self.nodes[sampler].incarnation;
                        let d = self.ms(1, 20);
                        self.after(
                            d,
                            Ev::RingStep {
                                node: sampler,
                                life,
                                seq,
                            },
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// The node that samples `seq` in the epoch `node` holds it under.
    pub(super) fn sampler_of(&self, node: usize, seq: u64) -> Option<usize> {
        let epoch = self.nodes[node].seqs.get(&seq)?.epoch;
        self.nodes
            .iter()
            .position(|n| n.held(epoch).is_some_and(|h| h.head))
    }

    /// One lap of the ring for `seq`, computed at its sampler.
    pub(super) fn ring_step(&mut self, node: usize, life: u64, seq: u64) -> Result<(), Violation> {
        let n = &self.nodes[node];
        if !n.alive || n.incarnation != life {
            return Ok(());
        }
        let Some(s) = n.seqs.get(&seq) else {
            return Ok(());
        };
        let epoch = s.epoch;
        // Every stage of the epoch must be up and reachable for the lap to complete.
        let ring: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].held(epoch).is_some())
            .collect();
        let stalled = ring
            .iter()
            .chain([&node])
            .filter_map(|&i| self.nodes[i].frozen_until.filter(|t| *t > self.now))
            .max();
        if let Some(until) = stalled {
            self.at(until, Ev::RingStep { node, life, seq });
            return Ok(());
        }
        let broken = ring.iter().any(|&i| {
            self.nodes[i].partitioned(self.now) || !self.nodes[i].seqs.contains_key(&seq)
        }) || ring.len() < self.stage_count_of(epoch);
        if broken {
            // A stage sees its neighbour's stream fail and reports it.
            self.node_send(
                node,
                NodeToCoord::Finished {
                    seq,
                    reason: FinishReason::Error,
                    generated: 0,
                    error: Some("the ring is broken".into()),
                },
            );
            return Ok(());
        }
        let s = self.nodes[node].seqs.get_mut(&seq).expect("checked above");
        let token = next_token(s.seed, &s.history, VOCAB);
        let pos = s.history.len();
        let generated = pos - s.prompt_len;
        if s.eog.contains(&token) {
            let end = NodeToCoord::Finished {
                seq,
                reason: FinishReason::EndOfGeneration,
                generated,
                error: None,
            };
            self.node_send(node, end);
            return Ok(());
        }
        s.history.push(token);
        s.remaining = s.remaining.saturating_sub(1);
        let remaining = s.remaining;
        self.node_send(
            node,
            NodeToCoord::Token {
                seq,
                pos,
                token,
                logprobs: None,
            },
        );
        if remaining == 0 {
            let end = NodeToCoord::Finished {
                seq,
                reason: FinishReason::Length,
                generated: generated + 1,
                error: None,
            };
            self.node_send(node, end);
        } else {
            let d = self.ms(10, 150);
            self.after(d, Ev::RingStep { node, life, seq });
        }
        Ok(())
    }

    /// How many stages epoch `epoch` has (from the membership, when it is a cell's latest).
    pub(super) fn stage_count_of(&self, epoch: u64) -> usize {
        self.cluster
            .membership()
            .epoch_with_id(epoch)
            .map_or(0, |e| e.stages.len())
    }

    // ---- the coordinator side ------------------------------------------------------------

    pub(super) fn coord_receives(
        &mut self,
        node: usize,
        conn: u64,
        msg: NodeToCoord,
    ) -> Result<(), Violation> {
        let id = self.nodes[node].id;
        if let NodeToCoord::Listening { addr, .. } = msg {
            self.heard[node] = self.now;
            // A new session: the hello, as the server takes it.
            if let Some(old) = self.coord_conn[node].replace(conn) {
                if old != conn {
                    let d = self.latency(node);
                    self.after(d, Ev::Closed { node, conn: old });
                }
            }
            let key = tessera_net::NodeIdentity::from_seed(identity_seed(node)).public_key();
            debug_assert_eq!(key.node_id(), id);
            let member = Member {
                session: conn,
                ..Member::hello(key, self.nodes[node].name.clone(), addr)
            };
            self.coord(ClusterInput::Joined(Box::new(member)))?;
            self.worker_joined(node, conn)?;
            return self.maybe_plan();
        }
        if self.coord_conn[node] != Some(conn) {
            return Ok(()); // that session is closed
        }
        self.heard[node] = self.now;
        if let NodeToCoord::Linked { epoch, .. } = &msg {
            self.linked.insert((id, *epoch));
        }
        self.coord(ClusterInput::Node {
            node: id,
            session: conn,
            msg,
        })
    }
}
