//! Real programs nobody here wrote, checkpointed with `--kill` in the middle
//! of their work and restored, then checked with their own output or tools:
//!
//! * coreutils pipelines (`seq | awk | cat > file` twice in a row, `yes |
//!   head | tr` into a pipe read by the test, `sort` spilling to temp files
//!   and merging them, `gzip`, `tr | nl` reading the test's pipe), frozen
//!   mid-stream with data in their pipes: the output is complete and in
//!   order; `tail -f` (inotify) and util-linux `flock` (flock(2));
//! * SQLite (python3's sqlite3 module) writing in a loop with a rollback
//!   journal and with WAL (mmapped -shm, POSIX locks): `PRAGMA
//!   integrity_check` is ok and rows are 1..M exactly once; a writer frozen
//!   inside its transaction still holds its lock after the restore;
//! * python3 multiprocessing (Pool: pipes, semaphores in deleted /dev/shm
//!   files; Manager: unix sockets);
//! * interactive programs in a tmux pane (a line program, bc, less, the
//!   sqlite3 shell in a transaction, `cat | tr`, a nested `sh -i`), restored
//!   into the same pane with `cr_restart --shell-job`: they own the
//!   terminal again, with their terminal settings, and answer with their
//!   state; and a whole tmux server with its pane's shell;
//! * LAMMPS (Debian's lammps, an MPI application) as 2 Open MPI ranks under
//!   `cr_run`: restored with `--verify`, its thermo table is the one of a
//!   run without checkpoints.
//!
//! Needs tmux, sqlite3, bc, lammps, openmpi-bin (tests/run.sh installs
//! them); nothing is skipped.

use cr_tests::*;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const SH: &str = "/bin/sh";

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn children(pid: i32) -> Vec<i32> {
    tree_pids(pid)
        .into_iter()
        .skip(1)
        .filter(|&c| proc_status(c).is_some_and(|s| s.ppid == pid))
        .collect()
}

/// Names and states of a process tree, for panic messages.
fn describe_tree(pid: i32) -> String {
    tree_pids(pid)
        .into_iter()
        .map(describe)
        .collect::<Vec<_>>()
        .join("\n")
}

/// After a `--kill` of a tree, its descendants were reparented to us (the
/// tests are child subreapers): reap them so every PID is free again, and
/// check that none of them survived.
fn reap_descendants(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    for &p in pids {
        loop {
            let mut st = 0;
            // SAFETY: waitpid with a valid out pointer; WNOHANG never blocks.
            let r = unsafe { libc::waitpid(p, &mut st, libc::WNOHANG | libc::__WALL) };
            if r == p || !Path::new(&format!("/proc/{p}")).exists() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "process {p} did not go away after cr_checkpoint --kill: {}",
                describe(p)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// `cr_checkpoint --kill` of the `cr_run --no-pidns` workload `wl` into
/// `img` (`what` names it if it fails): cr_run returns its job's SIGKILL,
/// and the job's processes `pids`, reparented to us, are reaped.
fn kill_cr_run_job(h: &Harness, wl: &mut Workload, img: &Path, pids: &[i32], what: &str) {
    h.checkpoint(img, &["--kill"], wl.pid())
        .assert_success(what);
    let (o, e) = (wl.stdout.clone(), wl.stderr.clone());
    let st = wl
        .proc
        .wait_exit(Duration::from_secs(20), || files_diag(&o, &e))
        .expect("cr_run is our child");
    assert_eq!(st.code(), Some(128 + libc::SIGKILL), "cr_run's status");
    reap_descendants(pids);
}

/// Declared first in every test, so dropped last: if the test fails, kills
/// and reaps whatever is left of the processes it started (e.g. the
/// descendants of a restored job, like a `tail -f` that would never end),
/// so nothing outlives it. (Meant for one test per process or
/// --test-threads=1, as the suite runs.)
struct Sweep;

impl Drop for Sweep {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        for _ in 0..50 {
            let left: Vec<i32> = tree_pids(me).into_iter().skip(1).collect();
            if left.is_empty() {
                return;
            }
            for &p in left.iter().rev() {
                // SAFETY: kill(2) of a descendant of this test process.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(20));
            loop {
                let mut st = 0;
                // SAFETY: reaping our own exited children; WNOHANG never blocks.
                let r = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG | libc::__WALL) };
                if r <= 0 {
                    break;
                }
            }
        }
    }
}

/// Makes every inherited fd above 2 close-on-exec in the child (the test
/// runner's own pipes must not leak into a checkpointed tree).
fn isolate(cmd: &mut Command) {
    // SAFETY: only a raw close_range syscall between fork and exec, which is
    // async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 4u32);
            Ok(())
        });
    }
}

/// A child started with std::process whose whole tree is killed on drop.
struct Kid {
    child: Child,
    label: String,
    status: Option<ExitStatus>,
}

impl Kid {
    fn spawn(mut cmd: Command, label: &str) -> Kid {
        isolate(&mut cmd);
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {label}: {e}"));
        own_child(child.id() as i32);
        Kid {
            child,
            label: label.to_string(),
            status: None,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn try_exit(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("wait {}: {e}", self.label));
        }
        self.status
    }

    fn wait(&mut self, timeout: Duration, diag: impl Fn() -> String) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.try_exit() {
                return st;
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {} to exit:\n{}\n{}",
                    self.label,
                    describe_tree(self.pid()),
                    diag()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        if self.try_exit().is_none() {
            for p in tree_pids(self.pid()).into_iter().rev() {
                // SAFETY: kill(2) on our child or one of its descendants.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
            let _ = self.child.wait();
        }
    }
}

/// Finds an executable in PATH (and the usual system dirs); panics with a
/// hint if it is missing: tests/run.sh installs what the tests need.
fn need_program(name: &str) -> PathBuf {
    let path = std::env::var("PATH").unwrap_or_default();
    let dirs = path
        .split(':')
        .chain(["/usr/bin", "/bin", "/usr/local/bin", "/usr/sbin"])
        .filter(|d| !d.is_empty());
    for d in dirs {
        let p = Path::new(d).join(name);
        if p.is_file() {
            return p;
        }
    }
    panic!("{name} is not installed (tests/run.sh installs it with apt-get)");
}

/// Runs a command to completion with a deadline; returns (status, stdout, stderr).
fn run_cmd(
    h: &Harness,
    exe: &Path,
    args: &[&OsStr],
    timeout: Duration,
) -> (ExitStatus, String, String) {
    let out = h.dir.join("cmd.out");
    let err = h.dir.join("cmd.err");
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out).expect("create cmd.out"))
        .stderr(File::create(&err).expect("create cmd.err"))
        .env_remove("TMUX");
    let line = format!(
        "{} {}",
        exe.display(),
        args.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut k = Kid::spawn(cmd, &line);
    let st = k.wait(timeout, || format!("stderr:\n{}", read_text(&err)));
    (st, read_text(&out), read_text(&err))
}

// ---------------------------------------------------------------------------
// 1. Coreutils pipelines
// ---------------------------------------------------------------------------

/// `sh -c SCRIPT WORKDIR`, run in WORKDIR, stdout/stderr to files.
fn spawn_sh(h: &Harness, label: &str, script: &str) -> Workload {
    h.spawn_program(
        label,
        Path::new(SH),
        &[OsStr::new("-c"), OsStr::new(script)],
        &[],
    )
}

/// Length of the lines "3\n6\n9\n...(3n)\n".
fn multiples_len(n: u64) -> u64 {
    (1..=n).map(|i| (3 * i).to_string().len() as u64 + 1).sum()
}

/// Checks that `path` holds exactly the lines f(1), f(2), ..., f(n).
fn check_lines(path: &Path, n: u64, f: impl Fn(u64) -> u64) -> Result<(), String> {
    let file = File::open(path).map_err(|e| format!("open {}: {e}", path.display()))?;
    let mut r = BufReader::with_capacity(1 << 20, file);
    let mut line = Vec::with_capacity(32);
    let mut i = 0u64;
    loop {
        line.clear();
        let got = r
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("read {}: {e}", path.display()))?;
        if got == 0 {
            break;
        }
        i += 1;
        let text = String::from_utf8_lossy(&line);
        if i > n {
            return Err(format!("line {i}: extra line {text:?} after the last one"));
        }
        let want = f(i);
        if !line.ends_with(b"\n") || text.trim_end().parse::<u64>().ok() != Some(want) {
            return Err(format!("line {i}: {text:?}, expected {want}"));
        }
    }
    if i != n {
        return Err(format!("{i} lines, expected {n}"));
    }
    Ok(())
}

/// Start `script` under sh, wait until its output file `file` has grown
/// past `min` bytes, check the tree has `procs` processes (`what`), then
/// checkpoint it with --kill and wait until all are gone. Returns the
/// workload, the output file, the image directory and the tree's pids
/// (root first).
fn sh_killed_mid_stream(
    h: &Harness,
    name: &str,
    script: &str,
    file: &str,
    min: u64,
    procs: usize,
    what: &str,
) -> (Workload, PathBuf, PathBuf, Vec<i32>) {
    let mut wl = spawn_sh(h, name, script);
    let out = wl.workdir.join(file);
    wait_until(
        &format!("{file} to grow past {min} bytes"),
        LINE_TIMEOUT,
        || file_len(&out) >= min,
        || format!("{}\n{}", describe_tree(wl.pid()), wl.diag()),
    );
    let pid = wl.pid();
    let pids = tree_pids(pid);
    assert_eq!(pids.len(), procs, "{what}:\n{}", describe_tree(pid));
    let img = h.image_dir("img");
    checkpoint_kill(h, &mut wl, &img);
    reap_descendants(&pids[1..]);
    (wl, out, img, pids)
}

