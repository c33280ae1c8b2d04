//! Kind "eventfds": the anonymous-inode fds whose whole state is in
//! /proc/PID/fdinfo — eventfd (count, semaphore mode), signalfd (mask),
//! timerfd (clock, time left, period, unread expirations), epoll (the
//! interest list with events and data), inotify (the watches, found by
//! their file handles, with their watch numbers), fanotify (the group's
//! flags and marks: see [`fanotify`]) and pidfds of processes
//! of the tree (which process; a pidfd of a process outside the tree is
//! refused: a restore cannot give it that process again), or of one that
//! has exited.
//!
//! Restore: each is made in the restorer and taken by the process; epoll
//! interest lists are registered inside the process once all its fds are
//! back (each item carries the process's own fd number); timerfds are
//! armed at the release, when the tree starts running; a pidfd is opened
//! inside the process (pidfd_open of the restored process, by its PID as
//! the process sees it), one of a thread that is not a main thread
//! (PIDFD_THREAD) by the thread's id once the threads exist (those of a
//! process rebuilt after the one holding it: once the whole tree is
//! rebuilt, [`open_deferred`]), the epoll items watching it registered
//! then; a pidfd of a process that had exited is one of a
//! child of the restorer (one per dead process, so that the pidfds of one
//! share their inode), which is ended and reaped at the release
//! (`cr_sys::clone::Doomed`).
//!
//! Events queued in an inotify instance or a fanotify group and not read
//! yet cannot be queued again in the one the restore makes: a dump whose
//! processes end (`--kill`, `--stop`) first gives the running program a
//! short while to read them ([`wait_for_reads`], see `kinds::drain`); what
//! is still queued is then dropped with a warning, see [`refuse_queued`]. A dump that
//! continues the processes leaves them their instances, queues and all.

pub mod fanotify;
#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::{Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::fds::{EpollItem, InotifyWatch, TimerFd};
use cr_image::model::{Checkpoint, Fd, FdKind, Process};
use cr_sys::fdio;
use cr_sys::proc::{FDTarget, FdInfo, WatchedHandle};
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

pub struct EventFds;

impl FileKind for EventFds {
    fn name(&self) -> &'static str {
        "eventfds"
    }

    /// Count the pidfds of each process that had exited ([`Dead`]): the
    /// fds opened again (not those sharing an earlier one's description).
    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        let dead_ones = &mut r.stash.get::<Dead>().0;
        for f in ck.processes.iter().flat_map(|p| &p.fds) {
            if let (FdKind::Pidfd { pid: 0, dead }, None) = (&f.kind, &f.shared) {
                dead_ones.entry(*dead).or_insert((0, None)).0 += 1;
            }
        }
        Ok(())
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        let FDTarget::AnonInode(kind) = f.target else {
            return None;
        };
        if kind == "[pidfd]" {
            return Some(pidfd(cx, f).map(Some));
        }
        // Our own dirty-page tracker (see `memory::tracking`): never part of an image.
        if kind == "[userfaultfd]" && cr_sys::dirty::is_tracker_fd(f.pid, f.fd) {
            return Some(Ok(None));
        }
        Some(describe(cx, f, kind).map(Some))
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let made = match &f.kind {
            FdKind::Eventfd { count, semaphore } => {
                let sem = if *semaphore { libc::EFD_SEMAPHORE } else { 0 };
                fdio::eventfd(*count, sem).step(|| format!("cannot create eventfd {}", f.fd))
            }
            FdKind::Signalfd { mask } => {
                fdio::signalfd(*mask, 0).step(|| format!("cannot create signalfd {}", f.fd))
            }
            FdKind::Timerfd(t) => timerfd(cx.r, f, t),
            FdKind::Epoll { .. } => {
                fdio::epoll_create().step(|| format!("cannot create epoll {}", f.fd))
            }
            FdKind::Inotify { watches } => inotify(cx.r, f, watches),
            FdKind::Fanotify {
                flags,
                event_flags,
                marks,
            } => fanotify::group(f, *flags, *event_flags, marks),
            FdKind::Pidfd { pid, dead } => return Some(open_pidfd(cx, f, *pid, *dead)),
            _ => return None,
        };
        Some(made.map(Opened::Ours))
    }

    /// The epoll interest lists, registered inside the process so each item
    /// carries the process's own fd number.
    ///
    /// An EPOLLONESHOT item that fired and was not armed again shows no
    /// events (the kernel clears them), but adding it anew arms it for
    /// EPOLLERR and EPOLLHUP. Such items are added first, armed for every
    /// event, and made to fire once (epoll_wait) if their file is ready for
    /// any: they are then as disarmed as they were. One whose file is ready
    /// for nothing stays armed for errors and hang-ups only.
    ///
    /// An edge-triggered (EPOLLET) item whose file is ready is reported
    /// once after the restore (adding it finds it ready), so an edge that
    /// was not reported yet is not lost. Whether one was already reported
    /// cannot be read (the ready list is the kernel's, fdinfo does not show
    /// it, and only epoll_wait, which consumes it, would): one reported
    /// before the checkpoint, its data still unread, is reported once more.
    /// An edge-triggered program reads until EAGAIN on each report, and the
    /// kernel repeats edges itself (every write to a readable pipe), so a
    /// repeated edge is harmless where a lost one would hang it.
    ///
    /// An item whose file is a thread's pidfd, opened once the threads
    /// exist ([`open_thread_pidfds`], [`open_deferred`]), is added then.
    fn after_fds(&self, cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        watch_opened(cx, p, Opening::WithFds)
    }

    /// Arm the timerfds with the time they had left, now that the tree
    /// runs; end the children whose pidfds stand for processes that had
    /// exited.
    fn release(&self, r: &mut Restorer<'_>) -> Result<(), RestoreError> {
        for (fd, t) in r.stash.get::<Timers>().0.drain(..) {
            arm(&fd, &t)?;
        }
        for (_, (_, child)) in r.stash.get::<Dead>().0.drain() {
            drop(child);
        }
        Ok(())
    }
}

