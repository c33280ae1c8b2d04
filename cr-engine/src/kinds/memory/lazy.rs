//! Post-copy ("lazy") restore of private anonymous memory.
//!
//! With `--lazy-pages` the private anonymous mappings of a process
//! (anonymous and heap; not memory-locked ones, nor the main stack, see
//! [`is_lazy`]) are mapped but left
//! empty: a userfaultfd is created *inside* the process (injected system
//! calls: one home, [`super::tracking::new_remote`]), registered in missing
//! mode on them, taken by the restorer (`pidfd_getfd`) and closed in the
//! process, so that the restored fd table is the image's. A server thread
//! of the restorer ([`serve`]) then puts each page in on first touch
//! (`UFFDIO_COPY` of the pages around the fault; a page the image does not
//! hold becomes a zero page) and pushes every other page in the
//! background, from the image's page stores. It starts at once (the rest
//! of the restore may touch that memory: such a touch is served like any
//! fault). Once every page is in, the userfaultfd is closed: the kernel
//! unregisters the mappings and the process runs on by itself.
//!
//! The non-cooperative events keep the served pages right: a range the
//! program drops (madvise DONTNEED, munmap) is never filled again, a
//! moved one (mremap) is served at its new address, and a child forked in
//! the meantime gets its own userfaultfd, served from what its parent
//! still missed at the fork.
//!
//! If a page cannot be put in (the store cannot be read, a block fails its
//! checksum, or the transfer is aborted), the process cannot continue: it
//! is killed before the userfaultfd is closed (closing it first would let
//! it read zeros where its data was) and the image is left intact.

use super::fill::Pages;
use super::remote::RemoteStores;
use crate::error::{RestoreError, StepContext};
use crate::restore::Rebuild;
use cr_image::chain::{Chain, Piece, Source};
use cr_image::model::{Mm, Vma, VmaKind};
use cr_image::store::{Loc, PAGE};
use cr_sys::uffd::{self, Event, Fill};
use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;
use tracing::{debug, info, warn};

/// Pages put in around a fault (the fault's page first).
const FAULT_PAGES: u32 = 16;
/// Pages of one background copy.
const PUSH_PAGES: u32 = 256;
/// Longest wait for a fault while no missing page is here to push.
const ARRIVAL_WAIT_MS: i32 = 2;
/// `CR_FAULT_INJECT` stage: the server fails at its first background copy
/// after the process was released (runs).
pub const FAULT_STAGE: &str = "lazy-transfer";

/// Whether the pages of `v` (of a process whose mm is `mm`) may be put in
/// after the process runs. Not the main stack, nor a mapping holding the
/// command line or the environment: the kernel reads those for
/// /proc/PID/cmdline and environ without waiting for a userfaultfd (such
/// a remote read of a missing page fails: `ps` would show nothing).
pub fn is_lazy(v: &Vma, mm: &Mm) -> bool {
    let holds = |a: u64| v.start <= a && a < v.end;
    matches!(v.kind, VmaKind::AnonPrivate | VmaKind::Heap)
        && !v.shared
        && !v.has_flag("lo")
        && !holds(mm.arg_start)
        && !holds(mm.env_start)
}

/// `p` restricted to `[from, to)` (inside it, page aligned).
fn sub(p: &Piece, from: u64, to: u64) -> Piece {
    let skip = ((from - p.vaddr) / PAGE as u64) as u32;
    let src = match p.src {
        Source::Store { link, loc } => Source::Store {
            link,
            loc: Loc {
                block: loc.block,
                page: loc.page + skip,
            },
        },
        s => s,
    };
    Piece {
        vaddr: from,
        pages: ((to - from) / PAGE as u64) as u32,
        src,
    }
}

fn end(p: &Piece) -> u64 {
    p.vaddr + p.pages as u64 * PAGE as u64
}

