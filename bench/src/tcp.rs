//! `cr-bench tcp`: cost of saving and restoring established TCP connections
//! (TCP_REPAIR) against their number, the pause a peer sees while the
//! server is checkpointed, and the machine's own reference: the time the
//! programs took to establish the connections, and a bare loop over the
//! server's sockets. See the "TCP connections" section of bench/README.md.

use crate::json;
use crate::{
    check_interrupted, describe_status, dir_bytes, file_tail, fmt_opt, install_signal_handlers,
    int_in, kernel_release, only_std_fds, proc_exists, proc_state, reap_strays, run_timed, settle,
    tool_ok, wait_gone, DirGuard, FsKind, ProcGuard, Res, Target, GIB, INTERRUPTED,
};
use clap::{ArgAction, Args};
use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{self, BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

const DEFAULT_CONNS: &str = "1,100,10000";
/// fds kept free below the hard RLIMIT_NOFILE (standard fds, listener,
/// epoll, the tools' own).
const MARGIN: usize = 100;
/// Echoes before the checkpoint starts, and after it ended.
const PINGS_AROUND: usize = 200;
/// First echoes not used for the baseline (connection 0 also returns its
/// initial bytes with the first one).
const PINGS_SKIP: usize = 10;
/// From bench_tcp.rs: initial bytes per connection, each way, and the
/// client's SO_RCVBUF.
const S2C: usize = 8192;
const C2S: usize = 4096;
const CLIENT_RCVBUF: usize = 4096;
const SOMAXCONN: u32 = 65535;
/// The nft table cr_restart leaves in the namespace by design (an empty
/// "reset guard" once its elements expired): not a lock left behind.
const RESET_GUARD_TABLE: &str = "cr_reset_guard";

/// `cr-bench tcp`: the TCP connection benchmark.
#[derive(Args)]
#[command(
    after_help = "Everything runs in a network namespace of its own (cr-bench-tcp-PID, lo \
                   only), created and removed by cr-bench."
)]
pub struct TcpOpts {
    /// Numbers of established connections; counts above the hard
    /// RLIMIT_NOFILE minus 100 are capped.
    #[arg(
        long,
        value_name = "N,N,...",
        value_delimiter = ',',
        action = ArgAction::Set,
        default_value = DEFAULT_CONNS,
        value_parser = int_in::<usize>(1..),
    )]
    conns: Vec<usize>,
    /// Repetitions; tables show the best, and the median in parentheses.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = int_in::<usize>(1..))]
    reps: usize,
    /// Where images go (tmpfs: mounted by cr-bench; disk: a fresh dir under
    /// --disk-base).
    #[arg(long, value_name = "tmpfs|disk", default_value = "tmpfs")]
    fs: FsKind,
    /// First server port inside the namespace; every server of the run gets
    /// the next one.
    #[arg(long, value_name = "P", default_value_t = 5000, value_parser = int_in::<u16>(1..30000))]
    port: u16,
    /// Where cr_checkpoint, cr_restart, cr_image and bench_tcp live
    /// (default: the directory of this executable).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// Parent of the on-disk directory.
    #[arg(long, value_name = "DIR", default_value = "/var/tmp")]
    disk_base: PathBuf,
}

fn nofile() -> (u64, u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid out-parameter.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
    }
    (l.rlim_cur, l.rlim_max)
}

/// The counts that fit in the hard RLIMIT_NOFILE (each workload holds N
/// sockets), and notes on those capped.
fn plan_counts(o: &TcpOpts) -> (Vec<usize>, Vec<String>) {
    let (_, hard) = nofile();
    let cap = (hard as usize).saturating_sub(MARGIN);
    let mut notes = Vec::new();
    let mut out = Vec::new();
    for &n in &o.conns {
        let m = if n > cap {
            notes.push(format!(
                "N={n} capped to {cap}: the hard RLIMIT_NOFILE is {hard} (each side holds N \
                 sockets), minus a margin of {MARGIN}"
            ));
            cap
        } else {
            n
        };
        if m > 0 && !out.contains(&m) {
            out.push(m);
        }
    }
    (out, notes)
}

