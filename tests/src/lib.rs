//! Shared helpers for the end-to-end tests.
//!
//! * [`wl`]: helpers for the workload binaries (`src/bin/wl_*.rs`).
//! * [`netns`]: network namespaces; [`cluster`]: a cluster of agents and a
//!   coordinator in namespaces joined by a bridge, and ring jobs on it;
//!   [`slurm`]: a real Slurm (munged, slurmctld, a slurmd per node) on it.
//! * Everything else: the test-side harness. A [`Harness`] owns a fresh temp
//!   directory; every process a test starts is wrapped in a [`Proc`] whose `Drop`
//!   kills it (by PID, and only if it is still the process we started) and reaps it,
//!   so nothing is left behind when an assertion fails.
//!
//! Every wait has a deadline and panics with a message that tells what was awaited
//! and what the process printed.

pub mod cluster;
pub mod faults;
pub mod libcr;
pub mod mpi;
pub mod netns;
pub mod node;
pub mod resp;
pub mod slurm;
pub mod wl;

use std::cell::Cell;
use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Deadline for one checkpoint or one failed tool run.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
/// Deadline for a workload to print READY or a line we wait for.
pub const LINE_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline for a workload to finish once `go` exists.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------
// Locating binaries
// ---------------------------------------------------------------------------

/// The directory holding the workspace's binaries: `CR_BIN_DIR` if set, else the
/// parent of the directory of the running test executable
/// (`target/debug/deps/x` -> `target/debug`).
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CR_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("test exe has a parent dir");
    if deps.file_name() == Some(OsStr::new("deps")) {
        deps.parent().expect("deps has a parent").to_path_buf()
    } else {
        deps.to_path_buf()
    }
}

/// What every restore of the suite passes to `cr_restart` (see
/// `Harness::start_tool`).
pub const VERIFY: &str = "--verify";

/// Path of an engine binary (`cr_checkpoint`, `cr_restart`, `cr_image`).
/// Panics with a hint if it was not built.
pub fn tool_path(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    if !p.is_file() {
        panic!(
            "{} not found: build the engine first with `cargo build --workspace` \
             (or point CR_BIN_DIR at the directory holding it)",
            p.display()
        );
    }
    p
}

/// Path of a workload binary of this crate (`wl_memory`, ...).
pub fn workload_path(name: &str) -> PathBuf {
    let p = bin_dir().join(name);
    if !p.is_file() {
        panic!(
            "workload {} not found: it is built by `cargo build -p cr-tests`",
            p.display()
        );
    }
    p
}

/// Path of a script in `tests/workloads/`.
pub fn script_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("workloads")
        .join(name)
}

/// The real python3 executable (not a pyenv shim script, whose bash would fork).
pub fn python3() -> PathBuf {
    for cand in ["/usr/bin/python3", "/usr/local/bin/python3"] {
        if Path::new(cand).is_file() {
            return PathBuf::from(cand);
        }
    }
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .stdin(Stdio::null())
        .output()
        .expect("no python3 found (tried /usr/bin/python3 and PATH)");
    assert!(out.status.success(), "python3 -c failed: {out:?}");
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

// ---------------------------------------------------------------------------
// /proc helpers
// ---------------------------------------------------------------------------

/// The fields of /proc/PID/status that the tests look at.
#[derive(Debug, Clone)]
pub struct ProcStatus {
    /// First letter of `State:` (R, S, D, T, t, Z, X, ...).
    pub state: char,
    pub tracer_pid: i32,
    pub ppid: i32,
    pub name: String,
    /// `VmRSS:` in KiB (0 for a zombie).
    pub vm_rss_kib: u64,
}

/// Reads /proc/PID/status; None if the process does not exist.
pub fn proc_status(pid: i32) -> Option<ProcStatus> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let mut st = ProcStatus {
        state: '?',
        tracer_pid: -1,
        ppid: -1,
        name: String::new(),
        vm_rss_kib: 0,
    };
    for line in text.lines() {
        if let Some(v) = line.strip_prefix("State:") {
            st.state = v.trim().chars().next().unwrap_or('?');
        } else if let Some(v) = line.strip_prefix("TracerPid:") {
            st.tracer_pid = v.trim().parse().unwrap_or(-1);
        } else if let Some(v) = line.strip_prefix("PPid:") {
            st.ppid = v.trim().parse().unwrap_or(-1);
        } else if let Some(v) = line.strip_prefix("Name:") {
            st.name = v.trim().to_string();
        } else if let Some(v) = line.strip_prefix("VmRSS:") {
            st.vm_rss_kib = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
        }
    }
    Some(st)
}

/// Start time (clock ticks since boot, field 22 of /proc/PID/stat).
pub fn proc_starttime(pid: i32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &text[text.rfind(')')? + 1..];
    // after the comm: state is field 3, starttime field 22 -> index 19 here.
    after.split_whitespace().nth(19)?.parse().ok()
}

/// The syscall number a process is blocked in (first field of /proc/PID/syscall),
/// None if running, gone or unreadable.
pub fn blocked_syscall(pid: i32) -> Option<i64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/syscall")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Open fds of a process with their targets, sorted by fd.
pub fn fd_list(pid: i32) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in rd.flatten() {
            let Ok(fd) = e.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let target = std::fs::read_link(e.path())
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            out.push((fd, target));
        }
    }
    out.sort();
    out
}

/// `pid` and all its descendants, parents first.
pub fn tree_pids(pid: i32) -> Vec<i32> {
    let mut out = vec![pid];
    let mut i = 0;
    while i < out.len() {
        let p = out[i];
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) {
            for t in tasks.flatten() {
                for c in std::fs::read_to_string(t.path().join("children"))
                    .unwrap_or_default()
                    .split_whitespace()
                {
                    if let Ok(c) = c.parse::<i32>() {
                        if !out.contains(&c) {
                            out.push(c);
                        }
                    }
                }
            }
        }
        i += 1;
    }
    out
}

/// One-line description of a process for panic messages.
pub fn describe(pid: i32) -> String {
    match proc_status(pid) {
        None => format!("pid {pid}: does not exist"),
        Some(st) => {
            let wchan = std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
            let sys = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
            let sys: String = sys.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
            format!(
                "pid {pid} ({}): state {} tracer {} ppid {} wchan {wchan:?} syscall {sys:?}",
                st.name, st.state, st.tracer_pid, st.ppid
            )
        }
    }
}