/// Register, in every epoll of `p` (the first fd of its description), the
/// items whose files are opened at `when`.
fn watch_opened(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    when: Opening,
) -> Result<(), RestoreError> {
    for f in p.fds.iter().filter(|f| f.shared.is_none()) {
        watch(cx, p, f, Some(when))?;
    }
    Ok(())
}

/// Register the items of the interest list of epoll `f` of `p` whose files
/// are opened at `when` (every fd of `p` open by then), or all of them
/// (None): see [`EventFds::after_fds`].
pub fn watch(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    f: &Fd,
    when: Option<Opening>,
) -> Result<(), RestoreError> {
    let FdKind::Epoll { items } = &f.kind else {
        return Ok(());
    };
    let ck = cx.r.ck;
    let mut order: Vec<&EpollItem> = items
        .iter()
        .filter(|it| when.is_none_or(|w| opening(ck, p, it.open_as.unwrap_or(it.tfd)) == w))
        .collect();
    order.sort_by_key(|it| !disarmed(it.events));
    for it in order {
        let rearm = disarmed(it.events);
        if rearm && when.is_some_and(|w| w != Opening::WithFds) {
            // Made to fire once, it would need a set holding nothing
            // else (see `after_fds`); added as it is, it would report the
            // thread's end, which the program no longer waits for.
            return Err(RestoreError::Unsupported(format!(
                "epoll fd {} of process {}: a one-shot item that fired, watching fd {}, a pidfd of a thread (not supported)",
                f.fd, p.pid, it.tfd
            )));
        }
        let events = match rearm {
            true => it.events | EPOLL_ALL,
            false => it.events,
        };
        // struct epoll_event is packed on x86_64: u32 events, u64 data.
        let mut ev = Vec::with_capacity(12);
        ev.extend_from_slice(&events.to_le_bytes());
        ev.extend_from_slice(&it.data.to_le_bytes());
        let addr = cx.stub.put(&ev)?;
        let what = || format!("cannot watch fd {} again in epoll fd {}", it.tfd, f.fd);
        // A file open at another number: `tfd` is its copy while it
        // is registered (the item keeps the key it was added with);
        // a file of the process at `tfd` waits at a free number.
        let mut aside = None;
        if let (Some(_), Some(now)) = (it.open_as, p.fd(it.tfd)) {
            let free = cx
                .stub
                .call(
                    "fcntl(F_DUPFD_CLOEXEC)",
                    libc::SYS_fcntl,
                    [it.tfd as u64, libc::F_DUPFD_CLOEXEC as u64, 0, 0, 0, 0],
                )
                .step(what)?;
            aside = Some((free, now.flags & libc::O_CLOEXEC as u32 != 0));
        }
        if let Some(n) = it.open_as {
            cx.stub
                .call(
                    "dup3",
                    libc::SYS_dup3,
                    [n as u64, it.tfd as u64, libc::O_CLOEXEC as u64, 0, 0, 0],
                )
                .step(what)?;
        }
        let r = cx.stub.call(
            "epoll_ctl",
            libc::SYS_epoll_ctl,
            [
                f.fd as u64,
                libc::EPOLL_CTL_ADD as u64,
                it.tfd as u64,
                addr,
                0,
                0,
            ],
        );
        if let Some((free, cloexec)) = aside {
            let flag = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
            cx.stub
                .call("dup3", libc::SYS_dup3, [free, it.tfd as u64, flag, 0, 0, 0])
                .step(what)?;
            cx.stub
                .call("close", libc::SYS_close, [free, 0, 0, 0, 0, 0])
                .step(what)?;
        } else if it.open_as.is_some() {
            cx.stub
                .call("close", libc::SYS_close, [it.tfd as u64, 0, 0, 0, 0, 0])
                .step(what)?;
        }
        r.step(what)?;
        if rearm {
            disarm(cx, f.fd, it, addr).step(what)?;
        }
    }
    Ok(())
}