fn mono_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-parameter.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Runs a short helper command (untimed), returning its stdout; Err with
/// its stderr if it fails.
fn run_cmd(prog: &str, args: &[&str]) -> Res<String> {
    let mut cmd = Command::new(prog);
    cmd.args(args).stdin(Stdio::null());
    only_std_fds(&mut cmd);
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {prog}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{prog} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

// ---------------------------------------------------------------------------
// The network namespace
// ---------------------------------------------------------------------------

const NS_PREFIX: &str = "cr-bench-tcp-";

/// `ip netns add cr-bench-tcp-PID` with lo up; `ip netns del` on drop.
struct Netns {
    name: String,
    path: String,
    somaxconn: Option<u32>,
}

impl Netns {
    fn new() -> Res<Netns> {
        // Namespaces of cr-bench runs that were killed.
        if let Ok(rd) = fs::read_dir("/run/netns") {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(pid) = name
                    .strip_prefix(NS_PREFIX)
                    .and_then(|p| p.parse::<i32>().ok())
                else {
                    continue;
                };
                if pid > 0 && !proc_exists(pid) {
                    eprintln!("cr-bench tcp: removing stale namespace {name}");
                    let _ = run_cmd("ip", &["netns", "del", &name]);
                }
            }
        }
        let name = format!("{NS_PREFIX}{}", std::process::id());
        run_cmd("ip", &["netns", "add", &name])?;
        let mut ns = Netns {
            path: format!("/run/netns/{name}"),
            name,
            somaxconn: None,
        };
        run_cmd("ip", &["-n", &ns.name, "link", "set", "lo", "up"])?;
        // So that a burst of connects never finds the accept queue full
        // (a dropped SYN costs a 1 s retransmit). Only in our namespace.
        let set = format!("net.core.somaxconn={SOMAXCONN}");
        match run_cmd(
            "nsenter",
            &[&format!("--net={}", ns.path), "sysctl", "-qw", &set],
        ) {
            Ok(_) => ns.somaxconn = Some(SOMAXCONN),
            Err(e) => eprintln!("cr-bench tcp: warning: {e}"),
        }
        if ns.somaxconn.is_none() {
            ns.somaxconn = run_cmd(
                "nsenter",
                &[
                    &format!("--net={}", ns.path),
                    "cat",
                    "/proc/sys/net/core/somaxconn",
                ],
            )
            .ok()
            .and_then(|s| s.trim().parse().ok());
        }
        Ok(ns)
    }

    /// nft tables in the namespace, as "family name".
    fn nft_tables(&self) -> Res<Vec<String>> {
        let out = run_cmd(
            "nsenter",
            &[&format!("--net={}", self.path), "nft", "list", "tables"],
        )?;
        Ok(out
            .lines()
            .filter_map(|l| l.trim().strip_prefix("table "))
            .map(|t| t.trim().to_string())
            .collect())
    }

    /// Deletes every nft table in the namespace (only ours: cr-bench made it).
    fn drop_tables(&self, tables: &[String]) {
        for t in tables {
            let mut args = vec![
                format!("--net={}", self.path),
                "nft".into(),
                "delete".into(),
            ];
            args.push("table".into());
            args.extend(t.split_whitespace().map(String::from));
            let a: Vec<&str> = args.iter().map(String::as_str).collect();
            if let Err(e) = run_cmd("nsenter", &a) {
                eprintln!("cr-bench tcp: warning: {e}");
            }
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = run_cmd("ip", &["netns", "del", &self.name]) {
            eprintln!("cr-bench tcp: warning: {e}");
        }
    }
}

// ---------------------------------------------------------------------------
// Workloads
// ---------------------------------------------------------------------------

type Bins = crate::Tools;

/// The client workload: commands on its stdin, replies read by a thread.
struct Client {
    guard: ProcGuard,
    stdin: ChildStdin,
    rx: Receiver<String>,
    err: PathBuf,
}

impl Client {
    fn send(&mut self, line: &str) -> Res<()> {
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|_| self.stdin.flush())
            .map_err(|e| {
                format!(
                    "client: write {line:?}: {e}; stderr: {}",
                    file_tail(&self.err, 400)
                )
            })
    }

    /// The next line, within `timeout`.
    fn line(&mut self, timeout: Duration) -> Res<String> {
        let t0 = Instant::now();
        loop {
            check_interrupted()?;
            match self.rx.recv_timeout(Duration::from_millis(100)) {
                Ok(l) => return Ok(l),
                Err(RecvTimeoutError::Timeout) => {
                    if t0.elapsed() > timeout {
                        return Err(format!("client: no answer in {} s", timeout.as_secs()));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(format!(
                        "client exited; stderr: {}",
                        file_tail(&self.err, 600)
                    ))
                }
            }
        }
    }

    /// The first line starting with one of `want`; FAIL, PINGFAIL and ERROR
    /// lines are errors.
    fn expect(&mut self, want: &[&str], timeout: Duration) -> Res<String> {
        let t0 = Instant::now();
        loop {
            let left = timeout.saturating_sub(t0.elapsed());
            let l = self.line(left)?;
            if want.iter().any(|p| l.starts_with(p)) {
                return Ok(l);
            }
            if l.starts_with("FAIL") || l.starts_with("PINGFAIL") || l.starts_with("ERROR") {
                return Err(format!("client: {l}"));
            }
        }
    }

    /// After `STOP`: `PINGS K`, K lines `SEQ SEND_NS RECV_NS`, `END`.
    fn pings(&mut self, timeout: Duration) -> Res<Vec<(u64, u64)>> {
        let head = self.expect(&["PINGS "], timeout)?;
        let k: usize = head[6..]
            .trim()
            .parse()
            .map_err(|_| format!("client: bad line {head:?}"))?;
        let mut v = Vec::with_capacity(k);
        for _ in 0..k {
            let l = self.line(Duration::from_secs(10))?;
            let w: Vec<u64> = l
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            if w.len() != 3 {
                return Err(format!("client: bad ping line {l:?}"));
            }
            v.push((w[1], w[2]));
        }
        let end = self.line(Duration::from_secs(10))?;
        if end != "END" {
            return Err(format!("client: {end:?} instead of END"));
        }
        Ok(v)
    }

    fn quit(mut self) -> Res<()> {
        let _ = self.send("QUIT");
        let _ = wait_gone(self.guard.pid, Duration::from_secs(2));
        self.guard.finish()
    }
}

/// A line of the file `out` starting with one of `prefixes` (after `skip`
/// lines); fails when our child `pid` exits without printing one.
fn file_line(
    out: &Path,
    err: &Path,
    prefixes: &[&str],
    pid: i32,
    timeout: Duration,
) -> Res<String> {
    let t0 = Instant::now();
    loop {
        check_interrupted()?;
        let s = fs::read_to_string(out).unwrap_or_default();
        let complete = &s[..s.rfind('\n').map_or(0, |i| i + 1)];
        for l in complete.lines() {
            if prefixes.iter().any(|p| l.starts_with(p)) {
                return Ok(l.to_string());
            }
            if l.starts_with("FAIL") {
                return Err(format!("server: {l}"));
            }
        }
        let mut st = 0;
        // SAFETY: non-blocking waitpid on our own child.
        if unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) } == pid {
            return Err(format!(
                "server pid {pid} ended ({}) without {prefixes:?}; stderr: {}",
                describe_status(st),
                file_tail(err, 400)
            ));
        }
        if t0.elapsed() > timeout {
            return Err(format!("server pid {pid} printed no {prefixes:?} in time"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The number after `key` in `s`.
fn num_after(s: &str, key: &str) -> Option<f64> {
    let rest = &s[s.find(key)? + key.len()..];
    rest.split(|c: char| c.is_whitespace() || c == ',' || c == ':')
        .next()?
        .parse()
        .ok()
}

/// A server and its client, connected, queues filled.
struct Pair {
    server: ProcGuard,
    spid: i32,
    client: Client,
    /// Client before its first connect, server after its last accept
    /// (CLOCK_MONOTONIC, ns), and the client after its last connect.
    t0: u64,
    t_accepted: u64,
    t_connected: u64,
}

impl Pair {
    fn establish_s(&self) -> f64 {
        self.t_accepted
            .max(self.t_connected)
            .saturating_sub(self.t0) as f64
            / 1e9
    }
}

fn workload_cmd(bins: &Bins, ns: &Netns, role: &str, port: u16, n: usize) -> Command {
    let mut cmd = Command::new(&bins.workload);
    only_std_fds(&mut cmd);
    cmd.arg("--netns")
        .arg(&ns.path)
        .arg(role)
        .arg(port.to_string())
        .arg(n.to_string());
    cmd
}

fn setup(bins: &Bins, ns: &Netns, dir: &Path, n: usize, port: u16) -> Res<Pair> {
    let create = |p: PathBuf| File::create(&p).map_err(|e| format!("{}: {e}", p.display()));
    let (sout, serr) = (dir.join("server.out"), dir.join("server.err"));
    let child = workload_cmd(bins, ns, "server", port, n)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(create(sout.clone())?)
        .stderr(create(serr.clone())?)
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bins.workload.display()))?;
    let spid = child.id() as i32;
    drop(child); // reaped by hand, never through std
    let server = ProcGuard::new(spid);
    file_line(&sout, &serr, &["LISTENING"], spid, Duration::from_secs(30))?;

    let cerr = dir.join("client.err");
    let mut child = workload_cmd(bins, ns, "client", port, n)
        .current_dir(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(create(cerr.clone())?)
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", bins.workload.display()))?;
    let guard = ProcGuard::new(child.id() as i32);
    let stdin = child.stdin.take().ok_or("client stdin")?;
    let stdout = child.stdout.take().ok_or("client stdout")?;
    drop(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines() {
            let Ok(l) = l else { break };
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut client = Client {
        guard,
        stdin,
        rx,
        err: cerr,
    };
    let c = client.expect(&["CONNECTED "], Duration::from_secs(330))?;
    let r = file_line(&sout, &serr, &["READY "], spid, Duration::from_secs(330))?;
    let t0 = num_after(&c, "t0=").ok_or_else(|| format!("bad line {c:?}"))? as u64;
    let t_connected = num_after(&c, "t1=").ok_or_else(|| format!("bad line {c:?}"))? as u64;
    let t_accepted = num_after(&r, "t_accepted=").ok_or_else(|| format!("bad line {r:?}"))? as u64;
    Ok(Pair {
        server,
        spid,
        client,
        t0,
        t_accepted,
        t_connected,
    })
}

// ---------------------------------------------------------------------------
// References and image facts
// ---------------------------------------------------------------------------

/// The plainest look at every TCP socket of `pid` from outside: one
/// pidfd_getfd + getsockopt(TCP_INFO) + close per socket (the socket fds
/// are listed before the timing). Returns (seconds, established, listening).
fn getfd_loop(pid: i32) -> Res<(f64, usize, usize)> {
    let dir = format!("/proc/{pid}/fd");
    let mut fds = Vec::new();
    for e in fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))? {
        let e = e.map_err(|e| format!("{dir}: {e}"))?;
        let Ok(fd) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:[")) {
            fds.push(fd);
        }
    }
    fds.sort_unstable();
    let t0 = Instant::now();
    // SAFETY: pidfd_open(2) with integer arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    if pidfd < 0 {
        return Err(crate::os_err(format!("pidfd_open {pid}")));
    }
    let (mut est, mut lis) = (0, 0);
    let mut res = Ok(());
    for &fd in &fds {
        // SAFETY: pidfd_getfd(2) with integer arguments.
        let s = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) } as i32;
        if s < 0 {
            res = Err(crate::os_err(format!("pidfd_getfd {pid} fd {fd}")));
            break;
        }
        // SAFETY: a zeroed tcp_info is a valid out-parameter.
        let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        // SAFETY: `info` is writable for `len` bytes.
        let r = unsafe {
            libc::getsockopt(
                s,
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                (&mut info as *mut libc::tcp_info).cast(),
                &mut len,
            )
        };
        if r != 0 {
            res = Err(crate::os_err(format!("TCP_INFO of {pid} fd {fd}")));
        }
        // SAFETY: closing the copy we own.
        unsafe { libc::close(s) };
        if res.is_err() {
            break;
        }
        match info.tcpi_state {
            1 => est += 1,
            10 => lis += 1,
            _ => {}
        }
    }
    // SAFETY: closing the pidfd we own.
    unsafe { libc::close(pidfd) };
    res?;
    Ok((t0.elapsed().as_secs_f64(), est, lis))
}

