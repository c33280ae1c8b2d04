//! The round-trip test of a resource kind, on a real process.
//!
//! A small python3 program sets up the resources of the kind and says it is
//! ready; it is checkpointed with `--kill`, restored, captured again (the
//! processes continue), and then asked (SIGUSR1) to check its resources from
//! the inside and write its verdict (OK, or FAIL and why). The test gets
//! both images to compare the kind's section of the process before and
//! after, and asserts on the program's own verdict.
//!
//! Both the restore and the second checkpoint run with `--verify`.
//!
//! Needs root (ptrace, clone3 with set_tid) and python3, like the
//! end-to-end suite.

use crate::options::{Action, CheckpointOptions, RestoreOptions};
use cr_image::model::{Checkpoint, Process};
use cr_image::ImageDir;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What the program runs before and around the kind's code.
const PROLOGUE: &str = r#"
import ctypes, errno, fcntl, os, signal, socket, struct, sys, time
os.closerange(3, 65536)    # what the test runner leaked (its jobserver pipe...)
DIR = sys.argv[1]
# The verdict goes through this fd, so it is written even from a chroot.
DIRFD = os.open(DIR, os.O_RDONLY | os.O_DIRECTORY)
def write_in_dir(name, text):
    fd = os.open(name + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=DIRFD)
    os.write(fd, text.encode())
    os.close(fd)
    os.rename(name + ".tmp", name, src_dir_fd=DIRFD, dst_dir_fd=DIRFD)
libc = ctypes.CDLL(None, use_errno=True)
problems = []
def expect(cond, why):
    if not cond:
        problems.append(why)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
"#;

const MIDDLE: &str = r#"
write_in_dir("ready", str(os.getpid()))
signal.sigwait({signal.SIGUSR1})
try:
"#;

const EPILOGUE: &str = r#"
except Exception as e:
    problems.append("exception: " + repr(e))
write_in_dir("verdict", "OK" if not problems else "FAIL " + "; ".join(problems))
time.sleep(600)
"#;

/// Both images of a round trip.
pub struct RoundTrip {
    /// Of the program as it set itself up.
    pub before: Checkpoint,
    /// Of the restored program.
    pub after: Checkpoint,
}

impl RoundTrip {
    /// The root process of each image.
    pub fn roots(&self) -> (&Process, &Process) {
        (&self.before.processes[0], &self.after.processes[0])
    }
}

fn indent(code: &str) -> String {
    code.lines()
        .map(|l| format!("    {l}\n"))
        .collect::<String>()
}

