//! Memory of a restored process: map every saved VMA at its address, fill
//! the stored pages from the page stores of the image chain (raw blocks
//! straight from the mapped store file, compressed ones through a buffer;
//! every block's checksum verified first), then set the final protections,
//! madvise flags, memory locks and anonymous names.

use crate::error::{RestoreError, StepContext};
use crate::restore::{Ids, Stub};
use cr_image::chain::{Chain, Piece, Source};
use cr_image::proto;
use cr_image::store::{StoreReader, PAGE};
use cr_sys::mem::{write_vm, write_vm_many};
use proto::VmaKind;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

const PR_SET_VMA: u64 = 0x53564d41;
const PR_SET_VMA_ANON_NAME: u64 = 0;

fn kind(v: &proto::Vma) -> VmaKind {
    VmaKind::try_from(v.kind).unwrap_or(VmaKind::Unspecified)
}

/// Whether restore maps this VMA itself (the kernel's special mappings are moved, not mapped).
pub fn is_mapped_by_us(v: &proto::Vma) -> bool {
    !matches!(
        kind(v),
        VmaKind::Vdso | VmaKind::Vvar | VmaKind::VvarVclock | VmaKind::Vsyscall
    )
}

/// The page stores of an image chain, opened once for all processes.
pub struct Pages<'a> {
    chain: &'a Chain,
    readers: Vec<Option<StoreReader>>,
}

impl<'a> Pages<'a> {
    /// Open (and size-check) the store of every image of the chain.
    pub fn open(chain: &'a Chain) -> Result<Self, RestoreError> {
        let readers = chain
            .links
            .iter()
            .map(|l| match &l.ck.store {
                Some(s) => StoreReader::open(&l.dir, s).map(Some),
                None => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pages { chain, readers })
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
                    self.chain.links[link.min(self.chain.links.len() - 1)]
                        .dir
                        .path()
                        .display()
                ))
            })
    }
}

