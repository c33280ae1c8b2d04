//! Listing the AF_UNIX sockets of the caller's network namespace through
//! NETLINK_SOCK_DIAG (`SOCK_DIAG_BY_FAMILY` requests carrying a
//! `struct unix_diag_req`, answered with `struct unix_diag_msg` plus
//! attributes; see linux/unix_diag.h).
//!
//! A checkpoint sees a process's sockets only as "socket:[INO]" links in
//! /proc/PID/fd. sock_diag is how that inode turns into what a restore needs:
//! the socket's type and state, its bound name (and the file it is bound to),
//! its peer, the not-yet-accepted connections of a listener, the queue
//! lengths and the shutdown state. [`dump_all`] lists every AF_UNIX socket of
//! the namespace (one dump, then lookups by inode), [`by_inode`] asks for one.
//!
//! Kernel behaviour worth knowing (checked on 6.18, unchanged for years):
//! - sock_diag inode numbers are 32 bits wide. Socket inodes always fit
//!   (sockfs numbers them with `get_next_ino()`), but the inode of the file a
//!   socket is bound to (`UNIX_DIAG_VFS`) is truncated to its low 32 bits.
//! - `udiag_vfs_dev` is the kernel-internal `dev_t` (major << 20 | minor),
//!   not the encoding `stat()` returns in `st_dev` (see `kdev_to_dev` in the
//!   tests for the conversion).
//! - `UNIX_DIAG_NAME` of a path-bound socket ends with the path's NUL
//!   terminator (the kernel counts it in the address length); [`UnixSock::name`]
//!   has it stripped. Abstract names are reported exactly as bound. A socket
//!   returned by accept() reports its listener's name.
//! - `UNIX_DIAG_ICONS` of a listener holds, for each queued connection, the
//!   inode of the *connecting (client) socket*: the server-side socket of a
//!   not-yet-accepted connection has no inode yet. For the same reason the
//!   client's `UNIX_DIAG_PEER` is 0 until the connection is accepted.
//! - `UNIX_DIAG_RQLEN` means different things by socket kind:
//!   listener: (queued connections, listen() backlog after the somaxconn cap);
//!   stream/seqpacket: (bytes queued for reading, write memory in flight);
//!   datagram: (length of the *first* queued datagram only, write memory in
//!   flight). "Write memory" is `sk_wmem_alloc`: the truesize of the skbs
//!   this socket sent that the receiver has not consumed yet (several hundred
//!   bytes for a 5-byte message), not a byte count.
//! - `UNIX_DIAG_SHUTDOWN` is sent for every socket whatever the show flags.

use crate::error::{Errno, Result};
use crate::sock_diag::{
    align4, attributes, exchange, message, next_seq, u32_at, QResult, QueryError, NLM_F_DUMP,
    NLM_F_REQUEST, SOCK_DIAG_BY_FAMILY,
};
use std::collections::HashMap;

// linux/unix_diag.h
const UDIAG_SHOW_NAME: u32 = 0x01;
const UDIAG_SHOW_VFS: u32 = 0x02;
const UDIAG_SHOW_PEER: u32 = 0x04;
const UDIAG_SHOW_ICONS: u32 = 0x08;
const UDIAG_SHOW_RQLEN: u32 = 0x10;
const UDIAG_SHOW_UID: u32 = 0x40;

const UNIX_DIAG_NAME: u16 = 0;
const UNIX_DIAG_VFS: u16 = 1;
const UNIX_DIAG_PEER: u16 = 2;
const UNIX_DIAG_ICONS: u16 = 3;
const UNIX_DIAG_RQLEN: u16 = 4;
// 5 is UNIX_DIAG_MEMINFO, not requested.
const UNIX_DIAG_SHUTDOWN: u16 = 6;
const UNIX_DIAG_UID: u16 = 7;

/// Wildcard cookie: "any socket with this inode".
const SOCK_DIAG_NOCOOKIE: u32 = !0;

