//! Kind "fds": the fd table of a process — which numbers are open, with
//! which flags and offsets, which share one open file description (dup,
//! fork), and for each what it is, which the file kinds
//! ([`crate::kinds::FILE_KINDS`]) tell.
//!
//! Capture: [`TreeFds`] first gathers what the whole tree holds (pipe
//! ends, sockets, pty masters), so a kind can tell an fd leading outside
//! the tree; each fd is then offered to the file kinds in turn, and the
//! objects it shares are saved once ([`Objects`]). The same code runs for
//! the pre-flight ([`preflight`], `cr_checkpoint --check`) without reading
//! any data, and on the frozen tree with data.
//!
//! Restore: the stub keeps only a pidfd of the restorer ([`keep_only_grab_fd`]);
//! each fd is shared from an fd restored before it, or opened by its kind
//! (in the stub, or in the restorer and taken by the stub with
//! pidfd_getfd); then the kinds' last steps (epoll lists), the locks, and
//! the controlling terminal.

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::{locks, tty, HeldState, Kind, Opened, Stash, FILE_KINDS};
use crate::restore::Rebuild;
use crate::stub::Stub;
use cr_image::model::{
    Checkpoint, Fd, FdKind, FdOwner, LockKind, Object, ObjectTag, Process, SharedFd,
};
use cr_image::ImageDir;
use cr_sys::proc::{self, FDTarget, FdInfo};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::{AsFd, AsRawFd};

pub struct Fds;

/// What the whole tree's fds hold, gathered once before any fd is described.
#[derive(Default)]
pub struct TreeFds {
    pids: HashSet<i32>,
    /// The tree's root (the first of the pids given).
    pub root: i32,
    /// Pipe inode -> (a read end is open in the tree, a write end is).
    pub pipe_ends: HashMap<u64, (bool, bool)>,
    /// Socket inodes open in the tree.
    pub sockets: HashSet<u64>,
    /// The pty pairs whose master the tree holds.
    pub pty_masters: tty::Masters,
    /// `--check`: also look into socket queues.
    pub deep: bool,
    /// The dump ends with the processes killed or stopped: TCP connections
    /// are held by the network lock and stay in repair mode.
    pub lock_network: bool,
    /// Drop connections not yet accepted by a TCP listener instead of
    /// refusing the dump (`--tcp-skip-in-flight`).
    pub skip_in_flight: bool,
    /// Drop inotify and fanotify events queued and not read yet instead of
    /// refusing the dump (`--skip-queued-events`).
    pub skip_queued_events: bool,
    /// The scan of a restored tree by `--verify`, not a dump: nothing is
    /// taken off a queue, and what only a dump whose processes end can
    /// save is not refused.
    pub verifying: bool,
    /// What the file kinds keep during the scan.
    pub stash: Stash,
}

impl TreeFds {
    /// Look at every fd of `pids` (the tree).
    pub fn new(pids: &[i32]) -> TreeFds {
        let mut s = TreeFds {
            pids: pids.iter().copied().collect(),
            root: pids.first().copied().unwrap_or(0),
            ..Default::default()
        };
        for &pid in pids {
            for (fd, target) in proc::fds(pid).unwrap_or_default() {
                match target {
                    FDTarget::Pipe(ino) => {
                        let acc = proc::fdinfo(pid, fd)
                            .map(|i| i.flags as i32 & libc::O_ACCMODE)
                            .unwrap_or(libc::O_RDONLY);
                        let e = s.pipe_ends.entry(ino).or_default();
                        e.0 |= acc != libc::O_WRONLY;
                        e.1 |= acc != libc::O_RDONLY;
                    }
                    FDTarget::Socket(ino) => {
                        s.sockets.insert(ino);
                    }
                    // /dev/ptmx, /dev/pts/ptmx, or the ptmx of another
                    // devpts mount.
                    FDTarget::Path(p) if p.file_name().is_some_and(|n| n == "ptmx") => {
                        if let Some(i) = proc::fdinfo(pid, fd)
                            .ok()
                            .and_then(|i| i.get("tty-index")?.trim().parse().ok())
                        {
                            s.pty_masters.add(pid, fd, &p.to_string_lossy(), i);
                        }
                    }
                    _ => {}
                }
            }
        }
        s
    }

    pub fn in_tree(&self, pid: i32) -> bool {
        self.pids.contains(&pid)
    }

    /// The processes of the tree, sorted.
    pub fn pids(&self) -> Vec<i32> {
        let mut v: Vec<i32> = self.pids.iter().copied().collect();
        v.sort();
        v
    }

