//! The lab: many emulated hosts on one machine, real networks between them.
//!
//! Each host is a network namespace with one TAP device and its own address (`10.213.0.N`);
//! a user-space [`Switch`] in this process reads every device and writes each frame
//! into its destination's after the link's one-way delay (± jitter), through its bandwidth
//! queue, unless lost or partitioned. Real `tessera` processes run inside the hosts
//! ([`Lab::command`]), unchanged: QUIC between nodes, the HTTP API and mDNS multicast all
//! cross the switch like any IP traffic. Hosts may be capped in memory, CPU and disk reads
//! by cgroups (v1 or v2; disks: [`disk`]). The switch's own round trip is measured when the
//! lab starts and taken off every delay ([`Lab::switch_floor`]). Everything is removed when the [`Lab`] is dropped, and after a crash by
//! [`clean`] (`tessera lab clean`).
//!
//! ```no_run
//! use std::time::Duration;
//! use tessera_lab::{HostSpec, Lab, LabSpec};
//! use tessera_linkemu::Impairment;
//!
//! # fn main() -> tessera_lab::Result<()> {
//! let spec = LabSpec::new(vec![HostSpec::new("coord"), HostSpec::new("a"), HostSpec::new("b")])
//!     .default_link(Impairment::default().delay(Duration::from_millis(2)));
//! let lab = Lab::start(&spec)?;
//! // `tessera node` on host "a", reaching the coordinator at lab.addr(0):
//! let mut node = lab.command(lab.host("a")?, "tessera")?;
//! node.args(["node", "--data-dir", "/tmp/a", "--join", "TOKEN@10.213.0.1:7070"]);
//! lab.switch().set_isolated(lab.host("a")?, true); // host "a" drops off the network
//! # Ok(()) }
//! ```
//!
//! Linux and root only (namespaces, TAP devices, cgroups); [`Lab::start`] says why when it cannot run.

pub mod cgroup;
pub mod cluster;
pub mod disk;
mod error;
pub mod http;
pub mod lab;
mod log_line;
pub mod netns;
pub mod packet;
pub mod run;
pub mod scenario;
pub mod selftest;
pub mod switch;
pub mod tun;

pub use error::{LabError, Result};
pub use lab::{clean, Cleaned, HostSpec, Lab, LabSpec, LinkSpec};
pub use switch::Switch;
