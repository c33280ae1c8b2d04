//! Unix sockets rebuilt inside the restorer, in an order that lets every
//! connection be made again:
//! 1. stale socket files at saved paths (names and moved files) are removed;
//! 2. connected pairs: a socketpair, or (for a stream pair with a name,
//!    like an accepted connection) a temporary listener at the name, a
//!    connect and an accept, so both ends carry their names again;
//! 3. listeners, then unconnected sockets, bound (and unlinked again where
//!    the saved path no longer named them, or renamed to where the program
//!    had moved their file);
//! 4. one-way connections: datagram sockets connected to a named socket
//!    (of the image or outside it, like /dev/log), and connections still
//!    waiting in a listener's queue;
//! 5. a stream whose peer had closed: a pair whose other end is closed
//!    after its data is written;
//! 6. the receive queues, written by each socket's peer (datagrams one by
//!    one, keeping their boundaries), then shutdowns and options.

use crate::error::{RestoreError, StepContext};
use crate::kinds::sockopts;
use cr_image::model::objects::UnixSocket;
use cr_image::model::{Checkpoint, ObjectKind};
use cr_sys::fdio;
use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

const TCP_LISTEN: u32 = 10;
const TCP_ESTABLISHED: u32 = 1;

fn is_path(name: &[u8]) -> bool {
    !name.is_empty() && name[0] != 0
}

/// The files bound sockets of this host hold (sock_diag's device, in the
/// kernel's encoding, and inode, truncated to 32 bits); None when they
/// cannot be listed.
fn live_socket_files() -> Option<HashSet<(u32, u64)>> {
    let all = cr_sys::unix_diag::dump_all().ok()?;
    Some(all.values().filter_map(|s| s.vfs).collect())
}

/// Remove the socket file at `name` when it is stale: a socket file no
/// socket of this host is bound to any more (the checkpointed program's,
/// left when it was killed). Any other file is left alone.
fn unlink_socket_file(name: &[u8], live: Option<&HashSet<(u32, u64)>>) {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let p = String::from_utf8_lossy(name).into_owned();
    let Ok(md) = std::fs::symlink_metadata(&p) else {
        return;
    };
    if !md.file_type().is_socket() {
        return;
    }
    let kdev = (libc::major(md.dev()) << 20) | libc::minor(md.dev());
    if live.is_some_and(|l| !l.contains(&(kdev, md.ino() & 0xffff_ffff))) {
        let _ = std::fs::remove_file(&p);
    }
}

/// Where the files of sockets bound at a name that no longer named them
/// wait (at a temporary name) until every connection to them is made, and
/// the directories made for them (gone at the checkpoint).
#[derive(Default)]
struct Ghosts {
    /// Socket id -> the temporary path of its file.
    at: HashMap<u64, String>,
    /// Directories made for the binds, in the order made.
    dirs: Vec<String>,
}

impl Ghosts {
    /// Remove the files and the directories made for them.
    fn clear(&mut self) {
        for (_, p) in self.at.drain() {
            let _ = std::fs::remove_file(p);
        }
        for d in self.dirs.drain(..).rev() {
            let _ = std::fs::remove_dir(d);
        }
    }

    /// Where to connect to socket `id` of the image: (directory, name).
    fn target<'a>(&'a self, id: u64, s: &'a UnixSocket) -> (&'a str, &'a [u8]) {
        match self.at.get(&id) {
            Some(p) => ("", p.as_bytes()),
            None => (&s.cwd, &s.name),
        }
    }
}

fn sys(what: String) -> impl FnOnce(std::io::Error) -> cr_sys::SysError {
    move |e: std::io::Error| cr_sys::SysError::Syscall {
        what,
        source: cr_sys::Errno(e.raw_os_error().unwrap_or(libc::EIO)),
    }
}

