//! Kind "unix": unix domain sockets (stream, datagram, seqpacket; pairs,
//! named and abstract, listening with connections not yet accepted,
//! sockets whose file was unlinked, datagram sockets connected to a named
//! peer outside the tree) with their receive queues.
//!
//! Capture: what sock_diag tells about each (type, state, name, peer,
//! queued connections, shutdown), and the receive queue read without
//! consuming it (MSG_PEEK with SO_PEEK_OFF on a copy of the fd taken with
//! pidfd_getfd). A socket whose peer is outside the tree is kept when it
//! is a datagram socket connected to a named peer (reconnected by name,
//! like /dev/log); any other leads outside (kind
//! [`external`](crate::kinds::external)).
//!
//! Restore, inside the restorer, in an order that lets every connection be
//! made again: see [`rebuild`]; files in flight (SCM_RIGHTS) are saved as
//! fds of their own kind and sent again with their message: see [`flight`].

mod flight;
mod peercred;
mod rebuild;
#[cfg(test)]
mod tests;

use flight::Flying;

use crate::error::RestoreError;
use crate::kinds::eventfds::EpollOwner;
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::sockopts::{options, shape, Fresh};
use crate::kinds::{external, Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::objects::{InFlight, PeerCred, PendingConnection, UnixSocket};
use cr_image::model::{Checkpoint, Fd, FdKind, Object, ObjectKind, ObjectTag, Process, SharedFd};
use cr_sys::fdio;
use cr_sys::proc::FDTarget;
use cr_sys::unix_diag::UnixSock;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};

pub struct Unix;

const TCP_LISTEN: u8 = 10;
/// unix_diag state of a connected stream or seqpacket socket.
const TCP_ESTABLISHED: u8 = 1;

/// The host's unix sockets by inode (one sock_diag dump per scan).
#[derive(Default)]
struct Diag(Option<HashMap<u64, UnixSock>>);

fn diag<'a>(cx: &'a mut FdScan<'_>) -> Result<&'a HashMap<u64, UnixSock>, String> {
    let d = cx.tree.stash.get::<Diag>();
    if d.0.is_none() {
        let all = cr_sys::unix_diag::dump_all()
            .map_err(|e| format!("cannot list unix sockets: {}", cr_sys::error::one_line(&e)))?;
        d.0 = Some(all);
    }
    Ok(d.0.as_ref().expect("just set"))
}

/// Whether socket `ino` is a unix socket of this host.
pub fn is_unix(cx: &mut FdScan<'_>, ino: u64) -> Result<bool, String> {
    Ok(diag(cx)?.contains_key(&ino))
}

/// Whether the socket `f` may be a unix socket: false only when its
/// family (SO_DOMAIN of a copy of the fd) is another one. A tree's first
/// socket used to load the dump of every unix socket of the namespace
/// ([`diag`]) even when it was a TCP one: on a node whose members are in
/// one namespace that dump grows with the members (each one's launcher
/// and agent connection hold unix sockets: ~260 for 64 members), and each
/// member read it while frozen, O(members²) in all.
fn may_be_unix(f: &OpenFd<'_>) -> bool {
    fdio::may_be_unix(f.pid, f.fd)
}

impl FileKind for Unix {
    fn name(&self) -> &'static str {
        "unix"
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        let FDTarget::Socket(ino) = *f.target else {
            return None;
        };
        if !may_be_unix(f) {
            return None;
        }
        match is_unix(cx, ino) {
            Ok(true) => Some(describe(cx, f, ino)),
            Ok(false) => None,
            Err(e) => Some(Err(e)),
        }
    }

    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        let (socks, later) = rebuild::all(ck)?;
        r.stash.get::<Held>().0 = socks;
        *r.stash.get::<Flying>() = Flying {
            later: Some(later),
            files: HashMap::new(),
        };
        Ok(())
    }

    /// The files in flight `p` gives; once every one is open again, the
    /// queues carrying them are written (before `--verify` looks: a closed
    /// peer's end, which writes them, is then closed too).
    fn after_fds(&self, cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        flight::open(cx, p)?;
        let ck = cx.r.ck;
        let flying = cx.r.stash.get::<Flying>();
        if flying.later.is_some() && flight::all_open(ck, &flying.files) {
            finish(cx.r)?;
        }
        Ok(())
    }

    fn release(&self, r: &mut Restorer<'_>) -> Result<(), RestoreError> {
        finish(r)
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let FdKind::UnixSocket { object } = f.kind else {
            return None;
        };
        Some(match cx.r.stash.get::<Held>().0.get(&object) {
            Some(s) => s.try_clone().map(Opened::Ours).map_err(|e| {
                RestoreError::Unsupported(format!("cannot hand socket:[{object}] over: {e}"))
            }),
            None => Err(RestoreError::Unsupported(format!(
                "fd {} refers to socket:[{object}], missing from the image",
                f.fd
            ))),
        })
    }
}

