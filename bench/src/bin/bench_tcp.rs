//! Benchmark workload of `cr-bench tcp`: one TCP server (the checkpointed
//! process) and one client (its peers, never checkpointed), both on
//! 127.0.0.1 inside a network namespace.
//!
//! `bench_tcp [--netns PATH] server PORT N`
//!
//! Enters the network namespace PATH (setns) if given, listens on
//! 127.0.0.1:PORT and accepts N connections (blocking accept, 300 s
//! deadline). Then it writes [`S2C`] bytes on each (the client leaves them
//! unread and its receive buffer is small, so part of them stays in the
//! server's send queue) and waits until the client's [`C2S`] bytes are in
//! every receive queue, which it does not read either. It prints
//! `READY n=N accept_s=SECS t_accepted=NS` (NS: CLOCK_MONOTONIC of the
//! N-th accept) and serves: one epoll (edge-triggered), nonblocking sockets;
//! a connection is left alone until more than the initial C2S bytes are
//! queued on it, from then on every byte read is echoed back. Stdin is not
//! used; it exits after an hour without any event.
//!
//! `bench_tcp [--netns PATH] client PORT N`
//!
//! Opens N connections to 127.0.0.1:PORT (SO_RCVBUF [`CLIENT_RCVBUF`];
//! beyond [`PORTS_PER_ADDR`] connections, source addresses are spread over
//! 127.0.0.x so that ephemeral ports do not run out), then writes [`C2S`]
//! bytes on each and prints `CONNECTED n=N connect_s=SECS t0=NS t1=NS`
//! (t0: before the first connect, t1: after the last). It watches every
//! connection (EPOLLRDHUP, EPOLLERR, EPOLLHUP: "broken") and reads commands,
//! one per line, on stdin:
//!
//! - `PING W`: ping connection 0 (a [`PING_LEN`]-byte message, one in
//!   flight at a time, at most one every millisecond), print `WARM` after W
//!   echoes; on `STOP M`, M more echoes, then `PINGS K`, K lines
//!   `SEQ SEND_NS RECV_NS` (CLOCK_MONOTONIC) and `END`. `PINGFAIL reason`
//!   if connection 0 breaks or an echo takes more than 10 minutes.
//! - `CHECK`: send a ping on every connection and wait (5 minute deadline)
//!   until every connection has returned all it owes: the server's initial
//!   S2C bytes, the echo of the client's C2S bytes, then the echo of every
//!   ping. Every byte is compared with what is expected (the initial bytes
//!   are a pattern of the connection index and direction). Prints
//!   `CHECK OK n=N answered_s=SECS` or
//!   `CHECK FAIL n=N ok=K broken=B silent=S answered_s=SECS: PROBLEMS`.
//!   A connection that broke at any time since it was opened fails.
//! - `QUIT`: exit 0. End of stdin also exits.

use clap::builder::RangedU64ValueParser;
use clap::{Parser, ValueEnum};
use std::io::Write;
use std::process::exit;

/// Bytes the server writes on each connection at start (left unread).
const S2C: usize = 8192;
/// Bytes the client writes on each connection at start (left unread).
const C2S: usize = 4096;
/// SO_RCVBUF of the client's sockets: small, so that the server's S2C
/// bytes do not all fit in the client's receive window.
const CLIENT_RCVBUF: i32 = 4096;
/// Length of one ping.
const PING_LEN: usize = 16;
/// Connections per source address (of 28232 default ephemeral ports).
const PORTS_PER_ADDR: usize = 16000;
/// Pattern "direction" of the server's initial bytes, and the client's.
const DIR_S2C: u64 = 1;
const DIR_C2S: u64 = 2;
const SETUP_DEADLINE_S: u64 = 300;
const CHECK_DEADLINE_S: u64 = 300;
const ECHO_DEADLINE_S: u64 = 600;
const IDLE_EXIT_S: u64 = 3600;
const MS: u64 = 1_000_000;
const SEC: u64 = 1_000_000_000;

