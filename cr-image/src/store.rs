//! The page store of an image: one file (`pages-<ID>.img`) of unique pages
//! for all the image's processes, cut into blocks of up to
//! [`BLOCK_PAGES`] pages.
//!
//! - A page identical to one already stored in this image (same XXH3-128) is
//!   stored once: dedup works within and across the processes of a tree.
//! - All-zero pages never reach the store (the dumper drops them).
//! - Each block is compressed on its own (lz4 or zstd, chosen per image) and
//!   kept raw when compression would not shrink it; raw blocks are copied
//!   from the mapped file straight into the restored process.
//! - Every block carries the XXH3-64 of its uncompressed pages, checked
//!   before any of its pages is used.
//!
//! Several threads add pages at once: each fills its own block and writes
//! it at an offset reserved atomically when the block is full.

use crate::dir::{ImageDir, TMP_SUFFIX};
use crate::model::{Compression, PageStore, StoreBlock};
use crate::{checksum, io_err, ImageError, Result};
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

pub const PAGE: usize = 4096;
/// Pages per block (256 KiB): the unit of compression and of verification.
pub const BLOCK_PAGES: usize = crate::model::memory::BLOCK_PAGES as usize;
const SHARDS: usize = 64;
const ZSTD_LEVEL: i32 = 3;

/// Where a page lives in a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    pub block: u32,
    pub page: u32,
}

/// XXH3-128 of a page: the dedup key (its low half is the page hash kept in
/// the image).
pub fn page_hash(page: &[u8]) -> u128 {
    xxhash_rust::xxh3::xxh3_128(page)
}

/// Whether a page is all zero.
pub fn is_zero(page: &[u8]) -> bool {
    let words = page.chunks_exact(8);
    words.remainder().iter().all(|&b| b == 0)
        && words
            .into_iter()
            .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
}

/// A block being filled by one thread.
pub struct OpenBlock {
    id: u32,
    data: Vec<u8>,
}

impl OpenBlock {
    fn pages(&self) -> usize {
        self.data.len() / PAGE
    }
}

/// Writer of an image's page store.
pub struct StoreWriter {
    file: File,
    path: PathBuf,
    name: String,
    compression: Compression,
    next_block: AtomicU32,
    end: AtomicU64,
    blocks: Mutex<Vec<(u32, StoreBlock)>>,
    dedup: Vec<Mutex<HashMap<u128, Loc>>>,
}

impl StoreWriter {
    /// Create `pages-<tag>.img.tmp` in `dir`; [`ImageDir::commit`] renames it.
    pub fn create(dir: &ImageDir, tag: &str, compression: Compression) -> Result<Self> {
        let name = format!("pages-{tag}.img");
        let path = dir.file(&format!("{name}{TMP_SUFFIX}"));
        let file = File::create(&path).map_err(io_err(&path))?;
        Ok(StoreWriter {
            file,
            path,
            name,
            compression,
            next_block: AtomicU32::new(0),
            end: AtomicU64::new(0),
            blocks: Mutex::new(Vec::new()),
            dedup: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        })
    }

    /// Add one page (not all zero) with its XXH3-128 `hash`; returns where
    /// it is and whether an identical page was stored before.
    pub fn add(&self, cur: &mut Option<OpenBlock>, hash: u128, page: &[u8]) -> Result<(Loc, bool)> {
        debug_assert_eq!(page.len(), PAGE);
        let shard = &self.dedup[(hash as usize) % SHARDS];
        let mut map = shard.lock().expect("dedup shard");
        if let Some(&loc) = map.get(&hash) {
            return Ok((loc, true));
        }
        let b = cur.get_or_insert_with(|| OpenBlock {
            id: self.next_block.fetch_add(1, Ordering::Relaxed),
            data: Vec::with_capacity(BLOCK_PAGES * PAGE),
        });
        let loc = Loc {
            block: b.id,
            page: b.pages() as u32,
        };
        map.insert(hash, loc);
        drop(map);
        b.data.extend_from_slice(page);
        if b.pages() == BLOCK_PAGES {
            self.flush(cur.take().expect("open block"))?;
        }
        Ok((loc, false))
    }

    /// Write a thread's last, partly filled block.
    pub fn close(&self, cur: Option<OpenBlock>) -> Result<()> {
        match cur {
            Some(b) => self.flush(b),
            None => Ok(()),
        }
    }

    fn flush(&self, b: OpenBlock) -> Result<()> {
        let xxh3 = checksum(&b.data);
        let packed = match self.compression {
            Compression::None => None,
            Compression::Lz4 => Some(lz4_flex::block::compress(&b.data)),
            Compression::Zstd => {
                Some(zstd::bulk::compress(&b.data, ZSTD_LEVEL).map_err(|source| {
                    ImageError::Io {
                        path: self.path.clone(),
                        source,
                    }
                })?)
            }
        };
        let (bytes, raw) = match &packed {
            Some(p) if p.len() < b.data.len() => (p.as_slice(), false),
            _ => (b.data.as_slice(), true),
        };
        // Raw blocks stay page aligned so they can be mapped and copied as is.
        let len = if raw {
            bytes.len() as u64
        } else {
            (bytes.len() as u64).next_multiple_of(PAGE as u64)
        };
        let offset = self.end.fetch_add(len, Ordering::Relaxed);
        self.file
            .write_all_at(bytes, offset)
            .map_err(io_err(&self.path))?;
        self.blocks.lock().expect("blocks").push((
            b.id,
            StoreBlock {
                offset,
                stored_len: bytes.len() as u32,
                pages: b.pages() as u32,
                xxh3,
                raw,
            },
        ));
        Ok(())
    }

