//! Speculative decoding on a ring of three node processes: prompt lookup and a predicted
//! answer give the tokens and log-probabilities of a run without speculation, in fewer turns.

use crate::common::{model, report_of};
use crate::Cluster;
use serde_json::Value;

/// Speculation on a ring of three node processes (`tessera run --speculate 4`): the tokens
/// and log-probabilities are those without it, greedy and seeded, while the sampling stage's
/// drafts were accepted and the ring turned fewer times.
#[test]
fn speculation_on_a_three_stage_ring_gives_the_same_tokens_and_logprobs() {
    let path = model("stories260K.gguf");
    let mut c = Cluster::start(&path);
    for name in ["a", "b", "c"] {
        c.add_node(name, &[]);
    }
    // A story that begins again: prompt lookup finds what followed the first time.
    let prompt = "Once upon a time, there was a little girl named Lily. She liked to play \
                  outside. Once upon a time, there was a little";
    let tokens = |msgs: &[Value]| -> Vec<(Value, Value)> {
        msgs.iter()
            .filter(|m| m["type"] == "token")
            .map(|m| (m["token"].clone(), m["logprobs"].clone()))
            .collect()
    };
    for sampling in [
        &["--temperature", "0"][..],
        &["--temperature", "0.8", "--seed", "5"][..],
    ] {
        let base = [
            &[
                "-p",
                prompt,
                "-n",
                "40",
                "--split",
                "0..1,1..3,3..5",
                "--top-logprobs",
                "2",
            ][..],
            sampling,
        ]
        .concat();
        let (out, plain) = c.run_json(&base);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (out, spec) = c.run_json(&[&base[..], &["--speculate", "4"]].concat());
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(tokens(&spec).len(), 40, "{sampling:?}");
        assert!(
            tokens(&spec)[0].1.is_object(),
            "log-probabilities are compared"
        );
        assert_eq!(tokens(&spec), tokens(&plain), "{sampling:?}");
        let (with, without) = (
            &report_of(&spec)["stage_stats"],
            &report_of(&plain)["stage_stats"],
        );
        assert!(
            with[2]["drafts_accepted"].as_u64().unwrap() > 0,
            "{sampling:?}: {with}"
        );
        assert_eq!(without[2]["drafted"].as_u64(), Some(0));
        let turns = |s: &Value| s[0]["decode"]["steps"].as_u64().unwrap();
        assert!(
            turns(with) < turns(without),
            "{sampling:?}: {with} against {without}"
        );
        // The answer predicted (`--prediction-file`): drafted from its first token, every
        // draft stands, the same tokens in fewer turns than lookup took.
        let text: String = plain
            .iter()
            .filter(|m| m["type"] == "token")
            .map(|m| m["text"].as_str().unwrap())
            .collect();
        let file = std::env::temp_dir().join(format!("prediction-{}.txt", std::process::id()));
        std::fs::write(&file, &text).unwrap();
        let predicted = [
            &base[..],
            &[
                "--speculate",
                "4",
                "--prediction-file",
                file.to_str().unwrap(),
            ],
        ]
        .concat();
        let (out, pred) = c.run_json(&predicted);
        let _ = std::fs::remove_file(&file);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(tokens(&pred), tokens(&plain), "{sampling:?}: predicted");
        let p = &report_of(&pred)["stage_stats"];
        assert_eq!(
            p[2]["drafts_accepted"], p[2]["drafted"],
            "{sampling:?}: {p}"
        );
        assert!(turns(p) < turns(with), "{sampling:?}: {p} against {with}");
    }
}