/// Bind `fd` (socket `id`) at the path its name no longer named: the
/// missing directories are made, a file now at the path is moved aside
/// meanwhile, and the new socket file goes to a temporary name next to the
/// nearest directory that existed (removed by [`Ghosts::clear`]).
fn bind_ghost(
    fd: &OwnedFd,
    id: u64,
    s: &UnixSocket,
    ghosts: &mut Ghosts,
) -> Result<(), RestoreError> {
    use std::path::{Path, PathBuf};
    let what = || format!("cannot bind socket:[{id}]");
    let path = PathBuf::from(abs_path(&s.cwd, &s.name));
    let mut missing = Vec::new();
    let mut base = path.parent().unwrap_or(Path::new("/")).to_path_buf();
    while std::fs::symlink_metadata(&base).is_err() {
        missing.push(base.clone());
        match base.parent() {
            Some(p) => base = p.to_path_buf(),
            None => break,
        }
    }
    for d in missing.iter().rev() {
        std::fs::create_dir(d)
            .map_err(sys(format!("mkdir {}", d.display())))
            .step(what)?;
        ghosts.dirs.push(d.display().to_string());
    }
    let me = std::process::id();
    let parked = PathBuf::from(format!("{}.cr-parked-{me}", path.display()));
    let temp = base.join(format!(".cr-ghost-socket-{me}-{id}"));
    // Renames replace what they move onto: neither name may be taken.
    if let Some(taken) = [&parked, &temp]
        .into_iter()
        .find(|p| std::fs::symlink_metadata(p).is_ok())
    {
        return Err(RestoreError::Unsupported(format!(
            "cannot bind socket:[{id}] at {}: its temporary name {} is taken",
            path.display(),
            taken.display()
        )));
    }
    let park = std::fs::symlink_metadata(&path).is_ok();
    if park {
        std::fs::rename(&path, &parked)
            .map_err(sys(format!("rename {} aside", path.display())))
            .step(what)?;
    }
    let bound = from_dir(&s.cwd, &s.name, || fdio::bind_unix(fd, &s.name))
        .step(what)
        .and_then(|()| {
            std::fs::rename(&path, &temp)
                .map_err(sys(format!("rename {}", path.display())))
                .step(what)
        });
    if bound.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    if park {
        std::fs::rename(&parked, &path)
            .map_err(sys(format!("rename {} back", parked.display())))
            .step(what)?;
    }
    bound?;
    ghosts.at.insert(id, temp.display().to_string());
    Ok(())
}

/// Run `f` from directory `cwd` when `name` is a relative path (names are
/// resolved by the kernel against the caller's cwd).
fn from_dir<T>(cwd: &str, name: &[u8], f: impl FnOnce() -> T) -> T {
    if !is_path(name) || name[0] == b'/' || cwd.is_empty() {
        return f();
    }
    let back = std::env::current_dir().ok();
    let _ = std::env::set_current_dir(cwd);
    let r = f();
    if let Some(b) = back {
        let _ = std::env::set_current_dir(b);
    }
    r
}

/// Absolute path of a path name.
fn abs_path(cwd: &str, name: &[u8]) -> String {
    let p = String::from_utf8_lossy(name).into_owned();
    if p.starts_with('/') || cwd.is_empty() {
        p
    } else {
        format!("{cwd}/{p}")
    }
}

/// How long a bind to an abstract name waits for the kernel to free it.
const ABSTRACT_FREED_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

