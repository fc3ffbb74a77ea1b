//! Sealed envelopes: a request travels to one worker sealed with HPKE (RFC 9180 base mode,
//! DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20-Poly1305), its routing header in clear for the
//! coordinator and bound as the AEAD's associated data; the answer travels back sealed to the
//! client's reply key in HPKE auth mode, so only the worker that opened the request can have
//! written it, bound to the job id and attempt.
//!
//! A coordinator that rewrites any header field (recipient, expiry, attempt, model, size, reply
//! key) gets [`SealError::Authentication`] at the worker, never a job that runs under changed terms;
//! it can drop or delay envelopes, which leases ([`crate::lease`]) and expiry handle.

use std::fmt;
use std::str::FromStr;

use hpke::{Deserializable, OpModeR, OpModeS, Serializable};

use crate::canonical::{hex, unhex, Reader, Writer, MAX_STR};
use crate::claims::SignedClaims;
use crate::error::{FormatError, SealError};
use crate::keys::{serde_via_string, Kem, KeyId, PublicKey, SecretKey};
use crate::verify::AnswerDigest;
use crate::UnixMillis;

type Aead = hpke::aead::ChaCha20Poly1305;
type Kdf = hpke::kdf::HkdfSha256;
type EncappedKey = <Kem as hpke::Kem>::EncappedKey;

/// Largest body sealed or opened (a request with its prompt, or a result with its text).
pub const MAX_BODY: usize = 16 << 20;
/// Longest model name a header carries.
pub const MAX_MODEL_NAME: usize = MAX_STR;
/// ChaCha20-Poly1305 tag length.
const TAG_LEN: usize = 16;
/// Largest canonical header accepted from the wire (far above any legal header).
const MAX_HEADER: usize = 1024;

const JOB_HEADER_TAG: &str = "tessera-seal job header v1";
const RESULT_HEADER_TAG: &str = "tessera-seal result header v1";
const JOB_INFO: &[u8] = b"tessera-seal v1 job";
const RESULT_INFO: &[u8] = b"tessera-seal v1 result";
const JOB_MAGIC: &[u8; 8] = b"TSEALJ1\n";
const RESULT_MAGIC: &[u8; 8] = b"TSEALR1\n";

/// A job's id: 16 random bytes, printed as 32 hex digits. With the attempt number it tells a retry
/// (same id, higher attempt) from a replay (same id, same attempt).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId([u8; 16]);

impl JobId {
    /// A fresh random id.
    pub fn random() -> Self {
        let mut b = [0u8; 16];
        rand_core::RngCore::fill_bytes(&mut rand_core::UnwrapErr(rand_core::OsRng), &mut b);
        Self(b)
    }
    pub const fn from_bytes(b: [u8; 16]) -> Self {
        Self(b)
    }
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JobId({self})")
    }
}

impl FromStr for JobId {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, FormatError> {
        unhex(s, "job id").map(Self)
    }
}
serde_via_string!(JobId);

/// The routing header: everything the coordinator may read, all of it authenticated.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JobHeader {
    pub job: JobId,
    /// 1 for the first dispatch; a re-dispatch after an expired lease is sealed with the next.
    pub attempt: u32,
    /// The id of the worker key the body is sealed to.
    pub recipient: KeyId,
    /// The model the job runs on: the coordinator routes to a holder of it.
    pub model: String,
    /// KV positions the job needs (prompt plus most new tokens): the coordinator's memory filter.
    pub context_tokens: u64,
    /// After this instant the worker refuses the envelope.
    pub expires_at: UnixMillis,
    /// The client's key the result is sealed to (fresh per request for unlinkability).
    pub reply_to: PublicKey,
}

impl JobHeader {
    /// The header's one encoding: the AEAD's associated data.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(JOB_HEADER_TAG);
        w.fixed(self.job.as_bytes())
            .u32(self.attempt)
            .fixed(self.recipient.as_bytes())
            .str(&self.model)
            .u64(self.context_tokens)
            .u64(self.expires_at.0)
            .fixed(self.reply_to.as_bytes());
        w.finish()
    }

    /// Decodes [`JobHeader::canonical_bytes`]; anything else is refused.
    pub fn from_canonical(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes, JOB_HEADER_TAG, "job header")?;
        let h = Self {
            job: JobId(r.fixed()?),
            attempt: r.u32()?,
            recipient: KeyId::from_bytes(r.fixed()?),
            model: r.str()?,
            context_tokens: r.u64()?,
            expires_at: UnixMillis(r.u64()?),
            reply_to: PublicKey::from_bytes(r.fixed()?),
        };
        r.finish()?;
        h.validate()?;
        Ok(h)
    }

    fn validate(&self) -> Result<(), FormatError> {
        let bad = |reason: String| FormatError {
            what: "job header",
            reason,
        };
        if self.attempt == 0 {
            return Err(bad("attempt 0 (attempts count from 1)".into()));
        }
        if self.model.is_empty() || self.model.len() > MAX_MODEL_NAME {
            return Err(bad(format!(
                "model name of {} bytes (1 to {MAX_MODEL_NAME})",
                self.model.len()
            )));
        }
        Ok(())
    }
}