/// `seq 1 N | awk '{print $1*3}' | cat > out.txt`, started as one tree (sh
/// and its three children), frozen while out.txt grows, restored, frozen
/// again while it grows and restored again: the file holds every line
/// exactly once and in order.
#[test]
fn seq_awk_cat_pipeline_into_a_file_frozen_mid_stream() {
    let _sweep = Sweep;
    let h = Harness::new("real-pipeline");
    let n: u64 = 20_000_000;
    let total = multiples_len(n);
    let script = format!("seq 1 {n} | awk '{{print $1*3}}' | cat > out.txt && echo DONE");
    let (wl, out, img, pids) = sh_killed_mid_stream(
        &h,
        "pipeline",
        &script,
        "out.txt",
        8 << 20,
        4,
        "sh with seq, awk and cat",
    );
    let pid = pids[0];
    let at = file_len(&out);
    assert!(
        at < total,
        "the pipeline had finished ({at} of {total} bytes) before the checkpoint: not mid-stream"
    );
    eprintln!("checkpointed with out.txt at {at} of {total} bytes");

    // The restored tree runs on; checkpoint it again mid-stream (a second
    // generation image of restored processes and pipes).
    let mut r1 = h.restore_bg(&img, pid);
    wait_until(
        "the restored pipeline to write 8 MiB more",
        LINE_TIMEOUT,
        || file_len(&out) >= at + (8 << 20) || (file_len(&out) > at && !is_alive(pid)),
        || format!("{}\n{}", r1.diag(), describe_tree(pid)),
    );
    assert!(
        r1.running() && tree_pids(pid) == pids,
        "the restored pipeline should run on as the same 4 processes ({pids:?})\n{}\n{}\n{}",
        describe_tree(pid),
        r1.diag(),
        wl.diag()
    );
    let img2 = h.image_dir("img2");
    h.checkpoint(&img2, &["--kill"], pid)
        .assert_success("cr_checkpoint --kill of the restored pipeline");
    let res1 = r1.wait(Duration::from_secs(20), &wl);
    reap_descendants(&pids[1..]);
    let at2 = file_len(&out);
    assert!(
        at2 < total,
        "the restored pipeline had finished ({at2} of {total} bytes) before the second checkpoint"
    );
    eprintln!(
        "second checkpoint with out.txt at {at2} bytes (first cr_restart: {})",
        status_str(Some(res1.status))
    );

    let mut r = h.restore_bg(&img2, pid);
    let res = r.wait(Duration::from_secs(90), &wl);
    assert!(
        res.status.success() && wl.output().trim() == "DONE",
        "pipeline restored from the second image should finish with exit 0 and print DONE\n{}\n{}",
        res.show(),
        wl.diag()
    );
    let len = file_len(&out);
    check_lines(&out, n, |i| 3 * i).unwrap_or_else(|e| {
        panic!(
            "out.txt after two restores (frozen at {at} and {at2} bytes, now {len} of {total}): {e}"
        )
    });
}

/// The output of `yes 0123456789abcdef | ... | tr 0-9a-f a-p`: this line
/// over and over.
const PATTERN: &[u8] = b"abcdefghijklmnop\n";

/// Reads `src` to its end in a thread, checking every byte against PATTERN
/// (the stream starts at offset `start` of it), never going past `limit`
/// bytes in total until the limit is raised. `progress`: bytes read so far.
/// Returns the number of bytes read.
fn pattern_reader(
    mut src: impl Read + Send + 'static,
    start: u64,
    limit: Arc<AtomicU64>,
    progress: Arc<AtomicU64>,
) -> JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut buf = vec![0u8; 1 << 16];
        let mut got = 0u64;
        loop {
            if Instant::now() > deadline {
                return Err(format!(
                    "reader gave up after 120 s at byte {}",
                    start + got
                ));
            }
            let room = limit.load(Ordering::SeqCst).saturating_sub(start + got);
            if room == 0 {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            let want = buf.len().min(room.min(usize::MAX as u64) as usize);
            let k = match src.read(&mut buf[..want]) {
                Ok(0) => return Ok(got),
                Ok(k) => k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(format!("read at byte {}: {e}", start + got)),
            };
            for (i, &b) in buf[..k].iter().enumerate() {
                let off = start + got + i as u64;
                let want = PATTERN[(off % PATTERN.len() as u64) as usize];
                if b != want {
                    let ctx = String::from_utf8_lossy(&buf[i.saturating_sub(40)..(i + 40).min(k)])
                        .into_owned();
                    return Err(format!(
                        "byte {off} is {:?}, expected {:?} (around: {ctx:?})",
                        b as char, want as char
                    ));
                }
            }
            got += k as u64;
            progress.store(got, Ordering::SeqCst);
        }
    })
}

/// `yes | head -c BIG | tr` run by cr_run (PID 1 of a new PID namespace)
/// with its stdout a pipe the test reads. The test stops reading, so every
/// pipe of the tree fills up and each stage blocks in write(2); then the job
/// is checkpointed through cr_run's PID and killed. The test drains what is
/// left in its pipe and reads the rest through the stdout of cr_restart
/// (fd 1 led outside the tree, so it is re-attached to cr_restart's): the
/// two parts add up to exactly the expected stream.
#[test]
fn yes_head_tr_in_a_pid_namespace_streams_into_a_pipe_across_restore() {
    let _sweep = Sweep;
    let h = Harness::new("real-yes-pipe");
    let big: u64 = 256 << 20;
    let first: u64 = 32 << 20;
    let img = h.image_dir("img");
    let script = format!("yes 0123456789abcdef | head -c {big} | tr 0-9a-f a-p");
    let err1 = h.dir.join("cr_run.err");
    let mut cmd = Command::new(tool_path("cr_run"));
    cmd.arg("--dir")
        .arg(&img)
        .args(["--", SH, "-c", &script])
        .current_dir(&h.dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(&err1).expect("create cr_run.err"));
    let mut run = Kid::spawn(cmd, "cr_run");
    let limit = Arc::new(AtomicU64::new(first));
    let progress = Arc::new(AtomicU64::new(0));
    let reader1 = pattern_reader(
        run.child.stdout.take().expect("piped stdout"),
        0,
        limit.clone(),
        progress.clone(),
    );
    let run_pid = run.pid();
    let diag1 = || {
        format!(
            "read {} bytes\n{}\n--- cr_run stderr:\n{}",
            progress.load(Ordering::SeqCst),
            describe_tree(run_pid),
            read_text(&err1)
        )
    };
    wait_until(
        "the test to read the first 32 MiB",
        LINE_TIMEOUT,
        || progress.load(Ordering::SeqCst) >= first,
        diag1,
    );
    // cr_run, sh (PID 1 inside), yes, head, tr: every stage blocked in write.
    let blocked_writers = || {
        let tree = tree_pids(run_pid);
        let stages: Vec<i32> = tree
            .iter()
            .copied()
            .filter(|&p| {
                proc_status(p).is_some_and(|s| ["yes", "head", "tr"].contains(&s.name.as_str()))
            })
            .collect();
        stages.len() == 3
            && stages.iter().all(|&p| {
                proc_status(p).is_some_and(|s| s.state == 'S')
                    && blocked_syscall(p) == Some(libc::SYS_write)
            })
    };
    wait_until(
        "yes, head and tr all blocked writing into full pipes",
        Duration::from_secs(30),
        blocked_writers,
        diag1,
    );

    let out = h.run_tool(
        "cr_checkpoint",
        &["--kill".as_ref(), run_pid.to_string().as_ref()],
        &RunOpts::default(),
    );
    out.assert_success("cr_checkpoint --kill <cr_run pid>");
    let st = run.wait(Duration::from_secs(20), diag1);
    assert_eq!(
        st.code(),
        Some(128 + libc::SIGKILL),
        "cr_run returns the killed job's status"
    );
    limit.store(u64::MAX, Ordering::SeqCst);
    let n1 = reader1
        .join()
        .expect("reader thread")
        .unwrap_or_else(|e| panic!("stream before the checkpoint: {e}"));
    assert!(
        n1 >= first && n1 < big,
        "read {n1} bytes before the checkpoint: expected the job frozen mid-stream (total {big})"
    );
    eprintln!("read {n1} of {big} bytes before the checkpoint");

    let err2 = h.dir.join("cr_restart.err");
    let mut cmd = Command::new(tool_path("cr_restart"));
    cmd.arg(VERIFY)
        .arg(&img)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(&err2).expect("create cr_restart.err"));
    let mut rst = Kid::spawn(cmd, "cr_restart");
    let progress2 = Arc::new(AtomicU64::new(0));
    let reader2 = pattern_reader(
        rst.child.stdout.take().expect("piped stdout"),
        n1,
        Arc::new(AtomicU64::new(u64::MAX)),
        progress2.clone(),
    );
    let rst_pid = rst.pid();
    let st = rst.wait(Duration::from_secs(90), || {
        format!(
            "read {} bytes after restore\n{}\n--- cr_restart stderr:\n{}",
            progress2.load(Ordering::SeqCst),
            describe_tree(rst_pid),
            read_text(&err2)
        )
    });
    let n2 = reader2.join().expect("reader thread").unwrap_or_else(|e| {
        panic!(
            "stream after the restore (had {n1} bytes before): {e}\n--- cr_restart stderr:\n{}",
            read_text(&err2)
        )
    });
    assert!(
        st.success(),
        "cr_restart should exit 0 (the pipeline's status), got {st:?}\n--- stderr:\n{}",
        read_text(&err2)
    );
    assert_eq!(
        n1 + n2,
        big,
        "{n1} bytes before the checkpoint + {n2} after the restore: bytes lost or doubled"
    );
}

/// fds of `pid` open on files under `dir`.
fn fds_under(pid: i32, dir: &Path) -> Vec<(i32, String)> {
    let dir = dir.to_string_lossy().into_owned();
    fd_list(pid)
        .into_iter()
        .filter(|(_, t)| t.starts_with(&dir))
        .collect()
}

/// GNU sort with a 1 MiB buffer (so it spills sorted runs to temp files and
/// merges them) fed by `seq | awk` with a permutation of 0..N-1, run by
/// `cr_run --no-pidns`, checkpointed through cr_run's PID, either while it
/// reads its input and spills, or while it merges (temp files open). After
/// the restore sorted.txt is 0..N-1 and sort removed its temp files.
fn sort_job(merging: bool) {
    let h = Harness::new(if merging {
        "real-sort-merge"
    } else {
        "real-sort-spill"
    });
    let n: u64 = 3_000_000;
    let script = format!(
        "mkdir -p tmp && seq 1 {n} | awk '{{print ($1 * 7919) % {n}}}' \
         | sort -n -S 1M --parallel=1 -T tmp > sorted.txt && echo DONE"
    );
    let pid_file = h.dir.join("job.pid");
    let cr_run = tool_path("cr_run");
    let mut wl = h.spawn_program(
        "cr_run",
        &cr_run,
        &[
            OsStr::new("--no-pidns"),
            OsStr::new("--pid-file"),
            pid_file.as_os_str(),
            OsStr::new("--"),
            OsStr::new(SH),
            OsStr::new("-c"),
            OsStr::new(&script),
        ],
        &[],
    );
    let tmp = wl.workdir.join("tmp");
    let sorted = wl.workdir.join("sorted.txt");
    let temp_files = || std::fs::read_dir(&tmp).map(|d| d.count()).unwrap_or(0);
    let sort_pid = || child_named_in_tree(wl.pid(), "sort");
    if merging {
        let mut seen = false;
        wait_until(
            "sort to merge (2 or more temp files open)",
            LINE_TIMEOUT,
            || match sort_pid() {
                Some(p) => {
                    seen = true;
                    fds_under(p, &tmp).len() >= 2
                }
                None => {
                    assert!(
                        !seen,
                        "sort ended before the test saw it merge\n{}",
                        wl.diag()
                    );
                    false
                }
            },
            || format!("{}\n{}", describe_tree(wl.pid()), wl.diag()),
        );
    } else {
        wait_until(
            "sort to spill at least 2 temp files",
            LINE_TIMEOUT,
            || temp_files() >= 2,
            || format!("{}\n{}", describe_tree(wl.pid()), wl.diag()),
        );
    }
    let job: i32 = read_text(&pid_file)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("cr_run --pid-file: {:?}", read_text(&pid_file)));
    let pids = tree_pids(job);
    let sort =
        sort_pid().unwrap_or_else(|| panic!("sort is part of the job\n{}", describe_tree(job)));
    let spilled = temp_files();
    let open = fds_under(sort, &tmp);
    let img = h.image_dir("img");
    kill_cr_run_job(
        &h,
        &mut wl,
        &img,
        &pids,
        "cr_checkpoint --kill <cr_run pid>",
    );
    let at = file_len(&sorted);
    assert!(
        at < n * 7,
        "sort had written its whole output before the checkpoint"
    );
    let state = format!(
        "checkpointed with {spilled} temp files, sort had {} of them open, sorted.txt at {at} bytes",
        open.len()
    );
    eprintln!("{state}");

    let mut r = h.restore_bg(&img, job);
    let res = r.wait(Duration::from_secs(90), &wl);
    assert!(
        res.status.success() && wl.output().trim() == "DONE",
        "restored job ({state}) should finish with exit 0 and print DONE\n{}\n{}",
        res.show(),
        wl.diag()
    );
    check_lines(&sorted, n, |i| i - 1).unwrap_or_else(|e| panic!("sorted.txt ({state}): {e}"));
    let left: Vec<String> = std::fs::read_dir(&tmp)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    assert!(
        left.is_empty(),
        "sort left temp files behind ({state}): {left:?}"
    );
}