/// `bind`, again while an abstract `name` is taken: sockets of a killed
/// original that were in flight in their own queues (a cycle, zdtm scm06)
/// outlive their processes until the kernel's unix garbage collector
/// frees them and their names; it runs when some unix socket is released,
/// so one is made and closed before each new try. A name still taken after [`ABSTRACT_FREED_WITHIN`] is the
/// error it was.
fn bind_when_free(
    bind: impl Fn() -> Result<(), cr_sys::SysError>,
    name: &[u8],
) -> Result<(), cr_sys::SysError> {
    let t0 = std::time::Instant::now();
    loop {
        match bind() {
            Err(e)
                if !is_path(name)
                    && e.errno() == Some(libc::EADDRINUSE)
                    && t0.elapsed() < ABSTRACT_FREED_WITHIN =>
            {
                // The collector runs when a unix socket is released while
                // sockets are in flight: a failed bind releases none.
                drop(fdio::socket(libc::AF_UNIX, libc::SOCK_DGRAM, 0));
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            r => return r,
        }
    }
}

/// Bind a socket to its saved name; one bound at a name that no longer
/// named it waits in `ghosts` until every connection is made.
fn bind(fd: &OwnedFd, id: u64, s: &UnixSocket, ghosts: &mut Ghosts) -> Result<(), RestoreError> {
    if s.name.is_empty() {
        return Ok(());
    }
    if is_path(&s.name) && s.name_unlinked {
        return bind_ghost(fd, id, s, ghosts);
    }
    bind_when_free(
        || from_dir(&s.cwd, &s.name, || fdio::bind_unix(fd, &s.name)),
        &s.name,
    )
    .step(|| format!("cannot bind socket:[{id}]"))?;
    if !is_path(&s.name) {
        return Ok(());
    }
    use std::os::unix::ffi::OsStrExt;
    let mut file = std::path::PathBuf::from(abs_path(&s.cwd, &s.name));
    if !s.moved_to.is_empty() {
        // Where the program had moved the file after its bind.
        let to = std::path::PathBuf::from(std::ffi::OsStr::from_bytes(&s.moved_to));
        std::fs::rename(&file, &to)
            .map_err(sys(format!(
                "rename {} to {}",
                file.display(),
                to.display()
            )))
            .step(|| format!("cannot move the file of socket:[{id}] where it was"))?;
        file = to;
    }
    if s.file_mode != 0 {
        // bind(2) made the file with the restorer's umask and ids; only
        // what differs is changed (a caller who is not root can give its
        // own files only its own groups).
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let now = std::fs::symlink_metadata(&file)
            .map_err(sys(format!("stat {}", file.display())))
            .step(|| format!("cannot find the file of socket:[{id}]"))?;
        if (now.uid(), now.gid()) != (s.file_uid, s.file_gid) {
            std::os::unix::fs::lchown(&file, Some(s.file_uid), Some(s.file_gid))
                .map_err(sys(format!("chown {}", file.display())))
                .step(|| format!("cannot give the file of socket:[{id}] its owner"))?;
        }
        if now.mode() & 0o7777 != s.file_mode {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(s.file_mode))
                .map_err(sys(format!("chmod {}", file.display())))
                .step(|| format!("cannot give the file of socket:[{id}] its mode"))?;
        }
    }
    Ok(())
}

fn connect(fd: &OwnedFd, cwd: &str, name: &[u8]) -> cr_sys::error::Result<()> {
    from_dir(cwd, name, || fdio::connect_unix(fd, name))
}

