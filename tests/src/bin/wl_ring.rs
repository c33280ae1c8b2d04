//! wl_ring STATUS_FILE INDEX COUNT LISTEN_ADDR:PORT NEXT_ADDR:PORT
//!
//! One member of a ring job (the cluster tests, `cr-bench cluster`): member
//! INDEX of COUNT listens on LISTEN, connects to NEXT (the listen address of
//! member (INDEX+1) % COUNT; retried while refused or unreachable, up to
//! 60 s), then accepts exactly one connection (from the previous member) and
//! closes its listener. A ring of one member connects to itself.
//!
//! Both directions of both connections carry 64-byte messages numbered 1, 2,
//! 3, ... (the number, a tag naming the connection, that is the index of the
//! member that connected, and the direction, and 48 bytes derived from both:
//! [`cr_tests::wl::msg`], as in wl_tcp). Every message received must be
//! exactly the previous number + 1 with its tag and bytes intact. Sockets are
//! nonblocking and wait in poll(2) (single-threaded); writing is paced at 200
//! messages per connection per 10 ms tick (or until the socket is full), and
//! everything readable is read at once, so the connections have data in
//! flight whenever a peer stops.
//!
//! About every 100 ms the status file is written atomically (STATUS_FILE.tmp,
//! opened afresh each time, then renamed): `ok sent=S recv=R min=M pid=P`,
//! with S and R the totals over both connections, M the smallest of the four
//! counts (each connection, each direction) and P what getpid returns. On
//! any failure (a gap, a duplicate or corrupted message, EOF or an error on
//! a connection, a connect or accept that never comes) it writes
//! `FAIL <reason>` instead, repeats the reason on stderr and exits 1.
//!
//! `wl_ring ... NEXT BALLAST_MIB[:DIRTY_MB_S]` also holds BALLAST_MIB MiB
//! of memory whose every page is recomputable (word 0 from the page's
//! version, the others from its index), rewrites DIRTY_MB_S MB of it per
//! second (the page's version bumped), and checks 1 MiB of it per tick,
//! round and round: a page restored wrong is a FAIL (`ballast page P word
//! W`). The status line then ends with `checked=N`, the full passes done.
//! (For the migration tests and benchmarks: memory size and dirty rate.)
//!
//! With `WL_RING_PHASES=PERIOD_MS:BURST_MS` in its environment a member
//! writes only during the first BURST_MS of every PERIOD_MS of the wall
//! clock (the same phases on every member: a bulk-synchronous program whose
//! exchange phase is followed by a quiet compute phase), reading all the
//! time: in the quiet part every byte written has been received and
//! acknowledged (for the uncoordinated checkpoint tests).
//!
//! Nothing is resolved or looked up after the start: the process may be
//! frozen, checkpointed, killed and restored on another node with its
//! sockets' addresses rewritten. It gives up (FAIL) after 15 minutes, so
//! nothing lingers if the test that started it was killed.

use cr_tests::wl;
use cr_tests::wl::msg::{bad_word, encode, field, tag, MSG};
use std::ffi::CString;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;

/// Length of one tick of the pacing.
const TICK_MS: u64 = 10;
/// Messages written per connection per tick (at most).
const WRITE_BUDGET: u64 = 200;
/// Period of the status file.
const STATUS_MS: u64 = 100;
/// How long connecting to the next member and accepting the previous may take.
const SETUP_MS: u64 = 60_000;
/// The member gives up after this long.
const LIFETIME_MS: u64 = 15 * 60_000;
/// Direction from the member that connected to the one that accepted.
const DIR_FWD: u64 = 1;
/// Direction from the member that accepted to the one that connected.
const DIR_BACK: u64 = 2;

const USAGE: &str =
    "wl_ring STATUS_FILE INDEX COUNT LISTEN_ADDR:PORT NEXT_ADDR:PORT [BALLAST_MIB[:DIRTY_MB_S]]";