#[test]
fn sort_spilling_to_temp_files_under_cr_run_no_pidns() {
    let _sweep = Sweep;
    sort_job(false);
}

#[test]
fn sort_merging_temp_files_under_cr_run_no_pidns() {
    let _sweep = Sweep;
    sort_job(true);
}

/// `seq 1 N | gzip -c > out.gz` frozen while gzip writes (its deflate state
/// lives in its memory): after the restore `gzip -dc` gives back exactly
/// 1..N, and `gzip -t` finds the stream and its CRC intact.
#[test]
fn gzip_compressing_a_stream_frozen_mid_stream() {
    let _sweep = Sweep;
    let h = Harness::new("real-gzip");
    let n: u64 = 6_000_000;
    let script = format!("seq 1 {n} | gzip -c > out.gz && echo DONE");
    let (wl, gz, img, pids) = sh_killed_mid_stream(
        &h,
        "gzip",
        &script,
        "out.gz",
        1 << 20,
        3,
        "sh with seq and gzip",
    );
    let pid = pids[0];
    let at = file_len(&gz);
    assert!(
        is_gzip_unfinished(&h, &gz),
        "gzip had finished before the checkpoint"
    );
    eprintln!("checkpointed with out.gz at {at} bytes");

    let mut r = h.restore_bg(&img, pid);
    let res = r.wait(Duration::from_secs(90), &wl);
    assert!(
        res.status.success() && wl.output().trim() == "DONE",
        "restored gzip pipeline should finish with exit 0 and print DONE\n{}\n{}",
        res.show(),
        wl.diag()
    );
    let gzip = need_program("gzip");
    let (st, _, err) = run_cmd(
        &h,
        &gzip,
        &[OsStr::new("-t"), gz.as_os_str()],
        Duration::from_secs(60),
    );
    assert!(
        st.success(),
        "gzip -t {} (frozen at {at} bytes): {err}",
        gz.display()
    );
    let dec = wl.workdir.join("dec.txt");
    let (st, _, err) = run_cmd(
        &h,
        Path::new(SH),
        &[
            OsStr::new("-c"),
            OsStr::new("gzip -dc \"$0\" > \"$1\""),
            gz.as_os_str(),
            dec.as_os_str(),
        ],
        Duration::from_secs(60),
    );
    assert!(st.success(), "gzip -dc: {err}");
    check_lines(&dec, n, |i| i)
        .unwrap_or_else(|e| panic!("gzip -dc out.gz (frozen at {at} bytes): {e}"));
}

/// True if `gzip -t` finds the file truncated (the compressor had not
/// finished writing it).
fn is_gzip_unfinished(h: &Harness, gz: &Path) -> bool {
    let gzip = need_program("gzip");
    let (st, _, _) = run_cmd(
        h,
        &gzip,
        &[OsStr::new("-t"), gz.as_os_str()],
        Duration::from_secs(60),
    );
    !st.success()
}

/// Bytes waiting in a pipe (FIONREAD works on either end).
fn pipe_pending(fd: &impl AsRawFd) -> i32 {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through a valid pointer.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::FIONREAD, &mut n) };
    assert_eq!(r, 0, "FIONREAD: {}", std::io::Error::last_os_error());
    n
}

/// `sh -c 'tr a-z A-Z | nl -ba > out.txt'` reading its stdin from a pipe the
/// test writes: the first half goes in, is consumed (tr waits on an empty
/// pipe; nl holds lines in its stdio buffer), the job is checkpointed and
/// killed; the second half goes into the stdin of cr_restart (fd 0 led
/// outside the tree, so it is re-attached to cr_restart's), then end of
/// input. out.txt is every line, upper-cased and numbered, exactly once.
#[test]
fn tr_nl_job_reads_stdin_from_the_test_then_through_cr_restart() {
    let _sweep = Sweep;
    use std::io::Write;
    let h = Harness::new("real-stdin");
    let work = h.dir.join("work");
    std::fs::create_dir_all(&work).expect("mkdir work");
    let lines: Vec<String> = (0..40_000)
        .map(|i| format!("line {i} of the input, quick brown fox {}", i * 7))
        .collect();
    let (first, second) = lines.split_at(25_000);
    let err = work.join("stderr.txt");
    let mut cmd = Command::new(SH);
    cmd.args([
        "-c",
        "tr a-z A-Z | nl -ba > out.txt && echo DONE > done.txt",
    ])
    .current_dir(&work)
    .stdin(Stdio::piped())
    .stdout(File::create(work.join("stdout.txt")).expect("stdout"))
    .stderr(File::create(&err).expect("stderr"));
    let mut job = Kid::spawn(cmd, "sh (tr | nl)");
    let pid = job.pid();
    let mut stdin = job.child.stdin.take().expect("piped stdin");
    let chunk: String = first.iter().map(|l| format!("{l}\n")).collect();
    stdin
        .write_all(chunk.as_bytes())
        .expect("write the first half");
    let find = |name: &str| child_named(pid, name);
    wait_until(
        "tr to consume the first half and wait on the empty pipe",
        LINE_TIMEOUT,
        || {
            pipe_pending(&stdin) == 0
                && find("tr").is_some_and(|p| blocked_syscall(p) == Some(libc::SYS_read))
                && find("nl").is_some_and(|p| blocked_syscall(p) == Some(libc::SYS_read))
        },
        || format!("{}\n{}", describe_tree(pid), read_text(&err)),
    );
    let pids = tree_pids(pid);
    assert_eq!(pids.len(), 3, "sh with tr and nl:\n{}", describe_tree(pid));
    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], pid)
        .assert_success("cr_checkpoint --kill <sh (tr | nl)>");
    job.wait(Duration::from_secs(20), || read_text(&err));
    reap_descendants(&pids[1..]);
    drop(stdin);
    let out = work.join("out.txt");
    let at = file_len(&out);

    let err2 = h.dir.join("cr_restart.err");
    let mut cmd = Command::new(tool_path("cr_restart"));
    cmd.arg(VERIFY)
        .arg(&img)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(File::create(&err2).expect("create cr_restart.err"));
    let mut rst = Kid::spawn(cmd, "cr_restart");
    let mut stdin = rst.child.stdin.take().expect("piped stdin");
    let chunk: String = second.iter().map(|l| format!("{l}\n")).collect();
    stdin.write_all(chunk.as_bytes()).unwrap_or_else(|e| {
        panic!(
            "write the second half into cr_restart's stdin: {e}\n{}",
            read_text(&err2)
        )
    });
    drop(stdin);
    let rst_pid = rst.pid();
    let st = rst.wait(Duration::from_secs(60), || {
        format!(
            "{}\n--- cr_restart stderr:\n{}",
            describe_tree(rst_pid),
            read_text(&err2)
        )
    });
    assert!(
        st.success() && read_text(&work.join("done.txt")).trim() == "DONE",
        "the restored job should finish with exit 0 at end of input, got {st:?}\n--- cr_restart stderr:\n{}\n--- job stderr:\n{}",
        read_text(&err2),
        read_text(&err)
    );
    let text = read_text(&out);
    let got: Vec<&str> = text.lines().collect();
    assert_eq!(
        got.len(),
        lines.len(),
        "out.txt line count (had {at} bytes at the checkpoint)"
    );
    for (i, (g, l)) in got.iter().zip(&lines).enumerate() {
        let want = format!("{:>6}\t{}", i + 1, l.to_uppercase());
        assert_eq!(
            *g,
            want,
            "out.txt line {} (had {at} bytes at the checkpoint)",
            i + 1
        );
    }
}

/// Appends lines to a file (opened, written, closed: a separate writer).
fn append_lines(path: &Path, lines: impl Iterator<Item = String>) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let text: String = lines.map(|l| l + "\n").collect();
    f.write_all(text.as_bytes()).expect("append");
}

/// fd_list without the inode numbers of pipes and sockets (new ones after a
/// restore).
fn fds_no_inode(pid: i32) -> Vec<(i32, String)> {
    fd_list(pid)
        .into_iter()
        .map(|(fd, t)| match t.split_once(":[") {
            Some((kind, _)) if kind == "pipe" || kind == "socket" => (fd, kind.to_string()),
            _ => (fd, t),
        })
        .collect()
}

fn line_count(path: &Path) -> usize {
    read_text(path).lines().count()
}