/// PIDFD_NONBLOCK and PIDFD_THREAD: the flags of a pidfd pidfd_open takes.
const PIDFD_FLAGS: u32 = (libc::O_NONBLOCK | libc::O_EXCL) as u32;

/// A pidfd: of which process of the tree ("Pid:" of fdinfo, as we see it;
/// -1 once it has exited: pid 0 in the image).
fn pidfd(cx: &FdScan<'_>, f: &OpenFd<'_>) -> Result<FdKind, String> {
    let pid: i32 = f
        .info
        .get("Pid")
        .and_then(|v| v.trim().parse().ok())
        .ok_or("a pidfd whose process cannot be read")?;
    if pid <= 0 {
        // Which dead process: pidfs gives each process one inode.
        let dead = f.md.as_ref().map(|m| m.ino()).unwrap_or_else(|| {
            std::fs::metadata(format!("/proc/{}/fd/{}", f.pid, f.fd)).map_or(0, |m| m.ino())
        });
        return Ok(FdKind::Pidfd { pid: 0, dead });
    }
    // PIDFD_THREAD (O_EXCL): of one thread. A main thread's id is its
    // process's, restored with it; pidfd_open takes the flag again. One
    // of another thread of the tree keeps that thread's id, and is opened
    // once the threads exist ([`open_thread_pidfds`]).
    let thread = f.info.flags & libc::O_EXCL as u32 != 0;
    if !cx.tree.in_tree(pid) {
        let of_tree = thread
            && cx
                .tree
                .pids()
                .iter()
                .any(|p| std::path::Path::new(&format!("/proc/{p}/task/{pid}")).exists());
        if of_tree {
            return Ok(FdKind::Pidfd {
                pid: pid as u32,
                dead: 0,
            });
        }
        return Err(format!(
            "a pidfd of {} {pid}, outside the tree (a restore cannot give it that process again)",
            if thread { "thread" } else { "process" }
        ));
    }
    Ok(FdKind::Pidfd {
        pid: pid as u32,
        dead: 0,
    })
}

/// The process of the image and thread of it (not its main thread) whose
/// id is `tid`.
fn thread_of(ck: &Checkpoint, tid: u32) -> Option<(&Process, &cr_image::model::Thread)> {
    ck.processes.iter().find_map(|q| {
        q.threads
            .iter()
            .skip(1)
            .find(|t| t.tid == tid)
            .map(|t| (q, t))
    })
}

/// Whether fd `fd` of `p` is a pidfd of a thread that is not a main
/// thread (PIDFD_THREAD), opened once the threads exist
/// ([`open_thread_pidfds`], [`open_deferred`]).
pub fn thread_pidfd(ck: &Checkpoint, p: &Process, fd: i32) -> bool {
    p.fd(fd).is_some_and(|f| {
        f.shared.is_none()
            && matches!(f.kind, FdKind::Pidfd { pid, .. } if pid != 0 && thread_of(ck, pid).is_some())
    })
}

/// When an fd of a process is opened at restore.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Opening {
    /// With the process's fds (kind "fds").
    WithFds,
    /// Once its threads exist, and those of the processes rebuilt before
    /// it ([`open_thread_pidfds`]): a pidfd of one of those threads, and
    /// its copies in the process.
    AfterThreads,
    /// Once every process of the tree is rebuilt ([`open_deferred`]): a
    /// pidfd of a thread of a process rebuilt after it, and its copies
    /// (in it, or in processes rebuilt after it).
    AfterTree,
}

/// When fd `fd` of `p` is opened at restore.
pub fn opening(ck: &Checkpoint, p: &Process, fd: i32) -> Opening {
    let Some(f) = p.fd(fd) else {
        return Opening::WithFds;
    };
    if let Some(s) = f.shared {
        if s.pid == p.pid {
            return opening(ck, p, s.fd);
        }
        let from = ck.processes.iter().find(|q| q.pid == s.pid);
        return match from.map(|q| opening(ck, q, s.fd)) {
            Some(Opening::AfterTree) => Opening::AfterTree,
            // Copied from an fd opened before this process's fds.
            _ => Opening::WithFds,
        };
    }
    let FdKind::Pidfd { pid: tid, .. } = f.kind else {
        return Opening::WithFds;
    };
    let Some((q, _)) = thread_of(ck, tid).filter(|_| tid != 0) else {
        return Opening::WithFds;
    };
    let at = |pid: u32| ck.processes.iter().position(|x| x.pid == pid);
    if at(q.pid) > at(p.pid) {
        Opening::AfterTree
    } else {
        Opening::AfterThreads
    }
}

/// Whether fd `fd` of `p` is a copy of an fd of another process that is
/// opened once the whole tree is rebuilt ([`open_deferred`]).
pub fn copy_of_deferred(ck: &Checkpoint, p: &Process, fd: i32) -> bool {
    p.fd(fd).is_some_and(|f| {
        f.shared.is_some_and(|s| s.pid != p.pid) && opening(ck, p, fd) == Opening::AfterTree
    })
}