/// (established connections, send queue, unsent, receive queue bytes) in
/// the image, from `cr_image show --json`.
fn image_queues(bins: &Bins, img: &Path) -> Res<[u64; 4]> {
    let out = run_cmd(
        &bins.image.to_string_lossy(),
        &["show", "--json", &img.to_string_lossy()],
    )?;
    let doc = json::parse(&out, "cr_image show --json")?;
    let sum = |key: &str| -> (u64, u64) {
        let v: Vec<u64> = json::all(&doc, key)
            .into_iter()
            .filter_map(serde_json::Value::as_u64)
            .collect();
        (v.len() as u64, v.iter().sum())
    };
    let (conns, sendq) = sum("send_queue_bytes");
    Ok([
        conns,
        sendq,
        sum("unsent_bytes").1,
        sum("recv_queue_bytes").1,
    ])
}

// ---------------------------------------------------------------------------
// One run
// ---------------------------------------------------------------------------

#[derive(Default, Clone)]
struct Sample {
    /// Client's first connect to the later of its last connect and the
    /// server's last accept.
    establish_s: Option<f64>,
    getfd_s: Option<f64>,
    // Checkpoint, the server continues.
    cont_s: Option<f64>,
    cont_frozen_s: Option<f64>,
    cont_image: Option<u64>,
    cont_rss_kib: Option<u64>,
    /// Longest gap between consecutive echoes on connection 0 overlapping
    /// the cr_checkpoint run; median RTT and longest gap outside it.
    pause_ms: Option<f64>,
    rtt_ms: Option<f64>,
    gap_out_ms: Option<f64>,
    // Checkpoint --kill.
    kill_s: Option<f64>,
    kill_frozen_s: Option<f64>,
    kill_image: Option<u64>,
    kill_rss_kib: Option<u64>,
    /// Established connections, send queue, unsent, receive queue bytes.
    queues: Option<[u64; 4]>,
    // Restore, then every connection answers.
    restore_s: Option<f64>,
    unverified_restore_s: Option<f64>,
    restore_rss_kib: Option<u64>,
    same_pid: Option<bool>,
    answered_s: Option<f64>,
    /// Some(Ok) or Some(Err(the CHECK FAIL line)).
    verified: Option<Result<(), String>>,
    /// Same check on a pair never checkpointed (rep 1): answered seconds.
    control: Option<Result<f64, String>>,
    /// nft tables found in the namespace after the rep (then deleted).
    lock_left: Option<String>,
    error: Option<String>,
}

