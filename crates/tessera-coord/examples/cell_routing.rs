//! What routing a request to a cell costs the coordinator: the router's decision
//! ([`tessera_coord::cells`]) for 4 and 64 ready cells, alone and with the loads read from the
//! membership and the request seated, as the driver does per request. A benchmark, not a test.
//!
//!     cargo run --release -p tessera-coord --example cell_routing

use std::hint::black_box;
use std::time::Instant;

use tessera_coord::cells::{choose, CellBook};
use tessera_coord::membership::{Event, Member, Membership};
use tessera_host::ContentHash;
use tessera_net::NodeIdentity;
use tessera_proto::LoadReport;

/// A membership of `n` single-node cells, every one ready, each node with a budget.
fn cells(n: usize) -> Membership {
    let mut m = Membership::new();
    let mut stages = Vec::new();
    for i in 0..n {
        let id = NodeIdentity::from_seed([i as u8 + 1; 32]);
        let addr = format!("127.0.0.1:{}", 4000 + i).parse().unwrap();
        m.handle(Event::Joined(Box::new(Member {
            memory_budget_bytes: Some(8 << 30),
            session: 1,
            ..Member::hello(id.public_key(), format!("n{i}"), addr)
        })));
        stages.push((id.node_id(), 0..28));
    }
    m.handle(Event::Plan {
        model: ContentHash([7; 32]),
        stages,
        n_layer: 28,
        max_context: 4096,
    });
    let epochs: Vec<(u64, tessera_net::NodeId)> = m
        .cells()
        .iter()
        .map(|e| (e.id, e.stages[0].node_id))
        .collect();
    for (epoch, node) in epochs {
        m.handle(Event::Loaded {
            node,
            epoch,
            report: LoadReport::default(),
        });
        m.handle(Event::Linked {
            node,
            epoch,
            link: None,
        });
    }
    assert_eq!(m.ready_cells().count(), n);
    m
}

fn main() {
    const DECISIONS: u64 = 200_000;
    for n in [4usize, 64] {
        let m = cells(n);
        let mut book = CellBook::default();
        // A loaded cluster: 8 requests seated per cell, each reserving 1,024 positions.
        let mut seq = 0;
        for e in m.ready_cells() {
            for _ in 0..8 {
                book.seat(seq, e.id, 1024);
                seq += 1;
            }
            book.measured(e.id, 64, 64.0 / (20.0 + (e.id % 5) as f64));
        }
        let loads = book.loads(&m);
        let t = Instant::now();
        for _ in 0..DECISIONS {
            black_box(choose(black_box(&loads), 1024, 4096, None).unwrap());
        }
        let decide = t.elapsed().as_nanos() as f64 / DECISIONS as f64;
        // As per request in the driver: read the loads, choose, seat, and later unseat.
        let t = Instant::now();
        for i in 0..DECISIONS {
            let loads = book.loads(&m);
            let e = choose(&loads, 1024, 4096, None).unwrap();
            book.seat(1_000_000 + i, e, 1024);
            book.unseat(1_000_000 + i);
        }
        let full = t.elapsed().as_nanos() as f64 / DECISIONS as f64;
        println!(
            "{n:>3} ready cells, {} requests seated: choose {decide:.0} ns; loads + choose + seat \
             + unseat {full:.0} ns per request",
            8 * n
        );
    }
}
