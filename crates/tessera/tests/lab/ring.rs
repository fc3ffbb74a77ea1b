//! A stage split over three lab hosts on 2 ms links: the text of one process, a decode step no
//! shorter than the ring's hops, the ring's traffic through the switch, and no namespace left
//! behind.

use std::path::PathBuf;
use std::time::Duration;

use crate::common::{self, model, Server};
use crate::{lab_or_skip, PROMPT};
use tessera_lab::cluster::{Cluster, ClusterOptions};
use tessera_lab::{HostSpec, LabSpec};
use tessera_linkemu::Impairment;

const TOKENS: usize = 40;
/// One-way delay of every link.
const LINK: Duration = Duration::from_millis(2);

/// The text one process gives for the same request, through the same API.
fn one_process_text() -> String {
    let server = Server::start(&[
        "--model",
        &model("stories260K.gguf").display().to_string(),
        "-t",
        "1",
    ]);
    let body = serde_json::json!({
        "model": "stories260K", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
    });
    let r = common::post(&server.addr, "/v1/completions", &body).json();
    r["choices"][0]["text"]
        .as_str()
        .expect("a completion")
        .to_string()
}

#[test]
fn a_stage_split_over_three_hosts_on_2ms_links_gives_the_text_of_one_process() {
    let spec = LabSpec::new(vec![
        HostSpec::new("coord"),
        HostSpec::new("a"),
        HostSpec::new("b"),
    ])
    .default_link(Impairment::default().delay(LINK));
    let Some(lab) = lab_or_skip(&spec) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(
        &lab,
        &ClusterOptions {
            tessera: PathBuf::from(common::bin()),
            model: model("stories260K.gguf"),
            dir: dir.path().to_path_buf(),
            coordinator: 0,
            nodes: vec![1, 2],
            split: None,
            threads: 1,
            timeout: Duration::from_secs(120),
        },
    )
    .unwrap_or_else(|e| panic!("starting the cluster in the lab: {e}"));
    // A warm-up, so the measured request does not pay the first sequence's set-up.
    cluster.complete(&lab, PROMPT, 4).unwrap();
    let c = cluster.complete(&lab, PROMPT, TOKENS).unwrap();
    assert_eq!(
        c.text,
        one_process_text(),
        "the lab's stage split and one process differ"
    );

    // Each decoded token crosses the ring: a → b → a, two one-way hops over 2 ms links. Below
    // that the switch did not impose the delay; the figure itself is printed.
    let step = c.decode_step_s().expect("several tokens were streamed");
    let hops = 2.0;
    eprintln!(
        "decode step {:.2} ms over {hops} hops of {:?} (hop cost beyond the link: {:.2} ms)",
        step * 1e3,
        LINK,
        (step - hops * LINK.as_secs_f64()) * 1e3 / hops
    );
    assert!(
        step >= hops * LINK.as_secs_f64(),
        "a token took {:.2} ms, less than its {hops} hops of {LINK:?}",
        step * 1e3
    );
    // Every packet between the hosts crossed the switch: the ring's traffic is on a ↔ b.
    let a_to_b = lab.switch().stats(1, 2);
    assert!(
        a_to_b.packets_out > 0 && a_to_b.dropped() == 0,
        "{a_to_b:?}"
    );
    drop(cluster);
    let id = lab.id().to_string();
    drop(lab);
    assert!(
        tessera_lab::netns::list(&id).is_empty(),
        "the lab's namespaces outlived it"
    );
}
