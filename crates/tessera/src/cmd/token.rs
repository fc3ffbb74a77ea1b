//! `tessera token` and `tessera node revoke`: credentials with a life, administered over an
//! operator's session with the running coordinator (so a revocation takes effect at once and
//! the records stay in the coordinator's `state.redb`, surviving restarts).
//!
//! The operator credential is the `operator token:` line the coordinator prints (or one made
//! with `tessera token create --role operator`); give it with `--coordinator-file` to keep it
//! out of the process list.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use tessera_net::NodeIdentity;
use tessera_node::agent::JoinTarget;
use tessera_proto::{AdminReply, AdminRequest, ClientToCoord, CoordToClient};

/// The environment variable that may hold a `TOKEN@HOST:PORT` line (or, for `tessera node`,
/// a join token alone), in place of a flag: a secret in argv is visible to every user in the
/// process list.
pub const TOKEN_ENV: &str = "TESSERA_TOKEN";

/// A secret line from (in this order) the command line, where it is visible to every user in
/// the process list (so a warning says so), a file, or [`TOKEN_ENV`]; `None` when none gives
/// one.
pub fn secret_line(
    given: Option<&str>,
    file: Option<&Path>,
    flag: &str,
    file_flag: &str,
) -> anyhow::Result<Option<String>> {
    if let Some(line) = given {
        eprintln!(
            "warning: a token given with {flag} is visible to every user in the process list; \
             use {file_flag} or {TOKEN_ENV}"
        );
        return Ok(Some(line.trim().to_string()));
    }
    if let Some(p) = file {
        let line = std::fs::read_to_string(p)
            .with_context(|| format!("reading {}", p.display()))?
            .trim()
            .to_string();
        return Ok(Some(line));
    }
    Ok(std::env::var(TOKEN_ENV)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty()))
}

/// The coordinator's `TOKEN@HOST:PORT` line: from a file, [`TOKEN_ENV`], or (visible in the
/// process list, with a warning) the command line.
#[derive(clap::Args, Debug)]
pub struct CoordinatorLine {
    /// The coordinator's `TOKEN@HOST:PORT` line (visible to every user in the process list:
    /// prefer --coordinator-file or the TESSERA_TOKEN environment variable).
    #[arg(
        long,
        value_name = "TOKEN@HOST:PORT",
        conflicts_with = "coordinator_file"
    )]
    coordinator: Option<String>,
    /// A file holding that line (keeps the secret out of the process list).
    #[arg(long, value_name = "PATH")]
    coordinator_file: Option<PathBuf>,
}

impl CoordinatorLine {
    /// The line, wherever it was given.
    pub fn line(&self) -> anyhow::Result<String> {
        secret_line(
            self.coordinator.as_deref(),
            self.coordinator_file.as_deref(),
            "--coordinator",
            "--coordinator-file",
        )?
        .with_context(|| format!("give --coordinator-file PATH or set {TOKEN_ENV}"))
    }
}

/// How to reach the coordinator as an operator.
#[derive(clap::Args, Debug)]
pub struct OperatorArgs {
    // The coordinator's `OPERATOR_TOKEN@HOST:PORT` line.
    #[command(flatten)]
    coordinator: CoordinatorLine,
    /// Where this operator client keeps its identity key.
    #[arg(long)]
    data_dir: PathBuf,
    /// Accept a token that names no coordinator, trusting whichever key answers at the address.
    #[arg(long)]
    trust_on_first_use: bool,
}

#[derive(clap::Args, Debug)]
pub struct TokenArgs {
    #[command(subcommand)]
    action: TokenAction,
}

#[derive(clap::Subcommand, Debug)]
enum TokenAction {
    /// Issue a join token; prints it once (`TOKEN@HOST:PORT`).
    Create {
        #[command(flatten)]
        op: OperatorArgs,
        /// What it lets a key be: `node`, `client` (runs generations on the operator's
        /// placement) or `operator` (also places stages and administers credentials).
        #[arg(long, default_value = "node")]
        role: String,
        /// How many keys may enrol with it (default: any number until it expires).
        #[arg(long)]
        uses: Option<u32>,
        /// Lifetime: e.g. `30m`, `24h`, `7d`, or `never`.
        #[arg(long, default_value = "24h")]
        expires: String,
    },
    /// List the tokens issued: id, role, uses left, expiry, revoked (never the secret).
    List {
        #[command(flatten)]
        op: OperatorArgs,
    },
    /// Revoke a token by id (or a unique prefix): no key enrols with it any more. With
    /// `--with-keys` (the default for a single-use token) the keys it enrolled are revoked
    /// too: every connection of theirs closes and their runs end.
    Revoke {
        #[command(flatten)]
        op: OperatorArgs,
        id: String,
        /// Also revoke the keys that enrolled with it.
        #[arg(long, conflicts_with = "keep_keys")]
        with_keys: bool,
        /// Leave the keys it enrolled enrolled, even for a single-use token.
        #[arg(long)]
        keep_keys: bool,
    },
}

