//! Section of kind "fds": the fd table of a process. Each fd has its
//! number, open flags and offset, the earlier fd it shares its open file
//! description with (if any), the locks held through it (kind "locks"),
//! and what it is: one case per kind of open file (files, pipes, unix,
//! inet, eventfds, tty); the state those kinds share between fds lives in
//! the image's objects.

use super::objects::ObjectTag;
use super::pb;
use super::{known, ser, Bad, Process};
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// struct termios as TCGETS fills it.
pub const TERMIOS_LEN: usize = 60;
/// struct winsize.
pub const WINSIZE_LEN: usize = 8;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fd {
    pub fd: i32,
    /// f_flags from fdinfo (O_ACCMODE, O_APPEND, O_CLOEXEC...).
    pub flags: u32,
    pub pos: u64,
    /// What /proc/PID/fd/N read.
    pub path: String,
    /// The same open file description as this earlier fd.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedFd>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub locks: Vec<FileLock>,
    /// F_SETOWN_EX of its open file description (None: nobody).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub owner: Option<FdOwner>,
    /// F_SETSIG (0: SIGIO).
    #[serde(skip_serializing_if = "is_zero")]
    pub signal: i32,
    #[serde(flatten)]
    pub kind: FdKind,
}

fn is_zero(v: &i32) -> bool {
    *v == 0
}

/// struct f_owner_ex: who gets an open file description's I/O signals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FdOwner {
    /// F_OWNER_TID (0), F_OWNER_PID (1) or F_OWNER_PGRP (2).
    pub kind: i32,
    /// As the process sees it (inside its PID namespace).
    pub pid: i32,
}

/// An fd of an earlier process of the image (or of the same process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SharedFd {
    pub pid: u32,
    pub fd: i32,
}

/// What an fd is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum FdKind {
    // kind "files"
    Regular {
        size: u64,
        /// A hard link the checkpoint made to a file whose opened name
        /// was removed while it kept other names (see
        /// `cr_engine::kinds::files::relink`).
        #[serde(skip_serializing_if = "Option::is_none")]
        relink: Option<String>,
    },
    Directory,
    /// A device node: `mode` its permission bits, `uid` and `gid` its
    /// owner (a removed node is made again with them).
    CharDevice {
        rdev: u64,
        #[serde(serialize_with = "ser::octal")]
        mode: u32,
        uid: u32,
        gid: u32,
    },
    /// A block device opened by path (its content is the disk's); the
    /// rest as for a character device.
    BlockDevice {
        rdev: u64,
        #[serde(serialize_with = "ser::octal")]
        mode: u32,
        uid: u32,
        gid: u32,
    },
    Memfd {
        object: u64,
    },
    /// Unlinked while open, or made with O_TMPFILE.
    DeletedFile {
        object: u64,
    },
    // kind "pipes"
    Pipe {
        object: u64,
    },
    Fifo {
        object: u64,
    },
    // kind "unix"
    UnixSocket {
        object: u64,
    },
    // kind "inet"
    InetSocket {
        object: u64,
    },
    // kind "netlink"
    NetlinkSocket {
        object: u64,
    },
    // kind "packet"
    PacketSocket {
        object: u64,
    },
    // kind "mqueue"
    Mqueue {
        object: u64,
    },
    // kind "bpf": a BPF map (its access mode is the fd's O_ACCMODE)
    BpfMap {
        object: u64,
    },
    // kind "eventfds"
    Eventfd {
        count: u64,
        semaphore: bool,
    },
    Signalfd {
        #[serde(serialize_with = "ser::hex")]
        mask: u64,
    },
    Timerfd(TimerFd),
    Epoll {
        items: Vec<EpollItem>,
    },
    Inotify {
        watches: Vec<InotifyWatch>,
    },
    /// A fanotify group: fanotify_init's flags and event flags, and its
    /// marks.
    Fanotify {
        flags: u32,
        event_flags: u32,
        marks: Vec<FanotifyMark>,
    },
    /// An O_PATH fd of a FIFO, socket file or device.
    PathOnly,
    /// An O_PATH fd of a symbolic link removed since (its path is
    /// "PATH (deleted)"): its target and owner.
    RemovedSymlink {
        target: Vec<u8>,
        uid: u32,
        gid: u32,
    },
    /// A pidfd of process `pid` of the image (0: of a process that had
    /// exited, which `dead` names: the pidfds of one such process share
    /// it, its pidfs inode number).
    Pidfd {
        pid: u32,
        dead: u64,
    },
    /// An fd of a namespace file (/proc/PID/ns/KIND; its path
    /// "KIND:[INODE]"): the namespace of kind `ns` ("net", "pid"...)
    /// the process is in, or (`host`) the checkpointer's, which it was not
    /// in. Opened again on the restored process's, or the restorer's.
    NsFile {
        ns: String,
        host: bool,
    },
    // kind "tty"
    Pty {
        object: u64,
        master: bool,
    },
    /// Leads outside the image ("external"): restored as what the user
    /// binds it to (`cr_restart --inherit-fd`); fds 0-2 by default as
    /// cr_restart's own. A terminal has its settings (else both are
    /// empty). `outside` says what it led to.
    Inherited {
        #[serde(skip)]
        termios: Vec<u8>,
        #[serde(skip)]
        winsize: Vec<u8>,
        outside: String,
    },
}

