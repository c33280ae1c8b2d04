//! The page store of an image: one file (`pages-<ID>.img`) of unique pages
//! for all the image's processes, cut into blocks of up to
//! [`BLOCK_PAGES`] pages.
//!
//! - A page identical to one stored shortly before in this image (same
//!   XXH3-128) is stored once: dedup works within and across the processes
//!   of a tree. What the writer remembers for that is bounded ([`Dedup`]:
//!   at most 2^17 pages, about 6 MiB), so that the dumper's memory does not
//!   grow with the image; a page seen longer ago may be stored again (the
//!   image is larger, never wrong). The pages a child shares
//!   copy-on-write with its parent are found by address by the memory kind,
//!   whatever this remembers.
//! - All-zero pages never reach the store (the dumper drops them).
//! - Each block is compressed on its own (lz4 or zstd, chosen per image) and
//!   kept raw when compression would not shrink it; raw blocks are copied
//!   from the mapped file straight into the restored process.
//! - Every block carries the XXH3-64 of its uncompressed pages, checked
//!   before any of its pages is used. (A checksum made of the pages'
//!   XXH3-128, which the writer has already, was tried: it spared the dump
//!   one hash but doubled the restore's, as 64 short hashes of 4 KiB cost
//!   twice one of 256 KiB.)
//!
//! Several threads add pages at once: each fills its own block and
//! reserves its offset atomically when the block is full. Blocks are
//! written by one thread at a time ([`Writes`]), the others going on.

use crate::dir::{ImageDir, TMP_SUFFIX};
use crate::model::{Compression, PageStore, StoreBlock};
use crate::{checksum, io_err, ImageError, Result};
use std::collections::HashMap;
use std::fs::File;
use std::hash::{BuildHasherDefault, Hasher};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};

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

/// A block being filled by one thread. Once written, its buffers are
/// reused for the thread's next block.
#[derive(Default)]
pub struct OpenBlock {
    /// Taken when its first page is added.
    id: Option<u32>,
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
    dedup: Vec<Mutex<Dedup>>,
    writes: Writes,
}

/// Full blocks waiting to be written, and who writes them.
///
/// The kernel serialises writes to one file (tmpfs and the usual disk
/// filesystems hold the inode's lock across a write), and a writer that
/// finds the lock taken spins on it: with two dump threads on 2 CPUs a
/// fifth of a 1 GiB dump's CPU went there (perf, `rwsem_spin_on_owner`
/// under `pwrite64`). So a thread with a full block queues it, and the
/// thread that holds `lock` writes every queued block; the others go on
/// reading and hashing. A thread waits for the writer only when more than
/// [`MAX_QUEUED`] blocks are queued, which bounds the memory held.
#[derive(Default)]
struct Writes {
    queue: Mutex<Vec<(u64, Vec<u8>)>>,
    lock: Mutex<()>,
    /// Block buffers written, for the next blocks.
    spare: Mutex<Vec<Vec<u8>>>,
    /// The first write that failed (it fails [`StoreWriter::finish`] too).
    failed: Mutex<Option<String>>,
}

/// Blocks queued before a thread that fills one waits for the writer.
const MAX_QUEUED: usize = 16;

/// Pages each shard's dedup map remembers at most: 2^17 in all over the
/// [`SHARDS`] shards (about 6 MiB once full, with the map's own room).
const DEDUP_PER_SHARD: usize = (1 << 17) / SHARDS;

/// The pages a store was given lately, by XXH3-128, bounded: a map that
/// starts empty (a small dump's costs what its pages need) and is emptied
/// when it holds [`DEDUP_PER_SHARD`] pages, keeping its room. A page seen
/// before the last emptying may be stored again (a larger image, never a
/// wrong page).
///
/// (A fixed table of 2^17 entries, 3-4 MiB allocated at every dump, made
/// the agent's RSS grow by megabytes per dump: the allocator kept the
/// freed tables in its per-thread arenas.)
#[derive(Default)]
struct Dedup(HashMap<u128, Loc, BuildHasherDefault<KeyHasher>>);

impl Dedup {
    fn get(&self, hash: u128) -> Option<Loc> {
        self.0.get(&hash).copied()
    }

    fn insert(&mut self, hash: u128, loc: Loc) {
        if self.0.len() >= DEDUP_PER_SHARD {
            self.0.clear();
        }
        self.0.insert(hash, loc);
    }
}

