//! TCP sockets through NETLINK_SOCK_DIAG (`struct inet_diag_req_v2`,
//! linux/inet_diag.h): find the socket of one connection by its addresses,
//! and destroy it (`SOCK_DESTROY`, CONFIG_INET_DIAG_DESTROY) when no
//! process holds it any more.
//!
//! What this is for: a connection restored while the killed original's
//! socket still lingers (closed but not gone: FIN-WAIT, CLOSING, LAST-ACK,
//! TIME-WAIT) cannot take its addresses back ("cannot assign requested
//! address"); a second restore of the same image meets the first copy's
//! remains. Such a socket has no file any more (`idiag_inode` 0), so
//! nothing can use it: destroying it is what `ss -K` would do.
//!
//! Kernel behaviour worth knowing: an exact lookup names the socket from
//! its own side (`idiag_src`/`idiag_sport` local, `idiag_dst`/`idiag_dport`
//! remote, all in network byte order) and is answered by one
//! `inet_diag_msg` or ENOENT; SOCK_DESTROY takes the same request (with the
//! cookie of the answer) and aborts the socket, TIME-WAIT ones included.

use crate::error::{Errno, Result};
use crate::sock_diag::{
    attributes, exchange, message, next_seq, u32_at, QueryError, NLM_F_ACK, NLM_F_DUMP,
    NLM_F_REQUEST, SOCK_DESTROY, SOCK_DIAG_BY_FAMILY,
};
use std::net::{IpAddr, SocketAddr};

/// Wildcard cookie.
const NOCOOKIE: u32 = !0;
/// Size of `struct inet_diag_req_v2`.
const REQ_LEN: usize = 56;
/// Offsets in `struct inet_diag_msg`.
const MSG_STATE: usize = 1;
const MSG_COOKIE: usize = 44;
const MSG_INODE: usize = 68;
/// Offsets of `struct inet_diag_sockid` in `struct inet_diag_msg`.
const MSG_SPORT: usize = 4;
const MSG_DPORT: usize = 6;
const MSG_SRC: usize = 8;
const MSG_DST: usize = 24;
/// TCP_LISTEN (include/net/tcp_states.h).
const LISTEN: u8 = 10;

/// Size of `struct inet_diag_msg`, which the attributes follow.
const MSG_LEN: usize = 72;
/// INET_DIAG_SHUTDOWN: the u8 of shutdown bits, sent for every socket.
const INET_DIAG_SHUTDOWN: u16 = 8;