/// GNU `tail -f` (which waits for changes with an inotify watch, in poll(2))
/// piped into `sed -u` that stops at END. Checkpointed while it waits,
/// restored; the lines appended after the restore still reach out.txt
/// (the inotify watch works again) and END ends the job.
#[test]
fn tail_f_with_inotify_follows_a_file_across_restore() {
    let _sweep = Sweep;
    let h = Harness::new("real-tail-f");
    let mut wl = spawn_sh(
        &h,
        "tail",
        "touch in.log && tail -n +1 -f in.log | sed -u '/^END$/q' > out.txt; echo DONE",
    );
    let input = wl.workdir.join("in.log");
    let out = wl.workdir.join("out.txt");
    let pid = wl.pid();
    let tail_pid = || child_named_in_tree(pid, "tail");
    let sed_pid = || child_named_in_tree(pid, "sed");
    let waiting = |tail: Option<i32>, sed: Option<i32>| {
        tail.is_some_and(|p| {
            proc_status(p).is_some_and(|s| s.state == 'S' && s.tracer_pid == 0)
                && blocked_syscall(p).is_some_and(|n| READ_SYSCALLS.contains(&n))
        }) && sed.is_some_and(|p| {
            proc_status(p).is_some_and(|s| s.state == 'S' && s.tracer_pid == 0)
                && blocked_syscall(p) == Some(libc::SYS_read)
        })
    };
    wait_until(
        "tail and sed to wait",
        LINE_TIMEOUT,
        || input.exists() && waiting(tail_pid(), sed_pid()),
        || format!("{}\n{}", describe_tree(pid), wl.diag()),
    );
    append_lines(&input, (1..=500).map(|i| format!("entry {i}")));
    wait_until(
        "the first 500 lines to reach out.txt",
        LINE_TIMEOUT,
        || line_count(&out) == 500,
        || format!("{}\n{}", describe_tree(pid), wl.diag()),
    );
    let tail_p = tail_pid().expect("tail runs");
    assert!(
        fd_list(tail_p)
            .iter()
            .any(|(_, t)| t == "anon_inode:inotify"),
        "tail -f watches with inotify: {:?}",
        fd_list(tail_p)
    );
    wait_until(
        "tail and sed to wait again",
        LINE_TIMEOUT,
        || waiting(tail_pid(), sed_pid()),
        || describe_tree(pid),
    );
    let pids = tree_pids(pid);
    let fds_before = fds_no_inode(tail_p);
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    reap_descendants(&pids[1..]);

    let mut r = h.restore_bg(&img, pid);
    wait_until(
        "the restored tail and sed to wait",
        LINE_TIMEOUT,
        || tree_pids(pid) == pids && waiting(Some(tail_p), sed_pid()),
        || format!("{}\n{}", r.diag(), describe_tree(pid)),
    );
    assert_eq!(fds_no_inode(tail_p), fds_before, "the restored tail's fds");
    append_lines(&input, (501..=1000).map(|i| format!("entry {i}")));
    wait_until(
        "the lines appended after the restore to reach out.txt",
        Duration::from_secs(30),
        || line_count(&out) == 1000,
        || {
            format!(
                "{}\n{}\n{}",
                r.diag(),
                describe_tree(pid),
                tail(&read_text(&out), 3)
            )
        },
    );
    append_lines(&input, ["END".to_string()].into_iter());
    let res = r.wait(Duration::from_secs(30), &wl);
    assert!(
        res.status.success() && wl.output().trim() == "DONE",
        "the restored job should end at END\n{}\n{}",
        res.show(),
        wl.diag()
    );
    let want: String = (1..=1000)
        .map(|i| format!("entry {i}\n"))
        .chain(["END\n".to_string()])
        .collect();
    assert!(
        read_text(&out) == want,
        "out.txt is not entry 1..1000 and END:\n{}",
        tail(&read_text(&out), 5)
    );
}

/// `flock -n FILE true`: 0 if the lock is free, 1 if someone holds it.
fn flock_free(h: &Harness, lock: &Path) -> bool {
    let flock = need_program("flock");
    let (st, _, err) = run_cmd(
        h,
        &flock,
        &[
            OsStr::new("-n"),
            OsStr::new("-x"),
            lock.as_os_str(),
            OsStr::new("true"),
        ],
        Duration::from_secs(20),
    );
    match st.code() {
        Some(0) => true,
        Some(1) => false,
        _ => panic!("flock -n {}: {st:?} {err}", lock.display()),
    }
}

