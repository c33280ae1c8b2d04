//! Restore of memory: map every saved VMA at its address, fill the stored
//! pages from the page stores of the image chain on the worker pool (raw
//! blocks straight from the mapped store file, compressed ones through a
//! buffer; every block's checksum verified before use), then set the final
//! protections, madvise flags, memory locks and anonymous names.

use super::cow::Slot;
use super::pool;
use super::remote::RemoteStores;
use crate::error::{RestoreError, StepContext};
use crate::restore::{Rebuild, Restorer};
use cr_image::chain::{Chain, Piece, Source};
use cr_image::model::{Process, Vma, VmaKind};
use cr_image::store::{StoreReader, PAGE};
use cr_sys::mem::{write_vm, write_vm_many};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

const PR_SET_VMA: u64 = 0x53564d41;
const PR_SET_VMA_ANON_NAME: u64 = 0;
/// madvise: make the range a guard region (Linux 6.13).
const MADV_GUARD_INSTALL: u64 = 102;

/// The page stores of an image chain, opened once for all processes.
pub struct Pages<'a> {
    chain: &'a Chain,
    readers: Vec<Option<StoreReader>>,
    /// Stores still arriving (post-copy between nodes), and each link's
    /// store file as they name it (canonical).
    remote: Option<(Arc<dyn RemoteStores>, Vec<PathBuf>)>,
}

impl<'a> Pages<'a> {
    /// Open (and size-check) the store of every image of the chain; the
    /// blocks of those in `remote` are waited for before they are read.
    pub fn open(
        chain: &'a Chain,
        remote: Option<&Arc<dyn RemoteStores>>,
    ) -> Result<Self, RestoreError> {
        let readers = chain
            .links
            .iter()
            .map(|l| match &l.ck.store {
                Some(s) => StoreReader::open(&l.dir, s).map(Some),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let remote = remote.map(|r| {
            let paths = readers
                .iter()
                .map(|rd| {
                    rd.as_ref().map_or_else(PathBuf::new, |rd| {
                        rd.path()
                            .canonicalize()
                            .unwrap_or_else(|_| rd.path().to_path_buf())
                    })
                })
                .collect();
            (r.clone(), paths)
        });
        Ok(Pages {
            chain,
            readers,
            remote,
        })
    }

    /// Whether block `block` of link `link`'s store can be read now; an
    /// error when it never will.
    pub fn has(&self, link: usize, block: u32) -> Result<bool, RestoreError> {
        let Some((r, paths)) = &self.remote else {
            return Ok(true);
        };
        r.has(&paths[link], block)
            .map_err(|why| RestoreError::RemotePages {
                store: paths[link].clone(),
                block,
                why,
            })
    }

    /// Ask at once for every block of `pieces` not in yet (their pages are
    /// about to be read).
    pub fn want(&self, pieces: &[Piece]) {
        let Some((r, paths)) = &self.remote else {
            return;
        };
        let mut by_link: HashMap<usize, Vec<u32>> = HashMap::new();
        for p in pieces {
            if let Source::Store { link, loc } = p.src {
                let v = by_link.entry(link).or_default();
                if v.last() != Some(&loc.block) {
                    v.push(loc.block);
                }
            }
        }
        for (link, blocks) in by_link {
            r.want(&paths[link], &blocks);
        }
    }

    /// Wait until block `block` of link `link`'s store can be read.
    fn ready(&self, link: usize, block: u32) -> Result<(), RestoreError> {
        let Some((r, paths)) = &self.remote else {
            return Ok(());
        };
        let store = &paths[link];
        r.wait(store, block)
            .map_err(|why| RestoreError::RemotePages {
                store: store.clone(),
                block,
                why,
            })
    }

    /// Where every page of process `pid` lives (checks the chain covers them).
    pub fn resolve(&self, pid: u32) -> Result<Vec<Piece>, RestoreError> {
        Ok(self.chain.resolve(pid, usize::MAX)?)
    }

    fn reader(&self, link: usize) -> Result<&StoreReader, RestoreError> {
        self.readers
            .get(link)
            .and_then(|r| r.as_ref())
            .ok_or_else(|| {
                RestoreError::Unsupported(format!(
                    "image {} has pages in a store it does not describe",
                    self.chain.links.get(link).map_or_else(String::new, |l| l
                        .dir
                        .path()
                        .display()
                        .to_string())
                ))
            })
    }
}

impl Pages<'_> {
    /// The bytes of `piece` (stored: straight from the mapped store file,
    /// or decompressed in `buf`, see [`unpacked`]); `None` for a zero piece.
    pub fn bytes<'b>(
        &'b self,
        piece: &Piece,
        buf: &'b mut Vec<u8>,
        cached: &mut Option<(usize, u32)>,
    ) -> Result<Option<&'b [u8]>, RestoreError> {
        match piece.src {
            Source::Store { link, loc } => {
                let reader = self.reader(link)?;
                self.ready(link, loc.block)?;
                if reader.is_raw(loc.block) {
                    let len = piece.pages as usize * PAGE;
                    return Ok(Some(reader.raw_slice(
                        loc.block,
                        loc.page as usize * PAGE,
                        len,
                    )?));
                }
                unpacked(reader, link, piece, buf, cached).map(Some)
            }
            Source::Zero => Ok(None),
            Source::Parent => Err(RestoreError::Unsupported(format!(
                "pages at {:#x} were not resolved",
                piece.vaddr
            ))),
        }
    }
}