/// The kinds of namespaces an [`FdKind::NsFile`] may be of (the names of
/// their files in /proc/PID/ns, and of their links' text).
pub const NS_KINDS: &[&str] = &["cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts"];

impl FdKind {
    /// The object this fd opens, if any.
    pub fn object(&self) -> Option<(ObjectTag, u64)> {
        Some(match *self {
            FdKind::Memfd { object } => (ObjectTag::Memfd, object),
            FdKind::DeletedFile { object } => (ObjectTag::DeletedFile, object),
            FdKind::Pipe { object } => (ObjectTag::Pipe, object),
            FdKind::Fifo { object } => (ObjectTag::Fifo, object),
            FdKind::UnixSocket { object } => (ObjectTag::UnixSocket, object),
            FdKind::InetSocket { object } => (ObjectTag::InetSocket, object),
            FdKind::NetlinkSocket { object } => (ObjectTag::NetlinkSocket, object),
            FdKind::PacketSocket { object } => (ObjectTag::PacketSocket, object),
            FdKind::Mqueue { object } => (ObjectTag::Mqueue, object),
            FdKind::BpfMap { object } => (ObjectTag::BpfMap, object),
            FdKind::Pty { object, .. } => (ObjectTag::Pty, object),
            _ => return None,
        })
    }

