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

use crate::error::{Errno, NixResult, Result, SysError};
use crate::fdio::{getsockopt_raw, ioctl_get_int, setsockopt_raw};
use nix::errno::Errno as NixErrno;
use nix::sys::socket::{self as sock, MsgFlags, SockaddrStorage};
use std::net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6};
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

/// The values `TCP_MAXSEG` takes (TCP_MIN_MSS, MAX_TCP_WINDOW of the kernel).
pub const TCP_MAXSEG_MIN: u32 = 88;
pub const TCP_MAXSEG_MAX: u32 = 32767;

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
pub const TCP_FIN_WAIT1: u8 = 4;
pub const TCP_FIN_WAIT2: u8 = 5;
pub const TCP_TIME_WAIT: u8 = 6;
pub const TCP_CLOSE: u8 = 7;
pub const TCP_CLOSE_WAIT: u8 = 8;
pub const TCP_LAST_ACK: u8 = 9;
pub const TCP_LISTEN: u8 = 10;
pub const TCP_CLOSING: u8 = 11;

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
    crate::fdio::socket(family, ty, protocol)
}

/// The groups allowed to make ping sockets (ICMP datagram sockets) in the
/// caller's network namespace: net.ipv4.ping_group_range, low and high
/// (low above high: none).
pub fn ping_group_range() -> Result<(u32, u32)> {
    let path = "/proc/sys/net/ipv4/ping_group_range";
    let text = std::fs::read_to_string(path).map_err(|source| SysError::Io {
        path: path.into(),
        source,
    })?;
    let mut it = text.split_whitespace().map(str::parse::<u32>);
    match (it.next(), it.next()) {
        (Some(Ok(lo)), Some(Ok(hi))) => Ok((lo, hi)),
        _ => Err(SysError::Syscall {
            what: format!("{path} reads {:?}", text.trim()),
            source: Errno(libc::EINVAL),
        }),
    }
}

