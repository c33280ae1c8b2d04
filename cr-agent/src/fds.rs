//! Open file descriptors: what each one is, whether it can be saved, and
//! its state.
//!
//! Saved: regular files and directories (with their locks), the stateless
//! character devices, pipes and FIFOs (with the bytes buffered in them),
//! unix sockets ([`crate::unix`]), eventfd, epoll, signalfd, timerfd,
//! inotify, memfds and files deleted while open ([`crate::objects`]), and
//! fds connected to something outside the tree (the terminal or pipe a job
//! was started with), which a restore takes from `cr_restart` itself.
//!
//! [`describe`] answers for one fd; [`Scan`] holds what needs the whole
//! tree at once (which pipe ends and sockets the tree holds). The same code
//! runs for the pre-flight (`cr_checkpoint --check`, and before any freeze)
//! without reading data, and on the frozen tree with data.

use crate::objects::Objects;
use cr_image::proto;
use cr_sys::proc::{self, dev_major as major, dev_minor as minor};
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// (major, minor) of the character devices that carry no state.
const SAFE_CHAR_DEVICES: &[(u64, u64, &str)] = &[
    (1, 3, "/dev/null"),
    (1, 5, "/dev/zero"),
    (1, 7, "/dev/full"),
    (1, 8, "/dev/random"),
    (1, 9, "/dev/urandom"),
];

/// Terminal devices: the console and virtual terminals (4), /dev/tty,
/// console and ptmx (5), pty slaves (136-143).
fn is_tty_dev(rdev: u64) -> bool {
    matches!(major(rdev), 4 | 5 | 136..=143)
}

/// The index of the pty pair held by the tree that is the controlling
/// terminal `tty_nr` (field 7 of /proc/PID/stat), if it is one.
pub fn ctty_pty(tty_nr: u64, masters: &HashSet<u32>) -> Option<u32> {
    proc::pty_slave_index(tty_nr).filter(|i| masters.contains(i))
}

/// What the whole tree holds, gathered before any fd is described.
#[derive(Default)]
pub struct Scan {
    pids: HashSet<i32>,
    /// Pipe inode -> (a read end is open in the tree, a write end is).
    pipe_ends: HashMap<u64, (bool, bool)>,
    /// Socket inodes open in the tree.
    sockets: HashSet<u64>,
    /// Unix sockets of the host, by inode (sock_diag), loaded on first need.
    unix: Option<HashMap<u64, cr_sys::unix_diag::UnixSock>>,
    /// Pipe inode -> whether a process outside the tree holds it (cached).
    outside: HashMap<u64, Option<i32>>,
    /// Indexes of the pty pairs whose master the tree holds.
    pub pty_masters: HashSet<u32>,
    /// `--check`: also look into socket queues (see [`crate::unix`]).
    pub deep: bool,
    /// The dump ends with the processes killed or stopped: TCP connections
    /// are held by the network lock and stay in repair mode.
    pub lock_network: bool,
    /// Drop connections not yet accepted by a TCP listener instead of
    /// refusing the dump (`--tcp-skip-in-flight`).
    pub skip_in_flight: bool,
    /// Fresh sockets whose options are the defaults (see [`crate::inet`]).
    pub fresh: crate::inet::Fresh,
}

impl Scan {
    /// Look at every fd of `pids` (the tree).
    pub fn new(pids: &[i32]) -> Scan {
        let mut s = Scan {
            pids: pids.iter().copied().collect(),
            ..Default::default()
        };
        for &pid in pids {
            for (fd, link) in proc::list_fds(pid).unwrap_or_default() {
                if let Some(ino) = inode_of(&link, "pipe:[") {
                    let acc = proc::read_fdinfo(pid, fd)
                        .map(|i| i.flags as i32 & libc::O_ACCMODE)
                        .unwrap_or(libc::O_RDONLY);
                    let e = s.pipe_ends.entry(ino).or_default();
                    e.0 |= acc != libc::O_WRONLY;
                    e.1 |= acc != libc::O_RDONLY;
                } else if let Some(ino) = inode_of(&link, "socket:[") {
                    s.sockets.insert(ino);
                } else if link == "/dev/ptmx" || link == "/dev/pts/ptmx" {
                    if let Some(i) = proc::read_fdinfo(pid, fd).ok().and_then(|i| {
                        i.extra
                            .iter()
                            .find(|(k, _)| k == "tty-index")
                            .and_then(|(_, v)| v.trim().parse().ok())
                    }) {
                        s.pty_masters.insert(i);
                    }
                }
            }
        }
        s
    }

    pub fn in_tree(&self, pid: i32) -> bool {
        self.pids.contains(&pid)
    }