/// One AF_UNIX socket as sock_diag reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnixSock {
    /// Socket inode (matches "socket:[ino]" in /proc/PID/fd).
    pub ino: u64,
    /// SOCK_STREAM=1, SOCK_DGRAM=2, SOCK_SEQPACKET=5.
    pub sock_type: u8,
    /// TCP_ESTABLISHED=1, TCP_LISTEN=10, TCP_CLOSE=7 ...
    pub state: u8,
    /// UNIX_DIAG_NAME raw bytes: path bytes (without the NUL terminator the
    /// kernel appends), or for abstract names a leading 0 byte then the name;
    /// None when unbound.
    pub name: Option<Vec<u8>>,
    /// UNIX_DIAG_VFS (udiag_vfs_dev, udiag_vfs_ino) of the bound file. The
    /// device is the kernel-internal encoding (major << 20 | minor) and the
    /// inode is truncated to 32 bits by the kernel.
    pub vfs: Option<(u32, u64)>,
    /// UNIX_DIAG_PEER inode, 0 if none.
    pub peer: u64,
    /// UNIX_DIAG_ICONS: for each not-yet-accepted connection of a listener,
    /// the inode of the connecting (client) socket.
    pub icons: Vec<u64>,
    /// UNIX_DIAG_RQLEN rqueue (for a listener: queued connections; for
    /// stream/seqpacket: bytes queued; for dgram: length of the first queued
    /// datagram).
    pub rqlen: u32,
    /// UNIX_DIAG_RQLEN wqueue (for a listener: backlog; else the truesize of
    /// sent skbs not yet consumed by the receiver).
    pub wqlen: u32,
    /// UNIX_DIAG_SHUTDOWN (bit0 RCV_SHUTDOWN, bit1 SEND_SHUTDOWN).
    pub shutdown: u8,
    /// UNIX_DIAG_UID.
    pub uid: Option<u32>,
}

/// Every AF_UNIX socket of the caller's network namespace, by inode.
///
/// The kernel walks its hash table without a snapshot: sockets created or
/// closed during the dump may or may not appear.
pub fn dump_all() -> Result<HashMap<u64, UnixSock>> {
    let socks = query(Query::Dump).map_err(|e| e.into_sys_error(Query::Dump.describe()))?;
    Ok(socks.into_iter().map(|s| (s.ino, s)).collect())
}

/// One socket by inode (request with udiag_ino set and the cookie wildcard
/// ~0), None if it does not exist.
pub fn by_inode(ino: u64) -> Result<Option<UnixSock>> {
    // sock_diag inodes are 32 bits wide and 0 is "no socket" (the kernel
    // answers EINVAL for it); socket inodes always fit in 32 bits.
    let Ok(ino32) = u32::try_from(ino) else {
        return Ok(None);
    };
    if ino32 == 0 {
        return Ok(None);
    }
    let q = Query::Inode(ino32);
    match query(q) {
        Ok(socks) => Ok(socks.into_iter().find(|s| s.ino == ino)),
        // The exact lookup answers ENOENT when no AF_UNIX socket of the
        // namespace has this inode.
        Err(QueryError::Kernel(Errno(libc::ENOENT))) => Ok(None),
        Err(e) => Err(e.into_sys_error(q.describe())),
    }
}

#[derive(Clone, Copy)]
enum Query {
    Dump,
    Inode(u32),
}

impl Query {
    fn describe(self) -> String {
        match self {
            Query::Dump => "sock_diag dump of AF_UNIX sockets".to_string(),
            Query::Inode(ino) => format!("sock_diag lookup of AF_UNIX socket inode {ino}"),
        }
    }
}

/// `struct unix_diag_req`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct UnixDiagReq {
    sdiag_family: u8,
    sdiag_protocol: u8,
    pad: u16,
    udiag_states: u32,
    udiag_ino: u32,
    udiag_show: u32,
    udiag_cookie: [u32; 2],
}

/// `struct unix_diag_msg`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(dead_code)] // mirrors the kernel layout; the cookie is not used
struct UnixDiagMsg {
    udiag_family: u8,
    udiag_type: u8,
    udiag_state: u8,
    pad: u8,
    udiag_ino: u32,
    udiag_cookie: [u32; 2],
}

const _: () = {
    assert!(std::mem::size_of::<UnixDiagReq>() == 24);
    assert!(std::mem::size_of::<UnixDiagMsg>() == 16);
};

