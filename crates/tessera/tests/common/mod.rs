//! Helpers shared by the end-to-end tests; each test binary uses a subset.
//!
//! - `proc`: the `tessera` binary, model paths, and a child process whose stdout lines are
//!   collected (killed on drop).
//! - `run`: running a command under a deadline, reading client JSON messages, and the greedy
//!   tokens of one process.
//! - `events`: the cluster's JSON events (`TESSERA_LOG_FORMAT=json`), which tests wait on.
//! - `moe`: a coordinator with an expert split and its nodes.
//! - `http`: a few-line HTTP/1.1 client over `TcpStream` (`Connection: close`, chunked bodies
//!   decoded), SSE parsing and Prometheus samples.
//! - `serve`: a `tessera serve` on a loopback port, the cache directory and model paths.
//! - `openai`: the official OpenAI Python client against a running server.
//! - `browser`: headless Chromium.
//! - `sealed`: a coordinator of single-node cells, its nodes and a sealing client.
//! - `cdp`: headless Chromium driven over the DevTools protocol (JavaScript observed).
//! - `up`: a running `tessera up` with its nodes, killed on drop.
//! - `token`: a command's checked stdout, `tessera token create`'s token, and enrolling a key
//!   with a token over the real transport.

#![allow(dead_code)]

pub mod browser;
pub mod cdp;
pub mod chaos;
pub mod events;
pub mod http;
pub mod moe;
pub mod openai;
pub mod proc;
pub mod run;
pub mod sealed;
pub mod serve;
pub mod token;
pub mod up;

#[allow(unused_imports)]
pub use browser::*;
#[allow(unused_imports)]
pub use events::{event_in, JSON_LOGS};
#[allow(unused_imports)]
pub use http::*;
#[allow(unused_imports)]
pub use moe::*;
#[allow(unused_imports)]
pub use openai::*;
#[allow(unused_imports)]
pub use proc::*;
#[allow(unused_imports)]
pub use run::*;
#[allow(unused_imports)]
pub use serve::*;