/// Which VMAs have pages to fill (they are mapped writable until filled).
fn vmas_with_pages(vmas: &[proto::Vma], pieces: &[Piece]) -> Vec<bool> {
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

/// Map every VMA (writable where pages must be filled).
pub fn map_all(
    stub: &mut Stub<'_>,
    p: &proto::Process,
    ids: &Ids,
    objects: &crate::objects::Objects,
    pieces: &[Piece],
) -> Result<Vec<bool>, RestoreError> {
    let fill = vmas_with_pages(&p.vmas, pieces);
    let mut files: HashMap<(String, bool), u64> = HashMap::new();
    let mut shm_fds = Vec::new();
    for (v, &fill) in p.vmas.iter().zip(&fill) {
        if !is_mapped_by_us(v) {
            continue;
        }
        let k = kind(v);
        let mut prot = v.prot as u64;
        if fill {
            prot |= libc::PROT_READ as u64 | libc::PROT_WRITE as u64;
        }
        let has = |f: &str| v.vm_flags.iter().any(|x| x == f);
        let mut flags = libc::MAP_FIXED_NOREPLACE as u64;
        flags |= if v.shared {
            libc::MAP_SHARED
        } else {
            libc::MAP_PRIVATE
        } as u64;
        if has("gd") {
            flags |= libc::MAP_GROWSDOWN as u64;
        }
        if has("nr") {
            flags |= libc::MAP_NORESERVE as u64;
        }
        let (fd, off) = match k {
            VmaKind::FilePrivate | VmaKind::FileShared => {
                // A shared mapping that may become writable needs a writable fd.
                let rw = k == VmaKind::FileShared && has("mw");
                // memfds and deleted files: the restorer's copy.
                let path = if v.object != 0 {
                    objects.map_path(v).ok_or_else(|| {
                        RestoreError::Unsupported(format!(
                            "mapping at {:#x} refers to object {} missing from the image",
                            v.start, v.object
                        ))
                    })?
                } else {
                    v.path.clone()
                };
                let fd = match files.get(&(path.clone(), rw)) {
                    Some(fd) => *fd,
                    None => {
                        let o = if rw { libc::O_RDWR } else { libc::O_RDONLY };
                        let fd = stub.open(&path, o | libc::O_CLOEXEC).step(|| {
                            format!("cannot open {} to map it at {:#x}", v.path, v.start)
                        })?;
                        files.insert((path.clone(), rw), fd);
                        fd
                    }
                };
                (fd, v.pgoff)
            }
            // Shared memory of an earlier process: map that very object.
            VmaKind::AnonShared if v.shm_owner_pid != 0 => {
                let path = format!(
                    "/proc/{}/map_files/{:x}-{:x}",
                    ids.outer(v.shm_owner_pid),
                    v.shm_owner_start,
                    v.shm_owner_end
                );
                let fd = stub.open(&path, libc::O_RDWR | libc::O_CLOEXEC).step(|| {
                    format!(
                        "cannot open the shared memory of process {} ({path})",
                        v.shm_owner_pid
                    )
                })?;
                shm_fds.push(fd);
                (fd, v.pgoff)
            }
            _ => {
                flags |= libc::MAP_ANONYMOUS as u64;
                (u64::MAX, 0)
            }
        };
        let got = stub
            .call(
                "mmap",
                libc::SYS_mmap,
                [v.start, v.end - v.start, prot, flags, fd, off],
            )
            .step(|| format!("cannot map {:#x}-{:#x} {}", v.start, v.end, v.path))?;
        if got != v.start {
            return Err(RestoreError::Unsupported(format!(
                "mapping {:#x}-{:#x} landed at {got:#x}",
                v.start, v.end
            )));
        }
    }
    for fd in files.into_values().chain(shm_fds) {
        stub.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    }
    Ok(fill)
}

/// Fill every page of `pieces` into process `pid` with `workers` threads;
/// returns the bytes written.
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
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let first_error: Mutex<Option<RestoreError>> = Mutex::new(None);
    let zero = vec![0u8; PAGE * 64];
    let workers = workers
        .clamp(1, 64)
        .min(pieces.len().div_ceil(BATCH).max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut buf = Vec::new();
                // The compressed block decompressed in `buf`.
                let mut cached: Option<(usize, u32)> = None;
                let r = (|| -> Result<(), RestoreError> {
                    while !failed.load(Ordering::Relaxed) {
                        let start = next.fetch_add(BATCH, Ordering::Relaxed);
                        let Some(batch) = pieces.get(start..(start + BATCH).min(pieces.len()))
                        else {
                            return Ok(());
                        };
                        if batch.is_empty() {
                            return Ok(());
                        }
                        let mut raw: Vec<(u64, &[u8])> = Vec::with_capacity(batch.len());
                        let mut bytes = 0u64;
                        for piece in batch {
                            let len = piece.pages as usize * PAGE;
                            bytes += len as u64;
                            match piece.src {
                                Source::Store { link, loc } => {
                                    let reader = pages.reader(link)?;
                                    let at = loc.page as usize * PAGE;
                                    if reader.is_raw(loc.block) {
                                        // Straight from the mapped store file.
                                        raw.push((
                                            piece.vaddr,
                                            reader.raw_slice(loc.block, at, len)?,
                                        ));
                                        continue;
                                    }
                                    if cached != Some((link, loc.block)) {
                                        cached = None;
                                        reader.block(loc.block, &mut buf)?;
                                        cached = Some((link, loc.block));
                                    }
                                    let slice = buf.get(at..at + len).ok_or_else(|| {
                                        cr_image::ImageError::Invalid {
                                            path: reader.path().into(),
                                            what: format!(
                                                "pages of {:#x} lie beyond the end of block {}",
                                                piece.vaddr, loc.block
                                            ),
                                        }
                                    })?;
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
                        let d = done.fetch_add(bytes, Ordering::Relaxed) + bytes;
                        progress(d);
                    }
                    Ok(())
                })();
                if let Err(e) = r {
                    failed.store(true, Ordering::Relaxed);
                    first_error.lock().expect("error slot").get_or_insert(e);
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().expect("error slot") {
        return Err(e);
    }
    Ok(done.into_inner())
}

/// Bytes `pieces` fill.
pub fn bytes(pieces: &[Piece]) -> u64 {
    pieces.iter().map(|p| p.pages as u64 * PAGE as u64).sum()
}

/// Final protections, madvise flags and anonymous VMA names.
pub fn finish(
    stub: &mut Stub<'_>,
    p: &proto::Process,
    filled: &[bool],
) -> Result<(), RestoreError> {
    const ADVICE: &[(&str, i32)] = &[
        ("dc", libc::MADV_DONTFORK),
        ("dd", libc::MADV_DONTDUMP),
        ("hg", libc::MADV_HUGEPAGE),
        ("nh", libc::MADV_NOHUGEPAGE),
        ("wf", libc::MADV_WIPEONFORK),
        ("mg", libc::MADV_MERGEABLE),
    ];
    for (v, &filled) in p.vmas.iter().zip(filled) {
        if !is_mapped_by_us(v) {
            continue;
        }
        let len = v.end - v.start;
        if filled && v.prot != (libc::PROT_READ | libc::PROT_WRITE) as u32 {
            stub.call(
                "mprotect",
                libc::SYS_mprotect,
                [v.start, len, v.prot as u64, 0, 0, 0],
            )
            .step(|| format!("cannot protect {:#x}-{:#x}", v.start, v.end))?;
        }
        for (flag, advice) in ADVICE {
            if v.vm_flags.iter().any(|f| f == flag) {
                stub.call(
                    "madvise",
                    libc::SYS_madvise,
                    [v.start, len, *advice as u64, 0, 0, 0],
                )
                .step(|| format!("cannot madvise({flag}) {:#x}-{:#x}", v.start, v.end))?;
            }
        }
        if v.vm_flags.iter().any(|f| f == "lo") {
            stub.call("mlock", libc::SYS_mlock, [v.start, len, 0, 0, 0, 0])
                .step(|| format!("cannot lock {:#x}-{:#x} in memory", v.start, v.end))?;
        }
        if !v.anon_name.is_empty() {
            let name = stub.put_str(&v.anon_name)?;
            stub.call(
                "prctl(PR_SET_VMA)",
                libc::SYS_prctl,
                [PR_SET_VMA, PR_SET_VMA_ANON_NAME, v.start, len, name, 0],
            )
            .step(|| format!("cannot name {:#x}-{:#x}", v.start, v.end))?;
        }
    }
    Ok(())
}