/// `pieces` (sorted) split into those outside `ranges` (sorted, disjoint)
/// and those inside.
pub fn split(pieces: &[Piece], ranges: &[(u64, u64)]) -> (Vec<Piece>, Vec<Piece>) {
    let (mut now, mut later) = (Vec::new(), Vec::new());
    for p in pieces {
        let (s, e) = (p.vaddr, end(p));
        let mut at = s;
        let first = ranges.partition_point(|r| r.1 <= s);
        for &(a, b) in ranges[first..].iter().take_while(|r| r.0 < e) {
            if a > at {
                now.push(sub(p, at, a));
            }
            let (from, to) = (a.max(at), b.min(e));
            later.push(sub(p, from, to));
            at = to;
        }
        if at < e {
            now.push(sub(p, at, e));
        }
    }
    (now, later)
}

/// The pages one userfaultfd still misses, by address.
#[derive(Clone, Default)]
struct Missing(BTreeMap<u64, Piece>);

impl Missing {
    /// Take out up to `max` pages of the piece holding `addr`, from `addr`.
    fn take_at(&mut self, addr: u64, max: u32) -> Option<Piece> {
        let (&k, p) = self.0.range(..=addr).next_back()?;
        let p = *p;
        if end(&p) <= addr {
            return None;
        }
        self.0.remove(&k);
        let to = end(&p).min(addr + max as u64 * PAGE as u64);
        self.put_back(&sub(&p, p.vaddr, addr));
        self.put_back(&sub(&p, to, end(&p)));
        Some(sub(&p, addr, to))
    }

    /// Take out up to `max` pages from the lowest address missing.
    #[cfg(test)]
    fn take_first(&mut self, max: u32) -> Option<Piece> {
        self.take_first_ready(max, |_| true)
    }

    /// Take out up to `max` pages from the lowest address missing whose
    /// piece `ready` accepts (its block is in, for a store that arrives
    /// from another node).
    fn take_first_ready(
        &mut self,
        max: u32,
        mut ready: impl FnMut(&Piece) -> bool,
    ) -> Option<Piece> {
        let addr = self.0.values().find(|p| ready(p))?.vaddr;
        self.take_at(addr, max)
    }

    fn put_back(&mut self, p: &Piece) {
        if p.pages > 0 {
            self.0.insert(p.vaddr, *p);
        }
    }

    /// Take out every page of `[start, stop)`.
    fn cut(&mut self, start: u64, stop: u64) -> Vec<Piece> {
        let keys: Vec<u64> = self
            .0
            .range(..stop)
            .rev()
            .take_while(|(_, p)| end(p) > start)
            .map(|(k, _)| *k)
            .collect();
        let mut out = Vec::new();
        for k in keys {
            let p = self.0.remove(&k).expect("listed");
            let (s, e) = (p.vaddr.max(start), end(&p).min(stop));
            self.put_back(&sub(&p, p.vaddr, s));
            self.put_back(&sub(&p, e, end(&p)));
            out.push(sub(&p, s, e));
        }
        out
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One userfaultfd served: the restored process's, or a child's forked
/// during the transfer.
struct Served {
    fd: OwnedFd,
    missing: Missing,
    /// A fault whose page could not be put in yet (`EAGAIN`).
    retry: Vec<u64>,
}

/// What a transfer did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub faults: u64,
    pub pushed_bytes: u64,
    pub ms: u64,
}

/// The post-copy transfers of one restore, one per process, running.
#[derive(Default)]
pub struct Transfer {
    abort: Arc<AtomicBool>,
    servers: Vec<(i32, JoinHandle<Result<Stats, RestoreError>>)>,
}

impl Transfer {
    /// Whether there is nothing to wait for.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// Wait until every page of every process is in (or a process ended);
    /// the first failure (its process was killed).
    pub fn wait(mut self) -> Result<Stats, RestoreError> {
        let mut total = Stats::default();
        let mut first = None;
        for (pid, h) in self.servers.drain(..) {
            match h.join() {
                Ok(Ok(s)) => {
                    total.faults += s.faults;
                    total.pushed_bytes += s.pushed_bytes;
                    total.ms = total.ms.max(s.ms);
                }
                Ok(Err(e)) => {
                    first.get_or_insert(e);
                }
                Err(_) => {
                    first.get_or_insert(RestoreError::LazyPages {
                        pid,
                        why: "its page server panicked".into(),
                    });
                }
            }
        }
        first.map_or(Ok(total), Err)
    }