/// util-linux `flock -x job.lock sleep 60` holds an flock(2) lock while its
/// child runs. Checkpointed and killed (the lock is free then), restored:
/// the restored flock holds the lock again, until its child ends.
#[test]
fn flock_command_holds_its_lock_again_after_restore() {
    let _sweep = Sweep;
    let h = Harness::new("real-flock");
    let flock = need_program("flock");
    let work = h.dir.join("work");
    std::fs::create_dir_all(&work).expect("mkdir work");
    let lock = work.join("job.lock");
    let mut wl = h.spawn_program(
        "flock",
        &flock,
        &[
            OsStr::new("-x"),
            lock.as_os_str(),
            OsStr::new(SH),
            OsStr::new("-c"),
            OsStr::new("sleep 60"),
        ],
        &[],
    );
    let pid = wl.pid();
    wait_until(
        "flock to take the lock and run sleep",
        LINE_TIMEOUT,
        || child_named_in_tree(pid, "sleep").is_some(),
        || format!("{}\n{}", describe_tree(pid), wl.diag()),
    );
    assert!(
        !flock_free(&h, &lock),
        "flock holds the lock while sleep runs"
    );
    let locks = |p: i32| -> Vec<String> {
        fd_list(p)
            .into_iter()
            .flat_map(|(fd, _)| {
                read_text(Path::new(&format!("/proc/{p}/fdinfo/{fd}")))
                    .lines()
                    .filter(|l| l.starts_with("lock:"))
                    .map(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        format!(
                            "fd {fd}: {}",
                            f.iter()
                                .skip(2)
                                .filter(|w| **w != p.to_string())
                                .copied()
                                .collect::<Vec<_>>()
                                .join(" ")
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let locks_before = locks(pid);
    assert!(
        locks_before.iter().any(|l| l.contains("FLOCK")),
        "flock's fd shows an FLOCK lock: {locks_before:?}"
    );
    let pids = tree_pids(pid);
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    reap_descendants(&pids[1..]);
    assert!(
        flock_free(&h, &lock),
        "the lock is free once the job is killed"
    );

    let mut r = h.restore_bg(&img, pid);
    wait_until(
        "the restored flock and sleep",
        LINE_TIMEOUT,
        || {
            tree_pids(pid) == pids
                && pids
                    .iter()
                    .all(|&p| proc_status(p).is_some_and(|s| s.tracer_pid == 0 && s.state == 'S'))
        },
        || format!("{}\n{}", r.diag(), describe_tree(pid)),
    );
    assert_eq!(
        locks(pid),
        locks_before,
        "the restored flock's locks (fdinfo)"
    );
    assert!(
        !flock_free(&h, &lock),
        "the restored flock should hold job.lock again\n{}",
        r.diag()
    );
    let sleep = child_named_in_tree(pid, "sleep").expect("the restored sleep");
    // SAFETY: kill(2) of the restored sleep, a process of the tree we restored.
    unsafe { libc::kill(sleep, libc::SIGTERM) };
    let res = r.wait(Duration::from_secs(30), &wl);
    assert_eq!(
        res.status.code(),
        Some(128 + libc::SIGTERM),
        "flock returns 128+SIGTERM when its child is terminated; cr_restart passes it on\n{}",
        res.show()
    );
    assert!(
        flock_free(&h, &lock),
        "the lock is free after the job ended"
    );
}

/// python3's multiprocessing.Pool (fork): the main process with its handler
/// threads, 3 workers, task and result pipes, and semaphores that are
/// deleted /dev/shm files mapped shared by all. Checkpointed mid-map and
/// killed, restored: every result arrives exactly once and is right.
#[test]
fn python_multiprocessing_pool_mid_map() {
    let _sweep = Sweep;
    let h = Harness::new("real-mp-pool");
    let n: u64 = 150_000;
    let mut wl = h.spawn_python("real_mp_pool.py", &[&n.to_string()]);
    wl.wait_ready();
    let done = |l: &str, k: u64| {
        l.strip_prefix("done ")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v >= k)
    };
    wl.wait_line("10000 results", |l| done(l, 10_000));
    let pid = wl.pid();
    let pids = tree_pids(pid);
    assert_eq!(
        pids.len(),
        4,
        "the main process and 3 workers\n{}",
        describe_tree(pid)
    );
    let maps = read_text(Path::new(&format!("/proc/{pid}/maps")));
    assert!(
        maps.lines()
            .any(|l| l.contains("/dev/shm/sem.") && l.ends_with("(deleted)")),
        "the pool's semaphores are deleted /dev/shm mappings:\n{maps}"
    );
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    reap_descendants(&pids[1..]);
    let at = wl
        .lines()
        .iter()
        .filter_map(|l| l.strip_prefix("done ")?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    assert!(at < n, "the map had finished before the checkpoint");
    eprintln!("checkpointed at {at} of {n} results");

    let mut r = h.restore_bg(&img, pid);
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(
        &res,
        &wl,
        &format!("multiprocessing pool checkpointed at {at} results"),
    );
    let counts: Vec<u64> = wl
        .lines()
        .iter()
        .filter_map(|l| l.strip_prefix("done ")?.parse().ok())
        .collect();
    assert_eq!(
        counts,
        (1..=n / 200).map(|k| k * 200).collect::<Vec<_>>(),
        "progress lines\n{}",
        wl.diag()
    );
    assert!(
        wl.lines()
            .iter()
            .any(|l| *l == format!("final {n} workers 3")),
        "all results from the same 3 workers\n{}",
        wl.diag()
    );
}

/// python3's multiprocessing.Manager: a server process listening on a unix
/// socket path, connections from the main process and two workers, all
/// busy with request/reply traffic. Checkpointed and killed mid-run,
/// restored: no request is lost or repeated (each worker's steps arrive in
/// order exactly once) and the shared dict ends right.
#[test]
fn python_multiprocessing_manager_over_unix_sockets() {
    let _sweep = Sweep;
    let h = Harness::new("real-mp-manager");
    let n: u64 = 12_000;
    let mut wl = h.spawn_python("real_mp_manager.py", &[&n.to_string()]);
    wl.wait_ready();
    wl.wait_line("3000 items", |l| {
        l.strip_prefix("got ")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v >= 3000)
    });
    let pid = wl.pid();
    let pids = tree_pids(pid);
    assert_eq!(
        pids.len(),
        4,
        "the main process, the manager server and 2 workers\n{}",
        describe_tree(pid)
    );
    let sockets = pids
        .iter()
        .flat_map(|&p| fd_list(p))
        .filter(|(_, t)| t.starts_with("socket:"))
        .count();
    assert!(
        sockets >= 4,
        "unix socket connections in the tree: {sockets}"
    );
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    reap_descendants(&pids[1..]);
    let at = wl
        .lines()
        .iter()
        .filter_map(|l| l.strip_prefix("got ")?.parse::<u64>().ok())
        .max()
        .unwrap_or(0);
    assert!(at < 2 * n, "the run had finished before the checkpoint");
    eprintln!(
        "checkpointed at {at} of {} items ({sockets} sockets)",
        2 * n
    );

    let mut r = h.restore_bg(&img, pid);
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(
        &res,
        &wl,
        &format!("multiprocessing manager checkpointed at {at} items"),
    );
    assert!(
        wl.lines().iter().any(|l| *l == format!("final {}", 2 * n)),
        "{}",
        wl.diag()
    );
}

// ---------------------------------------------------------------------------
// 2. SQLite
// ---------------------------------------------------------------------------

const ROWS_PER_TX: u64 = 20;

/// `sqlite3 DB SQL` (the CLI, busy timeout 0).
fn sqlite(h: &Harness, db: &Path, sql: &str) -> (ExitStatus, String, String) {
    let exe = need_program("sqlite3");
    run_cmd(
        h,
        &exe,
        &[db.as_os_str(), OsStr::new(sql)],
        Duration::from_secs(30),
    )
}

/// The `count N` lines go 20, 40, 60, ... with no gap and no duplicate;
/// returns the last.
fn check_sqlite_counts(out: &str) -> Result<u64, String> {
    let mut expect = ROWS_PER_TX;
    for l in out.lines() {
        if let Some(v) = l.strip_prefix("count ") {
            let v: u64 = v.parse().map_err(|_| format!("bad line {l:?}"))?;
            if v != expect {
                return Err(format!("count {v} where {expect} was expected"));
            }
            expect += ROWS_PER_TX;
        }
    }
    Ok(expect - ROWS_PER_TX)
}

/// With another connection (the sqlite3 CLI, another process): a write
/// fails with "database is locked", and a read sees `committed` rows.
fn assert_locked_by_writer(
    h: &Harness,
    db: &Path,
    committed: u64,
    ctx: &str,
    diag: &dyn Fn() -> String,
) {
    let (st, out, err) = sqlite(
        h,
        db,
        "INSERT INTO t (id, v, pad) VALUES (-1, 1, 'intruder');",
    );
    assert!(
        !st.success() && err.contains("database is locked"),
        "{ctx}: a second writer should fail with `database is locked` while the \
         writer holds its transaction, got {st:?}\nstdout: {out}\nstderr: {err}\n{}",
        diag()
    );
    let (st, out, err) = sqlite(h, db, "SELECT count(*), coalesce(max(id), 0) FROM t;");
    assert!(
        st.success() && out.trim() == format!("{committed}|{committed}"),
        "{ctx}: a reader should see the {committed} committed rows, got {st:?}\n\
         stdout: {out}\nstderr: {err}\n{}",
        diag()
    );
}

/// The POSIX (fcntl) locks `pid` holds, per fd, from the `lock:` lines of
/// /proc/PID/fdinfo/FD (a consistent per-file view; /proc/locks is read in
/// pages and can skip or repeat entries while other processes lock):
/// "fd N: POSIX ADVISORY WRITE <dev:inode> <start> <end>", sorted.
fn posix_locks(pid: i32) -> Vec<String> {
    let mut v = Vec::new();
    for (fd, _) in fd_list(pid) {
        let info = read_text(Path::new(&format!("/proc/{pid}/fdinfo/{fd}")));
        for l in info.lines() {
            let Some(rest) = l.strip_prefix("lock:") else {
                continue;
            };
            // "1: POSIX  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() == 8 && f[1] == "POSIX" {
                v.push(format!(
                    "fd {fd}: {} {} {} {} {} {}",
                    f[1], f[2], f[3], f[5], f[6], f[7]
                ));
            }
        }
    }
    v.sort();
    v
}

/// The database checked with the sqlite3 CLI: integrity ok, rows 1..m
/// exactly once with their values, journal mode as set.
fn check_db_with_cli(h: &Harness, db: &Path, m: u64, mode: &str) {
    let (st, out, err) = sqlite(
        h,
        db,
        "PRAGMA integrity_check; \
         SELECT count(*), min(id), max(id), sum(id), sum(v = id * id), count(DISTINCT id) FROM t; \
         PRAGMA journal_mode;",
    );
    let want = format!("ok\n{m}|1|{m}|{}|{m}|{m}\n{mode}", m * (m + 1) / 2);
    assert!(
        st.success() && out.trim() == want,
        "sqlite3 CLI check of {}: expected\n{want}\ngot ({st:?})\n{out}\nstderr: {err}",
        db.display()
    );
}

/// A writer in a busy loop of transactions is checkpointed wherever it is
/// and killed; the restored writer goes on to the target.
fn sqlite_busy_writer(mode: &str) {
    let h = Harness::new(&format!("real-sqlite-{mode}"));
    let target: u64 = 300_000;
    let mut wl = h.spawn_python("real_sqlite_writer.py", &[mode, &target.to_string(), "0"]);
    wl.wait_ready();
    wl.wait_line("10000 rows", |l| {
        l.strip_prefix("count ")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v >= 10_000)
    });
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let at = check_sqlite_counts(&wl.output())
        .unwrap_or_else(|e| panic!("before restore: {e}\n{}", wl.diag()));
    assert!(
        at < target,
        "the writer had finished before the checkpoint: not mid-stream"
    );
    eprintln!("checkpointed at {at} of {target} rows");

    let mut r = h.restore_bg(&img, pid);
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(
        &res,
        &wl,
        &format!("sqlite writer ({mode}) checkpointed at {at} rows"),
    );
    let last = check_sqlite_counts(&wl.output())
        .unwrap_or_else(|e| panic!("after restore (checkpointed at {at}): {e}\n{}", wl.diag()));
    assert_eq!(last, target, "{}", wl.diag());
    check_db_with_cli(&h, &wl.workdir.join("test.db"), target, mode);
}

#[test]
fn sqlite_rollback_journal_writer_killed_mid_loop() {
    let _sweep = Sweep;
    sqlite_busy_writer("delete");
}

#[test]
fn sqlite_wal_writer_killed_mid_loop() {
    let _sweep = Sweep;
    sqlite_busy_writer("wal");
}

/// The writer is checkpointed inside a transaction (rows inserted, not
/// committed, write lock held; rollback mode: -journal live; WAL: the
/// WAL write lock in -shm). After the restore another process still cannot
/// write and reads only committed rows; then the writer commits and goes on.
fn sqlite_writer_holding_its_lock(mode: &str) {
    let h = Harness::new(&format!("real-sqlite-hold-{mode}"));
    let target: u64 = 4000;
    let hold_tx = 50;
    let committed = (hold_tx - 1) * ROWS_PER_TX;
    let mut wl = h.spawn_python(
        "real_sqlite_writer.py",
        &[mode, &target.to_string(), &hold_tx.to_string()],
    );
    wl.wait_ready();
    let want = format!(
        "HOLD committed={committed} pending={}",
        committed + ROWS_PER_TX
    );
    wl.wait_line(&want, |l| l == want);
    let db = wl.workdir.join("test.db");
    let hold = wl.workdir.join("hold");
    assert!(
        hold.exists(),
        "the writer creates {} before HOLD",
        hold.display()
    );
    assert_locked_by_writer(&h, &db, committed, "before the checkpoint", &|| wl.diag());
    if mode == "delete" {
        assert!(
            wl.workdir.join("test.db-journal").exists(),
            "a rollback journal exists while the transaction is open"
        );
    }
    let pid = wl.pid();
    let locks_before = posix_locks(pid);
    let fds_before = fd_list(pid);
    assert!(
        !locks_before.is_empty(),
        "the writer holds POSIX locks inside its transaction (/proc/{pid}/fdinfo)"
    );
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    // Nothing may touch the database now: with the writer dead, its journal
    // is hot and any connection would roll it back.

    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(30));
    assert_eq!(
        fd_list(pid),
        fds_before,
        "the restored writer's fds differ from the original's"
    );
    assert_eq!(
        posix_locks(pid),
        locks_before,
        "the restored writer's POSIX locks (/proc/PID/fdinfo) differ from the original's"
    );
    let rdiag = r.diag();
    assert_locked_by_writer(&h, &db, committed, "after the restore", &|| {
        format!("{rdiag}\n{}", wl.diag())
    });
    std::fs::remove_file(&hold).expect("remove hold");
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(
        &res,
        &wl,
        &format!("sqlite writer ({mode}) restored inside its transaction"),
    );
    let last =
        check_sqlite_counts(&wl.output()).unwrap_or_else(|e| panic!("counts: {e}\n{}", wl.diag()));
    assert_eq!(last, target, "{}", wl.diag());
    check_db_with_cli(&h, &db, target, mode);
}

#[test]
fn sqlite_rollback_journal_writer_restored_inside_its_transaction_keeps_the_lock() {
    let _sweep = Sweep;
    sqlite_writer_holding_its_lock("delete");
}

#[test]
fn sqlite_wal_writer_restored_inside_its_transaction_keeps_the_lock() {
    let _sweep = Sweep;
    sqlite_writer_holding_its_lock("wal");
}

// ---------------------------------------------------------------------------
// 3. tmux + cr_restart --shell-job
// ---------------------------------------------------------------------------

/// A private tmux server (its own socket, no config) with one 80x24 pane
/// running /bin/sh. Killed on drop.
struct Tmux<'a> {
    h: &'a Harness,
    exe: PathBuf,
    sock: PathBuf,
    server: Option<Proc>,
    pane_pid: i32,
    pane_tty: PathBuf,
    /// Processes started in the pane that we must not leave behind.
    extra: Vec<Proc>,
}

impl<'a> Tmux<'a> {
    fn start(h: &'a Harness) -> Tmux<'a> {
        let exe = need_program("tmux");
        let sock = h.dir.join("tmux.sock");
        let mut t = Tmux {
            h,
            exe,
            sock,
            server: None,
            pane_pid: 0,
            pane_tty: PathBuf::new(),
            extra: Vec::new(),
        };
        let env = need_program("env");
        let env = env.to_string_lossy();
        t.run_ok(&[
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-s",
            "cr",
            "-x",
            "80",
            "-y",
            "24",
            &env,
            "PS1=sh$ ",
            SH,
        ]);
        let info = t.run_ok(&[
            "display-message",
            "-p",
            "-t",
            "cr",
            "#{pid} #{pane_pid} #{pane_tty}",
        ]);
        let f: Vec<&str> = info.split_whitespace().collect();
        assert_eq!(f.len(), 3, "tmux display-message: {info:?}");
        let server: i32 = f[0].parse().expect("server pid");
        t.server = Some(Proc::adopt(server, "tmux server", None));
        t.pane_pid = f[1].parse().expect("pane pid");
        t.pane_tty = PathBuf::from(f[2]);
        t
    }

    fn run(&self, args: &[&str]) -> (ExitStatus, String, String) {
        let mut a: Vec<&OsStr> = vec![OsStr::new("-S"), self.sock.as_os_str()];
        a.extend(args.iter().map(OsStr::new));
        run_cmd(self.h, &self.exe, &a, Duration::from_secs(20))
    }

    fn run_ok(&self, args: &[&str]) -> String {
        let (st, out, err) = self.run(args);
        assert!(
            st.success(),
            "tmux {args:?} failed ({st:?})\nstdout: {out}\nstderr: {err}"
        );
        out
    }

    /// The pane's text, history included, wrapped lines joined.
    fn screen(&self) -> String {
        self.run_ok(&["capture-pane", "-p", "-J", "-S", "-1000", "-t", "cr"])
    }

    /// Types `text` literally, then presses `key` (Enter, C-j, ...).
    fn type_keys(&self, text: &str, key: &str) {
        // tmux takes an argument ending in `;` for a command separator:
        // send such a last `;` as a hex key.
        match text.strip_suffix(';') {
            Some(head) => {
                if !head.is_empty() {
                    self.run_ok(&["send-keys", "-t", "cr", "-l", head]);
                }
                self.run_ok(&["send-keys", "-t", "cr", "-H", "3b"]);
            }
            None => {
                self.run_ok(&["send-keys", "-t", "cr", "-l", text]);
            }
        }
        self.run_ok(&["send-keys", "-t", "cr", key]);
    }

    fn type_line(&self, text: &str) {
        self.type_keys(text, "Enter");
    }

    /// Waits until a line of the pane satisfies `pred`; returns it.
    fn wait_line(
        &self,
        what: &str,
        pred: impl Fn(&str) -> bool,
        diag: &dyn Fn() -> String,
    ) -> String {
        let deadline = Instant::now() + LINE_TIMEOUT;
        loop {
            let s = self.screen();
            if let Some(l) = s.lines().find(|l| pred(l.trim_end())) {
                return l.trim_end().to_string();
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {LINE_TIMEOUT:?} waiting for {what} in the tmux pane\n\
                     --- pane:\n{}\n--- pane processes:\n{}\n{}",
                    tail(&s, 30),
                    describe_tree(self.pane_pid),
                    diag()
                );
            }
            std::thread::sleep(Duration::from_millis(30));
        }
    }

