//! Real daemons from Debian and servers written in Go, node and Java,
//! started the way their users start them: plain (a shell daemon that
//! forks away, or a foreground service as systemd runs it) and as a
//! `cr_run` job (PID 1 of its own PID, mount and IPC namespaces). Every
//! test runs the same scenario under a load of concurrent clients over
//! loopback TCP that check every answer:
//!
//! 1. the daemon starts, data is stored, the clients start;
//! 2. a checkpoint that lets it run on (the clients go on);
//! 3. a checkpoint `--kill` and a `cr_restart` (`--detach` for a daemon
//!    that had forked away from its shell) while the clients wait on
//!    their connections (held by the network lock): they go on over the
//!    same connections; then the same again of the restored daemon;
//! 4. the daemon's own checks over new connections: every key read back
//!    (memcached, redis), every file and one access log line per request
//!    (nginx), the server's self-check and exact totals (the counter
//!    servers), `jcmd` on the restored JVM;
//! 5. a clean stop of the restored daemon by its usual signal.
//!
//! The counter servers (tests/workloads/counter_server.go, .js and
//! CounterServer.java, compiled at test time) speak one small HTTP
//! protocol: `/add/KEY/N` answers the key's new value, `/sum` the totals,
//! `/check` the server's own verdict on its state (values adding up, hash
//! chains extended by background threads recomputed).
//!
//! Needs memcached, nginx, redis, golang-go, a JDK and nodejs (tests/run.sh
//! installs them); nothing is skipped. Each test prints one `figures:` line
//! (frozen time of the checkpoint under load, image size, restore time).

use cr_tests::resp::{Reply, Resp};
use cr_tests::*;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Requests the clients must complete in each phase (before, after the
/// checkpoint that lets the daemon run on, after the restore).
const PHASE_REQUESTS: u64 = 2_000;
/// Deadline of one phase, of a daemon's start and of its stop.
const PHASE_TIMEOUT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------
// Load: concurrent clients that check every answer
// ---------------------------------------------------------------------------

/// One client connection of a load.
trait Client: Send + 'static {
    /// One request; Err names what was wrong with the answer.
    fn step(&mut self) -> Result<(), String>;
}

/// Clients run by threads, each in a loop until stopped.
struct Load<C: Client> {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    failed: Arc<Mutex<Option<String>>>,
    threads: Vec<JoinHandle<C>>,
}

impl<C: Client> Load<C> {
    fn start(clients: Vec<C>) -> Load<C> {
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(Mutex::new(None));
        let threads = clients
            .into_iter()
            .enumerate()
            .map(|(i, mut c)| {
                let (stop, done, failed) = (stop.clone(), done.clone(), failed.clone());
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if let Err(e) = c.step() {
                            failed
                                .lock()
                                .expect("failed lock")
                                .get_or_insert(format!("client {i}: {e}"));
                            break;
                        }
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    c
                })
            })
            .collect();
        Load {
            stop,
            done,
            failed,
            threads,
        }
    }

    /// Requests answered (and checked) so far.
    fn requests(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    fn failure(&self) -> Option<String> {
        self.failed.lock().expect("failed lock").clone()
    }

    /// Waits until the clients completed `n` more requests; panics at once
    /// if one of them found a wrong answer.
    fn wait_more(&self, n: u64, what: &str, diag: &dyn Fn() -> String) {
        let target = self.requests() + n;
        wait_until(
            &format!("{n} more checked requests {what}"),
            PHASE_TIMEOUT,
            || {
                if let Some(e) = self.failure() {
                    panic!("a client failed {what}: {e}\n{}", diag());
                }
                self.requests() >= target
            },
            || format!("{} requests done\n{}", self.requests(), diag()),
        );
    }

    /// Stops the clients; returns them (with what they stored), or panics
    /// with the first wrong answer.
    fn finish(mut self, diag: &dyn Fn() -> String) -> Vec<C> {
        self.stop.store(true, Ordering::Relaxed);
        let clients: Vec<C> = self
            .threads
            .drain(..)
            .map(|t| t.join().expect("client thread"))
            .collect();
        if let Some(e) = self.failure() {
            panic!("a client failed: {e}\n{}", diag());
        }
        clients
    }
}

impl<C: Client> Drop for Load<C> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// A connection to 127.0.0.1:PORT with a read timeout (a restore takes
/// seconds, a hang is a failure).
fn connect(port: u16) -> TcpStream {
    let st = TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("connect to 127.0.0.1:{port}: {e}"));
    // A request lost in the outage waits for the client's TCP
    // retransmission (its backoff doubles: 13 s apart after 12 s).
    st.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("set_read_timeout");
    st.set_nodelay(true).expect("nodelay");
    st
}

fn accepts(port: u16) -> bool {
    TcpStream::connect(("127.0.0.1", port)).is_ok()
}

// ---------------------------------------------------------------------------
// How the daemons are run
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Debug)]
enum Mode {
    /// As its users start it, without cr_run.
    Plain,
    /// `cr_run --dir DIR -- DAEMON...` (in the foreground).
    Job,
}