/// Hasher of the dedup maps: their keys are XXH3-128 hashes already, so
/// its two halves folded are hash enough (the default SipHash of every
/// key was pure cost).
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = (v as u64) ^ ((v >> 64) as u64).rotate_left(32);
    }
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
            dedup: (0..SHARDS).map(|_| Mutex::new(Dedup::default())).collect(),
            writes: Writes::default(),
        })
    }

    /// Add one page (not all zero) with its XXH3-128 `hash` ([`page_hash`]);
    /// returns where it is and whether an identical page was stored before.
    pub fn add(&self, cur: &mut Option<OpenBlock>, hash: u128, page: &[u8]) -> Result<(Loc, bool)> {
        debug_assert_eq!(page.len(), PAGE);
        let shard = &self.dedup[(hash % SHARDS as u128) as usize];
        let mut map = shard.lock().expect("dedup shard");
        if let Some(loc) = map.get(hash) {
            return Ok((loc, true));
        }
        let b = cur.get_or_insert_with(OpenBlock::default);
        let id = *b
            .id
            .get_or_insert_with(|| self.next_block.fetch_add(1, Ordering::Relaxed));
        let loc = Loc {
            block: id,
            page: b.pages() as u32,
        };
        map.insert(hash, loc);
        drop(map);
        if b.data.capacity() == 0 {
            b.data = self.writes.buffer();
        }
        b.data.extend_from_slice(page);
        if b.pages() == BLOCK_PAGES {
            self.flush(b)?;
        }
        Ok((loc, false))
    }

    /// Write a thread's last, partly filled block.
    pub fn close(&self, cur: Option<OpenBlock>) -> Result<()> {
        match cur {
            Some(mut b) => self.flush(&mut b),
            None => Ok(()),
        }
    }

    /// Write block `b` (if it holds pages) and empty it for the next one.
    fn flush(&self, b: &mut OpenBlock) -> Result<()> {
        let Some(id) = b.id.take() else {
            return Ok(());
        };
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
        let pages = b.pages() as u32;
        let (bytes, raw) = match packed {
            Some(p) if p.len() < b.data.len() => {
                b.data.clear();
                (p, false)
            }
            _ => (std::mem::take(&mut b.data), true),
        };
        // Raw blocks stay page aligned so they can be mapped and copied as is.
        let len = if raw {
            bytes.len() as u64
        } else {
            (bytes.len() as u64).next_multiple_of(PAGE as u64)
        };
        let offset = self.end.fetch_add(len, Ordering::Relaxed);
        let stored_len = bytes.len() as u32;
        self.blocks.lock().expect("blocks").push((
            id,
            StoreBlock {
                offset,
                stored_len,
                pages,
                xxh3,
                raw,
            },
        ));
        self.writes
            .queue
            .lock()
            .expect("write queue")
            .push((offset, bytes));
        self.write_queued()
    }

    /// Write the queued blocks unless another thread is at it (and fewer
    /// than [`MAX_QUEUED`] wait); see [`Writes`].
    fn write_queued(&self) -> Result<()> {
        let w = &self.writes;
        loop {
            let guard = match w.lock.try_lock() {
                Ok(g) => g,
                Err(TryLockError::WouldBlock)
                    if w.queue.lock().expect("write queue").len() <= MAX_QUEUED =>
                {
                    return Ok(());
                }
                Err(TryLockError::WouldBlock) => w.lock.lock().unwrap_or_else(|p| p.into_inner()),
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
            };
            loop {
                let batch = std::mem::take(&mut *w.queue.lock().expect("write queue"));
                if batch.is_empty() {
                    break;
                }
                for (offset, bytes) in batch {
                    if let Err(e) = self.file.write_all_at(&bytes, offset) {
                        let e = io_err(&self.path)(e);
                        w.failed
                            .lock()
                            .expect("write failure")
                            .get_or_insert_with(|| e.to_string());
                        return Err(e);
                    }
                    w.recycle(bytes);
                }
            }
            drop(guard);
            // A block queued while the writer was leaving is written by
            // whoever takes the lock next: this thread, if no one else.
            if w.queue.lock().expect("write queue").is_empty() {
                return Ok(());
            }
        }
    }

    /// Make the file its final size, flush it if asked, and describe it.
    pub fn finish(self, fsync: bool) -> Result<PageStore> {
        // Every thread that added pages closed its block: what a writer
        // left queued (none should be) is written now.
        self.write_queued()?;
        if let Some(why) = self.writes.failed.lock().expect("write failure").take() {
            return Err(ImageError::Invalid {
                path: self.path,
                what: format!("a block of the page store could not be written: {why}"),
            });
        }
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

impl Writes {
    /// An empty buffer for a block's pages: one written before, or new.
    fn buffer(&self) -> Vec<u8> {
        self.spare
            .lock()
            .expect("spare buffers")
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(BLOCK_PAGES * PAGE))
    }

    /// Keep a written block's buffer for a next block (raw blocks' only).
    fn recycle(&self, mut bytes: Vec<u8>) {
        if bytes.capacity() == BLOCK_PAGES * PAGE {
            let mut spare = self.spare.lock().expect("spare buffers");
            if spare.len() < MAX_QUEUED {
                bytes.clear();
                spare.push(bytes);
            }
        }
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

    /// Check block `id`'s uncompressed `data` against its checksum (a raw
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The dedup map finds what it was given, never holds more than its
    /// bound (it is emptied then: older pages are stored again, never
    /// wrongly found), and keeps its room.
    #[test]
    fn dedup_map_is_bounded_and_finds_recent_pages() {
        let mut d = Dedup::default();
        let loc = |n: u128| Loc {
            block: n as u32,
            page: 0,
        };
        for n in 1..=DEDUP_PER_SHARD as u128 {
            d.insert(n, loc(n));
        }
        assert_eq!(d.get(1), Some(loc(1)));
        assert_eq!(
            d.get(DEDUP_PER_SHARD as u128),
            Some(loc(DEDUP_PER_SHARD as u128))
        );
        let room = d.0.capacity();
        d.insert(u128::MAX, loc(7));
        assert_eq!(d.get(1), None, "emptied at the bound");
        assert_eq!(d.get(u128::MAX), Some(loc(7)));
        for n in 0..10 * DEDUP_PER_SHARD as u128 {
            d.insert(n << 64 | 3, loc(n));
            assert!(d.0.len() <= DEDUP_PER_SHARD);
        }
        assert_eq!(d.0.capacity(), room, "the map keeps its room, never grows");
    }

    /// A store of `n` distinct pages (two blocks when `n` > 64) written
    /// with `compression` and renamed into place, and its description.
    fn written(name: &str, n: usize, compression: Compression) -> (ImageDir, PageStore) {
        let root =
            std::env::temp_dir().join(format!("cr-image-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = ImageDir::create(&root).unwrap();
        let w = StoreWriter::create(&dir, "t", compression).unwrap();
        let mut cur = None;
        for i in 0..n {
            let mut page = vec![(i % 251) as u8; PAGE];
            page[..8].copy_from_slice(&(i as u64).to_le_bytes());
            let (loc, dup) = w.add(&mut cur, page_hash(&page), &page).unwrap();
            assert!(!dup);
            assert_eq!(loc.block as usize * BLOCK_PAGES + loc.page as usize, i);
        }
        w.close(cur).unwrap();
        let store = w.finish(false).unwrap();
        let tmp = dir.file(&format!("{}{TMP_SUFFIX}", store.name));
        std::fs::rename(tmp, dir.file(&store.name)).unwrap();
        (dir, store)
    }

    fn read_all(dir: &ImageDir, store: &PageStore) -> Result<()> {
        let r = StoreReader::open(dir, store)?;
        let mut buf = Vec::new();
        for id in 0..r.nr_blocks() as u32 {
            r.block(id, &mut buf)?;
        }
        Ok(())
    }

    /// Blocks are checked against the pages' own hashes (format 3.1): a
    /// good store reads, one changed byte of a page is caught, raw or
    /// compressed, in the full block and in the last, partial one.
    #[test]
    fn block_sums_catch_a_changed_page() {
        for (name, c) in [("none", Compression::None), ("lz4", Compression::Lz4)] {
            let (dir, store) = written(name, BLOCK_PAGES + 3, c);
            assert_eq!(store.blocks.len(), 2);
            read_all(&dir, &store).unwrap();
            for (id, b) in store.blocks.iter().enumerate() {
                let path = dir.file(&store.name);
                let good = std::fs::read(&path).unwrap();
                let mut bad = good.clone();
                bad[b.offset as usize + b.stored_len as usize / 2] ^= 0x04;
                std::fs::write(&path, &bad).unwrap();
                let e = read_all(&dir, &store).unwrap_err().to_string();
                assert!(
                    e.contains(&format!("block {id} at byte {}", b.offset)),
                    "{name}: {e}"
                );
                std::fs::write(&path, &good).unwrap();
            }
            let _ = std::fs::remove_dir_all(dir.path());
        }
    }

    /// Threads adding pages at once (their blocks queued and written by
    /// whichever holds the write lock): every page reads back at its place.
    #[test]
    fn pages_added_by_threads_at_once_read_back() {
        let root = std::env::temp_dir().join(format!("cr-image-store-mt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dir = ImageDir::create(&root).unwrap();
        let w = StoreWriter::create(&dir, "t", Compression::None).unwrap();
        let page_of = |t: usize, i: usize| {
            let mut page = vec![(t * 7 + i) as u8; PAGE];
            page[..16].copy_from_slice(&((t as u128) << 64 | i as u128).to_le_bytes());
            page
        };
        let (threads, per) = (4, 40 * BLOCK_PAGES + 5);
        let locs: Vec<Vec<Loc>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let w = &w;
                    sc.spawn(move || {
                        let mut cur = None;
                        let locs = (0..per)
                            .map(|i| {
                                let page = page_of(t, i);
                                w.add(&mut cur, page_hash(&page), &page).unwrap().0
                            })
                            .collect::<Vec<_>>();
                        w.close(cur).unwrap();
                        locs
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let store = w.finish(false).unwrap();
        let tmp = dir.file(&format!("{}{TMP_SUFFIX}", store.name));
        std::fs::rename(tmp, dir.file(&store.name)).unwrap();
        let r = StoreReader::open(&dir, &store).unwrap();
        let mut buf = Vec::new();
        for (t, locs) in locs.iter().enumerate() {
            for (i, loc) in locs.iter().enumerate() {
                let data = r.block(loc.block, &mut buf).unwrap();
                let at = loc.page as usize * PAGE;
                assert!(
                    data[at..at + PAGE] == page_of(t, i)[..],
                    "thread {t} page {i}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(dir.path());
    }
}