/// Ping figures from (send, recv) pairs and the cr_checkpoint window [a, b].
fn ping_stats(v: &[(u64, u64)], a: u64, b: u64) -> (Option<f64>, Option<f64>, Option<f64>) {
    let v = &v[PINGS_SKIP.min(v.len())..];
    let ms = |ns: u64| ns as f64 / 1e6;
    let (mut pause, mut gap_out) = (None::<u64>, None::<u64>);
    for w in v.windows(2) {
        let (r0, r1) = (w[0].1, w[1].1);
        let g = r1.saturating_sub(r0);
        if r1 > a && r0 < b {
            pause = Some(pause.map_or(g, |p| p.max(g)));
        } else {
            gap_out = Some(gap_out.map_or(g, |p| p.max(g)));
        }
    }
    let mut rtts: Vec<u64> = v
        .iter()
        .filter(|(s, r)| *r < a || *s > b)
        .map(|(s, r)| r.saturating_sub(*s))
        .collect();
    rtts.sort_unstable();
    let rtt = (!rtts.is_empty()).then(|| ms(rtts[rtts.len() / 2]));
    (pause.map(ms), rtt, gap_out.map(ms))
}

/// nft tables left in the namespace: noted in the sample, then deleted so
/// that the next repetition starts clean.
fn sweep_locks(ns: &Netns, s: &mut Sample, when: &str) {
    // cr_restart's reset guard stays on purpose (its elements expire).
    let guard = format!("inet {RESET_GUARD_TABLE}");
    match ns
        .nft_tables()
        .map(|v| v.into_iter().filter(|t| *t != guard).collect::<Vec<_>>())
    {
        Ok(t) if !t.is_empty() => {
            let note = format!("{when}: {}", t.join(", "));
            s.lock_left = Some(match s.lock_left.take() {
                Some(prev) => format!("{prev}; {note}"),
                None => note,
            });
            ns.drop_tables(&t);
        }
        Ok(_) => {}
        Err(e) => eprintln!("cr-bench tcp: warning: {e}"),
    }
}

