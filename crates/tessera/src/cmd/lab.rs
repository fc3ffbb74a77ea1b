//! `tessera lab`: emulated hosts on this machine (network namespaces joined by a user-space
//! switch that imposes each link's delay, jitter, bandwidth, loss and partitions), for
//! checking the switch (`selftest`), running scenarios (`run`), measuring hops, pipelining and
//! cells (`hop`, `pipeline`, `cells`) and removing what a crashed lab left behind (`clean`).
//! Linux, root. The work is in `tessera-lab`.

use anyhow::Context;

#[derive(clap::Args, Debug)]
pub struct LabArgs {
    #[command(subcommand)]
    command: LabCommand,
}

/// Where a measuring command (`hop`, `pipeline`, `cells`) keeps its logs and how it prints.
#[derive(clap::Args, Debug)]
struct Measurement {
    /// Print the figures as JSON.
    #[arg(long)]
    json: bool,
    /// Keep logs and data here (default: a fresh directory under the temp dir); the nodes'
    /// copies of the model are removed when the run ends.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
}

#[derive(clap::Subcommand, Debug)]
enum LabCommand {
    /// Measure the switch: its floor (its own round trip, taken off every delay), round trip at
    /// 0.5/2/20/80 ms, bandwidth at 10/100/1000 Mbit/s, loss, and a partition; then the disks:
    /// each profile's read caps measured with O_DIRECT reads from inside a capped host, and
    /// whether a host's page cache stays within its memory cap. Print the table. Exits
    /// non-zero when a figure is out of tolerance.
    Selftest {
        /// Print the table as JSON.
        #[arg(long)]
        json: bool,
        /// Seconds of transfer per bandwidth figure.
        #[arg(long, default_value_t = 4.0)]
        transfer_s: f64,
        /// Measure the disk caps on the disk holding this directory (default: the temp dir).
        #[arg(long)]
        disk_dir: Option<std::path::PathBuf>,
        /// Leave the disks out.
        #[arg(long, conflicts_with = "disk_dir")]
        no_disk: bool,
        /// Only the disks (leave the switch out).
        #[arg(long, conflicts_with = "no_disk")]
        disk_only: bool,
    },
    /// Run a scenario (the planner's cluster file plus [model], [workload] and [lab]): the
    /// planner's choice and each runner-up the fabric can execute, on emulated hosts, measured
    /// (decode tokens/s, time to first token, throughput at the policy's concurrency, wire
    /// bytes per token); prints strategy, predicted, measured, error and ranks, before and
    /// after calibration, and lists the plans that cannot execute with why. The hosts share
    /// this machine, so it first measures what its cores deliver at once (one `tessera bench`
    /// decoder alone, then one per host), and the planner divides that among busy hosts.
    Run {
        /// The scenario file (see crates/tessera-lab/scenarios/).
        scenario: std::path::PathBuf,
        /// Run the scenario with this model in place of its [model] (a larger one than the
        /// repo carries, say, so that each request decodes for seconds).
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Keep logs and data here (default: a fresh directory under the temp dir); the nodes'
        /// copies of the model are removed when the run ends.
        #[arg(long)]
        dir: Option<std::path::PathBuf>,
        /// Run the best plan of this strategy (single, stage, expert) besides the planner's
        /// choice, instead of the runners-up.
        #[arg(long)]
        strategy: Option<String>,
        /// Run this stage split besides the planner's choice, instead of the runners-up:
        /// `NODE=START..END,…` in ring order (one part: that node alone).
        #[arg(long, value_name = "SPLIT")]
        split: Option<String>,
        /// Save the scenario with its planner part calibrated on this run (for `tessera plan
        /// --nodes` and `tessera lab run`).
        #[arg(long, value_name = "PATH")]
        save_calibrated: Option<std::path::PathBuf>,
        /// Plan with a calibrated graph (a scenario saved by --save-calibrated) given to the
        /// coordinator's `--plan auto --calibrated`, in place of the nodes' measured rates.
        #[arg(long, value_name = "PATH")]
        calibrated: Option<std::path::PathBuf>,
        /// A scaling curve: run the scenario on its first N hosts for each N given (e.g.
        /// `1,2,3,4`), one run after another on the same caps, and end with one table of
        /// every run's choice and best plan against the best single host of the same run.
        #[arg(long, value_delimiter = ',', value_name = "N,…")]
        hosts: Vec<usize>,
        /// After the plans, run this llama.cpp `llama-bench` on the best single host under
        /// its caps (the model memory-mapped, weight repacking off, the page cache dropped
        /// first) and set the plans against its decode: `tools/llama-cpp.sh build` makes one.
        #[arg(long, value_name = "PATH")]
        llama_bench: Option<std::path::PathBuf>,
    },
    /// The time a hop of a stage ring adds beyond the link's round trip: a model alone on one
    /// node and as a ring (two nodes, or --stages), alternating, on a link through the switch
    /// and on loopback; with the ring's speed against one process and its cost against the
    /// link crossings.
    Hop {
        /// The model (default: the built-in stories260K).
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        /// Round trip of the switched link, ms.
        #[arg(long, default_value_t = 0.5)]
        rtt_ms: f64,
        /// Stages of the ring (one node each, equal layer ranges): 3 with `--rtt-ms 1` on a model
        /// of real size checks the ring's goals (≥ 0.95× one process on loopback, cost within 10%
        /// of its link crossings).
        #[arg(long, default_value_t = 2)]
        stages: usize,
        /// Tokens per measured request.
        #[arg(long, default_value_t = 128)]
        tokens: usize,
        /// Requests per placement (alternating); medians are reported.
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        #[command(flatten)]
        out: Measurement,
    },
    /// Whether a stage ring pipelines: on loopback, a ring of equal stages decoding 1, 4 and 8
    /// streams at once (aggregate tokens/s, each stage's busy share, sequences per step), and
    /// the time to first token of a long prompt on the ring against one node.
    Pipeline {
        /// The model (default: the built-in stories260K; use one with enough layers that
        /// compute dominates).
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        /// Stages of the ring.
        #[arg(long, default_value_t = 3)]
        stages: usize,
        /// Concurrent streams to measure at.
        #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
        streams: Vec<usize>,
        /// Tokens each stream decodes.
        #[arg(long, default_value_t = 64)]
        tokens: usize,
        /// Rounds over every figure (alternating); medians are reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Prompt length of the prefill figure (0: none).
        #[arg(long, default_value_t = 1024)]
        prompt_tokens: usize,
        /// Prompt tokens per prefill step.
        #[arg(long, default_value_t = 64)]
        prefill_chunk: usize,
        /// Compute threads per node.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[command(flatten)]
        out: Measurement,
    },
    /// What whole-request cells add: emulated hosts, each capped at --cpu-quota cores and each
    /// able to hold the model, serve concurrent requests as one cell (the first host alone)
    /// and as one cell a host, alternating; prints each one's aggregate tokens/s, their ratio,
    /// which node served each request, and whether every text equals one process's.
    Cells {
        /// The model (default: the built-in stories260K).
        #[arg(long)]
        model: Option<std::path::PathBuf>,
        /// Hosts (each a cell of its own in the cells' placement).
        #[arg(long, default_value_t = 4)]
        hosts: usize,
        /// Concurrent requests (8 at most have prompts of their own; more repeat them).
        #[arg(long, default_value_t = 8)]
        streams: usize,
        /// Tokens each request decodes.
        #[arg(long, default_value_t = 256)]
        tokens: usize,
        /// Rounds (the placements alternating); medians are reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Each host's CPU time, in cores, by cgroup quota (0: no cap). Hosts × quota should
        /// leave the coordinator and the clients a share of this machine's cores.
        #[arg(long, default_value_t = 0.4)]
        cpu_quota: f64,
        /// Round trip of the links between the hosts, ms.
        #[arg(long, default_value_t = 0.3)]
        rtt_ms: f64,
        /// Compute threads per node.
        #[arg(long, default_value_t = 1)]
        threads: usize,
        #[command(flatten)]
        out: Measurement,
    },
    /// Run a command on one emulated host capped like a scenario's node: its disk's read rates
    /// (a profile: nvme-gen4, nvme-gen3, sata-ssd, usb, emmc, sd), memory and CPU. E.g.
    /// `tessera lab exec --disk emmc --memory 1GiB -- tessera bench --expert-budget 200MiB -m M`.
    /// Exits with the command's status.
    Exec {
        /// Disk profile whose read bandwidth and IOPS cap the host's reads.
        #[arg(long)]
        disk: Option<String>,
        /// Memory cap (page cache included), e.g. `1GiB`.
        #[arg(long)]
        memory: Option<String>,
        /// CPU time in cores.
        #[arg(long)]
        cpu_quota: Option<f64>,
        /// Paths on the host's emulated disk (each file's directory, or the directory
        /// itself): seen at the same path, every read taking the time the profile's disk
        /// would (writes pass through untimed). Default: each existing file among the command's
        /// arguments. The temp dir and these paths' disks are also capped by the host's cgroup.
        #[arg(long)]
        disk_path: Vec<std::path::PathBuf>,
        /// The command and its arguments.
        #[arg(last = true, required = true)]
        command: Vec<std::ffi::OsString>,
    },
    /// Remove the namespaces, devices and cgroups of labs whose process has gone (and kill the
    /// processes left inside them).
    Clean {
        /// Remove every lab's, running ones included.
        #[arg(long)]
        all: bool,
    },
}

