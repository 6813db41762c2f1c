//! The plugin's 128-byte connection handle as text: NCCL moves it between ranks out of band,
//! and the tools and tests do the same over pipes, sockets and files, as 256 lowercase hex
//! digits. Used by every multi-process test and by `ferroce perf` and `collective`.

/// Bytes of an ncclNet handle (`NCCL_NET_HANDLE_MAXSIZE`).
pub const LEN: usize = 128;

/// `b` as lowercase hex, two digits a byte.
pub fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A handle from exactly 256 hex digits; anything else (a short line, a stray character) is
/// an error that quotes it, since it arrived from another process.
pub fn from_hex(s: &str) -> Result<[u8; LEN], String> {
    let bad = || format!("a handle is {} hex digits, not {s:?}", 2 * LEN);
    if s.len() != 2 * LEN {
        return Err(bad());
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|v| v as u8).ok_or_else(bad);
    let mut h = [0u8; LEN];
    for (b, pair) in h.iter_mut().zip(s.as_bytes().chunks(2)) {
        *b = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_reject_garbage() {
        let h: [u8; LEN] = std::array::from_fn(|i| (i * 7) as u8);
        assert_eq!(from_hex(&to_hex(&h)).unwrap(), h);
        assert!(from_hex(&to_hex(&h[..127])).is_err());
        assert!(from_hex(&format!("{}zz", &to_hex(&h)[2..])).is_err());
        assert!(from_hex(&format!("{}é", &to_hex(&h)[..254])).is_err());
        assert!(from_hex(&format!("{}+1", &to_hex(&h)[..253])).is_err(), "a sign is not a digit");
    }
}
