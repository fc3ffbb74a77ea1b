//! A lab scenario: the planner's cluster file (`[defaults]`, `[policy]`, `[[node]]`,
//! `[[link]]`, read by `tessera_plan`) plus what only the lab needs — the model, the workload,
//! and what the planner's link figures cannot say (jitter, loss) or the lab imposes on a host
//! (CPU share, memory cap):
//!
//! ```toml
//! [model]
//! gguf = "../../../models/test/small-qwen3-Q8_0.gguf"   # relative to the scenario file
//!
//! [workload]
//! prompt = "Once upon a time"
//! tokens = 64                     # decoded per measured request
//! speculate = 8                   # also measure each plan speculating (prompt lookup, k drafts)
//! predict = true                  # ... drafting from the plain request's tokens (the ceiling)
//!
//! [lab]
//! threads = 1                     # compute threads per node
//! [[lab.link]]                    # beyond the planner's round trip and bandwidth
//! nodes = ["laptop", "desk"]
//! jitter_ms = 1.0
//! loss = 0.001
//! [[lab.node]]                    # imposed by the host's cgroup
//! name = "slow"
//! cpu_quota = 0.25                # cores
//! memory = "512MiB"
//! disk = "emmc"                   # reads capped at a profile's rates (tessera_lab::disk)
//! ```
//!
//! [`Scenario::parse`] splits the file: the planner's part is handed to
//! `ResourceGraph::from_toml` unchanged, so prediction and measurement describe the same
//! machines.

mod error;

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use tessera_linkemu::Impairment;
use tessera_plan::ResourceGraph;

use crate::cgroup::Limits;
use crate::disk::DiskProfile;
use crate::error::{LabError, Result};
use crate::lab::{HostSpec, LabSpec};
pub use error::ScenarioError;

/// The host that runs the coordinator (and the client), besides the scenario's nodes.
pub const COORDINATOR_HOST: &str = "lab-coordinator";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelSection {
    gguf: PathBuf,
}

/// What is measured.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    #[serde(default = "default_prompt")]
    pub prompt: String,
    #[serde(default = "default_tokens")]
    pub tokens: usize,
    /// Drafts per ring turn: each plan's requests are measured again speculating by prompt
    /// lookup (`tessera run --speculate`), alternated with the plain ones; 0 = not.
    #[serde(default)]
    pub speculate: usize,
    /// Each speculating request sends the tokens of the plain request before it as its
    /// prediction (`tessera run --prediction-tokens`): a draft that always agrees, as the
    /// target would be its own draft, so what is measured is the mechanism's ceiling. Needs
    /// `speculate`.
    #[serde(default)]
    pub predict: bool,
}

