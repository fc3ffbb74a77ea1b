//! Pre-tokenizers for byte-level BPE: split text into the words that merges never cross.
//!
//! The patterns are the ones llama.cpp uses for each `tokenizer.ggml.pre`. Their `\s+(?!\S)`
//! alternative (a whitespace run, minus the last character when a non-space follows, so that the
//! space attaches to the next word) needs a lookahead, which the linear-time `regex` crate does
//! not have; we match `\s+` instead and give the last character back when the lookahead would
//! have failed. That is exact: the alternatives before it in each pattern cannot match a pure
//! run of non-newline whitespace, so a whitespace-only match without `\r`/`\n` can only come from
//! that alternative. Text no alternative matches becomes a word of its own, as in llama.cpp.

use std::sync::OnceLock;

use regex::Regex;

/// Which pre-tokenizer a byte-level BPE model uses (`tokenizer.ggml.pre`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's original pattern (`gpt2` and the families llama.cpp treats alike).
    Gpt2,
    /// Llama 3 (`llama-bpe`, `llama3`): digits in groups of up to three.
    Llama3,
    /// Qwen2/Qwen3 (`qwen2`): single digits.
    Qwen2,
    /// GPT-4o's (`gpt-4o`, `llama4`: gpt-oss and Llama 4): a word is a run of capitals then a
    /// run of small letters (or capitals alone), with an optional leading non-letter and a
    /// trailing contraction; digits in groups of up to three; punctuation runs take trailing
    /// newlines and slashes. As llama.cpp rewrites the pattern for `std::regex`: a "capital" is
    /// any letter but `a-z`, a "small letter" any letter but `A-Z` (so non-ASCII letters are
    /// both), and marks (`\p{M}`) are not letters.
    Gpt4o,
    /// llama.cpp's fallback for unknown names (`default`): punctuation runs, GPT-2, digit runs,
    /// then groups of three ASCII digits, applied one after another.
    Default,
}

const CONTRACTIONS: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])";
/// GPT-4o's letter classes as llama.cpp matches them (see [`PreTokenizer::Gpt4o`]).
const UPPER: &str = r"[\p{L}&&[^a-z]]";
const LOWER: &str = r"[\p{L}&&[^A-Z]]";
const LEAD: &str = r"[^\r\n\p{L}\p{N}]";
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

struct Compiled {
    gpt2: Regex,
    llama3: Regex,
    qwen2: Regex,
    gpt4o: Regex,
    default_punct: Regex,
    default_digits: Regex,
    default_three: Regex,
}

fn compiled() -> &'static Compiled {
    static C: OnceLock<Compiled> = OnceLock::new();
    C.get_or_init(|| {
        // The patterns are constants; a failure here is a bug caught by every test.
        let re = |p: &str| Regex::new(p).unwrap_or_else(|e| panic!("bad pre-tokenizer regex: {e}"));
        let tail = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+";
        Compiled {
            gpt2: re(GPT2),
            llama3: re(&format!(
                r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,3}}{tail}"
            )),
            qwen2: re(&format!(
                r"{CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{tail}"
            )),
            gpt4o: re(&[
                format!(r"{LEAD}?{UPPER}*{LOWER}+{CONTRACTIONS}?"),
                format!(r"{LEAD}?{UPPER}+{LOWER}*{CONTRACTIONS}?"),
                r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+".to_string(),
            ]
            .join("|")),
            default_punct: re(r"[\p{P}\$\+<=>\^~\|]+"),
            default_digits: re(r"\p{N}+"),
            default_three: re(r"[0-9][0-9][0-9]"),
        }
    })
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` name. Unknown names get [`Self::Default`], as
    /// in llama.cpp.
    pub fn from_name(name: &str) -> Self {
        match name {
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "dbrx" | "smaug-bpe" => Self::Llama3,
            "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "hunyuan" => Self::Qwen2,
            "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" | "trillion" => Self::Gpt2,
            "gpt-4o" | "llama4" | "kanana2" | "minimax-m2" => Self::Gpt4o,
            _ => Self::Default,
        }
    }

    /// Splits `text` into words. The words are contiguous and cover `text` exactly.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let c = compiled();
        let mut out = Vec::new();
        match self {
            Self::Gpt2 => split_one(&c.gpt2, text, Lookahead::AnySpace, &mut out),
            Self::Llama3 => split_one(&c.llama3, text, Lookahead::NoNewline, &mut out),
            Self::Qwen2 => split_one(&c.qwen2, text, Lookahead::NoNewline, &mut out),
            Self::Gpt4o => split_one(&c.gpt4o, text, Lookahead::NoNewline, &mut out),
            Self::Default => {
                let mut words = vec![text];
                for (re, fix) in [
                    (&c.default_punct, Lookahead::Off),
                    (&c.gpt2, Lookahead::AnySpace),
                    (&c.default_digits, Lookahead::Off),
                    (&c.default_three, Lookahead::Off),
                ] {
                    let mut next = Vec::with_capacity(words.len());
                    for w in words {
                        split_one(re, w, fix, &mut next);
                    }
                    words = next;
                }
                out = words;
            }
        }
        out
    }
}

/// How a pattern's `\s+(?!\S)` alternative is emulated (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lookahead {
    /// The pattern has no such alternative.
    Off,
    /// Any whitespace-only match comes from it (GPT-2: no newline alternative before it).
    AnySpace,
    /// Whitespace-only matches without `\r`/`\n` come from it (Llama 3, Qwen2, GPT-4o: `\s*[\r\n]+`
    /// comes first and takes every run that contains a newline).
    NoNewline,
}

/// Splits `text` by the matches of `re`, keeping unmatched stretches as words. A whitespace run
/// matched by the `\s+` stand-in gives back its last character when a non-space follows,
/// emulating `\s+(?!\S)`.
fn split_one<'t>(re: &Regex, text: &'t str, lookahead: Lookahead, out: &mut Vec<&'t str>) {
    let mut pos = 0;
    while pos < text.len() {
        let Some(m) = re.find_at(text, pos) else {
            out.push(&text[pos..]);
            return;
        };
        if m.start() > pos {
            out.push(&text[pos..m.start()]);
        }
        let mut end = m.end();
        if end == m.start() {
            // No pattern here matches empty, but never loop forever if one did.
            end = text[end..]
                .chars()
                .next()
                .map_or(text.len(), |c| end + c.len_utf8());
        } else if lookahead != Lookahead::Off {
            let s = m.as_str();
            let followed_by_non_space = text[end..]
                .chars()
                .next()
                .is_some_and(|c| !c.is_whitespace());
            if followed_by_non_space
                && s.chars().all(char::is_whitespace)
                && (lookahead == Lookahead::AnySpace || !s.contains(['\r', '\n']))
            {
                if let Some((last, _)) = s.char_indices().next_back() {
                    if last > 0 {
                        end = m.start() + last;
                    }
                }
            }
        }
        out.push(&text[m.start()..end]);
        pos = end;
    }
}
