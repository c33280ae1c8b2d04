//! Unix sockets rebuilt inside the restorer, in an order that lets every
//! connection be made again:
//! 1. stale socket files at saved paths are removed;
//! 2. connected pairs: a socketpair, or (for a stream pair with a name,
//!    like an accepted connection) a temporary listener at the name, a
//!    connect and an accept, so both ends carry their names again;
//! 3. listeners, then unconnected sockets, bound (and unlinked again where
//!    the saved path no longer named them);
//! 4. one-way connections: datagram sockets connected to a named socket
//!    (of the image or outside it, like /dev/log), and connections still
//!    waiting in a listener's queue;
//! 5. a stream whose peer had closed: a pair whose other end is closed
//!    after its data is written;
//! 6. the receive queues, written by each socket's peer (datagrams one by
//!    one, keeping their boundaries), then shutdowns and options.

use crate::error::RestoreError;
use cr_image::proto;
use cr_sys::fdio;
use std::collections::HashMap;
use std::os::fd::OwnedFd;

const TCP_LISTEN: u32 = 10;
const TCP_ESTABLISHED: u32 = 1;

fn sys(what: String) -> impl FnOnce(cr_sys::SysError) -> RestoreError {
    move |e| RestoreError::Unsupported(format!("{what}: {}", cr_sys::error::one_line(&e)))
}

fn is_path(name: &[u8]) -> bool {
    !name.is_empty() && name[0] != 0
}

fn unlink_socket_file(name: &[u8]) {
    use std::os::unix::fs::FileTypeExt;
    let p = String::from_utf8_lossy(name).into_owned();
    if std::fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_socket()) {
        let _ = std::fs::remove_file(&p);
    }
}

fn bind(fd: &OwnedFd, id: u64, s: &proto::UnixSocket) -> Result<(), RestoreError> {
    if s.name.is_empty() {
        return Ok(());
    }
    fdio::bind_unix(fd, &s.name).map_err(sys(format!("cannot bind socket:[{id}]")))?;
    if s.name_unlinked && is_path(&s.name) {
        let _ = std::fs::remove_file(String::from_utf8_lossy(&s.name).as_ref());
    }
    Ok(())
}