/// The pidfds of threads (not main threads) that `p` holds, opened now
/// that its threads, and those of the processes rebuilt before it, exist
/// (and the fds of `p` that share them), with the epoll items watching
/// them. A thread of a process rebuilt after it has no id yet: its pidfd
/// waits for the whole tree ([`open_deferred`]).
pub fn open_thread_pidfds(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let ck = cx.r.ck;
    let mut any = false;
    for f in p.fds.iter().filter(|f| thread_pidfd(ck, p, f.fd)) {
        if opening(ck, p, f.fd) != Opening::AfterThreads {
            continue;
        }
        open_thread_pidfd(cx, p, f)?;
        any = true;
    }
    if any {
        watch_opened(cx, p, Opening::AfterThreads)?;
    }
    Ok(())
}

/// Whether `p` has fds opened once the whole tree is rebuilt
/// ([`open_deferred`]).
pub fn has_deferred(ck: &Checkpoint, p: &Process) -> bool {
    p.fds
        .iter()
        .any(|f| opening(ck, p, f.fd) == Opening::AfterTree)
}

/// Once every process of the tree is rebuilt (`p`'s stub ready again,
/// the processes before it done): the pidfds `p` holds of threads of
/// processes rebuilt after it, with their copies in `p`, its copies of
/// such pidfds of processes rebuilt before it, and the epoll items
/// watching them.
pub fn open_deferred(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let ck = cx.r.ck;
    for f in &p.fds {
        if opening(ck, p, f.fd) != Opening::AfterTree {
            continue;
        }
        match f.shared {
            None => open_thread_pidfd(cx, p, f)?,
            Some(s) if s.pid != p.pid => {
                let cloexec = f.flags as i32 & libc::O_CLOEXEC != 0;
                crate::kinds::fds::share(cx, p, f, s, cloexec)?;
            }
            // Made by `share_within`.
            Some(_) => {}
        }
    }
    cx.stub.flush()?;
    watch_opened(cx, p, Opening::AfterTree)
}

/// Thread pidfd `f` of `p` opened, with its copies in `p`.
fn open_thread_pidfd(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    f: &Fd,
) -> Result<(), RestoreError> {
    let ck = cx.r.ck;
    let FdKind::Pidfd { pid: tid, .. } = f.kind else {
        return Ok(());
    };
    let Some((_, t)) = thread_of(ck, tid) else {
        return Ok(());
    };
    let target = if ck.pidns { t.ns_tid } else { t.tid };
    pidfd_at(cx, f, target, &format!("thread {tid}"))?;
    crate::kinds::fds::share_within(cx, p, f.fd)?;
    cx.stub.flush()?;
    Ok(())
}

/// pidfd_open, inside the process, of `target` (as the process sees it:
/// `who`), with the fd's flags, at the fd's number.
fn pidfd_at(
    cx: &mut Rebuild<'_, '_, '_>,
    f: &Fd,
    target: u32,
    who: &str,
) -> Result<(), RestoreError> {
    let what = || format!("cannot open a pidfd of {who} as fd {}", f.fd);
    let got = cx
        .stub
        .call(
            "pidfd_open",
            libc::SYS_pidfd_open,
            [target as u64, (f.flags & PIDFD_FLAGS) as u64, 0, 0, 0, 0],
        )
        .step(what)?;
    let cloexec = f.flags as i32 & libc::O_CLOEXEC != 0;
    cx.stub.place(got, f.fd, cloexec).step(what)?;
    Ok(())
}

/// pidfd_open, inside the process, of the restored process `pid` of the
/// image (by the PID the process sees it with), at the fd's number; a
/// pidfd of a thread later ([`open_thread_pidfds`]).
fn open_pidfd(
    cx: &mut Rebuild<'_, '_, '_>,
    f: &Fd,
    pid: u32,
    dead: u64,
) -> Result<Opened, RestoreError> {
    if pid == 0 {
        // Of a process that had exited: of a child of ours, one per dead
        // process, which ends at the release ([`Dead`]).
        let what = || {
            format!(
                "cannot make fd {}, a pidfd of a process that has exited",
                f.fd
            )
        };
        let dead_ones = &mut cx.r.stash.get::<Dead>().0;
        let (left, child) = dead_ones.entry(dead).or_insert((1, None));
        let made = match child {
            Some(c) => c,
            None => child.insert(
                cr_sys::clone::Doomed::spawn()
                    .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())))?,
            ),
        }
        .pidfd(f.flags & PIDFD_FLAGS)
        .step(what)?;
        // Its last pidfd made: it ends (before `--verify` looks).
        *left = left.saturating_sub(1);
        if *left == 0 {
            if let Some(c) = child.take() {
                c.end();
            }
        }
        return Ok(Opened::Ours(made));
    }
    let ck = cx.r.ck;
    if thread_of(ck, pid).is_some() && !ck.processes.iter().any(|q| q.pid == pid) {
        return Ok(Opened::Later);
    }
    let target = ck
        .processes
        .iter()
        .find(|q| q.pid == pid)
        .map(|q| if ck.pidns { q.ns_pid } else { q.pid })
        .ok_or_else(|| {
            RestoreError::Unsupported(format!(
                "fd {}: a pidfd of process {pid}, not in the image",
                f.fd
            ))
        })?;
    pidfd_at(cx, f, target, &format!("process {pid}"))?;
    Ok(Opened::InStub)
}