fn default_prompt() -> String {
    "Once upon a time".into()
}
fn default_tokens() -> usize {
    64
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LabSection {
    threads: Option<usize>,
    #[serde(default)]
    link: Vec<LabLink>,
    #[serde(default)]
    node: Vec<LabNode>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LabLink {
    nodes: [String; 2],
    #[serde(default)]
    jitter_ms: f64,
    #[serde(default)]
    loss: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct LabNode {
    name: String,
    cpus: Option<String>,
    cpu_quota: Option<f64>,
    memory: Option<String>,
    disk: Option<String>,
}

/// The sections of a scenario that are the lab's, not the planner's.
pub const LAB_SECTIONS: [&str; 3] = ["model", "workload", "lab"];

/// The planner's part of a scenario (the cluster file without [`LAB_SECTIONS`]), so
/// `tessera plan --nodes SCENARIO` plans the same machines `tessera lab run` builds. Text
/// without those sections is returned unchanged.
pub fn planner_part(text: &str) -> std::result::Result<String, ScenarioError> {
    let mut doc: toml::Table = text.parse().map_err(ScenarioError::Toml)?;
    if !LAB_SECTIONS.iter().any(|k| doc.contains_key(*k)) {
        return Ok(text.to_string());
    }
    for k in LAB_SECTIONS {
        doc.remove(k);
    }
    toml::to_string(&doc).map_err(ScenarioError::PlannerPart)
}

/// The scenario's text with its planner part replaced by `planner` (a cluster file, e.g. a
/// calibrated graph's [`ResourceGraph::to_toml`]) and its model path made absolute, so the
/// result can be saved anywhere and read by `tessera plan --nodes` and `tessera lab run`.
pub fn with_planner_part(scenario: &Scenario, planner: &str) -> Result<String> {
    let bad = |e: &dyn std::fmt::Display| LabError::Spec(format!("writing the scenario: {e}"));
    let old: toml::Table = scenario.text.parse().map_err(|e| bad(&e))?;
    let mut doc: toml::Table = planner.parse().map_err(|e| bad(&e))?;
    for k in LAB_SECTIONS {
        if let Some(v) = old.get(k) {
            doc.insert(k.to_string(), v.clone());
        }
    }
    let model = scenario
        .model
        .canonicalize()
        .unwrap_or_else(|_| scenario.model.clone());
    doc.insert(
        "model".into(),
        toml::Value::Table(toml::Table::from_iter([(
            "gguf".to_string(),
            toml::Value::String(model.display().to_string()),
        )])),
    );
    let body = toml::to_string(&doc).map_err(|e| bad(&e))?;
    Ok(format!(
        "# Scenario {} with its planner part calibrated by `tessera lab run`.\n{body}",
        scenario.name
    ))
}

/// A parsed scenario.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    /// The planner's view, as declared.
    pub graph: ResourceGraph,
    pub model: PathBuf,
    pub workload: Workload,
    pub threads: usize,
    lab: LabSection,
    /// The file as read (for writing it back with a calibrated planner part).
    text: String,
}

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| LabError::io(format!("reading {}", path.display()), e))?;
        Self::parse(path, &text)
    }

    /// Parses `text` (read from `path`, which relative model paths start from).
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        Self::parse_text(path, text).map_err(|problem| LabError::Scenario {
            path: path.display().to_string(),
            problem: Box::new(problem),
        })
    }

    /// [`Scenario::parse`] but for naming the file in the error.
    fn parse_text(path: &Path, text: &str) -> std::result::Result<Self, ScenarioError> {
        fn section(section: &'static str) -> impl Fn(toml::de::Error) -> ScenarioError {
            move |error| ScenarioError::Section { section, error }
        }
        let mut doc: toml::Table = text.parse().map_err(ScenarioError::Toml)?;
        let model: ModelSection = doc
            .remove("model")
            .ok_or(ScenarioError::NoModel)?
            .try_into()
            .map_err(section("model"))?;
        let workload: Workload = match doc.remove("workload") {
            Some(w) => w.try_into().map_err(section("workload"))?,
            None => Workload {
                prompt: default_prompt(),
                tokens: default_tokens(),
                speculate: 0,
                predict: false,
            },
        };
        if workload.predict && workload.speculate == 0 {
            return Err(ScenarioError::PredictWithoutSpeculate);
        }
        let max = tessera_proto::OpenSeq::MAX_SPECULATE;
        if workload.speculate > max {
            return Err(ScenarioError::TooManyDrafts {
                asked: workload.speculate,
                max,
            });
        }
        let lab: LabSection = match doc.remove("lab") {
            Some(l) => l.try_into().map_err(section("lab"))?,
            None => LabSection::default(),
        };
        let rest = toml::to_string(&doc).map_err(ScenarioError::PlannerPart)?;
        let graph = ResourceGraph::from_toml(&rest).map_err(ScenarioError::Cluster)?;
        let names: Vec<&str> = graph.nodes.iter().map(|n| n.name.as_str()).collect();
        for l in &lab.link {
            if let Some(n) = l.nodes.iter().find(|n| !names.contains(&n.as_str())) {
                return Err(ScenarioError::UnknownLinkNode { node: n.clone() });
            }
            if !(0.0..=1.0).contains(&l.loss) || l.jitter_ms < 0.0 {
                return Err(ScenarioError::LinkImpairment {
                    nodes: l.nodes.clone(),
                    loss: l.loss,
                    jitter_ms: l.jitter_ms,
                });
            }
        }
        for n in &lab.node {
            if !names.contains(&n.name.as_str()) {
                return Err(ScenarioError::UnknownLabNode {
                    node: n.name.clone(),
                });
            }
            if let Some(d) = &n.disk {
                if DiskProfile::named(d).is_none() {
                    return Err(ScenarioError::NoDiskProfile {
                        node: n.name.clone(),
                        disk: d.clone(),
                    });
                }
            }
        }
        if names.contains(&COORDINATOR_HOST) {
            return Err(ScenarioError::ReservedHostName);
        }
        let base = path.parent().unwrap_or(Path::new("."));
        Ok(Self {
            name: path
                .file_stem()
                .map_or_else(|| "scenario".into(), |s| s.to_string_lossy().into_owned()),
            graph,
            model: base.join(model.gguf),
            threads: lab.threads.unwrap_or(1).max(1),
            workload,
            lab,
            text: text.to_string(),
        })
    }

    /// The scenario on its first `hosts` nodes only (in file order): the others, their links,
    /// their shares of a machine and their lab settings left out; named `NAME-HOSTSh`. The
    /// points of a scaling curve, each on the same caps as the whole scenario.
    pub fn first_hosts(&self, hosts: usize) -> Result<Self> {
        let total = self.graph.nodes.len();
        if hosts == 0 || hosts > total {
            return Err(LabError::Spec(format!(
                "{}: {hosts} host(s) asked, the scenario has 1 to {total}",
                self.name
            )));
        }
        let mut s = self.clone();
        s.graph.nodes.truncate(hosts);
        let kept: Vec<String> = s.graph.nodes.iter().map(|n| n.name.clone()).collect();
        let keeps = |n: &String| kept.contains(n);
        s.graph.links.retain(|l| keeps(&l.a) && keeps(&l.b));
        for m in &mut s.graph.machines {
            m.nodes.retain(keeps);
        }
        s.graph.machines.retain(|m| !m.nodes.is_empty());
        s.lab.node.retain(|n| keeps(&n.name));
        s.lab.link.retain(|l| l.nodes.iter().all(keeps));
        s.name = format!("{}-{hosts}h", self.name);
        Ok(s)
    }

    /// The CPU quota (cores) the lab imposes on `node`'s host, if any.
    pub fn cpu_quota(&self, node: &str) -> Option<f64> {
        self.lab
            .node
            .iter()
            .find(|l| l.name == node)
            .and_then(|l| l.cpu_quota)
    }

    /// The lab: the coordinator's host first, then one host per node; each pair's link from
    /// the planner's round trip (half each way) and bandwidth, with the lab's jitter and loss.
    pub fn lab_spec(&self) -> Result<LabSpec> {
        let mut hosts = vec![HostSpec::new(COORDINATOR_HOST)];
        for n in &self.graph.nodes {
            let mut h = HostSpec::new(n.name.clone());
            if let Some(l) = self.lab.node.iter().find(|l| l.name == n.name) {
                h.limits = Limits {
                    memory: l
                        .memory
                        .as_deref()
                        .map(tessera_plan::units::parse_bytes)
                        .transpose()
                        .map_err(|e| LabError::Spec(format!("node {}: {e}", n.name)))?
                        .map(|b| b.0),
                    cpus: l.cpus.clone(),
                    cpu_quota: l.cpu_quota,
                    disk: None,
                };
                h.disk = l.disk.as_deref().and_then(DiskProfile::named);
            }
            hosts.push(h);
        }
        let mut spec = LabSpec::new(hosts);
        // A capped host reads the model through its own emulated disk, and its data directory
        // (under the temp dir) under its cgroup's caps.
        spec.disk_paths.push(self.model.clone());
        if let Some(dir) = self.model.parent() {
            let dir = if dir.as_os_str().is_empty() {
                std::path::Path::new(".")
            } else {
                dir
            };
            spec.disk_dirs.push(dir.to_path_buf());
        }
        if let Some(d) = self.graph.default_link {
            spec = spec.default_link(impairment(d.rtt_s, d.bandwidth.0, 0.0, 0.0));
        }
        let nodes = &self.graph.nodes;
        for (i, a) in nodes.iter().enumerate() {
            for b in &nodes[i + 1..] {
                let Some(l) = self.graph.link(&a.name, &b.name) else {
                    continue;
                };
                let extra = self.lab.link.iter().find(|x| {
                    (x.nodes[0] == a.name && x.nodes[1] == b.name)
                        || (x.nodes[0] == b.name && x.nodes[1] == a.name)
                });
                let (jitter, loss) = extra.map_or((0.0, 0.0), |x| (x.jitter_ms, x.loss));
                spec = spec.link(
                    &a.name,
                    &b.name,
                    impairment(l.rtt_s, l.bandwidth.0, jitter, loss),
                );
            }
        }
        Ok(spec)
    }
}