/// What the scenario needs to know of one daemon.
trait Service {
    type Client: Client;
    /// Short name, for messages and image directories.
    fn name(&self) -> &'static str;
    /// Its executable (as /proc/PID/exe shows it).
    fn exe(&self) -> PathBuf;
    /// Arguments to run it in the foreground (systemd-style, and under cr_run).
    fn foreground_args(&self) -> Vec<OsString>;
    /// For a plain daemon that forks away from the shell that started it:
    /// its arguments and the pid file it writes. None: run in the
    /// foreground when plain too.
    fn daemon_args(&self) -> Option<(Vec<OsString>, PathBuf)> {
        None
    }
    /// The loopback port it listens on.
    fn port(&self) -> u16;
    /// Data stored before the load starts.
    fn prefill(&mut self) {}
    /// The clients of the load.
    fn clients(&self) -> Vec<Self::Client>;
    /// Checks of a live daemon (the pid of its main process as seen from
    /// here), before the checkpoints (`restored` false) and after the
    /// restore.
    fn live_check(&self, _pid: i32, _mode: Mode, _restored: bool) {}
    /// The daemon's own checks after the restore, given the clients.
    fn check(&self, clients: &[Self::Client]);
    /// Signal that stops it cleanly, and its exit code then.
    fn stop(&self) -> (i32, i32) {
        (libc::SIGTERM, 0)
    }
    /// Its logs, for panic messages.
    fn diag(&self) -> String {
        String::new()
    }
}

/// A started daemon, plain or under cr_run.
struct Started {
    /// The process to checkpoint: the daemon (plain) or cr_run (job).
    proc: Proc,
    out: PathBuf,
    err: PathBuf,
}

impl Started {
    fn diag(&self) -> String {
        files_diag(&self.out, &self.err)
    }
}

/// The restored daemon.
enum Restored {
    /// A foreground daemon: cr_restart waits for it, as its service
    /// manager would.
    Plain(Restore),
    /// A daemon that had forked away: `cr_restart --detach`, which returns
    /// once it runs (reparented to us, the tests being subreapers).
    Detached(Proc),
    Job(JobRestore),
}

/// Starts `svc` the way `mode` says, in the harness directory (as systemd
/// would in WorkingDirectory), and waits until it accepts connections.
fn start<S: Service>(h: &Harness, svc: &S, mode: Mode) -> Started {
    let exe = svc.exe();
    let in_dir = RunOpts {
        cwd: Some(h.dir.clone()),
        ..RunOpts::default()
    };
    let started = match (mode, svc.daemon_args()) {
        (Mode::Plain, Some((args, pidfile))) => {
            // A shell daemon: the command returns once the daemon forked away
            // (reparented to us, the tests being subreapers).
            let a: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            let out = h.run_tool(
                svc.name(),
                &a,
                &RunOpts {
                    exe: Some(exe.clone()),
                    ..in_dir
                },
            );
            out.assert_success(&format!("{} daemonizing", svc.name()));
            let mut pid = 0;
            wait_until(
                "the daemon's pid file",
                PHASE_TIMEOUT,
                || {
                    pid = read_text(&pidfile).trim().parse().unwrap_or(0);
                    pid > 0
                },
                || out.show(),
            );
            let out_file = h.dir.join(format!("{}.daemon.out", svc.name()));
            std::fs::write(&out_file, &out.stdout).expect("write daemon stdout");
            Started {
                proc: Proc::adopt(pid, svc.name(), None),
                out: out_file.clone(),
                err: out_file,
            }
        }
        (Mode::Plain, None) => {
            let args = svc.foreground_args();
            let a: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            let (proc, out, err, _) = h.start_tool(&exe, &a, &in_dir);
            Started { proc, out, err }
        }
        (Mode::Job, _) => {
            let job_dir = h.image_dir("job");
            let mut a: Vec<OsString> = vec![
                "--dir".into(),
                job_dir.into_os_string(),
                "--".into(),
                exe.clone().into_os_string(),
            ];
            a.extend(svc.foreground_args());
            let a: Vec<&OsStr> = a.iter().map(|a| a.as_os_str()).collect();
            let (proc, out, err, _) = h.start_tool(&tool_path("cr_run"), &a, &in_dir);
            Started { proc, out, err }
        }
    };
    let s = std::cell::RefCell::new(started);
    let what = format!("{} ({mode:?}) to start", svc.name());
    let diag = || format!("{}\n{}", s.borrow().diag(), svc.diag());
    wait_until(
        &what,
        PHASE_TIMEOUT,
        || {
            let exited = s.borrow_mut().proc.has_exited();
            assert!(
                !exited,
                "{} ({mode:?}) did not start\n{}",
                svc.name(),
                diag()
            );
            accepts(svc.port())
        },
        diag,
    );
    s.into_inner()
}

/// The daemon's main process (as seen from here): the job's root under
/// cr_run, else the process itself.
fn main_pid(s: &Started, mode: Mode) -> i32 {
    match mode {
        Mode::Plain => s.proc.pid,
        Mode::Job => {
            let kids = tree_pids(s.proc.pid);
            *kids.get(1).unwrap_or_else(|| {
                panic!("cr_run has no child\n{}", s.diag());
            })
        }
    }
}

/// Size in bytes of the files of an image directory.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| if m.is_dir() { 0 } else { m.len() })
                .sum()
        })
        .unwrap_or(0)
}

/// "frozen 0.123 s" of a cr_checkpoint summary line.
fn frozen(out: &ToolOutput) -> String {
    out.stdout
        .split(", frozen ")
        .nth(1)
        .map(|f| f.trim().to_string())
        .unwrap_or_else(|| "?".into())
}