/// Wait for the file `path` program `pid` writes (whole, by a rename),
/// showing its output `log` if it does not come: at once when the program
/// has died (gone, or a zombie), at the latest after `timeout`.
pub(crate) fn wait_for(what: &str, pid: i32, path: &Path, timeout: Duration, log: &Path) -> String {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            return s;
        }
        let dead = cr_sys::proc::stat(pid).map_or(true, |st| st.state == 'Z');
        // Its last write may have landed just before its death.
        if dead && !path.exists() {
            let out = std::fs::read_to_string(log).unwrap_or_default();
            panic!(
                "the program (PID {pid}) died before {what} ({})\nprogram output:\n{out}",
                path.display()
            );
        }
        if t0.elapsed() > timeout {
            let out = std::fs::read_to_string(log).unwrap_or_default();
            panic!(
                "timed out waiting for {what} ({})\nprogram output:\n{out}",
                path.display()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn reap(pid: i32) {
    let _ = cr_sys::ptrace::kill(pid, libc::SIGKILL);
    let _ = cr_sys::ptrace::wait_raw(pid, 0);
}

/// Checkpoint `pid` into `img` and kill it.
pub fn checkpoint_kill(pid: i32, img: &Path) -> Result<(), String> {
    checkpoint_kill_with(pid, img, |_| {})
}

/// [`checkpoint_kill`], with the options `tweak` changes.
fn checkpoint_kill_with(
    pid: i32,
    img: &Path,
    tweak: impl FnOnce(&mut CheckpointOptions),
) -> Result<(), String> {
    let mut opts = CheckpointOptions {
        dir: Some(img.to_path_buf()),
        no_fsync: true,
        ..Default::default()
    };
    opts.set_action(Action::Kill);
    tweak(&mut opts);
    crate::checkpoint(pid, &opts)
        .map(|_| ())
        .map_err(|e| cr_sys::error::one_line(&e))
}

fn read(dir: &Path) -> Checkpoint {
    ImageDir::open(dir)
        .and_then(|d| d.read_checkpoint())
        .unwrap_or_else(|e| panic!("{}: {}", dir.display(), cr_sys::error::one_line(&e)))
}

/// Run `f` on a thread of its own in a new network namespace (loopback
/// up), where the program it starts and the checkpoint and restore it runs
/// live: a test may drop packets there (nft) without touching the host's
/// network.
pub fn in_new_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            cr_sys::ns::unshare_net().expect("a network namespace of our own");
            let up = Command::new("ip")
                .args(["link", "set", "lo", "up"])
                .status()
                .expect("ip (iproute2)");
            assert!(up.success(), "ip link set lo up: {up}");
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// Run the round trip of the program made of `setup` (python3 code that
/// sets up the resources) and `check` (code that checks them after the
/// restore, calling `expect(cond, why)`).
pub fn round_trip(name: &str, setup: &str, check: &str) -> RoundTrip {
    round_trip_with(name, setup, check, |_| {})
}

/// [`round_trip`], with `between` run after the program is checkpointed
/// and killed and before it is restored (it gets the program's directory:
/// what changes there, or elsewhere, while the program is away).
pub fn round_trip_with(
    name: &str,
    setup: &str,
    check: &str,
    between: impl FnOnce(&Path),
) -> RoundTrip {
    round_trip_opts(name, setup, check, |_| {}, between)
}

/// [`round_trip_with`], the program checkpointed (and killed) with the
/// options `tweak` changes (`cr_checkpoint --kill` and more).
pub fn round_trip_opts(
    name: &str,
    setup: &str,
    check: &str,
    tweak: impl FnOnce(&mut CheckpointOptions),
    between: impl FnOnce(&Path),
) -> RoundTrip {
    round_trip_restoring(name, setup, check, tweak, between, |_| {})
}

/// [`round_trip_opts`], the program restored (with --verify) with the
/// options `restoring` changes (`cr_restart --tcp-close` and more).
pub fn round_trip_restoring(
    name: &str,
    setup: &str,
    check: &str,
    tweak: impl FnOnce(&mut CheckpointOptions),
    between: impl FnOnce(&Path),
    restoring: impl FnOnce(&mut RestoreOptions),
) -> RoundTrip {
    round_trip_spawning(name, setup, check, |_| {}, tweak, between, restoring)
}

/// [`round_trip`], the program started with the `python3` command that
/// `spawning` changes (its process group...).
pub fn round_trip_spawned(
    name: &str,
    setup: &str,
    check: &str,
    spawning: impl FnOnce(&mut Command),
) -> RoundTrip {
    round_trip_spawning(name, setup, check, spawning, |_| {}, |_| {}, |_| {})
}

fn round_trip_spawning(
    name: &str,
    setup: &str,
    check: &str,
    spawning: impl FnOnce(&mut Command),
    tweak: impl FnOnce(&mut CheckpointOptions),
    between: impl FnOnce(&Path),
    restoring: impl FnOnce(&mut RestoreOptions),
) -> RoundTrip {
    let (dir, log, child) = start_with(name, setup, check, spawning);
    let pid = child.id() as i32;
    let img = dir.join("img");
    if let Err(e) = checkpoint_kill_with(pid, &img, tweak) {
        reap(pid);
        panic!("checkpoint of {name}: {e}");
    }
    // Killed and reaped by the checkpoint (we are its tracer and parent).
    drop(child);
    between(&dir);
    let mut verify = RestoreOptions {
        verify: true,
        ..Default::default()
    };
    restoring(&mut verify);
    let restored = crate::restore(&img, &verify)
        .unwrap_or_else(|e| panic!("restore of {name}: {}", cr_sys::error::one_line(&e)));
    assert_eq!(restored, pid, "restored with its PID");

    let img2 = dir.join("img-after");
    checkpoint_continue(pid, &img2, &format!("the restored {name}"));
    verdict(pid, &dir, &log, &format!("{name}: the restored program"));
    let rt = RoundTrip {
        before: read(&img),
        after: read(&img2),
    };
    let _ = std::fs::remove_dir_all(&dir);
    rt
}

/// [`round_trip`] without the checkpoint of the restored program (which
/// lets it run on): for a state only a dump whose processes end can save
/// (connections not yet accepted that carry data). The image is returned.
pub fn round_trip_killed(name: &str, setup: &str, check: &str) -> Checkpoint {
    let (dir, log, pid, img) = start_and_kill(name, setup, check);
    let verify = RestoreOptions {
        verify: true,
        ..Default::default()
    };
    let restored = crate::restore(&img, &verify)
        .unwrap_or_else(|e| panic!("restore of {name}: {}", cr_sys::error::one_line(&e)));
    assert_eq!(restored, pid, "restored with its PID");
    verdict(pid, &dir, &log, &format!("{name}: the restored program"));
    let ck = read(&img);
    let _ = std::fs::remove_dir_all(&dir);
    ck
}

/// Checkpoint `pid` (`who`) into `img` with --verify, the processes
/// continuing; a failure ends the program and the test.
fn checkpoint_continue(pid: i32, img: &Path, who: &str) {
    let opts = CheckpointOptions {
        dir: Some(img.to_path_buf()),
        no_fsync: true,
        verify: true,
        ..Default::default()
    };
    if let Err(e) = crate::checkpoint(pid, &opts) {
        reap(pid);
        panic!("checkpoint of {who}: {}", cr_sys::error::one_line(&e));
    }
}

/// Ask program `pid` (SIGUSR1) to check its resources, wait for its
/// verdict, end it, and assert the verdict is OK (`who` names it).
fn verdict(pid: i32, dir: &Path, log: &Path, who: &str) {
    cr_sys::ptrace::kill(pid, libc::SIGUSR1).expect("ask the program to check itself");
    let verdict = wait_for(
        "the verdict",
        pid,
        &dir.join("verdict"),
        Duration::from_secs(30),
        log,
    );
    reap(pid);
    assert_eq!(
        verdict.trim(),
        "OK",
        "{who} found its resources different\noutput:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

/// Start the program made of `setup` and `check` (see [`round_trip`]) in
/// a directory of its own, and wait until it is ready: its directory, its
/// output file, the child.
fn start(name: &str, setup: &str, check: &str) -> (PathBuf, PathBuf, std::process::Child) {
    start_with(name, setup, check, |_| {})
}

/// [`start`], the command changed by `spawning` first.
fn start_with(
    name: &str,
    setup: &str,
    check: &str,
    spawning: impl FnOnce(&mut Command),
) -> (PathBuf, PathBuf, std::process::Child) {
    let dir = std::env::temp_dir()
        .join("cr-engine-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("test directory");
    let script = format!("{PROLOGUE}{setup}{MIDDLE}{}{EPILOGUE}", indent(check));
    let script_path = dir.join("program.py");
    std::fs::write(&script_path, script).expect("write the program");
    let log = dir.join("output");
    let out = std::fs::File::create(&log).expect("output file");
    let mut cmd = Command::new("python3");
    cmd.arg(&script_path)
        .arg(&dir)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(out.try_clone().expect("dup"))
        .stderr(out);
    spawning(&mut cmd);
    let child = cmd.spawn().expect("python3 (the round-trip tests need it)");
    wait_for(
        "the program to be ready",
        child.id() as i32,
        &dir.join("ready"),
        Duration::from_secs(30),
        &log,
    );
    (dir, log, child)
}

/// The program made of `setup` and `check` started, then checkpointed
/// into DIR/img and killed: its directory, output, PID and image.
fn start_and_kill(name: &str, setup: &str, check: &str) -> (PathBuf, PathBuf, i32, PathBuf) {
    let (dir, log, child) = start(name, setup, check);
    let pid = child.id() as i32;
    let img = dir.join("img");
    if let Err(e) = checkpoint_kill(pid, &img) {
        reap(pid);
        panic!("checkpoint of {name}: {e}");
    }
    // Killed and reaped by the checkpoint (we are its tracer and parent).
    drop(child);
    (dir, log, pid, img)
}

/// The refusal of the program made of `setup` and `check` (see
/// [`round_trip`]): its checkpoint fails with an error that contains
/// `says`, and the program runs on, untraced, and finds its resources as
/// they were. The error is returned.
///
/// The program checkpointed is the one that wrote `ready` (its PID is in
/// it): a setup may fork and leave its first process outside the tree,
/// waiting for the rest (the leader of a session the tree's processes
/// are in, say); that first process is reaped at the end.
pub fn refused(name: &str, setup: &str, check: &str, says: &str) -> String {
    let (dir, log, child) = start(name, setup, check);
    let first = child.id() as i32;
    let pid = std::fs::read_to_string(dir.join("ready"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(first);
    let err = match checkpoint_kill(pid, &dir.join("img")) {
        Ok(()) => {
            drop(child);
            panic!("{name}: checkpointed, but should have been refused ({says})");
        }
        Err(e) => e,
    };
    let traced = cr_sys::proc::read_string(&format!("/proc/{pid}/status"))
        .map(|s| !s.contains("TracerPid:\t0\n"))
        .unwrap_or(true);
    if !err.contains(says) || traced {
        reap(pid);
        panic!("{name}: refused with {err:?} (want {says:?}); left traced: {traced}");
    }
    verdict(
        pid,
        &dir,
        &log,
        &format!("{name}: the program after the refused checkpoint"),
    );
    if pid != first {
        reap(first);
    }
    drop(child);
    let _ = std::fs::remove_dir_all(&dir);
    err
}

/// The program made of `setup` (see [`round_trip`]; `check` is never
/// run) checkpointed and killed, then its restore refused with an error
/// that contains `says`, nothing of it left running. `after(dir)` runs
/// once the restore failed (to end what the program left outside its
/// tree). The error is returned.
pub fn restore_refused(name: &str, setup: &str, says: &str, after: impl FnOnce(&Path)) -> String {
    restore_refused_with(name, setup, says, |_| {}, after)
}

/// [`restore_refused`], `before(dir)` run between the checkpoint and the
/// restore (what changes while the program is away).
pub fn restore_refused_with(
    name: &str,
    setup: &str,
    says: &str,
    before: impl FnOnce(&Path),
    after: impl FnOnce(&Path),
) -> String {
    let (dir, _log, pid, img) = start_and_kill(name, setup, "pass");
    before(&dir);
    let err = crate::restore(&img, &RestoreOptions::default())
        .inspect(|&p| reap(p))
        .map_err(|e| cr_sys::error::one_line(&e));
    after(&dir);
    let err = match err {
        Ok(_) => panic!("{name}: restored, but should have been refused ({says})"),
        Err(e) => e,
    };
    assert!(
        err.contains(says),
        "{name}: refused with {err:?} (want {says:?})"
    );
    assert!(
        !cr_sys::clone::pid_exists(pid),
        "{name}: process {pid} left after the refused restore"
    );
    let _ = std::fs::remove_dir_all(&dir);
    err
}

/// The checkpoint of the program made of `setup` and `check` (see
/// [`round_trip`]) that continues it, with --verify: it succeeds, and the
/// program, which ran on, finds its resources as they were. The image is
/// returned.
pub fn continued(name: &str, setup: &str, check: &str) -> Checkpoint {
    let (dir, log, child) = start(name, setup, check);
    let pid = child.id() as i32;
    let img = dir.join("img");
    checkpoint_continue(pid, &img, name);
    verdict(
        pid,
        &dir,
        &log,
        &format!("{name}: the program after the checkpoint"),
    );
    drop(child);
    let ck = read(&img);
    let _ = std::fs::remove_dir_all(&dir);
    ck
}

/// The objects of `c` that `pick` takes, in image order.
pub fn objects_of<T: Clone>(
    c: &cr_image::model::Checkpoint,
    pick: impl Fn(&cr_image::model::ObjectKind) -> Option<&T>,
) -> Vec<T> {
    c.objects
        .iter()
        .filter_map(|o| pick(&o.kind))
        .cloned()
        .collect()
}