/// A request sealed to one worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnvelope {
    pub header: JobHeader,
    enc: [u8; 32],
    ciphertext: Vec<u8>,
}

/// Job `job`'s envelopes: attempt `k` sealed to candidate `k` (for the model it claims first),
/// each answering to `reply_to`. The sealing client calls it with a fresh id, the job's size and
/// an expiry from the clock; the coordinator's sealed-job simulator with its own, in virtual time.
pub fn seal_attempts(
    job: JobId,
    body: &[u8],
    candidates: &[SignedClaims],
    context_tokens: u64,
    expires_at: UnixMillis,
    reply_to: &PublicKey,
) -> Result<Vec<JobEnvelope>, SealError> {
    candidates
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let header = JobHeader {
                job,
                attempt: i as u32 + 1,
                recipient: c.claims.seal_key.key_id(),
                model: c.claims.models[0].clone(),
                context_tokens,
                expires_at,
                reply_to: *reply_to,
            };
            seal_job(&header, body, &c.claims.seal_key)
        })
        .collect()
}

/// Seals `body` to the worker key `to` under `header` (whose `recipient` must be `to`'s id).
pub fn seal_job(header: &JobHeader, body: &[u8], to: &PublicKey) -> Result<JobEnvelope, SealError> {
    header.validate()?;
    if header.recipient != to.key_id() {
        return Err(SealError::RecipientMismatch {
            header: header.recipient.to_string(),
            key: to.key_id().to_string(),
        });
    }
    check_body(body.len())?;
    let (enc, ciphertext) = hpke::single_shot_seal::<Aead, Kdf, Kem, _>(
        &OpModeS::Base,
        &to.to_hpke()?,
        JOB_INFO,
        body,
        &header.canonical_bytes(),
        &mut rand_core::UnwrapErr(rand_core::OsRng),
    )
    .map_err(|e| SealError::Seal(e.to_string()))?;
    Ok(JobEnvelope {
        header: header.clone(),
        enc: enc.to_bytes().into(),
        ciphertext,
    })
}

impl JobEnvelope {
    /// Opens the body with the worker's key. Any change to the header or ciphertext, or a key
    /// other than the one sealed to, gives [`SealError::Authentication`]. Expiry and replay are
    /// the [`crate::replay::ReplayGuard`]'s to check, after this succeeds.
    pub fn open(&self, key: &SecretKey) -> Result<Vec<u8>, SealError> {
        let auth = SealError::Authentication { what: "job" };
        let enc = EncappedKey::from_bytes(&self.enc).map_err(|_| auth.clone())?;
        hpke::single_shot_open::<Aead, Kdf, Kem>(
            &OpModeR::Base,
            key.hpke(),
            &enc,
            JOB_INFO,
            &self.ciphertext,
            &self.header.canonical_bytes(),
        )
        .map_err(|_| auth)
    }

    /// The wire form: magic, header, encapsulated key, ciphertext.
    pub fn to_bytes(&self) -> Vec<u8> {
        wire_bytes(
            JOB_MAGIC,
            &self.header.canonical_bytes(),
            &self.enc,
            &self.ciphertext,
        )
    }

    /// Parses [`JobEnvelope::to_bytes`], capping every length before allocating.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, FormatError> {
        let w = parse_wire(bytes, JOB_MAGIC, "job envelope")?;
        Ok(Self {
            header: JobHeader::from_canonical(w.header)?,
            enc: w.enc,
            ciphertext: w.ciphertext,
        })
    }

    /// Ciphertext length: what the coordinator can learn of the body's size.
    pub fn ciphertext_len(&self) -> usize {
        self.ciphertext.len()
    }
}