/// The scenario of the module docs for one daemon run the way `mode` says.
fn scenario<S: Service>(h: &Harness, mut svc: S, mode: Mode) {
    let mut s = start(h, &svc, mode);
    let main = main_pid(&s, mode);
    svc.live_check(main, mode, false);
    svc.prefill();
    let load = Load::start(svc.clients());
    let (out, err) = (s.out.clone(), s.err.clone());
    let diag = |svc: &S| format!("{}\n{}", files_diag(&out, &err), svc.diag());
    load.wait_more(PHASE_REQUESTS, "before the checkpoints", &|| diag(&svc));

    // 2. A checkpoint under load that lets it run on.
    let target = s.proc.pid;
    let cont = match mode {
        Mode::Plain => h.checkpoint(&h.image_dir("img-continue"), &[], target),
        // Through cr_run's pid, into the job's --dir.
        Mode::Job => h.run_tool(
            "cr_checkpoint",
            &[OsStr::new(&target.to_string())],
            &RunOpts::default(),
        ),
    };
    cont.assert_success(&format!("cr_checkpoint (continue) of {}", svc.name()));
    assert_running_untraced(target, &format!("{} after the checkpoint", svc.name()));
    if mode == Mode::Job {
        assert!(
            h.image_dir("job").join("checkpoint.img").exists(),
            "the job's image is in its --dir"
        );
    }
    load.wait_more(
        PHASE_REQUESTS,
        "after the checkpoint that let it run on",
        &|| diag(&svc),
    );

    // 3. checkpoint --kill (the clients keep their connections) and
    // restore; then the same again of the restored daemon.
    let rdiag = |r: &Restored| match r {
        Restored::Plain(r) => r.diag(),
        Restored::Detached(p) => describe(p.pid),
        Restored::Job(r) => r.diag(),
    };
    let exe = std::fs::canonicalize(svc.exe()).expect("the daemon's executable");
    let mut target = s.proc.pid;
    let mut restored: Option<Restored> = None;
    let mut figures = Vec::new();
    for generation in 1..=2 {
        let img = h.image_dir(&format!("img{generation}"));
        let tree = tree_pids(target);
        let killed = h.checkpoint(&img, &["--kill"], target);
        killed.assert_success(&format!(
            "cr_checkpoint --kill of {} (generation {generation})",
            svc.name()
        ));
        match restored.take() {
            None => {
                let st = s.proc.wait_exit(Duration::from_secs(20), || diag(&svc));
                if mode == Mode::Job {
                    assert_eq!(
                        st.and_then(|st| st.code()),
                        Some(128 + libc::SIGKILL),
                        "cr_run reports its job's kill"
                    );
                }
            }
            // The cr_restart of the killed generation ends.
            Some(Restored::Plain(mut r)) => {
                r.wait_plain(Duration::from_secs(20));
            }
            Some(Restored::Detached(mut p)) => {
                p.wait_exit(Duration::from_secs(20), || svc.diag());
            }
            Some(Restored::Job(mut r)) => {
                r.wait(Duration::from_secs(20), &|| svc.diag());
            }
        }
        wait_until(
            "the killed tree's processes to be gone",
            Duration::from_secs(20),
            || {
                reap_orphans();
                tree.iter().all(|&p| !is_alive(p))
            },
            || {
                tree.iter()
                    .map(|&p| describe(p))
                    .collect::<Vec<_>>()
                    .join("\n")
            },
        );
        let image = dir_bytes(&img);
        let t0 = Instant::now();
        let mut r = match mode {
            Mode::Plain if svc.daemon_args().is_some() => {
                Restored::Detached(h.restore_detach(&img, target))
            }
            Mode::Plain => Restored::Plain(h.restore_bg(&img, target)),
            Mode::Job => Restored::Job(h.restore_job(&img)),
        };
        load.wait_more(1, "after the restore", &|| {
            format!("{}\n{}", rdiag(&r), svc.diag())
        });
        let back = t0.elapsed();
        load.wait_more(PHASE_REQUESTS, "after the restore", &|| {
            format!("{}\n{}", rdiag(&r), svc.diag())
        });
        target = match &mut r {
            Restored::Plain(r) => r.restored.pid,
            Restored::Detached(p) => p.pid,
            Restored::Job(r) => r.wait_running(&exe, &|| svc.diag()),
        };
        svc.live_check(target, mode, true);
        figures.push(format!(
            "--kill: frozen {}, image {:.1} MiB; restore: answering again after {:.2} s",
            frozen(&killed),
            image as f64 / (1 << 20) as f64,
            back.as_secs_f64()
        ));
        if generation == 1 {
            figures.insert(
                0,
                killed
                    .stdout
                    .split_once(" (")
                    .and_then(|(_, t)| t.split_once(')'))
                    .map_or("?", |(t, _)| t)
                    .to_string(),
            );
        }
        restored = Some(r);
    }
    let mut restored = restored.expect("restored twice");
    let root = target;
    let total = load.requests();
    let clients = load.finish(&|| format!("{}\n{}", rdiag(&restored), svc.diag()));

    // 4. Its own checks.
    svc.check(&clients);
    eprintln!(
        "figures: {} {mode:?}: {}, {total} checked requests; continue: frozen {}; {}; again: {}",
        svc.name(),
        figures[0],
        frozen(&cont),
        figures[1],
        figures[2],
    );

    // 5. A clean stop.
    let (sig, code) = svc.stop();
    // SAFETY: kill(2) of the daemon this test restored.
    assert_eq!(unsafe { libc::kill(root, sig) }, 0, "kill {root}");
    let st = match &mut restored {
        Restored::Plain(r) => Some(r.wait_plain(PHASE_TIMEOUT).status),
        Restored::Detached(p) => p.wait_exit(PHASE_TIMEOUT, || svc.diag()),
        Restored::Job(r) => Some(r.wait(PHASE_TIMEOUT, &|| svc.diag())),
    };
    assert_eq!(
        st.and_then(|st| st.code()),
        Some(code),
        "the restored {} stopped cleanly on signal {sig}\n{}\n{}",
        svc.name(),
        rdiag(&restored),
        svc.diag()
    );
}