/// [`socket`] made with effective group `gid`: the kernel lets only the
/// groups of net.ipv4.ping_group_range make ping sockets, whatever the
/// caller's capabilities. Made on a thread of its own that alone changes
/// its group (the raw system call: glibc's setresgid changes every
/// thread's) and then ends; it shares the caller's network namespace.
pub fn socket_as_group(family: i32, ty: i32, protocol: i32, gid: u32) -> Result<OwnedFd> {
    std::thread::scope(|s| {
        s.spawn(|| {
            // -1: unchanged.
            let keep = u32::MAX as libc::c_long;
            // SAFETY: setresgid takes no pointers; it changes this thread's
            // credentials only, and the thread ends right after.
            let r = unsafe { libc::syscall(libc::SYS_setresgid, keep, gid as libc::c_long, keep) };
            if r != 0 {
                return Err(SysError::Syscall {
                    what: format!("setresgid(-1, {gid}, -1) to make a ping socket"),
                    source: Errno::last(),
                });
            }
            socket(family, ty, protocol)
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

fn from_storage(ss: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(sin) = ss.as_sockaddr_in() {
        return Some(SocketAddr::V4(SocketAddrV4::from(*sin)));
    }
    ss.as_sockaddr_in6()
        .map(|sin6| SocketAddr::V6(SocketAddrV6::from(*sin6)))
}

fn name_of(fd: &OwnedFd, peer: bool) -> Result<Option<SocketAddr>> {
    if peer {
        return peer_name(fd);
    }
    match sock::getsockname::<SockaddrStorage>(fd.as_raw_fd()) {
        Err(NixErrno::ENOTCONN) => Ok(None),
        r => r
            .map(|ss| from_storage(&ss))
            .or_sys(|| "getsockname".into()),
    }
}

/// The peer's address by SO_PEERNAME rather than getpeername(2): the
/// kernel answers getpeername with ENOTCONN for a TCP socket in CLOSE or
/// SYN-SENT, though it still has the peer (a connection that ended, one
/// being made); SO_PEERNAME tells it whenever the socket has one.
fn peer_name(fd: &OwnedFd) -> Result<Option<SocketAddr>> {
    // The kernel answers EINVAL to a buffer longer than the address: the
    // length of the socket's own family.
    let v6 = matches!(local_addr(fd), Ok(Some(SocketAddr::V6(_))));
    let mut buf = [0u8; std::mem::size_of::<libc::sockaddr_in6>()];
    let size = if v6 {
        buf.len()
    } else {
        std::mem::size_of::<libc::sockaddr_in>()
    };
    match crate::fdio::getsockopt_raw(fd, libc::SOL_SOCKET, libc::SO_PEERNAME, &mut buf[..size]) {
        Err(Errno(libc::ENOTCONN)) => Ok(None),
        Ok(len) => Ok(sockaddr_from_bytes(&buf[..len.min(size)])),
        // Anything else (a socket that answers SO_PEERNAME otherwise):
        // getpeername tells what there is.
        Err(_) => match sock::getpeername::<SockaddrStorage>(fd.as_raw_fd()) {
            Err(NixErrno::ENOTCONN) => Ok(None),
            r => r
                .map(|ss| from_storage(&ss))
                .or_sys(|| "getpeername".into()),
        },
    }
}

/// An IPv4 or IPv6 `struct sockaddr` as the kernel wrote it.
fn sockaddr_from_bytes(b: &[u8]) -> Option<SocketAddr> {
    let family = i32::from(u16::from_ne_bytes(b.get(0..2)?.try_into().ok()?));
    let port = u16::from_be_bytes(b.get(2..4)?.try_into().ok()?);
    match family {
        libc::AF_INET => {
            let ip: [u8; 4] = b.get(4..8)?.try_into().ok()?;
            Some(SocketAddr::V4(SocketAddrV4::new(ip.into(), port)))
        }
        libc::AF_INET6 => {
            let flow = u32::from_be_bytes(b.get(4..8)?.try_into().ok()?);
            let ip: [u8; 16] = b.get(8..24)?.try_into().ok()?;
            let scope = u32::from_ne_bytes(b.get(24..28)?.try_into().ok()?);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip.into(),
                port,
                flow,
                scope,
            )))
        }
        _ => None,
    }
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
    sock::bind(fd.as_raw_fd(), &SockaddrStorage::from(*addr)).or_sys(|| format!("bind to {addr}"))
}

pub fn connect(fd: &OwnedFd, addr: &SocketAddr) -> Result<()> {
    sock::connect(fd.as_raw_fd(), &SockaddrStorage::from(*addr))
        .or_sys(|| format!("connect to {addr}"))
}

/// getsockopt into a buffer of up to `max` bytes; returns what the kernel wrote.
pub fn getsockopt_bytes(fd: &OwnedFd, level: i32, opt: i32, max: usize) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; max];
    let len = getsockopt_raw(fd, level, opt, &mut buf).map_err(|source| SysError::Syscall {
        what: format!("getsockopt({level}, {opt})"),
        source,
    })?;
    buf.truncate(len);
    Ok(buf)
}

pub fn setsockopt_bytes(fd: &OwnedFd, level: i32, opt: i32, val: &[u8]) -> Result<()> {
    setsockopt_raw(fd, level, opt, val).map_err(|source| SysError::Syscall {
        what: format!("setsockopt({level}, {opt})"),
        source,
    })
}

/// SO_ATTACH_FILTER, also SO_GET_FILTER (asm-generic/socket.h; the libc
/// crate lacks them on Linux/glibc).
pub const SO_ATTACH_FILTER: i32 = 26;
/// SO_LOCK_FILTER: the filter can no longer be changed.
pub const SO_LOCK_FILTER: i32 = 44;
/// SO_BUF_LOCK (Linux 5.14): which of the buffer sizes are locked against
/// autotuning.
pub const SO_BUF_LOCK: i32 = 72;

/// BPF_MAXINSNS: the longest classic BPF program a socket takes.
const BPF_MAXINSNS: usize = 4096;
/// sizeof(struct sock_filter).
const SOCK_FILTER_LEN: usize = 8;

/// The classic BPF program attached with SO_ATTACH_FILTER, as its raw
/// `struct sock_filter` array (empty: none, or an eBPF program, which the
/// kernel cannot give back: the caller tells them apart).
pub fn socket_filter(fd: &OwnedFd) -> Result<Vec<u8>> {
    // Surprising ABI: SO_GET_FILTER takes and returns its length in filter
    // blocks (8 bytes each), not in bytes; the buffer must hold the blocks.
    let mut buf = vec![0u8; BPF_MAXINSNS * SOCK_FILTER_LEN];
    let mut blocks = BPF_MAXINSNS as libc::socklen_t;
    // SAFETY: the kernel writes at most `blocks` 8-byte blocks into `buf`,
    // which holds BPF_MAXINSNS of them.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ATTACH_FILTER,
            buf.as_mut_ptr().cast(),
            &mut blocks,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: "getsockopt(SO_GET_FILTER)".into(),
            source: Errno::last(),
        });
    }
    buf.truncate((blocks as usize).min(BPF_MAXINSNS) * SOCK_FILTER_LEN);
    Ok(buf)
}