#[allow(clippy::too_many_arguments)]
fn run_one(
    bins: &Bins,
    target: &Target,
    ns: &Netns,
    n: usize,
    rep: usize,
    port: &mut u16,
    s: &mut Sample,
) -> Res<()> {
    let run_dir = target.dir.join(format!("tcp-{n}-{rep}"));
    let _ = fs::remove_dir_all(&run_dir);
    fs::create_dir(&run_dir).map_err(|e| format!("{}: {e}", run_dir.display()))?;
    let _dir_guard = DirGuard(run_dir.clone());
    sweep_locks(ns, s, "before the run");

    // --- control: the check passes without any checkpoint ---
    if rep == 0 {
        let dir = run_dir.join("control");
        fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        *port += 1;
        let mut p = setup(bins, ns, &dir, n, *port)?;
        p.client.send("CHECK")?;
        let l = p.client.expect(&["CHECK "], Duration::from_secs(330))?;
        s.control = Some(if l.starts_with("CHECK OK") {
            Ok(num_after(&l, "answered_s=").unwrap_or(f64::NAN))
        } else {
            Err(l.clone())
        });
        p.server.finish()?;
        p.client.quit()?;
        reap_strays();
        if !l.starts_with("CHECK OK") {
            return Err(format!("the check fails without any checkpoint: {l}"));
        }
    }

    // --- the pair ---
    check_interrupted()?;
    *port += 1;
    let Pair {
        server: mut workload,
        spid,
        mut client,
        ..
    } = {
        let p = setup(bins, ns, &run_dir, n, *port)?;
        s.establish_s = Some(p.establish_s());
        p
    };

    // --- reference: pidfd_getfd + TCP_INFO of every socket ---
    let (g, est, lis) = getfd_loop(spid)?;
    if est != n || lis != 1 {
        return Err(format!(
            "the server has {est} established and {lis} listening sockets, expected {n} and 1"
        ));
    }
    s.getfd_s = Some(g);

    // --- checkpoint, the server continues; the client pings ---
    check_interrupted()?;
    client.send(&format!("PING {PINGS_AROUND}"))?;
    client.expect(&["WARM"], Duration::from_secs(60))?;
    let img1 = run_dir.join("img-continue");
    let (out, err) = (run_dir.join("ck1.out"), run_dir.join("ck1.err"));
    let mut cmd = Command::new(&bins.checkpoint);
    cmd.arg("--dir").arg(&img1).arg(spid.to_string());
    settle(&run_dir);
    let a = mono_ns();
    let t = run_timed(cmd, &out, &err);
    let b = mono_ns();
    client.send(&format!("STOP {PINGS_AROUND}"))?;
    let pings = client.pings(Duration::from_secs(660))?;
    let t = t?;
    let printed = tool_ok(&t, "cr_checkpoint", &out, &err)?;
    if !proc_exists(spid) || proc_state(spid) == Some('Z') {
        return Err("the server is gone after a checkpoint that lets it continue".into());
    }
    s.cont_s = Some(t.secs);
    s.cont_rss_kib = Some(t.maxrss_kib);
    s.cont_frozen_s = num_after(&printed, "frozen ");
    s.cont_image = Some(dir_bytes(&img1));
    (s.pause_ms, s.rtt_ms, s.gap_out_ms) = ping_stats(&pings, a, b);

    // --- checkpoint --kill ---
    check_interrupted()?;
    let img2 = run_dir.join("img-kill");
    let (out, err) = (run_dir.join("ck2.out"), run_dir.join("ck2.err"));
    let mut cmd = Command::new(&bins.checkpoint);
    cmd.arg("--kill")
        .arg("--dir")
        .arg(&img2)
        .arg(spid.to_string());
    settle(&run_dir);
    let t = run_timed(cmd, &out, &err)?;
    let printed = tool_ok(&t, "cr_checkpoint --kill", &out, &err)?;
    if !wait_gone(spid, Duration::from_secs(5)) {
        return Err(format!(
            "cr_checkpoint --kill exited 0 but left pid {spid} alive"
        ));
    }
    workload.finish()?;
    s.kill_s = Some(t.secs);
    s.kill_rss_kib = Some(t.maxrss_kib);
    s.kill_frozen_s = num_after(&printed, "frozen ");
    s.kill_image = Some(dir_bytes(&img2));
    match image_queues(bins, &img2) {
        Ok(q) => s.queues = Some(q),
        Err(e) => eprintln!("cr-bench tcp: warning: {e}"),
    }

    // --- restore ---
    check_interrupted()?;
    let mut cmd = Command::new(&bins.restart);
    cmd.arg("--detach").arg("--netns").arg(&ns.name).arg(&img2);
    let (t, mut restored, new_pid) = match crate::restore_detached(cmd, &run_dir, spid, "bench_tcp")
    {
        Ok(r) => r,
        Err(e) => {
            // The image's network lock is still in the namespace.
            let _ = run_cmd(
                "nsenter",
                &[
                    &format!("--net={}", ns.path),
                    &bins.image.to_string_lossy(),
                    "unlock",
                    &img2.to_string_lossy(),
                ],
            );
            return Err(e);
        }
    };
    s.restore_rss_kib = Some(t.maxrss_kib);
    s.same_pid = Some(new_pid == spid);

    // --- every connection answers ---
    check_interrupted()?;
    client.send("CHECK")?;
    let l = client.expect(&["CHECK "], Duration::from_secs(330))?;
    if l.starts_with("CHECK OK") {
        s.restore_s = Some(t.secs);
        s.answered_s = num_after(&l, "answered_s=");
        s.verified = Some(Ok(()));
    } else {
        s.unverified_restore_s = Some(t.secs);
        s.verified = Some(Err(l));
    }
    sweep_locks(ns, s, "after the restore");
    restored.finish()?;
    client.quit()?;
    reap_strays();
    Ok(())
}

// ---------------------------------------------------------------------------
// Output
// ---------------------------------------------------------------------------

struct Row {
    n: usize,
    samples: Vec<Sample>,
}