    pub fn socket_in_tree(&self, ino: u64) -> bool {
        self.sockets.contains(&ino)
    }
}

/// The objects of one checkpoint (by kind and id), and what the dump holds
/// until the processes are let go.
pub struct Objects {
    map: BTreeMap<(ObjectTag, u64), Object>,
    /// Where content files go (none for a pre-flight).
    pub dir: Option<ImageDir>,
    /// The new image's id, part of its content files' names.
    pub image_id: String,
    pub fsync: bool,
    held: Vec<Box<dyn HeldState>>,
}

impl Objects {
    pub fn new(dir: Option<ImageDir>, image_id: &str, fsync: bool) -> Objects {
        Objects {
            map: BTreeMap::new(),
            dir,
            image_id: image_id.to_string(),
            fsync,
            held: Vec::new(),
        }
    }

    pub fn contains(&self, tag: ObjectTag, id: u64) -> bool {
        self.map.contains_key(&(tag, id))
    }

    pub fn insert(&mut self, o: Object) {
        self.map.insert((o.kind.tag(), o.id), o);
    }

    pub fn get_mut(&mut self, tag: ObjectTag, id: u64) -> Option<&mut Object> {
        self.map.get_mut(&(tag, id))
    }

    /// Keep `h` until the processes are let go (see [`HeldState`]).
    pub fn hold(&mut self, h: Box<dyn HeldState>) {
        self.held.push(h);
    }

    /// The objects for the image, and what is held.
    pub fn finish(self) -> (Vec<Object>, Vec<Box<dyn HeldState>>) {
        (self.map.into_values().collect(), self.held)
    }
}

/// One open fd being described.
pub struct OpenFd<'a> {
    pub pid: i32,
    pub fd: i32,
    pub target: &'a FDTarget,
    /// What /proc/PID/fd/N reads.
    pub link: String,
    pub info: FdInfo,
    /// stat() through the magic link: the open file itself (for paths).
    pub md: Option<std::fs::Metadata>,
}

/// What the file kinds describe an fd with.
pub struct FdScan<'a> {
    pub tree: &'a mut TreeFds,
    /// The frozen tree's objects (None: a pre-flight, read no data).
    pub objects: Option<&'a mut Objects>,
}

/// Describe every fd of `pid` (sorted by number). Without `objects`, only
/// decide whether each can be saved (pre-flight).
pub fn describe_all(
    pid: i32,
    tree: &mut TreeFds,
    mut objects: Option<&mut Objects>,
) -> Result<Vec<Fd>, CheckpointError> {
    let list = proc::fds(pid).map_err(|e| CheckpointError::from_sys(pid, e))?;
    let mut out = Vec::with_capacity(list.len());
    for (fd, target) in &list {
        let mut scan = FdScan {
            tree,
            objects: objects.as_deref_mut(),
        };
        match describe(&mut scan, pid, *fd, target) {
            Ok(Some(f)) => out.push(f),
            Ok(None) => {} // closed meanwhile
            Err(why) => {
                return Err(CheckpointError::unsupported(
                    pid,
                    format!("fd {fd} is {why}"),
                ))
            }
        }
    }
    Ok(out)
}

/// Refuse an fd of `pid` that cannot be saved, reading nothing.
pub fn preflight(pid: i32, tree: &mut TreeFds) -> Result<(), CheckpointError> {
    describe_all(pid, tree, None).map(|_| ())
}

/// Describe fd `fd` of `pid`, or say in words why it cannot be saved.
/// `Ok(None)`: it was closed meanwhile.
pub fn describe(
    scan: &mut FdScan<'_>,
    pid: i32,
    fd: i32,
    target: &FDTarget,
) -> Result<Option<Fd>, String> {
    let Ok(info) = proc::fdinfo(pid, fd) else {
        return Ok(None);
    };
    let md = match target {
        FDTarget::Path(_) | FDTarget::MemFD(_) => {
            match std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) {
                Ok(m) => Some(m),
                Err(_) => return Ok(None),
            }
        }
        _ => None,
    };
    let open = OpenFd {
        pid,
        fd,
        target,
        link: proc::target_text(target),
        info,
        md,
    };
    for k in FILE_KINDS {
        if let Some(described) = k.describe(scan, &open) {
            let Some(kind) = described? else {
                return Ok(None); // its kind found it gone
            };
            return Ok(Some(Fd {
                owner: None, // asked of the process (`signal_owners`)
                signal: 0,
                fd,
                flags: open.info.flags,
                pos: open.info.pos,
                path: open.link.clone(),
                shared: None,
                locks: locks::of_fd(&open, scan.tree)?,
                kind,
            }));
        }
    }
    Err(format!("a {} (not supported)", open.link))
}