/// Every unix socket of the image, by id.
pub fn prepare(ck: &proto::Checkpoint) -> Result<HashMap<u64, OwnedFd>, RestoreError> {
    let socks: HashMap<u64, &proto::UnixSocket> = ck
        .objects
        .iter()
        .filter_map(|o| Some((o.id, o.unix.as_ref()?)))
        .collect();
    let mut out: HashMap<u64, OwnedFd> = HashMap::new();
    // Other end of a stream whose peer had closed: closed after its data.
    let mut orphans: HashMap<u64, OwnedFd> = HashMap::new();
    let mut ids: Vec<u64> = socks.keys().copied().collect();
    ids.sort();
    for s in socks.values() {
        if is_path(&s.name) {
            unlink_socket_file(&s.name);
        }
    }
    let ty = |s: &proto::UnixSocket| s.sock_type as i32;
    // 2. Pairs.
    for &a in &ids {
        let sa = socks[&a];
        let b = sa.peer;
        let Some(&sb) = socks.get(&b) else { continue };
        if sb.peer != a || b < a {
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
            let l = fdio::unix_socket(ty(s_srv)).map_err(sys(what.clone()))?;
            fdio::bind_unix(&l, &s_srv.name).map_err(sys(what.clone()))?;
            fdio::listen(&l, 1).map_err(sys(what.clone()))?;
            let c = fdio::unix_socket(ty(s_cli)).map_err(sys(what.clone()))?;
            bind(&c, cli, s_cli)?;
            fdio::connect_unix(&c, &s_srv.name).map_err(sys(what.clone()))?;
            let s = fdio::accept(&l).map_err(sys(what.clone()))?;
            drop(l);
            if is_path(&s_srv.name) {
                unlink_socket_file(&s_srv.name);
            }
            if srv == a {
                (s, c)
            } else {
                (c, s)
            }
        } else {
            let (x, y) = fdio::unix_socketpair(ty(sa)).map_err(sys(what.clone()))?;
            bind(&x, a, sa)?;
            bind(&y, b, sb)?;
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
            let fd =
                fdio::unix_socket(ty(s)).map_err(sys(format!("cannot create socket:[{id}]")))?;
            bind(&fd, id, s)?;
            if listening {
                fdio::listen(&fd, s.backlog as i32)
                    .map_err(sys(format!("cannot listen on socket:[{id}]")))?;
            }
            out.insert(id, fd);
        }
    }
    // 4. One-way connections.
    for &id in &ids {
        let s = socks[&id];
        if out.contains_key(&id) {
            continue;
        }
        let target = if s.listener != 0 {
            socks.get(&s.listener).map(|l| l.name.clone())
        } else if s.peer != 0 {
            socks.get(&s.peer).map(|p| p.name.clone())
        } else if !s.peer_name.is_empty() {
            Some(s.peer_name.clone())
        } else {
            continue;
        };
        let target = target.filter(|n| !n.is_empty()).ok_or_else(|| {
            RestoreError::Unsupported(format!(
                "socket:[{id}] was connected to a socket without a name, which cannot be reached again"
            ))
        })?;
        let fd = fdio::unix_socket(ty(s)).map_err(sys(format!("cannot create socket:[{id}]")))?;
        bind(&fd, id, s)?;
        fdio::connect_unix(&fd, &target).map_err(sys(format!(
            "cannot connect socket:[{id}] to {} again",
            fdio::show_name(&target)
        )))?;
        out.insert(id, fd);
    }
    // 5. Streams whose peer had closed.
    for &id in &ids {
        let s = socks[&id];
        if out.contains_key(&id) {
            continue;
        }
        let (x, y) =
            fdio::unix_socketpair(ty(s)).map_err(sys(format!("cannot create socket:[{id}]")))?;
        bind(&x, id, s)?;
        out.insert(id, x);
        orphans.insert(id, y);
    }
    // 6. Queues, shutdowns, options.
    for &id in &ids {
        let s = socks[&id];
        if s.queue.iter().all(|m| m.is_empty()) && ty(s) != libc::SOCK_DGRAM {
            continue;
        }
        if s.queue.is_empty() {
            continue;
        }
        let temp;
        let sender = if let Some(o) = orphans.get(&id) {
            o
        } else if let Some(p) = out
            .get(&s.peer)
            .filter(|_| socks.get(&s.peer).is_some_and(|p| p.peer == id))
        {
            p
        } else if !s.name.is_empty() && ty(s) == libc::SOCK_DGRAM {
            temp = fdio::unix_socket(libc::SOCK_DGRAM)
                .map_err(sys("cannot create a socket".into()))?;
            fdio::connect_unix(&temp, &s.name)
                .map_err(sys(format!("cannot reach socket:[{id}]")))?;
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
        for m in &s.queue {
            if ty(s) == libc::SOCK_STREAM {
                fdio::write_all(sender, m).map_err(sys(what.clone()))?;
            } else {
                fdio::send(sender, m).map_err(sys(what.clone()))?;
            }
        }
    }
    drop(orphans);
    for &id in &ids {
        let s = socks[&id];
        let Some(fd) = out.get(&id) else { continue };
        if s.shutdown & 2 != 0 {
            let _ = fdio::shutdown(fd, libc::SHUT_WR);
        }
        if s.shutdown & 1 != 0 {
            let _ = fdio::shutdown(fd, libc::SHUT_RD);
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
        if s.passcred {
            let _ = fdio::setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PASSCRED, 1);
        }
        if s.peek_off >= 0 {
            let _ = fdio::setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, s.peek_off);
        }
    }
    Ok(out)
}