    /// Make the file its final size, flush it if asked, and describe it.
    pub fn finish(self, fsync: bool) -> Result<PageStore> {
        let size = self.end.load(Ordering::Relaxed);
        self.file.set_len(size).map_err(io_err(&self.path))?;
        if fsync {
            self.file.sync_all().map_err(io_err(&self.path))?;
        }
        let mut blocks = self.blocks.into_inner().expect("blocks");
        blocks.sort_by_key(|(id, _)| *id);
        let ok = blocks
            .iter()
            .enumerate()
            .all(|(i, (id, _))| i as u32 == *id);
        if !ok || blocks.len() as u32 != self.next_block.load(Ordering::Relaxed) {
            return Err(ImageError::Invalid {
                path: self.path,
                what: "a block of the page store was never written".into(),
            });
        }
        Ok(PageStore {
            name: self.name,
            size,
            compression: self.compression,
            blocks: blocks.into_iter().map(|(_, b)| b).collect(),
        })
    }
}

/// Reader of a committed page store.
pub struct StoreReader {
    path: PathBuf,
    map: cr_sys::mem::FileMap,
    compression: Compression,
    blocks: Vec<StoreBlock>,
    verified: Vec<AtomicBool>,
}

impl StoreReader {
    /// Open a store and check its size (its name and block table were
    /// checked when the image was read).
    pub fn open(dir: &ImageDir, store: &PageStore) -> Result<Self> {
        let path = dir.file(&store.name);
        let file = File::open(&path).map_err(io_err(&path))?;
        let actual = file.metadata().map_err(io_err(&path))?.len();
        if actual != store.size {
            return Err(ImageError::Truncated {
                path,
                expected: store.size,
                actual,
            });
        }
        let map = cr_sys::mem::FileMap::map(&file, &path.to_string_lossy()).map_err(|e| {
            ImageError::Invalid {
                path: path.clone(),
                what: cr_sys::error::one_line(&e),
            }
        })?;
        Ok(StoreReader {
            path,
            map,
            compression: store.compression,
            verified: store
                .blocks
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            blocks: store.blocks.clone(),
        })
    }

    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub fn nr_blocks(&self) -> usize {
        self.blocks.len()
    }

    fn meta(&self, id: u32) -> Result<&StoreBlock> {
        self.blocks
            .get(id as usize)
            .ok_or_else(|| ImageError::Invalid {
                path: self.path.clone(),
                what: format!("reference to block {id} of {} blocks", self.blocks.len()),
            })
    }

    /// Check block `id`'s uncompressed `data` against its hash (a raw
    /// block only the first time).
    fn check(&self, id: u32, b: &StoreBlock, data: &[u8]) -> Result<()> {
        let verified = &self.verified[id as usize];
        if b.raw && verified.load(Ordering::Relaxed) {
            return Ok(());
        }
        if checksum(data) != b.xxh3 {
            return Err(self.damaged(id, "fails its checksum"));
        }
        verified.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Pages of block `id`, checked against its hash: borrowed from the
    /// mapped file when the block is raw, else decompressed into `buf`.
    pub fn block<'a>(&'a self, id: u32, buf: &'a mut Vec<u8>) -> Result<&'a [u8]> {
        let b = self.meta(id)?;
        let stored = &self.map.bytes()[b.offset as usize..][..b.stored_len as usize];
        if b.raw {
            self.check(id, b, stored)?;
            return Ok(stored);
        }
        let len = b.pages as usize * PAGE;
        buf.resize(len, 0);
        let n = match self.compression {
            Compression::Lz4 => lz4_flex::block::decompress_into(stored, buf).ok(),
            Compression::Zstd => zstd::bulk::decompress_to_buffer(stored, buf.as_mut_slice()).ok(),
            Compression::None => None,
        };
        if n != Some(len) {
            return Err(self.damaged(id, "does not decompress"));
        }
        self.check(id, b, buf)?;
        Ok(buf)
    }

    /// Block `id` as stored in the file (compressed or raw), unchecked: what
    /// a post-copy source sends (the target checks it when it reads it).
    pub fn stored(&self, id: u32) -> Result<&[u8]> {
        let b = self.meta(id)?;
        Ok(&self.map.bytes()[b.offset as usize..][..b.stored_len as usize])
    }

    /// Whether block `id` is stored uncompressed.
    pub fn is_raw(&self, id: u32) -> bool {
        self.blocks.get(id as usize).is_some_and(|b| b.raw)
    }

    /// Drop block `id` from our resident set (its bytes stay in the page
    /// cache; the next read maps them again): see
    /// [`cr_sys::mem::FileMap::release`].
    pub fn release(&self, id: u32) {
        if let Ok(b) = self.meta(id) {
            self.map.release(b.offset as usize, b.stored_len as usize);
        }
    }

    /// `len` bytes from byte `at` of raw block `id`, straight from the
    /// mapped file (the block's checksum is verified on first use).
    pub fn raw_slice(&self, id: u32, at: usize, len: usize) -> Result<&[u8]> {
        let b = self.meta(id)?;
        let stored = &self.map.bytes()[b.offset as usize..][..b.stored_len as usize];
        if !b.raw {
            return Err(self.damaged(id, "is compressed"));
        }
        self.check(id, b, stored)?;
        stored.get(at..at + len).ok_or_else(|| ImageError::Invalid {
            path: self.path.clone(),
            what: format!("a run lies beyond the end of block {id}"),
        })
    }

    fn damaged(&self, id: u32, what: &str) -> ImageError {
        let b = &self.blocks[id as usize];
        ImageError::Checksum {
            path: self.path.clone(),
            context: format!(" (block {id} at byte {} {what})", b.offset),
        }
    }
}
