//! The binary hot-path frames between stages ([`super::stream::RING`]): hidden states behind a
//! [`StepHeader`] ([`super::frame::HIDDEN`]) and sampled tokens ([`RingToken`]).

#[cfg(doc)]
use super::frame;
use super::{limits, FrameDecodeError, OpenSeq};

/// One sequence's rows in a hidden-state frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepEntry {
    pub seq: u64,
    /// Position of the first row.
    pub start_pos: u32,
    pub n_tokens: u32,
    /// [`StepEntry::SAMPLE`]: the last stage samples after this entry's last row;
    /// [`StepEntry::VERIFY`]: after every row (rows 1.. are drafts to check).
    pub flags: u8,
}

impl StepEntry {
    /// The last row of this entry is to be sampled (final prefill chunk, or a decode step).
    pub const SAMPLE: u8 = 1;
    /// Speculation: row 0 embeds the last accepted token and rows 1.. the drafts after it; the
    /// last stage draws after every row and keeps the drafts that agree. Every stage's cache
    /// holds the drafts' positions until the next step, which starts where the agreement
    /// ended (the positions past it are dropped, not recomputed).
    pub const VERIFY: u8 = 2;

    pub fn sample(&self) -> bool {
        self.flags & Self::SAMPLE != 0
    }

    pub fn verify(&self) -> bool {
        self.flags & Self::VERIFY != 0
    }
}

/// Header of a [`frame::HIDDEN`] frame: which rows belong to which sequence.
///
/// Layout (little-endian): `u16 n_entries`, `u32 n_embd`, then per entry
/// `u64 seq, u32 start_pos, u32 n_tokens, u8 flags`; then `Σ n_tokens × n_embd` `f32`s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepHeader {
    pub n_embd: u32,
    pub entries: Vec<StepEntry>,
}

const ENTRY_LEN: usize = 8 + 4 + 4 + 1;

impl StepHeader {
    /// Bytes of the encoded header.
    pub fn encoded_len(&self) -> usize {
        2 + 4 + ENTRY_LEN * self.entries.len()
    }

    /// Rows of hidden state the frame carries.
    pub fn n_rows(&self) -> usize {
        self.entries.iter().map(|e| e.n_tokens as usize).sum()
    }

    /// Encodes the header and `data` into one frame payload.
    pub fn encode_with(&self, data: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len() + data.len() * 4);
        out.extend_from_slice(&(self.entries.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.n_embd.to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&e.seq.to_le_bytes());
            out.extend_from_slice(&e.start_pos.to_le_bytes());
            out.extend_from_slice(&e.n_tokens.to_le_bytes());
            out.push(e.flags);
        }
        tessera_net::frame::extend_f32s_le(&mut out, data);
        out
    }

    /// Decodes a payload, checking the width against `n_embd` and the data length against the
    /// header before allocating for the data.
    pub fn decode(payload: &[u8], n_embd: usize) -> Result<(Self, Vec<f32>), FrameDecodeError> {
        let short = |need| FrameDecodeError::Short {
            len: payload.len(),
            need,
        };
        if payload.len() < 6 {
            return Err(short(6));
        }
        let n = u16::from_le_bytes([payload[0], payload[1]]) as usize;
        let width = u32::from_le_bytes(payload[2..6].try_into().expect("4 bytes"));
        if n == 0 {
            return Err(FrameDecodeError::NoEntries);
        }
        if n > limits::MAX_STEP_ENTRIES {
            return Err(FrameDecodeError::TooManyEntries(n));
        }
        if width as usize != n_embd {
            return Err(FrameDecodeError::BadWidth {
                got: width as usize,
                expected: n_embd,
            });
        }
        let head = 6 + n * ENTRY_LEN;
        if payload.len() < head {
            return Err(short(head));
        }
        let mut entries = Vec::with_capacity(n);
        let mut rows = 0usize;
        for i in 0..n {
            let b = &payload[6 + i * ENTRY_LEN..6 + (i + 1) * ENTRY_LEN];
            let e = StepEntry {
                seq: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
                start_pos: u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")),
                n_tokens: u32::from_le_bytes(b[12..16].try_into().expect("4 bytes")),
                flags: b[16],
            };
            rows = rows
                .checked_add(e.n_tokens as usize)
                .ok_or(FrameDecodeError::Overflow)?;
            entries.push(e);
        }
        let expected = rows
            .checked_mul(n_embd)
            .and_then(|x| x.checked_mul(4))
            .ok_or(FrameDecodeError::Overflow)?;
        let got = payload.len() - head;
        if got != expected {
            return Err(FrameDecodeError::BadPayload { got, expected });
        }
        let data = tessera_net::frame::f32s_from_le_bytes(&payload[head..])
            .expect("length is a multiple of 4");
        Ok((
            Self {
                n_embd: width,
                entries,
            },
            data,
        ))
    }
}