impl Row {
    fn vals(&self, f: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
        let mut v: Vec<f64> = self.samples.iter().filter_map(f).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v
    }

    fn best(&self, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        self.vals(f).first().copied()
    }

    fn median(&self, f: impl Fn(&Sample) -> Option<f64>) -> Option<f64> {
        let v = self.vals(f);
        if v.is_empty() {
            return None;
        }
        let m = v.len() / 2;
        Some(if v.len() % 2 == 1 {
            v[m]
        } else {
            (v[m - 1] + v[m]) / 2.0
        })
    }

    fn max_u(&self, f: impl Fn(&Sample) -> Option<u64>) -> Option<u64> {
        self.samples.iter().filter_map(f).max()
    }
}

type Get = fn(&Sample) -> Option<f64>;

/// "best" or, with several reps, "best (median)".
fn cell(r: &Row, reps: usize, prec: usize, f: impl Fn(&Sample) -> Option<f64> + Copy) -> String {
    let b = fmt_opt(r.best(f), prec);
    if reps > 1 {
        format!("{b} ({})", fmt_opt(r.median(f), prec))
    } else {
        b
    }
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn times(x: Option<f64>) -> String {
    match x {
        Some(x) if x.is_finite() && x > 0.0 => {
            if x >= 10.0 {
                format!("{x:.0}×")
            } else {
                format!("{x:.1}×")
            }
        }
        _ => "n/a".into(),
    }
}

fn us_per(secs: Option<f64>, n: usize) -> Option<f64> {
    secs.map(|s| s * 1e6 / n as f64)
}

fn marginal(a: Option<f64>, b: Option<f64>, na: usize, nb: usize) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if nb > na => Some((b - a) * 1e6 / (nb - na) as f64),
        _ => None,
    }
}

fn mib(b: Option<u64>) -> String {
    fmt_opt(b.map(|b| b as f64 / (1 << 20) as f64), 2)
}

