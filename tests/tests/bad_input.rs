//! Refusals and corrupted input: one error line on stderr, non-zero exit, and
//! the target (if any) unharmed: still running, not traced, later verifies OK.

use cr_tests::*;
use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

const CK_ERR: &str = "cr_checkpoint: error: ";
const RS_ERR: &str = "cr_restart: error: ";

/// The target is fine after a failed checkpoint: running, not traced, makes
/// progress, and verifies OK at go.
fn assert_unharmed(wl: &mut Workload, ctx: &str) {
    assert_running_untraced(wl.pid(), ctx);
    let at = last_count(&wl.output());
    let target = format!("count {}", at + 10);
    wl.wait_line(&target, |l| l == target);
    wl.go_and_expect_ok();
    check_consecutive_counts(&wl.output()).unwrap_or_else(|e| panic!("{ctx}: {e}"));
}

#[test]
fn checkpoint_nonexistent_pid() {
    let h = Harness::new("nopid");
    let pid_max: i32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(32768);
    let pid = (2..pid_max)
        .rev()
        .find(|p| proc_status(*p).is_none())
        .expect("a free pid");
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &[], pid);
    out.assert_error("nonexistent pid", CK_ERR, &["no such process"]);
}

#[test]
fn checkpoint_kernel_thread() {
    let h = Harness::new("kthread");
    // kthreadd is pid 2 unless we are in a pid namespace; find a kernel thread.
    const PF_KTHREAD: u64 = 0x0020_0000;
    let is_kthread = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let after = s[s.rfind(')')? + 1..].to_string();
                after.split_whitespace().nth(6)?.parse::<u64>().ok()
            })
            .is_some_and(|f| f & PF_KTHREAD != 0)
    };
    let pid = if is_kthread(2) {
        2
    } else {
        match (3..4096).find(|&p| is_kthread(p)) {
            Some(p) => p,
            None => panic!("no kernel thread visible in this pid namespace: cannot run this test"),
        }
    };
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &[], pid);
    out.assert_error("kernel thread", CK_ERR, &["kernel thread"]);
    let st = proc_status(pid).expect("kernel thread still exists");
    assert_eq!(st.tracer_pid, 0, "{}", describe(pid));
}

#[test]
fn checkpoint_permission_denied_as_nobody() {
    let h = Harness::new("nobody");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    // nobody must be able to run the binary and write the image directory, so the
    // only thing it lacks is the right to trace a root process.
    let bin = h.dir.join("bin");
    std::fs::create_dir(&bin).expect("mkdir bin");
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let exe = bin.join("cr_checkpoint");
    std::fs::copy(tool_path("cr_checkpoint"), &exe).expect("copy cr_checkpoint");
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let open = h.dir.join("open");
    std::fs::create_dir(&open).expect("mkdir open");
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let img = open.join("img");
    let run = RunOpts {
        as_user: Some((65534, 65534)),
        exe: Some(exe),
        ..Default::default()
    };
    let out = h.checkpoint_with(&img, &[], wl.pid(), &run);
    out.assert_error(
        "checkpoint of a root process as nobody",
        CK_ERR,
        &["permission denied"],
    );
    assert_unharmed(&mut wl, "after a refused checkpoint as nobody");
}

/// A process a debugger (another tracer) holds: refused naming the tracer,
/// not as "permission denied"; once the tracer lets go, the process runs on
/// as before.
#[test]
fn checkpoint_of_a_process_another_tracer_holds() {
    let h = Harness::new("traced");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let seized = h.dir.join("seized");
    let script = format!(
        "import ctypes, time\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         assert libc.ptrace(0x4206, {}, None, None) == 0, ctypes.get_errno()  # PTRACE_SEIZE\n\
         open({:?}, 'w').close()\n\
         time.sleep(600)\n",
        wl.pid(),
        seized.display().to_string()
    );
    let mut tracer = std::process::Command::new("python3")
        .args(["-c", &script])
        .spawn()
        .expect("python3");
    wait_until(
        "the tracer to seize the workload",
        Duration::from_secs(20),
        || seized.exists(),
        || describe(wl.pid()),
    );
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &[], wl.pid());
    out.assert_error(
        "checkpoint of a traced process",
        CK_ERR,
        &[&format!("is traced by process {}", tracer.id())],
    );
    // Its tracer gone, the process is let go by the kernel.
    tracer.kill().expect("kill the tracer");
    tracer.wait().expect("reap the tracer");
    assert_unharmed(&mut wl, "after a refused checkpoint of a traced process");
}

