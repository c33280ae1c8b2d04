//! The NETLINK_SOCK_DIAG transport shared by the socket kinds' lookups
//! ([`crate::unix_diag`] for AF_UNIX, [`crate::inet`] for TCP): message
//! headers, one request/reply exchange with the kernel, its errors.

use crate::error::{Errno, SysError};
use nix::errno::Errno as NixErrno;
use nix::sys::socket::{
    self as sock, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType,
};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};

// linux/netlink.h
pub(crate) const NLMSG_HDRLEN: usize = 16;
pub(crate) const NLMSG_NOOP: u16 = 1;
pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;
pub(crate) const NLM_F_REQUEST: u16 = 0x01;
pub(crate) const NLM_F_MULTI: u16 = 0x02;
pub(crate) const NLM_F_DUMP_INTR: u16 = 0x10;
pub(crate) const NLM_F_ROOT: u16 = 0x100;
pub(crate) const NLM_F_MATCH: u16 = 0x200;
pub(crate) const NLM_F_DUMP: u16 = NLM_F_ROOT | NLM_F_MATCH;

// linux/sock_diag.h
pub(crate) const SOCK_DIAG_BY_FAMILY: u16 = 20;
pub(crate) const SOCK_DESTROY: u16 = 21;
pub(crate) const NLM_F_ACK: u16 = 0x04;

/// Initial receive buffer. Netlink dump datagrams are at most about 32 KiB
/// (the kernel caps its dump allocation at SKB_WITH_OVERHEAD(32768)); a
/// larger datagram still cannot be truncated because every datagram is
/// peeked with MSG_TRUNC first and the buffer grown to fit.
pub(crate) const RECV_BUF: usize = 64 * 1024;

/// Failures of one exchange, kept apart so that callers can recognise the
/// kernel's answers (ENOENT: no such socket).
pub(crate) enum QueryError {
    /// A system call on the netlink socket failed.
    Syscall(&'static str, Errno),
    /// The kernel answered with an error.
    Kernel(Errno),
    /// The reply does not parse.
    Malformed(String),
}

impl QueryError {
    /// The error of the exchange described by `what`.
    pub(crate) fn into_sys_error(self, what: String) -> SysError {
        match self {
            QueryError::Syscall(call, source) => SysError::Syscall {
                what: format!("{call} for {what}"),
                source,
            },
            QueryError::Kernel(source) => SysError::Syscall { what, source },
            QueryError::Malformed(m) => SysError::Parse {
                path: format!("reply to {what}"),
                what: m,
            },
        }
    }
}

pub(crate) type QResult<T> = std::result::Result<T, QueryError>;

/// `struct nlmsghdr`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct NlMsgHdr {
    pub nlmsg_len: u32,
    pub nlmsg_type: u16,
    pub nlmsg_flags: u16,
    pub nlmsg_seq: u32,
    pub nlmsg_pid: u32,
}

const _: () = assert!(std::mem::size_of::<NlMsgHdr>() == NLMSG_HDRLEN);

pub(crate) fn bytes_at<const N: usize>(b: &[u8], off: usize) -> Option<[u8; N]> {
    b.get(off..off.checked_add(N)?)?.try_into().ok()
}

pub(crate) fn u16_at(b: &[u8], off: usize) -> Option<u16> {
    bytes_at(b, off).map(u16::from_ne_bytes)
}

pub(crate) fn u32_at(b: &[u8], off: usize) -> Option<u32> {
    bytes_at(b, off).map(u32::from_ne_bytes)
}

pub(crate) fn i32_at(b: &[u8], off: usize) -> Option<i32> {
    bytes_at(b, off).map(i32::from_ne_bytes)
}

/// Size of `struct nlattr`.
const NLA_HDRLEN: usize = 4;
/// The flag bits (NLA_F_NESTED, NLA_F_NET_BYTEORDER) of an attribute type.
const NLA_TYPE_MASK: u16 = !(0x8000 | 0x4000);

/// The netlink attributes packed in `b`, (type, data) each; a damaged
/// length field ends it with that length as the error.
pub(crate) fn attributes(mut b: &[u8]) -> std::result::Result<Vec<(u16, &[u8])>, usize> {
    let mut out = Vec::new();
    while b.len() >= NLA_HDRLEN {
        let nla_len = usize::from(u16_at(b, 0).unwrap_or(0));
        let nla_type = u16_at(b, 2).unwrap_or(0) & NLA_TYPE_MASK;
        if nla_len < NLA_HDRLEN || nla_len > b.len() {
            return Err(nla_len);
        }
        out.push((nla_type, &b[NLA_HDRLEN..nla_len]));
        b = &b[align4(nla_len).min(b.len())..];
    }
    Ok(out)
}