/// True if the process exists and is neither a zombie nor dead.
pub fn is_alive(pid: i32) -> bool {
    matches!(proc_status(pid), Some(st) if st.state != 'Z' && st.state != 'X')
}

/// Asserts that `pid` is alive, not stopped and not traced. Allows the kernel up
/// to one second to finish a detach that the tool started before exiting.
pub fn assert_running_untraced(pid: i32, ctx: &str) {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let st = proc_status(pid);
        let good = matches!(&st, Some(s) if s.tracer_pid == 0 && !matches!(s.state, 't' | 'T' | 'Z' | 'X'));
        if good {
            return;
        }
        if st.is_none() || Instant::now() > deadline {
            panic!(
                "{ctx}: expected pid {pid} running and not traced, but: {}",
                describe(pid)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `cond` every 10 ms until it is true; panics with `what` and the text of
/// `diag()` after `timeout`.
pub fn wait_until(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> bool,
    diag: impl Fn() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}\n{}", diag());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Reads a file as (lossy) text; empty if missing.
pub fn read_text(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Creates an empty file.
pub fn touch(path: &Path) {
    File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
}

/// Makes a process we started a child subreaper, so that processes restored with
/// `--detach` are reparented to us and can be reaped (no zombies).
pub fn become_subreaper() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) only sets a flag on this process.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

/// Spawn setup shared by all processes the tests start: every inherited fd above
/// 2 is made close-on-exec, so nothing of the test runner leaks into a workload
/// (an inherited pipe would make it uncheckpointable).
fn isolate_fds(cmd: &mut Command, keep: &[(i32, i32)]) {
    let keep = keep.to_vec();
    // SAFETY: the closure only makes async-signal-safe raw syscalls
    // (close_range, dup2, fcntl) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            // CLOSE_RANGE_CLOEXEC = 4; std's own exec-error pipe is already CLOEXEC.
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 4u32);
            // Then the fds the child is given: (ours, its number).
            for &(src, dst) in &keep {
                if src == dst {
                    libc::fcntl(dst, libc::F_SETFD, 0);
                } else if libc::dup2(src, dst) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

// ---------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------

/// A process started by the test (directly, or restored by a cr_restart we ran).
/// Dropping it kills it with SIGKILL if it is still the process we started, and
/// reaps it if we can.
pub struct Proc {
    pub pid: i32,
    pub label: String,
    child: Option<Child>,
    start: Option<u64>,
    /// A process (our cr_restart) whose children are ours too.
    parent_hint: Option<i32>,
    /// Start time of a different process that holds the pid and is never to be
    /// touched through this handle (the original, when a restore must fail).
    exclude_start: Option<u64>,
    status: Option<ExitStatus>,
    done: bool,
    /// Its peak RSS in KiB (`ru_maxrss` from wait4), once reaped as our
    /// direct child.
    pub max_rss_kib: Option<u64>,
}

impl Proc {
    fn from_child(child: Child, label: &str) -> Proc {
        let pid = child.id() as i32;
        own_child(pid);
        Proc {
            pid,
            label: label.to_string(),
            child: Some(child),
            start: proc_starttime(pid),
            parent_hint: None,
            exclude_start: None,
            status: None,
            done: false,
            max_rss_kib: None,
        }
    }

    /// Tracks a process that is not (or not yet) our direct child, e.g. a restored
    /// process. `parent_hint`: the cr_restart that runs it, if any.
    pub fn adopt(pid: i32, label: &str, parent_hint: Option<i32>) -> Proc {
        Proc {
            pid,
            label: label.to_string(),
            child: None,
            start: proc_starttime(pid),
            parent_hint,
            exclude_start: None,
            status: None,
            done: false,
            max_rss_kib: None,
        }
    }

    /// Tracks the process that a restore will create with `pid`, which may still
    /// be held by another process (then never touched through this handle).
    /// `held`: the start time of the process holding `pid` before cr_restart was
    /// started (read it with `proc_starttime` *before* starting cr_restart).
    pub fn expect_restored(pid: i32, label: &str, cr_restart: i32, held: Option<u64>) -> Proc {
        Proc {
            pid,
            label: label.to_string(),
            child: None,
            start: None,
            parent_hint: Some(cr_restart),
            exclude_start: held,
            status: None,
            done: false,
            max_rss_kib: None,
        }
    }

    /// True if `pid` is still the process we mean (start time matches, or its
    /// parent is us or our cr_restart).
    fn is_ours(&self) -> bool {
        let Some(st) = proc_status(self.pid) else {
            return false;
        };
        let now_start = proc_starttime(self.pid);
        if self.exclude_start.is_some() && now_start == self.exclude_start {
            return false;
        }
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        let start_ok = self.start.is_some() && now_start == self.start;
        start_ok
            || st.ppid == me
            || (self.parent_hint.is_some() && Some(st.ppid) == self.parent_hint)
    }

    /// Non-blocking check for exit. Some(status) once it has exited; the status is
    /// None if it was not our child (it was reaped by someone else).
    pub fn try_exit(&mut self) -> Option<Option<ExitStatus>> {
        if self.done {
            return Some(self.status);
        }
        if self.child.is_some() {
            // wait4 rather than Child::try_wait: its rusage gives the peak
            // RSS (the std handle, never waited on, reaps nothing on drop).
            match cr_sys::rusage::try_reap(self.pid) {
                Ok(Some(e)) => {
                    self.done = true;
                    self.status = Some(ExitStatus::from_raw(e.status));
                    self.max_rss_kib = Some(e.max_rss_kib);
                    return Some(self.status);
                }
                Ok(None) => return None,
                Err(e) => panic!("waiting for {} (pid {}): {e}", self.label, self.pid),
            }
        }
        // Not our direct child: a restored process, perhaps reparented to us
        // (we are a subreaper).
        let Some(st) = proc_status(self.pid) else {
            self.done = true;
            return Some(None);
        };
        let now_start = proc_starttime(self.pid);
        if self.exclude_start.is_some() && now_start == self.exclude_start {
            // The pid is held by another process: ours is not there.
            return Some(None);
        }
        if self.start.is_some() && now_start != self.start {
            // Ours is gone and the pid was reused.
            self.done = true;
            return Some(None);
        }
        // SAFETY: getpid has no preconditions.
        if st.ppid == unsafe { libc::getpid() } {
            let mut raw = 0;
            // SAFETY: raw is a valid int; WNOHANG never blocks; the pid is our
            // child that no std::process::Child owns.
            let r = unsafe { libc::waitpid(self.pid, &mut raw, libc::WNOHANG) };
            if r == self.pid {
                self.done = true;
                self.status = Some(ExitStatus::from_raw(raw));
                return Some(self.status);
            }
            if r == 0 {
                // Not reapable yet: a zombie thread-group leader whose
                // other threads are still exiting (a multi-threaded
                // daemon that just ended): its status comes later.
                return None;
            }
        }
        if matches!(st.state, 'Z' | 'X') {
            self.done = true;
            return Some(None);
        }
        None
    }

    pub fn has_exited(&mut self) -> bool {
        self.try_exit().is_some()
    }

    /// Waits for the process to exit; panics after `timeout` with `diag()`.
    pub fn wait_exit(
        &mut self,
        timeout: Duration,
        diag: impl Fn() -> String,
    ) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_exit() {
                return st;
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {} to exit: {}\n{}",
                    self.label,
                    describe(self.pid),
                    diag()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Sends a signal (only if the pid is still ours).
    pub fn signal(&self, sig: i32) {
        assert!(
            !self.done && self.is_ours(),
            "{} (pid {}) is gone or not ours (done {}, start {:?}, exclude {:?}, parent hint {:?}), \
             cannot send signal {sig}: {}",
            self.label,
            self.pid,
            self.done,
            self.start,
            self.exclude_start,
            self.parent_hint,
            describe(self.pid)
        );
        // SAFETY: kill(2) on a pid we verified to be our process.
        let r = unsafe { libc::kill(self.pid, sig) };
        assert_eq!(
            r,
            0,
            "kill({}, {sig}): {}",
            self.pid,
            std::io::Error::last_os_error()
        );
    }

    /// Stops the process: SIGTERM, then SIGKILL if it has not exited
    /// within `grace`.
    pub fn terminate(&mut self, grace: Duration) {
        if self.has_exited() {
            return;
        }
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while !self.has_exited() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill_and_reap();
    }

    /// SIGKILLs the process if it is still ours, then reaps it if we can.
    pub fn kill_and_reap(&mut self) {
        if self.done {
            return;
        }
        if self.is_ours() {
            // SAFETY: kill(2) on a pid we verified to be our process.
            unsafe { libc::kill(self.pid, libc::SIGKILL) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.try_exit().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill_and_reap();
    }
}

/// Formats an exit status for messages: "exit 3", "signal 9", "unknown".
pub fn status_str(st: Option<ExitStatus>) -> String {
    match st {
        None => "unknown (not our child)".into(),
        Some(s) => match (s.code(), s.signal()) {
            (Some(c), _) => format!("exit {c}"),
            (_, Some(sig)) => format!("signal {sig}"),
            _ => format!("{s:?}"),
        },
    }
}

// ---------------------------------------------------------------------------
// Tool runs
// ---------------------------------------------------------------------------

/// Result of running one engine tool to completion.
#[derive(Debug)]
pub struct ToolOutput {
    pub cmdline: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// The tool's peak RSS in KiB (`ru_maxrss`), when it was our child.
    pub max_rss_kib: Option<u64>,
}

impl ToolOutput {
    pub fn show(&self) -> String {
        format!(
            "command: {}\nstatus: {}\nstdout:\n{}\nstderr:\n{}",
            self.cmdline,
            status_str(Some(self.status)),
            self.stdout,
            self.stderr
        )
    }

    /// Panics unless the tool exited 0.
    pub fn assert_success(&self, ctx: &str) -> &Self {
        assert!(self.status.success(), "{ctx}: tool failed\n{}", self.show());
        self
    }

    /// Panics unless the tool exited non-zero (not by a signal) and printed exactly
    /// one line on stderr, starting with `prefix` and containing each of
    /// `keywords` (case-insensitive). Returns that line.
    pub fn assert_error(&self, ctx: &str, prefix: &str, keywords: &[&str]) -> String {
        assert!(
            self.status.code().is_some_and(|c| c != 0),
            "{ctx}: expected a non-zero exit code\n{}",
            self.show()
        );
        let lines: Vec<&str> = self
            .stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect();
        assert_eq!(
            lines.len(),
            1,
            "{ctx}: expected exactly one line on stderr\n{}",
            self.show()
        );
        let line = lines[0];
        assert!(
            line.starts_with(prefix),
            "{ctx}: stderr line does not start with {prefix:?}\n{}",
            self.show()
        );
        let lower = line.to_lowercase();
        for k in keywords {
            assert!(
                lower.contains(&k.to_lowercase()),
                "{ctx}: stderr line does not mention {k:?}\n{}",
                self.show()
            );
        }
        line.to_string()
    }
}

/// How to run a tool.
#[derive(Default, Clone)]
pub struct RunOpts {
    pub env: Vec<(String, String)>,
    /// Run as this uid/gid (setgroups([]), setgid, setuid before exec).
    pub as_user: Option<(u32, u32)>,
    /// Defaults to TOOL_TIMEOUT.
    pub timeout: Option<Duration>,
    /// Use this executable instead of the one in the target directory.
    pub exe: Option<PathBuf>,
    /// Fds the tool gets: (ours, its number).
    pub fds: Vec<(i32, i32)>,
    /// Its working directory (default: ours).
    pub cwd: Option<PathBuf>,
}

// ---------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------

static HARNESS_SEQ: AtomicU32 = AtomicU32::new(0);

/// Marks `pid` as owned by a std::process::Child of the caller, so that
/// `reap_orphans` (run by concurrent tests) never reaps it.
pub fn own_child(pid: i32) {
    if let Ok(mut v) = STD_CHILDREN.lock() {
        v.push(pid);
    }
}

/// Pids owned by a std::process::Child (reaped through it, never by `reap_orphans`).
static STD_CHILDREN: std::sync::Mutex<Vec<i32>> = std::sync::Mutex::new(Vec::new());

/// True if a child of ours that no Child handle owns is still alive (not a zombie).
fn orphans_alive() -> bool {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let owned = STD_CHILDREN.lock().map(|v| v.clone()).unwrap_or_default();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return false;
    };
    rd.flatten().any(|e| {
        e.file_name()
            .to_string_lossy()
            .parse::<i32>()
            .is_ok_and(|pid| {
                !owned.contains(&pid)
                    && matches!(proc_status(pid), Some(s) if s.ppid == me && s.state != 'Z')
            })
    })
}

/// Reaps zombies that were reparented to us (we are a subreaper), e.g. the child
/// of a workload killed by `cr_checkpoint --kill`, so they do not hold their pid.
pub fn reap_orphans() {
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let owned = STD_CHILDREN.lock().map(|v| v.clone()).unwrap_or_default();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in rd.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if owned.contains(&pid) {
            continue;
        }
        if matches!(proc_status(pid), Some(s) if s.ppid == me && s.state == 'Z') {
            let mut st = 0;
            // SAFETY: reaping a zombie child of ours that no Child handle owns.
            unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        }
    }
}

/// One test's world: a fresh temp directory (kept if the test panics, removed
/// otherwise) and helpers to start workloads and tools inside it.
pub struct Harness {
    pub dir: PathBuf,
    seq: Cell<u32>,
}

impl Harness {
    pub fn new(name: &str) -> Harness {
        become_subreaper();
        let base = std::env::temp_dir().join("cr-tests");
        std::fs::create_dir_all(&base).expect("create temp base dir");
        let _ = std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o1777));
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = base.join(format!(
            "{name}-{}-{}-{nanos:x}",
            std::process::id(),
            HARNESS_SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let _ = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755));
        Harness {
            dir,
            seq: Cell::new(0),
        }
    }

    fn next_seq(&self) -> u32 {
        let n = self.seq.get() + 1;
        self.seq.set(n);
        n
    }

    /// A path for an image directory (not created: cr_checkpoint creates it).
    pub fn image_dir(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Starts a workload binary of this crate: `wl_NAME WORKDIR ARGS...`.
    pub fn spawn_wl(&self, bin: &str, args: &[&str]) -> Workload {
        let exe = workload_path(bin);
        self.spawn_program(bin, &exe, &[], args)
    }

    /// Starts the python script `tests/workloads/SCRIPT` with the real python3.
    pub fn spawn_python(&self, script: &str, args: &[&str]) -> Workload {
        let py = python3();
        let s = script_path(script);
        assert!(s.is_file(), "missing script {}", s.display());
        self.spawn_program(script, &py, &[s.as_os_str()], args)
    }

    /// Starts `exe PRE_ARGS... WORKDIR ARGS...` with stdin /dev/null and
    /// stdout/stderr going to regular files in a fresh work directory.
    pub fn spawn_program(
        &self,
        label: &str,
        exe: &Path,
        pre: &[&OsStr],
        args: &[&str],
    ) -> Workload {
        self.spawn_program_fds(label, exe, pre, args, &[])
    }

    /// Like `spawn_program`, the child also getting our fd `src` as its
    /// fd `dst` for each `(src, dst)` of `fds`.
    pub fn spawn_program_fds(
        &self,
        label: &str,
        exe: &Path,
        pre: &[&OsStr],
        args: &[&str],
        fds: &[(i32, i32)],
    ) -> Workload {
        let n = self.next_seq();
        let workdir = self.dir.join(format!("wl{n}-{}", label.replace('/', "_")));
        self.spawn_in(&workdir, label, exe, pre, args, fds)
    }

    /// Starts a workload binary with a work directory of the given name (inside
    /// the harness directory), e.g. one with spaces in it.
    pub fn spawn_wl_in(&self, dirname: &str, bin: &str, args: &[&str]) -> Workload {
        let exe = workload_path(bin);
        self.spawn_in(&self.dir.join(dirname), bin, &exe, &[], args, &[])
    }

    fn spawn_in(
        &self,
        workdir: &Path,
        label: &str,
        exe: &Path,
        pre: &[&OsStr],
        args: &[&str],
        fds: &[(i32, i32)],
    ) -> Workload {
        let workdir = workdir.to_path_buf();
        std::fs::create_dir_all(&workdir).expect("mkdir workdir");
        let stdout = workdir.join("stdout.txt");
        let stderr = workdir.join("stderr.txt");
        let mut cmd = Command::new(exe);
        cmd.args(pre)
            .arg(&workdir)
            .args(args)
            .current_dir(&workdir)
            .stdin(File::open("/dev/null").expect("open /dev/null"))
            .stdout(File::create(&stdout).expect("create stdout file"))
            .stderr(File::create(&stderr).expect("create stderr file"))
            .env("PYTHONUNBUFFERED", "1")
            .env("PYTHONDONTWRITEBYTECODE", "1");
        isolate_fds(&mut cmd, fds);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", exe.display()));
        Workload {
            proc: Proc::from_child(child, label),
            label: label.to_string(),
            exe: std::fs::canonicalize(exe).unwrap_or_else(|_| exe.to_path_buf()),
            workdir,
            stdout,
            stderr,
        }
    }

    /// `cr_run --dir DIR -- PRE... WORKDIR ARGS...` as a workload: a job, PID
    /// 1 of its own namespaces (its `pid()` is cr_run's).
    pub fn spawn_job(&self, label: &str, dir: &Path, pre: &[&OsStr], args: &[&str]) -> Workload {
        let mut cmd: Vec<&OsStr> = vec![OsStr::new("--dir"), dir.as_os_str(), OsStr::new("--")];
        cmd.extend(pre);
        self.spawn_program(label, &tool_path("cr_run"), &cmd, args)
    }

    /// `cr_restart DIR` of a job's image in the background: the job comes
    /// back in new namespaces, as cr_restart's child, with PIDs of its own.
    pub fn restore_job(&self, dir: &Path) -> JobRestore {
        let (cr, _, err, cmdline) = self.start_tool(
            &tool_path("cr_restart"),
            &[dir.as_os_str()],
            &RunOpts::default(),
        );
        JobRestore {
            root: Cell::new(None),
            cr,
            err,
            cmdline,
        }
    }

    /// Runs a tool to completion (stdout/stderr captured through files, so a
    /// process that inherits them can never block us).
    pub fn run_tool(&self, tool: &str, args: &[&OsStr], opts: &RunOpts) -> ToolOutput {
        let exe = opts.exe.clone().unwrap_or_else(|| tool_path(tool));
        let (mut child, out, err, cmdline) = self.start_tool(&exe, args, opts);
        let timeout = opts.timeout.unwrap_or(TOOL_TIMEOUT);
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = child.try_exit() {
                break st.expect("tool is our child");
            }
            // Processes a `--kill` ended were reparented to us (a
            // subreaper): reaped now, so the tool sees them gone.
            reap_orphans();
            if t0.elapsed() > timeout {
                let msg = format!(
                    "timed out after {timeout:?}: {cmdline}\nstdout:\n{}\nstderr:\n{}",
                    read_text(&out),
                    read_text(&err)
                );
                child.kill_and_reap();
                panic!("{msg}");
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        ToolOutput {
            cmdline,
            status,
            stdout: read_text(&out),
            stderr: read_text(&err),
            elapsed: t0.elapsed(),
            max_rss_kib: child.max_rss_kib,
        }
    }

    /// Starts `exe ARGS...` in the background as `run_tool` would (fds
    /// isolated, stdout and stderr to files of the harness directory):
    /// the process, its stdout and stderr files, and its command line.
    pub fn start_tool(
        &self,
        exe: &Path,
        args: &[&OsStr],
        opts: &RunOpts,
    ) -> (Proc, PathBuf, PathBuf, String) {
        let n = self.next_seq();
        let name = exe
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let out = self.dir.join(format!("tool{n}-{name}.out"));
        let err = self.dir.join(format!("tool{n}-{name}.err"));
        // Every restore of the suite checks itself: the restored tree,
        // captured again before it runs, must be its image.
        let verify = (name == "cr_restart").then_some(OsStr::new(VERIFY));
        let args: Vec<&OsStr> = verify.into_iter().chain(args.iter().copied()).collect();
        let mut cmd = Command::new(exe);
        cmd.args(&args)
            .stdin(File::open("/dev/null").expect("open /dev/null"))
            .stdout(File::create(&out).expect("create tool stdout"))
            .stderr(File::create(&err).expect("create tool stderr"));
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        isolate_fds(&mut cmd, &opts.fds);
        if let Some(d) = &opts.cwd {
            cmd.current_dir(d);
        }
        if let Some((uid, gid)) = opts.as_user {
            // SAFETY: only async-signal-safe raw syscalls between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setgroups(0, std::ptr::null()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut cmdline = String::new();
        for (k, v) in &opts.env {
            cmdline.push_str(&format!("{k}={v} "));
        }
        if let Some((uid, _)) = opts.as_user {
            cmdline.push_str(&format!("[as uid {uid}] "));
        }
        cmdline.push_str(&exe.display().to_string());
        for a in args {
            cmdline.push(' ');
            cmdline.push_str(&a.to_string_lossy());
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmdline}: {e}"));
        (Proc::from_child(child, &name), out, err, cmdline)
    }

    /// `cr_checkpoint --dir DIR [opts...] PID`.
    pub fn checkpoint(&self, dir: &Path, opts: &[&str], pid: i32) -> ToolOutput {
        self.checkpoint_with(dir, opts, pid, &RunOpts::default())
    }

    pub fn checkpoint_with(
        &self,
        dir: &Path,
        opts: &[&str],
        pid: i32,
        run: &RunOpts,
    ) -> ToolOutput {
        let pid_s = pid.to_string();
        let mut args: Vec<&OsStr> = vec![OsStr::new("--dir"), dir.as_os_str()];
        args.extend(opts.iter().map(OsStr::new));
        args.push(OsStr::new(&pid_s));
        self.run_tool("cr_checkpoint", &args, run)
    }

    /// `cr_restart DIR` run to completion (for restores expected to fail). Should
    /// it restore something after all, the process that gets `pid` is killed
    /// when this returns.
    pub fn restore_sync(&self, dir: &Path, pid: i32) -> ToolOutput {
        let mut r = self.restore_bg(dir, pid);
        r.wait_plain(TOOL_TIMEOUT)
    }

    /// `cr_restart DIR` in the background; the restored process (pid `pid`) is
    /// tracked and killed on drop.
    pub fn restore_bg(&self, dir: &Path, pid: i32) -> Restore {
        self.restore_bg_args(dir, pid, &[])
    }

    /// `cr_restart EXTRA... DIR` in the background, like `restore_bg` (e.g.
    /// with `--netns NAME` or `--map-addr OLD=NEW`).
    pub fn restore_bg_args(&self, dir: &Path, pid: i32, extra: &[&OsStr]) -> Restore {
        self.restore_bg_with(dir, pid, extra, &RunOpts::default())
    }

    /// `cr_restart DIR` in the background with environment `env` (e.g.
    /// `CR_FAULT_INJECT`), like `restore_bg`.
    pub fn restore_bg_env(&self, dir: &Path, pid: i32, env: &[(&str, &str)]) -> Restore {
        let run = RunOpts {
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..RunOpts::default()
        };
        self.restore_bg_with(dir, pid, &[], &run)
    }

    /// Like `restore_bg_args`, cr_restart run with `run` (fds, env...).
    pub fn restore_bg_with(
        &self,
        dir: &Path,
        pid: i32,
        extra: &[&OsStr],
        run: &RunOpts,
    ) -> Restore {
        let exe = tool_path("cr_restart");
        // Who holds the pid now, before cr_restart can create the restored process.
        let held = proc_starttime(pid);
        let mut args: Vec<&OsStr> = extra.to_vec();
        args.push(dir.as_os_str());
        let (cr, out, err, cmdline) = self.start_tool(&exe, &args, run);
        let restored = Proc::expect_restored(pid, "restored process", cr.pid, held);
        Restore {
            restored,
            cr,
            out,
            err,
            cmdline,
        }
    }

    /// `cr_restart --detach DIR`: checks it exits 0 and prints `pid` alone on a
    /// line, and returns the restored process (reparented to us as subreaper).
    pub fn restore_detach(&self, dir: &Path, pid: i32) -> Proc {
        self.restore_detach_out(dir, pid).0
    }

    /// Like `restore_detach`, with cr_restart's result too.
    pub fn restore_detach_out(&self, dir: &Path, pid: i32) -> (Proc, ToolOutput) {
        let out = self.run_tool(
            "cr_restart",
            &[OsStr::new("--detach"), dir.as_os_str()],
            &RunOpts::default(),
        );
        out.assert_success("cr_restart --detach");
        let printed: Vec<&str> = out
            .stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .collect();
        assert_eq!(
            printed,
            vec![pid.to_string().as_str()],
            "cr_restart --detach must print the pid alone on one line\n{}",
            out.show()
        );
        (Proc::adopt(pid, "restored process (detached)", None), out)
    }

    /// `cr_image ARGS...`.
    pub fn cr_image(&self, args: &[&OsStr]) -> ToolOutput {
        self.run_tool("cr_image", args, &RunOpts::default())
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("CR_TESTS_KEEP").is_some() {
            // Keep the evidence, but not huge page files.
            trim_big_files(&self.dir, 32 << 20);
            eprintln!("test files kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn trim_big_files(dir: &Path, limit: u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let Ok(md) = e.metadata() else { continue };
        if md.is_dir() {
            trim_big_files(&e.path(), limit);
        } else if md.len() > limit {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

// ---------------------------------------------------------------------------
// Workloads
// ---------------------------------------------------------------------------

/// A started workload. Its pid stays the same across checkpoint/restore.
pub struct Workload {
    /// The process as we spawned it (dead once checkpointed with --kill).
    pub proc: Proc,
    pub label: String,
    pub exe: PathBuf,
    pub workdir: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
}

impl Workload {
    pub fn pid(&self) -> i32 {
        self.proc.pid
    }

    pub fn output(&self) -> String {
        read_text(&self.stdout)
    }

    pub fn lines(&self) -> Vec<String> {
        self.output().lines().map(str::to_string).collect()
    }

    /// stdout and stderr of the workload, for panic messages.
    pub fn diag(&self) -> String {
        format!(
            "--- {} stdout ({}):\n{}\n--- stderr:\n{}\n--- {}",
            self.label,
            self.stdout.display(),
            tail(&self.output(), 40),
            tail(&read_text(&self.stderr), 40),
            describe(self.pid())
        )
    }

    pub fn go_path(&self) -> PathBuf {
        self.workdir.join("go")
    }

    pub fn go(&self) {
        touch(&self.go_path());
    }

    pub fn remove_go(&self) {
        let _ = std::fs::remove_file(self.go_path());
    }

    /// Waits until a stdout line satisfies `pred`, returns it. `alive` tells
    /// whether the process that writes the file can still write (checked so that
    /// an early death is reported at once, not after the timeout); `extra` adds
    /// context to a panic message.
    pub fn wait_line_while(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
        alive: impl FnMut() -> bool,
        extra: impl Fn() -> String,
    ) -> String {
        match self.line_within(timeout, pred, alive) {
            Ok(l) => l,
            Err(LineMissing::Stopped) => panic!(
                "{} stopped while waiting for {what}\n{}\n{}",
                self.label,
                extra(),
                self.diag()
            ),
            Err(LineMissing::TimedOut) => panic!(
                "timed out after {timeout:?} waiting for {what}\n{}\n{}",
                extra(),
                self.diag()
            ),
        }
    }

    /// The first stdout line that satisfies `pred`, once written within
    /// `timeout` while `alive` says the writer lives; else why not.
    pub fn line_within(
        &self,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
        mut alive: impl FnMut() -> bool,
    ) -> Result<String, LineMissing> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(l) = self.output().lines().find(|l| pred(l)) {
                return Ok(l.to_string());
            }
            if !alive() {
                // One more look: the line may have been written just before exit.
                if let Some(l) = self.output().lines().find(|l| pred(l)) {
                    return Ok(l.to_string());
                }
                return Err(LineMissing::Stopped);
            }
            if Instant::now() > deadline {
                return Err(LineMissing::TimedOut);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for a line of the original (spawned) process.
    pub fn wait_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + LINE_TIMEOUT;
        loop {
            let out = self.output();
            if let Some(l) = out.lines().find(|l| pred(l)) {
                return l.to_string();
            }
            if self.proc.has_exited() {
                if let Some(l) = self.output().lines().find(|l| pred(l)) {
                    return l.to_string();
                }
                panic!(
                    "{} exited ({}) while waiting for {what}\n{}",
                    self.label,
                    status_str(self.proc.try_exit().flatten()),
                    self.diag()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {LINE_TIMEOUT:?} waiting for {what}\n{}",
                    self.diag()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn wait_ready(&mut self) {
        self.wait_line("READY", |l| l.starts_with("READY"));
    }

    /// Waits until the process sits in one of the syscalls `nrs`, not traced.
    pub fn wait_blocked_in(&self, nrs: &[i64], timeout: Duration) {
        let pid = self.pid();
        wait_until(
            &format!("pid {pid} to block in syscall {nrs:?}"),
            timeout,
            || {
                let st = proc_status(pid);
                matches!(&st, Some(s) if s.state == 'S' && s.tracer_pid == 0)
                    && blocked_syscall(pid).is_some_and(|n| nrs.contains(&n))
            },
            || self.diag(),
        );
    }

    /// Reaps the original process after `cr_checkpoint --kill`; asserts SIGKILL.
    pub fn reap_killed(&mut self) {
        let (o, e) = (self.stdout.clone(), self.stderr.clone());
        let st = self
            .proc
            .wait_exit(Duration::from_secs(20), || files_diag(&o, &e));
        let st = st.expect("the workload is our child");
        assert_eq!(
            st.signal(),
            Some(libc::SIGKILL),
            "after cr_checkpoint --kill the original should die of SIGKILL, got {}\n{}",
            status_str(Some(st)),
            self.diag_static()
        );
        // Children of the workload (if the engine took a tree) were reparented
        // to us: reap them once they die, so that their pids are free.
        let deadline = Instant::now() + Duration::from_secs(2);
        while orphans_alive() && Instant::now() < deadline {
            reap_orphans();
            std::thread::sleep(Duration::from_millis(5));
        }
        reap_orphans();
    }

    fn diag_static(&self) -> String {
        files_diag(&self.stdout, &self.stderr)
    }

    /// Creates `go`, waits for the original process to exit, asserts exit 0 and
    /// an `OK` line.
    pub fn go_and_expect_ok(&mut self) {
        self.go();
        let (o, e) = (self.stdout.clone(), self.stderr.clone());
        let st = self.proc.wait_exit(EXIT_TIMEOUT, || files_diag(&o, &e));
        let ok = self.output().lines().any(|l| l == "OK");
        assert!(
            st.is_some_and(|s| s.success()) && ok,
            "{} should print OK and exit 0, got {}\n{}",
            self.label,
            status_str(st),
            self.diag_static()
        );
    }

    /// Overwrites `len` bytes of stdout at `offset` with `fill` (keeps the size).
    pub fn scribble_stdout(&self, offset: u64, fill: &[u8]) {
        let mut f = OpenOptions::new()
            .write(true)
            .open(&self.stdout)
            .expect("open stdout file");
        f.seek(SeekFrom::Start(offset)).expect("seek");
        f.write_all(fill).expect("write");
    }

    pub fn stdout_len(&self) -> u64 {
        std::fs::metadata(&self.stdout)
            .map(|m| m.len())
            .unwrap_or(0)
    }
}

/// A value of a few dozen bytes, different for each `i`, for keys the
/// tests store in a daemon and read back.
pub fn sample_value(i: usize) -> Vec<u8> {
    let mut v = format!("value-{i}-").into_bytes();
    for k in 0..(i % 50 + 20) {
        v.push(b'a' + ((i * 7 + k * 13) % 26) as u8);
    }
    v
}

/// A TCP port nobody listens on now (on the host's loopback).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Tails of a workload's stdout and stderr files, for panic messages.
pub fn files_diag(stdout: &Path, stderr: &Path) -> String {
    format!(
        "--- stdout ({}):\n{}\n--- stderr:\n{}",
        stdout.display(),
        tail(&read_text(stdout), 40),
        tail(&read_text(stderr), 40)
    )
}

/// A background `cr_restart DIR` of a job (see `Harness::restore_job`).
/// Dropping it kills the restored job (its PID 1 takes its namespace
/// along) and cr_restart.
pub struct JobRestore {
    root: Cell<Option<i32>>,
    pub cr: Proc,
    err: PathBuf,
    cmdline: String,
}

impl JobRestore {
    pub fn diag(&self) -> String {
        format!(
            "--- {}\n--- cr_restart stderr:\n{}",
            self.cmdline,
            tail(&read_text(&self.err), 20)
        )
    }

    /// The restored job's root (cr_restart's child), once it exists.
    pub fn root(&self) -> Option<i32> {
        if self.root.get().is_none() {
            let pid = self.cr.pid;
            let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            self.root
                .set(kids.split_whitespace().next().and_then(|k| k.parse().ok()));
        }
        self.root.get()
    }

    /// Waits until the job runs (released: its root untraced, running
    /// `exe`); returns its root.
    pub fn wait_running(&mut self, exe: &Path, more: &dyn Fn() -> String) -> i32 {
        let deadline = Instant::now() + LINE_TIMEOUT;
        loop {
            if let Some(r) = self.root() {
                let running = proc_status(r).is_some_and(|s| s.tracer_pid == 0)
                    && std::fs::read_link(format!("/proc/{r}/exe")).is_ok_and(|e| e == exe);
                if running {
                    return r;
                }
            }
            if self.cr.has_exited() || Instant::now() > deadline {
                panic!("the restored job does not run\n{}\n{}", self.diag(), more());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for cr_restart to end (the job ended); its status.
    pub fn wait(&mut self, timeout: Duration, more: &dyn Fn() -> String) -> ExitStatus {
        let (cmdline, err) = (self.cmdline.clone(), self.err.clone());
        self.cr
            .wait_exit(timeout, || {
                format!("--- {cmdline}\n{}\n{}", read_text(&err), more())
            })
            .expect("cr_restart is our child")
    }
}

impl Drop for JobRestore {
    fn drop(&mut self) {
        if let Some(r) = self.root().filter(|&r| is_alive(r)) {
            // SAFETY: kill(2) of the job this restore made (our cr_restart's child).
            unsafe { libc::kill(r, libc::SIGKILL) };
        }
    }
}

/// A background `cr_restart DIR`.
pub struct Restore {
    /// The restored process (same pid as the original). Declared first so it is
    /// killed before cr_restart on drop.
    pub restored: Proc,
    pub cr: Proc,
    out: PathBuf,
    err: PathBuf,
    pub cmdline: String,
}

impl Restore {
    pub fn diag(&self) -> String {
        format!(
            "--- {}\n--- cr_restart stdout:\n{}\n--- cr_restart stderr:\n{}\n--- restored: {}",
            self.cmdline,
            tail(&read_text(&self.out), 20),
            tail(&read_text(&self.err), 20),
            describe(self.restored.pid)
        )
    }

    /// Waits for a stdout line written by the restored process.
    pub fn wait_line(&mut self, wl: &Workload, what: &str, pred: impl Fn(&str) -> bool) -> String {
        let (cmdline, err) = (self.cmdline.clone(), self.err.clone());
        let cr = &mut self.cr;
        wl.wait_line_while(
            what,
            LINE_TIMEOUT,
            pred,
            || !cr.has_exited(),
            || format!("--- {cmdline}\n--- cr_restart stderr:\n{}", read_text(&err)),
        )
    }

    /// True while cr_restart runs.
    pub fn running(&mut self) -> bool {
        !self.cr.has_exited()
    }

    /// Waits for cr_restart to exit and returns its result.
    pub fn wait(&mut self, timeout: Duration, wl: &Workload) -> ToolOutput {
        self.wait_diag(timeout, &|| wl.diag())
    }

    /// Like `wait`, without a workload to describe.
    pub fn wait_plain(&mut self, timeout: Duration) -> ToolOutput {
        self.wait_diag(timeout, &String::new)
    }

    fn wait_diag(&mut self, timeout: Duration, more: &dyn Fn() -> String) -> ToolOutput {
        let t0 = Instant::now();
        let (cmdline, err) = (self.cmdline.clone(), self.err.clone());
        let st = self
            .cr
            .wait_exit(timeout, || {
                format!(
                    "--- {cmdline}\ncr_restart stderr:\n{}\n{}",
                    read_text(&err),
                    more()
                )
            })
            .expect("cr_restart is our child");
        ToolOutput {
            cmdline: self.cmdline.clone(),
            status: st,
            stdout: read_text(&self.out),
            stderr: read_text(&self.err),
            elapsed: t0.elapsed(),
            max_rss_kib: self.cr.max_rss_kib,
        }
    }

    /// Waits until the restored process sits in one of the syscalls `nrs`, fully
    /// restored (not traced, runs the workload's exe).
    pub fn wait_blocked_in(&mut self, wl: &Workload, nrs: &[i64], timeout: Duration) {
        let pid = self.restored.pid;
        let exe = wl.exe.clone();
        let deadline = Instant::now() + timeout;
        loop {
            let st = proc_status(pid);
            let exe_ok = std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe);
            if exe_ok
                && matches!(&st, Some(s) if s.state == 'S' && s.tracer_pid == 0)
                && blocked_syscall(pid).is_some_and(|n| nrs.contains(&n))
            {
                return;
            }
            if !self.running() {
                panic!(
                    "cr_restart exited ({}) before pid {pid} blocked in {nrs:?}\n{}\n{}",
                    status_str(self.cr.try_exit().flatten()),
                    self.diag(),
                    wl.diag()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for restored pid {pid} to block in {nrs:?}\n{}\n{}",
                    self.diag(),
                    wl.diag()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Last `n` lines of a text.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    let start = lines.len().saturating_sub(n);
    let mut out = String::new();
    if start > 0 {
        out.push_str(&format!("[... {start} lines before]\n"));
    }
    out.push_str(&lines[start..].join("\n"));
    out
}

/// Reads a whole file into bytes, panicking with the path on error.
pub fn read_bytes(path: &Path) -> Vec<u8> {
    let mut v = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut v))
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    v
}

/// Flips every bit of the byte at `offset` of a file.
pub fn flip_byte(path: &Path, offset: u64) {
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.read_exact(&mut b).expect("read byte");
    b[0] ^= 0xff;
    f.seek(SeekFrom::Start(offset)).expect("seek");
    f.write_all(&b).expect("write byte");
}

/// Checks that a `cr_restart` that failed left no restored process with `pid`.
pub fn assert_no_restored(pid: i32, exe: &Path, ctx: &str) {
    // Give a process the tool may have forked a moment to die.
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let ours =
            is_alive(pid) && std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe);
        if !ours {
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "{ctx}: a restored process was left running: {}",
                describe(pid)
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Parses `count N` lines and checks they form 1, 2, 3, ... with no gap or
/// duplicate; returns the last count.
pub fn check_consecutive_counts(out: &str) -> Result<u64, String> {
    let mut expect = 1u64;
    for (i, line) in out.lines().enumerate() {
        if let Some(v) = line.strip_prefix("count ") {
            let n: u64 = v
                .trim()
                .parse()
                .map_err(|_| format!("line {}: bad count line {line:?}", i + 1))?;
            if n != expect {
                return Err(format!(
                    "line {}: expected count {expect}, found {n} ({})",
                    i + 1,
                    if n < expect { "duplicate" } else { "gap" }
                ));
            }
            expect += 1;
        } else if line.starts_with("READY") || line.starts_with("final ") || line == "OK" {
            continue;
        } else {
            return Err(format!("line {}: unexpected line {line:?}", i + 1));
        }
    }
    Ok(expect - 1)
}

/// The largest `count N` printed so far.
pub fn last_count(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.strip_prefix("count "))
        .filter_map(|v| v.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// Syscalls the go-polling loop of a workload sleeps in (glibc nanosleep is
/// clock_nanosleep underneath; restart_syscall while a restarted sleep runs).
pub const POLL_SLEEP_SYSCALLS: &[i64] = &[
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_restart_syscall,
];

/// Asserts that a restore run (`cr_restart DIR` without --detach) exited 0 and
/// that the workload's last stdout line is `OK`.
pub fn assert_restored_ok(out: &ToolOutput, wl: &Workload, ctx: &str) {
    let text = wl.output();
    let last = text.lines().rfind(|l| !l.is_empty()).unwrap_or("");
    assert!(
        out.status.code() == Some(0) && last == "OK",
        "{ctx}: restored workload should print OK and cr_restart exit 0\n{}\n{}",
        out.show(),
        wl.diag()
    );
}

/// Asserts an error line mentions at least one of `any_of` (case-insensitive).
pub fn assert_mentions_any(line: &str, any_of: &[&str], ctx: &str) {
    let lower = line.to_lowercase();
    assert!(
        any_of.iter().any(|k| lower.contains(&k.to_lowercase())),
        "{ctx}: error line should mention one of {any_of:?}: {line:?}"
    );
}

/// Checkpoints `wl` with `--kill` into `img` (asserting success) and reaps it.
pub fn checkpoint_kill(h: &Harness, wl: &mut Workload, img: &Path) -> ToolOutput {
    let out = h.checkpoint(img, &["--kill"], wl.pid());
    out.assert_success("cr_checkpoint --kill");
    wl.reap_killed();
    out
}

/// `cr_checkpoint --kill CR_RUN_PID` of a job started with `spawn_job`
/// (into its `--dir`, within `timeout`): asserts success, and that cr_run
/// then ends reporting its job's SIGKILL.
pub fn checkpoint_kill_job(h: &Harness, wl: &mut Workload, timeout: Duration, ctx: &str) {
    let out = h.run_tool(
        "cr_checkpoint",
        &["--kill".as_ref(), wl.pid().to_string().as_ref()],
        &RunOpts {
            timeout: Some(timeout),
            ..RunOpts::default()
        },
    );
    out.assert_success(ctx);
    let st = wl
        .proc
        .wait_exit(Duration::from_secs(20), String::new)
        .expect("cr_run is our child");
    assert_eq!(
        st.code(),
        Some(128 + libc::SIGKILL),
        "{ctx}: cr_run returns the killed job's status"
    );
}

/// The page store file (`pages-<ID>.img`) of an image directory.
pub fn store_file(img: &Path) -> PathBuf {
    let found: Vec<PathBuf> = std::fs::read_dir(img)
        .unwrap_or_else(|e| panic!("read {}: {e}", img.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("pages-") && n.ends_with(".img"))
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "page stores in {}: {found:?}",
        img.display()
    );
    found.into_iter().next().expect("one store")
}

/// The length of a file (0 if it does not exist).
pub fn file_len(p: &Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// Size of one record of wl_append's files.
pub const REC: u64 = 64;

/// Checks that a wl_append record file holds records 0..n exactly once, in
/// order; returns n.
pub fn check_records(p: &Path) -> Result<u64, String> {
    let data = read_bytes(p);
    if !(data.len() as u64).is_multiple_of(REC) {
        return Err(format!(
            "{}: size {} is not a multiple of {REC}",
            p.display(),
            data.len()
        ));
    }
    for (i, rec) in data.chunks(REC as usize).enumerate() {
        let want = format!("rec {i:010} ");
        if !rec.starts_with(want.as_bytes()) || rec[REC as usize - 1] != b'\n' {
            return Err(format!(
                "{}: record #{i} is {:?}",
                p.display(),
                String::from_utf8_lossy(rec)
            ));
        }
    }
    Ok(data.len() as u64 / REC)
}

/// Why [`Workload::line_within`] found no line.
#[derive(Debug, PartialEq, Eq)]
pub enum LineMissing {
    /// The writer ended.
    Stopped,
    /// Not within the time given.
    TimedOut,
}