/// Parses `TOKEN@HOST:PORT`, refusing a token that names no coordinator unless `tofu`.
pub fn parse_target(line: &str, tofu: bool) -> anyhow::Result<JoinTarget> {
    let target: JoinTarget = line.parse().map_err(anyhow::Error::msg)?;
    if target.token.coordinator().is_none() && !tofu {
        bail!(
            "this token names no coordinator, so any machine answering at {} could pose as \
             it: use the TOKEN@HOST:PORT line the coordinator printed, or pass \
             --trust-on-first-use",
            target.addr
        );
    }
    Ok(target)
}

pub fn run(args: TokenArgs) -> anyhow::Result<()> {
    let (op, req) = match args.action {
        TokenAction::Create {
            op,
            role,
            uses,
            expires,
        } => {
            let lifetime_ms = tessera_coord::tokens::parse_lifetime(&expires)
                .map_err(anyhow::Error::msg)
                .context("--expires")?;
            (
                op,
                AdminRequest::CreateToken {
                    role,
                    uses,
                    lifetime_ms,
                },
            )
        }
        TokenAction::List { op } => (op, AdminRequest::ListTokens),
        TokenAction::Revoke {
            op,
            id,
            with_keys,
            keep_keys,
        } => {
            let with_keys = match (with_keys, keep_keys) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            };
            (op, AdminRequest::RevokeToken { id, with_keys })
        }
    };
    let (addr, reply) = admin(&op, req)?;
    match reply {
        AdminReply::Token { token, info } => {
            println!("{token}@{addr}");
            eprintln!(
                "id {} role {} uses {} expires {}",
                info.id,
                info.role,
                info.uses_left.map_or("any".into(), |u| u.to_string()),
                info.expires_at_unix_ms
                    .map_or("never".into(), |t| format!("at {t} (unix ms)"))
            );
        }
        AdminReply::Tokens { tokens } => {
            println!("id               role      uses  enrolled  expires (unix ms)  revoked");
            for t in tokens {
                println!(
                    "{:<16} {:<9} {:>4}  {:>8}  {:>17}  {}",
                    t.id,
                    t.role,
                    t.uses_left.map_or("any".into(), |u| u.to_string()),
                    t.enrolled,
                    t.expires_at_unix_ms
                        .map_or("never".into(), |e| e.to_string()),
                    if t.revoked { "yes" } else { "no" }
                );
            }
        }
        AdminReply::Revoked { what } => println!("revoked {what}"),
        AdminReply::Refused { reason } => bail!("refused: {reason}"),
    }
    Ok(())
}

/// `tessera node revoke NAME`.
pub fn revoke_node(op: &OperatorArgs, name: String) -> anyhow::Result<()> {
    match admin(op, AdminRequest::RevokeNode { name })?.1 {
        AdminReply::Revoked { what } => println!("revoked {what}"),
        AdminReply::Refused { reason } => bail!("refused: {reason}"),
        other => bail!("unexpected reply {other:?}"),
    }
    Ok(())
}

/// Sends one request over an operator session; the coordinator's address and its reply.
fn admin(
    op: &OperatorArgs,
    req: AdminRequest,
) -> anyhow::Result<(std::net::SocketAddr, AdminReply)> {
    let line = op.coordinator.line()?;
    let target = parse_target(&line, op.trust_on_first_use).context("--coordinator")?;
    std::fs::create_dir_all(&op.data_dir)?;
    let identity = NodeIdentity::load_or_create(&op.data_dir)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let reply = rt.block_on(async {
        let mut session = super::run::connect_client(&identity, &target).await?;
        session.send(&ClientToCoord::Admin(req)).await?;
        let reply = loop {
            match session.next().await? {
                CoordToClient::Admin(r) => break r,
                CoordToClient::Error { message } => bail!("{message}"),
                _ => {}
            }
        };
        session.close().await;
        anyhow::Ok(reply)
    })?;
    Ok((target.addr, reply))
}
