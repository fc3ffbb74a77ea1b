//! SentencePiece (BPE-by-score) encoding as llama.cpp does it.
//!
//! The text (already space-escaped to `▁`) starts as one symbol per UTF-8 character. Every
//! adjacent pair whose concatenation is a vocabulary token is a candidate; the candidate with the
//! highest score is merged first (ties: the leftmost), and the new neighbours become candidates.
//! A priority queue with lazy invalidation keeps this O(n log n). What remains are tokens, except
//! single characters the vocabulary lacks, which fall back to `<0xNN>` byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::Tokenizer;

const NONE: usize = usize::MAX;

#[derive(Clone, Copy)]
struct Symbol {
    prev: usize,
    next: usize,
    start: usize,
    len: usize,
}

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the smaller left index. Scores are sanitised at
    /// load (no NaN, no -0.0), so `total_cmp` agrees with llama.cpp's `<`.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Appends the tokens of `text` (spaces already replaced by `▁`) to `out`.
pub(crate) fn tokenize(tok: &Tokenizer, text: &str, out: &mut Vec<u32>) {
    if text.is_empty() {
        return;
    }
    let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, (start, ch)) in text.char_indices().enumerate() {
        symbols.push(Symbol {
            prev: if i == 0 { NONE } else { i - 1 },
            next: i + 1,
            start,
            len: ch.len_utf8(),
        });
    }
    if let Some(last) = symbols.last_mut() {
        last.next = NONE;
    }

    let mut queue = BinaryHeap::with_capacity(symbols.len());
    let try_add =
        |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left: usize, right: usize| {
            if left == NONE || right == NONE {
                return;
            }
            let (l, r) = (symbols[left], symbols[right]);
            let piece = &text[l.start..l.start + l.len + r.len];
            if let Some(id) = tok.lookup(piece) {
                queue.push(Bigram {
                    score: tok.score(id),
                    left,
                    right,
                    size: piece.len(),
                });
            }
        };
    for i in 1..symbols.len() {
        try_add(&symbols, &mut queue, i - 1, i);
    }

    while let Some(b) = queue.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        // Stale: one side was merged away or grew since this candidate was queued.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if r.next != NONE {
            symbols[r.next].prev = b.left;
        }
        try_add(&symbols, &mut queue, l.prev, b.left);
        try_add(&symbols, &mut queue, b.left, r.next);
    }

    let mut i = 0;
    while i != NONE {
        let s = symbols[i];
        let piece = &text[s.start..s.start + s.len];
        match tok.lookup(piece) {
            Some(id) => out.push(id),
            None => {
                // Only unmerged single characters can be missing: emit their bytes.
                for &b in piece.as_bytes() {
                    if let Some(id) = tok.byte_id(b).or(tok.unk_id()) {
                        out.push(id);
                    }
                }
            }
        }
        i = s.next;
    }
}
