//! Dirty-page tracking of a live process between two checkpoints.
//!
//! A checkpoint that keeps the process running can leave tracking on
//! (`--track-mem`, implied by `--pre-dump`), so that the next checkpoint
//! made with `--parent` reads only the pages written since:
//!
//! - **uffd-wp**: a userfaultfd created inside the process by injected
//!   syscalls, kept there at a high fd number with close-on-exec, registered
//!   over its private anonymous VMAs (see `cr_sys::dirty`). The fd is never
//!   saved in an image, and a restored process does not have it.
//! - **soft-dirty**: `clear_refs` at each checkpoint.
//!
//! Which checkpoint last reset a process's tracker is kept in a small state
//! file (`$CR_STATE_DIR`, default `/run/cr/tracking` for root), keyed by pid
//! and start time. It is removed before the tracker is reset and written
//! again only once the image is committed, so a failed checkpoint, or a
//! checkpoint of another chain, makes the next one fall back to comparing
//! page hashes: slower, never wrong.

use super::dump::Dirty;
use crate::options::DirtyChoice as Choice;
use crate::pidstate::PidState;
use crate::probe::Probe;
use crate::CheckpointError;
use cr_image::model::{DirtyMethod, Vma};
use cr_sys::dirty as kd;
use cr_sys::mem;
use cr_sys::proc::{self, MapEntry};
use tracing::{debug, warn};

/// The method to use, refusing one the kernel lacks.
pub fn method(choice: Choice) -> Result<DirtyMethod, CheckpointError> {
    let lacks = |what: &str| CheckpointError::KernelLacks(what.to_string());
    match choice {
        Choice::Auto if kd::uffd_wp_async_supported() => Ok(DirtyMethod::UffdWp),
        Choice::Auto if kd::soft_dirty_supported() => Ok(DirtyMethod::SoftDirty),
        Choice::Auto | Choice::Hash => Ok(DirtyMethod::Hash),
        Choice::Uffd if kd::uffd_wp_async_supported() => Ok(DirtyMethod::UffdWp),
        Choice::Uffd => Err(lacks(
            "userfaultfd WP_ASYNC with PAGEMAP_SCAN (Linux 6.7 or later) for --dirty uffd",
        )),
        Choice::SoftDirty if kd::soft_dirty_supported() => Ok(DirtyMethod::SoftDirty),
        Choice::SoftDirty => Err(lacks(
            "soft-dirty bits (CONFIG_MEM_SOFT_DIRTY) for --dirty soft-dirty",
        )),
    }
}

/// The tracker of a process as the state file records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State {
    pub method: DirtyMethod,
    /// The userfaultfd in the process (uffd-wp only).
    pub fd: i32,
    /// Id of the image whose checkpoint last reset the tracker.
    pub epoch: String,
}

/// The state files of the trackers.
const STATE: PidState = PidState("tracking");

fn load(pid: i32) -> Option<State> {
    let text = STATE.read(pid)?;
    let mut it = text.split_whitespace();
    let method = match it.next()? {
        "uffd-wp" => DirtyMethod::UffdWp,
        "soft-dirty" => DirtyMethod::SoftDirty,
        _ => return None,
    };
    Some(State {
        method,
        fd: it.next()?.parse().ok()?,
        epoch: it.next()?.to_string(),
    })
}

fn forget(pid: i32) {
    STATE.forget(pid);
}

/// Record that the checkpoint of image `epoch` reset the tracker of `pid`.
pub fn save(pid: i32, method: DirtyMethod, fd: i32, epoch: &str) {
    let name = method.name();
    if let Err(e) = STATE.write(pid, &format!("{name} {fd} {epoch}\n")) {
        warn!(pid, error = %e, "cannot record dirty tracking state; the next incremental checkpoint will compare page hashes");
    }
}

