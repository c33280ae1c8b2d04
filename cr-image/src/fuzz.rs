//! Fuzzing the image reader: what a damaged or crafted image can do.
//!
//! [`read_image`] is the whole read path of an image directory (metadata
//! header, protobuf, every check of [`crate::model`], the parent chain, the
//! page store and every page reference): whatever the bytes, it returns an
//! error or an image, never panics. The cargo-fuzz target in
//! `cr-image/fuzz` feeds it arbitrary bytes; the test suite runs
//! [`mutate`] (a protobuf-aware mutator) over valid images with a fixed
//! seed, so every run checks the same thousands of damaged images.

use crate::chain::Chain;
use crate::dir::{ImageDir, CHECKPOINT_FILE};
use crate::store::StoreReader;
use crate::{header, Checkpoint, Result};
use std::path::Path;

/// Write `payload` as the metadata of the image in `dir` (whose other
/// files are left as they are) and read the image through every check
/// a restore makes before it touches a process.
pub fn read_image(dir: &Path, payload: &[u8]) -> Result<Checkpoint> {
    let framed = header::encode(header::KIND_CHECKPOINT, payload);
    std::fs::write(dir.join(CHECKPOINT_FILE), framed).map_err(crate::io_err(dir))?;
    let chain = Chain::open(dir)?;
    let top = chain.top();
    for p in &top.ck.processes {
        chain.resolve(p.pid, usize::MAX)?;
    }
    if let Some(s) = &top.ck.store {
        let r = StoreReader::open(&top.dir, s)?;
        let mut buf = Vec::new();
        for b in 0..r.nr_blocks() {
            let _ = r.block(b as u32, &mut buf);
        }
        for p in &top.ck.processes {
            for piece in chain.resolve(p.pid, usize::MAX)? {
                if let crate::chain::Source::Store { loc, .. } = piece.src {
                    let at = loc.page as usize * crate::store::PAGE;
                    let len = piece.pages as usize * crate::store::PAGE;
                    if r.is_raw(loc.block) {
                        let _ = r.raw_slice(loc.block, at, len);
                    }
                }
            }
        }
    }
    for pf in crate::model::objects::content_files(&top.ck) {
        let r = crate::PageReader::open(&top.dir, pf)?;
        let mut buf = Vec::new();
        for e in &pf.extents {
            let _ = r.read_extent(e, &mut buf);
        }
    }
    let _ = ImageDir::open(dir)?;
    Ok(chain.links.into_iter().next().expect("the top image").ck)
}

/// A small deterministic generator (SplitMix64).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// Values that break arithmetic and bounds checks.
const EDGES: &[u64] = &[
    0,
    1,
    2,
    63,
    64,
    65,
    4095,
    4096,
    4097,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_f000,
    0x00ff_ffff_ffff_f000,
    i64::MAX as u64,
    u64::MAX - 4095,
    u64::MAX,
];

/// One protobuf field as it is on the wire.
enum Field {
    Varint(u64, u64),
    Fixed64(u64, u64),
    Bytes(u64, Vec<u8>),
    Fixed32(u64, u32),
}

fn read_varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= ((byte & 0x7f) as u64) << shift;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}

fn write_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The fields of a message, or None if `b` is not one.
fn parse(b: &[u8]) -> Option<Vec<Field>> {
    let mut at = 0;
    let mut out = Vec::new();
    while at < b.len() {
        let key = read_varint(b, &mut at)?;
        let (tag, wire) = (key >> 3, key & 7);
        if tag == 0 {
            return None;
        }
        out.push(match wire {
            0 => Field::Varint(tag, read_varint(b, &mut at)?),
            1 => {
                let v = b.get(at..at + 8)?;
                at += 8;
                Field::Fixed64(tag, u64::from_le_bytes(v.try_into().ok()?))
            }
            2 => {
                let len = read_varint(b, &mut at)? as usize;
                let v = b.get(at..at.checked_add(len)?)?.to_vec();
                at += len;
                Field::Bytes(tag, v)
            }
            5 => {
                let v = b.get(at..at + 4)?;
                at += 4;
                Field::Fixed32(tag, u32::from_le_bytes(v.try_into().ok()?))
            }
            _ => return None,
        });
    }
    Some(out)
}

fn encode(fields: &[Field], out: &mut Vec<u8>) {
    for f in fields {
        match f {
            Field::Varint(t, v) => {
                write_varint(out, t << 3);
                write_varint(out, *v);
            }
            Field::Fixed64(t, v) => {
                write_varint(out, (t << 3) | 1);
                out.extend_from_slice(&v.to_le_bytes());
            }
            Field::Bytes(t, v) => {
                write_varint(out, (t << 3) | 2);
                write_varint(out, v.len() as u64);
                out.extend_from_slice(v);
            }
            Field::Fixed32(t, v) => {
                write_varint(out, (t << 3) | 5);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
}

fn number(rng: &mut Rng, old: u64) -> u64 {
    match rng.below(4) {
        0 => EDGES[rng.below(EDGES.len())],
        1 => old.wrapping_add(rng.below(9) as u64).wrapping_sub(4),
        2 => old ^ (1 << rng.below(64)),
        _ => rng.next_u64(),
    }
}

/// Change one thing deep inside an encoded protobuf message: a number, a
/// byte string, or the fields of a nested message (removed, duplicated,
/// reordered); raw byte damage when the input does not parse.
pub fn mutate(rng: &mut Rng, msg: &[u8]) -> Vec<u8> {
    let Some(mut fields) = parse(msg).filter(|f| !f.is_empty()) else {
        let mut b = msg.to_vec();
        match rng.below(3) {
            0 if !b.is_empty() => {
                let i = rng.below(b.len());
                b[i] ^= 1 << rng.below(8);
            }
            1 => b.truncate(rng.below(b.len() + 1)),
            _ => b.push(rng.next_u64() as u8),
        }
        return b;
    };
    let i = rng.below(fields.len());
    match rng.below(10) {
        // Structure: drop, duplicate, swap fields.
        0 => {
            fields.remove(i);
        }
        1 => {
            let dup = match &fields[i] {
                Field::Varint(t, v) => Field::Varint(*t, *v),
                Field::Fixed64(t, v) => Field::Fixed64(*t, *v),
                Field::Bytes(t, v) => Field::Bytes(*t, v.clone()),
                Field::Fixed32(t, v) => Field::Fixed32(*t, *v),
            };
            fields.insert(i, dup);
        }
        2 => {
            let j = rng.below(fields.len());
            fields.swap(i, j);
        }
        // Values: deep inside nested messages most of the time.
        _ => match &mut fields[i] {
            Field::Varint(_, v) | Field::Fixed64(_, v) => *v = number(rng, *v),
            Field::Fixed32(_, v) => *v = number(rng, *v as u64) as u32,
            Field::Bytes(_, v) => {
                *v = if rng.below(4) == 0 || parse(v).is_none() {
                    let mut b = std::mem::take(v);
                    match rng.below(3) {
                        0 => b.truncate(rng.below(b.len() + 1)),
                        1 => b.extend((0..rng.below(200)).map(|_| rng.next_u64() as u8)),
                        _ if !b.is_empty() => {
                            let k = rng.below(b.len());
                            b[k] = rng.next_u64() as u8;
                        }
                        _ => {}
                    }
                    b
                } else {
                    mutate(rng, v)
                }
            }
        },
    }
    let mut out = Vec::with_capacity(msg.len() + 16);
    encode(&fields, &mut out);
    out
}