/// The queues carrying files in flight, written once (see
/// [`rebuild::finish`]).
fn finish(r: &mut Restorer<'_>) -> Result<(), RestoreError> {
    let Some(Flying { later, files }) = r.stash.take::<Flying>() else {
        return Ok(());
    };
    let Some(later) = later else { return Ok(()) };
    let files = flight::check_all(r.ck, files)?;
    let held = &r.stash.get::<Held>().0;
    rebuild::finish(r.ck, held, later, &files)
}

/// Where the file of a socket bound at `path` is now, when it was renamed
/// within its directory after the bind: a socket file there with inode
/// `ino` (its low 32 bits: all sock_diag reports). A program that binds at
/// a temporary name and renames the file into place (the JVM's attach
/// listener: `.java_pidN.tmp` to `.java_pidN`) still reports the first name
/// through getsockname and sock_diag.
fn moved_socket_file(path: &str, ino: u64) -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStringExt;
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let dir = std::path::Path::new(path).parent()?;
    std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()))
        .find(|e| e.metadata().is_ok_and(|md| md.ino() & 0xffff_ffff == ino))
        .map(|e| e.path().into_os_string().into_vec())
}

/// The restorer's unix sockets, by object.
#[derive(Default)]
struct Held(HashMap<u64, OwnedFd>);

