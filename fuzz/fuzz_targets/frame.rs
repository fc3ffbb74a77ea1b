//! Wire decoder: `decode_frame_header`, `decode_frame` and the async `FrameReader` over an
//! in-memory stream that hands out bytes in input-chosen chunk sizes. None may panic; each must
//! agree with the others about what the bytes mean.
#![no_main]

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use libfuzzer_sys::fuzz_target;
use tessera_net::frame::HEADER_LEN;
use tessera_net::{decode_frame, decode_frame_header, FrameReader};
use tokio::io::{AsyncRead, ReadBuf};

#[path = "common.rs"]
mod common;

#[global_allocator]
static ALLOC: common::BoundedAlloc = common::BoundedAlloc;

/// An in-memory reader that returns at most `chunk` bytes per read (short reads are what a QUIC
/// stream really delivers) and never returns `Pending`.
struct Chunked<'a> {
    data: &'a [u8],
    chunk: usize,
}

impl AsyncRead for Chunked<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.data.len().min(self.chunk).min(buf.remaining());
        buf.put_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Poll::Ready(Ok(()))
    }
}

/// Drives a future whose I/O is always ready to completion without a runtime.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = Context::from_waker(Waker::noop());
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("in-memory frame read did not complete: a reader that never returns Pending hung");
}

fuzz_target!(|input: &[u8]| {
    // First two bytes: the length limit and the read chunk size; the rest is the stream.
    let (max_len, chunk, data) = match input {
        [a, b, rest @ ..] => (usize::from(*a) * 64, usize::from(*b % 32) + 1, rest),
        _ => (0, 1, input),
    };

    let header = decode_frame_header(data);
    if data.len() < HEADER_LEN {
        assert!(header.is_err());
    }

    // decode_frame over the whole buffer, frame after frame.
    let mut sync_frames = Vec::new();
    let mut rest = data;
    let sync_err = loop {
        match decode_frame(rest, max_len) {
            Ok(Some((frame, used))) => {
                assert!(used >= HEADER_LEN && used <= rest.len());
                assert_eq!(used, frame.wire_len());
                assert!(frame.payload.len() <= max_len);
                let h = decode_frame_header(rest).expect("decoded frame has a valid header");
                assert_eq!((h.kind, h.len as usize), (frame.kind, frame.payload.len()));
                sync_frames.push(frame);
                rest = &rest[used..];
            }
            Ok(None) => break false,
            Err(_) => break true,
        }
    };

    // The async reader over the same bytes must yield the same frames.
    let mut reader = FrameReader::new(Chunked { data, chunk }).with_max_len(max_len);
    let mut async_frames = Vec::new();
    let async_err = loop {
        match block_on(reader.read_frame()) {
            Ok(Some(frame)) => {
                assert!(frame.payload.len() <= max_len);
                async_frames.push(frame);
            }
            Ok(None) => break false,
            Err(_) => {
                // A poisoned reader keeps failing.
                assert!(block_on(reader.read_frame()).is_err());
                break true;
            }
        }
    };
    assert_eq!(
        sync_frames, async_frames,
        "sync and async decoders disagree"
    );
    if sync_err {
        assert!(
            async_err,
            "decode_frame refused bytes that FrameReader accepted"
        );
    }
    // The sync decoder stops on an incomplete tail (Ok(None)); the reader calls that truncation
    // unless nothing at all was left.
    if !sync_err && rest.is_empty() {
        assert!(
            !async_err,
            "FrameReader refused a clean sequence of whole frames"
        );
    }
});
