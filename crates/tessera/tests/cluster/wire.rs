//! In-process clients over the real transport, against the coordinator process.

use std::time::Duration;

use crate::common::model;
use crate::Cluster;
use tessera_net::{Endpoint, NodeIdentity};
use tessera_node::agent::JoinTarget;
use tessera_proto::{frame, stream, ClientToCoord, CoordToClient, Hello, Role, PROTOCOL_VERSION};
use tessera_sampling::SamplingParams;

fn hello(name: &str, version: u32) -> ClientToCoord {
    ClientToCoord::Hello(Hello {
        protocol_version: version,
        role: Role::Client,
        name: name.into(),
        inventory: None,
        memory_budget_bytes: None,
        models: vec![],
    })
}

/// A client endpoint on loopback with a fresh identity (inside a runtime).
fn client_endpoint() -> Endpoint {
    let id = NodeIdentity::generate().unwrap();
    Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        &id,
        tessera_net::AllowList::new(),
    )
    .unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn a_cancelled_sequence_stops_and_every_stage_closes_it() {
    let mut c = Cluster::start(&model("stories260K.gguf"));
    c.add_node("a", &[]);
    c.add_node("b", &[]);
    let target: JoinTarget = c.operator.parse().unwrap();
    rt().block_on(async {
        let ep = client_endpoint();
        let conn = ep.enroll(target.addr, &target.token).await.unwrap();
        let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
        s.writer
            .write_message(frame::MSG, &hello("canceller", PROTOCOL_VERSION))
            .await
            .unwrap();
        let w = s
            .reader
            .read_message::<CoordToClient>(frame::MSG)
            .await
            .unwrap();
        assert!(matches!(w, CoordToClient::Welcome { .. }));
        let req = tessera_proto::RunRequest {
            prompt: Some("Once upon a time".into()),
            prompt_tokens: None,
            max_new_tokens: 400,
            sampling: SamplingParams::greedy(),
            stages: Some(tessera_placement::assignment::parse_split("0..2,2..5").unwrap()),
            prefill_chunk: 64,
            trace: false,
            stop_at_eog: false,
            grammar: None,
            logprobs: None,
            speculate: 0,
            prediction: None,
        };
        s.writer
            .write_message(frame::MSG, &ClientToCoord::Run(Box::new(req)))
            .await
            .unwrap();
        let mut cancelled = false;
        let report = loop {
            match s
                .reader
                .read_message::<CoordToClient>(frame::MSG)
                .await
                .unwrap()
            {
                CoordToClient::Token { seq, .. } if !cancelled => {
                    s.writer
                        .write_message(frame::MSG, &ClientToCoord::Cancel { seq })
                        .await
                        .unwrap();
                    cancelled = true;
                }
                CoordToClient::Done(r) => break r,
                CoordToClient::Error { message } => panic!("{message}"),
                _ => {}
            }
        };
        assert_eq!(report.reason, tessera_proto::FinishReason::Cancelled);
        assert!(report.generated < 400, "{}", report.generated);
        // Both stages closed the sequence (freeing its KV cache) and reported on it.
        assert_eq!(report.stage_stats.len(), 2);
        assert!(report.stage_stats.iter().all(|s| s.prefill.steps > 0));
    });
}

#[test]
fn unenrolled_key_gets_nothing_without_the_token() {
    let c = Cluster::start(&model("stories260K.gguf"));
    let target: JoinTarget = c.join.parse().unwrap();
    rt().block_on(async {
        let ep = client_endpoint();
        // Dial with the coordinator pinned, but skip enrolment and talk straight away.
        let coord = target.token.coordinator().unwrap();
        let r = async {
            let conn = ep.connect(target.addr, coord).await?;
            let mut s = conn.open_stream(stream::CONTROL).await?;
            s.writer
                .write_message(frame::MSG, &hello("x", PROTOCOL_VERSION))
                .await?;
            let answer = s.reader.read_frame().await?;
            let after = s.reader.read_frame().await;
            Ok::<_, tessera_net::NetError>((answer, after))
        };
        let (answer, after) = tokio::time::timeout(Duration::from_secs(30), r)
            .await
            .expect("the coordinator neither answered nor refused")
            .expect("the refusal is readable");
        // Admitted for enrolment only: anything but an enrolment claim is refused with an
        // enrolment-refused frame (kind 0xFF22) carrying the reason, and nothing else
        // follows: no welcome, no message.
        let f = answer.expect("a refusal frame, not silence");
        assert_eq!(f.kind, 0xFF22, "not an enrolment refusal: {f:?}");
        assert_eq!(&f.payload[..], b"expected an enrolment stream");
        assert!(
            matches!(after, Ok(None) | Err(_)),
            "more after the refusal: {after:?}"
        );
    });
}