#[test]
fn restore_missing_image_dir() {
    let h = Harness::new("missingdir");
    let img = h.dir.join("does-not-exist");
    let out = h.restore_sync(&img, 0x7fff_fff0);
    let line = out.assert_error("restore of a missing dir", RS_ERR, &[]);
    assert_mentions_any(
        &line,
        &["does-not-exist", "no such file", "not found", "missing"],
        "missing dir",
    );
}

/// Checkpoints a small counter with --kill into `img` and returns the workload
/// (dead, reaped) so that its pid is free for a restore.
fn killed_image(h: &Harness, img: &Path) -> Workload {
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    checkpoint_kill(h, &mut wl, img);
    wl
}

/// cr_image verify and cr_restart must both reject the image; no process left.
fn assert_rejected(h: &Harness, img: &Path, wl: &Workload, ctx: &str, any_of: &[&str]) {
    let v = h.cr_image(&[OsStr::new("verify"), img.as_os_str()]);
    assert!(
        !v.status.success(),
        "{ctx}: cr_image verify accepted it\n{}",
        v.show()
    );
    let out = h.restore_sync(img, wl.pid());
    let line = out.assert_error(ctx, RS_ERR, &[]);
    assert_mentions_any(&line, any_of, ctx);
    assert_no_restored(wl.pid(), &wl.exe, ctx);
    // The same with --detach.
    let out = h.run_tool(
        "cr_restart",
        &[OsStr::new("--detach"), img.as_os_str()],
        &RunOpts::default(),
    );
    let _guard = Proc::adopt(wl.pid(), "wrongly restored process", None);
    let line = out.assert_error(&format!("{ctx} (--detach)"), RS_ERR, &[]);
    assert_mentions_any(&line, any_of, ctx);
    assert_no_restored(wl.pid(), &wl.exe, ctx);
    assert!(
        !wl.output()
            .lines()
            .any(|l| l == "OK" || l.starts_with("FAIL")),
        "{ctx}: something ran the workload to the end\n{}",
        wl.diag()
    );
}

fn pages_file(img: &Path, _pid: i32) -> std::path::PathBuf {
    store_file(img)
}

#[test]
fn restore_truncated_pages_file() {
    let h = Harness::new("truncated");
    let img = h.image_dir("img");
    let wl = killed_image(&h, &img);
    let pages = pages_file(&img, wl.pid());
    let len = std::fs::metadata(&pages).expect("stat").len();
    assert!(len > 8192, "pages file is only {len} bytes");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&pages)
        .expect("open");
    f.set_len(len / 2).expect("truncate");
    drop(f);
    wl.go();
    assert_rejected(
        &h,
        &img,
        &wl,
        "truncated pages file",
        &[
            "truncat",
            "short",
            "size",
            "checksum",
            "eof",
            "end of file",
            "corrupt",
        ],
    );
}

#[test]
fn restore_flipped_byte_in_pages_file() {
    let h = Harness::new("flippages");
    let img = h.image_dir("img");
    let wl = killed_image(&h, &img);
    let pages = pages_file(&img, wl.pid());
    let len = std::fs::metadata(&pages).expect("stat").len();
    flip_byte(&pages, len / 2 + 123);
    wl.go();
    assert_rejected(
        &h,
        &img,
        &wl,
        "one flipped byte in the pages file",
        &["checksum"],
    );
}

#[test]
fn restore_flipped_byte_in_checkpoint_img() {
    let h = Harness::new("flipmeta");
    let img = h.image_dir("img");
    let wl = killed_image(&h, &img);
    let meta = img.join("checkpoint.img");
    let len = std::fs::metadata(&meta).expect("stat checkpoint.img").len();
    assert!(len > 64, "checkpoint.img is only {len} bytes");
    flip_byte(&meta, len / 2);
    wl.go();
    assert_rejected(
        &h,
        &img,
        &wl,
        "one flipped byte in checkpoint.img",
        &["checksum", "corrupt"],
    );
}