/// Every unix socket of the image, by id, and what waits for the files in
/// flight.
pub fn all(ck: &Checkpoint) -> Result<(HashMap<u64, OwnedFd>, Later), RestoreError> {
    let socks = of_image(ck);
    let mut out: HashMap<u64, OwnedFd> = HashMap::new();
    // Other end of a stream whose peer had closed: closed after its data.
    let mut orphans: HashMap<u64, OwnedFd> = HashMap::new();
    let mut ids: Vec<u64> = socks.keys().copied().collect();
    ids.sort();
    let mut ghosts = Ghosts::default();
    let live = live_socket_files();
    for s in socks.values() {
        if is_path(&s.name) {
            unlink_socket_file(abs_path(&s.cwd, &s.name).as_bytes(), live.as_ref());
        }
        if is_path(&s.moved_to) {
            unlink_socket_file(&s.moved_to, live.as_ref());
        }
    }
    let ty = |s: &UnixSocket| s.sock_type as i32;
    // Clients of connections saved with their listener's queue (step 4;
    // one that is not there had closed).
    let pending: HashSet<u64> = socks
        .values()
        .flat_map(|s| s.pending.iter().map(|p| p.client))
        .filter(|&c| c != 0)
        .collect();
    let own_pidns = ck.pidns;
    // 2. Pairs.
    for &a in &ids {
        let sa = socks[&a];
        let b = sa.peer;
        let Some(&sb) = socks.get(&b) else { continue };
        // b == a: connected to itself (step 4, once bound).
        if sb.peer != a || b <= a {
            continue;
        }
        let what = format!("cannot connect socket:[{a}] and socket:[{b}] again");
        let (fa, fb) = if ty(sa) != libc::SOCK_DGRAM && (!sa.name.is_empty() || !sb.name.is_empty())
        {
            // The named one plays the accepted side: the temporary listener
            // lends it the name.
            let (srv, cli, s_srv, s_cli) = if !sa.name.is_empty() {
                (a, b, sa, sb)
            } else {
                (b, a, sb, sa)
            };
            let l = fdio::unix_socket(ty(s_srv)).step(|| what.clone())?;
            if is_path(&s_srv.name) && s_srv.name_unlinked {
                bind_ghost(&l, srv, s_srv, &mut ghosts)?;
            } else {
                from_dir(&s_srv.cwd, &s_srv.name, || fdio::bind_unix(&l, &s_srv.name))
                    .step(|| what.clone())?;
            }
            fdio::listen(&l, 1).step(|| what.clone())?;
            let c = fdio::unix_socket(ty(s_cli)).step(|| what.clone())?;
            bind(&c, cli, s_cli, &mut ghosts)?;
            let (tcwd, target) = ghosts.target(srv, s_srv);
            connect(&c, tcwd, target).step(|| what.clone())?;
            let s = fdio::accept(&l).step(|| what.clone())?;
            drop(l);
            if let Some(p) = ghosts.at.remove(&srv) {
                let _ = std::fs::remove_file(p);
            } else if is_path(&s_srv.name) {
                let _ = std::fs::remove_file(abs_path(&s_srv.cwd, &s_srv.name));
            }
            if srv == a {
                (s, c)
            } else {
                (c, s)
            }
        } else {
            // Made by a process with its maker's credentials, as far as
            // possible (`peercred`).
            let by_maker = match (&sa.peer_cred, own_pidns) {
                (Some(c), false) if sa.peer_cred == sb.peer_cred => {
                    super::peercred::pair(ty(sa), c)?
                }
                _ => None,
            };
            let (x, y) = match by_maker {
                Some(p) => p,
                None => fdio::unix_socketpair(ty(sa)).step(|| what.clone())?,
            };
            bind(&x, a, sa, &mut ghosts)?;
            bind(&y, b, sb, &mut ghosts)?;
            (x, y)
        };
        out.insert(a, fa);
        out.insert(b, fb);
    }
    // 3. Listeners, then the unconnected.
    for listening in [true, false] {
        for &id in &ids {
            let s = socks[&id];
            if out.contains_key(&id) || (s.state == TCP_LISTEN) != listening {
                continue;
            }
            if !listening && (s.peer != 0 || !s.peer_name.is_empty() || s.listener != 0) {
                continue;
            }
            if !listening && s.state == TCP_ESTABLISHED && ty(s) != libc::SOCK_DGRAM {
                continue; // peer closed: step 5
            }
            if !listening && s.name.is_empty() && !s.queue.is_empty() {
                continue; // data from a peer now gone: step 5
            }
            let fd = fdio::unix_socket(ty(s)).step(|| format!("cannot create socket:[{id}]"))?;
            bind(&fd, id, s, &mut ghosts)?;
            if listening {
                fdio::listen(&fd, s.backlog as i32)
                    .step(|| format!("cannot listen on socket:[{id}]"))?;
            }
            out.insert(id, fd);
        }
    }
    // 4. One-way connections; first those queued on a listener whose
    // queue was saved in order (with what each client had sent).
    for &id in &ids {
        let s = socks[&id];
        if !s.pending.is_empty() {
            queue_pending(id, s, &socks, &mut out, &mut ghosts)?;
        }
    }
    for &id in &ids {
        let s = socks[&id];
        if out.contains_key(&id) || pending.contains(&id) {
            continue;
        }
        let of_image = |t: u64| {
            socks.get(&t).filter(|o| !o.name.is_empty()).map(|o| {
                let (cwd, name) = ghosts.target(t, o);
                (name.to_vec(), cwd.to_string())
            })
        };
        let target = if s.listener != 0 {
            of_image(s.listener)
        } else if s.peer != 0 {
            of_image(s.peer)
        } else if !s.peer_name.is_empty() {
            Some((s.peer_name.clone(), s.cwd.clone()))
        } else {
            continue;
        };
        let (target, tcwd) = target.filter(|(n, _)| !n.is_empty()).ok_or_else(|| {
            RestoreError::Unsupported(format!(
                "socket:[{id}] was connected to a socket without a name, which cannot be reached again"
            ))
        })?;
        let fd = fdio::unix_socket(ty(s)).step(|| format!("cannot create socket:[{id}]"))?;
        bind(&fd, id, s, &mut ghosts)?;
        connect(&fd, &tcwd, &target).step(|| {
            format!(
                "cannot connect socket:[{id}] to {} again",
                fdio::show_name(&target)
            )
        })?;
        out.insert(id, fd);
    }
    // 5. Streams whose peer had closed.
    for &id in &ids {
        let s = socks[&id];
        if out.contains_key(&id) {
            continue;
        }
        let (x, y) =
            fdio::unix_socketpair(ty(s)).step(|| format!("cannot create socket:[{id}]"))?;
        bind(&x, id, s, &mut ghosts)?;
        out.insert(id, x);
        orphans.insert(id, y);
    }
    // SO_PASSCRED first: queued datagrams then carry credentials (the
    // restorer's; the original senders' are not kept).
    for &id in &ids {
        if let (true, Some(fd)) = (socks[&id].passcred, out.get(&id)) {
            let _ = fdio::setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PASSCRED, 1);
        }
    }
    // 6. Queues, shutdowns, options. A queue carrying files waits for
    // them (see `flight`): the files are opened with the processes; so do
    // the shutdowns of its socket and of its peer (a shut socket takes no
    // more data).
    let mut later = Later::default();
    for &id in &ids {
        let s = socks[&id];
        if !s.in_flight.is_empty() {
            later.queues.push(id);
            later.shut.insert(id);
            later.shut.insert(s.peer);
            if let Some(o) = orphans.remove(&id) {
                later.orphans.insert(id, o);
            }
            continue;
        }
        write_queue(id, &socks, &out, &orphans, &HashMap::new(), &ghosts)?;
    }
    drop(orphans);
    ghosts.clear();
    for &id in &ids {
        let s = socks[&id];
        let Some(fd) = out.get(&id) else { continue };
        if !later.shut.contains(&id) {
            shutdown(fd, s);
        }
        // The kernel doubles what is asked for and reports the doubled value.
        for (opt, v) in [
            (libc::SO_SNDBUFFORCE, s.sndbuf),
            (libc::SO_RCVBUFFORCE, s.rcvbuf),
        ] {
            if v > 0 {
                let _ = fdio::setsockopt_int(fd, libc::SOL_SOCKET, opt, v / 2);
            }
        }
        if s.peek_off >= 0 {
            let _ = fdio::setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, s.peek_off);
        }
        sockopts::set_options(fd, &s.opts)
            .step(|| format!("cannot set the options of socket:[{id}]"))?;
    }
    Ok((out, later))
}

