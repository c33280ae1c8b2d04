//! wl_tcp WORKDIR ROLE [--netns NAME] ADDR PORT [--conns N] [--extra-accept]
//! wl_tcp WORKDIR exec NETNS PROG [ARGS...]
//!
//! TCP and UDP connections that check every byte they carry, for checkpoints
//! of sockets. ROLE:
//!
//! * `server`: listens on ADDR:PORT (an IPv4 or IPv6 literal; prints
//!   `LISTENING`), accepts N connections (default 1; 0 is allowed) and
//!   exchanges on each. With `--extra-accept` it keeps accepting after that:
//!   each extra connection must send `ping\n`, gets `pong\n` and is closed
//!   (prints `pong N to ADDR`).
//! * `client`: makes N connections to ADDR:PORT (retrying while refused) and
//!   exchanges on each.
//! * `udp-server` / `udp-client`: N connected UDP pairs, pair i on port
//!   PORT+i: the client sends `hello` datagrams until the server, which
//!   connects its socket to the first hello's source, answers.
//!
//! `--netns NAME` first moves the whole (single-threaded) process into the
//! network namespace `/run/netns/NAME`.
//!
//! Exchange: both sides of every connection send 64-byte messages numbered
//! 1, 2, 3, ... (the number, a tag naming the connection and direction, and
//! 48 bytes derived from both) and read the peer's, checking that each is
//! exactly the previous number + 1 with its tag and bytes intact. Sockets are
//! nonblocking and wait in poll(2). Writing is paced at 512 messages per
//! connection per 10 ms tick (or until the socket is full). On connections
//! 0, 2, 4... reading is paced slower (16 KiB per tick), so their send and
//! receive queues are full (window closed, data not yet sent); on
//! connections 1, 3, 5... everything is read at once, so the window stays
//! open and data is in flight (sent, not yet acknowledged) when a peer
//! stops answering: both are what a checkpoint must save. UDP is paced at
//! 20 datagrams per pair per tick and read at once.
//!
//! Prints `progress sent=S recv=R min_sent=A min_recv=B` (totals over
//! connections, and the smallest connection's counts) about every 100 ms and
//! `READY` once every connection has carried messages both ways.
//! When WORKDIR/go appears: checks the socket options it set (TCP_NODELAY,
//! SO_KEEPALIVE, TCP_KEEPIDLE/KEEPINTVL/KEEPCNT, SO_SNDBUF/SO_RCVBUF,
//! SO_REUSEADDR of the listener), the ports, cwd/umask/pid; prints
//! `conn I local=A peer=B sent=S recv=R` for each connection. TCP: then stops
//! sending, sends an end marker holding its count and shuts its side down,
//! and reads the peer's messages until the peer's end marker and EOF, which
//! must come with the peer's count equal to what was received (so nothing
//! was lost at the tail either). UDP: stops sending and goes on reading for
//! 300 ms. Prints `final sent=S recv=R` (UDP: `... lost=L refused=F`) and
//! `OK`, exit 0.
//!
//! Anything wrong (a gap, duplicate, reordered or corrupted message, EOF or
//! reset before the peer's end marker, any socket error, a changed option)
//! prints `FAIL: what, which connection, expected vs got` and exits 1.
//!
//! UDP may lose datagrams: a gap in the numbers is counted (`lost`) but not
//! a failure, since datagrams in flight or queued while a side is
//! checkpointed and killed may be dropped (the network lock only holds TCP).
//! For the same reason ECONNREFUSED (an ICMP port-unreachable for a datagram
//! that reached the port of a killed peer) is counted (`refused`), not a
//! failure. A duplicate, a reorder or a corrupted datagram is a failure.
//!
//! `exec` mode: moves into network namespace NETNS, chdirs into WORKDIR and
//! execs PROG (keeps the pid: a real program run in a namespace).

use cr_tests::wl::msg::{bad_word, encode, field, tag, MSG};
use cr_tests::wl::{self, errno_str};
use std::ffi::CString;
use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

/// Length of one tick of the pacing.
const TICK_MS: u64 = 10;
/// Bytes read per tick on a paced (even-numbered) TCP connection.
const READ_BUDGET: usize = 256 * MSG;
/// Bytes read per tick on a fast (odd-numbered) TCP connection: more than
/// the peer may write, so its window stays open.
const READ_BUDGET_FAST: usize = 4 * WRITE_BUDGET as usize * MSG;
/// Messages written per TCP connection per tick (at most).
const WRITE_BUDGET: u64 = 512;
/// Datagrams sent per UDP pair per tick.
const UDP_BUDGET: u64 = 20;
/// Messages each way on every TCP connection before READY (enough to fill
/// the queues: READY means there is data in them to save).
const READY_MSGS: u64 = 3000;
/// Datagrams each way on every UDP pair before READY.
const UDP_READY_MSGS: u64 = 200;
/// Number field of the end marker; its tag field holds the sender's count.
const END: u64 = u64::MAX;
/// Number field of a UDP hello.
const HELLO: u64 = 0;
/// How long the drain after go may take.
const DRAIN_MS: u64 = 50_000;
/// How long a UDP side goes on reading after go.
const UDP_LINGER_MS: u64 = 300;
/// How long an extra connection may take to send its ping.
const EXTRA_MS: u64 = 5_000;

