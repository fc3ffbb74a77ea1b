//! Join tokens with a life: each says which role it grants ([`Grant`]), how many keys may
//! still enrol with it, when it expires, and whether it was revoked.
//!
//! A token is a secret handed out of band; once it has leaked it must be possible to make it
//! worthless, and one that is forgotten should stop working by itself. So every token expires
//! ([`DEFAULT_LIFETIME`] unless asked otherwise), can be limited to a number of uses, and can be
//! revoked; the records live in the coordinator's `state.redb`, so a rotation survives a
//! restart. The checks are pure functions of the record and `now`.

use serde::{Deserialize, Serialize};
use tessera_net::{JoinToken, TokenId};

use crate::authz::Grant;

/// How long a token lives when its creator does not say: a day.
pub const DEFAULT_LIFETIME_MS: u64 = 24 * 3600 * 1000;

/// One issued token.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub token: JoinToken,
    pub grant: Grant,
    /// Keys that may still enrol with it (`None`: any number until it expires).
    pub uses_left: Option<u32>,
    /// When it stops being accepted (`None`: never, only when asked for explicitly).
    pub expires_at_unix_ms: Option<u64>,
    pub revoked: bool,
    pub created_at_unix_ms: u64,
    /// Keys enrolled with it so far.
    #[serde(default)]
    pub enrolled: u32,
}

/// Why a token was not accepted (typed so tests and the enrolling node can tell which).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenRefusal {
    #[error("the join token is not known to this coordinator")]
    Unknown,
    #[error("the join token has expired")]
    Expired,
    #[error("the join token has been used as many times as it allows")]
    UsedUp,
    #[error("the join token has been revoked")]
    Revoked,
}

impl TokenRecord {
    /// A fresh token naming `coordinator`.
    pub fn issue(
        coordinator: tessera_net::NodeId,
        grant: Grant,
        uses: Option<u32>,
        lifetime_ms: Option<u64>,
        now_unix_ms: u64,
    ) -> Result<Self, tessera_net::NetError> {
        Ok(Self {
            token: JoinToken::generate(Some(coordinator))?,
            grant,
            uses_left: uses,
            expires_at_unix_ms: lifetime_ms.map(|l| now_unix_ms.saturating_add(l)),
            revoked: false,
            created_at_unix_ms: now_unix_ms,
            enrolled: 0,
        })
    }

    pub fn id(&self) -> TokenId {
        self.token.id()
    }

    /// Whether a key may enrol with this token at `now`.
    pub fn check(&self, now_unix_ms: u64) -> Result<(), TokenRefusal> {
        if self.revoked {
            Err(TokenRefusal::Revoked)
        } else if self.expires_at_unix_ms.is_some_and(|t| now_unix_ms >= t) {
            Err(TokenRefusal::Expired)
        } else if self.uses_left == Some(0) {
            Err(TokenRefusal::UsedUp)
        } else {
            Ok(())
        }
    }

    /// Whether it was made for one key (`--uses 1`).
    pub fn single_use(&self) -> bool {
        self.uses_left
            .is_some_and(|u| u64::from(u) + u64::from(self.enrolled) == 1)
    }

    /// Takes one use (after [`TokenRecord::check`] passed).
    pub fn take_use(&mut self) {
        if let Some(u) = &mut self.uses_left {
            *u = u.saturating_sub(1);
        }
        self.enrolled = self.enrolled.saturating_add(1);
    }

    /// Gives back a use taken for an enrolment whose proof then failed.
    pub fn give_back_use(&mut self) {
        if let Some(u) = &mut self.uses_left {
            *u = u.saturating_add(1);
        }
        self.enrolled = self.enrolled.saturating_sub(1);
    }

    /// What `tessera token list` shows: everything but the secret.
    pub fn info(&self) -> TokenInfo {
        TokenInfo {
            id: self.id().to_string(),
            role: self.grant.to_string(),
            uses_left: self.uses_left,
            enrolled: self.enrolled,
            expires_at_unix_ms: self.expires_at_unix_ms,
            revoked: self.revoked,
            created_at_unix_ms: self.created_at_unix_ms,
        }
    }
}

pub use tessera_proto::TokenInfo;

/// Finds the token a claim names.
pub fn find<'a>(tokens: &'a mut [TokenRecord], id: &TokenId) -> Option<&'a mut TokenRecord> {
    tokens.iter_mut().find(|t| t.id() == *id)
}

/// Parses a lifetime such as `30s`, `15m`, `24h`, `7d` or `never`, in ms (`None`: never).
pub fn parse_lifetime(s: &str) -> Result<Option<u64>, String> {
    if s == "never" {
        return Ok(None);
    }
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: expected a number and a unit (s, m, h, d), or never"))?;
    let ms = match unit {
        "ms" => 1,
        "s" | "" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (s, m, h, d)")),
    };
    n.checked_mul(ms)
        .map(Some)
        .ok_or_else(|| format!("{s:?} is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_net::NodeIdentity;

    fn record(uses: Option<u32>, lifetime: Option<u64>) -> TokenRecord {
        let c = NodeIdentity::generate().unwrap().node_id();
        TokenRecord::issue(c, Grant::Node, uses, lifetime, 1_000).unwrap()
    }

    #[test]
    fn a_token_expires() {
        let t = record(None, Some(500));
        assert_eq!(t.check(1_499), Ok(()));
        assert_eq!(t.check(1_500), Err(TokenRefusal::Expired));
    }

    #[test]
    fn a_token_allows_its_number_of_uses() {
        let mut t = record(Some(2), None);
        for _ in 0..2 {
            assert_eq!(t.check(0), Ok(()));
            t.take_use();
        }
        assert_eq!(t.check(0), Err(TokenRefusal::UsedUp));
        // A failed proof gives its use back.
        t.give_back_use();
        assert_eq!(t.check(0), Ok(()));
        assert_eq!(t.info().enrolled, 1);
    }

    #[test]
    fn a_revoked_token_is_refused_whatever_else_it_allows() {
        let mut t = record(None, None);
        t.revoked = true;
        assert_eq!(t.check(0), Err(TokenRefusal::Revoked));
    }

    #[test]
    fn lifetimes_parse() {
        assert_eq!(parse_lifetime("24h"), Ok(Some(DEFAULT_LIFETIME_MS)));
        assert_eq!(parse_lifetime("90s"), Ok(Some(90_000)));
        assert_eq!(parse_lifetime("never"), Ok(None));
        assert!(parse_lifetime("1y").is_err());
        assert!(parse_lifetime("h").is_err());
        assert!(parse_lifetime("99999999999999999999d").is_err());
    }

    #[test]
    fn the_listing_never_shows_the_secret() {
        let t = record(Some(1), None);
        let shown = serde_json::to_string(&t.info()).unwrap();
        let secret = t.token.to_string();
        assert!(!shown.contains(&secret[5..20]));
    }
}