// ---------------------------------------------------------------------------
// HTTP/1.1 over a kept-alive connection
// ---------------------------------------------------------------------------

struct Http {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Http {
    fn new(port: u16) -> Http {
        let st = connect(port);
        Http {
            w: st.try_clone().expect("clone stream"),
            r: BufReader::new(st),
        }
    }

    /// GET PATH: the status and the body (Content-Length framed).
    fn get(&mut self, path: &str) -> Result<(u16, Vec<u8>), String> {
        write!(self.w, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .map_err(|e| format!("send GET {path}: {e}"))?;
        let mut line = String::new();
        self.r
            .read_line(&mut line)
            .map_err(|e| format!("GET {path}: {e}"))?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("GET {path}: bad status line {line:?}"))?;
        let mut len = None;
        loop {
            line.clear();
            self.r
                .read_line(&mut line)
                .map_err(|e| format!("GET {path}: headers: {e}"))?;
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse::<usize>().ok();
                }
            }
        }
        let len = len.ok_or_else(|| format!("GET {path}: no Content-Length"))?;
        let mut body = vec![0; len];
        self.r
            .read_exact(&mut body)
            .map_err(|e| format!("GET {path}: body: {e}"))?;
        Ok((status, body))
    }

    /// GET PATH that must answer 200: the body as text.
    fn text(&mut self, path: &str) -> Result<String, String> {
        let (status, body) = self.get(path)?;
        let body = String::from_utf8_lossy(&body).into_owned();
        if status != 200 {
            return Err(format!("GET {path}: status {status}: {body}"));
        }
        Ok(body)
    }
}

// ---------------------------------------------------------------------------
// The counter servers (Go, node, Java)
// ---------------------------------------------------------------------------

/// Keys per counter client.
const COUNTER_KEYS: usize = 16;

/// A client adding to its own keys and checking every new value.
struct CounterClient {
    http: Http,
    id: usize,
    steps: u64,
    vals: [i64; COUNTER_KEYS],
}

impl Client for CounterClient {
    fn step(&mut self) -> Result<(), String> {
        // 7 is prime to 16: every key in turn.
        let k = (self.steps as usize * 7 + self.id) % COUNTER_KEYS;
        let n = (self.steps % 9) as i64 + 1;
        let got = self.http.text(&format!("/add/c{}-{k}/{n}", self.id))?;
        self.vals[k] += n;
        self.steps += 1;
        if got != self.vals[k].to_string() {
            return Err(format!(
                "key c{}-{k} is {got}, expected {} (step {})",
                self.id, self.vals[k], self.steps
            ));
        }
        Ok(())
    }
}

/// One of the counter servers.
struct Counter {
    name: &'static str,
    exe: PathBuf,
    /// Arguments before ADDR.
    pre: Vec<OsString>,
    port: u16,
    /// jcmd of the JVM.
    jvm: bool,
    h_dir: PathBuf,
}

impl Counter {
    fn new(h: &Harness, name: &'static str, exe: PathBuf, pre: Vec<OsString>) -> Counter {
        Counter {
            name,
            exe,
            pre,
            port: free_port(),
            jvm: false,
            h_dir: h.dir.clone(),
        }
    }
}

impl Service for Counter {
    type Client = CounterClient;
    fn name(&self) -> &'static str {
        self.name
    }
    fn exe(&self) -> PathBuf {
        self.exe.clone()
    }
    fn foreground_args(&self) -> Vec<OsString> {
        let mut a = self.pre.clone();
        a.push(format!("127.0.0.1:{}", self.port).into());
        a
    }
    fn port(&self) -> u16 {
        self.port
    }
    fn clients(&self) -> Vec<CounterClient> {
        (0..8)
            .map(|id| CounterClient {
                http: Http::new(self.port),
                id,
                steps: 0,
                vals: [0; COUNTER_KEYS],
            })
            .collect()
    }
    fn live_check(&self, pid: i32, mode: Mode, restored: bool) {
        // Plain, jcmd attaches before the checkpoints too: its listener
        // socket is in the image. Under cr_run the first attach comes after
        // the restore: a new listener in the restored namespaces.
        if !self.jvm || (mode == Mode::Job && !restored) {
            return;
        }
        // The JVM's attach mechanism (SIGQUIT, then a unix socket in /tmp
        // of the JVM's mount namespace) answers.
        let out = Command::new(need_jdk_tool("jcmd"))
            .args([pid.to_string().as_str(), "VM.version"])
            .current_dir(&self.h_dir)
            .output()
            .expect("run jcmd");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.lines().any(|l| l.starts_with("JDK ")),
            "jcmd {pid} VM.version: {}\n{text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    fn check(&self, clients: &[CounterClient]) {
        let mut http = Http::new(self.port);
        let verdict = http.text("/check").expect("GET /check");
        assert!(
            verdict.starts_with("OK"),
            "{}'s own check: {verdict}",
            self.name
        );
        let keys: usize = clients
            .iter()
            .map(|c| c.vals.iter().filter(|&&v| v != 0).count())
            .sum();
        let total: i64 = clients.iter().map(|c| c.vals.iter().sum::<i64>()).sum();
        let adds: u64 = clients.iter().map(|c| c.steps).sum();
        assert_eq!(
            http.text("/sum").expect("GET /sum"),
            format!("{keys} {total} {adds}"),
            "every request counted exactly once"
        );
        for c in clients {
            for (k, v) in c.vals.iter().enumerate() {
                let got = http
                    .text(&format!("/add/c{}-{k}/0", c.id))
                    .expect("read a key");
                assert_eq!(got, v.to_string(), "key c{}-{k} after the restore", c.id);
            }
        }
        eprintln!("{} says: {verdict}", self.name);
    }
    fn stop(&self) -> (i32, i32) {
        // The JVM exits 128+SIGTERM after its shutdown hooks.
        (
            libc::SIGTERM,
            if self.jvm { 128 + libc::SIGTERM } else { 0 },
        )
    }
}

