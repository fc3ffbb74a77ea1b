//! Versioned, length-prefixed frames for long-lived streams.
//!
//! Wire format of one frame (all header fields big-endian):
//!
//! ```text
//! +--------+---------+------------+----------------+-------------------+
//! | magic  | version | kind (u16) | length (u32)   | payload (length)  |
//! | 0x54   | 1       |            |                |                   |
//! +--------+---------+------------+----------------+-------------------+
//! ```
//!
//! The first two bytes form the `u16` magic/version field: a wrong magic byte means the peer is
//! not speaking this protocol ([`NetError::BadMagic`]); the right magic with another version is
//! [`NetError::VersionMismatch`]. A declared length above the reader's limit is refused before
//! any buffer is allocated ([`NetError::FrameTooLarge`]), and the payload buffer then grows only
//! as bytes actually arrive, so a peer that declares a large frame and stalls pins little memory.
//! Any framing error poisons that one reader: the stream is unusable, the connection is not.
//!
//! Kinds `0xFF00..=0xFFFF` are reserved for this crate (stream preamble, enrolment,
//! measurement); applications use the rest. Tensors travel as raw little-endian `f32` payloads
//! ([`FrameWriter::write_f32s`], [`Frame::f32s`]); control messages as JSON
//! ([`FrameWriter::write_message`], [`Frame::json`]).

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{NetError, StreamLabel};
use crate::stats::StreamCounters;

/// First byte of every frame.
pub const WIRE_MAGIC: u8 = 0x54;
/// Wire protocol version carried in every frame header.
pub const WIRE_VERSION: u8 = 1;
/// Header length in bytes.
pub const HEADER_LEN: usize = 8;
/// Default limit on a frame's payload length (16 MiB).
pub const DEFAULT_MAX_FRAME_LEN: usize = 16 << 20;
/// First frame kind reserved for this crate; applications use kinds below it.
pub const RESERVED_KIND_START: u16 = 0xFF00;
/// The payload buffer starts at most this large and doubles as bytes arrive.
const INITIAL_PAYLOAD_CHUNK: usize = 64 << 10;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Application- or crate-defined frame kind.
    pub kind: u16,
    /// Payload length in bytes.
    pub len: u32,
}

impl FrameHeader {
    /// Encodes the header with our magic and version.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0] = WIRE_MAGIC;
        h[1] = WIRE_VERSION;
        h[2..4].copy_from_slice(&self.kind.to_be_bytes());
        h[4..8].copy_from_slice(&self.len.to_be_bytes());
        h
    }
}

/// Why a byte string is not a valid frame header (stream-independent; see [`NetError`] for the
/// stream-labelled forms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// Fewer than [`HEADER_LEN`] bytes.
    #[error("short header: {got} of {HEADER_LEN} bytes")]
    Short {
        /// Bytes available.
        got: usize,
    },
    /// Not our magic byte.
    #[error("bad magic {found:#06x}")]
    BadMagic {
        /// The magic/version field as received.
        found: u16,
    },
    /// Our magic, another version.
    #[error("wire version mismatch: ours {ours}, theirs {theirs}")]
    VersionMismatch {
        /// Our version.
        ours: u8,
        /// Theirs.
        theirs: u8,
    },
    /// Declared payload longer than the limit.
    #[error("frame of {len} bytes exceeds limit {max}")]
    TooLarge {
        /// Declared length.
        len: u32,
        /// Limit.
        max: usize,
    },
}

impl HeaderError {
    fn labelled(self, stream: &StreamLabel) -> NetError {
        let stream = stream.clone();
        match self {
            Self::Short { got } => NetError::Truncated {
                stream,
                got,
                need: HEADER_LEN,
            },
            Self::BadMagic { found } => NetError::BadMagic { stream, found },
            Self::VersionMismatch { ours, theirs } => NetError::VersionMismatch {
                ours,
                theirs,
                stream,
            },
            Self::TooLarge { len, max } => NetError::FrameTooLarge {
                stream,
                len: u64::from(len),
                max,
            },
        }
    }
}