// Socket option values the engine must keep (unusual on purpose).
const SNDBUF: i32 = 150_000;
const RCVBUF: i32 = 200_000;
const KEEPIDLE: i32 = 4321;
const KEEPINTVL: i32 = 77;
const KEEPCNT: i32 = 7;

/// Direction of a message (part of its tag).
const DIR_S2C: u64 = 1;
const DIR_C2S: u64 = 2;

struct Opts {
    role: String,
    netns: Option<String>,
    addr: IpAddr,
    port: u16,
    conns: usize,
    extra_accept: bool,
}

fn usage() -> &'static str {
    "wl_tcp WORKDIR server|client|udp-server|udp-client [--netns NAME] ADDR PORT \
     [--conns N] [--extra-accept] | wl_tcp WORKDIR exec NETNS PROG [ARGS...]"
}

fn parse(rest: &[String]) -> Opts {
    let mut it = rest.iter();
    let role = it.next().cloned().unwrap_or_else(|| wl::fail(usage()));
    let mut netns = None;
    let mut conns = 1usize;
    let mut extra_accept = false;
    let mut pos = Vec::new();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--netns" => netns = Some(it.next().cloned().unwrap_or_else(|| wl::fail(usage()))),
            "--conns" => {
                conns = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| wl::fail(usage()))
            }
            "--extra-accept" => extra_accept = true,
            _ => pos.push(a.clone()),
        }
    }
    if pos.len() != 2 {
        wl::fail(usage());
    }
    let addr: IpAddr = pos[0]
        .parse()
        .unwrap_or_else(|_| wl::fail(&format!("bad address {:?}", pos[0])));
    let port: u16 = pos[1]
        .parse()
        .unwrap_or_else(|_| wl::fail(&format!("bad port {:?}", pos[1])));
    if conns == 0 && role != "server" {
        wl::fail("--conns 0 only for a server");
    }
    Opts {
        role,
        netns,
        addr,
        port,
        conns,
        extra_accept,
    }
}

/// Moves the process (single-threaded) into network namespace `name`.
fn enter_netns(name: &str) {
    let path = format!("/run/netns/{name}");
    let f = std::fs::File::open(&path).unwrap_or_else(|e| wl::fail(&format!("open {path}: {e}")));
    // SAFETY: setns on an fd we own; the fd is closed right after.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        wl::fail(&format!("setns {path}: {}", errno_str()));
    }
}

// ---------------------------------------------------------------------------
// Raw socket helpers
// ---------------------------------------------------------------------------

fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in6 and suitably aligned.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

fn family(a: &SocketAddr) -> i32 {
    if a.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    }
}

/// A new CLOEXEC socket, or FAIL.
fn socket(fam: i32, ty: i32) -> RawFd {
    // SAFETY: socket has no pointer arguments.
    let fd = unsafe { libc::socket(fam, ty | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        wl::fail(&format!("socket: {}", errno_str()));
    }
    fd
}

fn setopt(fd: RawFd, level: i32, name: i32, v: i32, what: &str) {
    // SAFETY: v is a valid int of the size given.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        wl::fail(&format!("setsockopt {what}={v}: {}", errno_str()));
    }
}

fn getopt(fd: RawFd, level: i32, name: i32) -> Result<i32, String> {
    let mut v: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: the kernel writes at most len bytes into v.
    let r = unsafe { libc::getsockopt(fd, level, name, (&mut v as *mut i32).cast(), &mut len) };
    if r != 0 {
        return Err(errno_str());
    }
    Ok(v)
}

fn bind(fd: RawFd, a: SocketAddr) -> Result<(), String> {
    let (ss, len) = sockaddr(a);
    // SAFETY: ss holds a valid sockaddr of length len.
    let r = unsafe { libc::bind(fd, (&ss as *const libc::sockaddr_storage).cast(), len) };
    if r != 0 {
        return Err(format!("bind {a}: {}", errno_str()));
    }
    Ok(())
}