fn impairment(rtt_s: f64, bytes_per_s: f64, jitter_ms: f64, loss: f64) -> Impairment {
    let rate = if bytes_per_s.is_finite() {
        bytes_per_s as u64
    } else {
        0
    };
    Impairment::default()
        .delay(Duration::from_secs_f64((rtt_s / 2.0).max(0.0)))
        .jitter(Duration::from_secs_f64(jitter_ms / 1e3))
        .bandwidth(rate)
        // A queue of 50 ms at the rate, at least 256 KiB.
        .queue_bytes(((rate / 20) as usize).max(256 << 10))
        .loss(loss)
}

#[cfg(test)]
mod tests {
    use super::*;

    const WIFI: &str = r#"
[policy]
strategies = ["single", "stage"]
[[node]]
name = "a"
ram = "16GiB"
mem_bandwidth = "20GB/s"
compute = "200GFLOPS"
[[node]]
name = "b"
ram = "8GiB"
mem_bandwidth = "20GB/s"
compute = "200GFLOPS"
[[link]]
nodes = ["a", "b"]
rtt_ms = 6
bandwidth = "300Mbit/s"
[model]
gguf = "m.gguf"
[workload]
tokens = 16
[lab]
[[lab.link]]
nodes = ["a", "b"]
jitter_ms = 1
loss = 0.001
[[lab.node]]
name = "b"
cpu_quota = 0.5
memory = "1GiB"
disk = "emmc"
"#;