impl Kind for Fds {
    const NAME: &'static str = "fds";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        if p.fd_table_of.is_some() {
            // Its fds are its table's owner's (kind "tree"), saved there.
            p.fds.clear();
            p.ctty_pty = cx.d.fds.pty_masters.ctty(cx.stat.tty_nr as u64, &[]);
            return Ok(());
        }
        let d = &mut *cx.d;
        // A capture for --verify reads no queued data (as a pre-flight).
        let objects = (!d.verifying()).then_some(&mut d.objects);
        let mut fds = describe_all(pid, &mut d.fds, objects)?;
        // Open file descriptions seen so far, per link text, kept in kcmp's
        // order: one binary search per fd instead of a comparison with every
        // earlier fd of the same name (all eventfds share one name).
        let seen = d.stash.get::<SeenFds>();
        for f in fds.iter_mut() {
            let list = seen.0.entry(f.path.clone()).or_default();
            let at = list.binary_search_by(|&(opid, ofd)| {
                cr_sys::mem::file_order(opid, ofd, pid, f.fd).unwrap_or(std::cmp::Ordering::Less)
            });
            match at {
                Ok(i) => {
                    f.shared = Some(SharedFd {
                        pid: list[i].0 as u32,
                        fd: list[i].1,
                    })
                }
                Err(i) => list.insert(i, (pid, f.fd)),
            }
        }
        signal_owners(cx, &mut fds)?;
        p.fds = fds;
        p.ctty_pty = cx.d.fds.pty_masters.ctty(cx.stat.tty_nr as u64, &p.fds);
        p.ctty_device = tty::ctty_device(cx.stat.tty_nr as u64, cx.stat.session, &p.fds, p.pid);
        Ok(())
    }

    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        for f in &p.fds {
            let cloexec = f.flags as i32 & libc::O_CLOEXEC != 0;
            if let Some(s) = f.shared {
                if s.pid == p.pid
                    && (tty::deferred(p, s.fd)
                        || crate::kinds::eventfds::thread_pidfd(cx.r.ck, p, s.fd))
                {
                    continue; // dup'ed after /dev/tty or the thread is made again
                }
                if crate::kinds::eventfds::copy_of_deferred(cx.r.ck, p, f.fd) {
                    continue; // taken once the whole tree is rebuilt
                }
                share(cx, p, f, s, cloexec)?;
                cx.stub.flush()?;
                continue;
            }
            let opened = FILE_KINDS
                .iter()
                .find_map(|k| k.open(cx, p, f))
                .unwrap_or_else(|| {
                    Err(RestoreError::Unsupported(format!(
                        "fd {} of process {} is of kind {} (no kind of this build opens it)",
                        f.fd,
                        p.pid,
                        f.kind.name()
                    )))
                })?;
            if let Opened::Ours(ours) = opened {
                give(&mut cx.stub, p, f, ours, cloexec)?;
            }
            // What this fd queued (its number, flags, offset) is done
            // before the next is looked at.
            cx.stub.flush()?;
        }
        for k in FILE_KINDS {
            k.after_fds(cx, p)?;
        }
        for f in &p.fds {
            locks::take(&mut cx.stub, f)?;
        }
        take_signal_owners(&mut cx.stub, p)?;
        tty::controlling_tty(cx, p)?;
        tty::reopen_dev_tty(cx, p)?;
        cx.stub.flush()?;
        // A table shared with processes rebuilt after this one keeps the
        // pidfd for them; the last closes it.
        if crate::kinds::tree::restore::last_sharing(cx.r.ck, p, |q| q.fd_table_of) {
            if let Some(h) = cx.stub.grab_pidfd.take() {
                cx.stub.call("close", libc::SYS_close, [h, 0, 0, 0, 0, 0])?;
            }
        }
        Ok(())
    }
}

/// The fds of `p` that share the description of its fd `fd`, opened late
/// (a /dev/tty, a thread's pidfd), made its copies now.
pub fn share_within(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    fd: i32,
) -> Result<(), RestoreError> {
    for d in p
        .fds
        .iter()
        .filter(|d| d.shared.is_some_and(|s| s.pid == p.pid && s.fd == fd))
    {
        let cloexec = ((d.flags as i32) & libc::O_CLOEXEC) as u64;
        cx.stub
            .call(
                "dup3",
                libc::SYS_dup3,
                [fd as u64, d.fd as u64, cloexec, 0, 0, 0],
            )
            .step(|| format!("cannot make fd {} a copy of fd {fd}", d.fd))?;
    }
    Ok(())
}