impl UnixDiagReq {
    fn write(&self, out: &mut Vec<u8>) {
        out.push(self.sdiag_family);
        out.push(self.sdiag_protocol);
        out.extend_from_slice(&self.pad.to_ne_bytes());
        out.extend_from_slice(&self.udiag_states.to_ne_bytes());
        out.extend_from_slice(&self.udiag_ino.to_ne_bytes());
        out.extend_from_slice(&self.udiag_show.to_ne_bytes());
        out.extend_from_slice(&self.udiag_cookie[0].to_ne_bytes());
        out.extend_from_slice(&self.udiag_cookie[1].to_ne_bytes());
    }
}

impl UnixDiagMsg {
    fn parse(b: &[u8]) -> Option<Self> {
        Some(UnixDiagMsg {
            udiag_family: *b.first()?,
            udiag_type: *b.get(1)?,
            udiag_state: *b.get(2)?,
            pad: *b.get(3)?,
            udiag_ino: u32_at(b, 4)?,
            udiag_cookie: [u32_at(b, 8)?, u32_at(b, 12)?],
        })
    }
}

/// The request message (nlmsghdr + unix_diag_req) for `q`.
fn request(q: Query, seq: u32) -> Vec<u8> {
    let (flags, ino, cookie) = match q {
        Query::Dump => (NLM_F_REQUEST | NLM_F_DUMP, 0, [0, 0]),
        Query::Inode(ino) => (NLM_F_REQUEST, ino, [SOCK_DIAG_NOCOOKIE, SOCK_DIAG_NOCOOKIE]),
    };
    let req = UnixDiagReq {
        sdiag_family: libc::AF_UNIX as u8,
        sdiag_protocol: 0,
        pad: 0,
        // One bit per state (1 << TCP_*): all of them.
        udiag_states: !0,
        udiag_ino: ino,
        // UNIX_DIAG_SHUTDOWN has no show flag: it is always sent. MEMINFO is
        // not asked for.
        udiag_show: UDIAG_SHOW_NAME
            | UDIAG_SHOW_VFS
            | UDIAG_SHOW_PEER
            | UDIAG_SHOW_ICONS
            | UDIAG_SHOW_RQLEN
            | UDIAG_SHOW_UID,
        udiag_cookie: cookie,
    };
    let mut payload = Vec::with_capacity(std::mem::size_of::<UnixDiagReq>());
    req.write(&mut payload);
    message(SOCK_DIAG_BY_FAMILY, flags, seq, &payload)
}

/// One request/reply exchange (see [`exchange`]): the sockets answered.
fn query(q: Query) -> QResult<Vec<UnixSock>> {
    let seq = next_seq();
    let mut out = Vec::new();
    exchange(&request(q, seq), seq, &mut |_, payload| {
        if let Some(s) = parse_sock(payload)? {
            out.push(s);
        }
        Ok(())
    })?;
    Ok(out)
}

