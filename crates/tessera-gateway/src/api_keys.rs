//! The API keys a server accepts, each with a name that logs, 429s and fair admission use in
//! place of the secret.
//!
//! A key file holds one key per line, as `KEY` or `NAME KEY`; blank lines and lines starting
//! with `#` are skipped. A key given alone (`--api-key`, `TESSERA_API_KEY`, or a file's only
//! line) is named `key1`, and unnamed keys in a file `key1`, `key2`, … by their line order.

use std::sync::Arc;

/// One accepted key.
#[derive(Clone)]
pub struct ApiKey {
    pub name: Arc<str>,
    secret: String,
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: configs are printed in debug logs.
        write!(f, "ApiKey({})", self.name)
    }
}

/// Every accepted key (none: the API is open, which only a loopback address allows).
#[derive(Clone, Debug, Default)]
pub struct ApiKeys(Vec<ApiKey>);

/// A key file that cannot be used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyFileError {
    #[error("line {line}: expected `KEY` or `NAME KEY`")]
    Malformed { line: usize },
    #[error("line {line}: the name `{name}` is used twice")]
    DuplicateName { line: usize, name: String },
    #[error("line {line}: this key is listed twice")]
    DuplicateKey { line: usize },
    #[error("it holds no key")]
    Empty,
}

impl ApiKeys {
    /// One key (empty or blank: none).
    pub fn single(secret: &str) -> Self {
        let secret = secret.trim();
        if secret.is_empty() {
            return Self::default();
        }
        Self(vec![ApiKey {
            name: "key1".into(),
            secret: secret.to_string(),
        }])
    }

    /// The keys of a key file's text.
    pub fn parse(text: &str) -> Result<Self, KeyFileError> {
        let mut keys: Vec<ApiKey> = Vec::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            let l = raw.trim();
            if l.is_empty() || l.starts_with('#') {
                continue;
            }
            let fields: Vec<&str> = l.split_whitespace().collect();
            let (name, secret) = match fields[..] {
                [secret] => (format!("key{}", keys.len() + 1), secret),
                [name, secret] => (name.to_string(), secret),
                _ => return Err(KeyFileError::Malformed { line }),
            };
            if keys.iter().any(|k| *k.name == *name) {
                return Err(KeyFileError::DuplicateName { line, name });
            }
            if keys.iter().any(|k| k.secret == secret) {
                return Err(KeyFileError::DuplicateKey { line });
            }
            keys.push(ApiKey {
                name: name.into(),
                secret: secret.to_string(),
            });
        }
        if keys.is_empty() {
            return Err(KeyFileError::Empty);
        }
        Ok(Self(keys))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The key `presented` is, compared with every key in full so that timing reveals
    /// neither a key nor which one matched.
    pub fn find(&self, presented: &[u8]) -> Option<&ApiKey> {
        self.0.iter().fold(None, |found, k| {
            let same = same_secret(presented, k.secret.as_bytes());
            found.or(same.then_some(k))
        })
    }
}

/// Compares without an early exit, so timing does not reveal the key.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_names_its_keys_or_numbers_them() {
        let keys = ApiKeys::parse("# team keys\nalice sk-a\n\nsk-b\nbob sk-c\n").unwrap();
        let names: Vec<&str> = ["sk-a", "sk-b", "sk-c"]
            .iter()
            .map(|s| &*keys.find(s.as_bytes()).unwrap().name)
            .collect();
        assert_eq!(names, ["alice", "key2", "bob"]);
        assert!(keys.find(b"sk-d").is_none());
        assert!(keys.find(b"sk-").is_none());
    }

    #[test]
    fn a_one_line_file_is_the_single_key_it_always_was() {
        let keys = ApiKeys::parse("sk-only\n").unwrap();
        assert_eq!(&*keys.find(b"sk-only").unwrap().name, "key1");
        assert_eq!(
            &*ApiKeys::single(" sk-only ").find(b"sk-only").unwrap().name,
            "key1"
        );
        assert!(ApiKeys::single("  ").is_empty());
    }

    #[test]
    fn unusable_files_say_which_line() {
        assert_eq!(
            ApiKeys::parse("a b c").unwrap_err(),
            KeyFileError::Malformed { line: 1 }
        );
        assert_eq!(
            ApiKeys::parse("x k1\nx k2").unwrap_err(),
            KeyFileError::DuplicateName {
                line: 2,
                name: "x".into()
            }
        );
        assert_eq!(
            ApiKeys::parse("x k1\ny k1").unwrap_err(),
            KeyFileError::DuplicateKey { line: 2 }
        );
        assert_eq!(ApiKeys::parse("# none\n").unwrap_err(), KeyFileError::Empty);
    }

    #[test]
    fn debug_output_never_shows_a_secret() {
        let keys = ApiKeys::parse("alice sk-secret").unwrap();
        assert!(!format!("{keys:?}").contains("sk-secret"));
    }
}
