//! Memory of a restored process: map every saved VMA at its address, fill
//! the stored pages from the page file, then set the final protections,
//! madvise flags, memory locks and anonymous names.

use crate::error::{RestoreError, StepContext};
use crate::restore::{Ids, Stub};
use cr_image::{proto, ImageDir, PageReader};
use cr_sys::mem::write_vm;
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

/// Which VMAs have stored pages (they are mapped writable until filled).
fn vmas_with_pages(vmas: &[proto::Vma], extents: &[proto::PageExtent]) -> Vec<bool> {
    let mut has = vec![false; vmas.len()];
    for e in extents {
        let end = e.vaddr + e.nr_pages as u64 * 4096;
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
) -> Result<Vec<bool>, RestoreError> {
    let extents = p
        .pages
        .as_ref()
        .map(|pf| pf.extents.as_slice())
        .unwrap_or(&[]);
    let fill = vmas_with_pages(&p.vmas, extents);
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

/// Fill stored pages from the page file with `workers` threads, checking
/// every run's checksum.
pub fn fill(
    pid: i32,
    dir: &ImageDir,
    pf: &proto::PageFile,
    workers: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64, RestoreError> {
    let reader = PageReader::open(dir, pf)?;
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let first_error: Mutex<Option<RestoreError>> = Mutex::new(None);
    let workers = workers.clamp(1, 64).min(pf.extents.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                let mut buf = Vec::new();
                let r = (|| -> Result<(), RestoreError> {
                    while !failed.load(Ordering::Relaxed) {
                        let Some(e) = pf.extents.get(next.fetch_add(1, Ordering::Relaxed)) else {
                            return Ok(());
                        };
                        reader.read_extent(e, &mut buf)?;
                        write_vm(pid, e.vaddr, &buf)?;
                        let d =
                            done.fetch_add(buf.len() as u64, Ordering::Relaxed) + buf.len() as u64;
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