/// Attach the classic BPF program `program` (raw `struct sock_filter`
/// blocks) with SO_ATTACH_FILTER.
pub fn attach_socket_filter(fd: &OwnedFd, program: &[u8]) -> Result<()> {
    let blocks = program.len() / SOCK_FILTER_LEN;
    if blocks == 0 || blocks > BPF_MAXINSNS || !program.len().is_multiple_of(SOCK_FILTER_LEN) {
        return Err(SysError::Syscall {
            what: format!("a socket filter of {} bytes", program.len()),
            source: Errno(libc::EINVAL),
        });
    }
    let prog = libc::sock_fprog {
        len: blocks as u16,
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: sock_fprog points at `blocks` blocks of `program`, which
    // outlives the call; the kernel copies them.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ATTACH_FILTER,
            (&prog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: "setsockopt(SO_ATTACH_FILTER)".into(),
            source: Errno::last(),
        });
    }
    Ok(())
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
    ioctl_get_int(fd, req, || format!("ioctl({req:#x})"))
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
    // The kernel reads an int: REPAIR_OFF_NO_WP (-1) goes as its bits.
    sock::setsockopt(fd, sock::sockopt::TcpRepair, &(mode as u32))
        .or_sys(|| format!("setsockopt(TCP_REPAIR, {mode})"))
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
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
    let n = match sock::recv(fd.as_raw_fd(), &mut buf, flags) {
        Err(NixErrno::EAGAIN) => 0,
        r => r.or_sys(|| format!("recv(MSG_PEEK) of {max} bytes"))?,
    };
    buf.truncate(n);
    Ok(buf)
}

/// Every datagram waiting in a UDP socket's receive queue, oldest first,
/// with its sender; nothing is consumed.
///
/// A plain MSG_PEEK only ever shows the first datagram. With a peek offset
/// (SO_PEEK_OFF, Linux 4.12 for UDP) each peek moves the offset past what
/// it copied, so the next one shows the next datagram. The socket's own
/// peek offset (-1: off) is put back afterwards. The caller holds the
/// program still (a reader would race with us). An empty datagram that
/// was peeked at before is skipped by every later peek at an offset (the
/// kernel marks it peeked and steps over it): such a one is not seen.
pub fn peek_datagrams(fd: &OwnedFd) -> Result<Vec<(SocketAddr, Vec<u8>)>> {
    let old = get_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, "SO_PEEK_OFF")?;
    set_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, 0, "SO_PEEK_OFF")?;
    let got = peek_all(fd);
    let back = set_int(fd, libc::SOL_SOCKET, libc::SO_PEEK_OFF, old, "SO_PEEK_OFF");
    let got = got?;
    back?;
    Ok(got)
}

/// Larger than any UDP payload (a GRO socket's coalesced one included).
const DATAGRAM_MAX: usize = 65536;

fn peek_all(fd: &OwnedFd) -> Result<Vec<(SocketAddr, Vec<u8>)>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; DATAGRAM_MAX + 1];
    loop {
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC;
        let mut iov = [std::io::IoSliceMut::new(&mut buf)];
        let r = sock::recvmsg::<SockaddrStorage>(fd.as_raw_fd(), &mut iov, None, flags);
        let (n, from) = match r {
            Err(NixErrno::EAGAIN) => return Ok(out),
            Err(e) => return Err(e).or_sys(|| "recvmsg(MSG_PEEK) of a datagram".into()),
            Ok(m) => (m.bytes, m.address.as_ref().and_then(from_storage)),
        };
        if n > DATAGRAM_MAX {
            return Err(SysError::Syscall {
                what: format!("a queued datagram of {n} bytes"),
                source: Errno(libc::EMSGSIZE),
            });
        }
        let Some(from) = from else {
            return Err(SysError::Syscall {
                what: "a queued datagram without its sender's address".into(),
                source: Errno(libc::EAFNOSUPPORT),
            });
        };
        out.push((from, buf[..n].to_vec()));
    }
}