/// A userfaultfd tracker of ours among the fds of `pid`.
fn find_tracker_fd(pid: i32) -> Option<i32> {
    proc::fds(pid)
        .ok()?
        .into_iter()
        .find(|(fd, t)| {
            matches!(t, proc::FDTarget::AnonInode(k) if k == "[userfaultfd]")
                && kd::is_tracker_fd(pid, *fd)
        })
        .map(|(fd, _)| fd)
}

/// Private anonymous VMAs (uffd-wp can track them).
fn trackable(v: &Vma, m: &MapEntry) -> bool {
    v.kind.is_anon_private() && !["ht", "io", "pf"].iter().any(|f| m.has_flag(f))
}

/// Adjacent ranges of the VMAs selected by `pick`, merged.
fn ranges(maps: &[MapEntry], mut pick: impl FnMut(usize, &MapEntry) -> bool) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for (i, m) in maps.iter().enumerate() {
        if !pick(i, m) {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.1 == m.start => last.1 = m.end,
            _ => out.push((m.start, m.end)),
        }
    }
    out
}

/// The outcome of [`begin`] for one process.
pub struct Begun {
    /// Which pages changed since the parent, as far as the tracker knows.
    pub dirty: Dirty,
    /// How unchanged pages are found in this dump.
    pub used: DirtyMethod,
    /// Tracking left on for the next checkpoint (saved after commit).
    pub kept: Option<(DirtyMethod, i32)>,
    /// Soft-dirty bits must be cleared once the pages are planned.
    pub clear_soft_dirty: bool,
    /// A tracker no longer wanted, closed in the process but still held
    /// here: drop it once the process runs again (the kernel removes the
    /// write protection from every page when the last reference goes,
    /// which takes ~100 ms per 4 GiB and must not lengthen the freeze).
    pub released: Option<Released>,
}

/// A tracker no longer wanted (our copy of its fd), and the ranges it had
/// registered. Dropped once the process runs again: the registration is
/// removed [`RELEASE_CHUNK`] bytes at a time from here, then the fd closed.
/// The kernel removes the write protection from every page it leaves
/// (~40 ms per GiB) holding the process's mmap lock: all at once, as the
/// last close does it, the process's page faults would wait for all of it.
pub struct Released {
    pub fd: std::os::fd::OwnedFd,
    pub ranges: Vec<(u64, u64)>,
}

/// Bytes of a tracker's registration removed at a time (~2.5 ms here).
const RELEASE_CHUNK: u64 = 64 << 20;

impl Drop for Released {
    fn drop(&mut self) {
        use std::os::fd::AsFd;
        let t = std::time::Instant::now();
        let mut chunks = 0;
        'ranges: for &(a, e) in &self.ranges {
            let mut at = a;
            while at < e {
                let next = e.min(at + RELEASE_CHUNK);
                if let Err(err) = kd::unregister(self.fd.as_fd(), at, next) {
                    // The process changed its mappings since, or is gone:
                    // the close removes what is left.
                    debug!(error = %cr_sys::error::one_line(&err), "tracker released by its close");
                    break 'ranges;
                }
                chunks += 1;
                at = next;
            }
        }
        debug!(
            chunks,
            us = t.elapsed().as_micros() as u64,
            "tracker's registration removed"
        );
    }
}