const PAGE_WORDS: usize = 512;
/// Ballast pages checked per tick (1 MiB).
const CHECK_PAGES: usize = 256;

fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Memory of a known content, partly rewritten at a steady rate.
struct Ballast {
    words: Vec<u64>,
    version: Vec<u32>,
    /// Pages rewritten per tick (fractional part carried over).
    dirty_per_tick: f64,
    carry: f64,
    dirty_at: usize,
    check_at: usize,
    passes: u64,
}

impl Ballast {
    fn word(p: usize, w: usize, v: u32) -> u64 {
        if w == 0 {
            mix(((p as u64) << 32) ^ u64::from(v) ^ 0x5eed)
        } else {
            mix(((p as u64) << 9) | w as u64)
        }
    }

    fn new(mib: usize, dirty_mb_s: f64) -> Ballast {
        let pages = mib * 256;
        let mut words = vec![0u64; pages * PAGE_WORDS];
        for (p, page) in words.chunks_exact_mut(PAGE_WORDS).enumerate() {
            for (w, x) in page.iter_mut().enumerate() {
                *x = Ballast::word(p, w, 0);
            }
        }
        Ballast {
            words,
            version: vec![0; pages],
            dirty_per_tick: dirty_mb_s * 1e6 / 4096.0 * TICK_MS as f64 / 1000.0,
            carry: 0.0,
            dirty_at: 0,
            check_at: 0,
            passes: 0,
        }
    }

    fn pages(&self) -> usize {
        self.version.len()
    }

    /// One tick: rewrite this tick's pages, check the next 1 MiB.
    fn tick(&mut self) {
        let n = self.pages();
        if n == 0 {
            return;
        }
        self.carry += self.dirty_per_tick;
        while self.carry >= 1.0 {
            self.carry -= 1.0;
            let p = self.dirty_at;
            self.dirty_at = (p + 7919) % n;
            self.version[p] = self.version[p].wrapping_add(1);
            self.words[p * PAGE_WORDS] = Ballast::word(p, 0, self.version[p]);
        }
        for _ in 0..CHECK_PAGES.min(n) {
            let p = self.check_at;
            let v = self.version[p];
            let page = &self.words[p * PAGE_WORDS..(p + 1) * PAGE_WORDS];
            for (w, &x) in page.iter().enumerate() {
                let want = Ballast::word(p, w, v);
                if x != want {
                    die(&format!(
                        "ballast page {p} word {w}: expected {want:#x}, got {x:#x} (version {v})"
                    ));
                }
            }
            self.check_at += 1;
            if self.check_at == n {
                self.check_at = 0;
                self.passes += 1;
            }
        }
    }
}

/// The status file, rewritten atomically.
struct Status {
    path: CString,
    tmp: CString,
}

impl Status {
    fn new(path: &str) -> Status {
        let c = |s: String| CString::new(s).unwrap_or_else(|_| die("NUL in the status path"));
        Status {
            path: c(path.to_string()),
            tmp: c(format!("{path}.tmp")),
        }
    }

    /// Writes `line` to STATUS.tmp (opened afresh) and renames it over STATUS.
    fn write(&self, line: &str) -> Result<(), String> {
        // SAFETY: tmp is a valid NUL-terminated path.
        let fd = unsafe {
            libc::open(
                self.tmp.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
                0o644,
            )
        };
        if fd < 0 {
            return Err(format!(
                "open {:?}: {}",
                self.tmp,
                std::io::Error::last_os_error()
            ));
        }
        let text = format!("{line}\n");
        let r = wl::write_all_fd(fd, text.as_bytes());
        // SAFETY: fd was opened above and is closed once.
        unsafe { libc::close(fd) };
        r?;
        // SAFETY: both are valid NUL-terminated paths.
        if unsafe { libc::rename(self.tmp.as_ptr(), self.path.as_ptr()) } != 0 {
            return Err(format!(
                "rename {:?}: {}",
                self.tmp,
                std::io::Error::last_os_error()
            ));
        }
        Ok(())
    }
}

