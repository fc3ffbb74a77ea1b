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
        AdminRequest::RevokeToken { id } => match shared.enrol.revoke_token(&id) {
            Ok(info) => {
                eprintln!("revoked token {}", info.id);
                AdminReply::Revoked {
                    what: format!("token {}", info.id),
                }
            }
            Err(e) => refused(&e),
        },
        AdminRequest::RevokeNode { name } => match shared.enrol.revoke_named(&name) {
            Ok(id) => {
                // Its sessions end now; it is planned around like a node that left.
                shared.authz.disconnect(&id, "revoked");
                eprintln!("revoked key {id}");
                AdminReply::Revoked {
                    what: format!("key {id}"),
                }
            }
            Err(e) => refused(&e),
        },
    }
}