/// For the frozen process of `probe`: the pages written since the image
/// `parent_id` (if the tracker has known them since then), and tracking
/// set up again for the next checkpoint when `keep`. `maps` are its smaps
/// entries and `vmas` their classification (same order).
pub fn begin(
    probe: &mut Probe<'_>,
    maps: &[MapEntry],
    vmas: &[Vma],
    parent_id: Option<&str>,
    method: DirtyMethod,
    keep: bool,
) -> Result<Begun, CheckpointError> {
    let pid = probe.pid();
    let sys = |e| CheckpointError::from_sys(pid, e);
    let st = load(pid);
    // From here on the tracker may be reset: until this checkpoint is
    // committed, nothing vouches for it.
    forget(pid);
    let live_fd = match &st {
        Some(s) if s.method == DirtyMethod::UffdWp && kd::is_tracker_fd(pid, s.fd) => Some(s.fd),
        _ => find_tracker_fd(pid),
    };
    let current = st.as_ref().filter(|s| parent_id == Some(s.epoch.as_str()));
    let registered = |m: &MapEntry| m.has_flag("uw");
    let mut b = Begun {
        dirty: Dirty::Unknown,
        used: if parent_id.is_some() {
            DirtyMethod::Hash
        } else {
            DirtyMethod::Full
        },
        kept: None,
        clear_soft_dirty: false,
        released: None,
    };
    let pagemap = || -> cr_sys::error::Result<std::fs::File> {
        let path = format!("/proc/{pid}/pagemap");
        std::fs::File::open(&path).map_err(|source| cr_sys::SysError::Io { path, source })
    };
    let mut scanned = false;
    match current {
        Some(s) if method == DirtyMethod::UffdWp && s.method == method && live_fd == Some(s.fd) => {
            let tracked = ranges(maps, |_, m| registered(m));
            let pm = pagemap().map_err(sys)?;
            let mut written = Vec::new();
            let mut lost = None;
            for &(a, e) in &tracked {
                match kd::scan_written_and_reset(&pm, pid, a, e, &mut written) {
                    Ok(()) => {}
                    // A range no longer registered: its `uw` came from
                    // smaps read before the freeze (`memory::flags`), and
                    // the program has since replaced the mapping by one of
                    // the same line. The tracker cannot vouch for it.
                    Err(err) if err.errno() == Some(libc::EPERM) => {
                        lost = Some((a, e));
                        break;
                    }
                    Err(err) => return Err(sys(err)),
                }
            }
            match lost {
                None => {
                    debug!(
                        pid,
                        tracked = tracked.len(),
                        written = written.len(),
                        "uffd-wp dirty ranges"
                    );
                    b.dirty = Dirty::Uffd { tracked, written };
                    b.used = method;
                    scanned = true;
                }
                Some((a, e)) => warn!(
                    pid,
                    start = a,
                    end = e,
                    "a range of the dirty tracker is no longer registered (mapping replaced); pages are compared by hash"
                ),
            }
        }
        Some(s) if method == DirtyMethod::SoftDirty && s.method == method => {
            b.dirty = Dirty::SoftDirty;
            b.used = method;
        }
        _ => {}
    }
    if !keep {
        if let Some(fd) = live_fd {
            // Nobody will read it: stop paying for write faults.
            b.released = cr_sys::fdio::steal_fd(pid, fd).ok().map(|fd| Released {
                fd,
                ranges: ranges(maps, |_, m| registered(m)),
            });
            probe
                .call("close", libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0])
                .map_err(sys)?;
        }
        return Ok(b);
    }
    match method {
        DirtyMethod::UffdWp => {
            let fresh = ranges(maps, |i, m| !registered(m) && trackable(&vmas[i], m));
            let r = (|| -> cr_sys::error::Result<i32> {
                let fd = match live_fd {
                    Some(fd) => fd,
                    None => create_remote(probe)?,
                };
                let done = register_remote(probe, fd, &fresh)?;
                // Protect what is there now: the pages of newly registered
                // VMAs and, when the dirty scan above did not run, of the
                // older ones.
                let pm = pagemap()?;
                let mut sink = Vec::new();
                let mut todo = done;
                if !scanned {
                    todo.extend(ranges(maps, |_, m| registered(m)));
                }
                for (a, e) in todo {
                    kd::scan_written_and_reset(&pm, pid, a, e, &mut sink)?;
                }
                Ok(fd)
            })();
            match r {
                Ok(fd) => b.kept = Some((method, fd)),
                Err(e) => {
                    warn!(pid, error = %cr_sys::error::one_line(&e), "cannot start uffd-wp tracking; the next incremental checkpoint will compare page hashes")
                }
            }
        }
        DirtyMethod::SoftDirty => {
            b.clear_soft_dirty = true;
            b.kept = Some((method, -1));
        }
        _ => {}
    }
    Ok(b)
}

