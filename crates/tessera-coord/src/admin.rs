//! Credential administration for operators: tokens with a life and revocation, asked for over
//! an operator's control session ([`AdminRequest`], checked by [`crate::authz`] first).

use tessera_proto::{AdminReply, AdminRequest};

use crate::authz::Grant;
use crate::shared::Shared;

/// Carries out one request; every failure becomes [`AdminReply::Refused`] with its reason.
pub(crate) fn handle(shared: &Shared, req: AdminRequest) -> AdminReply {
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
            match shared.enrol.create_token(grant, uses, lifetime_ms) {
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
            tokens: shared.enrol.tokens(),
        },
        AdminRequest::RevokeToken { id, with_keys } => {
            match shared.enrol.revoke_token(&id, with_keys) {
                Ok((info, keys)) => {
                    // The keys it let in: every connection of each ends now.
                    for k in &keys {
                        revoked_key(shared, k);
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
        AdminRequest::RevokeNode { name } => match shared.enrol.revoke_named(&name) {
            Ok(id) => {
                revoked_key(shared, &id);
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
fn revoked_key(shared: &Shared, key: &tessera_net::NodeId) {
    let closed = shared.authz.disconnect(key, "revoked");
    tracing::info!(
        event = "key_revoked",
        node_id = %key,
        connections = closed,
        "revoked key {key}: {closed} connections closed"
    );
}