/// Set once the status file is known, so that `die` can report there.
static STATUS: std::sync::OnceLock<Status> = std::sync::OnceLock::new();

/// Writes `FAIL reason` to the status file and stderr, exits 1.
fn die(reason: &str) -> ! {
    let reason = reason.replace('\n', " ");
    wl::note(&format!("wl_ring: FAIL {reason}"));
    if let Some(st) = STATUS.get() {
        if let Err(e) = st.write(&format!("FAIL {reason}")) {
            wl::note(&format!("wl_ring: cannot write the status file: {e}"));
        }
    }
    std::process::exit(1)
}

fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

/// One of the member's two connections.
struct Conn {
    /// For messages: which connection, which addresses.
    name: String,
    s: TcpStream,
    tx_tag: u64,
    rx_tag: u64,
    /// Messages written whole into the socket.
    sent: u64,
    /// Messages received and checked.
    recv: u64,
    /// The batch being written: messages `batch_base + 1 ...`.
    out: Vec<u8>,
    out_off: usize,
    batch_base: u64,
    /// Messages this tick may still queue.
    write_left: u64,
    /// Bytes of an incomplete message.
    inbuf: Vec<u8>,
}

impl Conn {
    fn new(s: TcpStream, what: &str, id: u16, connected: bool) -> Conn {
        if let Err(e) = s.set_nonblocking(true) {
            die(&format!("{what}: set_nonblocking: {e}"));
        }
        let show =
            |a: std::io::Result<SocketAddr>| a.map_or_else(|_| "?".into(), |a| a.to_string());
        let name = format!(
            "{what} (connection {id}, {} -> {})",
            show(s.local_addr()),
            show(s.peer_addr())
        );
        let (tx, rx) = if connected {
            (DIR_FWD, DIR_BACK)
        } else {
            (DIR_BACK, DIR_FWD)
        };
        Conn {
            name,
            s,
            tx_tag: tag(id, tx),
            rx_tag: tag(id, rx),
            sent: 0,
            recv: 0,
            out: Vec::with_capacity(WRITE_BUDGET as usize * MSG),
            out_off: 0,
            batch_base: 0,
            write_left: WRITE_BUDGET,
            inbuf: Vec::with_capacity(2 * MSG),
        }
    }

    /// True if a write would make progress.
    fn wants_write(&self) -> bool {
        self.out_off < self.out.len() || self.write_left > 0
    }

