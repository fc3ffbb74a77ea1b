//! Drafts from a predicted answer (OpenAI's "predicted outputs"): the client sends the text it
//! expects the answer to be close to — the file being edited, the paragraph being rewritten, the
//! previous version of a document — and the drafts come from it instead of from the history.
//!
//! A prediction is only a source of guesses: [`crate::speculate::settle`] keeps a draft only
//! where the target's own draw equals it, so a wrong prediction changes no token, it only costs
//! the rows it made the target check.
//!
//! Where the answer so far is a prefix of the prediction, the drafts are what follows in it.
//! Where the answer has left it (an edit), the last few tokens of the answer are looked up in the
//! prediction, nearest to where the answer would be if it had not left, so an inserted or
//! deleted word costs a few tokens of drafting, not the rest of the prediction. Where nothing
//! matches, prompt lookup over the history drafts as without a prediction.

use crate::speculate::{DraftSource, PromptLookup};

/// Drafts per step or ring turn for a request that brings a prediction to a server that does
/// not speculate otherwise (one process's adaptive k still turns them off when the prediction
/// is wrong).
pub const PREDICTION_DRAFTS: usize = 8;

/// The longest prediction a sequence may carry: as long as the longest context a model may have,
/// so the search per draft stays bounded.
pub const MAX_PREDICTION_TOKENS: usize = 1 << 17;

/// A prediction (owned, or borrowed from the sequence that carries it), and where the answer it
/// predicts starts in the history.
#[derive(Clone, Debug)]
pub struct Predicted<P> {
    prediction: P,
    /// History positions before this are the prompt; after it, the answer.
    answer_from: usize,
    /// Longest suffix of the answer looked up in the prediction once the answer has left it;
    /// shorter ones down to `MIN_NGRAM` after.
    lookup: PromptLookup,
}

/// Shortest suffix looked up in the prediction: one token matches too often to realign on.
const MIN_NGRAM: usize = 2;

impl<P: AsRef<[u32]>> Predicted<P> {
    /// `prediction` in tokens; the answer starts at history position `answer_from` (the prompt's
    /// length, less any tokens a resumed attempt replays as prompt).
    pub fn new(prediction: P, answer_from: usize) -> Self {
        Self {
            prediction,
            answer_from,
            lookup: PromptLookup::default(),
        }
    }

    /// Where the answer `answer` goes on in the prediction: the end of the occurrence of its
    /// last few tokens nearest to `answer.len()` (ties to the earlier).
    fn realign(&self, answer: &[u32]) -> Option<usize> {
        let p = self.prediction.as_ref();
        for n in (MIN_NGRAM..=self.lookup.max_ngram.max(MIN_NGRAM)).rev() {
            if answer.len() < n || p.len() < n {
                continue;
            }
            let suffix = &answer[answer.len() - n..];
            let near = (0..=p.len() - n)
                .filter(|&s| &p[s..s + n] == suffix)
                .map(|s| s + n)
                .min_by_key(|&end| end.abs_diff(answer.len()));
            if near.is_some() {
                return near;
            }
        }
        None
    }
}

impl<P: AsRef<[u32]> + Send> DraftSource for Predicted<P> {
    fn propose(&mut self, history: &[u32], k: usize) -> Vec<u32> {
        if k == 0 {
            return Vec::new();
        }
        let answer = &history[self.answer_from.min(history.len())..];
        let prediction = self.prediction.as_ref();
        let at = if prediction.starts_with(answer) {
            Some(answer.len())
        } else {
            self.realign(answer)
        };
        match at {
            Some(at) if at < prediction.len() => prediction[at..].iter().take(k).copied().collect(),
            _ => self.lookup.propose(history, k),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROMPT: [u32; 3] = [100, 101, 102];

    fn history(answer: &[u32]) -> Vec<u32> {
        PROMPT.iter().chain(answer).copied().collect()
    }

    #[test]
    fn an_answer_on_the_prediction_is_drafted_from_it_from_the_first_token() {
        let prediction = [1, 2, 3, 4, 5, 6];
        let mut p = Predicted::new(&prediction[..], PROMPT.len());
        assert_eq!(p.propose(&history(&[]), 3), vec![1, 2, 3]);
        assert_eq!(p.propose(&history(&[1, 2]), 3), vec![3, 4, 5]);
        assert_eq!(p.propose(&history(&[1, 2, 3, 4, 5]), 3), vec![6]);
        assert_eq!(p.propose(&history(&[1, 2]), 0), Vec::<u32>::new());
    }

    #[test]
    fn an_answer_that_inserted_a_word_realigns_on_its_last_tokens() {
        // The answer inserted 9 after 2, then went on with 3 4: it is one token ahead of the
        // prediction, and the drafts follow 3 4 in it.
        let prediction = [1, 2, 3, 4, 5, 6, 7];
        let mut p = Predicted::new(&prediction[..], PROMPT.len());
        assert_eq!(p.propose(&history(&[1, 2, 9, 3, 4]), 2), vec![5, 6]);
        // Deleted 3: 2 4 5 is found as 4 5.
        assert_eq!(p.propose(&history(&[1, 2, 4, 5]), 2), vec![6, 7]);
    }

    #[test]
    fn of_two_occurrences_the_one_nearest_the_answers_place_is_followed() {
        // "7 8" occurs twice; the answer (6 tokens, an edit at its 4th) is near the second.
        let prediction = [7, 8, 1, 2, 3, 7, 8, 4, 5];
        let mut p = Predicted::new(&prediction[..], PROMPT.len());
        assert_eq!(p.propose(&history(&[7, 8, 1, 9, 7, 8]), 2), vec![4, 5]);
    }

    #[test]
    fn where_nothing_matches_prompt_lookup_drafts_from_the_history() {
        let prediction = [1, 2, 3];
        let mut p = Predicted::new(&prediction[..], PROMPT.len());
        // The answer repeats the prompt: lookup finds 101 102 in it.
        let h = history(&[50, 100, 101]);
        assert_eq!(p.propose(&h, 2), PromptLookup::default().propose(&h, 2));
        assert_eq!(p.propose(&h, 2), vec![102, 50]);
        // The answer ran past the end of the prediction: nothing left to draft from it.
        assert_eq!(p.propose(&history(&[1, 2, 3]), 2), Vec::<u32>::new());
    }

    #[test]
    fn a_resumed_attempt_counts_the_answer_from_the_original_prompt() {
        // An attempt resumed after 2 generated tokens carries them at the end of its prompt.
        let prediction = [1, 2, 3, 4];
        let mut p = Predicted::new(&prediction[..], PROMPT.len());
        assert_eq!(p.propose(&history(&[1, 2]), 2), vec![3, 4]);
    }
}
