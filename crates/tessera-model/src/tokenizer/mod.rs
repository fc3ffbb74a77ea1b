//! Text ⇄ token ids, the way llama.cpp does it, from the vocabulary stored in a GGUF.
//!
//! Two tokenizer families cover the supported models:
//!
//! * **SentencePiece** (`tokenizer.ggml.model = "llama"`, [`spm`]): the dummy-prefix space, spaces
//!   written as `▁`, greedy bigram merging by score, and `<0xNN>` byte fallback for characters the
//!   vocabulary lacks. This reproduces llama.cpp's `llm_tokenizer_spm` token for token (the test
//!   suite checks it against llama.cpp's own output for every reference prompt).
//! * **Byte-level BPE** (`tokenizer.ggml.model = "gpt2"`, [`bpe`]): text is split into words by the
//!   model's pre-tokenizer ([`pretokenize`], chosen by `tokenizer.ggml.pre`), every byte is mapped to
//!   a printable character (GPT-2's byte-to-unicode table), and merges are applied by rank.
//!
//! Both families share the handling of special tokens: before any of the above, the text is cut at
//! occurrences of special-token strings, longest first (llama.cpp's `tokenizer_st_partition`).
//! [`Tokenizer::encode`] cuts only at user-defined tokens (as llama.cpp does when it is told not to
//! parse specials), [`Tokenizer::encode_with_specials`] also at control tokens such as
//! `<|im_start|>`, which is what a rendered chat template needs.
//!
//! Decoding maps each id to the bytes it stands for (control and unknown tokens decode to nothing,
//! as in llama.cpp's default); [`Tokenizer::decode`] turns the concatenation into a `String`,
//! replacing invalid UTF-8 the way llama.cpp's server does (one U+FFFD per maximal invalid
//! subsequence). [`StreamDecoder`] does the same incrementally, holding back an incomplete UTF-8
//! sequence until the token that completes it arrives.
//!
//! Nothing here panics on input text or ids: unknown ids decode to nothing, and every length and
//! id read from the GGUF is validated in [`Tokenizer::from_parts`].
//!
//! ```no_run
//! use tessera_model::{GgufFile, StreamDecoder, Tokenizer};
//! let g = GgufFile::open("models/stories260K.gguf")?;
//! let tok = Tokenizer::from_gguf(&g)?;
//! let ids = tok.encode("Once upon a time", true); // [1, 403, 407, 261, 378]: BOS + text
//! assert_eq!(tok.decode(&ids), " Once upon a time"); // BOS decodes to nothing
//! let mut stream = StreamDecoder::new(&tok);
//! let text: String = ids.iter().map(|&id| stream.push(id)).collect::<String>() + &stream.finish();
//! assert_eq!(text, tok.decode(&ids));
//! # Ok::<(), tessera_model::ModelError>(())
//! ```

pub mod bpe;
pub mod pretokenize;
pub mod spm;
pub mod stream;

use std::collections::HashMap;

use crate::error::{ModelError, Result};
use crate::gguf::{GgufFile, MetaArray, MetaValue};

pub use pretokenize::PreTokenizer;
pub use stream::{StreamDecoder, Utf8Assembler};

/// Token text of every EOT-like control token llama.cpp treats as end-of-generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
    "<|eom_id|>",
    "<|return|>",
    "<|call|>",
];

/// The kind of a vocabulary entry (GGUF `tokenizer.ggml.token_type`, llama.cpp's token attributes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// Ordinary text.
    Normal,
    /// `<unk>`: decodes to nothing.
    Unknown,
    /// Control tokens (`<s>`, `<|im_start|>`): decode to nothing, encoded only from their text by
    /// [`Tokenizer::encode_with_specials`].
    Control,
    /// Added tokens: always recognised in text, decode to their text.
    UserDefined,
    /// Reserved slots: never produced by encoding, decode to nothing.
    Unused,
    /// `<0xNN>` byte-fallback tokens: decode to that byte.
    Byte,
}

impl TokenType {
    /// From the GGUF/llama.cpp numbering (1 normal … 6 byte); 0 ("undefined") and unknown values
    /// count as normal text.
    pub fn from_gguf(v: i32) -> Self {
        match v {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }
}

/// Which algorithm turns text into tokens (GGUF `tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// `"llama"`: SentencePiece with byte fallback.
    Spm,
    /// `"gpt2"`: byte-level BPE with ranked merges.
    Bpe,
}