/// A program on PATH or in the usual system directories; panics naming the
/// package that tests/run.sh installs.
fn need(name: &str, package: &str) -> PathBuf {
    for dir in ["/usr/bin", "/usr/sbin", "/usr/local/bin", "/bin", "/sbin"] {
        let p = Path::new(dir).join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!("{name} is missing: install {package} (tests/run.sh does)")
}

fn need_jdk_tool(name: &str) -> PathBuf {
    need(name, "default-jdk-headless")
}

/// A directory of cr-tests' shared temp dir for what is built from
/// `source`, once per version of it, under a lock (tests run in parallel
/// processes): `make(dir)` fills it the first time.
fn built_once(name: &str, source: &Path, make: impl FnOnce(&Path)) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut hash = std::collections::hash_map::DefaultHasher::new();
    read_bytes(source).hash(&mut hash);
    let base = std::env::temp_dir()
        .join("cr-tests")
        .join(format!("{name}-{:x}", hash.finish()));
    std::fs::create_dir_all(base.parent().expect("parent")).expect("mkdir");
    let lock = std::fs::File::create(base.with_extension("lock")).expect("lock file");
    // SAFETY: flock on an fd we own; released when it is closed.
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    if !base.join("ready").exists() {
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).expect("mkdir build dir");
        make(&base);
        touch(&base.join("ready"));
    }
    base
}