/// The connections not yet accepted by listener `id` (bound and
/// listening), in their order: each client connected again, and what it
/// had sent written; a client that had closed is closed again after that.
fn queue_pending(
    id: u64,
    s: &UnixSocket,
    socks: &HashMap<u64, &UnixSocket>,
    out: &mut HashMap<u64, OwnedFd>,
    ghosts: &mut Ghosts,
) -> Result<(), RestoreError> {
    let ty = s.sock_type as i32;
    let (tcwd, target) = ghosts.target(id, s);
    let (tcwd, target) = (tcwd.to_string(), target.to_vec());
    if target.is_empty() {
        return Err(RestoreError::Unsupported(format!(
            "connections were queued on socket:[{id}], a listener without a name, which cannot be reached again"
        )));
    }
    for (i, p) in s.pending.iter().enumerate() {
        let what = || format!("cannot queue connection {i} on socket:[{id}] again");
        let fd = fdio::unix_socket(ty).step(what)?;
        if p.client != 0 {
            let c = socks.get(&p.client).ok_or_else(|| {
                RestoreError::Unsupported(format!(
                    "socket:[{}], queued on socket:[{id}], is missing from the image",
                    p.client
                ))
            })?;
            bind(&fd, p.client, c, ghosts)?;
        }
        connect(&fd, &tcwd, &target).step(what)?;
        let total: usize = p.data.iter().map(Vec::len).sum();
        if total > 0 {
            let _ = fdio::setsockopt_int(
                &fd,
                libc::SOL_SOCKET,
                libc::SO_SNDBUFFORCE,
                (total as i32).saturating_mul(4).max(1 << 20),
            );
        }
        for m in &p.data {
            if ty == libc::SOCK_STREAM {
                fdio::write_all(&fd, m).step(what)?;
            } else {
                fdio::send(&fd, m).step(what)?;
            }
        }
        if p.client != 0 {
            out.insert(p.client, fd);
        }
    }
    Ok(())
}