/// Whether an fd may have an I/O signal owner worth asking for: what
/// delivers SIGIO or SIGURG (sockets, pipes, terminals), any fd in
/// O_ASYNC mode, and one holding a file lease (a break signals the owner,
/// which F_SETLEASE made the process that took it).
fn may_signal(f: &Fd) -> bool {
    f.flags as i32 & libc::O_ASYNC != 0
        || closes_quietly(f)
        || matches!(f.kind, FdKind::Inherited { .. })
        || f.locks.iter().any(|l| l.kind == LockKind::Lease)
}

/// Whether closing a copy of the fd has no effect beyond dropping a
/// reference (pipes, sockets, terminals have no `flush` operation).
fn closes_quietly(f: &Fd) -> bool {
    matches!(
        f.kind,
        FdKind::Pipe { .. }
            | FdKind::Fifo { .. }
            | FdKind::UnixSocket { .. }
            | FdKind::InetSocket { .. }
            | FdKind::Pty { .. }
    )
}

/// F_GETOWN_EX and F_GETSIG of each open file description that may have
/// them (asked once, through its first fd). Read from outside, on a copy
/// of the fd (pidfd_getfd: the same description); only a description with
/// an owner is asked again inside the process, by injected fcntl calls,
/// for the owner's PID as the process sees it (its PID namespace). Each
/// injected call is a round trip through the frozen process.
fn signal_owners(cx: &mut Proc<'_, '_>, fds: &mut [Fd]) -> Result<(), CheckpointError> {
    let pid = cx.pid;
    let sys = |e| CheckpointError::from_sys(pid, e);
    let mut pidfd = None;
    for f in fds
        .iter_mut()
        .filter(|f| f.shared.is_none() && may_signal(f))
    {
        if pidfd.is_none() {
            pidfd = cr_sys::fdio::pidfd_open(pid).ok();
        }
        // From outside, for kinds whose close runs no flush of a driver or
        // file system (our copy is closed right away); any failure (a
        // security module refusing the copy) leaves it to the injected calls.
        let outside = pidfd
            .as_ref()
            .filter(|_| closes_quietly(f))
            .and_then(|pidfd| {
                let ours = cr_sys::fdio::pidfd_getfd(pidfd.as_fd(), pid, f.fd).ok()?;
                cr_sys::fdio::signal_owner(ours.as_fd()).ok()
            });
        if let Some((_, 0, sig)) = outside {
            f.owner = None;
            f.signal = sig;
            continue;
        }
        let scratch = cx.probe.scratch().map_err(sys)?;
        let fd = f.fd as u64;
        let sig = cx
            .probe
            .on(0, |inj| {
                inj.call(
                    "fcntl(F_GETOWN_EX)",
                    libc::SYS_fcntl,
                    [fd, F_GETOWN_EX, scratch, 0, 0, 0],
                )?;
                inj.call(
                    "fcntl(F_GETSIG)",
                    libc::SYS_fcntl,
                    [fd, F_GETSIG, 0, 0, 0, 0],
                )
            })
            .map_err(sys)?;
        let mut raw = [0u8; 8];
        cx.probe.read(0, &mut raw).map_err(sys)?;
        let kind = i32::from_le_bytes([raw[0], raw[1], raw[2], raw[3]]);
        let owner = i32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]);
        f.owner = (owner > 0).then_some(FdOwner { kind, pid: owner });
        f.signal = sig as i32;
    }
    Ok(())
}

/// F_GETSIG / F_SETSIG, F_GETOWN_EX / F_SETOWN_EX (Linux-specific, not in
/// the libc crate).
const F_GETSIG: u64 = 11;
const F_SETSIG: u64 = 10;
const F_SETOWN_EX: u64 = 15;
const F_GETOWN_EX: u64 = 16;