pub fn run(args: LabArgs) -> anyhow::Result<()> {
    match args.command {
        LabCommand::Selftest {
            json,
            transfer_s,
            disk_dir,
            no_disk,
            disk_only,
        } => {
            anyhow::ensure!(transfer_s >= 1.0, "--transfer-s must be at least 1");
            let mut opts = tessera_lab::selftest::Options {
                transfer_s,
                ..Default::default()
            };
            if no_disk {
                opts.disk_dir = None;
            } else if let Some(d) = disk_dir {
                opts.disk_dir = Some(d);
            }
            if disk_only {
                opts = opts.disk_only();
            }
            if !json {
                print!("{}", tessera_lab::selftest::table(&[]));
            }
            let checks = tessera_lab::selftest::run(&opts, |c| {
                if !json {
                    let t = tessera_lab::selftest::table(std::slice::from_ref(c));
                    print!(
                        "{}",
                        t.lines()
                            .nth(1)
                            .map(|l| format!("{l}\n"))
                            .unwrap_or_default()
                    );
                    use std::io::Write as _;
                    let _ = std::io::stdout().flush();
                }
            })
            .context("lab selftest")?;
            if json {
                println!("{}", serde_json::to_string_pretty(&checks)?);
            }
            let out = checks.iter().filter(|c| !c.ok).count();
            anyhow::ensure!(out == 0, "{out} figure(s) out of tolerance");
            Ok(())
        }
        LabCommand::Run {
            scenario,
            model,
            json,
            dir,
            strategy,
            split,
            save_calibrated,
            calibrated,
            hosts,
            llama_bench,
        } => {
            if let Some(b) = &llama_bench {
                anyhow::ensure!(b.is_file(), "--llama-bench {}: no such file", b.display());
            }
            let mut s = tessera_lab::scenario::Scenario::load(&scenario)?;
            if let Some(m) = model {
                anyhow::ensure!(m.is_file(), "--model {}: no such file", m.display());
                s.model = std::fs::canonicalize(&m)
                    .with_context(|| format!("--model {}", m.display()))?;
            }
            let dir = dir.unwrap_or_else(|| tessera_lab::run::default_dir(&s));
            let exe = std::env::current_exe().context("finding this executable")?;
            let strategy = strategy
                .map(|x| {
                    tessera_plan::StrategyKind::ALL
                        .into_iter()
                        .find(|k| k.name() == x)
                        .with_context(|| format!("--strategy {x:?}: single, stage or expert"))
                })
                .transpose()?;
            if !hosts.is_empty() {
                // A calibrated graph names every host, which a part of the scenario lacks.
                anyhow::ensure!(
                    save_calibrated.is_none() && calibrated.is_none(),
                    "--hosts runs parts of the scenario: without --save-calibrated or --calibrated"
                );
                let opts = tessera_lab::run::Options {
                    force: tessera_lab::run::Force { strategy, split },
                    save_calibrated: None,
                    calibrated: None,
                    llama_bench,
                };
                return scaling_curve(&s, &hosts, &exe, &dir, &opts, json);
            }
            let opts = tessera_lab::run::Options {
                force: tessera_lab::run::Force { strategy, split },
                save_calibrated,
                calibrated,
                llama_bench,
            };
            let report = tessera_lab::run::run(&s, &exe, &dir, &opts, |m| eprintln!("lab: {m}"))
                .with_context(|| {
                    format!("lab run {} (logs in {})", scenario.display(), dir.display())
                })?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", tessera_lab::run::table(&report));
            }
            // Greedy decoding: a plan whose text is not one process's is a fault, not a figure.
            let differ: Vec<&str> = report
                .text_mismatches()
                .iter()
                .map(|r| r.description.as_str())
                .collect();
            anyhow::ensure!(
                differ.is_empty(),
                "the text of {} differed from one process's (logs in {})",
                differ.join("; "),
                dir.display()
            );
            Ok(())
        }
        LabCommand::Hop {
            model,
            rtt_ms,
            stages,
            tokens,
            rounds,
            out,
        } => {
            anyhow::ensure!(rtt_ms >= 0.0, "--rtt-ms must be ≥ 0");
            let opts = tessera_lab::run::hop::Options {
                model: crate::default_model::resolve(model)?,
                rtt_ms,
                stages,
                tokens,
                rounds,
                threads: 1,
            };
            measure(
                "hop",
                out,
                |exe, dir, progress| tessera_lab::run::hop::run(&opts, exe, dir, progress),
                |f| tessera_lab::run::hop::table(f),
            )
        }
        LabCommand::Pipeline {
            model,
            stages,
            streams,
            tokens,
            rounds,
            prompt_tokens,
            prefill_chunk,
            threads,
            out,
        } => {
            anyhow::ensure!(
                !streams.is_empty() && !streams.contains(&0),
                "--streams: one or more counts of at least 1"
            );
            anyhow::ensure!(prefill_chunk > 0, "--prefill-chunk must be at least 1");
            let opts = tessera_lab::run::pipeline::Options {
                model: crate::default_model::resolve(model)?,
                stages,
                streams,
                tokens,
                rounds,
                prompt_tokens,
                prefill_chunk,
                threads: threads.max(1),
            };
            measure(
                "pipeline",
                out,
                |exe, dir, progress| tessera_lab::run::pipeline::run(&opts, exe, dir, progress),
                tessera_lab::run::pipeline::table,
            )
        }
        LabCommand::Cells {
            model,
            hosts,
            streams,
            tokens,
            rounds,
            cpu_quota,
            rtt_ms,
            threads,
            out,
        } => {
            anyhow::ensure!(hosts >= 2, "--hosts must be at least 2");
            anyhow::ensure!(streams >= 1, "--streams must be at least 1");
            anyhow::ensure!(cpu_quota >= 0.0, "--cpu-quota must be ≥ 0");
            anyhow::ensure!(rtt_ms >= 0.0, "--rtt-ms must be ≥ 0");
            let opts = tessera_lab::run::cells::Options {
                model: crate::default_model::resolve(model)?,
                hosts,
                streams,
                tokens,
                rounds,
                cpu_quota: (cpu_quota > 0.0).then_some(cpu_quota),
                rtt_ms,
                threads: threads.max(1),
            };
            measure(
                "cells",
                out,
                |exe, dir, progress| tessera_lab::run::cells::run(&opts, exe, dir, progress),
                tessera_lab::run::cells::table,
            )
        }
        LabCommand::Exec {
            disk,
            memory,
            cpu_quota,
            disk_path,
            command,
        } => exec(disk, memory, cpu_quota, disk_path, command),
        LabCommand::Clean { all } => {
            let c = tessera_lab::clean(all);
            for n in &c.namespaces {
                println!("removed namespace {n}");
            }
            for g in &c.cgroups {
                println!("removed cgroup {g}");
            }
            for v in &c.views {
                println!("unmounted disk view {v}");
            }
            if c.namespaces.is_empty() && c.cgroups.is_empty() && c.views.is_empty() {
                println!("nothing to remove");
            }
            Ok(())
        }
    }
}

