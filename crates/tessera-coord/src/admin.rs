//! Credential administration for operators: tokens with a life and revocation, asked for over
//! an operator's control session ([`AdminRequest`], checked by [`crate::authz`] first).
//!
//! Each request is one step of the core task, which owns the enrolment records and each key's
//! connections: a revocation and the closing of the revoked keys' connections happen together,
//! before anything asked after them.

use tessera_proto::{AdminReply, AdminRequest};

use crate::authz::Grant;
use crate::shared::{Core, Shared};

/// Carries out one request on the core task; every failure becomes [`AdminReply::Refused`]
/// with its reason.
pub(crate) async fn handle(shared: &Shared, req: AdminRequest) -> AdminReply {
    shared
        .ask(move |core, _| handle_on_core(core, req))
        .await
        .unwrap_or_else(|| AdminReply::Refused {
            reason: "the coordinator is closing".into(),
        })
}

fn handle_on_core(core: &mut Core, req: AdminRequest) -> AdminReply {
    let refused = |e: &dyn std::fmt::Display| AdminReply::Refused {
        reason: e.to_string(),
    };
    match req {
        AdminRequest::CreateToken {
            role,
            uses,
            lifetime_ms,
        } => {
            let grant: Grant = match role.parse() {
                Ok(g) => g,
                Err(e) => return refused(&e),
            };
            if uses == Some(0) {
                return refused(&"a token for 0 uses would enrol nobody");
            }
            match core.enrolment.create_token(grant, uses, lifetime_ms) {
                Ok(r) => {
                    eprintln!("issued {grant} token {}", r.id());
                    AdminReply::Token {
                        token: r.token.to_string(),
                        info: r.info(),
                    }
                }
                Err(e) => refused(&e),
            }
        }
        AdminRequest::ListTokens => AdminReply::Tokens {
            tokens: core.enrolment.public().tokens(),
        },
        AdminRequest::RevokeToken { id, with_keys } => {
            match core.enrolment.revoke_token(&id, with_keys) {
                Ok((info, keys)) => {
                    // The keys it let in: every connection of each ends now.
                    for k in &keys {
                        revoked_key(core, k);
                    }
                    eprintln!("revoked token {} and {} keys", info.id, keys.len());
                    AdminReply::Revoked {
                        what: if keys.is_empty() {
                            format!("token {}", info.id)
                        } else {
                            let ids: Vec<String> = keys.iter().map(ToString::to_string).collect();
                            format!("token {} and the keys {}", info.id, ids.join(", "))
                        },
                    }
                }
                Err(e) => refused(&e),
            }
        }
        AdminRequest::RevokeNode { name } => match core.enrolment.revoke_named(&name) {
            Ok(id) => {
                revoked_key(core, &id);
                eprintln!("revoked key {id}");
                AdminReply::Revoked {
                    what: format!("key {id}"),
                }
            }
            Err(e) => refused(&e),
        },
    }
}

/// A key was revoked: every connection it has ends now (its sessions with them: a node is
/// planned around like one that left, a client's runs are cancelled). A request that raced
/// the close is refused too: sessions check the key's rights on every message.
fn revoked_key(core: &mut Core, key: &tessera_net::NodeId) {
    let closed = core.door.disconnect(key, "revoked");
    tracing::info!(
        event = "key_revoked",
        node_id = %key,
        connections = closed,
        "revoked key {key}: {closed} connections closed"
    );
}