/// Runs a build command, panicking with its output if it fails.
fn build(cmd: &mut Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn go_server(h: &Harness) -> Counter {
    let dir = built_once("go-counter", &script_path("counter_server.go"), |d| {
        build(
            Command::new(need("go", "golang-go"))
                .args(["build", "-o"])
                .arg(d.join("counter_server"))
                .arg(script_path("counter_server.go"))
                .env("GOCACHE", d.join("cache"))
                .env("GOPATH", d.join("gopath"))
                .env("GO111MODULE", "off")
                .current_dir(d),
            "go build counter_server.go",
        );
        let _ = std::fs::remove_dir_all(d.join("cache"));
    });
    Counter::new(h, "go", dir.join("counter_server"), vec![])
}

fn node_server(h: &Harness) -> Counter {
    Counter::new(
        h,
        "node",
        need("node", "nodejs"),
        vec![script_path("counter_server.js").into()],
    )
}

fn java_server(h: &Harness) -> Counter {
    let dir = built_once("java-counter", &script_path("CounterServer.java"), |d| {
        build(
            Command::new(need_jdk_tool("javac"))
                .arg("-d")
                .arg(d)
                .arg(script_path("CounterServer.java")),
            "javac CounterServer.java",
        );
    });
    let mut c = Counter::new(
        h,
        "java",
        need_jdk_tool("java"),
        vec![
            "-Xmx256m".into(),
            // As HTTP services on the JDK's server set it (without it,
            // Nagle's algorithm holds every answer's body for the client's
            // delayed ACK: 25 answers a second per connection).
            "-Dsun.net.httpserver.nodelay=true".into(),
            "-cp".into(),
            dir.into_os_string(),
            "CounterServer".into(),
        ],
    );
    c.jvm = true;
    c
}

#[test]
fn go_server_plain() {
    let h = Harness::new("go-plain");
    scenario(&h, go_server(&h), Mode::Plain);
}

#[test]
fn go_server_under_cr_run() {
    let h = Harness::new("go-job");
    scenario(&h, go_server(&h), Mode::Job);
}

#[test]
fn node_server_plain() {
    let h = Harness::new("node-plain");
    scenario(&h, node_server(&h), Mode::Plain);
}

#[test]
fn node_server_under_cr_run() {
    let h = Harness::new("node-job");
    scenario(&h, node_server(&h), Mode::Job);
}

#[test]
fn jvm_with_many_threads_plain() {
    let h = Harness::new("java-plain");
    scenario(&h, java_server(&h), Mode::Plain);
}

#[test]
fn jvm_with_many_threads_under_cr_run() {
    let h = Harness::new("java-job");
    scenario(&h, java_server(&h), Mode::Job);
}

// ---------------------------------------------------------------------------
// memcached
// ---------------------------------------------------------------------------

/// Keys stored before the load (every 100th of them 64 KiB long).
const MEMCACHED_KEYS: usize = 20_000;

fn memcached_value(i: usize) -> Vec<u8> {
    let mut v = sample_value(i);
    if i.is_multiple_of(100) {
        let pat = v.clone();
        while v.len() < 64 << 10 {
            v.extend_from_slice(&pat);
        }
    }
    v
}

/// memcached's text protocol over one connection.
struct Mc {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

impl Mc {
    fn new(port: u16) -> Mc {
        let st = connect(port);
        Mc {
            w: st.try_clone().expect("clone stream"),
            r: BufReader::new(st),
        }
    }

    fn line(&mut self) -> Result<String, String> {
        let mut l = String::new();
        self.r.read_line(&mut l).map_err(|e| format!("read: {e}"))?;
        if !l.ends_with("\r\n") {
            return Err(format!("incomplete line {l:?}"));
        }
        l.truncate(l.len() - 2);
        Ok(l)
    }

    /// `set` of many keys in one write, then their STORED answers.
    fn set_many(&mut self, kvs: &[(String, Vec<u8>)]) -> Result<(), String> {
        let mut b = Vec::new();
        for (k, v) in kvs {
            b.extend_from_slice(format!("set {k} 0 0 {}\r\n", v.len()).as_bytes());
            b.extend_from_slice(v);
            b.extend_from_slice(b"\r\n");
        }
        self.w.write_all(&b).map_err(|e| format!("send set: {e}"))?;
        for (k, _) in kvs {
            let l = self.line()?;
            if l != "STORED" {
                return Err(format!("set {k}: {l}"));
            }
        }
        Ok(())
    }

    /// `get K1 K2 ...`: the values found, in the order memcached sent them.
    fn get_many(&mut self, keys: &[String]) -> Result<Vec<(String, Vec<u8>)>, String> {
        write!(self.w, "get {}\r\n", keys.join(" ")).map_err(|e| format!("send get: {e}"))?;
        let mut out = Vec::new();
        loop {
            let l = self.line()?;
            if l == "END" {
                return Ok(out);
            }
            let f: Vec<&str> = l.split(' ').collect();
            let len: usize = match f.as_slice() {
                ["VALUE", _, _, n] => n.parse().map_err(|_| format!("bad line {l:?}"))?,
                _ => return Err(format!("unexpected line {l:?}")),
            };
            let mut v = vec![0; len + 2];
            self.r
                .read_exact(&mut v)
                .map_err(|e| format!("read value: {e}"))?;
            v.truncate(len);
            out.push((f[1].to_string(), v));
        }
    }

    /// Checks that every key holds its value.
    fn expect_all(&mut self, want: &[(String, Vec<u8>)]) {
        for chunk in want.chunks(100) {
            let keys: Vec<String> = chunk.iter().map(|(k, _)| k.clone()).collect();
            let got = self.get_many(&keys).expect("get");
            assert_eq!(
                got.len(),
                chunk.len(),
                "keys found of {}..{}",
                keys[0],
                keys[keys.len() - 1]
            );
            for ((k, v), (gk, gv)) in chunk.iter().zip(&got) {
                assert!(k == gk && v == gv, "key {k}: wrong value after the restore");
            }
        }
    }

    fn stat(&mut self, name: &str) -> String {
        self.w.write_all(b"stats\r\n").expect("send stats");
        let mut found = String::new();
        loop {
            let l = self.line().expect("stats line");
            if l == "END" {
                return found;
            }
            if let Some(v) = l.strip_prefix(&format!("STAT {name} ")) {
                found = v.to_string();
            }
        }
    }
}

/// A client setting its keys to new values and reading them back.
struct McClient {
    mc: Mc,
    id: usize,
    steps: usize,
    /// Its keys' current values.
    vals: Vec<Vec<u8>>,
}

impl McClient {
    fn key(&self, k: usize) -> String {
        format!("c{}:{k}", self.id)
    }
}

impl Client for McClient {
    fn step(&mut self) -> Result<(), String> {
        let k = self.steps % self.vals.len();
        let key = self.key(k);
        if self.steps.is_multiple_of(2) {
            let v = sample_value(self.steps * 31 + self.id);
            self.mc.set_many(&[(key, v.clone())])?;
            self.vals[k] = v;
        } else {
            let got = self.mc.get_many(std::slice::from_ref(&key))?;
            let want = &self.vals[k];
            let ok = if want.is_empty() {
                got.is_empty()
            } else {
                got.len() == 1 && got[0].1 == *want
            };
            if !ok {
                return Err(format!("get {key}: {got:?}, expected {want:?}"));
            }
        }
        self.steps += 1;
        Ok(())
    }
}

struct Memcached {
    port: u16,
    dir: PathBuf,
}

impl Memcached {
    fn args(&self) -> Vec<OsString> {
        // As Debian's /etc/memcached.conf has it, on a port of the test.
        [
            "-m",
            "128",
            "-p",
            &self.port.to_string(),
            "-u",
            "memcache",
            "-l",
            "127.0.0.1",
            "-t",
            "4",
        ]
        .into_iter()
        .map(OsString::from)
        .collect()
    }

    fn prefilled() -> Vec<(String, Vec<u8>)> {
        (0..MEMCACHED_KEYS)
            .map(|i| (format!("pre:{i}"), memcached_value(i)))
            .collect()
    }
}

impl Service for Memcached {
    type Client = McClient;
    fn name(&self) -> &'static str {
        "memcached"
    }
    fn exe(&self) -> PathBuf {
        need("memcached", "memcached")
    }
    fn foreground_args(&self) -> Vec<OsString> {
        self.args()
    }
    fn daemon_args(&self) -> Option<(Vec<OsString>, PathBuf)> {
        // `memcached -d -P PIDFILE`, as its init script ran it.
        let pidfile = self.dir.join("memcached.pid");
        let mut a = self.args();
        a.extend(["-d".into(), "-P".into(), pidfile.clone().into_os_string()]);
        Some((a, pidfile))
    }
    fn port(&self) -> u16 {
        self.port
    }
    fn prefill(&mut self) {
        let mut mc = Mc::new(self.port);
        for chunk in Memcached::prefilled().chunks(500) {
            mc.set_many(chunk).expect("prefill");
        }
    }
    fn clients(&self) -> Vec<McClient> {
        (0..8)
            .map(|id| McClient {
                mc: Mc::new(self.port),
                id,
                steps: 0,
                vals: vec![Vec::new(); 64],
            })
            .collect()
    }
    fn check(&self, clients: &[McClient]) {
        let mut mc = Mc::new(self.port);
        let mut want = Memcached::prefilled();
        for c in clients {
            for (k, v) in c.vals.iter().enumerate() {
                if !v.is_empty() {
                    want.push((c.key(k), v.clone()));
                }
            }
        }
        mc.expect_all(&want);
        assert_eq!(
            mc.stat("curr_items"),
            want.len().to_string(),
            "memcached holds exactly the keys stored"
        );
        assert_eq!(mc.stat("evictions"), "0", "nothing was evicted");
    }
}

/// memcached on a free port, with a directory of its own.
fn memcached(h: &Harness) -> Memcached {
    let dir = h.dir.join("memcached");
    std::fs::create_dir(&dir).expect("mkdir");
    // Its pid file is written as user memcache (/run/memcached is its own).
    let memcache = std::fs::read_to_string("/etc/passwd")
        .expect("/etc/passwd")
        .lines()
        .find_map(|l| {
            l.strip_prefix("memcache:x:")?
                .split(':')
                .next()?
                .parse()
                .ok()
        })
        .expect("user memcache (made by the memcached package)");
    std::os::unix::fs::chown(&dir, Some(memcache), None).expect("chown");
    Memcached {
        port: free_port(),
        dir,
    }
}

#[test]
fn memcached_daemon_plain() {
    let h = Harness::new("memcached-plain");
    scenario(&h, memcached(&h), Mode::Plain);
}

#[test]
fn memcached_under_cr_run() {
    let h = Harness::new("memcached-job");
    scenario(&h, memcached(&h), Mode::Job);
}

// ---------------------------------------------------------------------------
// nginx
// ---------------------------------------------------------------------------

/// Static files nginx serves (1 to 128 KiB).
const NGINX_FILES: usize = 8;

fn nginx_file(i: usize) -> Vec<u8> {
    let len = 1024 << i.min(10);
    (0..len)
        .map(|k| (k * 131 + i * 7 + k / 251) as u8)
        .collect()
}

/// A client fetching the files over one kept-alive connection.
struct NginxClient {
    http: Http,
    id: usize,
    steps: usize,
    files: Arc<Vec<Vec<u8>>>,
}

impl Client for NginxClient {
    fn step(&mut self) -> Result<(), String> {
        let i = (self.steps + self.id) % NGINX_FILES;
        let (status, body) = self.http.get(&format!("/f{i}.bin"))?;
        if status != 200 || body != self.files[i] {
            return Err(format!(
                "/f{i}.bin: status {status}, {} bytes, {}",
                body.len(),
                if body == self.files[i] {
                    "right content"
                } else {
                    "wrong content"
                }
            ));
        }
        self.steps += 1;
        Ok(())
    }
}

struct Nginx {
    port: u16,
    dir: PathBuf,
    files: Arc<Vec<Vec<u8>>>,
}

impl Nginx {
    fn new(h: &Harness) -> Nginx {
        let dir = h.dir.join("nginx");
        let www = dir.join("www");
        std::fs::create_dir_all(&www).expect("mkdir www");
        let files: Vec<Vec<u8>> = (0..NGINX_FILES).map(nginx_file).collect();
        for (i, f) in files.iter().enumerate() {
            std::fs::write(www.join(format!("f{i}.bin")), f).expect("write file");
        }
        let port = free_port();
        let d = dir.display();
        // A master and two workers, keep-alive connections kept for the
        // whole test, one access log line per request.
        let conf = format!(
            "worker_processes 2;\n\
             pid {d}/nginx.pid;\n\
             error_log {d}/error.log notice;\n\
             events {{ worker_connections 256; }}\n\
             http {{\n\
               access_log {d}/access.log;\n\
               sendfile on;\n\
               keepalive_timeout 300s;\n\
               keepalive_requests 1000000;\n\
               server {{ listen 127.0.0.1:{port}; root {d}/www; }}\n\
             }}\n"
        );
        std::fs::write(dir.join("nginx.conf"), conf).expect("write nginx.conf");
        Nginx {
            port,
            dir,
            files: Arc::new(files),
        }
    }

    fn args(&self) -> Vec<OsString> {
        vec![
            "-c".into(),
            self.dir.join("nginx.conf").into_os_string(),
            "-e".into(),
            self.dir.join("error.log").into_os_string(),
        ]
    }

    fn log_lines(&self) -> usize {
        read_text(&self.dir.join("access.log")).lines().count()
    }
}

impl Service for Nginx {
    type Client = NginxClient;
    fn name(&self) -> &'static str {
        "nginx"
    }
    fn exe(&self) -> PathBuf {
        need("nginx", "nginx")
    }
    fn foreground_args(&self) -> Vec<OsString> {
        // As in a container or a Type=simple unit.
        let mut a = self.args();
        a.extend(["-g".into(), "daemon off;".into()]);
        a
    }
    fn daemon_args(&self) -> Option<(Vec<OsString>, PathBuf)> {
        // nginx's default: the master forks away and writes its pid file.
        Some((self.args(), self.dir.join("nginx.pid")))
    }
    fn port(&self) -> u16 {
        self.port
    }
    fn clients(&self) -> Vec<NginxClient> {
        (0..16)
            .map(|id| NginxClient {
                http: Http::new(self.port),
                id,
                steps: 0,
                files: self.files.clone(),
            })
            .collect()
    }
    fn check(&self, clients: &[NginxClient]) {
        // New connections get every file whole.
        for i in 0..NGINX_FILES {
            let (status, body) = Http::new(self.port)
                .get(&format!("/f{i}.bin"))
                .expect("GET a file");
            assert!(
                status == 200 && body == self.files[i],
                "/f{i}.bin after the restore"
            );
        }
        // One access log line per request: none lost, none doubled (a
        // worker logs a request just after answering it).
        let want = clients.iter().map(|c| c.steps).sum::<usize>() + NGINX_FILES;
        wait_until(
            &format!("{want} access log lines"),
            Duration::from_secs(10),
            || self.log_lines() >= want,
            || format!("{} lines", self.log_lines()),
        );
        assert_eq!(self.log_lines(), want, "access log lines");
        let errors: Vec<String> = read_text(&self.dir.join("error.log"))
            .lines()
            .filter(|l| {
                ["[error]", "[crit]", "[alert]", "[emerg]"]
                    .iter()
                    .any(|w| l.contains(w))
            })
            .map(str::to_string)
            .collect();
        assert!(errors.is_empty(), "nginx logged errors: {errors:#?}");
    }
    fn diag(&self) -> String {
        format!(
            "--- nginx error.log:\n{}",
            tail(&read_text(&self.dir.join("error.log")), 20)
        )
    }
}