/// Decodes the first [`HEADER_LEN`] bytes of `buf` as a frame header, checking magic and
/// version (not the length limit: see [`decode_frame`]). Never panics; allocation-free.
/// Suitable as a `cargo fuzz` target.
pub fn decode_frame_header(buf: &[u8]) -> Result<FrameHeader, HeaderError> {
    let Some(h) = buf.first_chunk::<HEADER_LEN>() else {
        return Err(HeaderError::Short { got: buf.len() });
    };
    if h[0] != WIRE_MAGIC {
        return Err(HeaderError::BadMagic {
            found: u16::from_be_bytes([h[0], h[1]]),
        });
    }
    if h[1] != WIRE_VERSION {
        return Err(HeaderError::VersionMismatch {
            ours: WIRE_VERSION,
            theirs: h[1],
        });
    }
    Ok(FrameHeader {
        kind: u16::from_be_bytes([h[2], h[3]]),
        len: u32::from_be_bytes([h[4], h[5], h[6], h[7]]),
    })
}

/// Decodes one complete frame from the start of `buf`, refusing payloads over `max_len`.
///
/// Returns `Ok(None)` when `buf` holds only part of a valid frame, else the frame and the
/// number of bytes it used. Never panics; allocates at most the payload, which is at most
/// `max_len` and at most `buf.len()`.
pub fn decode_frame(buf: &[u8], max_len: usize) -> Result<Option<(Frame, usize)>, HeaderError> {
    let h = match decode_frame_header(buf) {
        Err(HeaderError::Short { .. }) => return Ok(None),
        other => other?,
    };
    if h.len as usize > max_len {
        return Err(HeaderError::TooLarge {
            len: h.len,
            max: max_len,
        });
    }
    let end = HEADER_LEN + h.len as usize;
    match buf.get(HEADER_LEN..end) {
        None => Ok(None),
        Some(p) => Ok(Some((
            Frame {
                kind: h.kind,
                payload: Bytes::copy_from_slice(p),
            },
            end,
        ))),
    }
}

/// One frame: a kind and an opaque payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Frame kind.
    pub kind: u16,
    /// Payload bytes.
    pub payload: Bytes,
}

impl Frame {
    /// A frame with the given kind and payload.
    pub fn new(kind: u16, payload: impl Into<Bytes>) -> Self {
        Self {
            kind,
            payload: payload.into(),
        }
    }

    /// A frame whose payload is `msg` as JSON.
    pub fn from_json<T: Serialize + ?Sized>(kind: u16, msg: &T) -> Result<Self, NetError> {
        let v = serde_json::to_vec(msg).map_err(|e| NetError::Encode(e.to_string()))?;
        Ok(Self::new(kind, v))
    }

    /// A frame whose payload is `data` as little-endian `f32`s.
    pub fn from_f32s(kind: u16, data: &[f32]) -> Self {
        let mut v = Vec::with_capacity(data.len() * 4);
        extend_f32s_le(&mut v, data);
        Self::new(kind, v)
    }

    /// Decodes the payload as JSON.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, NetError> {
        serde_json::from_slice(&self.payload).map_err(|e| NetError::Decode {
            stream: StreamLabel::default(),
            kind: self.kind,
            reason: e.to_string(),
        })
    }

    /// Decodes the payload as little-endian `f32`s.
    pub fn f32s(&self) -> Result<Vec<f32>, NetError> {
        f32s_from_le_bytes(&self.payload).ok_or_else(|| NetError::Decode {
            stream: StreamLabel::default(),
            kind: self.kind,
            reason: format!("{} bytes is not a whole number of f32s", self.payload.len()),
        })
    }

    /// Total bytes this frame takes on the wire.
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.payload.len()
    }
}