/// Wait until the socket is writable or `timeout_ms` passed.
pub fn wait_writable(fd: &OwnedFd, timeout_ms: i32) -> Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let mut p = [PollFd::new(
        std::os::fd::AsFd::as_fd(fd),
        PollFlags::POLLOUT,
    )];
    PollTimeout::try_from(timeout_ms)
        .map_err(|_| NixErrno::EINVAL)
        .and_then(|t| poll(&mut p, t))
        .map(|r| r > 0)
        .or_sys(|| "poll".into())
}

/// Whether the receive side of `fd` is shut (poll reports POLLRDHUP): the
/// only way to learn it for a TCP socket in state CLOSE, which sock_diag
/// does not list. A connection that ended (both FINs, or a reset) leaves
/// its socket so: reads then return 0, not ENOTCONN.
pub fn read_shut(fd: &OwnedFd) -> Result<bool> {
    // Plain poll(2): nix knows no POLLRDHUP, and drops revents holding it.
    let mut p = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(fd),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one pollfd of ours, of an fd we hold, no timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    if r < 0 {
        return Err(SysError::Syscall {
            what: "poll".into(),
            source: NixErrno::last().into(),
        });
    }
    Ok(p.revents & libc::POLLRDHUP != 0)
}

/// Enter the network namespace of the file `path` (/proc/PID/ns/net,
/// /run/netns/NAME) for the calling thread; threads and processes it
/// creates later start there.
pub fn enter_netns(path: &str) -> Result<()> {
    let f = std::fs::File::open(path).map_err(crate::error::io_err(path))?;
    nix::sched::setns(&f, nix::sched::CloneFlags::CLONE_NEWNET)
        .or_sys(|| format!("entering network namespace {path}"))
}

/// The same IP address written as IPv4 when it is an IPv4-mapped IPv6 one.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The peer of a connected raw or ping socket of process `pid` (inode
/// `inode`), which getpeername hides: such a socket has no peer port, and
/// the kernel answers ENOTCONN whenever the peer's port is 0. Its line in
/// /proc/PID/net/`table` (raw, raw6, icmp, icmp6: the process's network
/// namespace) has the address. None when it is not connected.
pub fn datagram_peer(pid: i32, table: &str, inode: u64) -> Result<Option<SocketAddr>> {
    let path = format!("/proc/{pid}/net/{table}");
    let text = std::fs::read_to_string(&path).map_err(crate::error::io_err(&path))?;
    Ok(peer_in_table(&text, inode))
}

/// The remote address of socket `inode` in the text of a /proc/net table
/// of datagram sockets (`sl local rem st ... uid timeout inode ...`), when
/// its state is established (connected). Each 32-bit word of an address is
/// printed as the host reads the bytes of the network-order address.
fn peer_in_table(text: &str, inode: u64) -> Option<SocketAddr> {
    let inode = inode.to_string();
    let cols: Vec<&str> = text
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|c| c.get(9) == Some(&inode.as_str()))?;
    if u8::from_str_radix(cols.get(3)?, 16).ok()? != TCP_ESTABLISHED {
        return None;
    }
    let (addr, port) = cols.get(2)?.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::with_capacity(16);
    for i in (0..addr.len()).step_by(8) {
        let word = u32::from_str_radix(addr.get(i..i + 8)?, 16).ok()?;
        bytes.extend_from_slice(&word.to_ne_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod peer_tests {
    use super::peer_in_table;

    #[test]
    fn connected_datagram_sockets_are_found_by_inode() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n  \
            57: 0100007F:0001 0200007F:0000 01 00000000:00000000 00:00000000 00000000     0        0 13288854 2 000000001172c638 0\n  \
            58: 00000000:0001 00000000:0000 07 00000000:00000000 00:00000000 00000000     0        0 13288855 2 000000001172c638 0\n";
        assert_eq!(
            peer_in_table(v4, 13288854),
            Some("127.0.0.2:0".parse().unwrap())
        );
        assert_eq!(peer_in_table(v4, 13288855), None, "not connected");
        assert_eq!(peer_in_table(v4, 1), None, "not there");
        let v6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode ref pointer drops\n   \
            91: 00000000000000000000000001000000:003A 00000000000000000000000001000000:0000 01 00000000:00000000 00:00000000 00000000     0        0 13288853 2 000000002f516664 0\n";
        assert_eq!(
            peer_in_table(v6, 13288853),
            Some("[::1]:0".parse().unwrap())
        );
    }
}