/// Create the tracker userfaultfd inside the process; returns its fd there.
fn create_remote(probe: &mut Probe<'_>) -> cr_sys::error::Result<i32> {
    let pid = probe.pid();
    let scratch = probe.scratch()?;
    let fd = probe.on(0, |inj| {
        new_remote(inj, scratch, kd::UFFD_USER_MODE_ONLY, kd::TRACKER_FEATURES)
    })?;
    debug!(pid, fd, "uffd-wp tracker created");
    Ok(fd)
}

/// A userfaultfd created by `inj` inside its process (with `flags` beside
/// O_CLOEXEC|O_NONBLOCK, and `features`), moved to a high fd number out of
/// the way of the fds the program numbers itself; `scratch` is memory of
/// the process for the ioctl's argument. Returns its fd there.
pub(crate) fn new_remote(
    inj: &mut cr_sys::remote::Injector<'_>,
    scratch: u64,
    flags: u64,
    features: u64,
) -> cr_sys::error::Result<i32> {
    let pid = inj.pid();
    let limit = cr_sys::limits::get_all(pid)?
        .get(libc::RLIMIT_NOFILE as usize)
        .map_or(1024, |l| l.0);
    let high = limit.clamp(64, 4096) - 32;
    let fd = inj.call(
        "userfaultfd",
        libc::SYS_userfaultfd,
        [
            (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | flags,
            0,
            0,
            0,
            0,
            0,
        ],
    )?;
    let api = [kd::UFFD_API, features, 0];
    mem::write_vm(pid, scratch, &words(&api))?;
    inj.call(
        "ioctl(UFFDIO_API)",
        libc::SYS_ioctl,
        [fd, kd::UFFDIO_API, scratch, 0, 0, 0],
    )?;
    let moved = inj.syscall_raw(
        libc::SYS_fcntl,
        [fd, libc::F_DUPFD_CLOEXEC as u64, high, 0, 0, 0],
    )?;
    if moved >= 0 {
        inj.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
        Ok(moved as i32)
    } else {
        Ok(fd as i32)
    }
}

/// Register `ranges` for write-protect tracking with the tracker `fd`;
/// returns the ranges registered (one the kernel refuses is left out: its
/// pages are simply read every time).
fn register_remote(
    probe: &mut Probe<'_>,
    fd: i32,
    ranges: &[(u64, u64)],
) -> cr_sys::error::Result<Vec<(u64, u64)>> {
    if ranges.is_empty() {
        return Ok(Vec::new());
    }
    let pid = probe.pid();
    let scratch = probe.scratch()?;
    // As many ranges per stop as the scratch page holds arguments (32
    // bytes each).
    let mut done = Vec::new();
    for group in ranges.chunks((Probe::SCRATCH / 32) as usize) {
        let args: Vec<u64> = group
            .iter()
            .flat_map(|&(a, e)| [a, e - a, kd::UFFDIO_REGISTER_MODE_WP, 0])
            .collect();
        mem::write_vm(pid, scratch, &words(&args))?;
        let calls: Vec<_> = (0..group.len() as u64)
            .map(|k| {
                (
                    "ioctl(UFFDIO_REGISTER)",
                    libc::SYS_ioctl,
                    [fd as u64, kd::UFFDIO_REGISTER, scratch + 32 * k, 0, 0, 0],
                )
            })
            .collect();
        for (&(a, e), r) in group.iter().zip(probe.calls_raw(0, &calls)?) {
            if r == 0 {
                done.push((a, e));
            } else {
                debug!(pid, start = a, end = e, errno = -r, "range not trackable");
            }
        }
    }
    Ok(done)
}

pub(crate) fn words(w: &[u64]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}