fn markdown(rows: &[Row], o: &TcpOpts, target: &Target, ns: &Netns, notes: &[String]) -> String {
    let mut out = String::new();
    let (soft, hard) = nofile();
    let reps = o.reps;
    let _ = writeln!(out, "# cr-bench tcp results\n");
    let _ = writeln!(
        out,
        "kernel {}, {} CPUs, reps {}{}.",
        kernel_release(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        reps,
        if reps > 1 {
            " (cells: best (median))"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "- network namespace {} made by cr-bench (lo only, net.core.somaxconn {}); server \
         and client are bench_tcp on 127.0.0.1 in it",
        ns.name,
        ns.somaxconn.map_or("?".into(), |v| v.to_string())
    );
    let _ = writeln!(
        out,
        "- every connection: {S2C} bytes written by the server and left unread by the client \
         (client SO_RCVBUF {CLIENT_RCVBUF}, so part of them stays in the server's send \
         queue), {C2S} bytes written by the client and left unread by the server"
    );
    let _ = writeln!(
        out,
        "- images: {} ({}){}; `cr_checkpoint --dir D PID`, `cr_checkpoint --kill --dir D \
         PID`, `cr_restart --detach --netns NS D` (fsync on{})",
        target.dir.display(),
        target.fs_type,
        if target.mounted {
            ", mounted by cr-bench"
        } else {
            ""
        },
        if target.fs_type == "tmpfs" {
            ", a no-op on tmpfs"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "- RLIMIT_NOFILE of cr-bench: soft {soft}, hard {hard}; the workloads raise their \
         soft limit to the hard one"
    );
    for n in notes {
        let _ = writeln!(out, "- {n}");
    }
    let _ = writeln!(out);

    // Checkpoint, process continues.
    let _ = writeln!(
        out,
        "## Checkpoint, the server continues (`cr_checkpoint --dir D PID`)\n"
    );
    let _ = writeln!(
        out,
        "Peer pause: the longest gap between two consecutive echoes on connection 0 \
         (pinged every ~1 ms, one ping in flight) that overlaps the cr_checkpoint run. \
         Outside: the median RTT and the longest gap between echoes before and after it.\n"
    );
    let _ = writeln!(
        out,
        "| N | dump s | frozen s | image MiB | peer pause max ms | RTT outside ms (median) \
         | gap outside max ms | dump µs/conn | frozen µs/conn |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.n,
            cell(r, reps, 3, |s| s.cont_s),
            cell(r, reps, 3, |s| s.cont_frozen_s),
            mib(r.max_u(|s| s.cont_image)),
            cell(r, reps, 1, |s| s.pause_ms),
            cell(r, reps, 3, |s| s.rtt_ms),
            cell(r, reps, 1, |s| s.gap_out_ms),
            fmt_opt(us_per(r.best(|s| s.cont_s), r.n), 1),
            fmt_opt(us_per(r.best(|s| s.cont_frozen_s), r.n), 1),
        );
    }
    let _ = writeln!(out);

    // Checkpoint --kill.
    let _ = writeln!(
        out,
        "## Checkpoint --kill (`cr_checkpoint --kill --dir D PID`, network lock)\n"
    );
    let _ = writeln!(
        out,
        "| N | dump s | frozen s | image MiB | conns in image | send queue KiB | of it \
         unsent KiB | recv queue KiB | dump µs/conn | frozen µs/conn |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let q = r.samples.iter().rev().find_map(|s| s.queues);
        let kib = |i: usize| fmt_opt(q.map(|q| q[i] as f64 / 1024.0), 0);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.n,
            cell(r, reps, 3, |s| s.kill_s),
            cell(r, reps, 3, |s| s.kill_frozen_s),
            mib(r.max_u(|s| s.kill_image)),
            q.map_or("n/a".into(), |q| q[0].to_string()),
            kib(1),
            kib(2),
            kib(3),
            fmt_opt(us_per(r.best(|s| s.kill_s), r.n), 1),
            fmt_opt(us_per(r.best(|s| s.kill_frozen_s), r.n), 1),
        );
    }
    let _ = writeln!(out);

    // Restore.
    let _ = writeln!(
        out,
        "## Restore (`cr_restart --detach --netns NS D`), then every connection answers\n"
    );
    let _ = writeln!(
        out,
        "answered: from the client's CHECK (right after cr_restart returned) until all N \
         connections returned their queued bytes and the echo of a new ping, every byte \
         compared. The same check on a pair never checkpointed (first rep) is the \
         reference.\n"
    );
    let _ = writeln!(
        out,
        "| N | restore s | answered ms | restore + answered s | answered, no checkpoint ms \
         | restore µs/conn | verified | same pid |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---|---|");
    for r in rows {
        let all = |f: fn(&Sample) -> Option<bool>| {
            let v: Vec<bool> = r.samples.iter().filter_map(f).collect();
            if v.is_empty() {
                "n/a".to_string()
            } else if v.iter().all(|&b| b) {
                "yes".to_string()
            } else {
                format!("NO ({}/{} ok)", v.iter().filter(|&&b| b).count(), v.len())
            }
        };
        let verified = {
            let v: Vec<bool> = r
                .samples
                .iter()
                .filter_map(|s| s.verified.as_ref().map(|v| v.is_ok()))
                .collect();
            if v.is_empty() {
                "n/a".to_string()
            } else if v.iter().all(|&b| b) {
                "OK".to_string()
            } else {
                format!("FAIL ({}/{} ok)", v.iter().filter(|&&b| b).count(), v.len())
            }
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.n,
            cell(r, reps, 3, |s| s.restore_s),
            cell(r, reps, 2, |s| s.answered_s.map(|x| x * 1e3)),
            cell(r, reps, 3, |s| s
                .restore_s
                .zip(s.answered_s)
                .map(|(a, b)| a + b)),
            cell(r, reps, 2, |s| s
                .control
                .as_ref()
                .and_then(|c| c.clone().ok())
                .map(|x| x * 1e3)),
            fmt_opt(us_per(r.best(|s| s.restore_s), r.n), 1),
            verified,
            all(|s| s.same_pid),
        );
    }
    let _ = writeln!(out);

    // The machine's reference.
    let _ = writeln!(out, "## The machine's own reference\n");
    let _ = writeln!(
        out,
        "establish: from the client's first connect to the later of its last connect and \
         the server's last accept (the two run at the same time). getfd: one \
         pidfd_getfd + getsockopt(TCP_INFO) + close per socket of the running server, \
         from outside.\n"
    );
    let _ = writeln!(
        out,
        "| N | establish ms | getfd+TCP_INFO ms | establish µs/conn | getfd µs/conn \
         | kill dump ÷ getfd | frozen (kill) ÷ getfd | restore ÷ establish |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in rows {
        let est = r.best(|s| s.establish_s);
        let g = r.best(|s| s.getfd_s);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.n,
            cell(r, reps, 3, |s| s.establish_s.map(|x| x * 1e3)),
            cell(r, reps, 3, |s| s.getfd_s.map(|x| x * 1e3)),
            fmt_opt(us_per(est, r.n), 1),
            fmt_opt(us_per(g, r.n), 2),
            times(ratio(r.best(|s| s.kill_s), g)),
            times(ratio(r.best(|s| s.kill_frozen_s), g)),
            times(ratio(r.best(|s| s.restore_s), est)),
        );
    }
    let _ = writeln!(out);

    // Growth.
    if rows.len() > 1 {
        let _ = writeln!(out, "## Growth with N\n");
        let _ = writeln!(
            out,
            "From one N to the next: ×t is the ratio of the best times (linear cost: ×t ≈ \
             ×N); µs/conn is the marginal cost Δt/ΔN, flat for a linear cost, without the \
             fixed costs.\n"
        );
        let cols: [(&str, Get); 8] = [
            ("establish", |s| s.establish_s),
            ("getfd", |s| s.getfd_s),
            ("dump", |s| s.cont_s),
            ("frozen", |s| s.cont_frozen_s),
            ("kill dump", |s| s.kill_s),
            ("kill frozen", |s| s.kill_frozen_s),
            ("restore", |s| s.restore_s),
            ("answered", |s| s.answered_s),
        ];
        let mut h = String::from("| N | ×N |");
        let mut sep = String::from("|---|---:|");
        for (name, _) in &cols {
            let _ = write!(h, " {name} ×t |");
            sep.push_str("---:|");
        }
        for (name, _) in &cols {
            let _ = write!(h, " {name} µs/conn |");
            sep.push_str("---:|");
        }
        let _ = writeln!(out, "{h}\n{sep}");
        for w in rows.windows(2) {
            let (a, b) = (&w[0], &w[1]);
            let mut line = format!("| {}→{} | {:.0} |", a.n, b.n, b.n as f64 / a.n as f64);
            for (_, f) in &cols {
                let _ = write!(line, " {} |", fmt_opt(ratio(b.best(f), a.best(f)), 1));
            }
            for (_, f) in &cols {
                let _ = write!(
                    line,
                    " {} |",
                    fmt_opt(marginal(a.best(f), b.best(f), a.n, b.n), 1)
                );
            }
            let _ = writeln!(out, "{line}");
        }
        let _ = writeln!(out);
    }

    // Tools.
    let _ = writeln!(
        out,
        "| N | dump peak RSS MiB | kill dump peak RSS MiB | restore peak RSS MiB | nft lock \
         left | control check |"
    );
    let _ = writeln!(out, "|---:|---:|---:|---:|---|---|");
    for r in rows {
        let rss = |f: fn(&Sample) -> Option<u64>| fmt_opt(r.max_u(f).map(|k| k as f64 / 1024.0), 1);
        let left = if r.samples.iter().any(|s| s.lock_left.is_some()) {
            "YES"
        } else {
            "no"
        };
        let control = match r.samples.first().and_then(|s| s.control.as_ref()) {
            Some(Ok(_)) => "OK",
            Some(Err(_)) => "FAIL",
            None => "n/a",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.n,
            rss(|s| s.cont_rss_kib),
            rss(|s| s.kill_rss_kib),
            rss(|s| s.restore_rss_kib),
            left,
            control,
        );
    }
    let _ = writeln!(out);

    let mut problems = Vec::new();
    for r in rows {
        for (i, s) in r.samples.iter().enumerate() {
            let at = format!("N={} rep {}", r.n, i + 1);
            if let Some(e) = &s.error {
                problems.push(format!("- {at}: {e}"));
            }
            if let Some(Err(e)) = &s.verified {
                problems.push(format!(
                    "- {at}: after the restore ({} s, not counted): {e}",
                    fmt_opt(s.unverified_restore_s, 3)
                ));
            }
            if let Some(Err(e)) = &s.control {
                problems.push(format!("- {at}: control: {e}"));
            }
            if let Some(l) = &s.lock_left {
                problems.push(format!("- {at}: nft tables left in the namespace ({l})"));
            }
            if let Some(q) = s.queues {
                if q[0] != r.n as u64 {
                    problems.push(format!(
                        "- {at}: the --kill image holds {} established connections, the \
                   server had {}",
                        q[0], r.n
                    ));
                }
            }
        }
    }
    if !problems.is_empty() {
        let _ = writeln!(out, "## errors\n");
        for p in problems {
            let _ = writeln!(out, "{p}");
        }
    }
    out
}