    #[test]
    fn the_planners_part_and_the_labs_part_describe_the_same_link() {
        let s = Scenario::parse(Path::new("/x/wifi.toml"), WIFI).unwrap();
        assert_eq!(s.model, PathBuf::from("/x/m.gguf"));
        assert_eq!(s.workload.tokens, 16);
        assert_eq!(s.graph.link("a", "b").unwrap().rtt_s, 0.006);
        let spec = s.lab_spec().unwrap();
        assert_eq!(spec.hosts[0].name, COORDINATOR_HOST);
        let l = &spec.links[0];
        assert_eq!(l.each_way.delay, Duration::from_millis(3));
        assert_eq!(l.each_way.jitter, Duration::from_millis(1));
        assert_eq!(l.each_way.bandwidth, Some(37_500_000));
        assert_eq!(l.each_way.loss, 0.001);
        assert_eq!(spec.hosts[2].limits.cpu_quota, Some(0.5));
        assert_eq!(spec.hosts[2].limits.memory, Some(1 << 30));
        assert_eq!(spec.hosts[2].disk, DiskProfile::named("emmc"));
        assert_eq!(spec.hosts[1].disk, None);
        assert!(spec.disk_paths.contains(&s.model));
        assert!(spec
            .disk_dirs
            .contains(&s.model.parent().unwrap().to_path_buf()));
    }