    pub fn socket_in_tree(&self, ino: u64) -> bool {
        self.sockets.contains(&ino)
    }

    /// The host's unix sockets (one sock_diag dump per scan).
    pub fn unix(&mut self) -> Result<&HashMap<u64, cr_sys::unix_diag::UnixSock>, String> {
        if self.unix.is_none() {
            let all = cr_sys::unix_diag::dump_all().map_err(|e| {
                format!("cannot list unix sockets: {}", cr_sys::error::one_line(&e))
            })?;
            self.unix = Some(all);
        }
        Ok(self.unix.as_ref().expect("just set"))
    }

    /// A process outside the tree holding pipe `ino`, if any.
    fn pipe_outside(&mut self, ino: u64) -> Option<i32> {
        if let Some(v) = self.outside.get(&ino) {
            return *v;
        }
        let want = format!("pipe:[{ino}]");
        let found = std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|p| !self.pids.contains(p) && *p != std::process::id() as i32)
            .find(|&p| {
                proc::list_fds(p)
                    .map(|l| l.iter().any(|(_, t)| *t == want))
                    .unwrap_or(false)
            });
        self.outside.insert(ino, found);
        found
    }
}

/// The inode in a link like "pipe:[1234]".
pub fn inode_of(link: &str, prefix: &str) -> Option<u64> {
    link.strip_prefix(prefix)?.strip_suffix(']')?.parse().ok()
}

/// One fd of a process and whether it can be saved: the report line of
/// `cr_checkpoint --check`.
pub struct Report {
    pub fd: i32,
    /// What it is, in words ("pipe:[123] (read end)", "/var/log/x", ...).
    pub what: String,
    /// Why it cannot be saved.
    pub refused: Option<String>,
}

/// Describe every fd of `pid`. Without `objects`, only decide whether each
/// can be saved (pre-flight); with it, read the state and data too (the
/// tree must be frozen).
pub fn collect(
    pid: i32,
    scan: &mut Scan,
    mut objects: Option<&mut Objects>,
) -> Result<Vec<proto::Fd>, crate::CheckpointError> {
    let list = proc::list_fds(pid).map_err(|e| crate::CheckpointError::from_sys(pid, e))?;
    let mut out = Vec::with_capacity(list.len());
    for (fd, link) in list {
        match describe(pid, fd, &link, scan, objects.as_deref_mut()) {
            Ok(Some(f)) => out.push(f),
            Ok(None) => {} // closed meanwhile
            Err(why) => {
                return Err(crate::CheckpointError::Unsupported {
                    pid,
                    what: format!("fd {fd} is {why}"),
                })
            }
        }
    }
    Ok(out)
}