/// Queue the saved messages of socket `id` again, written by its peer
/// (datagrams one by one, keeping their boundaries, from their named
/// sender where it is of the image), each with the files it carried
/// (`files`, by message).
fn write_queue(
    id: u64,
    socks: &HashMap<u64, &UnixSocket>,
    out: &HashMap<u64, OwnedFd>,
    orphans: &HashMap<u64, OwnedFd>,
    files: &HashMap<u32, Vec<OwnedFd>>,
    ghosts: &Ghosts,
) -> Result<(), RestoreError> {
    let ty = |s: &UnixSocket| s.sock_type as i32;
    let s = socks[&id];
    let (tcwd, tname) = ghosts.target(id, s);
    if s.queue.iter().all(|m| m.is_empty()) && ty(s) != libc::SOCK_DGRAM {
        return Ok(());
    }
    if s.queue.is_empty() {
        return Ok(());
    }
    let temp;
    // A datagram socket reached by its name from an unconnected socket
    // of ours (connecting to it would mark it connected too).
    let mut by_name = false;
    let sender = if let Some(o) = orphans.get(&id) {
        o
    } else if let Some(p) = out
        .get(&s.peer)
        .filter(|_| socks.get(&s.peer).is_some_and(|p| p.peer == id))
    {
        p
    } else if !s.name.is_empty() && ty(s) == libc::SOCK_DGRAM {
        temp = fdio::unix_socket(libc::SOCK_DGRAM).step(|| "cannot create a socket".into())?;
        by_name = true;
        &temp
    } else {
        return Err(RestoreError::Unsupported(format!(
            "socket:[{id}] has queued data but no peer to send it again"
        )));
    };
    let total: usize = s.queue.iter().map(Vec::len).sum();
    let _ = fdio::setsockopt_int(
        sender,
        libc::SOL_SOCKET,
        libc::SO_SNDBUFFORCE,
        (total as i32).saturating_mul(4).max(1 << 20),
    );
    let what = format!("cannot queue {total} bytes on socket:[{id}] again");
    for (i, m) in s.queue.iter().enumerate() {
        // A datagram from a named socket of the image is sent again by
        // that socket, so recvfrom() names the same sender.
        let from = s.queue_from.get(i).filter(|f| !f.is_empty());
        let of_image = from.and_then(|f| {
            socks
                .iter()
                .find(|(_, o)| &o.name == f)
                .and_then(|(oid, _)| out.get(oid))
        });
        // A sender closed since: a socket bound at its name for the while
        // of the send, where the name is free.
        let gone = match (of_image, from) {
            (None, Some(f)) if ty(s) == libc::SOCK_DGRAM && !s.name.is_empty() => {
                stand_in(f, &s.cwd)
            }
            _ => None,
        };
        let named_sender = of_image.or(gone.as_ref().map(|(fd, _)| fd));
        let carried: Vec<BorrowedFd<'_>> = files
            .get(&(i as u32))
            .map(|v| v.iter().map(|f| f.as_fd()).collect())
            .unwrap_or_default();
        // To `to` (None: the peer), with the files it carried.
        let send = |snd: &OwnedFd, to: Option<&[u8]>| match (carried.is_empty(), to) {
            (false, to) => fdio::send_with_fds(snd, m, &carried, to),
            (true, Some(to)) => fdio::send_to(snd, m, to),
            (true, None) if ty(s) == libc::SOCK_STREAM => fdio::write_all(snd, m),
            (true, None) => fdio::send(snd, m),
        };
        if ty(s) == libc::SOCK_STREAM {
            send(sender, None).step(|| what.clone())?;
        } else if let (Some(snd), false) = (named_sender, s.name.is_empty()) {
            let _ = fdio::setsockopt_int(snd, libc::SOL_SOCKET, libc::SO_SNDBUFFORCE, 1 << 20);
            from_dir(tcwd, tname, || send(snd, Some(tname))).step(|| what.clone())?;
        } else if by_name {
            from_dir(tcwd, tname, || send(sender, Some(tname))).step(|| what.clone())?;
        } else {
            send(sender, None).step(|| what.clone())?;
        }
        if let Some((_, Some(file))) = gone {
            let _ = std::fs::remove_file(file);
        }
    }
    Ok(())
}