/// Benchmark workload of `cr-bench tcp`: one TCP server (the checkpointed
/// process) or its client (the peers, never checkpointed), on 127.0.0.1.
#[derive(Parser)]
#[command(name = "bench_tcp")]
struct Cli {
    /// Network namespace to enter (setns) first.
    #[arg(long, value_name = "PATH")]
    netns: Option<String>,
    /// Which side to run.
    #[arg(value_enum)]
    role: Role,
    /// Port of the server on 127.0.0.1.
    port: u16,
    /// Number of connections.
    #[arg(value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    n: usize,
}

#[derive(Clone, Copy, ValueEnum)]
enum Role {
    /// Listens on 127.0.0.1:PORT, accepts N connections, then echoes.
    Server,
    /// Opens N connections to 127.0.0.1:PORT and reads commands on stdin.
    Client,
}

// ---------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------

fn fail(msg: &str) -> ! {
    eprintln!("bench_tcp: {msg}");
    let _ = writeln!(std::io::stdout(), "FAIL {msg}");
    exit(1);
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn errno_str() -> String {
    std::io::Error::last_os_error().to_string()
}

fn say(line: &str) {
    let mut o = std::io::stdout().lock();
    if o.write_all(line.as_bytes())
        .and_then(|_| o.write_all(b"\n"))
        .and_then(|_| o.flush())
        .is_err()
    {
        exit(1);
    }
}

fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * SEC + ts.tv_nsec as u64
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Bytes `start..start + out.len()` of the initial data of connection
/// `conn` in direction `dir`.
fn fill(conn: usize, dir: u64, start: usize, out: &mut [u8]) {
    let (mut p, mut i) = (start, 0);
    while i < out.len() {
        let w = splitmix(((conn as u64) << 40) ^ (dir << 36) ^ (p / 8) as u64).to_le_bytes();
        let o = p % 8;
        let n = (8 - o).min(out.len() - i);
        out[i..i + n].copy_from_slice(&w[o..o + n]);
        i += n;
        p += n;
    }
}

fn set_int(fd: i32, level: i32, opt: i32, v: i32, what: &str) {
    // SAFETY: `v` is a valid c_int option value of the given size.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            opt,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if r != 0 {
        fail(&format!("setsockopt {what}: {}", errno_str()));
    }
}

fn set_timeout(fd: i32, opt: i32, secs: u64) {
    let tv = libc::timeval {
        tv_sec: secs as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: `tv` is a valid timeval option value.
    let r = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            opt,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r != 0 {
        fail(&format!("setsockopt timeout: {}", errno_str()));
    }
}

fn sockaddr(a: [u8; 4], port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_be_bytes(a).to_be(),
        },
        sin_zero: [0; 8],
    }
}

const SA_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;

fn set_nonblock(fd: i32) {
    // SAFETY: fcntl on an fd we own.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if fl < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) } != 0 {
        fail(&format!("fcntl O_NONBLOCK: {}", errno_str()));
    }
}

fn fionread(fd: i32) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one c_int.
    if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) } != 0 {
        return 0;
    }
    n.max(0) as usize
}

fn so_error(fd: i32) -> String {
    let mut e: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: SO_ERROR writes one c_int; `len` is its size.
    unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&mut e as *mut libc::c_int).cast(),
            &mut len,
        );
    }
    if e == 0 {
        "no socket error".into()
    } else {
        std::io::Error::from_raw_os_error(e).to_string()
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard one; fails if `need` fds do
/// not fit.
fn raise_nofile(need: usize) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid in/out parameter.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
        l.rlim_cur = l.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &l);
    }
    if (l.rlim_cur as usize) < need {
        fail(&format!(
            "{need} fds needed, the hard RLIMIT_NOFILE is {}",
            l.rlim_max
        ));
    }
}