/// NLMSG_ALIGN / NLA_ALIGN: both round up to 4 bytes.
pub(crate) fn align4(len: usize) -> usize {
    (len + 3) & !3
}

impl NlMsgHdr {
    pub(crate) fn parse(b: &[u8]) -> Option<Self> {
        Some(NlMsgHdr {
            nlmsg_len: u32_at(b, 0)?,
            nlmsg_type: u16_at(b, 4)?,
            nlmsg_flags: u16_at(b, 6)?,
            nlmsg_seq: u32_at(b, 8)?,
            nlmsg_pid: u32_at(b, 12)?,
        })
    }

    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.nlmsg_len.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_type.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_flags.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_seq.to_ne_bytes());
        out.extend_from_slice(&self.nlmsg_pid.to_ne_bytes());
    }
}

/// A fresh sequence number for a request.
pub(crate) fn next_seq() -> u32 {
    static SEQ: AtomicU32 = AtomicU32::new(1);
    SEQ.fetch_add(1, Ordering::Relaxed)
}

/// A netlink message: header for `msg_type`/`flags`/`seq`, then `payload`.
pub(crate) fn message(msg_type: u16, flags: u16, seq: u32, payload: &[u8]) -> Vec<u8> {
    let len = NLMSG_HDRLEN + payload.len();
    let mut out = Vec::with_capacity(len);
    NlMsgHdr {
        nlmsg_len: len as u32,
        nlmsg_type: msg_type,
        nlmsg_flags: flags,
        nlmsg_seq: seq,
        nlmsg_pid: 0,
    }
    .write(&mut out);
    out.extend_from_slice(payload);
    out
}

/// Send `request` (sequence number `seq`) on a fresh NETLINK_SOCK_DIAG
/// socket and hand every reply message of type SOCK_DIAG_BY_FAMILY to
/// `on_msg` (its flags and payload) until the kernel is done: a dump's
/// DONE, an acknowledgement, or a lookup's single answer. A kernel error
/// ends the exchange with [`QueryError::Kernel`].
pub(crate) fn exchange(
    request: &[u8],
    seq: u32,
    on_msg: &mut dyn FnMut(u16, &[u8]) -> QResult<()>,
) -> QResult<()> {
    let fd = open(
        SockProtocol::NetlinkSockDiag,
        "socket(AF_NETLINK, NETLINK_SOCK_DIAG)",
    )?;
    send(&fd, request)?;
    let mut buf = vec![0u8; RECV_BUF];
    loop {
        let n = recv_from_kernel(&fd, &mut buf)?;
        if parse_datagram(&buf[..n], seq, on_msg)? {
            return Ok(());
        }
    }
}

/// A netlink socket of `protocol` to talk to the kernel (`what` names the
/// call in an error).
pub(crate) fn open(protocol: SockProtocol, what: &'static str) -> QResult<OwnedFd> {
    sock::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        protocol,
    )
    .map_err(|e| QueryError::Syscall(what, e.into()))
}

pub(crate) fn send(fd: &OwnedFd, msg: &[u8]) -> QResult<()> {
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
pub(crate) fn recv_from_kernel(fd: &OwnedFd, buf: &mut Vec<u8>) -> QResult<usize> {
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

/// Parse the netlink messages of one datagram; true when the exchange is over.
fn parse_datagram(
    mut b: &[u8],
    seq: u32,
    on_msg: &mut dyn FnMut(u16, &[u8]) -> QResult<()>,
) -> QResult<bool> {
    let mut done = false;
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
                done = true;
            }
            NLMSG_ERROR => {
                let err = i32_at(payload, 0)
                    .ok_or_else(|| QueryError::Malformed("short NLMSG_ERROR".into()))?;
                if err < 0 {
                    return Err(QueryError::Kernel(Errno(-err)));
                }
                // 0 is an acknowledgement: the exchange is over.
                done = true;
            }
            SOCK_DIAG_BY_FAMILY => {
                if hdr.nlmsg_flags & NLM_F_DUMP_INTR != 0 {
                    tracing::debug!("sock_diag: dump interrupted flag set");
                }
                on_msg(hdr.nlmsg_flags, payload)?;
                // An exact lookup answers with a single message without
                // NLM_F_MULTI and nothing after it.
                if hdr.nlmsg_flags & NLM_F_MULTI == 0 {
                    done = true;
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
    Ok(done)
}
