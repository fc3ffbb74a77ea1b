//! Join tokens with a life, end to end: a `tessera coordinator` process, tokens issued, listed
//! and revoked with `tessera token` / `tessera node revoke` over the operator's session, and
//! keys enrolling over the real transport. Each refusal is checked for its reason.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::chaos::Cluster;
use common::token::{created, enrol_as, ok};
use common::{bin, model, run_with_timeout};
use tessera_net::NodeIdentity;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// `tessera ARGS --coordinator OPERATOR --data-dir DIR/operator`.
fn operator(c: &Cluster, args: &[&str]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(args)
        .args(["--coordinator", &c.operator, "--data-dir"])
        .arg(c.dir.path().join("operator"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    run_with_timeout(cmd, Duration::from_secs(60))
}

/// `tessera token create FLAGS`: the new token's line and its id.
fn create(c: &Cluster, flags: &[&str]) -> (String, String) {
    created(&operator(c, &[&["token", "create"], flags].concat()))
}

/// Enrols a fresh key (or `key`) with `line`'s token: `Ok` or the coordinator's reason.
fn enrol(line: &str, key: Option<&NodeIdentity>) -> Result<(), String> {
    let fresh;
    let id = match key {
        Some(k) => k,
        None => {
            fresh = NodeIdentity::generate().unwrap();
            &fresh
        }
    };
    rt().block_on(enrol_as(line, id))
}

#[test]
fn tokens_expire_run_out_are_revoked_and_survive_a_coordinator_restart() {
    let mut c = Cluster::start(&model("stories260K.gguf"), "0..5");

    // Use count: one key, then no more.
    let (once, once_id) = create(&c, &["--role", "node", "--uses", "1"]);
    enrol(&once, None).unwrap();
    let why = enrol(&once, None).unwrap_err();
    assert!(why.contains("used as many times as it allows"), "{why}");

    // Expiry.
    let (short, _) = create(&c, &["--expires", "1s"]);
    std::thread::sleep(Duration::from_millis(1500));
    let why = enrol(&short, None).unwrap_err();
    assert!(why.contains("expired"), "{why}");

    // Revocation of a token.
    let (revoked, revoked_id) = create(&c, &["--role", "client"]);
    ok(&operator(&c, &["token", "revoke", &revoked_id[..8]]));
    let why = enrol(&revoked, None).unwrap_err();
    assert!(why.contains("revoked"), "{why}");

    // The listing shows every token, never a secret.
    let list = ok(&operator(&c, &["token", "list"]));
    for id in [&once_id, &revoked_id] {
        assert!(list.contains(id.as_str()), "{list}");
    }
    let secret = |line: &str| line[5..37].to_string();
    assert!(!list.contains(&secret(&once)) && !list.contains(&secret(&revoked)));

    // A revoked key cannot enrol again, with an old token or a new one.
    let (multi, _) = create(&c, &["--role", "node"]);
    c.add_node_via("victim-of-revocation", &multi);
    ok(&operator(&c, &["node", "revoke", "victim-of-revocation"]));
    let key = NodeIdentity::load_or_create(c.dir.path().join("victim-of-revocation")).unwrap();
    let why = enrol(&multi, Some(&key)).unwrap_err();
    assert!(why.contains("revoked"), "{why}");
    let (fresh, _) = create(&c, &["--role", "node"]);
    let why = enrol(&fresh, Some(&key)).unwrap_err();
    assert!(why.contains("revoked"), "{why}");

    // Everything above is in the coordinator's database: a restart keeps it.
    let (kept, _) = create(&c, &["--role", "node", "--uses", "1"]);
    c.restart_coordinator();
    let why = enrol(&revoked, None).unwrap_err();
    assert!(why.contains("revoked"), "after a restart: {why}");
    let why = enrol(&once, None).unwrap_err();
    assert!(why.contains("used as many times"), "after a restart: {why}");
    let why = enrol(&fresh, Some(&key)).unwrap_err();
    assert!(why.contains("revoked"), "after a restart: {why}");
    enrol(&kept, None).unwrap();
}

#[test]
fn a_token_without_the_coordinator_id_is_refused_unless_trust_on_first_use() {
    let c = Cluster::start(&model("stories260K.gguf"), "0..5");
    // `tsr1-SECRET-COORDINATOR@ADDR` without `-COORDINATOR`.
    let (token, addr) = c.join.rsplit_once('@').unwrap();
    let idless = format!("{}@{addr}", &token[..token.rfind('-').unwrap()]);
    let mut args = common::node_args(c.dir.path(), "tofu");
    args.extend(["--join".into(), idless.clone()]);
    let out = run_with_timeout(
        {
            let mut cmd = Command::new(bin());
            cmd.args(&args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            cmd
        },
        Duration::from_secs(60),
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("names no coordinator") && err.contains("--trust-on-first-use"),
        "{err}"
    );
    // Asked for, trust on first use enrols.
    args.push("--trust-on-first-use".into());
    let mut p = common::chaos::Proc::spawn_with_events("tofu", &args);
    p.wait_event(&[("event", "joined")]);
}