fn enter_netns(path: &str) {
    let c = std::ffi::CString::new(path).unwrap_or_else(|_| fail("NUL in --netns"));
    // SAFETY: `c` is a valid C string.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        fail(&format!("open {path}: {}", errno_str()));
    }
    // SAFETY: setns on the fd just opened; only the network namespace.
    if unsafe { libc::setns(fd, libc::CLONE_NEWNET) } != 0 {
        fail(&format!("setns {path}: {}", errno_str()));
    }
    // SAFETY: closing our own fd.
    unsafe { libc::close(fd) };
}

fn epoll_add(ep: i32, fd: i32, data: u64) {
    let mut ev = libc::epoll_event {
        events: (libc::EPOLLIN | libc::EPOLLOUT | libc::EPOLLRDHUP | libc::EPOLLET) as u32,
        u64: data,
    };
    // SAFETY: `ev` is a valid epoll_event.
    if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        fail(&format!("epoll_ctl ADD: {}", errno_str()));
    }
}

fn epoll_wait(ep: i32, evs: &mut [libc::epoll_event], timeout_ms: i32) -> usize {
    // SAFETY: `evs` is a writable array of evs.len() events.
    let r = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), evs.len() as i32, timeout_ms) };
    if r < 0 {
        if errno() == libc::EINTR {
            return 0;
        }
        fail(&format!("epoll_wait: {}", errno_str()));
    }
    r as usize
}

/// Sends as much of `data` as the socket takes (nonblocking); returns how
/// much, or Err(reason) on a real error.
fn send_some(fd: i32, data: &[u8]) -> Result<usize, String> {
    let mut done = 0;
    while done < data.len() {
        // SAFETY: the slice data[done..] is valid for reading.
        let r = unsafe {
            libc::send(
                fd,
                data[done..].as_ptr().cast(),
                data.len() - done,
                libc::MSG_NOSIGNAL,
            )
        };
        if r < 0 {
            match errno() {
                libc::EINTR => continue,
                libc::EAGAIN => break,
                _ => return Err(format!("send: {}", errno_str())),
            }
        }
        done += r as usize;
    }
    Ok(done)
}

/// Sends as much of `out` as the socket takes and drops it from `out`.
fn flush(fd: i32, out: &mut Vec<u8>) -> Result<(), String> {
    let done = send_some(fd, out)?;
    out.drain(..done);
    if out.is_empty() {
        // No per-connection buffer left behind in the heap (and the image).
        *out = Vec::new();
    }
    Ok(())
}

/// Sends the initial `len` bytes of connection `conn` in direction `dir`;
/// what the socket does not take yet is kept in `out`.
fn send_initial(
    fd: i32,
    conn: usize,
    dir: u64,
    len: usize,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let mut b = vec![0u8; len];
    fill(conn, dir, 0, &mut b);
    let done = send_some(fd, &b)?;
    if done < len {
        *out = b[done..].to_vec();
    }
    Ok(())
}

enum Got {
    Data(usize),
    Again,
    Eof,
    Err(String),
}

fn read_some(fd: i32, buf: &mut [u8]) -> Got {
    loop {
        // SAFETY: `buf` is writable for buf.len() bytes.
        let r = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if r > 0 {
            return Got::Data(r as usize);
        }
        if r == 0 {
            return Got::Eof;
        }
        match errno() {
            libc::EINTR => continue,
            libc::EAGAIN => return Got::Again,
            _ => return Got::Err(errno_str()),
        }
    }
}

fn ns_secs(ns: u64) -> f64 {
    ns as f64 / SEC as f64
}

// ---------------------------------------------------------------------------
// Server
// ---------------------------------------------------------------------------

struct SConn {
    fd: i32,
    out: Vec<u8>,
    /// Client's initial bytes all queued (setup).
    full_in: bool,
    /// More than the initial bytes arrived once: echo from now on.
    active: bool,
    closed: bool,
}