/// The bytes of stored `piece` (of link `link`, whose store is `reader`)
/// from its compressed block, decompressed (and checked) in `buf` unless
/// `cached` says `buf` holds that block already.
fn unpacked<'b>(
    reader: &StoreReader,
    link: usize,
    piece: &Piece,
    buf: &'b mut Vec<u8>,
    cached: &mut Option<(usize, u32)>,
) -> Result<&'b [u8], RestoreError> {
    let Source::Store { loc, .. } = piece.src else {
        return Err(RestoreError::Unsupported(format!(
            "pages at {:#x} are not stored",
            piece.vaddr
        )));
    };
    if *cached != Some((link, loc.block)) {
        // Forget the old block before `buf` changes.
        cached.take();
        reader.block(loc.block, buf)?;
        *cached = Some((link, loc.block));
    }
    let at = loc.page as usize * PAGE;
    let len = piece.pages as usize * PAGE;
    Ok(buf
        .get(at..at + len)
        .ok_or_else(|| cr_image::ImageError::Invalid {
            path: reader.path().into(),
            what: format!(
                "pages of {:#x} lie beyond the end of block {}",
                piece.vaddr, loc.block
            ),
        })?)
}

/// Which VMAs have pages to fill (they are mapped writable until filled).
fn vmas_with_pages(vmas: &[Vma], pieces: &[Piece]) -> Vec<bool> {
    let mut has = vec![false; vmas.len()];
    for e in pieces {
        let end = e.vaddr + e.pages as u64 * PAGE as u64;
        let first = vmas.partition_point(|v| v.end <= e.vaddr);
        for (i, v) in vmas.iter().enumerate().skip(first) {
            if v.start >= end {
                break;
            }
            has[i] = true;
        }
    }
    has
}