    /// Waits for a pane line equal to `line`.
    fn wait_exact(&self, line: &str, diag: &dyn Fn() -> String) {
        self.wait_line(&format!("{line:?}"), |l| l == line, diag);
    }

    /// Waits for the output line of a shell command: alone on its line, or
    /// right after the prompt when the terminal does not echo what is typed.
    fn wait_answer(&self, line: &str, diag: &dyn Fn() -> String) {
        let after_prompt = format!("sh$ {line}");
        self.wait_line(
            &format!("{line:?}"),
            |l| l == line || l == after_prompt,
            diag,
        );
    }

    /// The pane processes and the screen, for panic messages.
    fn diag(&self) -> String {
        format!(
            "--- pane:\n{}\n--- pane processes:\n{}",
            tail(&self.screen(), 30),
            describe_tree(self.pane_pid)
        )
    }

    /// The local-mode flags of the pane's terminal, read from outside.
    fn lflag(&self) -> libc::tcflag_t {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOCTTY | libc::O_NONBLOCK)
            .open(&self.pane_tty)
            .unwrap_or_else(|e| panic!("open {}: {e}", self.pane_tty.display()));
        // SAFETY: termios is plain data; tcgetattr fills it from a valid fd.
        let mut tio: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: a valid fd and a valid pointer.
        let r = unsafe { libc::tcgetattr(f.as_raw_fd(), &mut tio) };
        assert_eq!(
            r,
            0,
            "tcgetattr {}: {}",
            self.pane_tty.display(),
            std::io::Error::last_os_error()
        );
        tio.c_lflag
    }

    /// The foreground process group of the pane's terminal (field 8 of
    /// /proc/PID/stat of the pane's shell).
    fn tpgid(&self) -> i32 {
        stat_field(self.pane_pid, 8)
    }
}

impl Drop for Tmux<'_> {
    fn drop(&mut self) {
        let _ = self.run(&["kill-server"]);
        if let Some(mut s) = self.server.take() {
            let _ = s.wait_exit_quiet();
        }
        for p in &mut self.extra {
            p.kill_and_reap();
        }
        reap_orphans();
    }
}

trait QuietWait {
    fn wait_exit_quiet(&mut self) -> Option<()>;
}