fn server(port: u16, n: usize) {
    raise_nofile(n + 16);
    // SAFETY: plain socket(2).
    let l = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if l < 0 {
        fail(&format!("socket: {}", errno_str()));
    }
    set_int(l, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1, "SO_REUSEADDR");
    let a = sockaddr([127, 0, 0, 1], port);
    // SAFETY: `a` is a valid sockaddr_in of SA_LEN bytes.
    if unsafe { libc::bind(l, (&a as *const libc::sockaddr_in).cast(), SA_LEN) } != 0 {
        fail(&format!("bind 127.0.0.1:{port}: {}", errno_str()));
    }
    // SAFETY: listen on our socket; the kernel caps the backlog at somaxconn.
    if unsafe { libc::listen(l, n.clamp(16, 65535) as i32) } != 0 {
        fail(&format!("listen: {}", errno_str()));
    }
    // accept(2) honours SO_RCVTIMEO: the setup deadline.
    set_timeout(l, libc::SO_RCVTIMEO, SETUP_DEADLINE_S);
    say(&format!("LISTENING port={port} n={n}"));

    let mut conns: Vec<SConn> = Vec::with_capacity(n);
    let mut t_first = 0;
    for i in 0..n {
        let fd = loop {
            // SAFETY: accept4 with no peer address requested.
            let fd = unsafe {
                libc::accept4(
                    l,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if fd >= 0 || errno() != libc::EINTR {
                break fd;
            }
        };
        if fd < 0 {
            fail(&format!("accept {} of {n}: {}", i + 1, errno_str()));
        }
        if i == 0 {
            t_first = now_ns();
        }
        conns.push(SConn {
            fd,
            out: Vec::new(),
            full_in: false,
            active: false,
            closed: false,
        });
    }
    let t_acc = now_ns();

    // SAFETY: plain epoll_create1.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        fail(&format!("epoll_create1: {}", errno_str()));
    }
    let mut full = 0;
    for (i, c) in conns.iter_mut().enumerate() {
        if let Err(e) = send_initial(c.fd, i, DIR_S2C, S2C, &mut c.out) {
            fail(&format!("conn {i}: initial write: {e}"));
        }
        epoll_add(ep, c.fd, i as u64);
    }
    // Wait until the client's initial bytes are queued on every connection.
    let deadline = now_ns() + SETUP_DEADLINE_S * SEC;
    for c in conns.iter_mut() {
        if fionread(c.fd) >= C2S {
            c.full_in = true;
            full += 1;
        }
    }
    let mut evs = vec![libc::epoll_event { events: 0, u64: 0 }; 1024];
    while full < n {
        if now_ns() > deadline {
            fail(&format!(
                "only {full} of {n} connections got the client's {C2S} bytes in time"
            ));
        }
        let k = epoll_wait(ep, &mut evs, 1000);
        for ev in &evs[..k] {
            let (bits, i) = (ev.events, ev.u64 as usize);
            let c = &mut conns[i];
            if bits & (libc::EPOLLERR | libc::EPOLLHUP | libc::EPOLLRDHUP) as u32 != 0 {
                fail(&format!("conn {i} broke during setup: {}", so_error(c.fd)));
            }
            if bits & libc::EPOLLOUT as u32 != 0 {
                if let Err(e) = flush(c.fd, &mut c.out) {
                    fail(&format!("conn {i}: {e}"));
                }
            }
            if bits & libc::EPOLLIN as u32 != 0 && !c.full_in && fionread(c.fd) >= C2S {
                c.full_in = true;
                full += 1;
            }
        }
    }
    say(&format!(
        "READY n={n} accept_s={:.6} t_accepted={t_acc}",
        ns_secs(t_acc - t_first)
    ));

    // Serve.
    let mut buf = vec![0u8; 65536];
    let mut last_event = now_ns();
    loop {
        let k = epoll_wait(ep, &mut evs, 1000);
        if k == 0 {
            if now_ns() - last_event > IDLE_EXIT_S * SEC {
                eprintln!("bench_tcp server: idle for an hour, exiting");
                exit(0);
            }
            continue;
        }
        last_event = now_ns();
        for ev in &evs[..k] {
            let (bits, i) = (ev.events, ev.u64 as usize);
            let c = &mut conns[i];
            if c.closed {
                continue;
            }
            if bits & libc::EPOLLIN as u32 != 0 && !c.active && fionread(c.fd) > C2S {
                c.active = true;
            }
            let mut why = None;
            if c.active {
                loop {
                    match read_some(c.fd, &mut buf) {
                        Got::Data(r) => c.out.extend_from_slice(&buf[..r]),
                        Got::Again => break,
                        Got::Eof => {
                            why = Some("EOF".to_string());
                            break;
                        }
                        Got::Err(e) => {
                            why = Some(e);
                            break;
                        }
                    }
                }
            }
            if why.is_none() && !c.out.is_empty() {
                why = flush(c.fd, &mut c.out).err();
            }
            if why.is_none() && bits & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0 {
                why = Some(so_error(c.fd));
            }
            if let Some(w) = why {
                eprintln!("bench_tcp server: conn {i} closed: {w}");
                // SAFETY: closing our own fd (also drops it from the epoll).
                unsafe { libc::close(c.fd) };
                c.closed = true;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Client
// ---------------------------------------------------------------------------

struct CConn {
    fd: i32,
    /// Not yet sent.
    out: Vec<u8>,
    /// Everything sent after the initial C2S bytes (pings), for the check
    /// of the echo.
    sent: Vec<u8>,
    /// Bytes received (and checked) so far.
    recv: usize,
    broken: Option<String>,
}

impl CConn {
    /// All the bytes the server owes once it has echoed everything sent.
    fn expected(&self) -> usize {
        S2C + C2S + self.sent.len()
    }

    fn mark(&mut self, why: String) {
        if self.broken.is_none() {
            self.broken = Some(why);
        }
    }

    /// Checks `data`, received at offset self.recv of the stream.
    fn take(&mut self, i: usize, data: &[u8]) {
        let mut p = self.recv;
        let mut d = data;
        if p + d.len() > self.expected() {
            self.mark(format!(
                "{} bytes more than the {} expected",
                p + d.len() - self.expected(),
                self.expected()
            ));
        }
        let mut exp = [0u8; 4096];
        while !d.is_empty() && self.broken.is_none() {
            let (n, ok) = if p < S2C {
                let n = d.len().min(S2C - p).min(exp.len());
                fill(i, DIR_S2C, p, &mut exp[..n]);
                (n, d[..n] == exp[..n])
            } else if p < S2C + C2S {
                let n = d.len().min(S2C + C2S - p).min(exp.len());
                fill(i, DIR_C2S, p - S2C, &mut exp[..n]);
                (n, d[..n] == exp[..n])
            } else {
                let q = p - S2C - C2S;
                let n = d.len().min(self.sent.len() - q);
                (n, d[..n] == self.sent[q..q + n])
            };
            if !ok {
                let what = if p < S2C {
                    "the server's initial bytes"
                } else if p < S2C + C2S {
                    "the echo of the client's initial bytes"
                } else {
                    "the echo of a ping"
                };
                self.mark(format!("wrong bytes in {what} at stream offset {p}"));
            }
            p += n;
            d = &d[n..];
        }
        self.recv += data.len();
    }

    /// Reads until EAGAIN, checking every byte.
    fn read_all(&mut self, i: usize, buf: &mut [u8]) {
        while self.broken.is_none() {
            match read_some(self.fd, buf) {
                Got::Data(r) => {
                    let data = buf[..r].to_vec();
                    self.take(i, &data);
                }
                Got::Again => break,
                Got::Eof => self.mark("EOF from the server".into()),
                Got::Err(e) => self.mark(format!("recv: {e}")),
            }
        }
    }

    fn send(&mut self, msg: &[u8]) {
        self.sent.extend_from_slice(msg);
        self.out.extend_from_slice(msg);
        if let Err(e) = flush(self.fd, &mut self.out) {
            self.mark(e);
        }
    }
}

struct Client {
    conns: Vec<CConn>,
    ep: i32,
    evs: Vec<libc::epoll_event>,
    buf: Vec<u8>,
    stdin_buf: Vec<u8>,
    seq: u64,
}

fn ping_msg(conn: usize, seq: u64) -> [u8; PING_LEN] {
    let mut m = [0x5Au8; PING_LEN];
    m[0] = 0xA5;
    m[1..5].copy_from_slice(&(conn as u32).to_le_bytes());
    m[5..13].copy_from_slice(&seq.to_le_bytes());
    m
}

impl Client {
    /// Handles the epoll events that are ready; reads the connections for
    /// which `read(i)` is true (the others keep their data queued).
    fn events(&mut self, timeout_ms: i32, read: impl Fn(usize) -> bool) {
        let k = epoll_wait(self.ep, &mut self.evs, timeout_ms);
        for j in 0..k {
            let (bits, i) = (self.evs[j].events, self.evs[j].u64 as usize);
            let c = &mut self.conns[i];
            if bits & libc::EPOLLOUT as u32 != 0 && !c.out.is_empty() {
                if let Err(e) = flush(c.fd, &mut c.out) {
                    c.mark(e);
                }
            }
            if read(i) {
                c.read_all(i, &mut self.buf);
            }
            if bits & (libc::EPOLLERR | libc::EPOLLHUP | libc::EPOLLRDHUP) as u32 != 0 {
                let what = if bits & libc::EPOLLRDHUP as u32 != 0 {
                    "the server closed or reset it"
                } else {
                    "error/hangup"
                };
                let e = so_error(c.fd);
                c.mark(format!("{what} ({e})"));
            }
        }
    }

    /// Complete lines on stdin (nonblocking); exits on end of input.
    fn stdin_lines(&mut self) -> Vec<String> {
        let mut b = [0u8; 4096];
        loop {
            // SAFETY: `b` is writable for its length.
            let r = unsafe { libc::read(0, b.as_mut_ptr().cast(), b.len()) };
            if r > 0 {
                self.stdin_buf.extend_from_slice(&b[..r as usize]);
                continue;
            }
            if r == 0 {
                exit(0);
            }
            match errno() {
                libc::EINTR => continue,
                libc::EAGAIN => break,
                _ => fail(&format!("read stdin: {}", errno_str())),
            }
        }
        let mut out = Vec::new();
        while let Some(p) = self.stdin_buf.iter().position(|&c| c == b'\n') {
            let line: Vec<u8> = self.stdin_buf.drain(..=p).collect();
            out.push(String::from_utf8_lossy(&line).trim().to_string());
        }
        out
    }

    /// Waits for stdin or epoll for at most `timeout_ns`. Returns whether
    /// stdin and epoll are readable.
    fn wait(&self, timeout_ns: u64) -> (bool, bool) {
        let mut fds = [
            libc::pollfd {
                fd: 0,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.ep,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ts = libc::timespec {
            tv_sec: (timeout_ns / SEC) as libc::time_t,
            tv_nsec: (timeout_ns % SEC) as libc::c_long,
        };
        // SAFETY: `fds` and `ts` are valid; no signal mask change.
        let r = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if r < 0 {
            if errno() == libc::EINTR {
                return (false, false);
            }
            fail(&format!("ppoll: {}", errno_str()));
        }
        (fds[0].revents != 0, fds[1].revents & libc::POLLIN != 0)
    }

    fn ping(&mut self, warm: usize) {
        self.conns[0].read_all(0, &mut self.buf);
        let mut samples: Vec<(u64, u64, u64)> = Vec::new();
        // (seq, send time, stream offset at which its echo is complete)
        let mut outstanding: Option<(u64, u64, usize)> = None;
        let mut next_send = now_ns();
        let mut warm_said = false;
        let mut stop_after: Option<usize> = None;
        loop {
            let now = now_ns();
            if outstanding.is_none() && now >= next_send {
                let seq = self.seq;
                self.seq += 1;
                let t = now_ns();
                self.conns[0].send(&ping_msg(0, seq));
                outstanding = Some((seq, t, self.conns[0].expected()));
                next_send = t + MS;
            }
            let timeout = match outstanding {
                Some(_) => SEC,
                None => next_send.saturating_sub(now_ns()),
            };
            let (stdin, epoll) = self.wait(timeout);
            if epoll {
                self.events(0, |i| i == 0);
            }
            if let Some(b) = &self.conns[0].broken {
                say(&format!("PINGFAIL connection 0: {b}"));
                return;
            }
            if let Some((seq, sent, end)) = outstanding {
                if self.conns[0].recv >= end {
                    samples.push((seq, sent, now_ns()));
                    outstanding = None;
                    if !warm_said && samples.len() >= warm {
                        say("WARM");
                        warm_said = true;
                    }
                    if let Some(k) = stop_after.as_mut() {
                        if *k == 0 {
                            break;
                        }
                        *k -= 1;
                    }
                } else if now_ns() - sent > ECHO_DEADLINE_S * SEC {
                    say(&format!(
                        "PINGFAIL no echo of ping {seq} in {ECHO_DEADLINE_S} s"
                    ));
                    return;
                }
            }
            if stdin {
                for l in self.stdin_lines() {
                    let mut w = l.split_whitespace();
                    match (w.next(), w.next().and_then(|x| x.parse().ok())) {
                        (Some("STOP"), Some(m)) => stop_after = Some(m),
                        _ => say(&format!("PINGFAIL unexpected command {l:?} while pinging")),
                    }
                }
            }
        }
        let mut s = format!("PINGS {}\n", samples.len());
        for (q, a, b) in &samples {
            s.push_str(&format!("{q} {a} {b}\n"));
        }
        s.push_str("END");
        say(&s);
    }

    fn check(&mut self) {
        let t0 = now_ns();
        let n = self.conns.len();
        for i in 0..n {
            if self.conns[i].broken.is_none() {
                let seq = self.seq;
                self.seq += 1;
                self.conns[i].send(&ping_msg(i, seq));
                self.conns[i].read_all(i, &mut self.buf);
            }
        }
        let done = |c: &CConn| c.broken.is_some() || c.recv >= c.expected();
        let mut pending = self.conns.iter().filter(|c| !done(c)).count();
        let deadline = t0 + CHECK_DEADLINE_S * SEC;
        while pending > 0 && now_ns() < deadline {
            self.events(1000, |_| true);
            pending = self.conns.iter().filter(|c| !done(c)).count();
        }
        let secs = ns_secs(now_ns() - t0);
        let broken = self.conns.iter().filter(|c| c.broken.is_some()).count();
        let silent = self
            .conns
            .iter()
            .filter(|c| c.broken.is_none() && c.recv < c.expected())
            .count();
        if broken == 0 && silent == 0 {
            say(&format!("CHECK OK n={n} answered_s={secs:.6}"));
            return;
        }
        let mut problems = Vec::new();
        for (i, c) in self.conns.iter().enumerate() {
            if problems.len() >= 5 {
                break;
            }
            if let Some(b) = &c.broken {
                problems.push(format!("conn {i}: {b}"));
            } else if c.recv < c.expected() {
                problems.push(format!(
                    "conn {i}: {} of {} bytes after {CHECK_DEADLINE_S} s",
                    c.recv,
                    c.expected()
                ));
            }
        }
        say(&format!(
            "CHECK FAIL n={n} ok={} broken={broken} silent={silent} answered_s={secs:.6}: {}",
            n - broken - silent,
            problems.join("; ")
        ));
    }
}

fn client(port: u16, n: usize) {
    raise_nofile(n + 16);
    let addrs = n.div_ceil(PORTS_PER_ADDR);
    let dst = sockaddr([127, 0, 0, 1], port);
    let mut conns = Vec::with_capacity(n);
    let t0 = now_ns();
    for i in 0..n {
        // SAFETY: plain socket(2).
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            fail(&format!("socket {} of {n}: {}", i + 1, errno_str()));
        }
        set_int(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            CLIENT_RCVBUF,
            "SO_RCVBUF",
        );
        // A blocking connect(2) honours SO_SNDTIMEO: the setup deadline.
        set_timeout(fd, libc::SO_SNDTIMEO, SETUP_DEADLINE_S);
        if addrs > 1 {
            set_int(
                fd,
                libc::IPPROTO_IP,
                libc::IP_BIND_ADDRESS_NO_PORT,
                1,
                "IP_BIND_ADDRESS_NO_PORT",
            );
            let src = sockaddr([127, 0, 0, 1 + (i % addrs) as u8], 0);
            // SAFETY: `src` is a valid sockaddr_in of SA_LEN bytes.
            if unsafe { libc::bind(fd, (&src as *const libc::sockaddr_in).cast(), SA_LEN) } != 0 {
                fail(&format!("bind source {}: {}", i % addrs + 1, errno_str()));
            }
        }
        loop {
            // SAFETY: `dst` is a valid sockaddr_in of SA_LEN bytes.
            let r = unsafe { libc::connect(fd, (&dst as *const libc::sockaddr_in).cast(), SA_LEN) };
            if r == 0 {
                break;
            }
            if errno() != libc::EINTR {
                fail(&format!("connect {} of {n}: {}", i + 1, errno_str()));
            }
        }
        conns.push(CConn {
            fd,
            out: Vec::new(),
            sent: Vec::new(),
            recv: 0,
            broken: None,
        });
    }
    let t1 = now_ns();
    // SAFETY: plain epoll_create1.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if ep < 0 {
        fail(&format!("epoll_create1: {}", errno_str()));
    }
    for (i, c) in conns.iter_mut().enumerate() {
        set_nonblock(c.fd);
        if let Err(e) = send_initial(c.fd, i, DIR_C2S, C2S, &mut c.out) {
            fail(&format!("conn {i}: initial write: {e}"));
        }
        epoll_add(ep, c.fd, i as u64);
    }
    set_nonblock(0);
    say(&format!(
        "CONNECTED n={n} connect_s={:.6} t0={t0} t1={t1}",
        ns_secs(t1 - t0)
    ));
    let mut cl = Client {
        conns,
        ep,
        evs: vec![libc::epoll_event { events: 0, u64: 0 }; 4096],
        buf: vec![0u8; 65536],
        stdin_buf: Vec::new(),
        seq: 0,
    };
    let mut last = now_ns();
    loop {
        let (stdin, epoll) = cl.wait(SEC);
        if epoll {
            // Idle: watch for broken connections, leave the data queued.
            cl.events(0, |_| false);
        }
        if stdin {
            last = now_ns();
            for l in cl.stdin_lines() {
                let mut w = l.split_whitespace();
                match (w.next(), w.next()) {
                    (Some("PING"), Some(k)) => match k.parse() {
                        Ok(k) => cl.ping(k),
                        Err(_) => say(&format!("ERROR bad command {l:?}")),
                    },
                    (Some("CHECK"), None) => cl.check(),
                    (Some("QUIT"), None) => exit(0),
                    (None, _) => {}
                    _ => say(&format!("ERROR bad command {l:?}")),
                }
            }
        } else if now_ns() - last > IDLE_EXIT_S * SEC {
            eprintln!("bench_tcp client: no command for an hour, exiting");
            exit(0);
        }
    }
}

fn main() {
    let Cli {
        netns,
        role,
        port,
        n,
    } = Cli::parse();
    if let Some(path) = &netns {
        enter_netns(path);
    }
    // SAFETY: close_range on fds above 2 (nothing of ours is open yet
    // besides the standard ones).
    unsafe {
        libc::close_range(3, libc::c_uint::MAX, 0);
    }
    match role {
        Role::Server => server(port, n),
        Role::Client => client(port, n),
    }
}