/// Timerfds to arm at the release.
#[derive(Default)]
struct Timers(Vec<(OwnedFd, TimerFd)>);

/// The children whose pidfds stand for the processes that had exited, by
/// the image's name of each (`dead`), with how many pidfds of each are
/// still to make (counted at `prepare`): each ends once its last pidfd is
/// made (at the latest at the release).
#[derive(Default)]
struct Dead(std::collections::HashMap<u64, (usize, Option<cr_sys::clone::Doomed>)>);

fn describe(cx: &mut FdScan<'_>, f: &OpenFd<'_>, kind: &str) -> Result<FdKind, String> {
    let info = &f.info;
    let get = |key: &str| info.get(key).map(str::trim);
    let hex = |key: &str| get(key).and_then(|v| u64::from_str_radix(v, 16).ok());
    Ok(match kind {
        "[eventfd]" => FdKind::Eventfd {
            count: hex("eventfd-count").ok_or("an eventfd without a readable count")?,
            semaphore: get("eventfd-semaphore") == Some("1"),
        },
        "[signalfd]" => FdKind::Signalfd {
            mask: hex("sigmask").ok_or("a signalfd without a readable mask")?,
        },
        "[timerfd]" => {
            FdKind::Timerfd(timer_state(info).ok_or("a timerfd whose state cannot be read")?)
        }
        "[eventpoll]" => {
            // Whose fd numbers the keys are: an epoll in flight over a unix
            // socket is looked at in our table, its keys the sender's.
            let owner = cx.tree.stash.get::<EpollOwner>().0.unwrap_or(f.pid);
            // The items with the same key, counted in the order listed.
            let mut seen: std::collections::HashMap<&str, u32> = Default::default();
            FdKind::Epoll {
                items: info
                    .all("tfd")
                    .map(|v| {
                        let n = seen
                            .entry(v.split_whitespace().next().unwrap_or(""))
                            .or_default();
                        *n += 1;
                        epoll_item(owner, f.pid, f.fd, v, *n - 1)
                    })
                    .collect::<Result<_, _>>()?,
            }
        }
        "[fanotify]" => fanotify::describe(cx, f)?,
        "inotify" => {
            refuse_queued(cx, f, "an inotify instance", false)?;
            FdKind::Inotify {
                watches: info
                    .all("inotify wd")
                    .map(|v| inotify_watch(cx, v))
                    .collect::<Result<_, _>>()?,
            }
        }
        other => {
            let name = other.trim_matches(|c| c == '[' || c == ']');
            return Err(format!("a {name} (anon_inode:{other}, not supported)"));
        }
    })
}

/// "clockid: 1", "ticks: 0", "settime flags: 01", "it_value: (4, 999424181)",
/// "it_interval: (1, 0)".
fn timer_state(info: &FdInfo) -> Option<TimerFd> {
    let get = |key: &str| info.get(key).map(str::trim);
    let pair = |key: &str| -> Option<u64> {
        let v = get(key)?.trim_matches(|c| c == '(' || c == ')');
        let (s, ns) = v.split_once(',')?;
        Some(s.trim().parse::<u64>().ok()? * 1_000_000_000 + ns.trim().parse::<u64>().ok()?)
    };
    let mut t = TimerFd {
        clockid: get("clockid")?.parse().ok()?,
        ticks: get("ticks")?.parse().ok()?,
        settime_flags: u32::from_str_radix(get("settime flags")?, 8).ok()?,
        value_ns: pair("it_value")?,
        interval_ns: pair("it_interval")?,
    };
    // fdinfo shows the time left; an absolute timer keeps its deadline.
    if t.settime_flags as i32 & libc::TFD_TIMER_ABSTIME != 0 && t.value_ns != 0 {
        t.value_ns += fdio::clock_now_ns(t.clockid).ok()?;
    }
    Some(t)
}

/// One "tfd: 6 events: 80000019 data: 6 pos:0 ino:40e sdev:10" line (the
/// part after "tfd:") of epoll `epfd`. The watched file must still be open
/// in the process: at that number, or (dup'ed, then closed) at another.
/// EPOLLEXCLUSIVE, EPOLLWAKEUP, EPOLLONESHOT, EPOLLET: how an item
/// reports, not what.
const EPOLL_MODE_BITS: u32 = 0xf000_0000;
/// Every event an item can wait for.
const EPOLL_ALL: u32 = (libc::EPOLLIN
    | libc::EPOLLPRI
    | libc::EPOLLOUT
    | libc::EPOLLRDNORM
    | libc::EPOLLRDBAND
    | libc::EPOLLWRNORM
    | libc::EPOLLWRBAND
    | libc::EPOLLMSG
    | libc::EPOLLRDHUP) as u32;

