//! Model names: `ORG/NAME` or `ORG/NAME:QUANT`, optionally written `hf:ORG/NAME[:QUANT]` where a
//! path is also accepted. Pure parsing, bounded: names the Hub could not hold are refused.

use std::fmt;

use crate::error::{HubError, Result};

/// The prefix that marks a model name where a file path is also accepted (`--model`).
pub const SCHEME: &str = "hf:";
/// The Hub limits repository names to 96 characters.
const MAX_PART: usize = 96;
const MAX_QUANT: usize = 32;

/// A repository and, optionally, which quantization of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelName {
    /// `ORG/NAME`.
    pub repo: String,
    /// A quantization as file names spell it (`Q4_K_M`, `IQ2_XXS`, `BF16`), matched without
    /// regard to case.
    pub quant: Option<String>,
}

impl ModelName {
    /// Parses `ORG/NAME[:QUANT]`, with or without the `hf:` prefix.
    pub fn parse(given: &str) -> Result<Self> {
        let bad = |what: &str| HubError::BadName {
            given: given.chars().take(200).collect(),
            what: what.into(),
        };
        let s = given.strip_prefix(SCHEME).unwrap_or(given);
        let (repo, quant) = match s.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (s, None),
        };
        let (org, name) = repo
            .split_once('/')
            .ok_or_else(|| bad("no '/' between organisation and name"))?;
        for part in [org, name] {
            let ok_chars = part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if part.is_empty() || part.len() > MAX_PART || !ok_chars {
                return Err(bad(
                    "organisation and name are 1 to 96 letters, digits, '-', '_' or '.'",
                ));
            }
            if part.starts_with('.') || part.contains("..") {
                return Err(bad("a name part may not start with '.' or hold '..'"));
            }
        }
        if let Some(q) = quant {
            let ok_chars = q
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if q.is_empty() || q.len() > MAX_QUANT || !ok_chars {
                return Err(bad(
                    "the quantization is 1 to 32 letters, digits, '-', '_' or '.'",
                ));
            }
        }
        Ok(Self {
            repo: repo.to_string(),
            quant: quant.map(str::to_string),
        })
    }

    /// `Some` if `given` is written as a model name (`hf:…`) rather than a path.
    pub fn from_model_arg(given: &str) -> Option<Result<Self>> {
        given.starts_with(SCHEME).then(|| Self::parse(given))
    }
}

impl fmt::Display for ModelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.quant {
            Some(q) => write!(f, "{}:{q}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_with_and_without_scheme_and_quant() {
        let n = ModelName::parse("hf:unsloth/Qwen3-8B-GGUF:Q4_K_M").unwrap();
        assert_eq!(n.repo, "unsloth/Qwen3-8B-GGUF");
        assert_eq!(n.quant.as_deref(), Some("Q4_K_M"));
        assert_eq!(n.to_string(), "unsloth/Qwen3-8B-GGUF:Q4_K_M");
        let n = ModelName::parse("org/m.v1").unwrap();
        assert_eq!((n.repo.as_str(), n.quant), ("org/m.v1", None));
        assert!(ModelName::from_model_arg("models/x.gguf").is_none());
        assert!(ModelName::from_model_arg("hf:a/b").unwrap().is_ok());
    }

    #[test]
    fn names_the_hub_could_not_hold_are_refused() {
        for bad in [
            "noslash",
            "a/b/c",
            "/b",
            "a/",
            "a/b:",
            "a/b:Q4 K",
            "a/../b",
            "../a/b",
            "a/b?x=1",
            "hf:a/b:Q4:K",
            &format!("a/{}", "x".repeat(97)),
        ] {
            assert!(ModelName::parse(bad).is_err(), "{bad}");
        }
    }
}