/// Give each open file description its I/O signal owner and signal again.
fn take_signal_owners(stub: &mut Stub<'_>, p: &Process) -> Result<(), RestoreError> {
    for f in p.fds.iter().filter(|f| f.shared.is_none()) {
        let fd = f.fd as u64;
        if let Some(o) = f.owner {
            let mut raw = Vec::with_capacity(8);
            raw.extend_from_slice(&o.kind.to_le_bytes());
            raw.extend_from_slice(&o.pid.to_le_bytes());
            let addr = stub.put(&raw)?;
            stub.call(
                "fcntl(F_SETOWN_EX)",
                libc::SYS_fcntl,
                [fd, F_SETOWN_EX, addr, 0, 0, 0],
            )
            .step(|| {
                format!(
                    "cannot make {} {} the owner of fd {} again",
                    ["thread", "process", "process group"][o.kind.clamp(0, 2) as usize],
                    o.pid,
                    f.fd
                )
            })?;
        }
        if f.signal != 0 {
            stub.call(
                "fcntl(F_SETSIG)",
                libc::SYS_fcntl,
                [fd, F_SETSIG, f.signal as u64, 0, 0, 0],
            )
            .step(|| format!("cannot set the I/O signal of fd {}", f.fd))?;
        }
    }
    Ok(())
}

/// Open file descriptions seen so far in the tree, per link text, in kcmp order.
#[derive(Default)]
struct SeenFds(HashMap<String, Vec<(i32, i32)>>);

/// An O_PATH fd (f_flags as fdinfo shows them): a place in the file
/// system, whatever the file is, opened again by its path (kind "files").
pub fn is_path_only(flags: u32) -> bool {
    flags & libc::O_PATH as u32 != 0
}

/// Open flags that must not be replayed (they act only at open time).
pub const OPEN_ONLY: i32 = libc::O_CREAT | libc::O_EXCL | libc::O_TRUNC | libc::O_NOCTTY;

/// Hand the restorer's description `ours` to the stub as fd `f`, with its
/// status flags (and offset, for files the restorer made).
fn give(
    stub: &mut Stub<'_>,
    p: &Process,
    f: &Fd,
    ours: std::os::fd::OwnedFd,
    cloexec: bool,
) -> Result<(), RestoreError> {
    stub.grab(ours.as_raw_fd(), f.fd, cloexec)
        .step(|| format!("cannot hand {} to process {} as fd {}", f.path, p.pid, f.fd))?;
    let settable =
        libc::O_APPEND | libc::O_ASYNC | libc::O_DIRECT | libc::O_NOATIME | libc::O_NONBLOCK;
    let flags = (f.flags as i32) & !OPEN_ONLY;
    // An O_PATH fd has no status flags to set (fcntl refuses: EBADF).
    if !is_path_only(f.flags) {
        stub.later(
            "fcntl(F_SETFL)",
            libc::SYS_fcntl,
            [
                f.fd as u64,
                libc::F_SETFL as u64,
                (flags & settable) as u64,
                0,
                0,
                0,
            ],
            format!("cannot set the flags of fd {}", f.fd),
        )?;
    }
    if matches!(f.kind, FdKind::Memfd { .. } | FdKind::DeletedFile { .. }) && f.pos != 0 {
        seek(stub, f)?;
    }
    // The grab, its flags and offset in one stop; `ours` is read by it.
    stub.flush()
        .step(|| format!("cannot hand {} to process {} as fd {}", f.path, p.pid, f.fd))?;
    // The process holds it now; ours would only cost an fd.
    drop(ours);
    Ok(())
}

/// lseek fd `f` of the stub to its saved offset: queued
/// ([`Stub::later`]; flushed once the fd is done, see `Fds::restore`).
pub fn seek(stub: &mut Stub<'_>, f: &Fd) -> Result<(), RestoreError> {
    stub.later(
        "lseek",
        libc::SYS_lseek,
        [f.fd as u64, f.pos, libc::SEEK_SET as u64, 0, 0, 0],
        format!("cannot seek fd {} ({}) to {}", f.fd, f.path, f.pos),
    )?;
    Ok(())
}

