//! What `tessera lab hop`, `pipeline` and `cells` share: a scenario of equal hosts, the two
//! placements hop and pipeline compare (one node holding every layer, a ring of equal stages),
//! medians and the load average.

use std::path::{Path, PathBuf};

use tessera_placement::assignment::PlanFile;
use tessera_proto::StageSpec;

use crate::error::{LabError, Result};
use crate::scenario::Scenario;

/// Name of the `i`th node of a ring: `s0`, `s1`, …
pub(crate) fn node(i: usize) -> String {
    format!("s{i}")
}

/// The scenario of `nodes` equal hosts ([`node`] names) joined by links of `rtt_ms` round
/// trip at 10 Gbit/s, each capped at `cpu_quota` cores when given, planning single nodes and
/// stage rings for `context` positions; `file` names it in errors.
pub(crate) struct EqualHosts<'a> {
    pub file: &'a str,
    pub model: &'a Path,
    pub nodes: usize,
    pub rtt_ms: f64,
    pub context: usize,
    pub tokens: usize,
    pub threads: usize,
    pub cpu_quota: Option<f64>,
}

impl EqualHosts<'_> {
    pub(crate) fn scenario(&self) -> Result<Scenario> {
        let nodes: String = (0..self.nodes)
            .map(|i| {
                format!(
                    "[[node]]\nname = \"{}\"\nprofile = \"laptop-16gb\"\n",
                    node(i)
                )
            })
            .collect();
        let quotas: String = self
            .cpu_quota
            .map(|q| {
                (0..self.nodes)
                    .map(|i| format!("[[lab.node]]\nname = \"{}\"\ncpu_quota = {q}\n", node(i)))
                    .collect()
            })
            .unwrap_or_default();
        let text = format!(
            r#"
[defaults]
link = {{ rtt_ms = {rtt_ms}, bandwidth = "10Gbit/s" }}
[policy]
strategies = ["single", "stage"]
context = {context}
{nodes}[model]
gguf = {model:?}
[workload]
tokens = {tokens}
[lab]
threads = {threads}
{quotas}"#,
            rtt_ms = self.rtt_ms,
            context = self.context,
            model = self.model.display().to_string(),
            tokens = self.tokens,
            threads = self.threads,
        );
        Scenario::parse(Path::new(self.file), &text)
    }
}

/// Writes the two placements into `dir`: `single.json` (node 0 holding all `n_layer` layers)
/// and `ring.json` (`stages` equal stages, [`split`]); their paths.
pub(crate) fn placements(dir: &Path, n_layer: usize, stages: usize) -> Result<(PathBuf, PathBuf)> {
    let single = dir.join("single.json");
    write_plan(&single, vec![stage(0, 0..n_layer)])?;
    let ring = dir.join("ring.json");
    let parts = split(n_layer, stages).into_iter().enumerate();
    write_plan(&ring, parts.map(|(i, r)| stage(i, r)).collect())?;
    Ok((single, ring))
}

/// Node `i` ([`node`]) holding `layers`.
pub(crate) fn stage(i: usize, layers: std::ops::Range<usize>) -> StageSpec {
    StageSpec {
        node: Some(node(i)),
        layers,
    }
}

/// Writes the plan file of `stages` to `path`, as the type `tessera run --plan FILE` reads.
pub(crate) fn write_plan(path: &Path, stages: Vec<StageSpec>) -> Result<()> {
    let text = serde_json::to_string(&PlanFile { stages }).expect("a plan file serializes");
    std::fs::write(path, text).map_err(|e| LabError::io(format!("writing {}", path.display()), e))
}

/// `n_layer` layers in `stages` equal contiguous ranges.
pub fn split(n_layer: usize, stages: usize) -> Vec<std::ops::Range<usize>> {
    let stages = stages.clamp(1, n_layer.max(1));
    (0..stages)
        .map(|i| (i * n_layer / stages)..((i + 1) * n_layer / stages))
        .collect()
}

/// The machine's 1-minute load average.
pub(crate) fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The middle value (the upper of the two middle ones), NaN for none.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ring_splits_the_layers_into_equal_contiguous_ranges() {
        assert_eq!(split(28, 3), vec![0..9, 9..18, 18..28]);
        assert_eq!(split(2, 3), vec![0..1, 1..2]);
    }

    #[test]
    fn the_placements_are_node_0_alone_and_the_ring_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (single, ring) = placements(dir.path(), 5, 2).unwrap();
        let read = |p: &Path| -> Vec<(Option<String>, std::ops::Range<usize>)> {
            let f: PlanFile = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
            f.stages.into_iter().map(|s| (s.node, s.layers)).collect()
        };
        assert_eq!(read(&single), [(Some("s0".into()), 0..5)]);
        assert_eq!(
            read(&ring),
            [(Some("s0".into()), 0..2), (Some("s1".into()), 2..5)]
        );
        let s = EqualHosts {
            file: "t.toml",
            model: Path::new("m.gguf"),
            nodes: 3,
            rtt_ms: 1.0,
            context: 64,
            tokens: 8,
            threads: 1,
            cpu_quota: Some(0.5),
        }
        .scenario()
        .unwrap();
        assert_eq!(s.workload.tokens, 8);
        assert_eq!(s.cpu_quota("s2"), Some(0.5));
    }
}
