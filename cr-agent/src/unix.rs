//! Unix domain sockets: what sock_diag tells about each (type, state, name,
//! peer, queued connections, shutdown), and the receive queue read without
//! consuming it (MSG_PEEK with SO_PEEK_OFF on a copy of the fd taken with
//! pidfd_getfd).
//!
//! A socket whose peer is outside the tree can only be kept when it is a
//! datagram socket connected to a named peer (reconnected by name, like
//! /dev/log), or when it is fd 0, 1 or 2 (taken from cr_restart). Other
//! socket families are refused by name.

use crate::fds::{inherited, Scan};
use crate::objects::Objects;
use cr_image::proto;
use cr_sys::fdio;

const TCP_LISTEN: u8 = 10;

pub fn describe(
    mut f: proto::Fd,
    pid: i32,
    fd: i32,
    ino: u64,
    scan: &mut Scan,
    objects: Option<&mut Objects>,
) -> Result<Option<proto::Fd>, String> {
    let all = scan.unix()?;
    let Some(u) = all.get(&ino).cloned() else {
        return Ok(None); // gone meanwhile
    };
    let kind = match u.sock_type as i32 {
        libc::SOCK_STREAM => "stream",
        libc::SOCK_DGRAM => "datagram",
        libc::SOCK_SEQPACKET => "seqpacket",
        _ => {
            return Err(format!(
                "a unix socket of type {} (not supported)",
                u.sock_type
            ))
        }
    };
    // A seqpacket socket whose peer is gone reads 0 at the end of its queue.
    let zero_ends =
        u.sock_type as i32 == libc::SOCK_SEQPACKET && (u.peer == 0 || u.shutdown & 1 != 0);
    let mut s = proto::UnixSocket {
        sock_type: u.sock_type as u32,
        state: u.state as u32,
        name: u.name.clone().unwrap_or_default(),
        shutdown: u.shutdown as u32,
        peek_off: -1,
        ..Default::default()
    };
    if u.state == TCP_LISTEN {
        s.backlog = u.wqlen;
        let outside: Vec<u64> = u
            .icons
            .iter()
            .copied()
            .filter(|c| !scan.socket_in_tree(*c))
            .collect();
        if !outside.is_empty() {
            tracing::warn!(
                pid,
                fd,
                queued = outside.len(),
                "connections from outside the tree queued on a listening unix socket are dropped"
            );
        }
    } else if u.peer != 0 && !scan.socket_in_tree(u.peer) {
        let peer_name = scan.unix()?.get(&u.peer).and_then(|p| p.name.clone());
        match peer_name {
            Some(n) if u.sock_type as i32 == libc::SOCK_DGRAM && !n.is_empty() => s.peer_name = n,
            _ if fd <= 2 => {
                return inherited(
                    f,
                    pid,
                    fd,
                    format!("a unix {kind} socket connected outside the tree"),
                );
            }
            _ => {
                return Err(format!(
                "a unix {kind} socket connected to socket:[{}] outside the tree (not supported)",
                u.peer
            ))
            }
        }
    } else if u.peer != 0 {
        s.peer = u.peer;
    } else if u.state == 1 && u.sock_type as i32 != libc::SOCK_DGRAM {
        // Connected, peer 0: either queued on a listener (not accepted yet)
        // or its peer is gone.
        let listener = scan
            .unix()?
            .values()
            .find(|l| l.state == TCP_LISTEN && l.icons.contains(&ino))
            .map(|l| l.ino);
        match listener {
            Some(l) if scan.socket_in_tree(l) => s.listener = l,
            Some(l) if fd > 2 => {
                return Err(format!(
                    "a unix {kind} socket waiting to be accepted by socket:[{l}] outside the tree (not supported)"
                ))
            }
            Some(_) => return inherited(f, pid, fd, format!("a unix {kind} socket connected outside the tree")),
            None => {} // the peer closed; the queue still holds its last data
        }
    }
    let relative = |n: &[u8]| !n.is_empty() && n[0] != 0 && n[0] != b'/';
    if relative(&s.name) || relative(&s.peer_name) {
        s.cwd = cr_sys::proc::read_link(&format!("/proc/{pid}/cwd")).unwrap_or_default();
    }
    if s.listener != 0 && u.wqlen > 0 {
        return Err(format!(
            "a unix {kind} socket not yet accepted by socket:[{}] that already sent data (the data waits where it cannot be read; not supported)",
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
        s.name_unlinked = match std::fs::metadata(&path) {
            Ok(md) => {
                use std::os::unix::fs::MetadataExt;
                u.vfs.map(|(_, i)| i & 0xffff_ffff) != Some(md.ino() & 0xffff_ffff)
            }
            Err(_) => true,
        };
    }
    f.kind = proto::FdKind::UnixSocket as i32;
    f.object = ino;
    let Some(objs) = objects else {
        // `cr_checkpoint --check` looks into the queue for fds in flight.
        // Not done before every dump: a peek marks empty datagrams, which
        // later peeks with an offset no longer see.
        if scan.deep && u.state != TCP_LISTEN {
            if let Ok(sock) = fdio::steal_fd(pid, fd) {
                let stream = u.sock_type as i32 == libc::SOCK_STREAM;
                if let Ok(Err(fdio::PeekProblem::FdsInFlight)) =
                    fdio::peek_queue(&sock, stream, zero_ends)
                {
                    return Err(format!(
                        "a unix {kind} socket with file descriptors in flight (SCM_RIGHTS, not supported)"
                    ));
                }
            }
        }
        return Ok(Some(f));
    };
    if objs.contains(proto::ObjectKind::UnixSocketObject, ino) {
        return Ok(Some(f));
    }
    let err = |e: cr_sys::SysError| {
        format!(
            "a unix {kind} socket that cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    };
    let sock = fdio::steal_fd(pid, fd).map_err(err)?;
    if u.state != TCP_LISTEN {
        s.queue = match fdio::peek_queue(&sock, u.sock_type as i32 == libc::SOCK_STREAM, zero_ends)
            .map_err(err)?
        {
            Ok(q) => {
                if u.sock_type as i32 != libc::SOCK_STREAM
                    && q.iter().any(|(_, from)| !from.is_empty())
                {
                    s.queue_from = q.iter().map(|(_, from)| from.clone()).collect();
                }
                q.into_iter().map(|(m, _)| m).collect()
            }
            Err(fdio::PeekProblem::FdsInFlight) => {
                return Err(format!(
                "a unix {kind} socket with file descriptors in flight (SCM_RIGHTS, not supported)"
            ))
            }
        };
    }
    s.sndbuf = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_SNDBUF).unwrap_or(0);
    s.rcvbuf = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_RCVBUF).unwrap_or(0);
    s.passcred = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_PASSCRED).unwrap_or(0) != 0;
    s.peek_off = fdio::getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_PEEK_OFF).unwrap_or(-1);
    objs.insert(proto::FileObject {
        id: ino,
        kind: proto::ObjectKind::UnixSocketObject as i32,
        unix: Some(s),
        ..Default::default()
    });
    Ok(Some(f))
}