#[test]
fn restore_while_pid_in_use() {
    let h = Harness::new("pidinuse");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &[], pid)
        .assert_success("cr_checkpoint (continue)");
    assert_running_untraced(pid, "after checkpoint");
    let out = h.restore_sync(&img, pid);
    let line = out.assert_error("restore while the pid is in use", RS_ERR, &["in use"]);
    assert!(
        line.contains(&pid.to_string()),
        "error should name pid {pid}: {line:?}"
    );
    assert_unharmed(&mut wl, "original after a refused restore");
}

/// `kind`: a word the error line must contain (None: only `fd N` is required).
fn unsupported_fd(mode: &str, kind: Option<&str>) {
    unsupported_fd_in("wl_pipe", mode, kind);
}

fn unsupported_fd_in(bin: &str, mode: &str, kind: Option<&str>) {
    let h = Harness::new(&format!("unsupported-{mode}"));
    let mut wl = h.spawn_wl(bin, &[mode]);
    let ready = wl.wait_line("READY fds", |l| l.starts_with("READY fds "));
    let fds: Vec<i32> = ready
        .trim_start_matches("READY fds ")
        .split_whitespace()
        .map(|v| v.parse().expect("fd number"))
        .collect();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &["--kill"], pid);
    let line = out.assert_error(
        &format!("checkpoint of a process holding a {mode}"),
        CK_ERR,
        kind.as_slice(),
    );
    let names_fd = fds.iter().any(|fd| {
        let pat = format!("fd {fd}");
        line.match_indices(&pat).any(|(i, _)| {
            !line[i + pat.len()..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
        })
    });
    assert!(
        names_fd,
        "error should name one of fds {fds:?} as `fd N`: {line:?}"
    );
    assert_running_untraced(pid, "after a refused checkpoint");
    wl.go_and_expect_ok();
    // Nothing restorable was left behind.
    let r = h.restore_sync(&img, pid);
    assert!(
        !r.status.success(),
        "an image was left behind\n{}",
        r.show()
    );
    assert_no_restored(pid, &wl.exe, "after restoring a refused image");
}

#[test]
fn checkpoint_refuses_io_uring() {
    unsupported_fd("io_uring", Some("io_uring"));
}

#[test]
fn checkpoint_refuses_packet_socket_with_a_ring() {
    unsupported_fd(
        "packet_ring",
        Some("queued in its transmit ring and not sent"),
    );
}

/// `cr_checkpoint --check` names the refused fd in one line, exits 1, and
/// the process is untouched.
#[test]
fn check_names_unsupported_fd() {
    let h = Harness::new("check-io-uring");
    let mut wl = h.spawn_wl("wl_pipe", &["io_uring"]);
    let ready = wl.wait_line("READY fds", |l| l.starts_with("READY fds "));
    let fd = ready.trim_start_matches("READY fds ").trim().to_string();
    let pid = wl.pid();
    let out = h.run_tool(
        "cr_checkpoint",
        &[OsStr::new("--check"), OsStr::new(&pid.to_string())],
        &RunOpts::default(),
    );
    let line = out.assert_error("--check of an io_uring holder", CK_ERR, &["io_uring"]);
    assert!(
        line.contains(&format!("fd {fd}")),
        "--check should name fd {fd}: {line:?}"
    );
    assert!(
        out.stdout.contains("CANNOT BE SAVED"),
        "--check lists the refused fd\n{}",
        out.show()
    );
    assert_running_untraced(pid, "after --check");
    wl.go_and_expect_ok();
}

/// Pipes, unix socketpairs and eventfds, once refused, are now saved:
/// checkpoint --kill and restore, and the workload checks them.
fn supported_fd(mode: &str) {
    supported_fd_in("wl_pipe", mode);
}

fn supported_fd_in(bin: &str, mode: &str) {
    let h = Harness::new(&format!("supported-{mode}"));
    let mut wl = h.spawn_wl(bin, &[mode]);
    wl.wait_line("READY fds", |l| l.starts_with("READY fds "));
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    let out = h.run_tool(
        "cr_checkpoint",
        &[OsStr::new("--check"), OsStr::new(&pid.to_string())],
        &RunOpts::default(),
    );
    out.assert_success(&format!("--check of a {mode} holder"));
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(60));
    wl.go();
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&res, &wl, &format!("restore of a {mode} holder"));
}

