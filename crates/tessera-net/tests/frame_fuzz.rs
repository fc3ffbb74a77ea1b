//! Random bytes into the frame decoders: no panics, no allocation above the limit.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use proptest::prelude::*;
use tessera_net::frame::{decode_frame, decode_frame_header, FrameHeader, HEADER_LEN};
use tessera_net::{FrameReader, NetError};

/// Records the largest single allocation while `TRACKING` is on.
struct Tracking;
static TRACKING: AtomicBool = AtomicBool::new(false);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if TRACKING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged from our caller's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged from our caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if TRACKING.load(Ordering::Relaxed) {
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
        }
        // SAFETY: forwarded unchanged from our caller's contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

const MAX: usize = 4096;
/// The allocation test must not overlap the other test's allocations.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Decodes a whole byte string with the async reader; returns frames until an error or EOF.
async fn read_all(bytes: &[u8]) -> (Vec<tessera_net::Frame>, Option<NetError>) {
    let mut r = FrameReader::new(bytes).with_max_len(MAX);
    let mut frames = Vec::new();
    loop {
        match r.read_frame().await {
            Ok(Some(f)) => frames.push(f),
            Ok(None) => return (frames, None),
            Err(e) => return (frames, Some(e)),
        }
    }
}

/// Inputs biased toward valid headers so the payload path is exercised too.
fn input() -> impl Strategy<Value = Vec<u8>> {
    let header = (
        any::<u16>(),
        prop_oneof![0u32..8192, any::<u32>()],
        any::<bool>(),
    )
        .prop_map(|(kind, len, good)| {
            let mut h = FrameHeader { kind, len }.encode();
            if !good {
                h[1] ^= 1;
            }
            h.to_vec()
        });
    let whole =
        (any::<u16>(), proptest::collection::vec(any::<u8>(), 0..600)).prop_map(|(kind, p)| {
            let mut v = FrameHeader {
                kind,
                len: p.len() as u32,
            }
            .encode()
            .to_vec();
            v.extend_from_slice(&p);
            v
        });
    let chunk = prop_oneof![
        header,
        whole.clone(),
        whole,
        proptest::collection::vec(any::<u8>(), 0..600)
    ];
    proptest::collection::vec(chunk, 0..8).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn decoders_never_panic_and_respect_the_limit(bytes in input()) {
        let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let _ = decode_frame_header(&bytes);
        let mut rest = &bytes[..];
        while let Ok(Some((f, used))) = decode_frame(rest, MAX) {
            prop_assert!(f.payload.len() <= MAX);
            prop_assert_eq!(used, HEADER_LEN + f.payload.len());
            rest = &rest[used..];
        }
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (frames, err) = rt.block_on(read_all(&bytes));
        let mut consumed = 0;
        for f in &frames {
            prop_assert!(f.payload.len() <= MAX);
            consumed += f.wire_len();
        }
        prop_assert!(consumed <= bytes.len());
        // The async reader and the slice decoder agree.
        let mut rest = &bytes[..];
        for f in &frames {
            let (g, used) = decode_frame(rest, MAX).unwrap().unwrap();
            prop_assert_eq!(&g, f);
            rest = &rest[used..];
        }
        if err.is_none() {
            prop_assert!(rest.is_empty());
        }
    }
}

#[test]
fn reader_never_allocates_more_than_the_limit() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    // Deterministic xorshift stream of inputs, many with huge declared lengths.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut inputs = Vec::new();
    for i in 0..2000 {
        let mut v = Vec::new();
        for _ in 0..(next() % 4) {
            let len = match next() % 4 {
                0 => (next() % 64) as u32,
                1 => (next() % (2 * MAX as u64)) as u32,
                2 => next() as u32,
                _ => u32::MAX,
            };
            v.extend_from_slice(&FrameHeader { kind: 1, len }.encode());
            // Often exactly the declared payload, so valid frames get decoded too.
            let body = if next() % 2 == 0 && len as usize <= MAX {
                len as usize
            } else {
                (next() % 300) as usize
            };
            v.extend((0..body).map(|_| next() as u8));
        }
        if i % 5 == 0 {
            v.extend((0..(next() % 40)).map(|_| next() as u8));
        }
        inputs.push(v);
    }
    let (mut too_large, mut decoded) = (0, 0);
    LARGEST.store(0, Ordering::SeqCst);
    TRACKING.store(true, Ordering::SeqCst);
    for v in &inputs {
        let (frames, err) = rt.block_on(read_all(v));
        assert!(frames.iter().all(|f| f.payload.len() <= MAX));
        decoded += frames.len();
        if matches!(err, Some(NetError::FrameTooLarge { .. })) {
            too_large += 1;
        }
    }
    TRACKING.store(false, Ordering::SeqCst);
    let largest = LARGEST.load(Ordering::SeqCst);
    assert!(
        decoded > 500,
        "inputs should often hold valid frames ({decoded})"
    );
    assert!(
        too_large > 100,
        "inputs should often declare oversize frames ({too_large})"
    );
    // Payload buffers are at most MAX; the rest is small bookkeeping (errors, labels).
    assert!(
        largest > MAX / 2,
        "the allocation tracker saw nothing ({largest})"
    );
    assert!(largest <= MAX, "largest allocation {largest} > limit {MAX}");
}