/// Parse one unix_diag_msg and its attributes; None if it is not AF_UNIX.
fn parse_sock(payload: &[u8]) -> QResult<Option<UnixSock>> {
    let msg = UnixDiagMsg::parse(payload).ok_or_else(|| {
        QueryError::Malformed(format!("unix_diag_msg of {} bytes", payload.len()))
    })?;
    if msg.udiag_family != libc::AF_UNIX as u8 {
        return Ok(None);
    }
    let mut s = UnixSock {
        ino: u64::from(msg.udiag_ino),
        sock_type: msg.udiag_type,
        state: msg.udiag_state,
        ..Default::default()
    };
    let bad = |what: &str, len: usize| {
        QueryError::Malformed(format!(
            "{what} of {len} bytes for socket inode {}",
            msg.udiag_ino
        ))
    };

    let start = align4(std::mem::size_of::<UnixDiagMsg>()).min(payload.len());
    let attrs = attributes(&payload[start..]).map_err(|len| bad("attribute length field", len))?;
    for (nla_type, data) in attrs {
        match nla_type {
            UNIX_DIAG_NAME => {
                let mut name = data.to_vec();
                // Path names are reported with their NUL terminator (the
                // kernel's address length counts it); abstract names (leading
                // 0) are reported exactly as bound and may end in 0 bytes
                // that belong to the name.
                if name.first().is_some_and(|&c| c != 0) && name.last() == Some(&0) {
                    name.pop();
                }
                s.name = Some(name);
            }
            UNIX_DIAG_VFS => {
                // struct unix_diag_vfs { u32 udiag_vfs_ino; u32 udiag_vfs_dev; }
                let (Some(ino), Some(dev)) = (u32_at(data, 0), u32_at(data, 4)) else {
                    return Err(bad("UNIX_DIAG_VFS", data.len()));
                };
                s.vfs = Some((dev, u64::from(ino)));
            }
            UNIX_DIAG_PEER => {
                let peer = u32_at(data, 0).ok_or_else(|| bad("UNIX_DIAG_PEER", data.len()))?;
                s.peer = u64::from(peer);
            }
            UNIX_DIAG_ICONS => {
                // An array of u32 inodes.
                let icons = data.chunks_exact(4);
                if !icons.remainder().is_empty() {
                    return Err(bad("UNIX_DIAG_ICONS", data.len()));
                }
                s.icons = icons
                    .map(|c| u64::from(u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                    .collect();
            }
            UNIX_DIAG_RQLEN => {
                // struct unix_diag_rqlen { u32 udiag_rqueue; u32 udiag_wqueue; }
                let (Some(rq), Some(wq)) = (u32_at(data, 0), u32_at(data, 4)) else {
                    return Err(bad("UNIX_DIAG_RQLEN", data.len()));
                };
                s.rqlen = rq;
                s.wqlen = wq;
            }
            UNIX_DIAG_SHUTDOWN => {
                s.shutdown = *data
                    .first()
                    .ok_or_else(|| bad("UNIX_DIAG_SHUTDOWN", data.len()))?;
            }
            UNIX_DIAG_UID => {
                s.uid = Some(u32_at(data, 0).ok_or_else(|| bad("UNIX_DIAG_UID", data.len()))?);
            }
            // UNIX_DIAG_MEMINFO (not requested), or added by a newer kernel.
            _ => {}
        }
    }
    Ok(Some(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::os::unix::ffi::OsStrExt;

    // The crate's own wrappers make the sockets these tests look at.
    use crate::fdio::{bind_unix as bind, connect_unix as connect, listen, write_all as write};

    fn socket(ty: libc::c_int) -> OwnedFd {
        crate::fdio::unix_socket(ty).unwrap()
    }

    fn socketpair(ty: libc::c_int) -> (OwnedFd, OwnedFd) {
        crate::fdio::unix_socketpair(ty).unwrap()
    }

    fn inode(fd: &OwnedFd) -> u64 {
        nix::sys::stat::fstat(fd).unwrap().st_ino
    }

    /// The userspace `dev_t` of a kernel-internal one (MINORBITS = 20), as
    /// udiag_vfs_dev is reported.
    fn kdev_to_dev(kdev: u32) -> u64 {
        libc::makedev(kdev >> 20, kdev & 0xf_ffff)
    }

    fn euid() -> u32 {
        nix::unistd::geteuid().as_raw()
    }

    #[test]
    fn stream_socketpair_peers() {
        let (a, b) = socketpair(libc::SOCK_STREAM);
        let (ia, ib) = (inode(&a), inode(&b));
        write(&a, b"abc").unwrap();
        let all = dump_all().unwrap();
        let sa = all.get(&ia).expect("first end listed");
        let sb = all.get(&ib).expect("second end listed");
        for (s, peer) in [(sa, ib), (sb, ia)] {
            assert_eq!(s.sock_type, libc::SOCK_STREAM as u8);
            assert_eq!(s.state, 1, "TCP_ESTABLISHED");
            assert_eq!(s.peer, peer);
            assert_eq!(s.name, None);
            assert_eq!(s.vfs, None);
            assert!(s.icons.is_empty());
            assert_eq!(s.uid, Some(euid()));
        }
        // Stream sockets: rqueue is the bytes waiting to be read; the
        // sender's wqueue is the truesize of its unconsumed skbs.
        assert_eq!(sb.rqlen, 3);
        assert!(sa.wqlen > 3, "wqlen {}", sa.wqlen);

        assert_eq!(by_inode(ia).unwrap().as_ref(), Some(sa));
    }

    #[test]
    fn listener_with_pending_connection() {
        let name = format!("\0cr-diag-test-{}-listen", std::process::id()).into_bytes();
        let l = socket(libc::SOCK_STREAM);
        bind(&l, &name).unwrap();
        listen(&l, 7).unwrap();
        let c = socket(libc::SOCK_STREAM);
        connect(&c, &name).unwrap();
        let (il, ic) = (inode(&l), inode(&c));

        let all = dump_all().unwrap();
        let sl = all.get(&il).expect("listener listed");
        assert_eq!(sl.state, 10, "TCP_LISTEN");
        assert_eq!(sl.name.as_deref(), Some(&name[..]));
        assert_eq!(sl.vfs, None);
        // The icon is the connecting socket's inode: the server-side socket
        // of the pending connection has no inode before accept().
        assert_eq!(sl.icons, vec![ic]);
        assert_eq!(sl.rqlen, 1, "one queued connection");
        assert_eq!(sl.wqlen, 7, "the listen() backlog");

        let sc = all.get(&ic).expect("client listed");
        assert_eq!(sc.state, 1);
        assert_eq!(sc.peer, 0, "embryo peer has no inode yet");
        assert_eq!(sc.name, None);

        assert_eq!(by_inode(il).unwrap().as_ref(), Some(sl));
    }

    #[test]
    fn dgram_bound_to_path() {
        let path = std::env::temp_dir().join(format!("cr-diag-test-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let s = socket(libc::SOCK_DGRAM);
        bind(&s, path.as_os_str().as_bytes()).unwrap();
        let got = by_inode(inode(&s)).unwrap().expect("bound socket found");
        let meta = std::fs::metadata(&path).unwrap();
        std::fs::remove_file(&path).unwrap();

        assert_eq!(got.sock_type, libc::SOCK_DGRAM as u8);
        assert_eq!(got.state, 7, "TCP_CLOSE");
        assert_eq!(got.name.as_deref(), Some(path.as_os_str().as_bytes()));
        let (dev, ino) = got.vfs.expect("vfs of a path-bound socket");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(ino, meta.ino() & 0xffff_ffff);
        assert_eq!(kdev_to_dev(dev), meta.dev());
    }

    #[test]
    fn dgram_queue_length() {
        let (a, b) = socketpair(libc::SOCK_DGRAM);
        write(&a, b"12345").unwrap();
        write(&a, b"xyz").unwrap();
        let got = by_inode(inode(&b)).unwrap().expect("receiver found");
        // Datagram sockets: rqueue is the length of the first queued
        // datagram only, not the total.
        assert_ne!(got.rqlen, 0);
        assert_eq!(got.rqlen, 5);
        let sender = by_inode(inode(&a)).unwrap().expect("sender found");
        assert!(sender.wqlen > 8, "wqlen {}", sender.wqlen);
    }

    #[test]
    fn shutdown_bits() {
        let (a, b) = socketpair(libc::SOCK_STREAM);
        crate::fdio::shutdown(&a, libc::SHUT_WR).unwrap();
        let sa = by_inode(inode(&a)).unwrap().unwrap();
        let sb = by_inode(inode(&b)).unwrap().unwrap();
        assert_eq!(sa.shutdown, 2, "SEND_SHUTDOWN on the shut end");
        assert_eq!(sb.shutdown, 1, "RCV_SHUTDOWN on the peer");
    }

    #[test]
    fn missing_inode() {
        assert_eq!(by_inode(0).unwrap(), None);
        assert_eq!(by_inode(u64::MAX).unwrap(), None);
        // A regular file's inode is no socket.
        let f = std::fs::File::open("/proc/self/status").unwrap();
        use std::os::unix::fs::MetadataExt;
        let ino = f.metadata().unwrap().ino();
        if let Ok(ino) = u32::try_from(ino) {
            assert_eq!(by_inode(u64::from(ino)).unwrap(), None);
        }
    }
}