    /// Writes the pending batch, then new ones while the budget allows.
    fn write(&mut self) {
        loop {
            if self.out_off == self.out.len() {
                if self.write_left == 0 {
                    return;
                }
                let n = self.write_left;
                self.batch_base = self.sent;
                self.out.clear();
                let mut m = [0u8; MSG];
                for k in 1..=n {
                    encode(&mut m, self.batch_base + k, self.tx_tag, self.tx_tag);
                    self.out.extend_from_slice(&m);
                }
                self.out_off = 0;
                self.write_left = 0;
            }
            match self.s.write(&self.out[self.out_off..]) {
                Ok(0) => die(&format!("{}: write returned 0", self.name)),
                Ok(n) => {
                    self.out_off += n;
                    self.sent = self.batch_base + (self.out_off / MSG) as u64;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => die(&format!(
                    "{}: write after {} messages sent: {e} (errno {:?})",
                    self.name,
                    self.sent,
                    e.raw_os_error()
                )),
            }
        }
    }

    /// Reads and checks everything there is.
    fn read(&mut self) {
        let mut buf = [0u8; 65536];
        loop {
            match self.s.read(&mut buf) {
                Ok(0) => die(&format!(
                    "{}: EOF from the peer after {} messages received",
                    self.name, self.recv
                )),
                Ok(n) => self.take(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => die(&format!(
                    "{}: read after {} messages received: {e} (errno {:?})",
                    self.name,
                    self.recv,
                    e.raw_os_error()
                )),
            }
        }
    }

    /// Checks the complete messages of what was read.
    fn take(&mut self, mut data: &[u8]) {
        if !self.inbuf.is_empty() {
            let need = MSG - self.inbuf.len();
            let k = need.min(data.len());
            self.inbuf.extend_from_slice(&data[..k]);
            data = &data[k..];
            if self.inbuf.len() < MSG {
                return;
            }
            let m = std::mem::take(&mut self.inbuf);
            self.check(&m);
            self.inbuf = m;
            self.inbuf.clear();
        }
        let whole = data.len() / MSG * MSG;
        for m in data[..whole].chunks_exact(MSG) {
            self.check(m);
        }
        self.inbuf.extend_from_slice(&data[whole..]);
    }

    fn check(&mut self, m: &[u8]) {
        let (a, b) = (field(m, 0), field(m, 1));
        let want = self.recv + 1;
        if a != want {
            let kind = if a < want {
                "duplicate or reordered"
            } else {
                "messages lost"
            };
            die(&format!(
                "{}: expected message {want}, got {a} ({kind}; tag {b:#x})",
                self.name
            ));
        }
        if b != self.rx_tag {
            die(&format!(
                "{}: message {a}: tag {b:#x}, expected {:#x} (wrong connection or corrupted)",
                self.name, self.rx_tag
            ));
        }
        if let Some((i, w, g)) = bad_word(m, self.rx_tag) {
            die(&format!(
                "{}: message {a} corrupted at word {i}: expected {w:#x}, got {g:#x}",
                self.name
            ));
        }
        self.recv += 1;
    }
}

/// Connects to `next`, retrying while refused or unreachable.
fn connect(next: SocketAddr, start: u64) -> TcpStream {
    loop {
        match TcpStream::connect_timeout(&next, Duration::from_secs(5)) {
            Ok(s) => return s,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::ConnectionRefused
                        | ErrorKind::HostUnreachable
                        | ErrorKind::NetworkUnreachable
                        | ErrorKind::TimedOut
                        | ErrorKind::Interrupted
                ) && wl::mono_ns() - start < SETUP_MS * 1_000_000 =>
            {
                wl::sleep_ms(20);
            }
            Err(e) => die(&format!("connect to the next member at {next}: {e}")),
        }
    }
}

/// Accepts one connection within the setup deadline.
fn accept(l: &TcpListener, listen: SocketAddr, start: u64) -> TcpStream {
    if let Err(e) = l.set_nonblocking(true) {
        die(&format!("listener {listen}: set_nonblocking: {e}"));
    }
    loop {
        match l.accept() {
            Ok((s, _)) => return s,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => die(&format!("accept on {listen}: {e}")),
        }
        let left = (SETUP_MS * 1_000_000).saturating_sub(wl::mono_ns() - start) / 1_000_000;
        if left == 0 {
            die(&format!(
                "no connection from the previous member on {listen} within {SETUP_MS} ms"
            ));
        }
        let mut p = libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: p is one valid pollfd.
        unsafe { libc::poll(&mut p, 1, left.min(1000) as i32) };
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 5 && args.len() != 6 {
        wl::note(&format!("usage: {USAGE}"));
        std::process::exit(2);
    }
    let _ = STATUS.set(Status::new(&args[0]));
    let index: u16 = args[1]
        .parse()
        .unwrap_or_else(|_| die(&format!("bad INDEX {:?}", args[1])));
    let count: u16 = args[2]
        .parse()
        .ok()
        .filter(|&c| c > index)
        .unwrap_or_else(|| die(&format!("bad COUNT {:?} (must exceed INDEX)", args[2])));
    let listen: SocketAddr = args[3]
        .parse()
        .unwrap_or_else(|_| die(&format!("bad LISTEN_ADDR:PORT {:?}", args[3])));
    let next: SocketAddr = args[4]
        .parse()
        .unwrap_or_else(|_| die(&format!("bad NEXT_ADDR:PORT {:?}", args[4])));
    let mut ballast = args.get(5).map(|b| {
        let (mib, rate) = b.split_once(':').unwrap_or((b, "0"));
        match (mib.parse::<usize>(), rate.parse::<f64>()) {
            (Ok(m), Ok(r)) if r >= 0.0 => Ballast::new(m, r),
            _ => die(&format!("bad BALLAST_MIB[:DIRTY_MB_S] {b:?}")),
        }
    });
    let status = STATUS.get().expect("status set above");
    let report = |line: &str| {
        if let Err(e) = status.write(line) {
            die(&format!("cannot write the status file: {e}"));
        }
    };
    report(&format!("ok sent=0 recv=0 min=0 pid={}", getpid()));

    let start = wl::mono_ns();
    let listener =
        TcpListener::bind(listen).unwrap_or_else(|e| die(&format!("listen on {listen}: {e}")));
    let to_next = connect(next, start);
    let from_prev = accept(&listener, listen, start);
    drop(listener);
    let prev = (index + count - 1) % count;
    let mut conns = [
        Conn::new(to_next, &format!("to next member at {next}"), index, true),
        Conn::new(from_prev, "from previous member", prev, false),
    ];

    let phases = std::env::var("WL_RING_PHASES").ok().map(|v| {
        match v
            .split_once(':')
            .map(|(p, b)| (p.parse::<u64>(), b.parse::<u64>()))
        {
            Some((Ok(p), Ok(b))) if p > 0 && b <= p => (p, b),
            _ => die(&format!("bad WL_RING_PHASES {v:?} (PERIOD_MS:BURST_MS)")),
        }
    });
    let tick = TICK_MS * 1_000_000;
    let mut next_tick = wl::mono_ns() + tick;
    let mut next_status = 0u64;
    loop {
        let now = wl::mono_ns();
        if now >= next_tick {
            let quiet = phases.is_some_and(|(period, burst)| {
                wl::clock_ns(libc::CLOCK_REALTIME) / 1_000_000 % period >= burst
            });
            for c in conns.iter_mut() {
                c.write_left = if quiet { 0 } else { WRITE_BUDGET };
            }
            if let Some(b) = ballast.as_mut() {
                b.tick();
            }
            // After a freeze: no burst to catch up.
            next_tick = if now - next_tick > tick {
                now + tick
            } else {
                next_tick + tick
            };
        }
        for c in conns.iter_mut() {
            c.read();
            c.write();
        }
        if now >= next_status {
            let sent: u64 = conns.iter().map(|c| c.sent).sum();
            let recv: u64 = conns.iter().map(|c| c.recv).sum();
            let min = conns
                .iter()
                .flat_map(|c| [c.sent, c.recv])
                .min()
                .unwrap_or(0);
            let checked = ballast
                .as_ref()
                .map_or(String::new(), |b| format!(" checked={}", b.passes));
            report(&format!(
                "ok sent={sent} recv={recv} min={min} pid={}{checked}",
                getpid()
            ));
            next_status = now + STATUS_MS * 1_000_000;
        }
        if now - start > LIFETIME_MS * 1_000_000 {
            die(&format!("gave up after {} s", LIFETIME_MS / 1000));
        }
        let mut fds = conns.each_ref().map(|c| libc::pollfd {
            fd: c.s.as_raw_fd(),
            events: libc::POLLIN | if c.wants_write() { libc::POLLOUT } else { 0 },
            revents: 0,
        });
        let wait_ms = (next_tick.saturating_sub(wl::mono_ns()) / 1_000_000).clamp(1, TICK_MS);
        // SAFETY: fds is an array of valid pollfds of the length given.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms as i32) };
        if r < 0 && std::io::Error::last_os_error().kind() != ErrorKind::Interrupted {
            die(&format!("poll: {}", std::io::Error::last_os_error()));
        }
    }
}