/// A one-shot item that fired and was not armed again.
pub fn disarmed(events: u32) -> bool {
    events & libc::EPOLLONESHOT as u32 != 0 && events & !EPOLL_MODE_BITS == 0
}

/// Make the one-shot item `it` just added to epoll fd `epfd` (armed for
/// every event) fire once if its file is ready, else arm it for nothing
/// but what the kernel always adds (errors, hang-ups). Only disarmed items
/// are in the set yet: the one event epoll_wait reports is this item's.
fn disarm(
    cx: &mut Rebuild<'_, '_, '_>,
    epfd: i32,
    it: &EpollItem,
    ev: u64,
) -> cr_sys::error::Result<()> {
    let fired = cx.stub.call(
        "epoll_wait",
        libc::SYS_epoll_wait,
        [epfd as u64, ev, 1, 0, 0, 0],
    )?;
    if fired == 0 {
        let mut back = Vec::with_capacity(12);
        back.extend_from_slice(&it.events.to_le_bytes());
        back.extend_from_slice(&it.data.to_le_bytes());
        let addr = cx.stub.put(&back)?;
        cx.stub.call(
            "epoll_ctl",
            libc::SYS_epoll_ctl,
            [
                epfd as u64,
                libc::EPOLL_CTL_MOD as u64,
                it.tfd as u64,
                addr,
                0,
                0,
            ],
        )?;
    }
    Ok(())
}

/// The process whose fd numbers the keys of the epoll being described are,
/// when not the process holding it (None).
#[derive(Default)]
pub struct EpollOwner(pub Option<i32>);

/// One epoll item (of epoll `epfd` of `epid`, its keys fd numbers of
/// `pid`) from its fdinfo line, the `toff`th with its key.
fn epoll_item(pid: i32, epid: i32, epfd: i32, v: &str, toff: u32) -> Result<EpollItem, String> {
    let mut words = v.split_whitespace();
    let tfd: i32 = words
        .next()
        .and_then(|w| w.parse().ok())
        .ok_or("an epoll with an unreadable interest list")?;
    let mut item = EpollItem {
        tfd,
        events: 0,
        data: 0,
        open_as: None,
    };
    let mut ino = None;
    while let Some(w) = words.next() {
        match w {
            "events:" => {
                item.events = words
                    .next()
                    .and_then(|x| u32::from_str_radix(x, 16).ok())
                    .unwrap_or(0)
            }
            "data:" => {
                item.data = words
                    .next()
                    .and_then(|x| u64::from_str_radix(x, 16).ok())
                    .unwrap_or(0)
            }
            _ => {
                if let Some(i) = w.strip_prefix("ino:") {
                    ino = u64::from_str_radix(i, 16).ok();
                }
            }
        }
    }
    let open = std::fs::metadata(format!("/proc/{pid}/fd/{tfd}"))
        .ok()
        .map(|m| m.ino());
    if ino.is_some() && open != ino {
        // Closed, or its number taken by another file: the file may still
        // be open at another number.
        let fds = cr_sys::proc::fds(pid).map_err(|e| cr_sys::error::one_line(&e))?;
        item.open_as = fds.iter().map(|(n, _)| *n).find(|&n| {
            n != tfd && cr_sys::mem::is_epoll_target(pid, n, epid, epfd, tfd, toff).unwrap_or(false)
        });
        if item.open_as.is_none() {
            let now = match open {
                Some(_) => "its number taken by another file",
                None => "closed",
            };
            return Err(format!(
                "an epoll watching a file that is open nowhere in the process (fd {tfd} {now}; the kernel gives no way to reach that file)"
            ));
        }
    }
    Ok(item)
}