fn connect(fd: RawFd, a: SocketAddr) -> Result<(), std::io::Error> {
    let (ss, len) = sockaddr(a);
    loop {
        // SAFETY: ss holds a valid sockaddr of length len.
        let r = unsafe { libc::connect(fd, (&ss as *const libc::sockaddr_storage).cast(), len) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// An option to set and to find unchanged at go.
struct Want {
    name: &'static str,
    level: i32,
    opt: i32,
    value: i32,
}

fn tcp_wants() -> Vec<Want> {
    vec![
        Want {
            name: "SO_SNDBUF",
            level: libc::SOL_SOCKET,
            opt: libc::SO_SNDBUF,
            value: SNDBUF,
        },
        Want {
            name: "SO_RCVBUF",
            level: libc::SOL_SOCKET,
            opt: libc::SO_RCVBUF,
            value: RCVBUF,
        },
        Want {
            name: "TCP_NODELAY",
            level: libc::IPPROTO_TCP,
            opt: libc::TCP_NODELAY,
            value: 1,
        },
        Want {
            name: "SO_KEEPALIVE",
            level: libc::SOL_SOCKET,
            opt: libc::SO_KEEPALIVE,
            value: 1,
        },
        Want {
            name: "TCP_KEEPIDLE",
            level: libc::IPPROTO_TCP,
            opt: libc::TCP_KEEPIDLE,
            value: KEEPIDLE,
        },
        Want {
            name: "TCP_KEEPINTVL",
            level: libc::IPPROTO_TCP,
            opt: libc::TCP_KEEPINTVL,
            value: KEEPINTVL,
        },
        Want {
            name: "TCP_KEEPCNT",
            level: libc::IPPROTO_TCP,
            opt: libc::TCP_KEEPCNT,
            value: KEEPCNT,
        },
    ]
}

fn buf_wants() -> Vec<Want> {
    tcp_wants().into_iter().take(2).collect()
}

/// Sets the options and returns what getsockopt reads back (the kernel
/// doubles buffer sizes), to be compared at go.
fn apply(fd: RawFd, wants: &[Want], what: &str) -> Vec<(&'static str, i32, i32, i32)> {
    let mut got = Vec::new();
    for w in wants {
        setopt(fd, w.level, w.opt, w.value, w.name);
        let v = getopt(fd, w.level, w.opt)
            .unwrap_or_else(|e| wl::fail(&format!("{what}: getsockopt {}: {e}", w.name)));
        let expect = if w.opt == libc::SO_SNDBUF || w.opt == libc::SO_RCVBUF {
            2 * w.value
        } else {
            w.value
        };
        if v != expect {
            wl::fail(&format!(
                "{what}: {} reads {v} after setting {}, expected {expect}",
                w.name, w.value
            ));
        }
        got.push((w.name, w.level, w.opt, v));
    }
    got
}

fn check_opts(fd: RawFd, opts: &[(&'static str, i32, i32, i32)], what: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, level, opt, v) in opts {
        match getopt(fd, *level, *opt) {
            Ok(now) if now == *v => {}
            Ok(now) => problems.push(format!("{what}: {name} is {now}, was {v}")),
            Err(e) => problems.push(format!("{what}: getsockopt {name}: {e}")),
        }
    }
    problems
}

fn ports(fd: RawFd) -> (Option<SocketAddr>, Option<SocketAddr>) {
    // SAFETY: fd is an open socket owned by the caller for the call's length;
    // ManuallyDrop keeps it from being closed.
    let s = std::mem::ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
    (s.local_addr().ok(), s.peer_addr().ok())
}

fn udp_addrs(fd: RawFd) -> (Option<SocketAddr>, Option<SocketAddr>) {
    // SAFETY: as in `ports`.
    let s = std::mem::ManuallyDrop::new(unsafe { UdpSocket::from_raw_fd(fd) });
    (s.local_addr().ok(), s.peer_addr().ok())
}

fn show(a: Option<SocketAddr>) -> String {
    a.map_or_else(|| "?".into(), |a| a.to_string())
}

// ---------------------------------------------------------------------------
// TCP
// ---------------------------------------------------------------------------

struct Conn {
    idx: usize,
    s: TcpStream,
    tx_tag: u64,
    rx_tag: u64,
    sent: u64,
    recv: u64,
    out: [u8; MSG],
    /// Bytes of `out` written; MSG when nothing is pending.
    out_off: usize,
    inbuf: Vec<u8>,
    read_left: usize,
    write_left: u64,
    /// Our end marker was queued (after go).
    end_queued: bool,
    /// Our end marker was written and our side shut down.
    shut: bool,
    /// The peer's end marker: its count.
    peer_end: Option<u64>,
    eof: bool,
    opts: Vec<(&'static str, i32, i32, i32)>,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
}

impl Conn {
    fn new(idx: usize, s: TcpStream, server: bool) -> Conn {
        let what = format!("connection {idx}");
        let fd = s.as_raw_fd();
        let opts = apply(fd, &tcp_wants(), &what);
        if let Err(e) = s.set_nonblocking(true) {
            wl::fail(&format!("{what}: set_nonblocking: {e}"));
        }
        let (local, peer) = ports(fd);
        let (Some(l), Some(p)) = (local, peer) else {
            wl::fail(&format!("{what}: getsockname/getpeername failed"));
        };
        let cport = if server { p.port() } else { l.port() };
        let (tx, rx) = if server {
            (DIR_S2C, DIR_C2S)
        } else {
            (DIR_C2S, DIR_S2C)
        };
        Conn {
            idx,
            s,
            tx_tag: tag(cport, tx),
            rx_tag: tag(cport, rx),
            sent: 0,
            recv: 0,
            out: [0; MSG],
            out_off: MSG,
            inbuf: Vec::with_capacity(READ_BUDGET_FAST + MSG),
            read_left: Conn::read_budget(idx),
            write_left: WRITE_BUDGET,
            end_queued: false,
            shut: false,
            peer_end: None,
            eof: false,
            opts,
            local,
            peer,
        }
    }

    fn read_budget(idx: usize) -> usize {
        if idx & 1 == 0 {
            READ_BUDGET
        } else {
            READ_BUDGET_FAST
        }
    }

    fn name(&self) -> String {
        format!(
            "connection {} ({} -> {})",
            self.idx,
            show(self.local),
            show(self.peer)
        )
    }

    /// Reads what the budget allows (all when draining) and checks it.
    fn read(&mut self, draining: bool) {
        let mut buf = [0u8; 16384];
        while !self.eof && (draining || self.read_left > 0) {
            let want = if draining {
                buf.len()
            } else {
                self.read_left.min(buf.len())
            };
            match self.s.read(&mut buf[..want]) {
                Ok(0) => {
                    if self.peer_end.is_none() {
                        wl::fail(&format!(
                            "{}: EOF from the peer without its end marker, after {} messages \
                             (expected message {} next)",
                            self.name(),
                            self.recv,
                            self.recv + 1
                        ));
                    }
                    if !self.inbuf.is_empty() {
                        wl::fail(&format!(
                            "{}: EOF with {} bytes of a partial message",
                            self.name(),
                            self.inbuf.len()
                        ));
                    }
                    self.eof = true;
                }
                Ok(n) => {
                    self.read_left = self.read_left.saturating_sub(n);
                    self.inbuf.extend_from_slice(&buf[..n]);
                    self.take();
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => wl::fail(&format!(
                    "{}: read after {} messages received: {e} (errno {:?})",
                    self.name(),
                    self.recv,
                    e.raw_os_error()
                )),
            }
        }
    }

    /// Checks the complete messages of `inbuf`.
    fn take(&mut self) {
        let whole = self.inbuf.len() / MSG * MSG;
        for m in self.inbuf[..whole].chunks_exact(MSG) {
            let (a, b) = (field(m, 0), field(m, 1));
            if let Some(n) = self.peer_end {
                wl::fail(&format!(
                    "{}: data (number {a}) after the peer's end marker (count {n})",
                    self.name()
                ));
            }
            if a == END {
                if let Some((i, want, got)) = bad_word(m, self.rx_tag) {
                    wl::fail(&format!(
                        "{}: end marker corrupted at word {i}: expected {want:#x}, got {got:#x}",
                        self.name()
                    ));
                }
                if b != self.recv {
                    wl::fail(&format!(
                        "{}: the peer's end marker says it sent {b} messages, {} were received",
                        self.name(),
                        self.recv
                    ));
                }
                self.peer_end = Some(b);
                continue;
            }
            let want = self.recv + 1;
            if a != want {
                let kind = if a < want {
                    "duplicate or reordered"
                } else {
                    "messages lost"
                };
                wl::fail(&format!(
                    "{}: expected message {want}, got {a} ({kind}; tag {b:#x})",
                    self.name()
                ));
            }
            if b != self.rx_tag {
                wl::fail(&format!(
                    "{}: message {a}: tag {b:#x}, expected {:#x} (wrong connection or corrupted)",
                    self.name(),
                    self.rx_tag
                ));
            }
            if let Some((i, w, g)) = bad_word(m, self.rx_tag) {
                wl::fail(&format!(
                    "{}: message {a} corrupted at word {i}: expected {w:#x}, got {g:#x}",
                    self.name()
                ));
            }
            self.recv += 1;
        }
        self.inbuf.drain(..whole);
    }

    /// Writes the pending message, then new ones while the budget allows
    /// (not when draining: then the end marker and the shutdown).
    fn write(&mut self, draining: bool) {
        loop {
            if self.out_off == MSG {
                if draining {
                    if self.end_queued {
                        if !self.shut {
                            if let Err(e) = self.s.shutdown(Shutdown::Write) {
                                wl::fail(&format!("{}: shutdown: {e}", self.name()));
                            }
                            self.shut = true;
                        }
                        return;
                    }
                    encode(&mut self.out, END, self.sent, self.tx_tag);
                    self.end_queued = true;
                } else {
                    if self.write_left == 0 {
                        return;
                    }
                    encode(&mut self.out, self.sent + 1, self.tx_tag, self.tx_tag);
                }
                self.out_off = 0;
            }
            match self.s.write(&self.out[self.out_off..]) {
                Ok(n) => {
                    self.out_off += n;
                    if self.out_off == MSG && !(draining && self.end_queued) {
                        self.sent += 1;
                        self.write_left = self.write_left.saturating_sub(1);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => wl::fail(&format!(
                    "{}: write after {} messages sent: {e} (errno {:?})",
                    self.name(),
                    self.sent,
                    e.raw_os_error()
                )),
            }
        }
    }

    fn wants_write(&self, draining: bool) -> bool {
        if draining {
            !self.shut
        } else {
            self.out_off < MSG || self.write_left > 0
        }
    }

    fn done(&self) -> bool {
        self.shut && self.eof
    }
}

/// An extra connection of `--extra-accept`: waits for `ping\n`.
struct Extra {
    s: TcpStream,
    from: SocketAddr,
    got: Vec<u8>,
    since: u64,
}

fn listen(o: &Opts) -> (TcpListener, Vec<(&'static str, i32, i32, i32)>) {
    let a = SocketAddr::new(o.addr, o.port);
    let fd = socket(family(&a), libc::SOCK_STREAM);
    setopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1, "SO_REUSEADDR");
    let mut opts = apply(fd, &buf_wants(), "listener");
    opts.push((
        "SO_REUSEADDR",
        libc::SOL_SOCKET,
        libc::SO_REUSEADDR,
        getopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR).unwrap_or(-1),
    ));
    if let Err(e) = bind(fd, a) {
        wl::fail(&e);
    }
    // SAFETY: listen has no pointer arguments.
    if unsafe { libc::listen(fd, 16) } != 0 {
        wl::fail(&format!("listen: {}", errno_str()));
    }
    // SAFETY: fd is a listening socket we own from here on.
    let l = unsafe { TcpListener::from_raw_fd(fd) };
    if let Err(e) = l.set_nonblocking(true) {
        wl::fail(&format!("listener set_nonblocking: {e}"));
    }
    (l, opts)
}

fn poll(fds: &mut [libc::pollfd], timeout_ms: u64) {
    // SAFETY: fds is a valid array of fds.len() pollfds.
    let r = unsafe {
        libc::poll(
            fds.as_mut_ptr(),
            fds.len() as libc::nfds_t,
            timeout_ms as i32,
        )
    };
    if r < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
        wl::fail(&format!("poll: {}", errno_str()));
    }
}

fn pfd(fd: RawFd, events: i16) -> libc::pollfd {
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn ms() -> u64 {
    wl::mono_ns() / 1_000_000
}

fn tcp_main(o: &Opts, state: &wl::ProcState, go: &wl::Go) -> ! {
    let server = o.role == "server";
    let mut listener = None;
    let mut conns: Vec<Conn> = Vec::new();
    if server {
        let (l, opts) = listen(o);
        wl::say(&format!("LISTENING {}", show(l.local_addr().ok())));
        while conns.len() < o.conns {
            match l.accept() {
                Ok((s, _)) => {
                    let i = conns.len();
                    conns.push(Conn::new(i, s, true));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if go.check() {
                        wl::fail(&format!("go before {} connections came", o.conns));
                    }
                    let mut p = [pfd(l.as_raw_fd(), libc::POLLIN)];
                    poll(&mut p, 100);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => wl::fail(&format!("accept: {e}")),
            }
        }
        listener = Some((l, opts));
    } else {
        let a = SocketAddr::new(o.addr, o.port);
        let start = ms();
        for i in 0..o.conns {
            loop {
                let fd = socket(family(&a), libc::SOCK_STREAM);
                // Buffer sizes before connect, so the window scale fits them.
                apply(fd, &buf_wants(), &format!("connection {i}"));
                // SAFETY: fd is a socket we own from here on.
                let s = unsafe { TcpStream::from_raw_fd(fd) };
                match connect(fd, a) {
                    Ok(()) => {
                        conns.push(Conn::new(i, s, false));
                        break;
                    }
                    Err(e)
                        if e.kind() == std::io::ErrorKind::ConnectionRefused
                            && ms() - start < 20_000 =>
                    {
                        drop(s);
                        wl::sleep_ms(50);
                    }
                    Err(e) => wl::fail(&format!("connection {i}: connect {a}: {e}")),
                }
            }
        }
    }
    wl::say(&format!("CONNECTED {}", conns.len()));

    let extra = o.extra_accept && server;
    let mut extras: Vec<Extra> = Vec::new();
    let mut pongs = 0u64;
    let mut ready = false;
    let mut draining = false;
    let mut drain_start = 0;
    let mut problems = Vec::new();
    let mut tick_end = ms() + TICK_MS;
    let mut next_progress = ms() + 100;
    loop {
        if !draining && go.check() {
            draining = true;
            drain_start = ms();
            for c in &conns {
                problems.extend(check_opts(c.s.as_raw_fd(), &c.opts, &c.name()));
                let (l, p) = ports(c.s.as_raw_fd());
                if l.map(|a| a.port()) != c.local.map(|a| a.port())
                    || p.map(|a| a.port()) != c.peer.map(|a| a.port())
                {
                    problems.push(format!(
                        "{}: ports changed: now {} -> {}",
                        c.name(),
                        show(l),
                        show(p)
                    ));
                }
                wl::say(&format!(
                    "conn {} local={} peer={} sent={} recv={}",
                    c.idx,
                    show(l),
                    show(p),
                    c.sent,
                    c.recv
                ));
            }
            if let Some((l, opts)) = &listener {
                problems.extend(check_opts(l.as_raw_fd(), opts, "listener"));
                match getopt(l.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ACCEPTCONN) {
                    Ok(1) => {}
                    other => problems.push(format!("listener: SO_ACCEPTCONN is {other:?}")),
                }
                wl::say(&format!("listener local={}", show(l.local_addr().ok())));
            }
            state.verify(&mut problems);
            if !problems.is_empty() {
                wl::finish(&problems);
            }
        }
        let now = ms();
        if now >= tick_end {
            tick_end = now + TICK_MS;
            for c in conns.iter_mut() {
                c.read_left = Conn::read_budget(c.idx);
                c.write_left = WRITE_BUDGET;
            }
        }
        for c in conns.iter_mut() {
            c.read(draining);
            c.write(draining);
            // What was read may have made room for more.
            c.read(draining);
        }
        if extra && !draining {
            if let Some((l, _)) = &listener {
                loop {
                    match l.accept() {
                        Ok((s, from)) => {
                            if let Err(e) = s.set_nonblocking(true) {
                                wl::fail(&format!("extra connection from {from}: {e}"));
                            }
                            extras.push(Extra {
                                s,
                                from,
                                got: Vec::new(),
                                since: ms(),
                            });
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => wl::fail(&format!("accept (extra): {e}")),
                    }
                }
            }
            let mut i = 0;
            while i < extras.len() {
                let x = &mut extras[i];
                let mut b = [0u8; 64];
                let mut done = false;
                match x.s.read(&mut b) {
                    Ok(0) => wl::fail(&format!(
                        "extra connection from {}: EOF after {:?} instead of ping",
                        x.from,
                        String::from_utf8_lossy(&x.got)
                    )),
                    Ok(n) => {
                        x.got.extend_from_slice(&b[..n]);
                        if x.got.len() >= 5 {
                            if x.got != b"ping\n" {
                                wl::fail(&format!(
                                    "extra connection from {}: got {:?} instead of ping",
                                    x.from,
                                    String::from_utf8_lossy(&x.got)
                                ));
                            }
                            if let Err(e) = x.s.write_all(b"pong\n") {
                                wl::fail(&format!("extra connection from {}: write: {e}", x.from));
                            }
                            pongs += 1;
                            wl::say(&format!("pong {pongs} to {}", x.from));
                            done = true;
                        }
                    }
                    Err(e)
                        if e.kind() == std::io::ErrorKind::WouldBlock
                            || e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => wl::fail(&format!("extra connection from {}: read: {e}", x.from)),
                }
                if !done && ms() - x.since > EXTRA_MS {
                    wl::fail(&format!(
                        "extra connection from {}: no ping within {EXTRA_MS} ms",
                        x.from
                    ));
                }
                if done {
                    extras.swap_remove(i);
                } else {
                    i += 1;
                }
            }
        }
        let counts: Vec<(u64, u64)> = conns.iter().map(|c| (c.sent, c.recv)).collect();
        let (sent, recv) = report(&counts, &mut next_progress, &mut ready, READY_MSGS);
        if draining {
            if conns.iter().all(Conn::done) {
                wl::say(&format!("final sent={sent} recv={recv}"));
                wl::ok();
            }
            if ms() - drain_start > DRAIN_MS {
                let waiting: Vec<String> = conns
                    .iter()
                    .filter(|c| !c.done())
                    .map(|c| {
                        format!(
                            "{} (shut {}, peer end {:?}, eof {}, recv {})",
                            c.name(),
                            c.shut,
                            c.peer_end,
                            c.eof,
                            c.recv
                        )
                    })
                    .collect();
                wl::fail(&format!(
                    "after go, no end from the peer within {DRAIN_MS} ms on {}",
                    waiting.join("; ")
                ));
            }
        }
        // Wait for something to do, or for the next tick.
        let mut fds = Vec::with_capacity(conns.len() + extras.len() + 1);
        for c in &conns {
            let mut ev = 0;
            if !c.eof && (draining || c.read_left > 0) {
                ev |= libc::POLLIN;
            }
            if c.wants_write(draining) {
                ev |= libc::POLLOUT;
            }
            fds.push(pfd(if c.done() { -1 } else { c.s.as_raw_fd() }, ev));
        }
        if extra && !draining {
            if let Some((l, _)) = &listener {
                fds.push(pfd(l.as_raw_fd(), libc::POLLIN));
            }
            for x in &extras {
                fds.push(pfd(x.s.as_raw_fd(), libc::POLLIN));
            }
        }
        let now = ms();
        let wait = tick_end
            .saturating_sub(now)
            .min(next_progress.saturating_sub(now));
        poll(&mut fds, wait.max(1));
    }
}

// ---------------------------------------------------------------------------
// UDP
// ---------------------------------------------------------------------------

struct Pair {
    idx: usize,
    s: UdpSocket,
    tx_tag: u64,
    rx_tag: u64,
    sent: u64,
    /// Datagrams received, and the last number seen.
    recv: u64,
    last: u64,
    lost: u64,
    refused: u64,
    opts: Vec<(&'static str, i32, i32, i32)>,
    local: Option<SocketAddr>,
    peer: Option<SocketAddr>,
}

impl Pair {
    fn name(&self) -> String {
        format!(
            "pair {} ({} -> {})",
            self.idx,
            show(self.local),
            show(self.peer)
        )
    }

    fn refused(&mut self, what: &str) {
        self.refused += 1;
        wl::note(&format!(
            "{}: {what}: ECONNREFUSED (the peer's port was closed)",
            self.name()
        ));
    }

    /// Reads every datagram queued, checks it. Returns whether one came.
    fn read(&mut self) -> bool {
        let mut any = false;
        let mut b = [0u8; 2 * MSG];
        loop {
            match self.s.recv(&mut b) {
                Ok(n) => {
                    any = true;
                    if n != MSG {
                        wl::fail(&format!(
                            "{}: datagram of {n} bytes, expected {MSG}",
                            self.name()
                        ));
                    }
                    let m = &b[..MSG];
                    let (a, t) = (field(m, 0), field(m, 1));
                    if a == HELLO {
                        if self.last != 0 {
                            wl::fail(&format!(
                                "{}: hello after message {} (reordered)",
                                self.name(),
                                self.last
                            ));
                        }
                        continue;
                    }
                    if a <= self.last {
                        wl::fail(&format!(
                            "{}: got number {a} after {} (duplicate or reordered)",
                            self.name(),
                            self.last
                        ));
                    }
                    if t != self.rx_tag {
                        wl::fail(&format!(
                            "{}: datagram {a}: tag {t:#x}, expected {:#x}",
                            self.name(),
                            self.rx_tag
                        ));
                    }
                    if let Some((i, w, g)) = bad_word(m, self.rx_tag) {
                        wl::fail(&format!(
                            "{}: datagram {a} corrupted at word {i}: expected {w:#x}, got {g:#x}",
                            self.name()
                        ));
                    }
                    if a > self.last + 1 {
                        wl::note(&format!(
                            "{}: datagrams {}..{} lost",
                            self.name(),
                            self.last + 1,
                            a - 1
                        ));
                        self.lost += a - self.last - 1;
                    }
                    self.last = a;
                    self.recv += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return any,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => self.refused("recv"),
                Err(e) => wl::fail(&format!("{}: recv: {e}", self.name())),
            }
        }
    }

    fn send(&mut self, budget: u64) {
        let mut m = [0u8; MSG];
        for _ in 0..budget {
            encode(&mut m, self.sent + 1, self.tx_tag, self.tx_tag);
            match self.s.send(&m) {
                Ok(n) if n == MSG => self.sent += 1,
                Ok(n) => wl::fail(&format!("{}: short send {n}", self.name())),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    self.refused("send");
                    return;
                }
                Err(e) => wl::fail(&format!("{}: send: {e}", self.name())),
            }
        }
    }
}

fn udp_socket(local: SocketAddr, what: &str) -> (UdpSocket, Vec<(&'static str, i32, i32, i32)>) {
    let fd = socket(family(&local), libc::SOCK_DGRAM);
    let opts = apply(fd, &buf_wants(), what);
    if let Err(e) = bind(fd, local) {
        wl::fail(&format!("{what}: {e}"));
    }
    // SAFETY: fd is a socket we own from here on.
    let s = unsafe { UdpSocket::from_raw_fd(fd) };
    if let Err(e) = s.set_nonblocking(true) {
        wl::fail(&format!("{what}: set_nonblocking: {e}"));
    }
    (s, opts)
}

fn udp_main(o: &Opts, state: &wl::ProcState, go: &wl::Go) -> ! {
    let server = o.role == "udp-server";
    let mut pairs = Vec::new();
    let start = ms();
    let any = SocketAddr::new(
        if o.addr.is_ipv4() {
            IpAddr::from([0u8; 4])
        } else {
            IpAddr::from([0u16; 8])
        },
        0,
    );
    let mut socks = Vec::new();
    for i in 0..o.conns {
        let what = format!("pair {i}");
        let port = o.port + i as u16;
        let local = if server {
            SocketAddr::new(o.addr, port)
        } else {
            any
        };
        let (s, opts) = udp_socket(local, &what);
        if !server {
            if let Err(e) = s.connect(SocketAddr::new(o.addr, port)) {
                wl::fail(&format!("{what}: connect: {e}"));
            }
        }
        socks.push((s, opts));
    }
    if server {
        wl::say("LISTENING");
    }
    // Handshake: the client says hello until the server's first datagram
    // comes; the server connects to the source of the first hello.
    let mut done = vec![false; socks.len()];
    let mut next_hello = 0;
    let mut b = [0u8; 2 * MSG];
    let mut m = [0u8; MSG];
    encode(&mut m, HELLO, 0, 0);
    while done.iter().any(|d| !d) {
        if go.check() {
            wl::fail("go before every pair was set up");
        }
        if ms() - start > 20_000 {
            wl::fail(&format!("pairs set up after 20 s: {done:?}"));
        }
        let hello = !server && ms() >= next_hello;
        if hello {
            next_hello = ms() + 100;
        }
        for (i, (s, _)) in socks.iter().enumerate() {
            if done[i] {
                continue;
            }
            let what = format!("pair {i}");
            if server {
                match s.recv_from(&mut b) {
                    Ok((n, from)) if n == MSG && field(&b, 0) == HELLO => {
                        if let Err(e) = s.connect(from) {
                            wl::fail(&format!("{what}: connect {from}: {e}"));
                        }
                        done[i] = true;
                    }
                    Ok((n, from)) => wl::fail(&format!(
                        "{what}: first datagram from {from} ({n} bytes) is not a hello"
                    )),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => wl::fail(&format!("{what}: recv_from: {e}")),
                }
                continue;
            }
            if hello {
                match s.send(&m) {
                    Ok(_) => {}
                    Err(e)
                        if e.kind() == std::io::ErrorKind::ConnectionRefused
                            || e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => wl::fail(&format!("{what}: send hello: {e}")),
                }
            }
            // The server's first datagram is left queued for the main loop.
            match s.peek(&mut b) {
                Ok(n) if n == MSG && field(&b, 0) != HELLO => done[i] = true,
                Ok(n) => wl::fail(&format!(
                    "{what}: the server's first datagram ({n} bytes) is not a message"
                )),
                Err(e)
                    if e.kind() == std::io::ErrorKind::WouldBlock
                        || e.kind() == std::io::ErrorKind::ConnectionRefused => {}
                Err(e) => wl::fail(&format!("{what}: recv: {e}")),
            }
        }
        let mut p: Vec<libc::pollfd> = socks
            .iter()
            .map(|(s, _)| pfd(s.as_raw_fd(), libc::POLLIN))
            .collect();
        poll(&mut p, 20);
    }
    for (i, (s, opts)) in socks.into_iter().enumerate() {
        let what = format!("pair {i}");
        let (local, peer) = udp_addrs(s.as_raw_fd());
        let (Some(l), Some(p)) = (local, peer) else {
            wl::fail(&format!("{what}: getsockname/getpeername failed"));
        };
        let cport = if server { p.port() } else { l.port() };
        let (tx, rx) = if server {
            (DIR_S2C, DIR_C2S)
        } else {
            (DIR_C2S, DIR_S2C)
        };
        pairs.push(Pair {
            idx: i,
            s,
            tx_tag: tag(cport, tx),
            rx_tag: tag(cport, rx),
            sent: 0,
            recv: 0,
            last: 0,
            lost: 0,
            refused: 0,
            opts,
            local,
            peer,
        });
    }
    wl::say(&format!("CONNECTED {}", pairs.len()));

    let mut ready = false;
    let mut tick_end = ms();
    let mut next_progress = ms() + 100;
    let mut linger_end: Option<u64> = None;
    loop {
        if linger_end.is_none() && go.check() {
            let mut problems = Vec::new();
            for p in &pairs {
                problems.extend(check_opts(p.s.as_raw_fd(), &p.opts, &p.name()));
                let (l, r) = udp_addrs(p.s.as_raw_fd());
                if l.map(|a| a.port()) != p.local.map(|a| a.port())
                    || r.map(|a| a.port()) != p.peer.map(|a| a.port())
                {
                    problems.push(format!(
                        "{}: ports changed: now {} -> {}",
                        p.name(),
                        show(l),
                        show(r)
                    ));
                }
                wl::say(&format!(
                    "conn {} local={} peer={} sent={} recv={} lost={} refused={}",
                    p.idx,
                    show(l),
                    show(r),
                    p.sent,
                    p.recv,
                    p.lost,
                    p.refused
                ));
            }
            state.verify(&mut problems);
            if !problems.is_empty() {
                wl::finish(&problems);
            }
            linger_end = Some(ms() + UDP_LINGER_MS);
        }
        let now = ms();
        let sending = now >= tick_end && linger_end.is_none();
        if sending {
            tick_end = now + TICK_MS;
        }
        for p in pairs.iter_mut() {
            p.read();
            if sending {
                p.send(UDP_BUDGET);
            }
        }
        let counts: Vec<(u64, u64)> = pairs.iter().map(|p| (p.sent, p.recv)).collect();
        let (sent, recv) = report(&counts, &mut next_progress, &mut ready, UDP_READY_MSGS);
        if let Some(end) = linger_end {
            if ms() >= end {
                let lost: u64 = pairs.iter().map(|p| p.lost).sum();
                let refused: u64 = pairs.iter().map(|p| p.refused).sum();
                wl::say(&format!(
                    "final sent={sent} recv={recv} lost={lost} refused={refused}"
                ));
                wl::ok();
            }
        }
        let mut fds: Vec<libc::pollfd> = pairs
            .iter()
            .map(|p| pfd(p.s.as_raw_fd(), libc::POLLIN))
            .collect();
        let now = ms();
        let until = linger_end.unwrap_or(tick_end).min(next_progress);
        poll(&mut fds, until.saturating_sub(now).max(1));
    }
}

// ---------------------------------------------------------------------------

fn exec_in(workdir: &std::path::Path, rest: &[String]) -> ! {
    if rest.len() < 3 {
        wl::fail(usage());
    }
    enter_netns(&rest[1]);
    if let Err(e) = std::env::set_current_dir(workdir) {
        wl::fail(&format!("chdir {}: {e}", workdir.display()));
    }
    let argv: Vec<CString> = rest[2..]
        .iter()
        .map(|a| CString::new(a.as_bytes()).unwrap_or_else(|_| wl::fail("NUL in argument")))
        .collect();
    let mut ptrs: Vec<*const libc::c_char> = argv.iter().map(|a| a.as_ptr()).collect();
    ptrs.push(std::ptr::null());
    // SAFETY: the Rust runtime ignores SIGPIPE; give the program the default
    // back. execvp gets a NULL-terminated array of valid C strings.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::execvp(ptrs[0], ptrs.as_ptr());
    }
    wl::fail(&format!("exec {}: {}", rest[2], errno_str()))
}

fn main() {
    let args = wl::args(usage());
    if args.rest.first().map(String::as_str) == Some("exec") {
        exec_in(&args.workdir, &args.rest);
    }
    let o = parse(&args.rest);
    if let Some(ns) = &o.netns {
        enter_netns(ns);
    }
    let state = wl::ProcState::setup(&args.workdir);
    let go = wl::Go::new(&args.workdir);
    match o.role.as_str() {
        "server" | "client" => tcp_main(&o, &state, &go),
        "udp-server" | "udp-client" => udp_main(&o, &state, &go),
        other => wl::fail(&format!("unknown role {other:?}; usage: {}", usage())),
    }
}

/// Totals of (sent, recv) over `counts`; prints the `progress` line every
/// 100 ms and `READY` once every connection exchanged `ready_msgs` both ways.
fn report(
    counts: &[(u64, u64)],
    next_progress: &mut u64,
    ready: &mut bool,
    ready_msgs: u64,
) -> (u64, u64) {
    let sent: u64 = counts.iter().map(|c| c.0).sum();
    let recv: u64 = counts.iter().map(|c| c.1).sum();
    if ms() >= *next_progress {
        *next_progress = ms() + 100;
        let min_sent = counts.iter().map(|c| c.0).min().unwrap_or(0);
        let min_recv = counts.iter().map(|c| c.1).min().unwrap_or(0);
        wl::say(&format!(
            "progress sent={sent} recv={recv} min_sent={min_sent} min_recv={min_recv}"
        ));
    }
    if !*ready
        && counts
            .iter()
            .all(|&(s, r)| s >= ready_msgs && r >= ready_msgs)
    {
        *ready = true;
        wl::say("READY");
    }
    (sent, recv)
}
