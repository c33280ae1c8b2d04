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

use crate::error::{Errno, Result, SysError};
use nix::errno::Errno as NixErrno;
use nix::sys::socket::{
    self as sock, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

// linux/netlink.h
const NLMSG_HDRLEN: usize = 16;
const NLMSG_NOOP: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x01;
const NLM_F_MULTI: u16 = 0x02;
const NLM_F_DUMP_INTR: u16 = 0x10;
const NLM_F_ROOT: u16 = 0x100;
const NLM_F_MATCH: u16 = 0x200;
const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;
const NLA_HDRLEN: usize = 4;
/// Attribute type bits that are flags (NLA_F_NESTED, NLA_F_NET_BYTEORDER).
const NLA_TYPE_MASK: u16 = !(0x8000 | 0x4000);

// linux/sock_diag.h
const SOCK_DIAG_BY_FAMILY: u16 = 20;

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

/// Initial receive buffer. Netlink dump datagrams are at most about 32 KiB
/// (the kernel caps its dump allocation at SKB_WITH_OVERHEAD(32768)); a
/// larger datagram still cannot be truncated because every datagram is
/// peeked with MSG_TRUNC first and the buffer grown to fit.
const RECV_BUF: usize = 64 * 1024;

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
    let socks = query(Query::Dump).map_err(|e| e.into_sys_error(Query::Dump))?;
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
        Err(e) => Err(e.into_sys_error(q)),
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

/// Failures of one exchange, kept apart so that [`by_inode`] can recognise
/// the kernel's ENOENT.
enum QueryError {
    /// A system call on the netlink socket failed.
    Syscall(&'static str, Errno),
    /// The kernel answered with an error.
    Kernel(Errno),
    /// The reply does not parse.
    Malformed(String),
}

impl QueryError {
    fn into_sys_error(self, q: Query) -> SysError {
        match self {
            QueryError::Syscall(call, source) => SysError::Syscall {
                what: format!("{call} for {}", q.describe()),
                source,
            },
            QueryError::Kernel(source) => SysError::Syscall {
                what: q.describe(),
                source,
            },
            QueryError::Malformed(what) => SysError::Parse {
                path: format!("reply to {}", q.describe()),
                what,
            },
        }
    }
}

type QResult<T> = std::result::Result<T, QueryError>;

/// `struct nlmsghdr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct NlMsgHdr {
    nlmsg_len: u32,
    nlmsg_type: u16,
    nlmsg_flags: u16,
    nlmsg_seq: u32,
    nlmsg_pid: u32,
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
    assert!(std::mem::size_of::<NlMsgHdr>() == NLMSG_HDRLEN);
    assert!(std::mem::size_of::<UnixDiagReq>() == 24);
    assert!(std::mem::size_of::<UnixDiagMsg>() == 16);
};

fn bytes_at<const N: usize>(b: &[u8], off: usize) -> Option<[u8; N]> {
    b.get(off..off.checked_add(N)?)?.try_into().ok()
}

fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    bytes_at(b, off).map(u16::from_ne_bytes)
}

fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    bytes_at(b, off).map(u32::from_ne_bytes)
}

fn i32_at(b: &[u8], off: usize) -> Option<i32> {
    bytes_at(b, off).map(i32::from_ne_bytes)
}

/// NLMSG_ALIGN / NLA_ALIGN: both round up to 4 bytes.
fn align4(len: usize) -> usize {
    (len + 3) & !3
}

impl NlMsgHdr {
    fn parse(b: &[u8]) -> Option<Self> {
        Some(NlMsgHdr {
            nlmsg_len: u32_at(b, 0)?,
            nlmsg_type: u16_at(b, 4)?,
            nlmsg_flags: u16_at(b, 6)?,
            nlmsg_seq: u32_at(b, 8)?,
            nlmsg_pid: u32_at(b, 12)?,
        })
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.nlmsg_len.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_type.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_flags.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_seq.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_pid.to_ne_bytes());
    }
}

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
    let len = NLMSG_HDRLEN + std::mem::size_of::<UnixDiagReq>();
    let hdr = NlMsgHdr {
        nlmsg_len: len as u32,
        nlmsg_type: SOCK_DIAG_BY_FAMILY,
        nlmsg_flags: flags,
        nlmsg_seq: seq,
        nlmsg_pid: 0,
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
    let mut out = Vec::with_capacity(len);
    hdr.write(&mut out);
    req.write(&mut out);
    debug_assert_eq!(out.len(), len);
    out
}

/// One request/reply exchange on a fresh NETLINK_SOCK_DIAG socket (closed
/// by `OwnedFd` on every path).
fn query(q: Query) -> QResult<Vec<UnixSock>> {
    static SEQ: AtomicU32 = AtomicU32::new(1);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);

    let fd = sock::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )
    .map_err(|e| QueryError::Syscall("socket(AF_NETLINK, NETLINK_SOCK_DIAG)", e.into()))?;

    send(&fd, &request(q, seq))?;

    let mut buf = vec![0u8; RECV_BUF];
    let mut out = Vec::new();
    loop {
        let n = recv_from_kernel(&fd, &mut buf)?;
        if parse_datagram(&buf[..n], seq, &mut out)? == Flow::Done {
            return Ok(out);
        }
    }
}