/// A node's own port (ring and expert streams) admits only keys the coordinator placed
/// there: a fresh key, pinned to the node's id, gets no stream of either kind.
#[test]
fn unenrolled_key_is_refused_by_a_nodes_ring_and_expert_streams() {
    let mut c = Cluster::start(&model("stories260K.gguf"));
    c.add_node("a", &[]);
    let mut field = |event: &str, field: &str| {
        c.nodes[0].wait_event(&[("event", event)])[field]
            .as_str()
            .unwrap_or_else(|| panic!("no {field} in the node's {event} event"))
            .to_string()
    };
    let id: tessera_net::NodeId = field("identity", "node_id").parse().unwrap();
    let addr: std::net::SocketAddr = field("listening", "addr").parse().unwrap();
    rt().block_on(async {
        let ep = client_endpoint();
        for kind in [stream::RING, stream::EXPERT] {
            let r = async {
                let conn = ep.connect(addr, id).await?;
                let mut s = conn.open_stream(kind).await?;
                s.writer.write_frame(frame::MSG, b"{}").await?;
                s.reader.read_frame().await
            };
            let r = tokio::time::timeout(Duration::from_secs(30), r)
                .await
                .expect("the node neither answered nor refused");
            let err = r.expect_err("an unenrolled key got a stream").to_string();
            eprintln!("REFUSAL(node {kind}): {err}");
            assert!(
                err.contains("unknown node key"),
                "stream {kind:#06x}: {err}"
            );
        }
    });
}

#[test]
fn oversized_malformed_and_wrong_version_frames_fail_only_their_stream() {
    let c = Cluster::start(&model("stories260K.gguf"));
    let target: JoinTarget = c.operator.parse().unwrap();
    rt().block_on(async {
        let ep = client_endpoint();
        let conn = ep.enroll(target.addr, &target.token).await.unwrap();

        // 1. A header declaring a 1 GiB frame: refused before allocation, stream closed.
        let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
        let mut h = vec![0x54, 1];
        h.extend_from_slice(&frame::MSG.to_be_bytes());
        h.extend_from_slice(&(1u32 << 30).to_be_bytes());
        s.writer.get_mut().write_all(&h).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), s.reader.read_frame()).await;
        assert!(
            matches!(r, Ok(Ok(None)) | Ok(Err(_))),
            "oversized frame: {r:?}"
        );

        // 2. A frame of the right size that is not JSON.
        let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
        s.writer
            .write_frame(frame::MSG, b"{not json")
            .await
            .unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), s.reader.read_frame()).await;
        assert!(
            matches!(r, Ok(Ok(None)) | Ok(Err(_))),
            "malformed frame: {r:?}"
        );

        // 3. Another wire version: a clear error on the coordinator, this stream only.
        let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
        let mut h = vec![0x54, 9];
        h.extend_from_slice(&frame::MSG.to_be_bytes());
        h.extend_from_slice(&2u32.to_be_bytes());
        h.extend_from_slice(b"{}");
        s.writer.get_mut().write_all(&h).await.unwrap();
        let r = tokio::time::timeout(Duration::from_secs(10), s.reader.read_frame()).await;
        assert!(
            matches!(r, Ok(Ok(None)) | Ok(Err(_))),
            "wrong version: {r:?}"
        );

        // 4. Another protocol version in the hello: refused by name.
        let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
        s.writer
            .write_message(frame::MSG, &hello("old", 99))
            .await
            .unwrap();
        match s
            .reader
            .read_message::<CoordToClient>(frame::MSG)
            .await
            .unwrap()
        {
            CoordToClient::Refused { reason } => {
                assert!(reason.contains("protocol version mismatch"), "{reason}")
            }
            other => panic!("{other:?}"),
        }

        // The same connection still serves a well-formed session.
        let mut s = conn.open_stream(stream::CONTROL).await.unwrap();
        s.writer
            .write_message(frame::MSG, &hello("fine", PROTOCOL_VERSION))
            .await
            .unwrap();
        let w = s
            .reader
            .read_message::<CoordToClient>(frame::MSG)
            .await
            .unwrap();
        assert!(matches!(w, CoordToClient::Welcome { .. }), "{w:?}");
        s.writer
            .write_message(frame::MSG, &ClientToCoord::Status)
            .await
            .unwrap();
        let st = s
            .reader
            .read_message::<CoordToClient>(frame::MSG)
            .await
            .unwrap();
        assert!(matches!(st, CoordToClient::Status { .. }), "{st:?}");
    });
}