    /// Stop every transfer: each process not complete yet is killed.
    pub fn abort(self) -> Result<Stats, RestoreError> {
        self.abort.store(true, Ordering::Relaxed);
        self.wait()
    }
}

impl Drop for Transfer {
    /// A transfer dropped unfinished ends like an aborted one: a process
    /// must never run on with pages missing and nobody to serve them.
    fn drop(&mut self) {
        if !self.servers.is_empty() {
            self.abort.store(true, Ordering::Relaxed);
            for (_, h) in self.servers.drain(..) {
                let _ = h.join();
            }
        }
    }
}

/// Register the lazy mappings of the process being rebuilt (`ranges`,
/// sorted) on a userfaultfd created in it, take that fd and start serving
/// `pieces` (the stored pages of those ranges) at once.
pub fn start(
    cx: &mut Rebuild<'_, '_, '_>,
    ranges: &[(u64, u64)],
    pieces: Vec<Piece>,
) -> Result<(), RestoreError> {
    let pid = cx.stub.pid();
    let scratch = cx.stub.scratch;
    let fd = super::tracking::new_remote(&mut cx.stub.inj, scratch, 0, uffd::LAZY_FEATURES)
        .step(|| format!("cannot create a userfaultfd in process {pid} for --lazy-pages"))?;
    for &(a, e) in ranges {
        let reg = [a, e - a, uffd::UFFDIO_REGISTER_MODE_MISSING, 0];
        cr_sys::mem::write_vm(pid, scratch, &super::tracking::words(&reg))?;
        cx.stub
            .call(
                "ioctl(UFFDIO_REGISTER)",
                libc::SYS_ioctl,
                [fd as u64, uffd::UFFDIO_REGISTER, scratch, 0, 0, 0],
            )
            .step(|| format!("cannot register {a:#x}-{e:#x} for post-copy"))?;
    }
    let ours = cr_sys::fdio::steal_fd(pid, fd)?;
    cx.stub
        .call("close", libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0])?;
    let dir: PathBuf = cx.r.img.path().to_path_buf();
    let remote = cx.r.opts.remote_pages.clone();
    let bytes: u64 = pieces.iter().map(|p| p.pages as u64 * PAGE as u64).sum();
    let transfer = cx.r.stash.get::<Transfer>();
    let abort = transfer.abort.clone();
    debug!(pid, ranges = ranges.len(), bytes, "post-copy server starts");
    let h = std::thread::Builder::new()
        .name(format!("cr-lazy-{pid}"))
        .spawn(move || serve(pid, ours, dir, remote, pieces, &abort))
        .map_err(|e| RestoreError::LazyPages {
            pid,
            why: format!("cannot start its page server: {e}"),
        })?;
    transfer.servers.push((pid, h));
    Ok(())
}

/// Serve process `pid` through `fd` until every page of `pieces` is in (see
/// the module doc); on failure the process is killed first.
fn serve(
    pid: i32,
    fd: OwnedFd,
    dir: PathBuf,
    remote: Option<Arc<dyn RemoteStores>>,
    pieces: Vec<Piece>,
    abort: &AtomicBool,
) -> Result<Stats, RestoreError> {
    let t0 = Instant::now();
    let mut served = vec![Served {
        fd,
        missing: Missing(
            pieces
                .into_iter()
                .filter(|p| p.src != Source::Zero)
                .map(|p| (p.vaddr, p))
                .collect(),
        ),
        retry: Vec::new(),
    }];
    let mut stats = Stats::default();
    let r = (|| -> Result<(), RestoreError> {
        let chain = Chain::open(&dir)?;
        let pages = Pages::open(&chain, remote.as_ref())?;
        let mut io = Io {
            pages: &pages,
            buf: Vec::new(),
            cached: None,
        };
        run(pid, &mut served, &mut io, &mut stats, abort)
    })();
    stats.ms = t0.elapsed().as_millis() as u64;
    match r {
        Ok(()) => {
            info!(
                pid,
                faults = stats.faults,
                pushed_mib = stats.pushed_bytes >> 20,
                ms = stats.ms,
                "post-copy complete: every page is in"
            );
            Ok(stats)
        }
        Err(e) => {
            // Before the userfaultfds close: no thread may read zeros.
            // Children forked during the transfer had their missing pages
            // served by us too: they go as well.
            if served.len() > 1 {
                kill_descendants(pid);
            }
            let _ = cr_sys::ptrace::kill(pid, libc::SIGKILL);
            let why = cr_sys::error::one_line(&e);
            warn!(pid, "post-copy failed, process killed: {why}");
            Err(RestoreError::LazyPages { pid, why })
        }
    }
}

