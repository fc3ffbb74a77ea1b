//! `tessera lab hop`: what one hop adds per token, on a switched link and on loopback.

use std::time::Duration;

use crate::{lab_can_run, tessera_json};

/// `tessera lab hop` gives the hop figure on a switched link and on loopback: each from a
/// single node and a two-node ring that both ran, and the link's measured round trip.
#[test]
fn lab_hop_reports_what_a_hop_adds_on_a_switched_link_and_on_loopback() {
    if !lab_can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let figures: Vec<serde_json::Value> = serde_json::from_value(tessera_json::<&std::ffi::OsStr>(
        [
            "lab".as_ref(),
            "hop".as_ref(),
            "--json".as_ref(),
            "--tokens".as_ref(),
            "32".as_ref(),
            "--rounds".as_ref(),
            "2".as_ref(),
            "--dir".as_ref(),
            dir.path().as_os_str(),
        ],
        Duration::from_secs(120),
    ))
    .unwrap();
    assert_eq!(figures.len(), 2, "{figures:?}");
    assert_eq!(figures[0]["requested_rtt_ms"], 0.5);
    assert!(figures[1]["requested_rtt_ms"].is_null(), "loopback");
    for f in &figures {
        for k in [
            "measured_rtt_ms",
            "single_ms_per_token",
            "ring_ms_per_token",
            "added_per_hop_us",
        ] {
            assert!(f[k].as_f64().is_some_and(f64::is_finite), "{k}: {f}");
        }
        assert!(f["measured_rtt_ms"].as_f64().unwrap() > 0.0, "{f}");
        assert_eq!(f["goal_us"], 50.0);
    }
}