fn describe(cx: &mut FdScan<'_>, f: &OpenFd<'_>, ino: u64) -> Described {
    let (pid, fd) = (f.pid, f.fd);
    let all = diag(cx)?;
    let Some(u) = all.get(&ino).cloned() else {
        return Ok(None); // gone meanwhile
    };
    if ![libc::SOCK_STREAM, libc::SOCK_DGRAM, libc::SOCK_SEQPACKET].contains(&(u.sock_type as i32))
    {
        return Err(format!(
            "a unix socket of type {} (not supported)",
            u.sock_type
        ));
    }
    let kind = kind_name(u.sock_type);
    // A seqpacket socket whose peer is gone reads 0 at the end of its queue.
    let zero_ends =
        u.sock_type as i32 == libc::SOCK_SEQPACKET && (u.peer == 0 || u.shutdown & 1 != 0);
    let mut s = UnixSocket {
        sock_type: u.sock_type as u32,
        state: u.state as u32,
        name: u.name.clone().unwrap_or_default(),
        shutdown: u.shutdown as u32,
        peek_off: -1,
        ..Default::default()
    };
    if u.state == TCP_LISTEN {
        s.backlog = u.wqlen;
        let outside = u
            .icons
            .iter()
            .filter(|c| !cx.tree.socket_in_tree(**c))
            .count();
        if outside > 0 {
            tracing::warn!(
                pid,
                fd,
                queued = outside,
                "connections from outside the tree queued on a listening unix socket are dropped"
            );
        }
    } else if u.peer != 0 && !cx.tree.socket_in_tree(u.peer) {
        let peer_name = diag(cx)?.get(&u.peer).and_then(|p| p.name.clone());
        match peer_name {
            Some(n) if u.sock_type as i32 == libc::SOCK_DGRAM && !n.is_empty() => s.peer_name = n,
            _ => {
                return external::record(
                    f,
                    format!(
                        "a unix {kind} socket connected to socket:[{}] outside the tree",
                        u.peer
                    ),
                );
            }
        }
    } else if u.peer != 0 {
        s.peer = u.peer;
    } else if u.state == 1 && u.sock_type as i32 != libc::SOCK_DGRAM {
        // Connected, peer 0: either queued on a listener (not accepted yet)
        // or its peer is gone.
        let listener = diag(cx)?
            .values()
            .find(|l| l.state == TCP_LISTEN && l.icons.contains(&ino))
            .map(|l| l.ino);
        match listener {
            Some(l) if cx.tree.socket_in_tree(l) => s.listener = l,
            Some(l) => {
                return external::record(
                    f,
                    format!(
                    "a unix {kind} socket waiting to be accepted by socket:[{l}] outside the tree"
                ),
                )
            }
            None => {} // the peer closed; the queue still holds its last data
        }
    }
    let relative = |n: &[u8]| !n.is_empty() && n[0] != 0 && n[0] != b'/';
    if relative(&s.name) || relative(&s.peer_name) {
        s.cwd = cr_sys::proc::read_link(&format!("/proc/{pid}/cwd")).unwrap_or_default();
    }
    // What it sent waits on the listener's side, where only an accept()
    // reads it: a dump whose processes end takes the connection off the
    // queue for that (see `take_pending`); one that lets them run cannot.
    if s.listener != 0 && u.wqlen > 0 && !cx.tree.lock_network && !cx.tree.verifying {
        return Err(format!(
            "a unix {kind} socket not yet accepted by socket:[{}] that already sent data (the data waits where only an accept() reads it; not supported when the processes run on: use --kill or --stop)",
            s.listener
        ));
    }
    if !s.name.is_empty() && s.name[0] != 0 {
        let path = String::from_utf8_lossy(&s.name).into_owned();
        let path = if path.starts_with('/') {
            path
        } else {
            format!("{}/{path}", s.cwd)
        };
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::MetadataExt;
        let vfs_ino = u.vfs.map(|(_, i)| i & 0xffff_ffff);
        let file_of = |p: &std::path::Path| {
            std::fs::metadata(p)
                .ok()
                .filter(|md| Some(md.ino() & 0xffff_ffff) == vfs_ino)
        };
        let mut file = file_of(std::path::Path::new(&path));
        if file.is_none() {
            if let Some(now) = vfs_ino.and_then(|ino| moved_socket_file(&path, ino)) {
                file = file_of(std::ffi::OsStr::from_bytes(&now).as_ref());
                s.moved_to = now;
            }
        }
        match file {
            Some(md) => {
                s.file_mode = md.mode() & 0o7777;
                s.file_uid = md.uid();
                s.file_gid = md.gid();
            }
            None => {
                s.name_unlinked = true;
                s.moved_to.clear();
            }
        }
    }
    let deep = cx.tree.deep;
    // A socket whose queue carries itself (or a socket that carries it):
    // the description under way saves it once. The restore takes a socket
    // in flight that the tree holds from the process that holds it; one
    // that only queues hold (a garbage cycle the kernel has not collected
    // yet) would have to be made from a description not saved yet.
    if !cx.tree.stash.get::<Describing>().0.insert(ino) {
        if cx.tree.socket_in_tree(ino) {
            return Ok(Some(FdKind::UnixSocket { object: ino }));
        }
        return Err(format!(
            "a unix {kind} socket in flight in its own queue that no process holds (a cycle of sockets passed over each other; not supported)"
        ));
    }
    let out = describe_data(cx, f, ino, &u, s, deep, zero_ends);
    cx.tree.stash.get::<Describing>().0.remove(&ino);
    out
}

/// The unix sockets whose queue is being read (see [`describe_data`]).
#[derive(Default)]
struct Describing(std::collections::HashSet<u64>);