/// `lab exec`: one host with the caps asked for, the command run inside, its status passed on.
fn exec(
    disk: Option<String>,
    memory: Option<String>,
    cpu_quota: Option<f64>,
    disk_path: Vec<std::path::PathBuf>,
    command: Vec<std::ffi::OsString>,
) -> anyhow::Result<()> {
    use tessera_lab::disk::DiskProfile;
    let mut host = tessera_lab::HostSpec::new("host");
    if let Some(d) = disk {
        let p = DiskProfile::named(&d)
            .with_context(|| format!("--disk {d:?}: one of {}", DiskProfile::names()))?;
        host = host.disk(p);
    }
    host.limits.memory = memory
        .map(|m| tessera_plan::units::parse_bytes(&m).map(|b| b.0))
        .transpose()
        .map_err(|e| anyhow::anyhow!("--memory: {e}"))?;
    host.limits.cpu_quota = cpu_quota;
    let mut spec = tessera_lab::LabSpec::new(vec![host]);
    let paths: Vec<std::path::PathBuf> = if disk_path.is_empty() {
        command[1..]
            .iter()
            .map(std::path::PathBuf::from)
            .filter(|p| p.is_file())
            .collect()
    } else {
        disk_path
    };
    for p in &paths {
        let dir = if p.is_dir() {
            p.clone()
        } else {
            p.canonicalize()
                .with_context(|| format!("--disk-path {}", p.display()))?
                .parent()
                .map(std::path::Path::to_path_buf)
                .unwrap_or_default()
        };
        spec.disk_dirs.push(dir);
    }
    spec.disk_paths.extend(paths);
    let lab = tessera_lab::Lab::start(&spec).context("starting the host")?;
    for d in lab.disks() {
        eprintln!("lab: reads capped on {} ({}): {}", d.name, d.id, d.how);
    }
    for v in lab.emulated_disk(0).map_or(&[][..], |d| d.views()) {
        eprintln!("lab: {} is on the emulated disk", v.source.display());
    }
    let status = lab
        .command(0, &command[0])?
        .args(&command[1..])
        .status()
        .with_context(|| format!("running {:?}", command[0]))?;
    drop(lab);
    anyhow::ensure!(status.success(), "the command exited with {status}");
    Ok(())
}