/// Reading pages from the image.
struct Io<'p> {
    pages: &'p Pages<'p>,
    buf: Vec<u8>,
    cached: Option<(usize, u32)>,
}

fn run(
    pid: i32,
    served: &mut Vec<Served>,
    io: &mut Io<'_>,
    stats: &mut Stats,
    abort: &AtomicBool,
) -> Result<(), RestoreError> {
    let mut events = Vec::new();
    // The test's fault fires at the first background copy after the
    // release; until then (and only then) nothing is pushed, so that a
    // fast restore cannot finish the transfer before it.
    let inject = crate::fault::armed(FAULT_STAGE);
    loop {
        if abort.load(Ordering::Relaxed) {
            return Err(RestoreError::Interrupted("an abort of the transfer"));
        }
        crate::interrupt::check().map_err(RestoreError::Interrupted)?;
        let mut forks = Vec::new();
        for s in served.iter_mut() {
            uffd::read_events(s.fd.as_fd(), &mut events)?;
            let mut faults = std::mem::take(&mut s.retry);
            for ev in events.drain(..) {
                match ev {
                    Event::PageFault { addr } => faults.push(addr & !(PAGE as u64 - 1)),
                    Event::Fork { fd } => forks.push(Served {
                        fd,
                        missing: s.missing.clone(),
                        retry: Vec::new(),
                    }),
                    Event::Remap { from, to, len } => {
                        for p in s.missing.cut(from, from + len) {
                            let moved = Piece {
                                vaddr: p.vaddr - from + to,
                                ..p
                            };
                            s.missing.put_back(&moved);
                        }
                    }
                    Event::Remove { start, end } => {
                        s.missing.cut(start, end);
                    }
                    Event::Other(k) => debug!(kind = k, "userfaultfd message ignored"),
                }
            }
            for addr in faults {
                stats.faults += 1;
                fault(s, io, addr)?;
            }
        }
        served.extend(forks);
        // Gone processes (and finished children) need nothing more.
        let Some(s) = served.iter_mut().find(|s| !s.missing.is_empty()) else {
            return Ok(());
        };
        if inject {
            if released(pid) {
                crate::fault::check_restore(FAULT_STAGE)?;
            }
            let fds: Vec<_> = served.iter().map(|s| s.fd.as_fd()).collect();
            uffd::wait(&fds, ARRIVAL_WAIT_MS)?;
            continue;
        }
        // The background push takes what is here (a store arriving from
        // another node comes in its own order); with nothing to push, wait
        // a moment for a fault.
        let pages = io.pages;
        let mut lost = None;
        let ready = s.missing.take_first_ready(PUSH_PAGES, |p| match p.src {
            Source::Store { link, loc } => pages.has(link, loc.block).unwrap_or_else(|e| {
                lost.get_or_insert(e);
                false
            }),
            _ => true,
        });
        if let Some(e) = lost {
            return Err(e);
        }
        let Some(p) = ready else {
            let fds: Vec<_> = served.iter().map(|s| s.fd.as_fd()).collect();
            uffd::wait(&fds, ARRIVAL_WAIT_MS)?;
            continue;
        };
        stats.pushed_bytes += put(s, io, &p)?;
    }
}