/// Everything a [`Tokenizer`] is built from, as plain data. [`Tokenizer::from_gguf`] fills it from
/// metadata; tests build it by hand to exercise vocabularies no test model has.
#[derive(Clone, Debug)]
pub struct TokenizerParts {
    pub kind: TokenizerKind,
    /// Token text by id (SPM: `▁` for space; BPE: GPT-2 byte-to-unicode characters).
    pub tokens: Vec<String>,
    /// SPM merge scores by id (higher merges first). Absent: all zero.
    pub scores: Option<Vec<f32>>,
    /// Token types by id. Absent: all normal.
    pub token_types: Option<Vec<TokenType>>,
    /// BPE merges, `"left right"`, best first.
    pub merges: Vec<String>,
    pub pre: PreTokenizer,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    /// Further end-of-generation ids (GGUF `eot_token_id`, `eom_token_id`).
    pub extra_eog_ids: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// SPM: prepend a space to text that starts the input or follows a special token.
    pub add_space_prefix: bool,
}

impl TokenizerParts {
    /// Defaults for a vocabulary of `kind`: no scores, types or merges, no special ids, BOS added
    /// for SPM only, dummy prefix for SPM only.
    pub fn new(kind: TokenizerKind, tokens: Vec<String>) -> Self {
        Self {
            kind,
            tokens,
            scores: None,
            token_types: None,
            merges: Vec::new(),
            pre: PreTokenizer::Gpt2,
            bos_id: None,
            eos_id: None,
            unk_id: None,
            extra_eog_ids: Vec::new(),
            add_bos: kind == TokenizerKind::Spm,
            add_eos: false,
            add_space_prefix: kind == TokenizerKind::Spm,
        }
    }
}

/// A piece of input text, or a special token already recognised in it.
#[derive(Clone, Copy, Debug)]
enum Fragment {
    Text(usize, usize),
    /// Text never searched for control tokens (a chat message's content).
    Plain(usize, usize),
    Token(u32),
}

/// A loaded vocabulary that encodes and decodes. Cheap to share (`&Tokenizer` is all the methods
/// need); build it once per model.
#[derive(Clone)]
pub struct Tokenizer {
    kind: TokenizerKind,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    scores: Vec<f32>,
    token_to_id: HashMap<String, u32>,
    /// The bytes each id decodes to (empty for control/unknown/unused).
    pieces: Vec<Vec<u8>>,
    /// SPM byte-fallback id for every byte value.
    byte_ids: [Option<u32>; 256],
    /// Special tokens recognised in text, longest text first: (text, id, is_user_defined).
    specials: Vec<(String, u32, bool)>,
    bpe: Option<bpe::Bpe>,
    pre: PreTokenizer,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    unk_id: Option<u32>,
    eog: Vec<bool>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("pre", &self.pre)
            .field("vocab_size", &self.tokens.len())
            .field("specials", &self.specials.len())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

fn tok_err(msg: impl Into<String>) -> ModelError {
    ModelError::Tokenizer(msg.into())
}

fn meta_u32(g: &GgufFile, key: &str) -> Result<Option<u32>> {
    match g.meta(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| tok_err(format!("metadata key '{key}' is not a token id: {v:?}"))),
    }
}

fn meta_bool(g: &GgufFile, key: &str) -> Result<Option<bool>> {
    match g.meta(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| tok_err(format!("metadata key '{key}' is not a bool: {v:?}"))),
    }
}

fn meta_strings(g: &GgufFile, key: &str) -> Result<Option<Vec<String>>> {
    match g.meta(key) {
        None => Ok(None),
        Some(MetaValue::Array(MetaArray::Strings(v))) => Ok(Some(v.clone())),
        Some(MetaValue::Array(MetaArray::Values(v))) if v.is_empty() => Ok(Some(Vec::new())),
        Some(_) => Err(tok_err(format!(
            "metadata key '{key}' is not an array of strings"
        ))),
    }
}

fn meta_numbers(g: &GgufFile, key: &str) -> Result<Option<Vec<f64>>> {
    let bad = || tok_err(format!("metadata key '{key}' is not an array of numbers"));
    match g.meta(key) {
        None => Ok(None),
        Some(MetaValue::Array(a)) => match a {
            MetaArray::F32(v) => Ok(Some(v.iter().map(|&x| f64::from(x)).collect())),
            MetaArray::I32(v) => Ok(Some(v.iter().map(|&x| f64::from(x)).collect())),
            MetaArray::U32(v) => Ok(Some(v.iter().map(|&x| f64::from(x)).collect())),
            MetaArray::Values(v) => v
                .iter()
                .map(|x| match *x {
                    MetaValue::I8(i) => Some(f64::from(i)),
                    MetaValue::I16(i) => Some(f64::from(i)),
                    MetaValue::I64(i) => Some(i as f64),
                    _ => x.as_f64(),
                })
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(bad),
            MetaArray::Strings(_) => Err(bad()),
        },
        Some(_) => Err(bad()),
    }
}