#[test]
fn pipe_fd_restored() {
    supported_fd("pipe");
}

#[test]
fn socketpair_fd_restored() {
    supported_fd("socket");
}

#[test]
fn eventfd_restored() {
    supported_fd("eventfd");
}

#[test]
fn pty_master_restored() {
    supported_fd_in("wl_unsupported", "tty");
}

/// A process with a second thread, or with a child: checkpointed with --kill
/// and restored, the thread / child still work (the workload checks them).
fn process_with(mode: &str) {
    let h = Harness::new(&format!("with-{mode}"));
    let mut wl = h.spawn_wl("wl_unsupported", &[mode]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], pid)
        .assert_success(&format!("checkpoint of a process with a {mode}"));
    wl.reap_killed();
    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(60));
    wl.go();
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&res, &wl, &format!("restore of a process with a {mode}"));
}

#[test]
fn process_with_a_second_thread_restored() {
    process_with("thread");
}

#[test]
fn process_with_a_child_restored() {
    process_with("child");
}

/// An image directory that cannot be created: refused, the target is not
/// killed although --kill was asked for.
#[test]
fn checkpoint_into_unwritable_dir() {
    let h = Harness::new("unwritable");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let img = Path::new("/proc/self/no-such-dir/img");
    let out = h.checkpoint(img, &["--kill"], wl.pid());
    out.assert_error("checkpoint into an unwritable dir", CK_ERR, &[]);
    assert_unharmed(&mut wl, "after a checkpoint into an unwritable dir");
}

/// Checkpoints `bin ARGS` with --kill, removes `victim` (relative to the work
/// directory; renamed away), then expects the restore to fail cleanly with an
/// error naming it, and no process left.
fn restore_with_missing(bin: &str, args: &[&str], victim: &str) {
    let h = Harness::new(&format!("missing-{}", victim.replace('/', "_")));
    let mut wl = h.spawn_wl(bin, args);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let path = wl.workdir.join(victim);
    assert!(path.exists(), "{} does not exist", path.display());
    std::fs::rename(&path, wl.workdir.join("moved-away")).expect("rename");
    wl.go();
    let ctx = format!("restore with {victim} gone");
    let out = h.restore_sync(&img, pid);
    let line = out.assert_error(&ctx, RS_ERR, &[]);
    let name = Path::new(victim)
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or(victim);
    assert_mentions_any(&line, &[name], &ctx);
    assert_no_restored(pid, &wl.exe, &ctx);
}

#[test]
fn restore_fails_cleanly_when_cwd_is_gone() {
    restore_with_missing("wl_counter", &["5"], "cwd");
}

#[test]
fn restore_fails_cleanly_when_mapped_file_is_gone() {
    restore_with_missing("wl_memory", &["8"], "shared-map.bin");
}

#[test]
fn restore_fails_cleanly_when_open_file_is_gone() {
    restore_with_missing("wl_append", &["5"], "files/plain.dat");
}

/// A process in a user or time namespace of its own (`unshare -U -r`,
/// `unshare -T`): restored in ours it would see other ids or clocks, so
/// the checkpoint is refused naming the namespace; the process runs on.
#[test]
fn checkpoint_refuses_own_user_and_time_namespaces() {
    for (flags, kind) in [
        (&["-U", "-r"][..], "user namespace"),
        (&["-T"][..], "time namespace"),
    ] {
        let h = Harness::new(&format!("ns-{}", flags[0].trim_start_matches('-')));
        let exe = workload_path("wl_counter");
        let mut pre: Vec<&OsStr> = flags.iter().map(OsStr::new).collect();
        pre.push(exe.as_os_str());
        let mut wl = h.spawn_program("wl_counter", Path::new("/usr/bin/unshare"), &pre, &["5"]);
        wl.wait_ready();
        let img = h.image_dir("img");
        let out = h.checkpoint(&img, &["--kill"], wl.pid());
        out.assert_error(&format!("checkpoint in a {kind}"), CK_ERR, &[kind]);
        assert_unharmed(&mut wl, &format!("after a refused checkpoint in a {kind}"));
    }
}