/// The queue, files in flight and options of socket `ino`, saved once as
/// an object.
fn describe_data(
    cx: &mut FdScan<'_>,
    f: &OpenFd<'_>,
    ino: u64,
    u: &UnixSock,
    mut s: UnixSocket,
    deep: bool,
    zero_ends: bool,
) -> Described {
    let (pid, fd) = (f.pid, f.fd);
    let stream = u.sock_type as i32 == libc::SOCK_STREAM;
    let kind = kind_name(u.sock_type);
    let Some(objs) = cx.objects.as_deref() else {
        // `cr_checkpoint --check` looks into the queue for files in flight
        // it could not save. Not done before every dump: a peek marks
        // empty datagrams, which later peeks with an offset no longer see.
        if deep && has_queue(u) {
            if let Ok(Ok(q)) =
                fdio::steal_fd(pid, fd).map(|s| fdio::peek_queue(&s, stream, zero_ends))
            {
                for m in &q {
                    in_flight(cx, pid, &m.fds)
                        .map_err(|e| format!("a unix {kind} socket carrying {e}"))?;
                }
            }
        }
        return Ok(Some(FdKind::UnixSocket { object: ino }));
    };
    if objs.contains(ObjectTag::UnixSocket, ino) {
        return Ok(Some(FdKind::UnixSocket { object: ino }));
    }
    let err = |e: cr_sys::SysError| {
        format!(
            "a unix {kind} socket that cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    };
    let sock = fdio::steal_fd(pid, fd).map_err(err)?;
    if has_queue(u) {
        let q = fdio::peek_queue(&sock, stream, zero_ends).map_err(err)?;
        if !stream && q.iter().any(|m| !m.from.is_empty()) {
            s.queue_from = q.iter().map(|m| m.from.clone()).collect();
        }
        for (i, m) in q.iter().enumerate() {
            if !m.fds.is_empty() {
                s.in_flight.push(InFlight {
                    message: i as u32,
                    fds: in_flight(cx, pid, &m.fds)
                        .map_err(|e| format!("a unix {kind} socket carrying {e}"))?,
                });
            }
        }
        s.queue = q.into_iter().map(|m| m.data).collect();
    }
    if u.state == TCP_LISTEN && cx.tree.lock_network && must_take(cx, u)? {
        s.pending = take_pending(cx, &sock, u).map_err(|e| {
            format!("a unix {kind} socket listening with connections not yet accepted: {e}")
        })?;
    }
    let fresh = cx.tree.stash.get::<Fresh>();
    s.sndbuf = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_SNDBUF).unwrap_or(0);
    s.rcvbuf = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_RCVBUF).unwrap_or(0);
    s.passcred = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_PASSCRED).unwrap_or(0) != 0;
    s.peek_off = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_PEEK_OFF).unwrap_or(-1);
    s.peer_cred = fdio::peer_cred(&sock)
        .ok()
        .flatten()
        .map(|(pid, uid, gid)| PeerCred { pid, uid, gid });
    s.opts = options(&sock, &shape(&sock), fresh);
    let objs = cx.objects.as_deref_mut().expect("checked above");
    objs.insert(Object {
        id: ino,
        kind: ObjectKind::UnixSocket(s),
    });
    Ok(Some(FdKind::UnixSocket { object: ino }))
}

/// Whether the connections queued on listener `u` must be taken off its
/// queue to be saved: one whose client had closed (it may have sent data
/// before), or one whose client in the tree had sent data (sock_diag
/// counts it in the client's write queue). Those whose client is outside
/// the tree are dropped, as before.
fn must_take(cx: &mut FdScan<'_>, u: &UnixSock) -> Result<bool, String> {
    let in_tree: Vec<u64> = u
        .icons
        .iter()
        .copied()
        .filter(|&c| c != 0 && cx.tree.socket_in_tree(c))
        .collect();
    let all = diag(cx)?;
    Ok(u.icons.contains(&0)
        || in_tree
            .iter()
            .any(|c| all.get(c).is_some_and(|c| c.wqlen > 0)))
}

/// The connections not yet accepted by a listening socket, whose
/// processes end with the dump: accepted here (the only way to read what
/// their clients sent), in the order the program would have had them,
/// with what each client sent. The accepted ends are kept until the scan
/// ends. Those whose client is outside the tree are left out (dropped, as
/// their listener ends).
fn take_pending(
    cx: &mut FdScan<'_>,
    sock: &OwnedFd,
    u: &UnixSock,
) -> Result<Vec<PendingConnection>, String> {
    let stream = u.sock_type as i32 == libc::SOCK_STREAM;
    let one = |e: cr_sys::SysError| cr_sys::error::one_line(&e);
    let mut out = Vec::new();
    for _ in 0..u.icons.len() {
        let a = fdio::accept(sock).map_err(one)?;
        let peer = fdio::inode(&a)
            .and_then(cr_sys::unix_diag::by_inode)
            .map_err(one)?
            .map_or(0, |d| d.peer);
        // The accepted end reads 0 at the end of what a closed client sent.
        let q = fdio::peek_queue(&a, stream, true).map_err(one)?;
        if q.iter().any(|m| !m.fds.is_empty()) {
            return Err("one carries files in flight (not supported)".into());
        }
        cx.tree.stash.get::<Accepted>().0.push(a);
        if peer != 0 && !cx.tree.socket_in_tree(peer) {
            continue;
        }
        out.push(PendingConnection {
            client: peer,
            data: q.into_iter().map(|m| m.data).collect(),
        });
    }
    Ok(out)
}