/// The header of a result, authenticated like a job's.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResultHeader {
    pub job: JobId,
    /// The attempt that produced this result: the lease machine drops stale ones.
    pub attempt: u32,
    /// The key id of the worker that opened the job (and authenticates this result).
    pub worker: KeyId,
    /// The answer's digest, keyed by the request: what verification compares, readable by the
    /// coordinator without revealing the answer.
    pub answer: AnswerDigest,
}

impl ResultHeader {
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut w = Writer::new(RESULT_HEADER_TAG);
        w.fixed(self.job.as_bytes())
            .u32(self.attempt)
            .fixed(self.worker.as_bytes())
            .fixed(self.answer.as_bytes());
        w.finish()
    }

    pub fn from_canonical(bytes: &[u8]) -> Result<Self, FormatError> {
        let mut r = Reader::new(bytes, RESULT_HEADER_TAG, "result header")?;
        let h = Self {
            job: JobId(r.fixed()?),
            attempt: r.u32()?,
            worker: KeyId::from_bytes(r.fixed()?),
            answer: AnswerDigest::from_bytes(r.fixed()?),
        };
        r.finish()?;
        Ok(h)
    }
}

/// A result sealed to the client's reply key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResultEnvelope {
    pub header: ResultHeader,
    enc: [u8; 32],
    ciphertext: Vec<u8>,
}

/// Seals a result for the job `job` (the header the worker opened) with the worker's key: HPKE
/// auth mode, so the client knows the worker it sealed to wrote it, and a coordinator that knows
/// the reply key cannot forge one. `answer` is the digest verification compares
/// ([`AnswerDigest::of_tokens`] of the request body and the generated token ids).
pub fn seal_result(
    job: &JobHeader,
    worker: &SecretKey,
    answer: AnswerDigest,
    body: &[u8],
) -> Result<ResultEnvelope, SealError> {
    check_body(body.len())?;
    let header = ResultHeader {
        job: job.job,
        attempt: job.attempt,
        worker: worker.key_id(),
        answer,
    };
    let sender = (worker.hpke().clone(), worker.public_key().to_hpke()?);
    let (enc, ciphertext) = hpke::single_shot_seal::<Aead, Kdf, Kem, _>(
        &OpModeS::Auth(sender),
        &job.reply_to.to_hpke()?,
        RESULT_INFO,
        body,
        &header.canonical_bytes(),
        &mut rand_core::UnwrapErr(rand_core::OsRng),
    )
    .map_err(|e| SealError::Seal(e.to_string()))?;
    Ok(ResultEnvelope {
        header,
        enc: enc.to_bytes().into(),
        ciphertext,
    })
}

impl ResultEnvelope {
    /// Opens a result with the client's reply key, checking it answers `expected` and was written
    /// by the holder of `worker` (the key the job was sealed to). Returns the attempt and body.
    pub fn open(
        &self,
        reply_key: &SecretKey,
        worker: &PublicKey,
        expected: JobId,
    ) -> Result<(u32, Vec<u8>), SealError> {
        if self.header.job != expected {
            return Err(SealError::WrongJob {
                expected,
                got: self.header.job,
            });
        }
        let auth = SealError::Authentication { what: "result" };
        if self.header.worker != worker.key_id() {
            return Err(auth);
        }
        let enc = EncappedKey::from_bytes(&self.enc).map_err(|_| auth.clone())?;
        let body = hpke::single_shot_open::<Aead, Kdf, Kem>(
            &OpModeR::Auth(worker.to_hpke()?),
            reply_key.hpke(),
            &enc,
            RESULT_INFO,
            &self.ciphertext,
            &self.header.canonical_bytes(),
        )
        .map_err(|_| auth)?;
        Ok((self.header.attempt, body))
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        wire_bytes(
            RESULT_MAGIC,
            &self.header.canonical_bytes(),
            &self.enc,
            &self.ciphertext,
        )
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Self, FormatError> {
        let w = parse_wire(bytes, RESULT_MAGIC, "result envelope")?;
        Ok(Self {
            header: ResultHeader::from_canonical(w.header)?,
            enc: w.enc,
            ciphertext: w.ciphertext,
        })
    }
}

fn check_body(len: usize) -> Result<(), SealError> {
    if len > MAX_BODY {
        return Err(SealError::BodyTooLarge { len, max: MAX_BODY });
    }
    Ok(())
}

fn wire_bytes(magic: &[u8; 8], header: &[u8], enc: &[u8; 32], ct: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(8 + 4 + header.len() + 32 + 4 + ct.len());
    v.extend_from_slice(magic);
    v.extend_from_slice(&(header.len() as u32).to_be_bytes());
    v.extend_from_slice(header);
    v.extend_from_slice(enc);
    v.extend_from_slice(&(ct.len() as u32).to_be_bytes());
    v.extend_from_slice(ct);
    v
}

/// An envelope's parts as read from the wire, the header still encoded.
struct Wire<'a> {
    header: &'a [u8],
    enc: [u8; 32],
    ciphertext: Vec<u8>,
}