/// The pre-flight report of every fd of `pid`.
pub fn report(pid: i32, scan: &mut Scan) -> Vec<Report> {
    proc::list_fds(pid)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(fd, link)| {
            let r = describe(pid, fd, &link, scan, None);
            let what = match &r {
                Ok(Some(f)) if f.kind == proto::FdKind::InetSocket as i32 => {
                    format!("{link} ({})", crate::inet::label(pid, fd))
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

fn summary(f: &proto::Fd, link: &str) -> String {
    let kind = proto::FdKind::try_from(f.kind).unwrap_or(proto::FdKind::Unspecified);
    let end = match f.flags as i32 & libc::O_ACCMODE {
        libc::O_RDONLY => "read",
        libc::O_WRONLY => "write",
        _ => "read/write",
    };
    match kind {
        proto::FdKind::Pipe => format!("{link} ({end} end)"),
        proto::FdKind::Inherited => format!("{link} (outside the tree: taken from cr_restart)"),
        proto::FdKind::Epoll => format!("{link} ({} watched fds)", f.epoll.len()),
        proto::FdKind::Inotify => format!("{link} ({} watches)", f.inotify.len()),
        _ => {
            let name = kind.as_str_name().to_lowercase().replace('_', " ");
            if link.starts_with('/') {
                format!("{link} ({name})")
            } else {
                format!("{link} ({name}, {end})")
            }
        }
    }
}

/// Describe fd `fd` of `pid` (`link`: its /proc/PID/fd target), or say in
/// words why it cannot be saved. `Ok(None)`: it was closed meanwhile.
pub fn describe(
    pid: i32,
    fd: i32,
    link: &str,
    scan: &mut Scan,
    objects: Option<&mut Objects>,
) -> Result<Option<proto::Fd>, String> {
    let Ok(info) = proc::read_fdinfo(pid, fd) else {
        return Ok(None);
    };
    let mut f = proto::Fd {
        fd,
        path: link.to_string(),
        flags: info.flags,
        pos: info.pos,
        ..Default::default()
    };
    let extra = |key: &str| {
        info.extra
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    };
    if let Some(ino) = inode_of(link, "pipe:[") {
        let (r, w) = scan.pipe_ends.get(&ino).copied().unwrap_or((true, true));
        if !(r && w) {
            if let Some(other) = scan.pipe_outside(ino) {
                return inherited(
                    f,
                    pid,
                    fd,
                    format!("a pipe shared with process {other} outside the tree"),
                );
            }
        }
        f.kind = proto::FdKind::Pipe as i32;
        f.object = ino;
        if let Some(objs) = objects {
            objs.pipe(pid, fd, ino, None)?;
        }
        return Ok(Some(f));
    }
    if let Some(ino) = inode_of(link, "socket:[") {
        if scan.unix()?.contains_key(&ino) {
            return crate::unix::describe(f, pid, fd, ino, scan, objects);
        }
        return crate::inet::describe(f, pid, fd, ino, scan, objects);
    }
    if let Some(kind) = link.strip_prefix("anon_inode:") {
        // Our own dirty-page tracker (see `tracking`): never part of an image.
        if kind == "[userfaultfd]" && cr_sys::dirty::is_tracker_fd(pid, fd) {
            return Ok(None);
        }
        return anon(f, pid, kind, &info, objects.is_some());
    }
    if !link.starts_with('/') {
        return Err(format!("a {link} (not supported)"));
    }
    // stat() through the magic link gives the open file itself.
    let Ok(md) = std::fs::metadata(format!("/proc/{pid}/fd/{fd}")) else {
        return Ok(None);
    };
    let ft = md.file_type();
    f.locks = crate::locks::of_fd(&info)?;
    if link.starts_with("/memfd:") && md.nlink() == 0 {
        f.kind = proto::FdKind::Memfd as i32;
        f.object = md.ino();
        if let Some(objs) = objects {
            objs.file_content(pid, fd, md.ino(), link, true)?;
        }
        return Ok(Some(f));
    }
    if ft.is_file() {
        if md.nlink() == 0 {
            f.kind = proto::FdKind::DeletedFile as i32;
            f.object = md.ino();
            if let Some(objs) = objects {
                objs.file_content(pid, fd, md.ino(), link, false)?;
            }
        } else {
            f.kind = proto::FdKind::Regular as i32;
            f.size = md.len();
        }
        return Ok(Some(f));
    }
    if ft.is_dir() {
        f.kind = proto::FdKind::Directory as i32;
        return Ok(Some(f));
    }
    if ft.is_fifo() {
        f.kind = proto::FdKind::Fifo as i32;
        f.object = md.ino();
        if let Some(objs) = objects {
            objs.pipe(pid, fd, md.ino(), Some(link))?;
        }
        return Ok(Some(f));
    }
    if ft.is_char_device() {
        let r = md.rdev();
        f.rdev = r;
        if SAFE_CHAR_DEVICES
            .iter()
            .any(|&(ma, mi, _)| ma == major(r) && mi == minor(r))
        {
            f.kind = proto::FdKind::CharDevice as i32;
            return Ok(Some(f));
        }
        if is_tty_dev(r) {
            // /dev/tty of a process whose controlling terminal is a pty of
            // the tree: opened again by path once that pty is its terminal.
            if (major(r), minor(r)) == (5, 0) {
                let ctty = proc::read_stat(pid).map(|s| s.field(7)).unwrap_or(0);
                if ctty_pty(ctty, &scan.pty_masters).is_some() {
                    f.kind = proto::FdKind::CharDevice as i32;
                    return Ok(Some(f));
                }
            }
            let master = major(r) == 5 && minor(r) == 2;
            let index = if master {
                extra("tty-index").and_then(|v| v.trim().parse::<u32>().ok())
            } else {
                proc::pty_slave_index(r)
            };
            if let Some(index) = index.filter(|i| scan.pty_masters.contains(i)) {
                f.kind = proto::FdKind::Pty as i32;
                f.object = index as u64;
                if let Some(objs) = objects {
                    objs.pty(pid, fd, index, master)?;
                }
                return Ok(Some(f));
            }
            if master {
                return Err(format!(
                    "the master of pseudo-terminal {} (not supported)",
                    extra("tty-index").unwrap_or("?")
                ));
            }
            return inherited(f, pid, fd, "a terminal".into());
        }
        return Err(format!(
            "the character device {link} ({}:{}, not supported)",
            major(r),
            minor(r)
        ));
    }
    if ft.is_socket() {
        return Err(format!("a socket bound at {link} (not supported)"));
    }
    Err(format!("the block device {link} (not supported)"))
}

/// An fd connected to something outside the tree: restored as the fd of the
/// same number of cr_restart (terminals: cr_restart's terminal).
pub fn inherited(
    mut f: proto::Fd,
    pid: i32,
    fd: i32,
    what: String,
) -> Result<Option<proto::Fd>, String> {
    let stolen = cr_sys::fdio::steal_fd(pid, fd).ok();
    let tty = stolen
        .as_ref()
        .is_some_and(|s| cr_sys::fdio::is_tty(std::os::fd::AsFd::as_fd(s)));
    if !tty && fd > 2 {
        return Err(format!(
            "{what}; only fds 0, 1 and 2 may lead outside the tree (they are taken from cr_restart)"
        ));
    }
    if let (true, Some(s)) = (tty, &stolen) {
        f.termios = cr_sys::fdio::tcgets(s).unwrap_or_default();
        f.winsize = cr_sys::fdio::get_winsize(s).unwrap_or_default();
    }
    f.kind = proto::FdKind::Inherited as i32;
    Ok(Some(f))
}

/// eventfd, epoll, signalfd, timerfd and inotify: their whole state is in
/// /proc/PID/fdinfo.
fn anon(
    mut f: proto::Fd,
    pid: i32,
    kind: &str,
    info: &proc::FdInfo,
    with_data: bool,
) -> Result<Option<proto::Fd>, String> {
    let get = |key: &str| {
        info.extra
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.trim())
    };
    let hex = |key: &str| get(key).and_then(|v| u64::from_str_radix(v, 16).ok());
    match kind {
        "[eventfd]" => {
            f.kind = proto::FdKind::Eventfd as i32;
            f.eventfd_count = hex("eventfd-count").ok_or("an eventfd without a readable count")?;
            f.eventfd_semaphore = get("eventfd-semaphore") == Some("1");
        }
        "[signalfd]" => {
            f.kind = proto::FdKind::Signalfd as i32;
            f.sigmask = hex("sigmask").ok_or("a signalfd without a readable mask")?;
        }
        "[timerfd]" => {
            f.kind = proto::FdKind::Timerfd as i32;
            f.timerfd = Some(timerfd(info).ok_or("a timerfd whose state cannot be read")?);
        }
        "[eventpoll]" => {
            f.kind = proto::FdKind::Epoll as i32;
            for (k, v) in &info.extra {
                if k == "tfd" {
                    f.epoll.push(epoll_item(pid, v)?);
                }
            }
        }
        "inotify" => {
            f.kind = proto::FdKind::Inotify as i32;
            for (k, v) in &info.extra {
                if k == "inotify wd" {
                    f.inotify.push(crate::objects::inotify_watch(v, with_data)?);
                }
            }
        }
        other => {
            let name = other.trim_matches(|c| c == '[' || c == ']');
            return Err(format!("a {name} (anon_inode:{other}, not supported)"));
        }
    }
    Ok(Some(f))
}

/// "clockid: 1", "ticks: 0", "settime flags: 01", "it_value: (4, 999424181)",
/// "it_interval: (1, 0)".
fn timerfd(info: &proc::FdInfo) -> Option<proto::TimerFd> {
    let get = |key: &str| {
        info.extra
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.trim())
    };
    let pair = |key: &str| -> Option<u64> {
        let v = get(key)?.trim_matches(|c| c == '(' || c == ')');
        let (s, ns) = v.split_once(',')?;
        Some(s.trim().parse::<u64>().ok()? * 1_000_000_000 + ns.trim().parse::<u64>().ok()?)
    };
    let mut t = proto::TimerFd {
        clockid: get("clockid")?.parse().ok()?,
        ticks: get("ticks")?.parse().ok()?,
        settime_flags: u32::from_str_radix(get("settime flags")?, 8).ok()?,
        value_ns: pair("it_value")?,
        interval_ns: pair("it_interval")?,
    };
    // fdinfo shows the time left; an absolute timer keeps its deadline.
    if t.settime_flags as i32 & libc::TFD_TIMER_ABSTIME != 0 && t.value_ns != 0 {
        t.value_ns += cr_sys::fdio::clock_now_ns(t.clockid).ok()?;
    }
    Some(t)
}

/// One "tfd: 6 events: 80000019 data: 6 pos:0 ino:40e sdev:10" line (the
/// part after "tfd:"). The watched file must still be open at that number.
fn epoll_item(pid: i32, v: &str) -> Result<proto::EpollItem, String> {
    let mut words = v.split_whitespace();
    let tfd: i32 = words
        .next()
        .and_then(|w| w.parse().ok())
        .ok_or("an epoll with an unreadable interest list")?;
    let mut item = proto::EpollItem {
        tfd,
        ..Default::default()
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
        return Err(format!(
            "an epoll watching a file that is no longer open as fd {tfd} (not supported)"
        ));
    }
    Ok(item)
}