/// A datagram socket bound at `name` (a sender closed since; `cwd` for a
/// relative path), where the name is free: an abstract name no socket
/// holds, a path where no file is. With the file it made (a path).
fn stand_in(name: &[u8], cwd: &str) -> Option<(OwnedFd, Option<String>)> {
    let file = is_path(name).then(|| abs_path(cwd, name));
    if file
        .as_ref()
        .is_some_and(|f| std::fs::symlink_metadata(f).is_ok())
    {
        return None;
    }
    let fd = fdio::unix_socket(libc::SOCK_DGRAM).ok()?;
    from_dir(cwd, name, || fdio::bind_unix(&fd, name)).ok()?;
    Some((fd, file))
}

fn shutdown(fd: &OwnedFd, s: &UnixSocket) {
    if s.shutdown & 2 != 0 {
        let _ = fdio::shutdown(fd, libc::SHUT_WR);
    }
    if s.shutdown & 1 != 0 {
        let _ = fdio::shutdown(fd, libc::SHUT_RD);
    }
}

/// What waits for the files in flight: the queues that carry them, the
/// shutdowns after them, the closed peers' ends.
#[derive(Default)]
pub struct Later {
    pub queues: Vec<u64>,
    shut: HashSet<u64>,
    orphans: HashMap<u64, OwnedFd>,
}

/// The queues carrying files in flight, now that every file is open
/// again (`files`: by socket, then message), then their shutdowns.
pub fn finish(
    ck: &Checkpoint,
    out: &HashMap<u64, OwnedFd>,
    later: Later,
    files: &HashMap<u64, HashMap<u32, Vec<OwnedFd>>>,
) -> Result<(), RestoreError> {
    let socks = of_image(ck);
    let none = HashMap::new();
    for &id in &later.queues {
        write_queue(
            id,
            &socks,
            out,
            &later.orphans,
            files.get(&id).unwrap_or(&none),
            &Ghosts::default(),
        )?;
    }
    drop(later.orphans);
    for id in later.shut {
        if let (Some(fd), Some(s)) = (out.get(&id), socks.get(&id)) {
            shutdown(fd, s);
        }
    }
    Ok(())
}

fn of_image(ck: &Checkpoint) -> HashMap<u64, &UnixSocket> {
    ck.objects
        .iter()
        .filter_map(|o| match &o.kind {
            ObjectKind::UnixSocket(u) => Some((o.id, u)),
            _ => None,
        })
        .collect()
}