/// One inotify watch from its fdinfo line (the part after "inotify wd:"):
/// "1 ino:3c4a7 sdev:fe00000 mask:300 ignored_mask:0 fhandle-bytes:8
/// fhandle-type:1 f_handle:a7c4030000000000". The path is found by opening
/// the file handle on the watched file's mount. A regular file removed
/// since (something still holds it open, or the kernel would have dropped
/// the watch) is saved as a deleted file's content object, the one an fd
/// of it would have: the restore makes it again and watches that.
fn inotify_watch(cx: &mut FdScan<'_>, v: &str) -> Result<InotifyWatch, String> {
    let bad = || format!("an inotify watch that cannot be read ({v})");
    // In hex, as every number of the line ("a" is watch 10).
    let wd = v
        .split_whitespace()
        .next()
        .and_then(|w| i32::from_str_radix(w, 16).ok())
        .ok_or_else(bad)?;
    let mask = v
        .split_whitespace()
        .find_map(|w| w.strip_prefix("mask:"))
        .and_then(|s| u32::from_str_radix(s, 16).ok())
        .ok_or_else(bad)?;
    let handle = WatchedHandle::parse(v).ok_or_else(bad)?;
    let (file, path) = watched_file(&handle, "an inotify watch")?;
    let open = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
    // A watch on a symbolic link itself was added with IN_DONT_FOLLOW,
    // which the kernel does not keep in the mask: the restore needs it
    // again, or it would watch what the link points to.
    let on_link = file
        .try_clone()
        .map(std::fs::File::from)
        .and_then(|f| f.metadata())
        .is_ok_and(|m| m.file_type().is_symlink());
    let mut w = InotifyWatch {
        wd,
        mask: if on_link {
            mask | libc::IN_DONT_FOLLOW
        } else {
            mask
        },
        path,
        deleted_file: None,
    };
    let md =
        std::fs::metadata(&open).map_err(|e| format!("an inotify watch on {}: {e}", w.path))?;
    if md.nlink() == 0 {
        if !md.is_file() {
            return Err(format!(
                "an inotify watch on the removed directory {} (not supported: only removed files are made again for a watch)",
                w.path
            ));
        }
        if let Some(objs) = cx.objects.as_deref_mut() {
            crate::kinds::files::content_object(objs, &open, md.ino(), &w.path, false)?;
        }
        w.deleted_file = Some(md.ino());
    }
    Ok(w)
}

/// The file behind the file handle of a watch (`what`: "an inotify
/// watch", "a fanotify mark"), opened on its filesystem's mount: an O_PATH
/// fd of it, and its path (" (deleted)" when it was removed).
fn watched_file(h: &WatchedHandle, what: &str) -> Result<(OwnedFd, String), String> {
    let (maj, min) = h.dev();
    let mount = cr_sys::proc::mount_point(maj, min)
        .ok_or_else(|| format!("{what} on device {maj}:{min}, which has no mount here"))?;
    let mount = mount.to_string_lossy();
    let mfd = fdio::open(&mount, libc::O_RDONLY | libc::O_DIRECTORY)
        .map_err(|e| format!("{what} on {mount}: {}", cr_sys::error::one_line(&e)))?;
    let unfound = |e: cr_sys::SysError| {
        format!(
            "{what} whose file cannot be found from its handle on {mount} ({})",
            cr_sys::error::one_line(&e)
        )
    };
    let file = fdio::open_handle(&mfd, h.handle_type, &h.handle).map_err(unfound)?;
    let open = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&file));
    let path = cr_sys::proc::read_link(&open).map_err(unfound)?;
    Ok((file, path))
}

/// A timerfd for `f`, armed only at the release.
fn timerfd(r: &mut Restorer<'_>, f: &Fd, t: &TimerFd) -> Result<OwnedFd, RestoreError> {
    let fd = fdio::timerfd(t.clockid, 0)
        .step(|| format!("cannot create timerfd {} (clock {})", f.fd, t.clockid))?;
    let copy = fd
        .try_clone()
        .map_err(|e| RestoreError::Unsupported(format!("cannot keep timerfd {}: {e}", f.fd)))?;
    r.stash.get::<Timers>().0.push((copy, *t));
    Ok(fd)
}

/// Arm a timerfd with the time it had left.
fn arm(fd: &OwnedFd, t: &TimerFd) -> Result<(), RestoreError> {
    let what = || format!("cannot arm a timerfd (clock {})", t.clockid);
    // A periodic timer that expired and was not read since is not re-armed
    // by the kernel until it is read: its time left shows 0 but it still
    // runs, one period from now.
    let value = match (t.value_ns, t.interval_ns) {
        (0, 0) => {
            if t.ticks != 0 {
                fdio::timerfd_set_ticks(fd, t.ticks).step(what)?;
            }
            return Ok(());
        }
        (0, period) => period,
        (v, _) => v,
    };
    let abs = t.settime_flags as i32 & libc::TFD_TIMER_ABSTIME != 0;
    let flags = if abs && t.value_ns == 0 {
        t.settime_flags as i32 & !libc::TFD_TIMER_ABSTIME
    } else {
        t.settime_flags as i32
    };
    fdio::timerfd_settime(fd, flags, value, t.interval_ns).step(what)?;
    // After settime, which clears them.
    if t.ticks != 0 {
        fdio::timerfd_set_ticks(fd, t.ticks).step(what)?;
    }
    Ok(())
}

