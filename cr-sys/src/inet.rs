//! IPv4 and IPv6 sockets: addresses, socket options as raw bytes, and TCP
//! repair mode (`TCP_REPAIR`), which lets a privileged process read a
//! connection's sequence numbers and both queues without sending anything,
//! and build a connection in the established state without a handshake.
//!
//! Surprises of the kernel worth knowing (net/ipv4/tcp.c):
//! - Entering repair mode sets `sk_reuse` to "force" (binding ignores
//!   conflicts); leaving it resets `sk_reuse` to 0, whatever SO_REUSEADDR
//!   the program had set, so callers set it again afterwards.
//! - `TCP_REPAIR_OFF` sends a window probe, `TCP_REPAIR_OFF_NO_WP` does not.
//! - A socket in repair mode that is closed sends neither FIN nor RST.
//! - `TCP_REPAIR_OPTIONS` is accepted only between the repair-mode
//!   `connect()` and the first byte queued for sending.
//! - In repair mode, data sent with `TCP_SEND_QUEUE` selected counts as
//!   sent but not yet acknowledged (nothing leaves), and data sent with
//!   `TCP_RECV_QUEUE` selected lands in the receive queue.

use crate::error::{Errno, Result, SysError};
use crate::fdio::{cvt, own};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, OwnedFd};

pub const TCP_REPAIR: i32 = 19;
pub const TCP_REPAIR_QUEUE: i32 = 20;
pub const TCP_QUEUE_SEQ: i32 = 21;
pub const TCP_REPAIR_OPTIONS: i32 = 22;
pub const TCP_TIMESTAMP: i32 = 24;
pub const TCP_REPAIR_WINDOW: i32 = 29;

pub const REPAIR_ON: i32 = 1;
pub const REPAIR_OFF: i32 = 0;
pub const REPAIR_OFF_NO_WP: i32 = -1;

/// The queues `TCP_REPAIR_QUEUE` selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TcpQueue {
    Recv = 1,
    Send = 2,
}

/// Option codes of `TCP_REPAIR_OPTIONS` (the TCP header option kinds).
pub const TCPOPT_MSS: u32 = 2;
pub const TCPOPT_WINDOW: u32 = 3;
pub const TCPOPT_SACK_PERM: u32 = 4;
pub const TCPOPT_TIMESTAMP: u32 = 8;

/// Bits of `tcpi_options`.
pub const TCPI_OPT_TIMESTAMPS: u8 = 1;
pub const TCPI_OPT_SACK: u8 = 2;
pub const TCPI_OPT_WSCALE: u8 = 4;

/// Bytes of the receive queue, of the send queue, of the send queue never sent.
pub const SIOCINQ: u64 = libc::FIONREAD;
pub const SIOCOUTQ: u64 = libc::TIOCOUTQ;
pub const SIOCOUTQNSD: u64 = 0x894B;

/// TCP states (include/net/tcp_states.h).
pub const TCP_ESTABLISHED: u8 = 1;
pub const TCP_SYN_SENT: u8 = 2;
pub const TCP_CLOSE: u8 = 7;
pub const TCP_LISTEN: u8 = 10;

/// The name of TCP state `s`.
pub fn tcp_state_name(s: u8) -> &'static str {
    match s {
        1 => "ESTABLISHED",
        2 => "SYN-SENT",
        3 => "SYN-RECV",
        4 => "FIN-WAIT-1",
        5 => "FIN-WAIT-2",
        6 => "TIME-WAIT",
        7 => "CLOSE",
        8 => "CLOSE-WAIT",
        9 => "LAST-ACK",
        10 => "LISTEN",
        11 => "CLOSING",
        _ => "UNKNOWN",
    }
}

/// `socket(family, ty | SOCK_CLOEXEC, protocol)`.
pub fn socket(family: i32, ty: i32, protocol: i32) -> Result<OwnedFd> {
    // SAFETY: plain syscall with integer arguments.
    let r = unsafe { libc::socket(family, ty | libc::SOCK_CLOEXEC, protocol) };
    own(r as i64, || format!("socket({family}, {ty}, {protocol})"))
}