/// A token on its way from the last stage back to the first: `u64 seq, u32 pos, u32 token`,
/// then `u32` per draft to run after it (speculation, [`StepEntry::VERIFY`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingToken {
    pub seq: u64,
    /// The position the token occupies in the sequence.
    pub pos: u32,
    pub token: u32,
    /// Guesses of the tokens after it, at `pos + 1`, … (at most [`OpenSeq::MAX_SPECULATE`]).
    pub drafts: Vec<u32>,
}

impl RingToken {
    /// Bytes without drafts.
    pub const LEN: usize = 16;

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::LEN + 4 * self.drafts.len());
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.pos.to_le_bytes());
        b.extend_from_slice(&self.token.to_le_bytes());
        for d in &self.drafts {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b
    }

    pub fn decode(payload: &[u8]) -> Result<Self, FrameDecodeError> {
        if payload.len() < Self::LEN {
            return Err(FrameDecodeError::Short {
                len: payload.len(),
                need: Self::LEN,
            });
        }
        let rest = &payload[Self::LEN..];
        if !rest.len().is_multiple_of(4) {
            return Err(FrameDecodeError::BadDrafts { len: payload.len() });
        }
        if rest.len() / 4 > OpenSeq::MAX_SPECULATE {
            return Err(FrameDecodeError::TooManyDrafts {
                got: rest.len() / 4,
            });
        }
        let u32_at = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
        Ok(Self {
            seq: u64::from_le_bytes(payload[0..8].try_into().expect("8 bytes")),
            pos: u32_at(&payload[8..12]),
            token: u32_at(&payload[12..16]),
            drafts: rest.chunks_exact(4).map(u32_at).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode_chunk;

    fn header() -> StepHeader {
        StepHeader {
            n_embd: 4,
            entries: vec![
                StepEntry {
                    seq: 7,
                    start_pos: 3,
                    n_tokens: 2,
                    flags: StepEntry::SAMPLE,
                },
                StepEntry {
                    seq: 9,
                    start_pos: 0,
                    n_tokens: 1,
                    flags: 0,
                },
            ],
        }
    }

    #[test]
    fn step_header_round_trip() {
        let h = header();
        let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
        let p = h.encode_with(&data);
        assert_eq!(p.len(), h.encoded_len() + 48);
        let (back, d) = StepHeader::decode(&p, 4).unwrap();
        assert_eq!(back, h);
        assert_eq!(d, data);
    }

    #[test]
    fn one_sequence_header_is_small() {
        let h = StepHeader {
            n_embd: 64,
            entries: vec![header().entries[0]],
        };
        assert_eq!(h.encoded_len(), 23);
    }

    #[test]
    fn malformed_step_frames_are_refused_without_panicking() {
        let h = header();
        let p = h.encode_with(&[0.0; 12]);
        assert!(matches!(
            StepHeader::decode(&p, 8),
            Err(FrameDecodeError::BadWidth { .. })
        ));
        assert!(matches!(
            StepHeader::decode(&p[..p.len() - 1], 4),
            Err(FrameDecodeError::BadPayload { .. })
        ));
        assert!(StepHeader::decode(&p[..10], 4).is_err());
        assert!(StepHeader::decode(&[], 4).is_err());
        // A header claiming u32::MAX rows is refused by arithmetic, not allocation.
        let mut big = p.clone();
        big[6 + 12..6 + 16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(StepHeader::decode(&big, 4).is_err());
        let mut many = p;
        many[0..2].copy_from_slice(&u16::MAX.to_le_bytes());
        assert!(matches!(
            StepHeader::decode(&many, 4),
            Err(FrameDecodeError::TooManyEntries(_))
        ));
        for cut in 0..40 {
            let junk: Vec<u8> = (0..cut).map(|i| (i * 37 + 11) as u8).collect();
            let _ = StepHeader::decode(&junk, 4);
            let _ = RingToken::decode(&junk);
            let _ = decode_chunk(&junk);
        }
    }

    #[test]
    fn ring_token_round_trip() {
        let mut t = RingToken {
            seq: u64::MAX - 1,
            pos: 77,
            token: 123_456,
            drafts: vec![],
        };
        assert_eq!(t.encode().len(), RingToken::LEN);
        assert_eq!(RingToken::decode(&t.encode()).unwrap(), t);
        t.drafts = vec![5, 6, 7];
        assert_eq!(RingToken::decode(&t.encode()).unwrap(), t);
        assert!(RingToken::decode(&[0; 15]).is_err());
        assert_eq!(
            RingToken::decode(&[0; 18]),
            Err(FrameDecodeError::BadDrafts { len: 18 })
        );
        t.drafts = vec![1; OpenSeq::MAX_SPECULATE + 1];
        assert_eq!(
            RingToken::decode(&t.encode()),
            Err(FrameDecodeError::TooManyDrafts {
                got: OpenSeq::MAX_SPECULATE + 1
            })
        );
    }
}