    /// A short name ("pipe", "unix_socket"...).
    pub fn name(&self) -> &'static str {
        match self {
            FdKind::Regular { .. } => "regular",
            FdKind::Directory => "directory",
            FdKind::CharDevice { .. } => "char_device",
            FdKind::BlockDevice { .. } => "block_device",
            FdKind::Memfd { .. } => "memfd",
            FdKind::DeletedFile { .. } => "deleted_file",
            FdKind::Pipe { .. } => "pipe",
            FdKind::Fifo { .. } => "fifo",
            FdKind::UnixSocket { .. } => "unix_socket",
            FdKind::InetSocket { .. } => "inet_socket",
            FdKind::NetlinkSocket { .. } => "netlink_socket",
            FdKind::PacketSocket { .. } => "packet_socket",
            FdKind::Mqueue { .. } => "mqueue",
            FdKind::BpfMap { .. } => "bpf_map",
            FdKind::Eventfd { .. } => "eventfd",
            FdKind::Signalfd { .. } => "signalfd",
            FdKind::Timerfd(_) => "timerfd",
            FdKind::Epoll { .. } => "epoll",
            FdKind::Inotify { .. } => "inotify",
            FdKind::Fanotify { .. } => "fanotify",
            FdKind::Pidfd { .. } => "pidfd",
            FdKind::PathOnly => "path_only",
            FdKind::RemovedSymlink { .. } => "removed_symlink",
            FdKind::NsFile { .. } => "ns_file",
            FdKind::Pty { .. } => "pty",
            FdKind::Inherited { .. } => "inherited",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct TimerFd {
    pub clockid: i32,
    /// Expirations not yet read.
    pub ticks: u64,
    /// TFD_TIMER_ABSTIME / TFD_TIMER_CANCEL_ON_SET.
    pub settime_flags: u32,
    /// Time left (0: disarmed; an absolute timer: its deadline).
    pub value_ns: u64,
    pub interval_ns: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EpollItem {
    /// The watched fd, in the same process (the item's key).
    pub tfd: i32,
    pub events: u32,
    pub data: u64,
    /// The watched file is open as this fd instead (`tfd` was closed after
    /// a dup): `tfd` is made its copy for the while of the registration.
    pub open_as: Option<i32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InotifyWatch {
    pub wd: i32,
    pub mask: u32,
    pub path: String,
    /// A watched file removed since: its `DeletedFile` object.
    pub deleted_file: Option<u64>,
}

/// One mark of a fanotify group.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct FanotifyMark {
    pub on: FanotifyMarkOn,
    /// The marked file (found from its file handle), or a mount point of
    /// the marked mount or filesystem.
    pub path: String,
    /// FAN_MARK_IGNORED_SURV_MODIFY, FAN_MARK_EVICTABLE, FAN_MARK_IGNORE.
    pub mflags: u32,
    pub mask: u32,
    pub ignored_mask: u32,
}

/// What a fanotify mark is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FanotifyMarkOn {
    Inode,
    Mount,
    Filesystem,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LockKind {
    Flock,
    Posix,
    Ofd,
    /// A file lease (F_SETLEASE), held by the open file description.
    Lease,
}

impl LockKind {
    pub fn name(self) -> &'static str {
        match self {
            LockKind::Flock => "flock",
            LockKind::Posix => "posix",
            LockKind::Ofd => "ofd",
            LockKind::Lease => "lease",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct FileLock {
    pub kind: LockKind,
    /// Of a lease: the type it was taken with (a write lease stays one
    /// while it is broken).
    pub write: bool,
    pub start: u64,
    /// 0: to the end of the file and beyond.
    pub len: u64,
    /// A lease being broken: the type its holder must give it up to.
    pub breaking: Option<LeaseBreak>,
}

/// What a lease being broken must become (F_GETLEASE gives it meanwhile).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LeaseBreak {
    /// A write lease downgraded to a read lease (a reader opened the file).
    ToRead,
    /// Given up (a writer opened the file, or a reader a write-leased one).
    ToUnlock,
}

/// Clocks a timerfd may use.
const TIMER_CLOCKS: &[i32] = &[0, 1, 7, 8, 9];

impl Fd {
    pub(crate) fn from_pb(f: pb::Fd) -> Result<Fd, Bad> {
        use pb::fd::Kind as K;
        if f.fd < 0 {
            return Err("a negative fd number".into());
        }
        let obj = |r: pb::ObjectRef| r.id;
        let kind = match f.kind {
            None => return Err("of a kind this build does not know".into()),
            Some(K::Regular(r)) => FdKind::Regular {
                size: r.size,
                relink: (!r.relink.is_empty()).then_some(r.relink),
            },
            Some(K::Directory(_)) => FdKind::Directory,
            Some(K::CharDevice(c)) => FdKind::CharDevice {
                rdev: c.rdev,
                mode: c.mode,
                uid: c.uid,
                gid: c.gid,
            },
            Some(K::BlockDevice(c)) => FdKind::BlockDevice {
                rdev: c.rdev,
                mode: c.mode,
                uid: c.uid,
                gid: c.gid,
            },
            Some(K::Memfd(r)) => FdKind::Memfd { object: obj(r) },
            Some(K::DeletedFile(r)) => FdKind::DeletedFile { object: obj(r) },
            Some(K::Pipe(r)) => FdKind::Pipe { object: obj(r) },
            Some(K::Fifo(r)) => FdKind::Fifo { object: obj(r) },
            Some(K::UnixSocket(r)) => FdKind::UnixSocket { object: obj(r) },
            Some(K::InetSocket(r)) => FdKind::InetSocket { object: obj(r) },
            Some(K::NetlinkSocket(r)) => FdKind::NetlinkSocket { object: obj(r) },
            Some(K::PacketSocket(r)) => FdKind::PacketSocket { object: obj(r) },
            Some(K::Mqueue(r)) => FdKind::Mqueue { object: obj(r) },
            Some(K::BpfMap(r)) => FdKind::BpfMap { object: obj(r) },
            Some(K::Eventfd(e)) => FdKind::Eventfd {
                count: e.count,
                semaphore: e.semaphore,
            },
            Some(K::Signalfd(s)) => FdKind::Signalfd { mask: s.mask },
            Some(K::Timerfd(t)) => {
                if !TIMER_CLOCKS.contains(&t.clockid) {
                    return Err(format!("a timerfd on clock {}", t.clockid));
                }
                FdKind::Timerfd(TimerFd {
                    clockid: t.clockid,
                    ticks: t.ticks,
                    settime_flags: t.settime_flags,
                    value_ns: t.value_ns,
                    interval_ns: t.interval_ns,
                })
            }
            Some(K::Epoll(e)) => FdKind::Epoll {
                items: e
                    .items
                    .into_iter()
                    .map(|i| EpollItem {
                        tfd: i.tfd,
                        events: i.events,
                        data: i.data,
                        open_as: i.open_as,
                    })
                    .collect(),
            },
            Some(K::Inotify(i)) => FdKind::Inotify {
                watches: i
                    .watches
                    .into_iter()
                    .map(|w| InotifyWatch {
                        wd: w.wd,
                        mask: w.mask,
                        path: w.path,
                        deleted_file: (w.deleted_file != 0).then_some(w.deleted_file),
                    })
                    .collect(),
            },
            Some(K::Fanotify(g)) => FdKind::Fanotify {
                flags: g.flags,
                event_flags: g.event_flags,
                marks: g
                    .marks
                    .into_iter()
                    .map(|m| {
                        let on = match known(m.on, "a fanotify mark")? {
                            pb::FanotifyMarkOn::Unspecified => {
                                return Err("a fanotify mark on something unknown".to_string())
                            }
                            pb::FanotifyMarkOn::FanotifyInode => FanotifyMarkOn::Inode,
                            pb::FanotifyMarkOn::FanotifyMount => FanotifyMarkOn::Mount,
                            pb::FanotifyMarkOn::FanotifyFilesystem => FanotifyMarkOn::Filesystem,
                        };
                        Ok(FanotifyMark {
                            on,
                            path: m.path,
                            mflags: m.mflags,
                            mask: m.mask,
                            ignored_mask: m.ignored_mask,
                        })
                    })
                    .collect::<Result<_, _>>()?,
            },
            Some(K::Pidfd(p)) => FdKind::Pidfd {
                pid: p.pid,
                dead: p.dead,
            },
            Some(K::PathOnly(_)) => FdKind::PathOnly,
            Some(K::RemovedSymlink(s)) => FdKind::RemovedSymlink {
                target: s.target,
                uid: s.uid,
                gid: s.gid,
            },
            Some(K::NsFile(n)) => {
                if !NS_KINDS.contains(&n.ns.as_str()) {
                    return Err(format!("a namespace fd of unknown kind {:?}", n.ns));
                }
                FdKind::NsFile {
                    ns: n.ns,
                    host: n.host,
                }
            }
            Some(K::Pty(p)) => FdKind::Pty {
                object: p.id,
                master: p.master,
            },
            Some(K::Inherited(i)) => {
                let ok = (i.termios.is_empty() || i.termios.len() == TERMIOS_LEN)
                    && (i.winsize.is_empty() || i.winsize.len() == WINSIZE_LEN);
                if !ok {
                    return Err("damaged terminal settings".into());
                }
                FdKind::Inherited {
                    termios: i.termios,
                    winsize: i.winsize,
                    outside: i.outside,
                }
            }
        };
        let locks = f
            .locks
            .into_iter()
            .map(|l| {
                let kind = match known(l.kind, "a lock")? {
                    pb::LockKind::Unspecified => return Err("a lock of unknown kind".into()),
                    pb::LockKind::Flock => LockKind::Flock,
                    pb::LockKind::Posix => LockKind::Posix,
                    pb::LockKind::Ofd => LockKind::Ofd,
                    pb::LockKind::Lease => LockKind::Lease,
                };
                if l.start > i64::MAX as u64 || l.len > i64::MAX as u64 {
                    return Err(format!("a lock on bytes {}+{}", l.start, l.len));
                }
                let breaking = match known(l.breaking, "a lease break")? {
                    pb::LeaseBreak::LeaseNotBreaking => None,
                    pb::LeaseBreak::LeaseBreakingToRead => Some(LeaseBreak::ToRead),
                    pb::LeaseBreak::LeaseBreakingToUnlock => Some(LeaseBreak::ToUnlock),
                };
                if breaking.is_some() && kind != LockKind::Lease {
                    return Err(format!("a {} lock being broken", kind.name()));
                }
                if breaking == Some(LeaseBreak::ToRead) && !l.write {
                    return Err("a read lease being broken to a read lease".into());
                }
                Ok(FileLock {
                    kind,
                    write: l.write,
                    start: l.start,
                    len: l.len,
                    breaking,
                })
            })
            .collect::<Result<_, Bad>>()?;
        if let Some(o) = &f.owner {
            if !(0..=2).contains(&o.kind) || o.pid <= 0 {
                return Err(format!("an owner {} of type {}", o.pid, o.kind));
            }
        }
        if !(0..=64).contains(&f.signal) {
            return Err(format!("I/O signal {}", f.signal));
        }
        Ok(Fd {
            owner: f.owner.map(|o| FdOwner {
                kind: o.kind,
                pid: o.pid,
            }),
            signal: f.signal,
            fd: f.fd,
            flags: f.flags,
            pos: f.pos,
            path: f.path,
            shared: f.shared.map(|s| SharedFd {
                pid: s.pid,
                fd: s.fd,
            }),
            locks,
            kind,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::Fd {
        use pb::fd::Kind as K;
        let r = |id: u64| pb::ObjectRef { id };
        let kind = match &self.kind {
            FdKind::Regular { size, relink } => K::Regular(pb::RegularFile {
                size: *size,
                relink: relink.clone().unwrap_or_default(),
            }),
            FdKind::Directory => K::Directory(pb::Empty {}),
            FdKind::CharDevice {
                rdev,
                mode,
                uid,
                gid,
            } => K::CharDevice(pb::CharDevice {
                rdev: *rdev,
                mode: *mode,
                uid: *uid,
                gid: *gid,
            }),
            FdKind::BlockDevice {
                rdev,
                mode,
                uid,
                gid,
            } => K::BlockDevice(pb::CharDevice {
                rdev: *rdev,
                mode: *mode,
                uid: *uid,
                gid: *gid,
            }),
            FdKind::Memfd { object } => K::Memfd(r(*object)),
            FdKind::DeletedFile { object } => K::DeletedFile(r(*object)),
            FdKind::Pipe { object } => K::Pipe(r(*object)),
            FdKind::Fifo { object } => K::Fifo(r(*object)),
            FdKind::UnixSocket { object } => K::UnixSocket(r(*object)),
            FdKind::InetSocket { object } => K::InetSocket(r(*object)),
            FdKind::NetlinkSocket { object } => K::NetlinkSocket(r(*object)),
            FdKind::PacketSocket { object } => K::PacketSocket(r(*object)),
            FdKind::Mqueue { object } => K::Mqueue(r(*object)),
            FdKind::BpfMap { object } => K::BpfMap(r(*object)),
            FdKind::Eventfd { count, semaphore } => K::Eventfd(pb::Eventfd {
                count: *count,
                semaphore: *semaphore,
            }),
            FdKind::Signalfd { mask } => K::Signalfd(pb::Signalfd { mask: *mask }),
            FdKind::Timerfd(t) => K::Timerfd(pb::TimerFd {
                clockid: t.clockid,
                ticks: t.ticks,
                settime_flags: t.settime_flags,
                value_ns: t.value_ns,
                interval_ns: t.interval_ns,
            }),
            FdKind::Epoll { items } => K::Epoll(pb::Epoll {
                items: items
                    .iter()
                    .map(|i| pb::EpollItem {
                        tfd: i.tfd,
                        events: i.events,
                        data: i.data,
                        open_as: i.open_as,
                    })
                    .collect(),
            }),
            FdKind::Inotify { watches } => K::Inotify(pb::Inotify {
                watches: watches
                    .iter()
                    .map(|w| pb::InotifyWatch {
                        wd: w.wd,
                        mask: w.mask,
                        path: w.path.clone(),
                        deleted_file: w.deleted_file.unwrap_or(0),
                    })
                    .collect(),
            }),
            FdKind::Fanotify {
                flags,
                event_flags,
                marks,
            } => K::Fanotify(pb::Fanotify {
                flags: *flags,
                event_flags: *event_flags,
                marks: marks
                    .iter()
                    .map(|m| pb::FanotifyMark {
                        on: match m.on {
                            FanotifyMarkOn::Inode => pb::FanotifyMarkOn::FanotifyInode,
                            FanotifyMarkOn::Mount => pb::FanotifyMarkOn::FanotifyMount,
                            FanotifyMarkOn::Filesystem => pb::FanotifyMarkOn::FanotifyFilesystem,
                        } as i32,
                        path: m.path.clone(),
                        mflags: m.mflags,
                        mask: m.mask,
                        ignored_mask: m.ignored_mask,
                    })
                    .collect(),
            }),
            FdKind::Pidfd { pid, dead } => K::Pidfd(pb::Pidfd {
                pid: *pid,
                dead: *dead,
            }),
            FdKind::PathOnly => K::PathOnly(pb::Empty {}),
            FdKind::RemovedSymlink { target, uid, gid } => K::RemovedSymlink(pb::RemovedSymlink {
                target: target.clone(),
                uid: *uid,
                gid: *gid,
            }),
            FdKind::NsFile { ns, host } => K::NsFile(pb::NsFile {
                ns: ns.clone(),
                host: *host,
            }),
            FdKind::Pty { object, master } => K::Pty(pb::PtyEnd {
                id: *object,
                master: *master,
            }),
            FdKind::Inherited {
                termios,
                winsize,
                outside,
            } => K::Inherited(pb::Inherited {
                termios: termios.clone(),
                winsize: winsize.clone(),
                outside: outside.clone(),
            }),
        };
        pb::Fd {
            owner: self.owner.map(|o| pb::FdOwner {
                kind: o.kind,
                pid: o.pid,
            }),
            signal: self.signal,
            fd: self.fd,
            flags: self.flags,
            pos: self.pos,
            path: self.path.clone(),
            shared: self.shared.map(|s| pb::SharedFd {
                pid: s.pid,
                fd: s.fd,
            }),
            locks: self
                .locks
                .iter()
                .map(|l| pb::FileLock {
                    kind: (match l.kind {
                        LockKind::Flock => pb::LockKind::Flock,
                        LockKind::Posix => pb::LockKind::Posix,
                        LockKind::Ofd => pb::LockKind::Ofd,
                        LockKind::Lease => pb::LockKind::Lease,
                    }) as i32,
                    write: l.write,
                    start: l.start,
                    len: l.len,
                    breaking: (match l.breaking {
                        None => pb::LeaseBreak::LeaseNotBreaking,
                        Some(LeaseBreak::ToRead) => pb::LeaseBreak::LeaseBreakingToRead,
                        Some(LeaseBreak::ToUnlock) => pb::LeaseBreak::LeaseBreakingToUnlock,
                    }) as i32,
                })
                .collect(),
            kind: Some(kind),
        }
    }
}

/// The fd table of process `p` (number `i` of the image): sorted, unique
/// numbers; every object it opens is in the image; every fd it shares was
/// restored before it; every watched fd of an epoll is open.
pub(crate) fn validate(
    p: &Process,
    i: usize,
    pids: &HashMap<u32, usize>,
    procs: &[Process],
    objects: &HashSet<(ObjectTag, u64)>,
) -> Result<(), Bad> {
    for w in p.fds.windows(2) {
        if w[1].fd <= w[0].fd {
            return Err(format!("fd {} is out of order", w[1].fd));
        }
    }
    for f in &p.fds {
        let bad = |what: String| Err(format!("fd {}: {what}", f.fd));
        if let Some((tag, id)) = f.kind.object() {
            if !objects.contains(&(tag, id)) {
                return bad(format!("refers to {tag:?} {id}, missing from the image"));
            }
        }
        if let Some(s) = f.shared {
            let owner = pids.get(&s.pid).map(|&j| (j, &procs[j]));
            let ok = match owner {
                Some((j, q)) if j < i => q.fd(s.fd).is_some(),
                Some((j, q)) if j == i => s.fd < f.fd && q.fd(s.fd).is_some(),
                _ => false,
            };
            if !ok {
                return bad(format!(
                    "shares fd {} of process {}, which is not restored before it",
                    s.fd, s.pid
                ));
            }
        }
        if let FdKind::Epoll { items } = &f.kind {
            if let Some(it) = items
                .iter()
                .find(|it| p.fd(it.open_as.unwrap_or(it.tfd)).is_none())
            {
                return bad(format!("watches fd {}, which is not open", it.tfd));
            }
        }
        if let FdKind::Pidfd { pid, .. } = f.kind {
            // (Or of a thread, PIDFD_THREAD: its id.)
            let thread = || procs.iter().any(|q| q.threads.iter().any(|t| t.tid == pid));
            if pid != 0 && !pids.contains_key(&pid) && !thread() {
                return bad(format!(
                    "is a pidfd of process or thread {pid}, not in the image"
                ));
            }
        }
    }
    Ok(())
}