impl Tokenizer {
    /// Reads the vocabulary from GGUF metadata (`tokenizer.ggml.*`). Errors name the key that is
    /// missing or inconsistent.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let model = g
            .meta("tokenizer.ggml.model")
            .ok_or_else(|| tok_err("metadata key 'tokenizer.ggml.model' is missing"))?;
        let model = model.as_str().ok_or_else(|| {
            tok_err("metadata key 'tokenizer.ggml.model' is not a string".to_string())
        })?;
        let kind = match model {
            "llama" => TokenizerKind::Spm,
            "gpt2" => TokenizerKind::Bpe,
            other => {
                return Err(tok_err(format!(
                    "metadata key 'tokenizer.ggml.model' is '{other}'; supported: llama, gpt2"
                )))
            }
        };
        let tokens = meta_strings(g, "tokenizer.ggml.tokens")?
            .ok_or_else(|| tok_err("metadata key 'tokenizer.ggml.tokens' is missing"))?;
        let mut parts = TokenizerParts::new(kind, tokens);
        parts.scores = meta_numbers(g, "tokenizer.ggml.scores")?
            .map(|v| v.into_iter().map(|x| x as f32).collect());
        parts.token_types = meta_numbers(g, "tokenizer.ggml.token_type")?.map(|v| {
            v.into_iter()
                .map(|x| TokenType::from_gguf(x as i32))
                .collect()
        });
        if kind == TokenizerKind::Bpe {
            parts.merges = meta_strings(g, "tokenizer.ggml.merges")?
                .ok_or_else(|| tok_err("metadata key 'tokenizer.ggml.merges' is missing"))?;
            let pre = match g.meta("tokenizer.ggml.pre") {
                None => "default",
                Some(v) => v
                    .as_str()
                    .ok_or_else(|| tok_err("metadata key 'tokenizer.ggml.pre' is not a string"))?,
            };
            parts.pre = PreTokenizer::from_name(pre);
            parts.add_bos = parts.pre == PreTokenizer::Llama3;
        }
        parts.bos_id = meta_u32(g, "tokenizer.ggml.bos_token_id")?;
        parts.eos_id = meta_u32(g, "tokenizer.ggml.eos_token_id")?;
        parts.unk_id = meta_u32(g, "tokenizer.ggml.unknown_token_id")?;
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = meta_u32(g, key)? {
                if id as usize >= parts.tokens.len() {
                    return Err(tok_err(format!(
                        "metadata key '{key}' is {id}, outside the vocabulary of {}",
                        parts.tokens.len()
                    )));
                }
                parts.extra_eog_ids.push(id);
            }
        }
        if let Some(b) = meta_bool(g, "tokenizer.ggml.add_bos_token")? {
            parts.add_bos = b;
        }
        if let Some(b) = meta_bool(g, "tokenizer.ggml.add_eos_token")? {
            parts.add_eos = b;
        }
        if let Some(b) = meta_bool(g, "tokenizer.ggml.add_space_prefix")? {
            parts.add_space_prefix = b;
        }
        Self::from_parts(parts)
    }

    /// Builds a tokenizer from plain parts, validating them: array lengths must match the token
    /// list and special ids must lie inside it (errors name the GGUF key concerned).
    pub fn from_parts(p: TokenizerParts) -> Result<Self> {
        let n = p.tokens.len();
        if n == 0 {
            return Err(tok_err("metadata key 'tokenizer.ggml.tokens' is empty"));
        }
        if n > u32::MAX as usize {
            return Err(tok_err("metadata key 'tokenizer.ggml.tokens' is too long"));
        }
        let mut scores = match p.scores {
            Some(s) if s.len() != n => {
                return Err(tok_err(format!(
                    "metadata key 'tokenizer.ggml.scores' has {} entries but 'tokenizer.ggml.tokens' has {n}",
                    s.len()
                )))
            }
            Some(s) => s,
            None => vec![0.0; n],
        };
        // -0.0 and 0.0 must tie (llama.cpp compares with `<`), and NaN must not win.
        for s in &mut scores {
            *s = if s.is_nan() {
                f32::NEG_INFINITY
            } else {
                *s + 0.0
            };
        }
        let types = match p.token_types {
            Some(t) if t.len() != n => {
                return Err(tok_err(format!(
                    "metadata key 'tokenizer.ggml.token_type' has {} entries but 'tokenizer.ggml.tokens' has {n}",
                    t.len()
                )))
            }
            Some(t) => t,
            None => vec![TokenType::Normal; n],
        };
        for (key, id) in [
            ("tokenizer.ggml.bos_token_id", p.bos_id),
            ("tokenizer.ggml.eos_token_id", p.eos_id),
            ("tokenizer.ggml.unknown_token_id", p.unk_id),
        ] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(tok_err(format!(
                        "metadata key '{key}' is {id}, outside the vocabulary of {n}"
                    )));
                }
            }
        }
        if p.add_bos && p.bos_id.is_none() {
            return Err(tok_err(
                "metadata key 'tokenizer.ggml.add_bos_token' is true, but 'tokenizer.ggml.bos_token_id' is not set",
            ));
        }
        if p.add_eos && p.eos_id.is_none() {
            return Err(tok_err(
                "metadata key 'tokenizer.ggml.add_eos_token' is true, but 'tokenizer.ggml.eos_token_id' is not set",
            ));
        }

        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in p.tokens.iter().enumerate() {
            // Later duplicates win, as in llama.cpp.
            token_to_id.insert(t.clone(), i as u32);
        }

        let pieces: Vec<Vec<u8>> = p
            .tokens
            .iter()
            .zip(&types)
            .map(|(text, ty)| match ty {
                TokenType::Control | TokenType::Unknown | TokenType::Unused => Vec::new(),
                TokenType::UserDefined => text.as_bytes().to_vec(),
                TokenType::Byte => parse_byte_token(text).map(|b| vec![b]).unwrap_or_default(),
                TokenType::Normal => match p.kind {
                    TokenizerKind::Spm => text.replace('\u{2581}', " ").into_bytes(),
                    TokenizerKind::Bpe => bpe::decode_byte_level(text),
                },
            })
            .collect();

        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = token_to_id.get(hex.as_str()).copied().or_else(|| {
                let single = [b as u8];
                std::str::from_utf8(&single)
                    .ok()
                    .and_then(|s| token_to_id.get(s).copied())
            });
        }

        let mut specials: Vec<(String, u32, bool)> = p
            .tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (text, ty))| {
                !text.is_empty()
                    && matches!(
                        ty,
                        TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                    )
            })
            .map(|(i, (text, ty))| (text.clone(), i as u32, *ty == TokenType::UserDefined))
            .collect();
        // Longest first; ties by id for determinism.
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));

        let bpe = match p.kind {
            TokenizerKind::Bpe => Some(bpe::Bpe::new(&p.merges, &token_to_id)?),
            TokenizerKind::Spm => None,
        };

        let mut eog = vec![false; n];
        for id in p.eos_id.iter().chain(&p.extra_eog_ids) {
            if let Some(e) = eog.get_mut(*id as usize) {
                *e = true;
            }
        }
        for t in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*t) {
                eog[id as usize] = true;
            }
        }

        Ok(Self {
            kind: p.kind,
            tokens: p.tokens,
            types,
            scores,
            token_to_id,
            pieces,
            byte_ids,
            specials,
            bpe,
            pre: p.pre,
            bos_id: p.bos_id,
            eos_id: p.eos_id,
            unk_id: p.unk_id,
            eog,
            add_bos: p.add_bos,
            add_eos: p.add_eos,
            add_space_prefix: p.add_space_prefix,
        })
    }

    /// Tokens for plain text. Special-token strings in it are *not* turned into control tokens
    /// (user-defined tokens are, as in llama.cpp). `add_special`: prepend BOS / append EOS where
    /// the model's metadata asks for them.
    pub fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        self.encode_impl(text, add_special, false)
    }

    /// Tokens for text that may contain special-token strings like `<|im_start|>` (chat
    /// templates output these): the text is split on special/control tokens first, longest
    /// first, those map to their ids, and the rest is tokenized normally.
    pub fn encode_with_specials(&self, text: &str, add_special: bool) -> Vec<u32> {
        self.encode_impl(text, add_special, true)
    }

    /// [`Tokenizer::encode_with_specials`], except that the byte ranges `plain` (sorted, not
    /// overlapping, on character boundaries) are tokenized as plain text: control-token strings
    /// in them stay text. A chat template's own markup gives control tokens; what a user wrote
    /// inside it never does.
    pub fn encode_with_specials_except(
        &self,
        text: &str,
        add_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Vec<u32> {
        self.encode_fragments(text, add_special, self.partition(text, true, plain))
    }

    /// Whether `text` holds the text of a control (non-user-defined special) token.
    pub fn contains_control_text(&self, text: &str) -> bool {
        self.specials
            .iter()
            .any(|(s, _, user_defined)| !*user_defined && text.contains(s.as_str()))
    }

    fn encode_impl(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        self.encode_fragments(text, add_special, self.partition(text, parse_special, &[]))
    }

    fn encode_fragments(
        &self,
        text: &str,
        add_special: bool,
        fragments: Vec<Fragment>,
    ) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos_id);
        }
        match self.kind {
            TokenizerKind::Spm => {
                let mut prev_special = true;
                for f in fragments {
                    match f {
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                        Fragment::Text(a, b) | Fragment::Plain(a, b) => {
                            let mut s = String::with_capacity(b - a + 3);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(&text[a..b]);
                            let escaped = s.replace(' ', "\u{2581}");
                            spm::tokenize(self, &escaped, &mut out);
                            prev_special = false;
                        }
                    }
                }
            }
            TokenizerKind::Bpe => {
                for f in fragments {
                    match f {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(a, b) | Fragment::Plain(a, b) => {
                            self.bpe_text(&text[a..b], &mut out)
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos_id);
        }
        out
    }

    fn bpe_text(&self, text: &str, out: &mut Vec<u32>) {
        let Some(bpe) = &self.bpe else { return };
        let ignore_merges = self.pre == PreTokenizer::Llama3;
        let mut encoded = String::new();
        for word in self.pre.split(text) {
            encoded.clear();
            bpe::encode_bytes_into(word.as_bytes(), &mut encoded);
            if ignore_merges {
                if let Some(&id) = self.token_to_id.get(encoded.as_str()) {
                    out.push(id);
                    continue;
                }
            }
            bpe.encode_word(&encoded, &self.token_to_id, out);
        }
    }

    /// llama.cpp's special-token partition: for each special token, longest first, cut every
    /// remaining text fragment at its occurrences.
    /// `plain` ranges are cut at user-defined tokens only (as text is when `parse_special` is
    /// false).
    fn partition(
        &self,
        text: &str,
        parse_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        let mut at = 0;
        for r in plain {
            if r.start < at || r.end > text.len() {
                continue;
            }
            if r.start > at {
                frags.push(Fragment::Text(at, r.start));
            }
            if r.end > r.start {
                frags.push(Fragment::Plain(r.start, r.end));
            }
            at = r.end;
        }
        if at < text.len() {
            frags.push(Fragment::Text(at, text.len()));
        }
        for (stext, id, user_defined) in &self.specials {
            if !parse_special && !*user_defined {
                continue;
            }
            if !text.contains(stext.as_str()) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let (mut a, b, plain) = match f {
                    Fragment::Text(a, b) => (a, b, false),
                    Fragment::Plain(a, b) if *user_defined => (a, b, true),
                    _ => {
                        next.push(f);
                        continue;
                    }
                };
                let piece = |a, b| {
                    if plain {
                        Fragment::Plain(a, b)
                    } else {
                        Fragment::Text(a, b)
                    }
                };
                while let Some(pos) = text[a..b].find(stext.as_str()) {
                    if pos > 0 {
                        next.push(piece(a, a + pos));
                    }
                    next.push(Fragment::Token(*id));
                    a += pos + stext.len();
                }
                if a < b {
                    next.push(piece(a, b));
                }
            }
            frags = next;
        }
        frags
    }

    /// The text for `ids`: control and unknown tokens contribute nothing, byte tokens their byte,
    /// and invalid UTF-8 becomes U+FFFD. The SentencePiece dummy-prefix space is kept (llama.cpp's
    /// server keeps it too: a continuation starts with the space that separates it from the
    /// prompt).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes = self.decode_bytes(ids);
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes for `ids` (see [`Tokenizer::decode`]); they need not be valid UTF-8.
    pub fn decode_bytes(&self, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.piece_bytes(id));
        }
        out
    }

    /// The bytes one id decodes to (empty for control/unknown/unused tokens and ids outside the
    /// vocabulary).
    pub fn piece_bytes(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// The vocabulary text of `id`, as stored in the model (`▁the`, `Ġthe`, `<0x0A>`, `<s>`).
    pub fn token_str(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The id whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }

    /// Whether [`Tokenizer::encode`] with `add_special` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Ids that end generation: EOS, the GGUF's EOT/EOM ids, and EOT-like tokens recognised by
    /// their text (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `<end_of_turn>`, ...).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.eog.get(id as usize).copied().unwrap_or(false)
    }

    pub(crate) fn score(&self, id: u32) -> f32 {
        self.scores
            .get(id as usize)
            .copied()
            .unwrap_or(f32::NEG_INFINITY)
    }

    pub(crate) fn lookup(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub(crate) fn byte_id(&self, b: u8) -> Option<u32> {
        self.byte_ids[b as usize]
    }
}

/// `<0xNN>` → NN.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}