// ---------------------------------------------------------------------------
// main
// ---------------------------------------------------------------------------

fn find_bins(o: &TcpOpts) -> Res<Bins> {
    crate::find_tools(o.bin_dir.as_deref(), "bench_tcp")
}

/// `cr-bench tcp ...`
pub fn main(o: TcpOpts) -> Res<()> {
    let bins = find_bins(&o)?;
    install_signal_handlers();
    crate::become_subreaper();
    let (counts, notes) = plan_counts(&o);
    for n in &notes {
        eprintln!("cr-bench tcp: {n}");
    }
    if counts.is_empty() {
        return Err("no connection count fits the RLIMIT_NOFILE hard limit".into());
    }
    let target = match o.fs {
        FsKind::Tmpfs => Target::tmpfs(4 * GIB)?,
        FsKind::Disk => Target::disk(&o.disk_base)?,
    };
    let ns = Netns::new()?;
    eprintln!("cr-bench tcp: network namespace {}", ns.name);

    let mut port = o.port;
    let mut rows = Vec::new();
    'outer: for &n in &counts {
        let mut row = Row {
            n,
            samples: Vec::new(),
        };
        for rep in 0..o.reps {
            eprintln!("cr-bench tcp: N={n}, rep {}/{} ...", rep + 1, o.reps);
            let mut s = Sample::default();
            if let Err(e) = run_one(&bins, &target, &ns, n, rep, &mut port, &mut s) {
                eprintln!("cr-bench tcp:   error: {e}");
                s.error = Some(e);
                sweep_locks(&ns, &mut s, "after the error");
            }
            if let Some(Err(e)) = &s.verified {
                eprintln!("cr-bench tcp:   after the restore: {e}");
            }
            reap_strays();
            row.samples.push(s);
            if INTERRUPTED.load(Ordering::SeqCst) {
                rows.push(row);
                break 'outer;
            }
        }
        rows.push(row);
    }
    let out = markdown(&rows, &o, &target, &ns, &notes);
    drop(ns);
    drop(target); // unmount / remove before printing the result
    let mut so = io::stdout().lock();
    let _ = so.write_all(out.as_bytes());
    let _ = so.flush();
    if INTERRUPTED.load(Ordering::SeqCst) {
        return Err("interrupted".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{assert_refused, parsed};

    #[test]
    fn command_lines() {
        let o = parsed::<TcpOpts>("tcp");
        assert!(o.conns == [1, 100, 10000] && o.reps == 1 && o.fs == FsKind::Tmpfs);
        assert!(o.port == 5000 && o.bin_dir.is_none());
        assert_eq!(o.disk_base, Path::new("/var/tmp"));
        let o = parsed::<TcpOpts>("tcp --conns 100,1000 --reps 3 --fs disk --port 29999");
        assert!(o.conns == [100, 1000] && o.reps == 3 && o.fs == FsKind::Disk && o.port == 29999);
        assert_refused(&[
            "tcp --conns 0",
            "tcp --port 0",
            "tcp --port 30000",
            "tcp --reps 0",
        ]);
    }
}