/// An fd sharing its open file description with an fd restored before it:
/// dup'ed in the same process, or taken from the other process with
/// pidfd_getfd (the same description, so the offset stays shared).
pub(crate) fn share(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    f: &Fd,
    s: SharedFd,
    cloexec: bool,
) -> Result<(), RestoreError> {
    let what = || {
        format!(
            "cannot share fd {} of process {} as fd {}",
            s.fd, s.pid, f.fd
        )
    };
    let flag = if cloexec { libc::O_CLOEXEC as u64 } else { 0 };
    if s.pid == p.pid {
        cx.stub
            .call(
                "dup3",
                libc::SYS_dup3,
                [s.fd as u64, f.fd as u64, flag, 0, 0, 0],
            )
            .step(what)?;
        return Ok(());
    }
    // Taken from the owner's stub by the restorer, then handed over as an
    // fd of ours (`Stub::grab`: one stop for the fd). A child shares most
    // of its fds with its parent (inherited): inside the stub, pidfd_open,
    // pidfd_getfd and close were three calls waited for (six stops) per fd.
    // Not once the stub has let the restorer's pidfd go (fds opened at
    // the end, `restore::open_deferred`).
    let ours = match cx.stub.grab_pidfd {
        Some(_) => cr_sys::fdio::steal_fd(cx.r.ids.outer(s.pid), s.fd).ok(),
        None => None,
    };
    if let Some(ours) = ours {
        cx.stub.grab(ours.as_raw_fd(), f.fd, cloexec).step(what)?;
        cx.stub.flush().step(what)?;
        return Ok(());
    }
    // Not ours to take (the owner's stub is beyond our ptrace rights, e.g.
    // made undumpable): as the stub sees it, by pidfd_open inside the stub
    // (the owner's PID in the stub's namespace).
    let owner = cx.r.ids.inner(s.pid) as u64;
    let stub = &mut cx.stub;
    let pidfd = stub
        .call("pidfd_open", libc::SYS_pidfd_open, [owner, 0, 0, 0, 0, 0])
        .step(what)?;
    let got = stub.call(
        "pidfd_getfd",
        libc::SYS_pidfd_getfd,
        [pidfd, s.fd as u64, 0, 0, 0, 0],
    );
    stub.call("close", libc::SYS_close, [pidfd, 0, 0, 0, 0, 0])?;
    let got = got.step(what)?;
    stub.place(got, f.fd, cloexec).step(what)?;
    Ok(())
}

/// Whether the restore of `p` needs fd number `n`: an fd of it, or the key
/// of an epoll item whose file is open at another number (made for the
/// while of its registration).
pub fn needed(p: &Process, n: i32) -> bool {
    p.fd(n).is_some()
        || p.fds.iter().any(|f| match &f.kind {
            cr_image::model::FdKind::Epoll { items } => {
                items.iter().any(|i| i.tfd == n && i.open_as.is_some())
            }
            _ => false,
        })
}

/// The owner (`p` itself, or the process whose table it shares) of the fd
/// table of image process `p` (kind "tree": CLONE_FILES).
pub fn table_owner<'a>(ck: &'a Checkpoint, p: &'a Process) -> &'a Process {
    p.fd_table_of.and_then(|o| ck.process(o)).unwrap_or(p)
}

/// Close every fd the stub inherited except our pidfd, which moves to a
/// number the image does not use; raise its fd limit so high fd numbers can
/// be restored (the saved limits come back at the end). A stub made with
/// the fd table of a process rebuilt before it (`owner`, see
/// [`table_owner`]) closes nothing: that process emptied the table (and
/// may have filled it already); the pidfd is where it put it.
pub fn keep_only_grab_fd(
    stub: &mut Stub<'_>,
    p: &Process,
    owner: &Process,
    ours: i32,
) -> Result<(), RestoreError> {
    if owner.pid != p.pid {
        raise_fd_limit(stub)?;
        stub.grab_pidfd = Some(grab_fd_number(owner));
        return Ok(());
    }
    let ours = ours as u64;
    if ours > 0 {
        stub.call(
            "close_range",
            libc::SYS_close_range,
            [0, ours - 1, 0, 0, 0, 0],
        )?;
    }
    stub.call(
        "close_range",
        libc::SYS_close_range,
        [ours + 1, u32::MAX as u64, 0, 0, 0, 0],
    )?;
    raise_fd_limit(stub)?;
    let free = grab_fd_number(p);
    if free != ours {
        stub.call(
            "dup3",
            libc::SYS_dup3,
            [ours, free, libc::O_CLOEXEC as u64, 0, 0, 0],
        )
        .step(|| "cannot move the restorer's pidfd in the stub".into())?;
        stub.call("close", libc::SYS_close, [ours, 0, 0, 0, 0, 0])?;
    }
    stub.grab_pidfd = Some(free);
    Ok(())
}

/// Where the restorer's pidfd goes in the table of `p`: the first number
/// its restore does not need.
fn grab_fd_number(p: &Process) -> u64 {
    (0..).find(|&n| !needed(p, n)).unwrap_or(0) as u64
}