/// One TCP socket as an exact lookup reports it.
#[derive(Debug, Clone, Copy)]
pub struct TcpSock {
    /// TCP state (include/net/tcp_states.h).
    pub state: u8,
    /// Its file's inode; 0 when no process holds it (orphaned, TIME-WAIT).
    pub inode: u32,
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2` for the TCP connection `local` -> `remote`.
fn request(local: SocketAddr, remote: SocketAddr, cookie: [u32; 2]) -> Vec<u8> {
    request_of(libc::IPPROTO_TCP, local, remote, cookie)
}

/// `struct inet_diag_req_v2` for a socket of `protocol`.
fn request_of(protocol: i32, local: SocketAddr, remote: SocketAddr, cookie: [u32; 2]) -> Vec<u8> {
    let family = if local.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    let mut r = Vec::with_capacity(REQ_LEN);
    r.push(family as u8);
    r.push(protocol as u8);
    r.push(0); // idiag_ext: no extensions
    r.push(0);
    r.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
    r.extend_from_slice(&local.port().to_be_bytes());
    r.extend_from_slice(&remote.port().to_be_bytes());
    for a in [local.ip(), remote.ip()] {
        let mut b = [0u8; 16];
        match a {
            IpAddr::V4(v4) => b[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => b.copy_from_slice(&v6.octets()),
        }
        r.extend_from_slice(&b);
    }
    r.extend_from_slice(&0u32.to_ne_bytes()); // idiag_if
    r.extend_from_slice(&cookie[0].to_ne_bytes());
    r.extend_from_slice(&cookie[1].to_ne_bytes());
    debug_assert_eq!(r.len(), REQ_LEN);
    r
}

fn describe(what: &str, local: SocketAddr, remote: SocketAddr) -> String {
    format!("sock_diag {what} of TCP {local} -> {remote}")
}

/// The TCP socket of the connection `local` -> `remote`, if there is one.
pub fn lookup(local: SocketAddr, remote: SocketAddr) -> Result<Option<TcpSock>> {
    exact(local, remote, |p| {
        let bad = || QueryError::Malformed(format!("inet_diag_msg of {} bytes", p.len()));
        Ok(Some(TcpSock {
            state: *p.get(MSG_STATE).ok_or_else(bad)?,
            inode: u32_at(p, MSG_INODE).ok_or_else(bad)?,
            cookie: [
                u32_at(p, MSG_COOKIE).ok_or_else(bad)?,
                u32_at(p, MSG_COOKIE + 4).ok_or_else(bad)?,
            ],
        }))
    })
}

/// The exact lookup of the TCP connection `local` -> `remote`: what `read`
/// makes of the kernel's answer (None: no such socket).
fn exact<T>(
    local: SocketAddr,
    remote: SocketAddr,
    mut read: impl FnMut(&[u8]) -> std::result::Result<Option<T>, QueryError>,
) -> Result<Option<T>> {
    let seq = next_seq();
    let req = message(
        SOCK_DIAG_BY_FAMILY,
        NLM_F_REQUEST,
        seq,
        &request(local, remote, [NOCOOKIE; 2]),
    );
    let mut found = None;
    let r = exchange(&req, seq, &mut |_, p| {
        found = read(p)?;
        Ok(())
    });
    match r {
        Ok(()) => Ok(found),
        Err(QueryError::Kernel(Errno(libc::ENOENT))) => Ok(None),
        Err(e) => Err(e.into_sys_error(describe("lookup", local, remote))),
    }
}

/// A dump request of every socket of `protocol` and family IPv4 (or IPv6),
/// with its sequence number.
fn dump_request(protocol: i32, ipv4: bool) -> (u32, Vec<u8>) {
    let any = SocketAddr::new(
        if ipv4 {
            IpAddr::from([0u8; 4])
        } else {
            IpAddr::from([0u8; 16])
        },
        0,
    );
    let seq = next_seq();
    let req = message(
        SOCK_DIAG_BY_FAMILY,
        NLM_F_REQUEST | NLM_F_DUMP,
        seq,
        &request_of(protocol, any, any, [NOCOOKIE; 2]),
    );
    (seq, req)
}

/// What sock_diag tells of one socket found by its file's inode.
#[derive(Debug, Clone, Copy)]
pub struct Found {
    /// The shutdown(2) bits (1 receive side, 2 send side).
    pub shutdown: u8,
    /// The address it is connected (or connecting) to: unlike
    /// getpeername, known for a socket in SYN-SENT too.
    pub remote: Option<SocketAddr>,
}

/// The socket of `protocol` (TCP or UDP) and family `ipv4` or not whose
/// file has inode `inode`; None if none has. The kernel keeps no other
/// trace of a UDP socket's shutdown that could be read (poll shows the
/// receive side only).
pub fn by_inode(protocol: i32, ipv4: bool, inode: u64) -> Result<Option<Found>> {
    let (seq, req) = dump_request(protocol, ipv4);
    let mut found = None;
    let r = exchange(&req, seq, &mut |_, p| {
        if let Some(f) = found_of(p, ipv4, inode)? {
            found = Some(f);
        }
        Ok(())
    });
    r.map_err(|e| e.into_sys_error(format!("sock_diag dump of sockets of protocol {protocol}")))?;
    Ok(found)
}

/// [`by_inode`] for the TCP connection `local` -> `remote` (as getsockname
/// and getpeername give them): one exact lookup, whose cost does not grow
/// with the sockets of the namespace (a dump per socket made a node's
/// checkpoint quadratic in its connections). None when no socket of
/// those addresses has inode `inode`.
pub fn tcp_by_addresses(
    local: SocketAddr,
    remote: SocketAddr,
    inode: u64,
) -> Result<Option<Found>> {
    exact(local, remote, |p| found_of(p, local.is_ipv4(), inode))
}

/// What the `inet_diag_msg` `p` (of family IPv4 or not) tells, if it is
/// the socket of inode `inode`.
fn found_of(p: &[u8], ipv4: bool, inode: u64) -> std::result::Result<Option<Found>, QueryError> {
    let bad = || QueryError::Malformed(format!("inet_diag_msg of {} bytes", p.len()));
    if u64::from(u32_at(p, MSG_INODE).ok_or_else(bad)?) != inode || p.len() < MSG_LEN {
        return Ok(None);
    }
    let attrs = attributes(&p[MSG_LEN..]).map_err(|_| bad())?;
    let remote = addr_at(p, MSG_DST, MSG_DPORT, ipv4).ok_or_else(bad)?;
    Ok(Some(Found {
        shutdown: attrs
            .iter()
            .find(|(t, _)| *t == INET_DIAG_SHUTDOWN)
            .and_then(|(_, d)| d.first().copied())
            .unwrap_or(0),
        remote: (remote.port() != 0).then_some(remote),
    }))
}

/// The shutdown(2) bits of a socket found as [`by_inode`] finds it.
pub fn shutdown_of(protocol: i32, ipv4: bool, inode: u64) -> Result<Option<u8>> {
    Ok(by_inode(protocol, ipv4, inode)?.map(|f| f.shutdown))
}

/// Destroy the socket of `local` -> `remote` when no process holds it (see
/// the module documentation); returns its state if one was destroyed.
pub fn destroy_orphan(local: SocketAddr, remote: SocketAddr) -> Result<Option<u8>> {
    destroy_held_by(local, remote, 0)
}

/// Abort the socket of `local` -> `remote` whose inode is `inode` (a
/// socket of ours: `tcp_abort`, as `ss -K` does): it goes to CLOSE at
/// once, shut both ways, keeping its addresses, with ECONNABORTED pending
/// (SO_ERROR clears it). A connection in ESTABLISHED sends a reset to the
/// peer. Returns its state before, None if there was no such socket.
pub fn abort(local: SocketAddr, remote: SocketAddr, inode: u64) -> Result<Option<u8>> {
    destroy_held_by(local, remote, inode)
}

/// Destroy the socket of `local` -> `remote` if its inode is `inode` (0:
/// no process holds it).
fn destroy_held_by(local: SocketAddr, remote: SocketAddr, inode: u64) -> Result<Option<u8>> {
    let Some(s) = lookup(local, remote)? else {
        return Ok(None);
    };
    if u64::from(s.inode) != inode {
        return Ok(None);
    }
    let seq = next_seq();
    let req = message(
        SOCK_DESTROY,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        &request(local, remote, s.cookie),
    );
    match exchange(&req, seq, &mut |_, _| Ok(())) {
        Ok(()) => Ok(Some(s.state)),
        // Gone meanwhile.
        Err(QueryError::Kernel(Errno(libc::ENOENT))) => Ok(None),
        Err(e) => Err(e.into_sys_error(describe("destroy", local, remote))),
    }
}

/// The address at `off` of an `inet_diag_msg` of `family`.
fn addr_at(p: &[u8], off: usize, port: usize, v4: bool) -> Option<SocketAddr> {
    let port = u16::from_be_bytes([*p.get(port)?, *p.get(port + 1)?]);
    let ip: IpAddr = if v4 {
        <[u8; 4]>::try_from(p.get(off..off + 4)?).ok()?.into()
    } else {
        <[u8; 16]>::try_from(p.get(off..off + 16)?).ok()?.into()
    };
    Some(SocketAddr::new(ip, port))
}

/// Destroy every TCP socket that no process holds (closing, TIME-WAIT)
/// and whose local address `local` would need, that is its port on the
/// same or any address; returns their states. For a listener that cannot
/// bind because the killed original's closed connections (accepted on
/// that port) still linger.
pub fn destroy_orphans_on_port(local: SocketAddr) -> Result<Vec<u8>> {
    let v4 = local.is_ipv4();
    let (seq, req) = dump_request(libc::IPPROTO_TCP, v4);
    let mut found = Vec::new();
    let r = exchange(&req, seq, &mut |_, p| {
        let bad = || QueryError::Malformed(format!("inet_diag_msg of {} bytes", p.len()));
        let state = *p.get(MSG_STATE).ok_or_else(bad)?;
        let inode = u32_at(p, MSG_INODE).ok_or_else(bad)?;
        let l = addr_at(p, MSG_SRC, MSG_SPORT, v4).ok_or_else(bad)?;
        let r = addr_at(p, MSG_DST, MSG_DPORT, v4).ok_or_else(bad)?;
        let overlaps =
            local.ip().is_unspecified() || l.ip().is_unspecified() || l.ip() == local.ip();
        if inode == 0 && state != LISTEN && l.port() == local.port() && overlaps {
            let cookie = [
                u32_at(p, MSG_COOKIE).ok_or_else(bad)?,
                u32_at(p, MSG_COOKIE + 4).ok_or_else(bad)?,
            ];
            found.push((l, r, cookie, state));
        }
        Ok(())
    });
    r.map_err(|e| {
        e.into_sys_error(format!(
            "sock_diag dump of TCP sockets on port {}",
            local.port()
        ))
    })?;
    let mut destroyed = Vec::new();
    for (l, r, cookie, state) in found {
        let seq = next_seq();
        let req = message(
            SOCK_DESTROY,
            NLM_F_REQUEST | NLM_F_ACK,
            seq,
            &request(l, r, cookie),
        );
        match exchange(&req, seq, &mut |_, _| Ok(())) {
            Ok(()) => destroyed.push(state),
            Err(QueryError::Kernel(Errno(libc::ENOENT))) => {}
            Err(e) => return Err(e.into_sys_error(describe("destroy", l, r))),
        }
    }
    Ok(destroyed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn a_held_connection_is_found_and_never_destroyed() {
        let lis = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(lis.local_addr().unwrap()).unwrap();
        let (local, remote) = (c.local_addr().unwrap(), c.peer_addr().unwrap());
        let s = lookup(local, remote).unwrap().expect("found");
        assert_eq!(s.state, crate::inet::TCP_ESTABLISHED);
        assert_ne!(s.inode, 0);
        assert_eq!(destroy_orphan(local, remote).unwrap(), None);
        assert!(lookup(local, remote).unwrap().is_some());
    }

    #[test]
    fn a_connection_is_found_by_its_addresses_as_by_its_inode() {
        let lis = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(lis.local_addr().unwrap()).unwrap();
        let (_srv, _) = lis.accept().unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        let (local, remote) = (c.local_addr().unwrap(), c.peer_addr().unwrap());
        let fd: std::os::fd::OwnedFd = c.try_clone().unwrap().into();
        let ino = crate::fdio::inode(&fd).unwrap();
        let exact = tcp_by_addresses(local, remote, ino)
            .unwrap()
            .expect("found");
        let dumped = by_inode(libc::IPPROTO_TCP, true, ino)
            .unwrap()
            .expect("found");
        assert_eq!(exact.remote, Some(remote));
        assert_eq!(
            (exact.remote, exact.shutdown),
            (dumped.remote, dumped.shutdown)
        );
        assert_eq!(exact.shutdown & 2, 2, "the send side was shut");
        // Another inode at those addresses, or no socket there: None.
        assert!(tcp_by_addresses(local, remote, ino + 1).unwrap().is_none());
        assert!(tcp_by_addresses(remote, local, ino).unwrap().is_none());
        let nowhere = SocketAddr::from(([127, 0, 0, 1], 1));
        assert!(tcp_by_addresses(local, nowhere, ino).unwrap().is_none());
    }

    #[test]
    fn a_closed_connection_lingering_is_destroyed() {
        let lis = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(lis.local_addr().unwrap()).unwrap();
        let (_srv, _) = lis.accept().unwrap();
        let (local, remote) = (c.local_addr().unwrap(), c.peer_addr().unwrap());
        drop(c); // FIN sent; the server never closes: FIN-WAIT-2
        let orphan = lookup(local, remote).unwrap().expect("lingers");
        assert_eq!(orphan.inode, 0);
        assert!(destroy_orphan(local, remote).unwrap().is_some());
        assert!(lookup(local, remote).unwrap().is_none());
        assert!(
            lookup(remote, local).unwrap().is_some(),
            "the other end is held"
        );
    }

    #[test]
    fn closed_connections_of_a_port_are_destroyed_the_held_ones_kept() {
        let lis = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = lis.local_addr().unwrap();
        let c1 = TcpStream::connect(port).unwrap();
        let (s1, _) = lis.accept().unwrap();
        let c2 = TcpStream::connect(port).unwrap();
        let (s2, _) = lis.accept().unwrap();
        let closed = (s1.local_addr().unwrap(), s1.peer_addr().unwrap());
        drop(s1); // the server side closes first: FIN-WAIT-2 on the port
        let any = SocketAddr::new(IpAddr::from([0u8; 4]), port.port());
        let states = destroy_orphans_on_port(any).unwrap();
        assert_eq!(states.len(), 1, "{states:?}");
        // An exact lookup falls back to the listener of the port.
        let after = lookup(closed.0, closed.1).unwrap();
        assert!(after.is_none_or(|s| s.state == LISTEN), "{after:?}");
        // Held ones and the listener stay.
        let held = (s2.local_addr().unwrap(), s2.peer_addr().unwrap());
        assert!(lookup(held.0, held.1).unwrap().is_some());
        drop((c1, c2, lis));
    }
}