#[test]
fn nginx_under_load_plain() {
    let h = Harness::new("nginx-plain");
    scenario(&h, Nginx::new(&h), Mode::Plain);
}

#[test]
fn nginx_under_load_under_cr_run() {
    let h = Harness::new("nginx-job");
    scenario(&h, Nginx::new(&h), Mode::Job);
}

// ---------------------------------------------------------------------------
// redis (plain: tests/tests/tcp.rs)
// ---------------------------------------------------------------------------

/// Keys stored before the load.
const REDIS_KEYS: usize = 10_000;

/// A client adding to its counters with INCRBY and checking the sums.
struct RedisClient {
    resp: Resp,
    id: usize,
    steps: usize,
    vals: [i64; 16],
}

impl Client for RedisClient {
    fn step(&mut self) -> Result<(), String> {
        let k = (self.steps * 7 + self.id) % self.vals.len();
        let n = (self.steps % 9) as i64 + 1;
        let key = format!("c{}:{k}", self.id);
        let got = self
            .resp
            .call(&[b"INCRBY", key.as_bytes(), n.to_string().as_bytes()])
            .map_err(|e| format!("INCRBY {key}: {e}"))?;
        self.vals[k] += n;
        self.steps += 1;
        if got != Reply::Int(self.vals[k]) {
            return Err(format!("INCRBY {key}: {got:?}, expected {}", self.vals[k]));
        }
        Ok(())
    }
}

