//! `tessera`: many ordinary machines, one model.
//!
//! A thin binary: flags are parsed and validated here, then each subcommand calls into the
//! library crates (`tessera-model`, `tessera-engine`, `tessera-plan`, …).

#![forbid(unsafe_code)]

#[macro_use]
mod output;
mod cmd;
mod default_model;
mod logging;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Tessera turns the machines you already own into one inference platform for open-weight LLMs.
///
/// Start with `tessera up`: a coordinator, three local nodes and an OpenAI-compatible API with a
/// dashboard, serving the small story model built into the binary. `tessera generate -p "Once upon
/// a time"` runs that model in one process; `tessera inspect MODEL` shows what a GGUF model costs,
/// part by part; `tessera plan` says how a model would be split over a cluster, and why; `tessera
/// node` and `tessera coordinator` build a cluster across machines.
#[derive(Parser)]
#[command(name = "tessera", version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming tokens as they are produced.
    Generate(cmd::generate::GenerateArgs),
    /// Bring a model from the Hugging Face Hub into its cache, by name (ORG/NAME[:QUANT]); print
    /// its path. `--model hf:ORG/NAME[:QUANT]` does the same wherever a model is taken.
    Pull(cmd::pull::PullArgs),
    /// Print a model's profile: architecture, geometry, and bytes per layer, expert and token.
    Inspect(cmd::inspect::InspectArgs),
    /// Measure load time, prefill and decode tokens/s, and peak memory.
    Bench(cmd::bench::BenchArgs),
    /// Choose the best split of a model over a cluster, and explain why.
    Plan(cmd::plan::PlanArgs),
    /// Run a node agent: measure this machine, join a coordinator, hold part of a model.
    Node(cmd::node::NodeArgs),
    /// Run the coordinator: enrol nodes, distribute the model, place layers, drive generations.
    Coordinator(cmd::coordinator::CoordinatorArgs),
    /// Generate across an enrolled cluster (stage split), streaming tokens.
    Run(cmd::run::RunArgs),
    /// Serve the OpenAI-compatible API and the live web dashboard for a model run in this
    /// process (continuous batching; an API key is required beyond loopback).
    Serve(cmd::serve::ServeArgs),
    /// Start a whole cluster on this machine: a coordinator and gateway here, N node processes,
    /// an even layer split; serves the API and dashboard until Ctrl-C.
    Up(cmd::up::UpArgs),
    /// Emulated hosts on this machine (namespaces and a user-space switch; Linux, root):
    /// `selftest`, `run SCENARIO`, `clean`.
    Lab(cmd::lab::LabArgs),
    /// Join tokens with a life: create (with a role, uses and expiry), list, revoke.
    Token(cmd::token::TokenArgs),
    // Its help (a walkthrough) is the doc comment of `ClientArgs`.
    Client(cmd::client::ClientArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    logging::init();
    let result = match cli.command {
        Command::Generate(a) => cmd::generate::run(a),
        Command::Pull(a) => cmd::pull::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Node(a) => cmd::node::run(a),
        Command::Coordinator(a) => cmd::coordinator::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Up(a) => cmd::up::run(a),
        Command::Lab(a) => cmd::lab::run(a),
        Command::Token(a) => cmd::token::run(a),
        Command::Client(a) => cmd::client::run(a),
    };
    // Log lines still queued (bounded: stdout may be a pipe nobody reads).
    output::drain(std::time::Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
