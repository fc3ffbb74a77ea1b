//! Lowercase RFC 4648 base32 without padding, for printable ids and tokens.

const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

pub(crate) fn encode(data: &[u8]) -> String {
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    let mut acc: u32 = 0;
    let mut bits = 0u32;
    for &b in data {
        acc = ((acc << 8) | u32::from(b)) & 0xfff;
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((acc << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// Decodes exactly `N` bytes; case-insensitive; rejects wrong lengths and non-zero padding bits.
pub(crate) fn decode<const N: usize>(s: &str) -> Result<[u8; N], String> {
    let want = (N * 8).div_ceil(5);
    if s.len() != want {
        return Err(format!(
            "expected {want} base32 characters, got {}",
            s.len()
        ));
    }
    let mut out = [0u8; N];
    let mut acc: u32 = 0;
    let mut bits = 0u32;
    let mut i = 0;
    for c in s.bytes() {
        let v = match c.to_ascii_lowercase() {
            c @ b'a'..=b'z' => c - b'a',
            c @ b'2'..=b'7' => c - b'2' + 26,
            _ => return Err(format!("invalid base32 character {:?}", c as char)),
        };
        acc = (acc << 5) | u32::from(v);
        bits += 5;
        if bits >= 8 {
            bits -= 8;
            out[i] = (acc >> bits) as u8;
            i += 1;
        }
        acc &= (1 << bits) - 1;
    }
    if acc != 0 {
        return Err("non-canonical base32 (trailing bits set)".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        for n in 0..40u8 {
            let data: Vec<u8> = (0..20u8)
                .map(|i| i.wrapping_mul(13).wrapping_add(n))
                .collect();
            let s = super::encode(&data);
            let back: [u8; 20] = super::decode(&s).unwrap();
            assert_eq!(&back[..], &data[..]);
            assert_eq!(super::decode::<20>(&s.to_uppercase()).unwrap(), back);
        }
        assert_eq!(super::encode(b"foobar"), "mzxw6ytboi");
        assert!(super::decode::<20>("a").is_err());
        let mut s = super::encode(&[0u8; 32]);
        s.pop();
        s.push('b'); // sets a padding bit
        assert!(super::decode::<32>(&s).is_err());
    }
}