fn to_raw(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn from_raw(ss: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match ss.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin: libc::sockaddr_in =
                unsafe { std::ptr::read((ss as *const libc::sockaddr_storage).cast()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6: libc::sockaddr_in6 =
                unsafe { std::ptr::read((ss as *const libc::sockaddr_storage).cast()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

fn name_of(fd: &OwnedFd, peer: bool) -> Result<Option<SocketAddr>> {
    // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast();
    // SAFETY: the kernel writes at most `len` bytes into `ss`.
    let r = unsafe {
        if peer {
            libc::getpeername(fd.as_raw_fd(), p, &mut len)
        } else {
            libc::getsockname(fd.as_raw_fd(), p, &mut len)
        }
    };
    if r < 0 {
        let e = Errno::last();
        if e.0 == libc::ENOTCONN {
            return Ok(None);
        }
        return Err(SysError::Syscall {
            what: if peer { "getpeername" } else { "getsockname" }.into(),
            source: e,
        });
    }
    Ok(from_raw(&ss))
}

/// The socket's own address.
pub fn local_addr(fd: &OwnedFd) -> Result<Option<SocketAddr>> {
    name_of(fd, false)
}

/// The address the socket is connected to, if it is.
pub fn peer_addr(fd: &OwnedFd) -> Result<Option<SocketAddr>> {
    name_of(fd, true)
}

pub fn bind(fd: &OwnedFd, addr: &SocketAddr) -> Result<()> {
    let (ss, len) = to_raw(addr);
    // SAFETY: `ss` holds a valid address of `len` bytes.
    let r = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&ss as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    cvt(r as i64, || format!("bind to {addr}")).map(drop)
}

pub fn connect(fd: &OwnedFd, addr: &SocketAddr) -> Result<()> {
    let (ss, len) = to_raw(addr);
    // SAFETY: `ss` holds a valid address of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&ss as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    cvt(r as i64, || format!("connect to {addr}")).map(drop)
}

/// getsockopt into a buffer of up to `max` bytes; returns what the kernel wrote.
pub fn getsockopt_bytes(fd: &OwnedFd, level: i32, opt: i32, max: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; max];
    let mut len = max as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` bytes into `buf`.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    cvt(r as i64, || format!("getsockopt({level}, {opt})"))?;
    buf.truncate(len as usize);
    Ok(buf)
}

pub fn setsockopt_bytes(fd: &OwnedFd, level: i32, opt: i32, val: &[u8]) -> Result<()> {
    // SAFETY: the kernel reads `val.len()` bytes from `val`.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            val.as_ptr().cast(),
            val.len() as libc::socklen_t,
        )
    };
    cvt(r as i64, || format!("setsockopt({level}, {opt})")).map(drop)
}

/// An int option, with the option's name in the error.
fn set_int(fd: &OwnedFd, level: i32, opt: i32, v: i32, what: &str) -> Result<()> {
    crate::fdio::setsockopt_int(fd, level, opt, v).map_err(|e| rename(e, what))
}

fn get_int(fd: &OwnedFd, level: i32, opt: i32, what: &str) -> Result<i32> {
    crate::fdio::getsockopt_int(fd, level, opt).map_err(|e| rename(e, what))
}

fn rename(e: SysError, what: &str) -> SysError {
    match e {
        SysError::Syscall { source, .. } => SysError::Syscall {
            what: what.to_string(),
            source,
        },
        e => e,
    }
}

/// An int ioctl on a socket (SIOCINQ, SIOCOUTQ, SIOCOUTQNSD).
pub fn ioctl_int(fd: &OwnedFd, req: u64) -> Result<i32> {
    let mut v: libc::c_int = 0;
    // SAFETY: these ioctls write one int.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req as _, &mut v) };
    cvt(r as i64, || format!("ioctl({req:#x})"))?;
    Ok(v)
}

/// The first bytes of `struct tcp_info` that describe a socket's shape.
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpInfo {
    pub state: u8,
    pub options: u8,
    pub snd_wscale: u8,
    pub rcv_wscale: u8,
    /// Listening socket: connections waiting to be accepted.
    pub unacked: u32,
    /// Listening socket: the backlog it was given.
    pub sacked: u32,
}

pub fn tcp_info(fd: &OwnedFd) -> Result<TcpInfo> {
    let b = getsockopt_bytes(fd, libc::IPPROTO_TCP, libc::TCP_INFO, 32)
        .map_err(|e| rename(e, "getsockopt(TCP_INFO)"))?;
    if b.len() < 32 {
        return Err(SysError::Syscall {
            what: format!("getsockopt(TCP_INFO) returned {} bytes", b.len()),
            source: Errno(libc::EPROTO),
        });
    }
    let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    Ok(TcpInfo {
        state: b[0],
        options: b[5],
        // Two 4-bit fields; the first declared is the low nibble.
        snd_wscale: b[6] & 0xf,
        rcv_wscale: b[6] >> 4,
        unacked: u32_at(24),
        sacked: u32_at(28),
    })
}

/// Enter or leave repair mode (REPAIR_ON, REPAIR_OFF, REPAIR_OFF_NO_WP).
pub fn set_repair(fd: &OwnedFd, mode: i32) -> Result<()> {
    set_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_REPAIR,
        mode,
        &format!("setsockopt(TCP_REPAIR, {mode})"),
    )
}

pub fn set_repair_queue(fd: &OwnedFd, q: TcpQueue) -> Result<()> {
    set_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_REPAIR_QUEUE,
        q as i32,
        "setsockopt(TCP_REPAIR_QUEUE)",
    )
}

/// The selected queue's sequence number: write_seq for the send queue,
/// rcv_nxt for the receive queue.
pub fn queue_seq(fd: &OwnedFd) -> Result<u32> {
    get_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_QUEUE_SEQ,
        "getsockopt(TCP_QUEUE_SEQ)",
    )
    .map(|v| v as u32)
}

/// Set the selected queue's first sequence number (before connect).
pub fn set_queue_seq(fd: &OwnedFd, seq: u32) -> Result<()> {
    set_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_QUEUE_SEQ,
        seq as i32,
        "setsockopt(TCP_QUEUE_SEQ)",
    )
}

/// `struct tcp_repair_window`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RepairWindow {
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
}

pub fn repair_window(fd: &OwnedFd) -> Result<RepairWindow> {
    let b = getsockopt_bytes(fd, libc::IPPROTO_TCP, TCP_REPAIR_WINDOW, 20)
        .map_err(|e| rename(e, "getsockopt(TCP_REPAIR_WINDOW)"))?;
    let w = |i: usize| {
        b.get(i * 4..i * 4 + 4)
            .map(|s| u32::from_ne_bytes(s.try_into().expect("4 bytes")))
            .unwrap_or(0)
    };
    Ok(RepairWindow {
        snd_wl1: w(0),
        snd_wnd: w(1),
        max_window: w(2),
        rcv_wnd: w(3),
        rcv_wup: w(4),
    })
}

pub fn set_repair_window(fd: &OwnedFd, w: &RepairWindow) -> Result<()> {
    let mut b = Vec::with_capacity(20);
    for v in [w.snd_wl1, w.snd_wnd, w.max_window, w.rcv_wnd, w.rcv_wup] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    setsockopt_bytes(fd, libc::IPPROTO_TCP, TCP_REPAIR_WINDOW, &b)
        .map_err(|e| rename(e, "setsockopt(TCP_REPAIR_WINDOW)"))
}

/// `TCP_REPAIR_OPTIONS`: (option kind, value) pairs.
pub fn set_repair_options(fd: &OwnedFd, opts: &[(u32, u32)]) -> Result<()> {
    let mut b = Vec::with_capacity(opts.len() * 8);
    for (code, val) in opts {
        b.extend_from_slice(&code.to_ne_bytes());
        b.extend_from_slice(&val.to_ne_bytes());
    }
    setsockopt_bytes(fd, libc::IPPROTO_TCP, TCP_REPAIR_OPTIONS, &b)
        .map_err(|e| rename(e, "setsockopt(TCP_REPAIR_OPTIONS)"))
}

/// The connection's current TCP timestamp clock (with its offset).
pub fn timestamp(fd: &OwnedFd) -> Result<u32> {
    get_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_TIMESTAMP,
        "getsockopt(TCP_TIMESTAMP)",
    )
    .map(|v| v as u32)
}

/// Make the connection's timestamp clock read `ts` now (repair mode).
pub fn set_timestamp(fd: &OwnedFd, ts: u32) -> Result<()> {
    set_int(
        fd,
        libc::IPPROTO_TCP,
        TCP_TIMESTAMP,
        ts as i32,
        "setsockopt(TCP_TIMESTAMP)",
    )
}

/// Read up to `max` bytes from the front of a socket queue without
/// consuming them (in repair mode: the selected queue).
pub fn peek(fd: &OwnedFd, max: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; max];
    if max == 0 {
        return Ok(buf);
    }
    // SAFETY: the kernel writes at most `max` bytes into `buf`.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            max,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 && Errno::last().0 == libc::EAGAIN {
        buf.clear();
        return Ok(buf);
    }
    let n = cvt(n as i64, || format!("recv(MSG_PEEK) of {max} bytes"))?;
    buf.truncate(n as usize);
    Ok(buf)
}

/// Wait until the socket is writable or `timeout_ms` passed.
pub fn wait_writable(fd: &OwnedFd, timeout_ms: i32) -> Result<bool> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    cvt(r as i64, || "poll".into()).map(|r| r > 0)
}

/// Enter the network namespace of the file `path` (/proc/PID/ns/net,
/// /run/netns/NAME) for the calling thread; threads and processes it
/// creates later start there.
pub fn enter_netns(path: &str) -> Result<()> {
    let f = std::fs::File::open(path).map_err(crate::error::io_err(path))?;
    // SAFETY: plain syscall on an fd we own.
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    cvt(r as i64, || format!("entering network namespace {path}")).map(drop)
}

/// The same IP address written as IPv4 when it is an IPv4-mapped IPv6 one.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}