impl QuietWait for Proc {
    /// Gives the process up to 5 s to exit; kills it (on drop) otherwise.
    fn wait_exit_quiet(&mut self) -> Option<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.has_exited() {
                return Some(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }
}

/// What a program waiting for terminal input sleeps in: read(2), or the
/// select/poll that readline does first.
const READ_SYSCALLS: &[i64] = &[
    libc::SYS_read,
    libc::SYS_pselect6,
    libc::SYS_select,
    libc::SYS_poll,
    libc::SYS_ppoll,
];

/// Field `n` (1-based, as in proc(5)) of /proc/PID/stat, as a number.
fn stat_field(pid: i32, n: usize) -> i32 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let Some(close) = text.rfind(')') else {
        return -1;
    };
    // Fields after the comm start with field 3 (state).
    text[close + 1..]
        .split_whitespace()
        .nth(n - 3)
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

/// The first process named `name` in the tree of `root`, if any.
fn child_named_in_tree(root: i32, name: &str) -> Option<i32> {
    tree_pids(root)
        .into_iter()
        .find(|&c| proc_status(c).is_some_and(|s| s.name == name))
}

/// The child of `parent` named `name`, if any.
fn child_named(parent: i32, name: &str) -> Option<i32> {
    children(parent)
        .into_iter()
        .find(|&c| proc_status(c).is_some_and(|s| s.name == name))
}

/// Waits until the process `pid` (restored by a `cr_restart --shell-job`
/// typed into the pane) runs `exe` untraced and sleeps in read(2) on the
/// terminal; fails at once if it is stopped (it would be if it were not the
/// terminal's foreground job: SIGTTIN).
fn wait_restored_reader(t: &Tmux, pid: i32, exe: &Path) {
    let reading = READ_SYSCALLS;
    let deadline = Instant::now() + LINE_TIMEOUT;
    loop {
        let st = proc_status(pid);
        let exe_ok = std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe);
        if exe_ok {
            if let Some(s) = &st {
                if s.tracer_pid == 0
                    && s.state == 'S'
                    && blocked_syscall(pid).is_some_and(|n| reading.contains(&n))
                {
                    return;
                }
                if s.tracer_pid == 0 && matches!(s.state, 'T' | 't') {
                    panic!(
                        "the restored process is stopped (not the foreground job of the \
                         terminal? tpgid {} pgrp {}): {}\n{}",
                        t.tpgid(),
                        stat_field(pid, 5),
                        describe(pid),
                        t.diag()
                    );
                }
            }
        }
        if Instant::now() > deadline {
            panic!(
                "timed out waiting for restored pid {pid} to read from the terminal: {}\n{}",
                describe(pid),
                t.diag()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// True once the pane shows the line `echo RESTART-EXIT-$?` prints after
/// cr_restart (not the typed command that contains it).
fn restart_exited(screen: &str) -> bool {
    screen.lines().any(|l| l.starts_with("RESTART-EXIT-"))
}

/// Kills the job running in the pane (`root` and its descendants) with
/// `cr_checkpoint --kill`, then, in the same pane: resets the terminal
/// (`stty sane`, typed then `key`), checks the shell answers, and types
/// `cr_restart --shell-job IMG`. Waits until `root` is back as a child of
/// that cr_restart and `reader` (running `exe`) waits for terminal input.
/// Returns the pid of cr_restart; everything is tracked by `t`.
fn checkpoint_and_restore_in_pane(
    t: &mut Tmux,
    h: &Harness,
    root: i32,
    reader: i32,
    exe: &Path,
    key: &str,
) -> i32 {
    let pids = tree_pids(root);
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &["--kill"], root);
    out.assert_success("cr_checkpoint --kill <job in the pane>");
    wait_until(
        "the shell in the pane to reap the killed job",
        Duration::from_secs(20),
        || !Path::new(&format!("/proc/{root}")).exists(),
        || t.diag(),
    );
    // Its children were reparented to us (subreaper): free their pids.
    reap_descendants(&pids[1..]);
    // The shell takes its terminal back; its settings are what the program
    // left (echo off, raw...): reset them, so that the restore must bring
    // them back.
    t.type_keys("stty sane; echo MARK-$((6*7))", key);
    t.wait_answer("MARK-42", &|| String::new());
    let sane = t.lflag();
    assert!(
        sane & libc::ECHO != 0 && sane & libc::ICANON != 0,
        "stty sane: lflag {sane:#o}"
    );
    let cmd = format!(
        "{} {VERIFY} --shell-job {}; echo RESTART-EXIT-$?",
        tool_path("cr_restart").display(),
        img.display()
    );
    t.type_line(&cmd);
    let pane = t.pane_pid;
    let deadline = Instant::now() + LINE_TIMEOUT;
    let cr = loop {
        if let Some(c) = child_named(pane, "cr_restart") {
            break c;
        }
        if restart_exited(&t.screen()) || Instant::now() > deadline {
            panic!("cr_restart did not start or exited at once\n{}", t.diag());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    t.extra
        .push(Proc::adopt(cr, "cr_restart in the pane", None));
    wait_until(
        "the restored job to appear",
        LINE_TIMEOUT,
        || proc_status(root).is_some_and(|s| s.ppid == cr) || restart_exited(&t.screen()),
        || t.diag(),
    );
    assert!(
        proc_status(root).is_some_and(|s| s.ppid == cr),
        "cr_restart --shell-job exited without restoring pid {root}\n{}",
        t.diag()
    );
    for &p in pids.iter().rev() {
        t.extra
            .push(Proc::adopt(p, "restored process in the pane", None));
    }
    wait_restored_reader(t, reader, exe);
    cr
}

/// A line-echo program (python3) with a counter reads from the terminal of
/// a tmux pane, with echo turned off. It is checkpointed with --kill, the
/// terminal is reset, and `cr_restart --shell-job` typed into the same pane
/// brings it back: it is the foreground job again, the terminal has its
/// settings again (echo off), it answers with its counter going on, and its
/// exit status reaches the shell through cr_restart.
#[test]
fn tmux_line_program_restored_with_shell_job_in_its_pane() {
    let _sweep = Sweep;
    let h = Harness::new("real-tmux-echo");
    let mut t = Tmux::start(&h);
    t.wait_line("the shell prompt", |l| l.starts_with("sh$"), &|| {
        String::new()
    });
    let py = python3();
    let exe = std::fs::canonicalize(&py).expect("python3 path");
    let script = script_path("real_tty_echo.py");
    t.type_line(&format!("{} {}", py.display(), script.display()));
    let ready = t.wait_line("READY", |l| l.starts_with("READY pid="), &|| String::new());
    let pid: i32 = ready["READY pid=".len()..].parse().expect("pid");
    t.extra.push(Proc::adopt(pid, "echo program", None));
    assert_eq!(
        proc_status(pid).map(|s| s.ppid),
        Some(t.pane_pid),
        "the program is a child of the pane's shell\n{}",
        t.diag()
    );
    t.type_line("alpha");
    t.wait_exact("ECHO: alpha #1 sum=5 echo=off fg=yes", &|| String::new());
    t.type_line("beta gamma");
    t.wait_exact("ECHO: beta gamma #2 sum=15 echo=off fg=yes", &|| {
        String::new()
    });
    t.type_line("x");
    t.wait_exact("ECHO: x #3 sum=16 echo=off fg=yes", &|| String::new());
    wait_until(
        "the program to block in read",
        Duration::from_secs(10),
        || blocked_syscall(pid) == Some(libc::SYS_read),
        || describe(pid),
    );
    let lflag_before = t.lflag();
    assert_eq!(lflag_before & libc::ECHO, 0, "the program turned echo off");
    assert_eq!(t.tpgid(), pid, "the program is the foreground job");

    checkpoint_and_restore_in_pane(&mut t, &h, pid, pid, &exe, "Enter");
    assert_eq!(
        t.tpgid(),
        stat_field(pid, 5),
        "the restored job is the terminal's foreground process group\n{}",
        t.diag()
    );
    assert_eq!(
        t.lflag(),
        lflag_before,
        "the terminal's local flags are those of the checkpoint (echo off)\n{}",
        t.diag()
    );
    t.type_line("delta");
    t.wait_exact("ECHO: delta #4 sum=21 echo=off fg=yes", &|| t.diag());
    assert!(
        !t.screen().lines().any(|l| l.trim_end() == "delta"),
        "the typed line was echoed by the terminal (echo should be off)\n{}",
        t.diag()
    );
    t.type_line("quit");
    t.wait_exact("BYE 5", &|| t.diag());
    // The program's exit status, 3, is cr_restart's; the shell has its
    // terminal back and answers.
    t.wait_exact("RESTART-EXIT-3", &|| t.diag());
    t.type_line("echo AFTER-$((40+2))");
    t.wait_answer("AFTER-42", &|| t.diag());
}

/// GNU bc (with readline, which puts the terminal in raw mode while it
/// reads) with a variable and a function defined, restored into its tmux
/// pane with --shell-job: it computes with them after the restore.
#[test]
fn tmux_bc_with_readline_restored_with_shell_job() {
    let _sweep = Sweep;
    let h = Harness::new("real-tmux-bc");
    let bc = need_program("bc");
    let exe = std::fs::canonicalize(&bc).expect("bc path");
    let mut t = Tmux::start(&h);
    t.wait_line("the shell prompt", |l| l.starts_with("sh$"), &|| {
        String::new()
    });
    t.type_line("bc -q");
    let pane = t.pane_pid;
    let deadline = Instant::now() + LINE_TIMEOUT;
    let pid = loop {
        if let Some(c) = child_named(pane, "bc") {
            break c;
        }
        assert!(Instant::now() < deadline, "bc did not start\n{}", t.diag());
        std::thread::sleep(Duration::from_millis(10));
    };
    t.extra.push(Proc::adopt(pid, "bc", None));
    t.type_line("x = 6 * 7");
    t.type_line("define f(n) { if (n < 2) return (n); return (f(n - 1) + f(n - 2)); }");
    t.type_line("x + f(20)");
    t.wait_exact("6807", &|| t.diag());
    wait_until(
        "bc to wait for terminal input",
        Duration::from_secs(10),
        || blocked_syscall(pid).is_some_and(|n| READ_SYSCALLS.contains(&n)),
        || describe(pid),
    );
    let lflag_before = t.lflag();
    assert_eq!(
        lflag_before & (libc::ICANON | libc::ECHO),
        0,
        "readline reads with the terminal in raw mode\n{}",
        t.diag()
    );

    // The shell reads its line with the terminal left raw: end it with C-j.
    checkpoint_and_restore_in_pane(&mut t, &h, pid, pid, &exe, "C-j");
    assert_eq!(
        t.lflag(),
        lflag_before,
        "the terminal is in bc's (readline's) mode again\n{}",
        t.diag()
    );
    t.type_line("x * 1000 + f(10)");
    t.wait_exact("42055", &|| t.diag());
    t.type_line("quit");
    t.wait_exact("RESTART-EXIT-0", &|| t.diag());
    wait_until(
        "bc to exit",
        Duration::from_secs(10),
        || !is_alive(pid),
        || t.diag(),
    );
    t.type_line("echo AFTER-$((40+2))");
    t.wait_answer("AFTER-42", &|| t.diag());
}

/// Types `cmd` into the pane and waits for the shell's child named `name`.
fn start_in_pane(t: &mut Tmux, cmd: &str, name: &str) -> i32 {
    t.type_line(cmd);
    let pane = t.pane_pid;
    let deadline = Instant::now() + LINE_TIMEOUT;
    let pid = loop {
        if let Some(c) = child_named(pane, name) {
            break c;
        }
        assert!(
            Instant::now() < deadline,
            "{name} did not start in the pane\n{}",
            t.diag()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    t.extra.push(Proc::adopt(pid, name, None));
    pid
}

/// A job of three processes on the terminal, `sh -c 'cat | tr a-z A-Z'`
/// (cat reads the terminal, tr writes to it, a pipe between them), restored
/// with --shell-job: the whole job is the foreground process group again
/// and goes on translating; end of input (Ctrl-D) ends it with status 0.
#[test]
fn tmux_cat_tr_job_restored_with_shell_job() {
    let _sweep = Sweep;
    let h = Harness::new("real-tmux-cat-tr");
    let mut t = Tmux::start(&h);
    t.wait_line("the shell prompt", |l| l.starts_with("sh$"), &|| {
        String::new()
    });
    let job = start_in_pane(&mut t, "sh -c 'cat | tr a-z A-Z'", "sh");
    let find = |name: &str| {
        let deadline = Instant::now() + LINE_TIMEOUT;
        loop {
            if let Some(p) = child_named(job, name) {
                return p;
            }
            assert!(
                Instant::now() < deadline,
                "no {name} in the job\n{}",
                describe_tree(job)
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let cat = find("cat");
    let tr = find("tr");
    t.type_line("hello there");
    t.wait_exact("HELLO THERE", &|| String::new());
    wait_until(
        "cat to wait for terminal input",
        Duration::from_secs(10),
        || {
            blocked_syscall(cat) == Some(libc::SYS_read)
                && blocked_syscall(tr) == Some(libc::SYS_read)
        },
        || describe_tree(job),
    );
    assert_eq!(t.tpgid(), job, "the job is the foreground process group");
    let cat_exe = std::fs::read_link(format!("/proc/{cat}/exe")).expect("cat exe");

    checkpoint_and_restore_in_pane(&mut t, &h, job, cat, &cat_exe, "Enter");
    assert_eq!(
        tree_pids(job),
        vec![job, cat, tr],
        "the restored job has its three processes\n{}",
        describe_tree(job)
    );
    for p in [job, cat, tr] {
        assert_eq!(
            stat_field(p, 5),
            job,
            "pid {p} is in the job's process group"
        );
    }
    assert_eq!(
        t.tpgid(),
        job,
        "the restored job is the foreground process group"
    );
    t.type_line("after the restore");
    t.wait_exact("AFTER THE RESTORE", &|| t.diag());
    t.run_ok(&["send-keys", "-t", "cr", "C-d"]);
    t.wait_exact("RESTART-EXIT-0", &|| t.diag());
    t.type_line("echo AFTER-$((40+2))");
    t.wait_answer("AFTER-42", &|| t.diag());
}

/// The sqlite3 shell itself in a tmux pane, inside an open write
/// transaction (BEGIN IMMEDIATE, 1000 rows inserted, not committed) on a
/// WAL database, restored with --shell-job: another sqlite3 still cannot
/// write and sees only the committed rows; the restored shell sees its own
/// rows, commits, and the database is intact with all of them.
#[test]
fn tmux_sqlite3_shell_with_an_open_transaction_restored_with_shell_job() {
    let _sweep = Sweep;
    let h = Harness::new("real-tmux-sqlite");
    let sqlite3 = need_program("sqlite3");
    let exe = std::fs::canonicalize(&sqlite3).expect("sqlite3 path");
    let db = h.dir.join("shell.db");
    let mut t = Tmux::start(&h);
    t.wait_line("the shell prompt", |l| l.starts_with("sh$"), &|| {
        String::new()
    });
    let pid = start_in_pane(&mut t, &format!("sqlite3 {}", db.display()), "sqlite3");
    t.type_line("PRAGMA journal_mode=WAL;");
    t.wait_exact("wal", &|| t.diag());
    t.type_line("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER NOT NULL, pad TEXT);");
    t.type_line(
        "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < 1000) \
         INSERT INTO t (id, v) SELECT i, i * i FROM c;",
    );
    t.type_line("BEGIN IMMEDIATE;");
    t.type_line("INSERT INTO t (id, v) SELECT id + 1000, (id + 1000) * (id + 1000) FROM t;");
    t.type_line("SELECT 'pre', count(*) FROM t;");
    t.wait_exact("pre|2000", &|| t.diag());
    wait_until(
        "sqlite3 to wait for terminal input",
        Duration::from_secs(10),
        || blocked_syscall(pid).is_some_and(|n| READ_SYSCALLS.contains(&n)),
        || describe(pid),
    );
    assert_locked_by_writer(&h, &db, 1000, "before the checkpoint", &|| t.diag());
    let locks_before = posix_locks(pid);
    let lflag_before = t.lflag();

    checkpoint_and_restore_in_pane(&mut t, &h, pid, pid, &exe, "C-j");
    assert_eq!(
        posix_locks(pid),
        locks_before,
        "the restored sqlite3's POSIX locks (/proc/PID/fdinfo) differ from the original's"
    );
    assert_eq!(
        t.lflag(),
        lflag_before,
        "the terminal is in sqlite3's mode again"
    );
    assert_locked_by_writer(&h, &db, 1000, "after the restore", &|| t.diag());
    t.type_line("SELECT 'post', count(*), sum(id) FROM t;");
    t.wait_exact("post|2000|2001000", &|| t.diag());
    t.type_line("COMMIT;");
    t.type_line(".quit");
    t.wait_exact("RESTART-EXIT-0", &|| t.diag());
    let (st, out, err) = sqlite(
        &h,
        &db,
        "PRAGMA integrity_check; SELECT count(*), sum(id), sum(v = id * id) FROM t;",
    );
    assert!(
        st.success() && out.trim() == "ok\n2000|2001000|2000",
        "the database after the restored shell committed: {st:?}\n{out}\n{err}"
    );
}

/// The whole tmux server, with its pane's shell, checkpointed and killed,
/// then restored with --detach: the pty pair between them (master in the
/// server, slave the shell's terminal) and the server's listening socket
/// come back; tmux clients talk to the restored server, the shell keeps its
/// variables, and its job control works (a foreground pipeline reads the
/// terminal), which needs its own /dev/tty fd to be its terminal again.
#[test]
fn tmux_server_with_its_pane_shell_checkpointed_whole() {
    let _sweep = Sweep;
    let h = Harness::new("real-tmux-server");
    let mut t = Tmux::start(&h);
    t.wait_line("the shell prompt", |l| l.starts_with("sh$"), &|| {
        String::new()
    });
    t.type_line("X=41; echo hello-$((X+1))");
    t.wait_exact("hello-42", &|| String::new());
    let server = t.server.as_ref().expect("server").pid;
    let pane = t.pane_pid;
    let pids = tree_pids(server);
    assert_eq!(pids, vec![server, pane], "the server and the pane's shell");
    wait_until(
        "the pane's shell to wait for input",
        Duration::from_secs(10),
        || blocked_syscall(pane).is_some_and(|n| READ_SYSCALLS.contains(&n)),
        || describe(pane),
    );
    let pane_fds = fd_list(pane);
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &["--kill"], server);
    out.assert_success("cr_checkpoint --kill <tmux server>");
    let mut old = t.server.take().expect("server");
    old.wait_exit(Duration::from_secs(20), || describe(server));
    reap_descendants(&pids[1..]);

    t.server = Some(h.restore_detach(&img, server));
    t.extra.push(Proc::adopt(pane, "restored pane shell", None));
    let info = t.run_ok(&[
        "display-message",
        "-p",
        "-t",
        "cr",
        "#{pid} #{pane_pid} #{pane_tty}",
    ]);
    let f: Vec<&str> = info.split_whitespace().collect();
    assert_eq!(
        f.first().and_then(|v| v.parse::<i32>().ok()),
        Some(server),
        "a tmux client reaches the restored server: {info:?}"
    );
    t.pane_tty = PathBuf::from(f.get(2).copied().unwrap_or_default());
    t.type_line("echo again-$((X+2))");
    t.wait_exact("again-43", &|| t.diag());
    // Job control: the shell makes the pipeline the foreground job (through
    // its /dev/tty fd), head reads the line from the terminal.
    t.type_line("head -n 1 | tr a-z A-Z");
    t.type_line("typed-line");
    t.wait_line(
        "the pipeline's answer (or the shell's error)",
        |l| {
            l == "TYPED-LINE"
                || l.contains("Cannot set tty process group")
                || l.contains("not found")
        },
        &|| t.diag(),
    );
    let screen = t.screen();
    let job_control_ok = screen.lines().any(|l| l.trim_end() == "TYPED-LINE")
        && !screen.contains("Cannot set tty process group");
    // Every fd of the shell that was its terminal (0, 1, 2 and the /dev/tty
    // fd it keeps for job control) is the restored terminal again.
    let now = fd_list(pane);
    let tty = t.pane_tty.to_string_lossy().into_owned();
    let lost: Vec<String> = pane_fds
        .iter()
        .filter(|(_, p)| p.starts_with("/dev/pts/") || p == "/dev/tty")
        .filter_map(|(fd, before)| {
            let after = now.iter().find(|(f, _)| f == fd).map(|(_, p)| p.as_str());
            (after != Some(tty.as_str()) && after != Some("/dev/tty"))
                .then(|| format!("fd {fd}: {before} before, {after:?} now"))
        })
        .collect();
    assert!(
        job_control_ok && lost.is_empty(),
        "the restored shell's terminal fds should be its restored terminal {tty}: {lost:?}; \
         job control works: {job_control_ok}\n{}",
        t.diag()
    );
}

/// `less` paging a file in a tmux pane: it reads its keys from the
/// terminal through an fd of its own above 2 (it opens /dev/tty), with the terminal in raw mode. Restored with
/// --shell-job after a page down, the next Space shows the page after that.
#[test]
fn tmux_less_restored_with_shell_job_goes_on_paging() {
    let _sweep = Sweep;
    let h = Harness::new("real-tmux-less");
    need_program("less");
    let file = h.dir.join("numbers.txt");
    let text: String = (1..=1000).map(|i| format!("line {i:04}\n")).collect();
    std::fs::write(&file, text).expect("write numbers.txt");
    let mut t = Tmux::start(&h);
    t.wait_line("the shell prompt", |l| l.starts_with("sh$"), &|| {
        String::new()
    });
    let pid = start_in_pane(&mut t, &format!("less {}", file.display()), "less");
    t.wait_exact("line 0023", &|| t.diag());
    t.run_ok(&["send-keys", "-t", "cr", "Space"]);
    t.wait_exact("line 0046", &|| t.diag());
    wait_until(
        "less to wait for a key",
        Duration::from_secs(10),
        || blocked_syscall(pid).is_some_and(|n| READ_SYSCALLS.contains(&n)),
        || describe(pid),
    );
    let fds_before = fd_list(pid);
    let tty = t.pane_tty.to_string_lossy().into_owned();
    assert!(
        fds_before
            .iter()
            .any(|(fd, p)| *fd > 2 && (*p == tty || p == "/dev/tty")),
        "less reads keys from the terminal through an fd above 2: {fds_before:?}"
    );
    let lflag_before = t.lflag();
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("less exe");

    checkpoint_and_restore_in_pane(&mut t, &h, pid, pid, &exe, "C-j");
    assert_eq!(
        t.lflag(),
        lflag_before,
        "the terminal is in less's mode again"
    );
    for (fd, p) in fd_list(pid) {
        assert!(
            p == tty || p == "/dev/tty" || p == file.to_string_lossy(),
            "fd {fd} of the restored less is {p} (before: {fds_before:?})"
        );
    }
    t.run_ok(&["send-keys", "-t", "cr", "Space"]);
    t.wait_exact("line 0069", &|| t.diag());
    t.run_ok(&["send-keys", "-t", "cr", "q"]);
    t.wait_line("RESTART-EXIT-0", |l| l.ends_with("RESTART-EXIT-0"), &|| {
        t.diag()
    });
}

/// An interactive shell started inside the pane's shell (`sh -i`, job
/// control on: it keeps the terminal open as /dev/tty on an fd of its own)
/// with a variable set, restored with --shell-job: it keeps the variable,
/// and its own job control works (a pipeline it runs is made the foreground
/// job and reads a line from the terminal).
#[test]
fn tmux_nested_interactive_shell_restored_with_shell_job() {
    let _sweep = Sweep;
    let h = Harness::new("real-tmux-nested-sh");
    let mut t = Tmux::start(&h);
    t.wait_line("the shell prompt", |l| l.starts_with("sh$"), &|| {
        String::new()
    });
    let pid = start_in_pane(&mut t, "PS1='in$ ' sh -i", "sh");
    t.type_line("Y=7; echo in-$((Y*6))");
    t.wait_exact("in-42", &|| t.diag());
    wait_until(
        "the nested shell to wait for input",
        Duration::from_secs(10),
        || blocked_syscall(pid).is_some_and(|n| READ_SYSCALLS.contains(&n)),
        || describe(pid),
    );
    let fds_before = fd_list(pid);
    assert!(
        fds_before.iter().any(|(fd, p)| *fd > 2 && p == "/dev/tty"),
        "an interactive dash keeps /dev/tty open: {fds_before:?}"
    );
    assert_eq!(t.tpgid(), pid, "the nested shell is the foreground job");
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("sh exe");

    checkpoint_and_restore_in_pane(&mut t, &h, pid, pid, &exe, "Enter");
    t.type_line("echo in-$((Y*6+1))");
    t.wait_exact("in-43", &|| t.diag());
    t.type_line("head -n 1 | tr a-z A-Z");
    t.type_line("typed-line");
    t.wait_line(
        "the pipeline's answer (or the shell's error)",
        |l| {
            l == "TYPED-LINE"
                || l.contains("Cannot set tty process group")
                || l.contains("not found")
        },
        &|| t.diag(),
    );
    let screen = t.screen();
    assert!(
        screen.lines().any(|l| l.trim_end() == "TYPED-LINE")
            && !screen.contains("Cannot set tty process group"),
        "the restored interactive shell's job control does not work (its fds: {:?}, \
         before: {fds_before:?})\n{}",
        fd_list(pid),
        t.diag()
    );
    t.type_line("exit 5");
    t.wait_line("RESTART-EXIT-5", |l| l.ends_with("RESTART-EXIT-5"), &|| {
        t.diag()
    });
}

// ---------------------------------------------------------------------------
// LAMMPS under Open MPI (Debian's lammps package)
// ---------------------------------------------------------------------------

/// mpirun of 2 LAMMPS ranks on `input`, Open MPI's session directory under
/// `tmp` (a directory of this test alone).
fn lammps_cmd(input: &Path, tmp: &Path) -> String {
    format!(
        "exec mpirun.openmpi --allow-run-as-root -np 2 --mca orte_tmpdir_base {} \
         lmp -in {} -log none",
        tmp.display(),
        input.display()
    )
}

/// An unmodified MPI application from a Debian package: LAMMPS, 2 ranks
/// under Open MPI's mpirun (shared memory between the ranks, a deleted
/// /dev/shm segment opened by shm_open, the runtime's pipes and sockets),
/// run first without checkpoints, then under `cr_run`, checkpointed with
/// `--kill` a quarter of the way through (step 5000 of 20000) and restored with `--verify`: it
/// prints the same thermo table (temperature, energies, pressure to 8
/// digits at every 1000 steps) as the run without checkpoints. Before the
/// fix the restore's --verify refused the shm segment's fd (O_NOFOLLOW
/// lost).
#[test]
fn lammps_under_open_mpi_killed_and_restored_prints_the_same_thermo() {
    let _sweep = Sweep;
    let h = Harness::new("real-lammps");
    need_program("lmp");
    need_program("mpirun.openmpi");
    let input = h.dir.join("in.lj");
    std::fs::write(&input, cr_tests::mpi::lammps_lj(5, 20000, 1000)).expect("write in.lj");

    let ref_tmp = h.dir.join("ompi-ref");
    std::fs::create_dir_all(&ref_tmp).expect("mkdir");
    let (st, out, err) = run_cmd(
        &h,
        Path::new(SH),
        &[OsStr::new("-c"), OsStr::new(&lammps_cmd(&input, &ref_tmp))],
        Duration::from_secs(300),
    );
    assert!(
        st.success(),
        "LAMMPS without checkpoints: {st}\n{out}\n{err}"
    );
    let reference = cr_tests::mpi::lammps_thermo(&out);
    assert_eq!(reference.len(), 21, "thermo of the reference run:\n{out}");

    let tmp = h.dir.join("ompi-ck");
    std::fs::create_dir_all(&tmp).expect("mkdir");
    let pid_file = h.dir.join("job.pid");
    let script = lammps_cmd(&input, &tmp);
    let mut wl = h.spawn_program(
        "cr_run",
        &tool_path("cr_run"),
        &[
            OsStr::new("--no-pidns"),
            OsStr::new("--pid-file"),
            pid_file.as_os_str(),
            OsStr::new("--"),
            OsStr::new(SH),
            OsStr::new("-c"),
            OsStr::new(&script),
        ],
        &[],
    );
    let past = |l: &str| {
        l.split_whitespace()
            .next()
            .and_then(|s| s.parse::<u64>().ok())
            .is_some_and(|s| s >= 5_000)
    };
    wl.wait_line("LAMMPS at step 5000", past);
    let job: i32 = read_text(&pid_file)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("cr_run --pid-file: {:?}", read_text(&pid_file)));
    let pids = tree_pids(job);
    let img = h.image_dir("img");
    kill_cr_run_job(
        &h,
        &mut wl,
        &img,
        &pids,
        "cr_checkpoint --kill of the LAMMPS job",
    );
    let at = cr_tests::mpi::lammps_thermo(&wl.output()).len();
    assert!(
        at < reference.len(),
        "LAMMPS finished before the checkpoint"
    );
    eprintln!(
        "checkpointed after {at} thermo lines of {}",
        reference.len()
    );

    let mut r = h.restore_bg(&img, job);
    let res = r.wait(Duration::from_secs(300), &wl);
    assert!(
        res.status.success(),
        "restored LAMMPS job should finish with exit 0\n{}\n{}",
        res.show(),
        wl.diag()
    );
    assert_eq!(
        cr_tests::mpi::lammps_thermo(&wl.output()),
        reference,
        "the thermo table after a checkpoint at line {at}\n{}",
        wl.diag()
    );
}