fn send(fd: &OwnedFd, msg: &[u8]) -> QResult<()> {
    // Port id 0: the kernel.
    let kernel = NetlinkAddr::new(0, 0);
    loop {
        match sock::sendto(fd.as_raw_fd(), msg, &kernel, MsgFlags::empty()) {
            Err(NixErrno::EINTR) => continue,
            Err(e) => return Err(QueryError::Syscall("sendto", e.into())),
            Ok(n) if n != msg.len() => {
                return Err(QueryError::Syscall("sendto (short)", Errno(libc::EMSGSIZE)))
            }
            Ok(_) => return Ok(()),
        }
    }
}

struct Received {
    len: usize,
    flags: MsgFlags,
    sender: u32,
}

fn recvmsg_into(fd: &OwnedFd, buf: &mut [u8], flags: MsgFlags) -> QResult<Received> {
    loop {
        let mut iov = [std::io::IoSliceMut::new(buf)];
        match sock::recvmsg::<NetlinkAddr>(fd.as_raw_fd(), &mut iov, None, flags) {
            Err(NixErrno::EINTR) => continue,
            Err(e) => return Err(QueryError::Syscall("recvmsg", e.into())),
            Ok(m) => {
                return Ok(Received {
                    len: m.bytes,
                    flags: m.flags,
                    sender: m.address.map_or(0, |a| a.pid()),
                })
            }
        }
    }
}

/// Receive one whole datagram sent by the kernel into `buf`, growing `buf`
/// if the datagram is larger; returns its length.
fn recv_from_kernel(fd: &OwnedFd, buf: &mut Vec<u8>) -> QResult<usize> {
    loop {
        // With MSG_TRUNC netlink returns the datagram's real length even when
        // it does not fit; MSG_PEEK leaves it queued for the real read.
        let peek = recvmsg_into(fd, buf, MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC)?;
        if peek.len > buf.len() {
            buf.resize(peek.len, 0);
            continue;
        }
        let got = recvmsg_into(fd, buf, MsgFlags::empty())?;
        if got.flags.contains(MsgFlags::MSG_TRUNC) {
            // Only if the queue head changed between peek and read, which
            // cannot happen with a single reader; refuse partial data.
            return Err(QueryError::Malformed(format!(
                "datagram truncated to {} bytes",
                got.len
            )));
        }
        if got.sender != 0 {
            // Not from the kernel (another root process can unicast to our
            // port id); not part of the reply.
            tracing::debug!(sender = got.sender, "sock_diag: ignoring foreign datagram");
            continue;
        }
        return Ok(got.len);
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    More,
    Done,
}

/// Parse the netlink messages of one datagram, appending sockets to `out`.
fn parse_datagram(mut b: &[u8], seq: u32, out: &mut Vec<UnixSock>) -> QResult<Flow> {
    let mut flow = Flow::More;
    while b.len() >= NLMSG_HDRLEN {
        let hdr = NlMsgHdr::parse(b).ok_or_else(|| QueryError::Malformed("short header".into()))?;
        let len = hdr.nlmsg_len as usize;
        if len < NLMSG_HDRLEN || len > b.len() {
            return Err(QueryError::Malformed(format!(
                "message length {len} with {} bytes left",
                b.len()
            )));
        }
        let payload = &b[NLMSG_HDRLEN..len];
        b = &b[align4(len).min(b.len())..];

        if hdr.nlmsg_seq != seq {
            tracing::debug!(
                seq = hdr.nlmsg_seq,
                expected = seq,
                "sock_diag: ignoring message of another request"
            );
            continue;
        }
        match hdr.nlmsg_type {
            NLMSG_NOOP => {}
            NLMSG_DONE => {
                // A dump's DONE carries an int: 0, or the negative errno the
                // dump failed with.
                if let Some(err) = i32_at(payload, 0) {
                    if err < 0 {
                        return Err(QueryError::Kernel(Errno(-err)));
                    }
                }
                flow = Flow::Done;
            }
            NLMSG_ERROR => {
                let err = i32_at(payload, 0)
                    .ok_or_else(|| QueryError::Malformed("short NLMSG_ERROR".into()))?;
                if err < 0 {
                    return Err(QueryError::Kernel(Errno(-err)));
                }
                // 0 is an acknowledgement; we asked for none, but it ends the
                // exchange all the same.
                flow = Flow::Done;
            }
            SOCK_DIAG_BY_FAMILY => {
                if hdr.nlmsg_flags & NLM_F_DUMP_INTR != 0 {
                    // unix_diag does not track consistency, so this is not
                    // expected; the dump is still as good as any other.
                    tracing::debug!("sock_diag: dump interrupted flag set");
                }
                if let Some(s) = parse_sock(payload)? {
                    out.push(s);
                }
                // An exact lookup answers with a single message without
                // NLM_F_MULTI and nothing after it.
                if hdr.nlmsg_flags & NLM_F_MULTI == 0 {
                    flow = Flow::Done;
                }
            }
            other => {
                tracing::debug!(
                    r#type = other,
                    "sock_diag: ignoring unexpected message type"
                );
            }
        }
    }
    Ok(flow)
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
    let mut attrs = &payload[start..];
    while attrs.len() >= NLA_HDRLEN {
        let nla_len = usize::from(u16_at(attrs, 0).unwrap_or(0));
        let nla_type = u16_at(attrs, 2).unwrap_or(0) & NLA_TYPE_MASK;
        if nla_len < NLA_HDRLEN || nla_len > attrs.len() {
            return Err(bad("attribute length field", nla_len));
        }
        let data = &attrs[NLA_HDRLEN..nla_len];
        attrs = &attrs[align4(nla_len).min(attrs.len())..];

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