/// Map every VMA (writable where pages must be filled), moving those
/// already filled in `slots` (memory shared copy-on-write, see
/// [`super::cow`]) into place; returns which are writable until
/// [`finish`].
pub fn map_all(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    slots: &[Slot],
) -> Result<Vec<bool>, RestoreError> {
    let mut fill = vmas_with_pages(&p.vmas, cx.pieces);
    let mut files: HashMap<(String, bool), u64> = HashMap::new();
    let mut shm_fds = Vec::new();
    let mut sysv = crate::kinds::sysv::Attaches::new(&p.vmas);
    for (i, v) in p.vmas.iter().enumerate() {
        if v.kind.is_special() {
            continue;
        }
        if let Some(s) = slots.iter().find(|s| s.start == v.start && s.end == v.end) {
            move_slot(cx, s)?;
            // Mapped writable in its slot.
            fill[i] = true;
            continue;
        }
        let fill = fill[i];
        if v.kind == VmaKind::SysvShm {
            sysv.attach(&mut cx.stub, cx.r, i)?;
            continue;
        }
        // Made by io_setup (kind "aio"), once every other mapping is in;
        // a packet ring by mmap of its socket, once the fds are (kind
        // "packet").
        if matches!(v.kind, VmaKind::Aio | VmaKind::PacketRing) {
            continue;
        }
        let mut prot = v.prot as u64;
        if fill {
            prot |= libc::PROT_READ as u64 | libc::PROT_WRITE as u64;
        }
        let mut flags = libc::MAP_FIXED_NOREPLACE as u64;
        // Droppable memory (`dp`, Linux 6.12) is a sharing type of its
        // own: private, its pages freed under memory pressure.
        flags |= if v.shared {
            libc::MAP_SHARED
        } else if v.has_flag("dp") {
            libc::MAP_DROPPABLE
        } else {
            libc::MAP_PRIVATE
        } as u64;
        if v.has_flag("gd") {
            flags |= libc::MAP_GROWSDOWN as u64;
        }
        if v.has_flag("nr") {
            flags |= libc::MAP_NORESERVE as u64;
        }
        let (fd, off) = match v.kind {
            // Shared anonymous memory (and private mappings of it): the
            // object as the first mapping of it in the image made it.
            _ if v.is_shmem() && (v.shm_owner.is_some() || !plain_shmem(cx.r.ck, p.pid, v)) => {
                let path = shmem_object(cx, p.pid, v)?;
                let fd =
                    open_restorer_path(cx, &path, libc::O_RDWR | libc::O_CLOEXEC).step(|| {
                        format!(
                            "cannot open the shared memory of {:#x}-{:#x}",
                            v.start, v.end
                        )
                    })?;
                shm_fds.push(fd);
                (fd, v.pgoff)
            }
            VmaKind::FilePrivate | VmaKind::FileShared => {
                // A shared mapping that may become writable needs a writable fd.
                let rw = v.kind == VmaKind::FileShared && v.has_flag("mw");
                let path = file_path(cx.r, v)?;
                let fd = match files.get(&(path.clone(), rw)) {
                    Some(fd) => *fd,
                    None => {
                        let o = if rw { libc::O_RDWR } else { libc::O_RDONLY };
                        let fd = open_restorer_path(cx, &path, o | libc::O_CLOEXEC).step(|| {
                            format!("cannot open {} to map it at {:#x}", v.path, v.start)
                        })?;
                        files.insert((path.clone(), rw), fd);
                        fd
                    }
                };
                (fd, v.pgoff)
            }
            _ => {
                flags |=
                    (libc::MAP_ANONYMOUS | cr_sys::mem::huge_mmap_flags(v.huge_page_size)) as u64;
                (u64::MAX, 0)
            }
        };
        // The object a plain shared anonymous mapping makes, for the
        // mappings of it that follow.
        let made = v.is_shmem() && v.shm_owner.is_none() && fd == u64::MAX;
        // Queued: MAP_FIXED_NOREPLACE maps exactly there or fails
        // (EEXIST), so the address it returns need not be looked at.
        cx.stub.later(
            "mmap",
            libc::SYS_mmap,
            [v.start, v.len(), prot, flags, fd, off],
            format!(
                "cannot map {:#x}-{:#x} {}{}",
                v.start,
                v.end,
                v.path,
                if v.huge_page_size != 0 {
                    format!(
                        " (hugetlb memory in pages of {} kB: are enough free? /proc/sys/vm/nr_hugepages)",
                        v.huge_page_size >> 10
                    )
                } else {
                    String::new()
                }
            ),
        )?;
        if made {
            cx.stub.flush()?;
            let path = format!(
                "/proc/{}/map_files/{:x}-{:x}",
                cx.stub.pid(),
                v.start,
                v.end
            );
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(|source| cr_sys::SysError::Io { path, source })?;
            cx.r.stash
                .get::<ShmObjects>()
                .0
                .insert((p.pid, v.start), f.into());
        }
    }
    for fd in files.into_values().chain(shm_fds) {
        cx.stub.later(
            "close",
            libc::SYS_close,
            [fd, 0, 0, 0, 0, 0],
            format!("cannot close fd {fd} of the stub's mappings"),
        )?;
    }
    cx.stub.flush()?;
    Ok(fill)
}

