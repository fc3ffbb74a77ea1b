//! Join tokens seen from outside a running coordinator (`authz.rs`, `token_lifecycle.rs`): what
//! `tessera token create` printed, and a key enrolling with a token over the real transport.

use std::process::Output;

use tessera_net::{Endpoint, NetError, NodeIdentity};
use tessera_node::agent::JoinTarget;

/// The trimmed stdout of a command that must have succeeded; panics with its stderr if not.
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// What a successful `tessera token create` printed: the new token's line and its id.
pub fn created(out: &Output) -> (String, String) {
    let line = ok(out);
    let target: JoinTarget = line.parse().unwrap();
    (line, target.token.id().to_string())
}

/// Enrols `id` with `line`'s token over the real transport: `Ok` or the coordinator's reason.
pub async fn enrol_as(line: &str, id: &NodeIdentity) -> Result<(), String> {
    let target: JoinTarget = line.parse().unwrap();
    let ep = Endpoint::bind(
        "127.0.0.1:0".parse().unwrap(),
        id,
        tessera_net::AllowList::new(),
    )
    .unwrap();
    let r = ep.enroll(target.addr, &target.token).await;
    ep.close();
    match r {
        Ok(_) => Ok(()),
        Err(NetError::EnrolmentRefused { reason, .. }) => Err(reason),
        Err(e) => Err(e.to_string()),
    }
}