fn parse_wire<'a>(
    bytes: &'a [u8],
    magic: &[u8; 8],
    what: &'static str,
) -> Result<Wire<'a>, FormatError> {
    let bad = |reason: String| FormatError { what, reason };
    let rest = bytes
        .strip_prefix(&magic[..])
        .ok_or_else(|| bad("wrong magic (not this kind of envelope, or another version)".into()))?;
    let take = |rest: &'a [u8], n: usize, field: &str| {
        if rest.len() < n {
            Err(bad(format!("truncated in the {field}")))
        } else {
            Ok(rest.split_at(n))
        }
    };
    let (len, rest) = take(rest, 4, "header length")?;
    let hlen = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
    if hlen > MAX_HEADER {
        return Err(bad(format!(
            "header of {hlen} bytes (at most {MAX_HEADER})"
        )));
    }
    let (header, rest) = take(rest, hlen, "header")?;
    let (enc, rest) = take(rest, 32, "encapsulated key")?;
    let (len, rest) = take(rest, 4, "ciphertext length")?;
    let clen = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
    if clen > MAX_BODY + TAG_LEN {
        return Err(bad(format!("ciphertext of {clen} bytes exceeds the cap")));
    }
    if clen < TAG_LEN {
        return Err(bad(format!(
            "ciphertext of {clen} bytes is shorter than a tag"
        )));
    }
    let (ct, rest) = take(rest, clen, "ciphertext")?;
    if !rest.is_empty() {
        return Err(bad(format!("{} trailing bytes", rest.len())));
    }
    Ok(Wire {
        header,
        enc: enc.try_into().expect("32 bytes"),
        ciphertext: ct.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest() -> AnswerDigest {
        AnswerDigest::of_tokens(b"body", &[1, 2, 3])
    }

    fn header(worker: &SecretKey, client: &SecretKey) -> JobHeader {
        JobHeader {
            job: JobId::from_bytes([7; 16]),
            attempt: 1,
            recipient: worker.key_id(),
            model: "qwen3-0.6b".into(),
            context_tokens: 512,
            expires_at: UnixMillis(60_000),
            reply_to: client.public_key(),
        }
    }

    #[test]
    fn a_job_opens_with_the_workers_key_and_its_result_with_the_clients() {
        let (w, c) = (SecretKey::derive(b"worker"), SecretKey::derive(b"client"));
        let h = header(&w, &c);
        let env = seal_job(&h, b"{\"prompt\":\"hi\"}", &w.public_key()).unwrap();
        let env = JobEnvelope::from_bytes(&env.to_bytes()).unwrap();
        assert_eq!(env.open(&w).unwrap(), b"{\"prompt\":\"hi\"}");
        let r = seal_result(&env.header, &w, digest(), b"hello").unwrap();
        let r = ResultEnvelope::from_bytes(&r.to_bytes()).unwrap();
        assert_eq!(
            r.open(&c, &w.public_key(), h.job).unwrap(),
            (1, b"hello".to_vec())
        );
    }

    #[test]
    fn every_rewritten_header_field_fails_authentication() {
        let (w, c) = (SecretKey::derive(b"worker"), SecretKey::derive(b"client"));
        let other = SecretKey::derive(b"other");
        let h = header(&w, &c);
        let env = seal_job(&h, b"body", &w.public_key()).unwrap();
        type Edit<'a> = Box<dyn Fn(&mut JobHeader) + 'a>;
        let edits: Vec<(&str, Edit)> = vec![
            ("job", Box::new(|h| h.job = JobId::from_bytes([8; 16]))),
            ("attempt", Box::new(|h| h.attempt = 2)),
            ("recipient", Box::new(|h| h.recipient = other.key_id())),
            ("model", Box::new(|h| h.model = "llama".into())),
            ("context", Box::new(|h| h.context_tokens = 4096)),
            ("expiry", Box::new(|h| h.expires_at = UnixMillis(u64::MAX))),
            ("reply key", Box::new(|h| h.reply_to = other.public_key())),
        ];
        for (field, edit) in edits {
            let mut e = env.clone();
            edit(&mut e.header);
            assert_eq!(
                e.open(&w),
                Err(SealError::Authentication { what: "job" }),
                "rewritten {field}"
            );
        }
        // Another worker's key cannot open it either.
        assert_eq!(
            env.open(&other),
            Err(SealError::Authentication { what: "job" })
        );
    }

    #[test]
    fn a_flipped_ciphertext_byte_fails_authentication() {
        let (w, c) = (SecretKey::derive(b"worker"), SecretKey::derive(b"client"));
        let mut bytes = seal_job(&header(&w, &c), b"body", &w.public_key())
            .unwrap()
            .to_bytes();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        let env = JobEnvelope::from_bytes(&bytes).unwrap();
        assert_eq!(env.open(&w), Err(SealError::Authentication { what: "job" }));
    }

    #[test]
    fn sealing_to_a_key_the_header_does_not_name_is_refused() {
        let (w, c) = (SecretKey::derive(b"worker"), SecretKey::derive(b"client"));
        let err = seal_job(&header(&w, &c), b"x", &c.public_key()).unwrap_err();
        assert!(matches!(err, SealError::RecipientMismatch { .. }), "{err}");
    }

    #[test]
    fn a_result_forged_with_the_reply_key_alone_is_refused() {
        // The coordinator sees the reply key and can seal to it, but not as the worker.
        let (w, c) = (SecretKey::derive(b"worker"), SecretKey::derive(b"client"));
        let forger = SecretKey::derive(b"coordinator");
        let h = header(&w, &c);
        let mut forged = seal_result(&h, &forger, digest(), b"lies").unwrap();
        assert_eq!(
            forged.open(&c, &w.public_key(), h.job),
            Err(SealError::Authentication { what: "result" })
        );
        forged.header.worker = w.key_id();
        assert_eq!(
            forged.open(&c, &w.public_key(), h.job),
            Err(SealError::Authentication { what: "result" })
        );
        // A genuine result with its attempt or answer digest rewritten fails too.
        let mut r = seal_result(&h, &w, digest(), b"truth").unwrap();
        r.header.attempt = 9;
        assert_eq!(
            r.open(&c, &w.public_key(), h.job),
            Err(SealError::Authentication { what: "result" })
        );
        let mut r = seal_result(&h, &w, digest(), b"truth").unwrap();
        r.header.answer = AnswerDigest::of_tokens(b"body", &[1, 2, 4]);
        assert_eq!(
            r.open(&c, &w.public_key(), h.job),
            Err(SealError::Authentication { what: "result" })
        );
        let other_job = JobId::from_bytes([1; 16]);
        assert!(matches!(
            seal_result(&h, &w, digest(), b"x")
                .unwrap()
                .open(&c, &w.public_key(), other_job),
            Err(SealError::WrongJob { .. })
        ));
    }

    #[test]
    fn hostile_wire_bytes_are_refused_without_panicking() {
        let (w, c) = (SecretKey::derive(b"worker"), SecretKey::derive(b"client"));
        let good = seal_job(&header(&w, &c), b"body", &w.public_key())
            .unwrap()
            .to_bytes();
        for cut in 0..good.len() {
            assert!(
                JobEnvelope::from_bytes(&good[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut long = good.clone();
        long.push(0);
        assert!(JobEnvelope::from_bytes(&long)
            .unwrap_err()
            .reason
            .contains("trailing"));
        let mut huge = good.clone();
        huge[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(JobEnvelope::from_bytes(&huge)
            .unwrap_err()
            .reason
            .contains("at most"));
        assert!(ResultEnvelope::from_bytes(&good)
            .unwrap_err()
            .reason
            .contains("magic"));
    }
}

/// The wire form as hex: how envelopes travel inside the JSON control messages.
macro_rules! hex_wire_form {
    ($t:ty, $what:literal) => {
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&hex(&self.to_bytes()))
            }
        }
        impl FromStr for $t {
            type Err = FormatError;
            fn from_str(s: &str) -> Result<Self, FormatError> {
                Self::from_bytes(&crate::canonical::unhex_vec(s, $what)?)
            }
        }
        serde_via_string!($t);
    };
}
hex_wire_form!(JobEnvelope, "job envelope");
hex_wire_form!(ResultEnvelope, "result envelope");
