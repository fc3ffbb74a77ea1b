//! KV caches of finished sequences kept for the next request that starts the same way.
//!
//! A chat re-sends its whole history every turn: without reuse, turn N prefills every earlier
//! turn again, and the time to its first token grows with the conversation. A finished
//! sequence's cache holds exactly the positions of the tokens it fed (prompt, then answer), so
//! a new prompt that begins with those tokens needs only its new tail prefilled. Kernels are
//! batch-invariant, so keys and values computed then equal those a fresh prefill would compute:
//! the answer is the same with or without reuse.
//!
//! Generic over the cache type so the policy is tested without a model. `tessera serve` keeps
//! one of whole-model caches; each stage of a cluster keeps one of its layers' caches, and the
//! coordinator starts a sequence from the shortest prefix its stages found (so they agree).

use std::collections::VecDeque;

/// Caches kept unless configured: two conversations alternating keep theirs.
pub const DEFAULT_KEPT: usize = 2;

/// Finished sequences' caches, most recently used first, at most `capacity` of them.
#[derive(Debug)]
pub struct PrefixCache<K> {
    entries: VecDeque<Entry<K>>,
    capacity: usize,
}

#[derive(Debug)]
struct Entry<K> {
    /// The tokens whose positions `kv` holds, in order.
    tokens: Vec<u32>,
    kv: K,
}

/// A cache taken for reuse: its first `reused` positions equal the new prompt's first tokens.
#[derive(Debug)]
pub struct Reuse<K> {
    pub kv: K,
    pub reused: usize,
}

impl<K> PrefixCache<K> {
    /// Keeps at most `capacity` caches (0 turns reuse off).
    pub fn new(capacity: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            capacity,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The caches kept, most recently used first.
    pub fn values(&self) -> impl Iterator<Item = &K> {
        self.entries.iter().map(|e| &e.kv)
    }

    /// Drops the least recently used cache (to make room for a new sequence); it, if any.
    pub fn pop_oldest(&mut self) -> Option<K> {
        self.entries.pop_back().map(|e| e.kv)
    }

    /// Keeps `kv`, which holds the positions of `tokens`. The least recently used cache is
    /// dropped when more than `capacity` are kept.
    pub fn put(&mut self, tokens: Vec<u32>, kv: K) {
        if self.capacity == 0 || tokens.is_empty() {
            return;
        }
        self.entries.push_front(Entry { tokens, kv });
        self.entries.truncate(self.capacity);
    }

    /// Takes the cache sharing the longest prefix with `prompt`, if any shares a token. At
    /// least the prompt's last token is left to prefill: its logits start the answer. The
    /// caller truncates the cache to `reused` positions.
    pub fn take(&mut self, prompt: &[u32]) -> Option<Reuse<K>> {
        let limit = prompt.len().saturating_sub(1);
        let (best, reused) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, common_prefix(&e.tokens, prompt).min(limit)))
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(i)))?;
        if reused == 0 {
            return None;
        }
        let e = self.entries.remove(best)?;
        Some(Reuse { kv: e.kv, reused })
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_shared_prefix_wins_and_leaves_one_token_to_prefill() {
        let mut c = PrefixCache::new(4);
        c.put(vec![1, 2, 3], "short");
        c.put(vec![1, 2, 3, 4, 5, 6], "long");
        c.put(vec![9, 9], "other");
        let r = c.take(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
        assert_eq!((r.kv, r.reused), ("long", 6));
        // The same prompt again: all of it is cached, but its last token must be fed.
        c.put(vec![1, 2, 3, 4, 5, 6, 7, 8], "turn");
        let r = c.take(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap();
        assert_eq!((r.kv, r.reused), ("turn", 7));
        // Taken caches are gone; nothing shared is no reuse.
        assert_eq!(c.len(), 2);
        assert!(c.take(&[5, 5, 5]).is_none());
        assert!(
            c.take(&[1]).is_none(),
            "a one-token prompt has nothing to reuse"
        );
    }

    #[test]
    fn at_most_capacity_caches_are_kept_most_recent_first() {
        let mut c = PrefixCache::new(2);
        c.put(vec![1, 1], 'a');
        c.put(vec![1, 2], 'b');
        c.put(vec![1, 3], 'c');
        assert_eq!(c.len(), 2);
        // 'a' was dropped; among equal prefixes the most recent is taken.
        assert_eq!(c.take(&[1, 1, 7]).unwrap().kv, 'c');
        assert_eq!(c.values().collect::<Vec<_>>(), [&'b']);
        assert_eq!(c.pop_oldest(), Some('b'));
        assert_eq!(c.pop_oldest(), None);
        let mut off = PrefixCache::new(0);
        off.put(vec![1, 2], 'x');
        assert!(off.is_empty());
    }
}