/// An inotify instance with its watches at their saved numbers: watch
/// descriptors are handed out cyclically, so a watch that came out too low
/// is removed and added again until it gets its number. A removed file is
/// watched through the restorer's fd of its copy (made again by kind
/// "files"), so the watch is on the file the processes hold.
fn inotify(
    r: &mut Restorer<'_>,
    f: &Fd,
    watches: &[InotifyWatch],
) -> Result<OwnedFd, RestoreError> {
    let fd =
        fdio::inotify_init(libc::IN_NONBLOCK).step(|| format!("cannot create inotify {}", f.fd))?;
    let mut watches = watches.to_vec();
    watches.sort_by_key(|w| w.wd);
    for w in &watches {
        let what = || format!("cannot watch {} again (inotify fd {})", w.path, f.fd);
        let (path, mask) = match w.deleted_file {
            // The magic link is followed to the copy.
            Some(id) => (
                crate::kinds::files::map_path(r, id, "").ok_or_else(|| {
                    RestoreError::Unsupported(format!(
                        "{}: its file (object {id}) is missing from the image",
                        what()
                    ))
                })?,
                w.mask & !libc::IN_DONT_FOLLOW,
            ),
            None => (w.path.clone(), w.mask),
        };
        loop {
            let got = fdio::inotify_add_watch(&fd, &path, mask).step(what)?;
            if got == w.wd {
                break;
            }
            if got > w.wd {
                return Err(RestoreError::Unsupported(format!(
                    "{}: got watch {got} instead of {}",
                    what(),
                    w.wd
                )));
            }
            fdio::inotify_rm_watch(&fd, got).step(what)?;
        }
    }
    // Each removed stand-in queued an IN_IGNORED event: drop them.
    let mut buf = [0u8; 4096];
    while fdio::read_nonblock(&fd, &mut buf).is_ok_and(|n| n > 0) {}
    Ok(fd)
}

/// The bytes of events queued in the inotify instance or fanotify group
/// open as fd `fd` of `pid` and not read yet: FIONREAD on a copy of the
/// fd (pidfd_getfd).
fn bytes_queued(pid: i32, fd: i32) -> cr_sys::error::Result<usize> {
    fdio::steal_fd(pid, fd).and_then(|copy| fdio::bytes_queued(&copy))
}

/// Events queued in `f` (`what`: "an inotify instance", "a fanotify
/// group") and not read yet, in a dump whose processes end (the restore
/// makes a new instance, and the kernel has no way to queue them in it
/// again). With `strict` they are refused by name, unless
/// `--skip-queued-events`; otherwise (inotify instances, fanotify groups:
/// notifications only, permission marks being refused) they are dropped
/// with a warning, as with that option: inotify already lets events go
/// (its queue overflows), programs watching files re-scan what they
/// watch, a group marking a mount also gets the checkpoint's own opens,
/// and CRIU drops them too, so refusing would fail checkpoints users
/// expect to work. A dump that continues the processes leaves them their
/// queue.
pub(crate) fn refuse_queued(
    cx: &FdScan<'_>,
    f: &OpenFd<'_>,
    what: &str,
    strict: bool,
) -> Result<(), String> {
    if !cx.tree.lock_network {
        return Ok(());
    }
    let queued = bytes_queued(f.pid, f.fd).map_err(|e| {
        format!(
            "{what} whose queue cannot be looked at ({})",
            cr_sys::error::one_line(&e)
        )
    })?;
    if queued == 0 {
        return Ok(());
    }
    if cx.tree.skip_queued_events || !strict {
        // Once, from the scan of the frozen tree (not the pre-flight's).
        if cx.objects.is_some() {
            tracing::warn!(
                pid = f.pid,
                fd = f.fd,
                bytes = queued,
                "{what} with events not read yet: dropped; the restored program will not see them"
            );
        }
        return Ok(());
    }
    Err(format!(
        "{what} with {queued} bytes of events not read yet (not supported: the kernel cannot queue them again, and the program did not read them while the checkpoint waited; have it read them first, or use --skip-queued-events to drop them)"
    ))
}

/// Before the freeze of a dump whose processes end: if inotify instances
/// or fanotify groups of `pids` have events queued, give the running
/// program up to `limit` to read them (see `kinds::drain`), looking at
/// their queues again every few milliseconds. What is still queued after
/// is refused by the scan ([`refuse_queued`]).
pub fn wait_for_reads(pids: &[i32], limit: Duration) {
    // (pid, fd, bytes queued) and a copy of the fd.
    let mut queues: Vec<((i32, i32, usize), OwnedFd)> = Vec::new();
    for &pid in pids {
        for (fd, target) in cr_sys::proc::fds(pid).unwrap_or_default() {
            if !matches!(&target, FDTarget::AnonInode(k) if k == "inotify" || k == "[fanotify]") {
                continue;
            }
            // One that cannot be looked at is refused by the scan.
            let Ok(copy) = fdio::steal_fd(pid, fd) else {
                continue;
            };
            match fdio::bytes_queued(&copy) {
                Ok(bytes) if bytes > 0 => queues.push(((pid, fd, bytes), copy)),
                _ => {}
            }
        }
    }
    if queues.is_empty() {
        return;
    }
    let queued: Vec<(i32, i32, usize)> = queues.iter().map(|(q, _)| *q).collect();
    crate::kinds::drain::wait("inotify and fanotify events", &queued, limit, || {
        queues
            .iter()
            .filter_map(|&((pid, fd, _), ref copy)| {
                let bytes = fdio::bytes_queued(copy).unwrap_or(0);
                (bytes > 0).then_some((pid, fd, bytes))
            })
            .collect()
    });
}