/// The path through which the file that `v` maps privately or shared is
/// opened: the restorer's copy of a memfd or deleted file, else its own.
pub fn file_path(r: &mut Restorer<'_>, v: &Vma) -> Result<String, RestoreError> {
    match v.object {
        Some(id) => crate::kinds::files::map_path(r, id, &v.path).ok_or_else(|| {
            RestoreError::Unsupported(format!(
                "mapping at {:#x} refers to object {id} missing from the image",
                v.start
            ))
        }),
        None => match &v.relink {
            Some(link) => crate::kinds::files::relink::open_path(r, &v.path, link),
            None => Ok(v.path.clone()),
        },
    }
}

/// The shared anonymous memory objects made so far in this restore, by
/// the image's first mapping of each (pid, start): held open until the
/// restore ends, so that every later mapping maps that very object.
#[derive(Default)]
pub struct ShmObjects(HashMap<(u32, u64), std::os::fd::OwnedFd>);

/// The first mapping of a shared anonymous object in the image (pid,
/// start) that `v` (of process `pid`) maps, and the bytes the object
/// needs: up to the furthest end of any mapping of it.
fn shmem_extent(ck: &cr_image::model::Checkpoint, pid: u32, v: &Vma) -> ((u32, u64), u64) {
    let key = v.shm_owner.map_or((pid, v.start), |o| (o.pid, o.start));
    let size = ck
        .processes
        .iter()
        .flat_map(|q| q.vmas.iter().map(move |w| (q.pid, w)))
        .filter(|(q, w)| {
            w.is_shmem() && w.shm_owner.map_or((*q, w.start), |o| (o.pid, o.start)) == key
        })
        .map(|(_, w)| w.pgoff + w.len())
        .max()
        .unwrap_or(v.pgoff + v.len());
    (key, size)
}

/// Whether `v`, the first mapping of its object, makes it as a plain
/// mmap(MAP_SHARED | MAP_ANONYMOUS) would (shared, from offset 0, no other
/// mapping of it reaching further): then it keeps the kernel's own
/// anonymous shared mapping (which can be named).
fn plain_shmem(ck: &cr_image::model::Checkpoint, pid: u32, v: &Vma) -> bool {
    v.kind == VmaKind::AnonShared
        && v.shared
        && v.pgoff == 0
        && shmem_extent(ck, pid, v).1 <= v.len()
}

/// The path (in the restorer's /proc) of the shared anonymous object `v`
/// maps, made now for the first mapping of it.
fn shmem_object(cx: &mut Rebuild<'_, '_, '_>, pid: u32, v: &Vma) -> Result<String, RestoreError> {
    let (key, size) = shmem_extent(cx.r.ck, pid, v);
    let objects = &mut cx.r.stash.get::<ShmObjects>().0;
    let fd = match objects.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => std::os::fd::AsRawFd::as_raw_fd(e.get()),
        std::collections::hash_map::Entry::Vacant(e) => {
            if v.shm_owner.is_some() {
                return Err(RestoreError::Unsupported(format!(
                    "mapping at {:#x} shares memory of process {} at {:#x}, not restored before it",
                    v.start, key.0, key.1
                )));
            }
            std::os::fd::AsRawFd::as_raw_fd(
                e.insert(cr_sys::mem::shmem_object(size, v.huge_page_size)?),
            )
        }
    };
    Ok(format!("/proc/{}/fd/{fd}", std::process::id()))
}

