//! Streaming detokenization: text as tokens arrive, never splitting a UTF-8 character.
//!
//! A character can span several tokens (SentencePiece byte fallback emits `<0xE2><0x9C><0x85>`,
//! byte-level BPE splits rare characters across tokens). [`StreamDecoder::push`] returns only
//! text whose UTF-8 is complete and holds back a trailing incomplete sequence (at most three
//! bytes) until a later token completes it. Bytes that can never form valid UTF-8 become U+FFFD,
//! exactly as [`Tokenizer::decode`] would render them, so the concatenation of everything `push`
//! and [`StreamDecoder::finish`] return equals `decode` of all ids. Each push costs O(piece).

use super::Tokenizer;

/// Incremental detokenizer over one [`Tokenizer`].
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    utf8: Utf8Assembler,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Self {
        Self {
            tok,
            utf8: Utf8Assembler::default(),
        }
    }

    /// Adds one id; returns the text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.utf8.push(self.tok.piece_bytes(id))
    }

    /// Ends the stream: whatever is still held back, with an incomplete sequence as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.utf8.finish()
    }
}

/// The tokenizer-free half of [`StreamDecoder`]: bytes in, complete UTF-8 text out. For callers
/// that hold the tokenizer some other way (e.g. behind an `Arc`) and look up piece bytes
/// themselves.
#[derive(Debug, Default)]
pub struct Utf8Assembler {
    pending: Vec<u8>,
}

impl Utf8Assembler {
    /// Appends `bytes`; returns the text now complete (invalid bytes as U+FFFD), holding back a
    /// trailing incomplete sequence.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid` was just checked, so this cannot fail.
                    out.push_str(&String::from_utf8_lossy(
                        &self.pending[start..start + valid],
                    ));
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start += valid + n;
                        }
                        None => {
                            // Incomplete sequence at the end: wait for more bytes.
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Whatever is still held back, with an incomplete sequence as U+FFFD; empties the buffer.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