/// What `lab hop`, `pipeline` and `cells` share: the directory (default a fresh one under the
/// temp dir), this executable for the lab's processes, progress on stderr, and the result as
/// JSON or as `table` prints it.
fn measure<T: serde::Serialize>(
    kind: &str,
    Measurement { json, dir }: Measurement,
    run: impl FnOnce(
        &std::path::Path,
        &std::path::Path,
        &mut dyn FnMut(&str),
    ) -> Result<T, tessera_lab::LabError>,
    table: impl FnOnce(&T) -> String,
) -> anyhow::Result<()> {
    let dir = dir.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("tessera-lab-{kind}-{}", std::process::id()))
    });
    let exe = std::env::current_exe().context("finding this executable")?;
    let result = run(&exe, &dir, &mut |m| eprintln!("lab: {m}"))
        .with_context(|| format!("lab {kind} (logs in {})", dir.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&result)?);
    } else {
        print!("{}", table(&result));
    }
    Ok(())
}

/// `tessera lab run --hosts N,…`: the scenario on its first N hosts for each N, one run after
/// another (each run's table as it ends), then the curve as one table (or every run as JSON).
/// A text that differs from one process's fails the whole command, after the table.
fn scaling_curve(
    s: &tessera_lab::scenario::Scenario,
    hosts: &[usize],
    exe: &std::path::Path,
    dir: &std::path::Path,
    opts: &tessera_lab::run::Options,
    json: bool,
) -> anyhow::Result<()> {
    // Every part is checked before the first run starts minutes of work.
    let parts = hosts
        .iter()
        .map(|&n| s.first_hosts(n).map(|p| (n, p)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut points = Vec::new();
    for (n, part) in parts {
        let sub = dir.join(format!("hosts-{n}"));
        eprintln!("lab: === {n} host(s): {} ===", part.name);
        let report = tessera_lab::run::run(&part, exe, &sub, opts, |m| eprintln!("lab: {m}"))
            .with_context(|| format!("lab run on {n} host(s) (logs in {})", sub.display()))?;
        if !json {
            print!("{}", tessera_lab::run::table(&report));
            println!();
        }
        points.push(tessera_lab::run::scaling::Point { hosts: n, report });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&points)?);
    } else {
        print!("{}", tessera_lab::run::scaling::table(&points));
    }
    let differ: Vec<String> = points
        .iter()
        .flat_map(|p| {
            p.report
                .text_mismatches()
                .into_iter()
                .map(move |r| format!("{} on {} host(s)", r.description, p.hosts))
        })
        .collect();
    anyhow::ensure!(
        differ.is_empty(),
        "the text of {} differed from one process's (logs in {})",
        differ.join("; "),
        dir.display()
    );
    Ok(())
}