    /// Why `text` was refused as a scenario; panics when it was not, or not as a scenario.
    fn refused(text: &str) -> ScenarioError {
        match Scenario::parse(Path::new("w.toml"), text) {
            Err(LabError::Scenario { path, problem }) => {
                assert_eq!(path, "w.toml");
                *problem
            }
            Err(e) => panic!("refused, not as a scenario: {e}"),
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn a_disk_without_a_profile_is_refused_with_the_profiles_named() {
        let e = refused(&WIFI.replace("disk = \"emmc\"", "disk = \"floppy\""));
        assert!(
            matches!(&e, ScenarioError::NoDiskProfile { node, disk } if node == "b" && disk == "floppy"),
            "{e:?}"
        );
        // The profiles to choose from are in what the person reads.
        assert!(e.to_string().contains("emmc"), "{e}");
    }

    #[test]
    fn a_lab_section_naming_an_unknown_node_is_refused() {
        let e = refused(&WIFI.replace("name = \"b\"\ncpu_quota", "name = \"zz\"\ncpu_quota"));
        assert!(
            matches!(&e, ScenarioError::UnknownLabNode { node } if node == "zz"),
            "{e:?}"
        );
        let e = refused(&WIFI.replace(
            "nodes = [\"a\", \"b\"]\njitter_ms",
            "nodes = [\"a\", \"yy\"]\njitter_ms",
        ));
        assert!(
            matches!(&e, ScenarioError::UnknownLinkNode { node } if node == "yy"),
            "{e:?}"
        );
        let e = refused("[[node]]\nname='a'");
        assert!(matches!(e, ScenarioError::NoModel), "{e:?}");
    }

    #[test]
    fn a_lab_section_of_the_wrong_shape_or_range_is_refused_naming_it() {
        let e = refused(&WIFI.replace("tokens = 16", "tokens = 16\nwarmup = 2"));
        assert!(
            matches!(
                e,
                ScenarioError::Section {
                    section: "workload",
                    ..
                }
            ),
            "{e:?}"
        );
        let e = refused(&WIFI.replace("loss = 0.001", "loss = 2.0"));
        assert!(
            matches!(e, ScenarioError::LinkImpairment { loss, .. } if loss == 2.0),
            "{e:?}"
        );
        let e = refused(&WIFI.replace("tokens = 16", "tokens = 16\npredict = true"));
        assert!(matches!(e, ScenarioError::PredictWithoutSpeculate), "{e:?}");
        let e = refused(
            "[[node]]\nname = \"lab-coordinator\"\nprofile = \"laptop-16gb\"\n[model]\ngguf = \"m\"",
        );
        assert!(matches!(e, ScenarioError::ReservedHostName), "{e:?}");
        let e = refused("[[node]]\nname = \"a\"\nprofile = \"no-such\"\n[model]\ngguf = \"m\"");
        assert!(
            matches!(&e, ScenarioError::Cluster(tessera_plan::ClusterError::UnknownProfile(p)) if p == "no-such"),
            "{e:?}"
        );
        let e = refused("[[node]\n");
        assert!(matches!(e, ScenarioError::Toml(_)), "{e:?}");
    }

    #[test]
    fn speculation_in_the_workload_is_read_and_bounded_by_what_a_ring_turn_carries() {
        assert_eq!(
            Scenario::parse(Path::new("w.toml"), WIFI)
                .unwrap()
                .workload
                .speculate,
            0
        );
        let eight = WIFI.replace("tokens = 16", "tokens = 16\nspeculate = 8");
        let s = Scenario::parse(Path::new("w.toml"), &eight).unwrap();
        assert_eq!(s.workload.speculate, 8);
        let e = refused(&WIFI.replace("tokens = 16", "tokens = 16\nspeculate = 17"));
        assert!(
            matches!(e, ScenarioError::TooManyDrafts { asked: 17, max: 16 }),
            "{e:?}"
        );
    }
}