/// Connections taken off a listener's queue by the dump (see
/// [`take_pending`]), held until the scan ends.
#[derive(Default)]
struct Accepted(Vec<OwnedFd>);

/// Whether the socket can hold a receive queue: a datagram socket always;
/// a stream or seqpacket one only once connected (the kernel refuses to
/// read one that never was: EINVAL for a stream, ENOTCONN for seqpacket;
/// one whose peer has gone stays connected, with what the peer sent).
fn has_queue(u: &UnixSock) -> bool {
    u.sock_type as i32 == libc::SOCK_DGRAM || u.state == TCP_ESTABLISHED
}

fn kind_name(sock_type: u8) -> &'static str {
    match sock_type as i32 {
        libc::SOCK_STREAM => "stream",
        libc::SOCK_DGRAM => "datagram",
        _ => "seqpacket",
    }
}

/// Files in flight with one queued message (a peek put a copy of each in
/// our table), each described as an fd of its own kind, numbered by its
/// place in the message; one the tree holds too (the same open file
/// description: the sender kept it) names that fd. An epoll's keys are fd
/// numbers of `holder`, the process holding the socket (sent by itself),
/// which must be the tree's root (its items are registered again in the
/// root, which opens the files no process holds).
fn in_flight(cx: &mut FdScan<'_>, holder: i32, fds: &[OwnedFd]) -> Result<Vec<Fd>, String> {
    let me = std::process::id() as i32;
    let mut out = Vec::with_capacity(fds.len());
    for (i, file) in fds.iter().enumerate() {
        let raw = file.as_raw_fd();
        let target = cr_sys::proc::fds(me)
            .ok()
            .and_then(|all| all.into_iter().find(|(n, _)| *n == raw).map(|(_, t)| t))
            .ok_or_else(|| format!("file {i} in flight that cannot be looked at"))?;
        let epoll = matches!(&target, FDTarget::AnonInode(k) if k == "[eventpoll]");
        if epoll && holder != cx.tree.root {
            return Err(format!(
                "file {i} in flight, an epoll held by a process other than the tree's root (not supported)"
            ));
        }
        cx.tree.stash.get::<EpollOwner>().0 = Some(holder);
        let d = crate::kinds::fds::describe(cx, me, raw, &target);
        cx.tree.stash.get::<EpollOwner>().0 = None;
        let mut d = match d {
            Ok(Some(d)) => d,
            Ok(None) => return Err(format!("file {i} in flight that cannot be looked at")),
            Err(why) => return Err(format!("file {i} in flight, {why}")),
        };
        if let FdKind::Epoll { items } = &d.kind {
            if let Some(it) = items.iter().find(|it| it.open_as.is_some()) {
                return Err(format!(
                    "file {i} in flight, an epoll watching fd {} of the root, closed or reused since (not supported)",
                    it.tfd
                ));
            }
        }
        let text = cr_sys::proc::target_text(&target);
        d.shared = cx.tree.pids().into_iter().find_map(|pid| {
            let list = cr_sys::proc::fds(pid).ok()?;
            list.into_iter()
                .filter(|(_, t)| cr_sys::proc::target_text(t) == text)
                .find(|(n, _)| cr_sys::mem::same_file(me, raw, pid, *n).unwrap_or(false))
                .map(|(n, _)| SharedFd {
                    pid: pid as u32,
                    fd: n,
                })
        });
        d.fd = i as i32;
        d.flags &= !(libc::O_CLOEXEC as u32);
        d.locks.clear();
        out.push(d);
    }
    Ok(out)
}