/// The stub's soft fd limit raised to its hard one.
fn raise_fd_limit(stub: &mut Stub<'_>) -> Result<(), RestoreError> {
    if let Some(&(_, hard)) = cr_sys::limits::get_all(stub.pid())?.get(libc::RLIMIT_NOFILE as usize)
    {
        cr_sys::limits::set(stub.pid(), libc::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok(())
}

/// One fd of a process and whether it can be saved: a line of
/// `cr_checkpoint --check`.
pub struct Report {
    pub fd: i32,
    /// What it is, in words ("pipe:[123] (read end)", "/var/log/x", ...).
    pub what: String,
    /// Why it cannot be saved.
    pub refused: Option<String>,
}

/// The pre-flight report of every fd of `pid`.
pub fn report(pid: i32, tree: &mut TreeFds) -> Vec<Report> {
    proc::fds(pid)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(fd, target)| {
            let link = proc::target_text(&target);
            let mut scan = FdScan {
                tree: &mut *tree,
                objects: None,
            };
            let r = describe(&mut scan, pid, fd, &target);
            let what = match &r {
                Ok(Some(f)) if matches!(f.kind, FdKind::InetSocket { .. }) => {
                    format!("{link} ({})", crate::kinds::inet::label(pid, fd))
                }
                Ok(Some(f)) => summary(f, &link),
                Ok(None) => return None,
                Err(_) => link.clone(),
            };
            Some(Report {
                fd,
                what,
                refused: r.err(),
            })
        })
        .collect()
}

fn summary(f: &Fd, link: &str) -> String {
    let end = match f.flags as i32 & libc::O_ACCMODE {
        libc::O_RDONLY => "read",
        libc::O_WRONLY => "write",
        _ => "read/write",
    };
    match &f.kind {
        FdKind::Pipe { .. } => format!("{link} ({end} end)"),
        FdKind::Inherited { outside, .. } => {
            format!("{link}: {outside} (external: cr_restart gives it, see --inherit-fd)")
        }
        FdKind::Epoll { items } => format!("{link} ({} watched fds)", items.len()),
        FdKind::Inotify { watches } => format!("{link} ({} watches)", watches.len()),
        FdKind::Fanotify { marks, .. } => format!("{link} ({} marks)", marks.len()),
        k => {
            let name = k.name().replace('_', " ");
            if link.starts_with('/') {
                format!("{link} ({name})")
            } else {
                format!("{link} ({name}, {end})")
            }
        }
    }
}

/// `--verify`: the same fd numbers, each with its flags, offset, what it
/// is (its kind and the state the kind keeps in the fd: an eventfd's
/// count, an epoll's interest list...), the fd it shares its description
/// with, its locks, and for files their path (objects such as pipes and
/// sockets are made anew: their inode numbers differ).
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    let numbers = |v: &[Fd]| v.iter().map(|f| f.fd).collect::<Vec<_>>();
    if !c.same_list("fds", "open fd", &numbers(&image.fds), &numbers(&now.fds)) {
        return;
    }
    for a in &image.fds {
        let Some(b) = now.fd(a.fd) else { continue };
        let what = format!("fd {} ({})", a.fd, a.path);
        // What led outside the tree is what the user bound it to.
        if matches!(a.kind, FdKind::Inherited { .. }) {
            continue;
        }
        // mq_open sets no O_LARGEFILE, any open() does (a queue is
        // reopened through /proc); it means nothing for a queue.
        let (fa, fb) = match a.kind {
            FdKind::Mqueue { .. } => (a.flags & !0o100000, b.flags & !0o100000),
            _ => (a.flags, b.flags),
        };
        c.same(&what, "flags", &fa, &fb);
        c.same(&what, "offset", &a.pos, &b.pos);
        c.same(&what, "kind", a.kind.name(), b.kind.name());
        let shared = b.shared.map(|s| SharedFd {
            pid: c.image_pid(s.pid),
            fd: s.fd,
        });
        c.same(
            &what,
            "shares its open file description with",
            &a.shared,
            &shared,
        );
        c.same(&what, "locks", &a.locks, &b.locks);
        c.same(&what, "I/O signal owner (F_SETOWN)", &a.owner, &b.owner);
        c.same(&what, "I/O signal (F_SETSIG)", &a.signal, &b.signal);
        match (&a.kind, &b.kind) {
            // A file's size is the file's, outside the image (checked by
            // kind "outside" before the restore), not the fd's.
            (FdKind::Regular { .. } | FdKind::PathOnly, _) => {
                c.same(&what, "path", &a.path, &b.path);
            }
            (
                FdKind::Directory
                | FdKind::CharDevice { .. }
                | FdKind::BlockDevice { .. }
                | FdKind::RemovedSymlink { .. },
                _,
            ) => {
                c.same(&what, "path", &a.path, &b.path);
                c.same(&what, "state", &a.kind, &b.kind);
            }
            // A new memfd of the same name (a deleted file comes back as
            // an unnamed file of its directory).
            (FdKind::Memfd { .. }, _) => {
                c.same(&what, "path", &a.path, &b.path);
            }
            // A restored timerfd is armed only when the tree runs.
            (FdKind::Timerfd(x), FdKind::Timerfd(y)) if c.restored => {
                c.same(&what, "clock", &x.clockid, &y.clockid);
            }
            (FdKind::Timerfd(x), FdKind::Timerfd(y)) => {
                let t =
                    |t: &cr_image::model::fds::TimerFd| (t.clockid, t.settime_flags, t.interval_ns);
                c.same(&what, "(clock, flags, interval)", &t(x), &t(y));
            }
            // Its path names the namespace, made again (another inode).
            (FdKind::NsFile { .. }, _) => {
                c.same(&what, "namespace", &a.kind, &b.kind);
            }
            (FdKind::Pty { master: x, .. }, FdKind::Pty { master: y, .. }) => {
                c.same(&what, "pty end (master)", x, y);
            }
            (FdKind::Pidfd { pid: x, .. }, FdKind::Pidfd { pid: y, .. }) => {
                let y = c.image_pid(*y);
                // A thread's (PIDFD_THREAD) keeps its id, as seen from
                // here unless the image has a PID namespace of its own.
                if x == &y || !c.pidns || c.is_image_pid(*x) {
                    c.same(&what, "pidfd of process", x, &y);
                }
            }
            // The kernel lists an interest list in its own order.
            (FdKind::Epoll { items: x }, FdKind::Epoll { items: y }) => {
                // A fired one-shot item whose file was ready for nothing
                // comes back armed for errors and hang-ups (see
                // `eventfds::after_fds`).
                let quiet = (libc::EPOLLERR | libc::EPOLLHUP) as u32;
                let sorted = |v: &[cr_image::model::fds::EpollItem]| {
                    let mut v = v.to_vec();
                    for i in v.iter_mut() {
                        if crate::kinds::eventfds::disarmed(i.events & !quiet) {
                            i.events &= !quiet;
                        }
                    }
                    v.sort_by_key(|i| (i.tfd, i.events, i.data));
                    v
                };
                c.same_list(&what, "epoll item", &sorted(x), &sorted(y));
            }
            // A removed file watched is a copy made anew (another inode).
            (FdKind::Inotify { watches: x }, FdKind::Inotify { watches: y }) => {
                let shown = |v: &[cr_image::model::fds::InotifyWatch]| {
                    v.iter()
                        .map(|w| (w.wd, w.mask, w.path.clone(), w.deleted_file.is_some()))
                        .collect::<Vec<_>>()
                };
                c.same_list(&what, "inotify watch", &shown(x), &shown(y));
            }
            // The kernel lists a group's marks newest first. An ignore
            // mask without FAN_MARK_IGNORED_SURV_MODIFY is the kernel's to
            // clear at the next change of the file (or anywhere on the
            // mount or filesystem): not compared.
            (
                FdKind::Fanotify {
                    flags: fx,
                    event_flags: ex,
                    marks: x,
                },
                FdKind::Fanotify {
                    flags: fy,
                    event_flags: ey,
                    marks: y,
                },
            ) => {
                c.same(&what, "fanotify flags", &(fx, ex), &(fy, ey));
                let sorted = |v: &[cr_image::model::fds::FanotifyMark]| {
                    let mut v = v.to_vec();
                    for m in &mut v {
                        if m.mflags & libc::FAN_MARK_IGNORED_SURV_MODIFY == 0 {
                            m.ignored_mask = 0;
                        }
                    }
                    v.sort();
                    v
                };
                c.same_list(&what, "fanotify mark", &sorted(x), &sorted(y));
            }
            (
                FdKind::Eventfd { .. }
                | FdKind::Signalfd { .. }
                | FdKind::Epoll { .. }
                | FdKind::Inotify { .. },
                _,
            ) => {
                c.same(&what, "state", &a.kind, &b.kind);
            }
            // Objects made anew (pipes, sockets: their data is the
            // image's), or what leads outside the tree.
            _ => {}
        }
    }
}