/// Appends `data` as little-endian bytes.
pub fn extend_f32s_le(out: &mut Vec<u8>, data: &[f32]) {
    out.reserve(data.len() * 4);
    for x in data {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Decodes little-endian `f32`s; `None` if the length is not a multiple of 4.
pub fn f32s_from_le_bytes(bytes: &[u8]) -> Option<Vec<f32>> {
    let chunks = bytes.chunks_exact(4);
    if !chunks.remainder().is_empty() {
        return None;
    }
    Some(
        chunks
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    )
}

/// Reads frames from any [`AsyncRead`] (a QUIC receive stream, an in-memory duplex).
#[derive(Debug)]
pub struct FrameReader<R> {
    inner: R,
    max_len: usize,
    label: StreamLabel,
    counters: Option<StreamCounters>,
    poisoned: bool,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader with the default limit of [`DEFAULT_MAX_FRAME_LEN`].
    pub fn new(inner: R) -> Self {
        Self {
            inner,
            max_len: DEFAULT_MAX_FRAME_LEN,
            label: StreamLabel::default(),
            counters: None,
            poisoned: false,
        }
    }

    /// Sets the payload length limit.
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len;
        self
    }

    /// Changes the payload length limit (e.g. per stream kind).
    pub fn set_max_len(&mut self, max_len: usize) {
        self.max_len = max_len;
    }

    /// Sets the label used in errors.
    pub fn with_label(mut self, label: StreamLabel) -> Self {
        self.label = label;
        self
    }

    pub(crate) fn with_counters(mut self, c: StreamCounters) -> Self {
        self.counters = Some(c);
        self
    }

    /// The label used in errors.
    pub fn label(&self) -> &StreamLabel {
        &self.label
    }

    pub(crate) fn counters(&self) -> Option<&StreamCounters> {
        self.counters.as_ref()
    }

    /// The payload length limit.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The underlying reader.
    pub fn into_inner(self) -> R {
        self.inner
    }

    fn io_err(&self, e: std::io::Error) -> NetError {
        NetError::StreamIo {
            stream: self.label.clone(),
            source: e,
        }
    }

    /// Reads the next frame; `Ok(None)` when the stream ended cleanly between frames.
    ///
    /// After any error the reader is poisoned and keeps failing: framing is lost.
    pub async fn read_frame(&mut self) -> Result<Option<Frame>, NetError> {
        if self.poisoned {
            return Err(self.io_err(std::io::Error::other(
                "stream framing lost after an earlier error",
            )));
        }
        let r = self.read_frame_inner().await;
        if r.is_err() {
            self.poisoned = true;
        }
        r
    }

    async fn read_frame_inner(&mut self) -> Result<Option<Frame>, NetError> {
        let mut h = [0u8; HEADER_LEN];
        let mut got = 0;
        while got < HEADER_LEN {
            let n = self
                .inner
                .read(&mut h[got..])
                .await
                .map_err(|e| self.io_err(e))?;
            if n == 0 {
                if got == 0 {
                    return Ok(None);
                }
                return Err(HeaderError::Short { got }.labelled(&self.label));
            }
            got += n;
        }
        let header = decode_frame_header(&h).map_err(|e| e.labelled(&self.label))?;
        let len = header.len as usize;
        if len > self.max_len {
            return Err(HeaderError::TooLarge {
                len: header.len,
                max: self.max_len,
            }
            .labelled(&self.label));
        }
        let mut buf: Vec<u8> = Vec::with_capacity(len.min(INITIAL_PAYLOAD_CHUNK));
        while buf.len() < len {
            if buf.len() == buf.capacity() {
                let target = (buf.capacity() * 2).clamp(1, len);
                buf.reserve_exact(target - buf.len());
            }
            let want = (buf.capacity() - buf.len()).min(len - buf.len());
            let n = (&mut self.inner)
                .take(want as u64)
                .read_buf(&mut buf)
                .await
                .map_err(|e| self.io_err(e))?;
            if n == 0 {
                return Err(NetError::Truncated {
                    stream: self.label.clone(),
                    got: buf.len(),
                    need: len,
                });
            }
        }
        if let Some(c) = &self.counters {
            c.received(HEADER_LEN + len);
        }
        Ok(Some(Frame {
            kind: header.kind,
            payload: Bytes::from(buf),
        }))
    }

    /// Reads the next frame; a clean end of stream is an error here.
    pub async fn recv(&mut self) -> Result<Frame, NetError> {
        match self.read_frame().await? {
            Some(f) => Ok(f),
            None => Err(NetError::Truncated {
                stream: self.label.clone(),
                got: 0,
                need: HEADER_LEN,
            }),
        }
    }

    /// Reads the next frame, requires `kind`, returns its payload.
    pub async fn recv_kind(
        &mut self,
        kind: u16,
        expected: &'static str,
    ) -> Result<Bytes, NetError> {
        let f = self.recv().await?;
        if f.kind != kind {
            self.poisoned = true;
            return Err(NetError::UnexpectedFrame {
                stream: self.label.clone(),
                kind: f.kind,
                expected,
            });
        }
        Ok(f.payload)
    }

    /// Reads a frame of `kind` and decodes its JSON payload.
    pub async fn read_message<T: DeserializeOwned>(&mut self, kind: u16) -> Result<T, NetError> {
        let p = self.recv_kind(kind, "a message frame").await?;
        serde_json::from_slice(&p).map_err(|e| NetError::Decode {
            stream: self.label.clone(),
            kind,
            reason: e.to_string(),
        })
    }

    /// Reads a frame of `kind` and decodes its payload as little-endian `f32`s.
    pub async fn read_f32s(&mut self, kind: u16) -> Result<Vec<f32>, NetError> {
        let p = self.recv_kind(kind, "an f32 frame").await?;
        f32s_from_le_bytes(&p).ok_or_else(|| NetError::Decode {
            stream: self.label.clone(),
            kind,
            reason: format!("{} bytes is not a whole number of f32s", p.len()),
        })
    }
}

/// Writes frames to any [`AsyncWrite`].
#[derive(Debug)]
pub struct FrameWriter<W> {
    inner: W,
    max_len: usize,
    label: StreamLabel,
    counters: Option<StreamCounters>,
}

impl<W: AsyncWrite + Unpin> FrameWriter<W> {
    /// A writer with the default limit of [`DEFAULT_MAX_FRAME_LEN`].
    pub fn new(inner: W) -> Self {
        Self {
            inner,
            max_len: DEFAULT_MAX_FRAME_LEN,
            label: StreamLabel::default(),
            counters: None,
        }
    }

    /// Sets the payload length limit (frames over it are refused locally).
    pub fn with_max_len(mut self, max_len: usize) -> Self {
        self.max_len = max_len;
        self
    }

    /// Changes the payload length limit.
    pub fn set_max_len(&mut self, max_len: usize) {
        self.max_len = max_len;
    }

    /// Sets the label used in errors.
    pub fn with_label(mut self, label: StreamLabel) -> Self {
        self.label = label;
        self
    }

    pub(crate) fn with_counters(mut self, c: StreamCounters) -> Self {
        self.counters = Some(c);
        self
    }

    /// The label used in errors.
    pub fn label(&self) -> &StreamLabel {
        &self.label
    }

    /// The underlying writer.
    pub fn into_inner(self) -> W {
        self.inner
    }

    /// Mutable access to the underlying writer (e.g. to reset a QUIC stream).
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.inner
    }

    fn check_len(&self, len: usize) -> Result<u32, NetError> {
        match u32::try_from(len) {
            Ok(l) if len <= self.max_len => Ok(l),
            _ => Err(NetError::FrameTooLarge {
                stream: self.label.clone(),
                len: len as u64,
                max: self.max_len,
            }),
        }
    }

    async fn put(&mut self, bytes: &[u8]) -> Result<(), NetError> {
        self.inner
            .write_all(bytes)
            .await
            .map_err(|e| NetError::StreamIo {
                stream: self.label.clone(),
                source: e,
            })
    }

    /// Writes one frame.
    pub async fn write_frame(&mut self, kind: u16, payload: &[u8]) -> Result<(), NetError> {
        let len = self.check_len(payload.len())?;
        let header = FrameHeader { kind, len }.encode();
        if payload.len() <= 4096 {
            let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
            buf.extend_from_slice(&header);
            buf.extend_from_slice(payload);
            self.put(&buf).await?;
        } else {
            self.put(&header).await?;
            self.put(payload).await?;
        }
        if let Some(c) = &self.counters {
            c.sent(HEADER_LEN + payload.len());
        }
        Ok(())
    }

    /// Writes a [`Frame`].
    pub async fn send(&mut self, frame: &Frame) -> Result<(), NetError> {
        self.write_frame(frame.kind, &frame.payload).await
    }

    /// Writes `msg` as a JSON frame of `kind`.
    pub async fn write_message<T: Serialize + ?Sized>(
        &mut self,
        kind: u16,
        msg: &T,
    ) -> Result<(), NetError> {
        let v = serde_json::to_vec(msg).map_err(|e| NetError::Encode(e.to_string()))?;
        self.write_frame(kind, &v).await
    }

    /// Writes `data` as one frame of little-endian `f32`s (header and payload in one buffer).
    pub async fn write_f32s(&mut self, kind: u16, data: &[f32]) -> Result<(), NetError> {
        let len = self.check_len(data.len().saturating_mul(4))?;
        let mut buf = Vec::with_capacity(HEADER_LEN + data.len() * 4);
        buf.extend_from_slice(&FrameHeader { kind, len }.encode());
        extend_f32s_le(&mut buf, data);
        self.put(&buf).await?;
        if let Some(c) = &self.counters {
            c.sent(buf.len());
        }
        Ok(())
    }

    /// Flushes buffered bytes.
    pub async fn flush(&mut self) -> Result<(), NetError> {
        self.inner.flush().await.map_err(|e| NetError::StreamIo {
            stream: self.label.clone(),
            source: e,
        })
    }

    /// Ends the stream cleanly (the peer's reader then sees `Ok(None)`).
    pub async fn finish(&mut self) -> Result<(), NetError> {
        self.inner.shutdown().await.map_err(|e| NetError::StreamIo {
            stream: self.label.clone(),
            source: e,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn round_trip_over_duplex() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let mut w = FrameWriter::new(a);
        let mut r = FrameReader::new(b);
        let big = vec![7u8; 200_000];
        let floats: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
        let writer = tokio::spawn(async move {
            w.write_frame(1, b"hi").await.unwrap();
            w.write_frame(2, &big).await.unwrap();
            w.write_f32s(3, &floats).await.unwrap();
            w.write_message(4, &vec!["a", "b"]).await.unwrap();
            w.write_frame(5, b"").await.unwrap();
            w.finish().await.unwrap();
        });
        assert_eq!(r.recv().await.unwrap(), Frame::new(1, &b"hi"[..]));
        assert_eq!(r.recv().await.unwrap().payload.len(), 200_000);
        let f = r.read_f32s(3).await.unwrap();
        assert_eq!(f.len(), 1000);
        assert_eq!(f[3], 3.0 * 0.5 - 3.0);
        let m: Vec<String> = r.read_message(4).await.unwrap();
        assert_eq!(m, ["a", "b"]);
        assert_eq!(r.recv().await.unwrap().payload.len(), 0);
        assert!(r.read_frame().await.unwrap().is_none());
        writer.await.unwrap();
    }

    #[test]
    fn header_errors() {
        let good = FrameHeader { kind: 9, len: 3 }.encode();
        assert_eq!(
            decode_frame_header(&good),
            Ok(FrameHeader { kind: 9, len: 3 })
        );
        assert_eq!(
            decode_frame_header(&good[..5]),
            Err(HeaderError::Short { got: 5 })
        );
        let mut v = good;
        v[1] = 2;
        assert_eq!(
            decode_frame_header(&v),
            Err(HeaderError::VersionMismatch { ours: 1, theirs: 2 })
        );
        v[0] = b'G';
        assert!(matches!(
            decode_frame_header(&v),
            Err(HeaderError::BadMagic { .. })
        ));
        let mut buf = good.to_vec();
        buf.extend_from_slice(b"abcde");
        let (f, used) = decode_frame(&buf, 10).unwrap().unwrap();
        assert_eq!((f.payload.as_ref(), used), (&b"abc"[..], 11));
        assert_eq!(decode_frame(&buf[..10], 10), Ok(None));
        assert!(matches!(
            decode_frame(&buf, 2),
            Err(HeaderError::TooLarge { .. })
        ));
    }

    #[tokio::test]
    async fn writer_refuses_oversize() {
        let (a, _b) = tokio::io::duplex(64);
        let mut w = FrameWriter::new(a).with_max_len(8);
        assert!(matches!(
            w.write_frame(1, &[0; 9]).await,
            Err(NetError::FrameTooLarge { len: 9, max: 8, .. })
        ));
        assert!(matches!(
            w.write_f32s(1, &[0.0; 3]).await,
            Err(NetError::FrameTooLarge { len: 12, .. })
        ));
    }
}