struct Redis {
    port: u16,
    dir: PathBuf,
}

impl Service for Redis {
    type Client = RedisClient;
    fn name(&self) -> &'static str {
        "redis"
    }
    fn exe(&self) -> PathBuf {
        need("redis-server", "redis-server")
    }
    fn foreground_args(&self) -> Vec<OsString> {
        // With its append-only file, fsynced every second by a thread.
        let port = self.port.to_string();
        let mut a: Vec<OsString> = [
            "--port",
            &port,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--daemonize",
            "no",
            "--dir",
        ]
        .into_iter()
        .map(OsString::from)
        .collect();
        a.push(self.dir.clone().into_os_string());
        a
    }
    fn port(&self) -> u16 {
        self.port
    }
    fn prefill(&mut self) {
        let mut cl = Resp::new(connect(self.port));
        for chunk in (0..REDIS_KEYS).collect::<Vec<_>>().chunks(1000) {
            let cmds: Vec<Vec<u8>> = chunk
                .iter()
                .map(|&i| Resp::encode(&[b"SET", format!("key:{i}").as_bytes(), &sample_value(i)]))
                .collect();
            cl.send(&cmds).expect("send SETs");
            for &i in chunk {
                assert_eq!(
                    cl.reply().expect("SET reply"),
                    Reply::Simple("OK".into()),
                    "SET key:{i}"
                );
            }
        }
    }
    fn clients(&self) -> Vec<RedisClient> {
        (0..8)
            .map(|id| RedisClient {
                resp: Resp::new(connect(self.port)),
                id,
                steps: 0,
                vals: [0; 16],
            })
            .collect()
    }
    fn check(&self, clients: &[RedisClient]) {
        let mut cl = Resp::new(connect(self.port));
        for i in 0..REDIS_KEYS {
            assert_eq!(
                cl.call(&[b"GET", format!("key:{i}").as_bytes()])
                    .expect("GET"),
                Reply::Bulk(Some(sample_value(i))),
                "key:{i} after the restore"
            );
        }
        let mut keys = REDIS_KEYS;
        for c in clients {
            for (k, v) in c.vals.iter().enumerate() {
                let want = if *v == 0 {
                    Reply::Bulk(None)
                } else {
                    keys += 1;
                    Reply::Bulk(Some(v.to_string().into_bytes()))
                };
                assert_eq!(
                    cl.call(&[b"GET", format!("c{}:{k}", c.id).as_bytes()])
                        .expect("GET"),
                    want,
                    "counter c{}:{k} after the restore",
                    c.id
                );
            }
        }
        assert_eq!(
            cl.call(&[b"DBSIZE"]).expect("DBSIZE"),
            Reply::Int(keys as i64)
        );
    }
}

#[test]
fn redis_with_aof_under_cr_run() {
    let h = Harness::new("redis-job");
    let dir = h.dir.join("redis");
    std::fs::create_dir(&dir).expect("mkdir");
    scenario(
        &h,
        Redis {
            port: free_port(),
            dir,
        },
        Mode::Job,
    );
}
