//! Byte-level BPE (GPT-2 family: Qwen2/3, Llama 3).
//!
//! Each pre-tokenized word is turned into GPT-2's printable byte alphabet (every byte maps to one
//! character, so any UTF-8 — or any byte string — is representable), then merged pairwise: the
//! adjacent pair with the best (lowest) merge rank first, ties to the leftmost, until no pair has
//! a rank. Merges are indexed by the ids of their two halves, so a lookup is one hash probe.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;

use crate::error::Result;

const NONE: usize = usize::MAX;

/// A merge candidate: (rank, left index, right index, merged byte size, merged id). Tuple order
/// is heap order: best rank first, then leftmost.
type Candidate = (u32, usize, usize, usize, u32);

/// GPT-2's byte → char table: printable Latin-1 bytes map to themselves, the rest to U+0100...
fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut extra = 0u32;
        for (b, slot) in t.iter_mut().enumerate() {
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            let cp = if printable {
                b as u32
            } else {
                extra += 1;
                255 + extra
            };
            *slot = char::from_u32(cp).unwrap_or('\u{FFFD}');
        }
        t
    })
}

/// The inverse of [`byte_to_char`], for chars below U+0180 (all the table uses).
fn char_to_byte(c: char) -> Option<u8> {
    static TABLE: OnceLock<[i16; 0x180]> = OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [-1i16; 0x180];
        for (b, &c) in byte_to_char().iter().enumerate() {
            t[c as usize] = b as i16;
        }
        t
    });
    t.get(c as usize).and_then(|&b| u8::try_from(b).ok())
}

/// Appends the byte-level encoding of `bytes` to `out`.
pub fn encode_bytes_into(bytes: &[u8], out: &mut String) {
    let t = byte_to_char();
    out.reserve(bytes.len() * 2);
    for &b in bytes {
        out.push(t[b as usize]);
    }
}

/// The bytes a byte-level token text stands for. Characters outside GPT-2's alphabet (which a
/// well-formed vocabulary never has) are kept as their own UTF-8.
pub fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Ranked merges, indexed by the ids of the two halves.
#[derive(Clone, Debug)]
pub(crate) struct Bpe {
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
}

impl Bpe {
    /// Indexes `merges` (`"left right"`, best first). Merges whose halves or result are not in
    /// the vocabulary can never apply and are dropped; a repeated pair keeps its best rank.
    pub(crate) fn new(merges: &[String], vocab: &HashMap<String, u32>) -> Result<Self> {
        let mut map = HashMap::with_capacity(merges.len());
        let mut joined = String::new();
        for (rank, m) in merges.iter().enumerate() {
            // The separator is the first space after the first byte (a half is never empty).
            let Some(sp) = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (l, r) = (&m[..sp], &m[sp + 1..]);
            let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) else {
                continue;
            };
            joined.clear();
            joined.push_str(l);
            joined.push_str(r);
            let Some(&mi) = vocab.get(joined.as_str()) else {
                continue;
            };
            map.entry((li, ri))
                .or_insert((u32::try_from(rank).unwrap_or(u32::MAX), mi));
        }
        Ok(Self { merges: map })
    }

    /// Appends the tokens of one byte-level-encoded word to `out`.
    pub(crate) fn encode_word(&self, word: &str, vocab: &HashMap<String, u32>, out: &mut Vec<u32>) {
        #[derive(Clone, Copy)]
        struct Sym {
            prev: usize,
            next: usize,
            start: usize,
            len: usize,
            id: Option<u32>,
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
        for (i, (start, c)) in word.char_indices().enumerate() {
            let len = c.len_utf8();
            syms.push(Sym {
                prev: if i == 0 { NONE } else { i - 1 },
                next: i + 1,
                start,
                len,
                id: vocab.get(&word[start..start + len]).copied(),
            });
        }
        let Some(last) = syms.last_mut() else { return };
        last.next = NONE;
        if syms.len() == 1 {
            emit(&syms[0].id, &word[syms[0].start..], vocab, out);
            return;
        }

        // Min-heap on (rank, left); entries carry the merged size to detect staleness.
        let mut heap: BinaryHeap<Reverse<Candidate>> = BinaryHeap::new();
        let push = |syms: &[Sym], heap: &mut BinaryHeap<_>, l: usize, r: usize| {
            if l == NONE || r == NONE {
                return;
            }
            if let (Some(li), Some(ri)) = (syms[l].id, syms[r].id) {
                if let Some(&(rank, mi)) = self.merges.get(&(li, ri)) {
                    heap.push(Reverse((rank, l, r, syms[l].len + syms[r].len, mi)));
                }
            }
        };
        for i in 1..syms.len() {
            push(&syms, &mut heap, i - 1, i);
        }
        while let Some(Reverse((_, l, r, size, mi))) = heap.pop() {
            let (ls, rs) = (syms[l], syms[r]);
            if ls.len == 0 || rs.len == 0 || ls.len + rs.len != size {
                continue;
            }
            syms[l].len = size;
            syms[l].id = Some(mi);
            syms[r].len = 0;
            syms[l].next = rs.next;
            if rs.next != NONE {
                syms[rs.next].prev = l;
            }
            push(&syms, &mut heap, ls.prev, l);
            push(&syms, &mut heap, l, rs.next);
        }
        let mut i = 0;
        while i != NONE {
            let s = syms[i];
            emit(&s.id, &word[s.start..s.start + s.len], vocab, out);
            i = s.next;
        }
    }
}

/// A final symbol: its id, or (for characters the vocabulary lacks) the ids of its characters.
fn emit(id: &Option<u32>, text: &str, vocab: &HashMap<String, u32>, out: &mut Vec<u32>) {
    match id {
        Some(id) => out.push(*id),
        None => {
            let mut buf = [0u8; 4];
            for c in text.chars() {
                if let Some(&id) = vocab.get(&*c.encode_utf8(&mut buf)) {
                    out.push(id);
                }
            }
        }
    }
}
