//! One module per subcommand: its flags and its `run`.

pub mod auto_plan;
pub mod bench;
mod bench_draft;
pub mod client;
pub mod coordinator;
pub mod generate;
pub mod inspect;
mod join_line;
pub mod lab;
pub mod node;
pub mod plan;
mod progress;
pub mod pull;
pub mod run;
mod sampling;
pub mod serve;
pub mod speculate;
pub mod submit;
pub mod token;
pub mod up;

/// Compute threads when the user does not say: every core the process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