/// Move the memory filled in slot `s` to its saved address (the pages
/// keep being shared with the relatives that hold them).
fn move_slot(cx: &mut Rebuild<'_, '_, '_>, s: &Slot) -> Result<(), RestoreError> {
    let len = s.end - s.start;
    let flags = (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64;
    // Queued (see `map_all`): MREMAP_FIXED moves exactly there or fails.
    cx.stub.later(
        "mremap",
        libc::SYS_mremap,
        [s.at, len, len, flags, s.start, 0],
        format!(
            "cannot move the memory shared copy-on-write from {:#x} to {:#x}-{:#x}",
            s.at, s.start, s.end
        ),
    )?;
    Ok(())
}

/// Open in the stub `path` as the restorer sees it. A job with a /proc of
/// its own (kind "mounts") does not show the restorer's PIDs there: a
/// /proc path is then opened relative to the restorer's /proc.
fn open_restorer_path(
    cx: &mut Rebuild<'_, '_, '_>,
    path: &str,
    flags: i32,
) -> cr_sys::error::Result<u64> {
    let own_proc = cx.r.ck.mounts.as_ref().is_some_and(|m| m.proc);
    match path.strip_prefix("/proc/") {
        Some(rel) if own_proc => {
            let dir = std::fs::File::open("/proc").map_err(|source| cr_sys::SysError::Io {
                path: "/proc".into(),
                source,
            })?;
            cx.stub
                .open_at_ours(std::os::fd::AsRawFd::as_raw_fd(&dir), rel, flags)
        }
        _ => cx.stub.open(path, flags),
    }
}

/// Fill every page of `pieces` into process `pid` on `workers` workers;
/// returns the bytes written. Each worker takes a batch of pieces whose
/// stored pages fit in its window ([`pool::window_bytes`]), writes them
/// from the mapped store, then drops the store blocks it read from our
/// resident set ([`StoreReader::release`]): the restorer's RSS stays
/// bounded at any image size, the pages stay in the page cache.
pub fn fill(
    pid: i32,
    pages: &Pages<'_>,
    pieces: &[Piece],
    workers: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64, RestoreError> {
    /// Pieces one worker takes at a time (written with one process_vm_writev
    /// when their blocks are raw).
    const BATCH: usize = 256;
    let workers = workers.max(1);
    // At most BATCH pieces and a window's bytes of stored pages together.
    let batches = pool::groups(
        pieces.iter().map(|p| match p.src {
            Source::Store { .. } => p.pages as usize * PAGE,
            _ => 0,
        }),
        BATCH,
        pool::window_bytes(workers),
    );
    let next = AtomicUsize::new(0);
    let done = AtomicU64::new(0);
    let zero = vec![0u8; PAGE * 64];
    let workers = workers.min(batches.len().max(1));
    pool::run(workers, |stop| {
        let mut buf = Vec::new();
        // The compressed block decompressed in `buf`.
        let mut cached: Option<(usize, u32)> = None;
        // The store blocks this batch read through the map.
        let mut read: Vec<(usize, u32)> = Vec::new();
        while !stop.stopped() {
            crate::interrupt::check().map_err(RestoreError::Interrupted)?;
            let Some(batch) = batches.get(next.fetch_add(1, Ordering::Relaxed)) else {
                return Ok(());
            };
            let batch = &pieces[batch.clone()];
            let mut raw: Vec<(u64, &[u8])> = Vec::with_capacity(batch.len());
            let mut bytes = 0u64;
            for piece in batch {
                let len = piece.pages as usize * PAGE;
                bytes += len as u64;
                match piece.src {
                    Source::Store { link, loc } => {
                        let reader = pages.reader(link)?;
                        pages.ready(link, loc.block)?;
                        if read.last() != Some(&(link, loc.block)) {
                            read.push((link, loc.block));
                        }
                        let at = loc.page as usize * PAGE;
                        if reader.is_raw(loc.block) {
                            // Straight from the mapped store file.
                            raw.push((piece.vaddr, reader.raw_slice(loc.block, at, len)?));
                            continue;
                        }
                        let slice = unpacked(reader, link, piece, &mut buf, &mut cached)?;
                        write_vm(pid, piece.vaddr, slice)?;
                    }
                    Source::Zero => {
                        for chunk in (0..len).step_by(zero.len()) {
                            let n = (len - chunk).min(zero.len());
                            write_vm(pid, piece.vaddr + chunk as u64, &zero[..n])?;
                        }
                    }
                    Source::Parent => {
                        return Err(RestoreError::Unsupported(format!(
                            "pages at {:#x} were not resolved",
                            piece.vaddr
                        )))
                    }
                }
            }
            write_vm_many(pid, &raw)?;
            drop(raw);
            for (link, block) in read.drain(..) {
                pages.reader(link)?.release(block);
            }
            let d = done.fetch_add(bytes, Ordering::Relaxed) + bytes;
            progress(d);
        }
        Ok(())
    })?;
    Ok(done.into_inner())
}

/// Bytes `pieces` fill.
pub fn bytes(pieces: &[Piece]) -> u64 {
    pieces.iter().map(|p| p.pages as u64 * PAGE as u64).sum()
}

/// Final protections, madvise flags, memory locks and anonymous VMA names.
pub fn finish(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    filled: &[bool],
) -> Result<(), RestoreError> {
    const ADVICE: &[(&str, i32)] = &[
        ("dc", libc::MADV_DONTFORK),
        ("dd", libc::MADV_DONTDUMP),
        ("hg", libc::MADV_HUGEPAGE),
        ("nh", libc::MADV_NOHUGEPAGE),
        ("wf", libc::MADV_WIPEONFORK),
        ("mg", libc::MADV_MERGEABLE),
        // Read-ahead advice (VM_SEQ_READ, VM_RAND_READ).
        ("sr", libc::MADV_SEQUENTIAL),
        ("rr", libc::MADV_RANDOM),
    ];
    let stub = &mut cx.stub;
    for (v, &filled) in p.vmas.iter().zip(filled) {
        if v.kind.is_special() || matches!(v.kind, VmaKind::Aio | VmaKind::PacketRing) {
            continue;
        }
        let len = v.len();
        if filled && v.prot != (libc::PROT_READ | libc::PROT_WRITE) as u32 {
            stub.later(
                "mprotect",
                libc::SYS_mprotect,
                [v.start, len, v.prot as u64, 0, 0, 0],
                format!("cannot protect {:#x}-{:#x}", v.start, v.end),
            )?;
        }
        for (flag, advice) in ADVICE {
            if v.has_flag(flag) {
                stub.later(
                    "madvise",
                    libc::SYS_madvise,
                    [v.start, len, *advice as u64, 0, 0, 0],
                    format!("cannot madvise({flag}) {:#x}-{:#x}", v.start, v.end),
                )?;
            }
        }
        // Before the lock: the kernel refuses guards in a locked mapping.
        for &(a, b) in &v.guards {
            stub.later(
                "madvise",
                libc::SYS_madvise,
                [a, b - a, MADV_GUARD_INSTALL, 0, 0, 0],
                format!("cannot install the guard region {a:#x}-{b:#x}"),
            )?;
        }
        if v.has_flag("lo") {
            stub.later(
                "mlock",
                libc::SYS_mlock,
                [v.start, len, 0, 0, 0, 0],
                format!("cannot lock {:#x}-{:#x} in memory", v.start, v.end),
            )?;
        }
        if !v.anon_name.is_empty() {
            let name = stub.put_str(&v.anon_name)?;
            stub.later(
                "prctl(PR_SET_VMA)",
                libc::SYS_prctl,
                [PR_SET_VMA, PR_SET_VMA_ANON_NAME, v.start, len, name, 0],
                format!("cannot name {:#x}-{:#x}", v.start, v.end),
            )?;
        }
    }
    // The calls of one mapping run in order, the mappings one after the
    // other as before.
    stub.flush()?;
    Ok(())
}
