//! How some values of the image read in JSON (`cr_image show --json`):
//! large byte strings as their length, masks and addresses in hex.

use serde::Serializer;

/// A byte string as its length.
pub fn len<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(v.len() as u64)
}

/// A list of byte strings as its total length.
pub fn total_len<S: Serializer>(v: &[Vec<u8>], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(v.iter().map(|b| b.len() as u64).sum())
}

/// A number as "0x...".
pub fn hex<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#x}"))
}

/// Bytes as a hex string.
pub fn hex_bytes<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&v.iter().map(|b| format!("{b:02x}")).collect::<String>())
}

/// A byte string that is usually text (names, paths), lossily, with NUL as '@'.
pub fn text<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&String::from_utf8_lossy(v).replace('\0', "@"))
}

/// Octal, as "0o...".
pub fn octal<S: Serializer>(v: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{v:#o}"))
}

/// Address ranges as "0x...-0x..." strings.
pub fn hex_ranges<S: Serializer>(v: &[(u64, u64)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|(a, b)| format!("{a:#x}-{b:#x}")))
}
