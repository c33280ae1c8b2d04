//! The 32-byte header of a metadata file.
//!
//! ```text
//! 0  magic    "CRIMAGE\0"
//! 8  major    u16 LE
//! 10 minor    u16 LE
//! 12 kind     u32 LE (1 = checkpoint metadata)
//! 16 length   u64 LE (payload bytes)
//! 24 xxh3     u64 LE (XXH3-64 of the payload)
//! ```

use crate::{checksum, ImageError, Result, FORMAT_MAJOR, FORMAT_MINOR};
use std::path::Path;

pub const MAGIC: &[u8; 8] = b"CRIMAGE\0";
pub const HEADER_LEN: usize = 32;
pub const KIND_CHECKPOINT: u32 = 1;

/// The header of `payload`, to be written just before it (a large
/// payload is not copied to be framed).
pub fn frame(kind: u32, payload: &[u8]) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(MAGIC);
    h[8..10].copy_from_slice(&FORMAT_MAJOR.to_le_bytes());
    h[10..12].copy_from_slice(&FORMAT_MINOR.to_le_bytes());
    h[12..16].copy_from_slice(&kind.to_le_bytes());
    h[16..24].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[24..32].copy_from_slice(&checksum(payload).to_le_bytes());
    h
}

/// Frame a payload with the header.
pub fn encode(kind: u32, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&frame(kind, payload));
    out.extend_from_slice(payload);
    out
}

/// Check the header of `data` (read from `path`) and return the payload.
pub fn decode<'a>(path: &Path, kind: u32, data: &'a [u8]) -> Result<&'a [u8]> {
    if data.len() < HEADER_LEN {
        return Err(ImageError::Truncated {
            path: path.into(),
            expected: HEADER_LEN as u64,
            actual: data.len() as u64,
        });
    }
    if &data[0..8] != MAGIC {
        return Err(ImageError::BadMagic { path: path.into() });
    }
    let u16_at = |o: usize| u16::from_le_bytes([data[o], data[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes(data[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(data[o..o + 8].try_into().expect("8 bytes"));
    let (major, minor) = (u16_at(8), u16_at(10));
    if major != FORMAT_MAJOR || minor > FORMAT_MINOR {
        return Err(ImageError::Version {
            path: path.into(),
            major,
            minor,
        });
    }
    if u32_at(12) != kind {
        return Err(ImageError::Invalid {
            path: path.into(),
            what: format!("file kind {} where {kind} was expected", u32_at(12)),
        });
    }
    let len = u64_at(16);
    let payload = &data[HEADER_LEN..];
    if payload.len() as u64 != len {
        return Err(ImageError::Truncated {
            path: path.into(),
            expected: HEADER_LEN as u64 + len,
            actual: data.len() as u64,
        });
    }
    if checksum(payload) != u64_at(24) {
        return Err(ImageError::Checksum {
            path: path.into(),
            context: String::new(),
        });
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_flipped_byte_is_caught() {
        let p = Path::new("x");
        let framed = encode(KIND_CHECKPOINT, b"hello image");
        assert_eq!(decode(p, KIND_CHECKPOINT, &framed).unwrap(), b"hello image");
        for i in 0..framed.len() {
            let mut bad = framed.clone();
            bad[i] ^= 0x10;
            assert!(
                decode(p, KIND_CHECKPOINT, &bad).is_err(),
                "flip at {i} not caught"
            );
        }
        assert!(matches!(
            decode(p, KIND_CHECKPOINT, &framed[..framed.len() - 1]),
            Err(ImageError::Truncated { .. })
        ));
    }

    /// An image of format 2 (before the typed model) is refused by its
    /// version, in words.
    #[test]
    fn older_major_is_refused_by_name() {
        let mut framed = encode(KIND_CHECKPOINT, b"old");
        framed[8..10].copy_from_slice(&2u16.to_le_bytes());
        framed[10..12].copy_from_slice(&1u16.to_le_bytes());
        let e = decode(Path::new("img/checkpoint.img"), KIND_CHECKPOINT, &framed).unwrap_err();
        assert_eq!(
            e.to_string(),
            "img/checkpoint.img has image format version 2.1; this build reads 3.0 to 3.1"
        );
    }
}