/// SIGKILL every descendant of `pid` (depth first, children before
/// their parent's kill lets them be reparented).
fn kill_descendants(pid: i32) {
    for k in cr_sys::proc::children(pid).unwrap_or_default() {
        kill_descendants(k);
        let _ = cr_sys::ptrace::kill(k, libc::SIGKILL);
    }
}

/// Whether process `pid` was let go by the restorer (has no tracer).
fn released(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
        s.lines().any(|l| {
            l.split_once(':')
                .is_some_and(|(k, v)| k == "TracerPid" && v.trim() == "0")
        })
    })
}

/// Serve a fault at page `addr`.
fn fault(s: &mut Served, io: &mut Io<'_>, addr: u64) -> Result<(), RestoreError> {
    match s.missing.take_at(addr, FAULT_PAGES) {
        Some(p) => {
            put(s, io, &p)?;
        }
        None => match uffd::zeropage(s.fd.as_fd(), addr, PAGE as u64)? {
            Fill::Done | Fill::Gone => {}
            Fill::Exists(_) => uffd::wake(s.fd.as_fd(), addr, PAGE as u64)?,
            Fill::Again(_) => s.retry.push(addr),
        },
    }
    Ok(())
}

/// Put piece `p` in; what does not go in now (an event is unread) goes back
/// to the missing pages. Returns the bytes put in.
fn put(s: &mut Served, io: &mut Io<'_>, p: &Piece) -> Result<u64, RestoreError> {
    let Some(bytes) = io.pages.bytes(p, &mut io.buf, &mut io.cached)? else {
        return Ok(0);
    };
    let len = bytes.len() as u64;
    let mut off = 0u64;
    while off < len {
        let dst = p.vaddr + off;
        match uffd::copy(s.fd.as_fd(), dst, &bytes[off as usize..])? {
            Fill::Done => off = len,
            Fill::Exists(n) => {
                // That page is there already; someone may wait for it.
                let page = dst + n;
                uffd::wake(s.fd.as_fd(), page, PAGE as u64)?;
                off += n + PAGE as u64;
            }
            Fill::Again(n) => {
                off += n;
                s.missing.put_back(&sub(p, p.vaddr + off, end(p)));
                return Ok(off);
            }
            Fill::Gone => {
                // The process ended: nothing more to serve it.
                s.missing = Missing::default();
                return Ok(off);
            }
        }
    }
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(vaddr: u64, pages: u32, page: u32) -> Piece {
        Piece {
            vaddr,
            pages,
            src: Source::Store {
                link: 0,
                loc: Loc { block: 1, page },
            },
        }
    }
    const P: u64 = PAGE as u64;

    #[test]
    fn split_cuts_pieces_at_range_edges_and_keeps_their_store_offsets() {
        let pieces = [piece(0, 10, 0), piece(20 * P, 4, 10)];
        let (now, later) = split(&pieces, &[(2 * P, 5 * P), (8 * P, 22 * P)]);
        let show = |v: &[Piece]| {
            v.iter()
                .map(|p| match p.src {
                    Source::Store { loc, .. } => (p.vaddr / P, p.pages, loc.page),
                    _ => (p.vaddr / P, p.pages, u32::MAX),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(show(&now), [(0, 2, 0), (5, 3, 5), (22, 2, 12)]);
        assert_eq!(show(&later), [(2, 3, 2), (8, 2, 8), (20, 2, 10)]);
    }

    #[test]
    fn missing_takes_faults_cuts_removed_ranges_and_empties() {
        let mut m = Missing::default();
        m.put_back(&piece(0, 100, 0));
        let f = m.take_at(50 * P, FAULT_PAGES).expect("a piece");
        assert_eq!((f.vaddr, f.pages), (50 * P, FAULT_PAGES));
        assert!(m.take_at(55 * P, 1).is_none(), "taken already");
        let cut = m.cut(10 * P, 60 * P);
        assert_eq!(cut.iter().map(|p| p.pages).sum::<u32>(), 40);
        let mut left = 0;
        while let Some(p) = m.take_first(PUSH_PAGES) {
            left += p.pages;
        }
        assert_eq!(left, 100 - FAULT_PAGES - 40);
        assert!(m.is_empty());
    }
}
