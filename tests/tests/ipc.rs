//! File descriptors and IPC: pipes, FIFOs, unix sockets, eventfd, signalfd,
//! timerfd, epoll, inotify, memfds, deleted and O_TMPFILE files, shared
//! open file descriptions, close-on-exec, high fd numbers and file locks
//! survive checkpoint --kill and restore (and a checkpoint that leaves the
//! process running consumes nothing); the workloads check themselves from
//! the inside and print `PART OK` lines and a final `OK`. What the engine
//! cannot save (netlink and packet sockets, TCP connections half closed, fds in flight, data of a connection
//! not yet accepted when the process runs on) is refused by name, by `--check` too, and the process is
//! left unharmed; a restore whose lock another process took meanwhile fails
//! cleanly.

mod common;

use common::object_summaries;
use cr_tests::*;
use std::ffi::{CString, OsStr};
use std::path::Path;
use std::time::Duration;

const CK_ERR: &str = "cr_checkpoint: error: ";

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

/// `cr_checkpoint --check PID`.
fn check_tool(h: &Harness, pid: i32) -> ToolOutput {
    let pid_s = pid.to_string();
    h.run_tool(
        "cr_checkpoint",
        &[OsStr::new("--check"), OsStr::new(&pid_s)],
        &RunOpts::default(),
    )
}

/// `--check` exits 0 and lists every fd of `pid` as ok.
fn assert_check_ok(h: &Harness, pid: i32, ctx: &str) {
    let out = check_tool(h, pid);
    out.assert_success(&format!("{ctx}: cr_checkpoint --check"));
    for (fd, link) in fd_list(pid) {
        let needle = format!("fd {fd} ");
        let line = out
            .stdout
            .lines()
            .find(|l| l.contains(&format!("pid {pid} ")) && l.contains(&needle))
            .unwrap_or_else(|| {
                panic!(
                    "{ctx}: --check does not list fd {fd} ({link}) of {pid}\n{}",
                    out.show()
                )
            });
        assert!(
            line.ends_with(": ok"),
            "{ctx}: --check line of fd {fd} ({link}) is not ok: {line:?}\n{}",
            out.show()
        );
    }
}

/// Checkpoint --kill, restore in the background, create `go`, expect OK.
fn kill_restore_ok(h: &Harness, wl: &mut Workload, ctx: &str) {
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(h, wl, &img);
    let mut r = h.restore_bg(&img, pid);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, wl);
    assert_restored_ok(&out, wl, ctx);
}

/// Every `NAME OK` line the workload must print.
fn assert_parts_ok(wl: &Workload, parts: &[&str]) {
    let lines = wl.lines();
    for p in parts {
        let want = format!("{p} OK");
        assert!(
            lines.contains(&want),
            "missing line {want:?}\n{}",
            wl.diag()
        );
    }
}

fn spawn_parts(h: &Harness, script: &str, parts: &[&str]) -> Workload {
    let joined = parts.join(",");
    let mut wl = h.spawn_python(script, &[&joined]);
    wl.wait_ready();
    wl
}

/// Parts of a python workload: checkpoint --kill, restore, go, every part
/// OK. With `check`, `cr_checkpoint --check` must first find every fd
/// savable; with `continue_first`, a checkpoint without --kill comes first
/// (it must consume nothing and leave the process as it was).
fn parts_kill_restore(
    h: &Harness,
    script: &str,
    parts: &[&str],
    ctx: &str,
    check: bool,
    continue_first: bool,
) {
    let mut wl = spawn_parts(h, script, parts);
    if check {
        assert_check_ok(h, wl.pid(), ctx);
    }
    if continue_first {
        h.checkpoint(&h.image_dir("img-continue"), &[], wl.pid())
            .assert_success(&format!("{ctx}: cr_checkpoint (continue)"));
        assert_running_untraced(wl.pid(), ctx);
    }
    kill_restore_ok(h, &mut wl, ctx);
    assert_parts_ok(&wl, parts);
}

fn last_got(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.strip_prefix("got "))
        .filter_map(|v| v.parse().ok())
        .max()
        .unwrap_or(0)
}

/// `got` lines go up by 8192 each, from 8192, none missing or repeated.
fn check_got_lines(wl: &Workload) {
    let mut want = 8192;
    for l in wl.lines() {
        if let Some(v) = l.strip_prefix("got ") {
            assert_eq!(
                v.parse::<u64>().ok(),
                Some(want),
                "got lines\n{}",
                wl.diag()
            );
            want += 8192;
        }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn open_rw(path: &Path) -> i32 {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL");
    // SAFETY: c is a valid NUL-terminated path.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    assert!(
        fd >= 0,
        "open {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
    fd
}

fn close(fd: i32) {
    // SAFETY: closes an fd this function's caller opened.
    unsafe { libc::close(fd) };
}

/// flock(op | LOCK_NB) on a fresh open file description (closed again).
fn try_flock(path: &Path, op: i32) -> Result<(), i32> {
    let fd = open_rw(path);
    // SAFETY: flock on our own fd.
    let r = unsafe { libc::flock(fd, op | libc::LOCK_NB) };
    let e = errno();
    close(fd);
    if r == 0 {
        Ok(())
    } else {
        Err(e)
    }
}

fn flock_struct(ltype: i32, start: i64, len: i64) -> libc::flock {
    // SAFETY: struct flock is plain old data.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = ltype as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start;
    fl.l_len = len;
    fl
}

/// fcntl(cmd) with a lock of `ltype` on [start, start+len) through a fresh
/// open file description (closed again, which drops anything taken).
fn try_lock(path: &Path, cmd: i32, ltype: i32, start: i64, len: i64) -> Result<(), i32> {
    let fd = open_rw(path);
    let mut fl = flock_struct(ltype, start, len);
    // SAFETY: fl is a valid struct flock.
    let r = unsafe { libc::fcntl(fd, cmd, &mut fl) };
    let e = errno();
    close(fd);
    if r == 0 {
        Ok(())
    } else {
        Err(e)
    }
}

/// F_GETLK for a write lock on [start, start+len): (type, start, len, pid).
fn getlk(path: &Path, start: i64, len: i64) -> (i32, i64, i64, i32) {
    let fd = open_rw(path);
    let mut fl = flock_struct(libc::F_WRLCK, start, len);
    // SAFETY: fl is a valid struct flock.
    let r = unsafe { libc::fcntl(fd, libc::F_GETLK, &mut fl) };
    let e = std::io::Error::last_os_error();
    close(fd);
    assert_eq!(r, 0, "F_GETLK on {}: {e}", path.display());
    (fl.l_type as i32, fl.l_start, fl.l_len, fl.l_pid)
}

fn assert_busy(what: &str, r: Result<(), i32>, wl: &Workload) {
    match r {
        Err(e) if e == libc::EAGAIN || e == libc::EACCES => {}
        Ok(()) => panic!(
            "{what}: the lock was granted to another process, so the restored workload does not hold it\n{}",
            wl.diag()
        ),
        Err(e) => panic!(
            "{what}: unexpected error {}\n{}",
            std::io::Error::from_raw_os_error(e),
            wl.diag()
        ),
    }
}

/// Writes `val` to fd `fd` of process `pid` (an eventfd), through a copy of
/// the fd taken with pidfd_getfd.
fn write_u64_to_fd_of(pid: i32, fd: i32, val: u64) {
    // SAFETY: pidfd_open has no pointer arguments.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    assert!(
        pidfd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: pidfd_getfd has no pointer arguments.
    let copy = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) } as i32;
    let e = std::io::Error::last_os_error();
    close(pidfd);
    assert!(copy >= 0, "pidfd_getfd({pid}, {fd}): {e}");
    // SAFETY: val is 8 readable bytes.
    let n = unsafe { libc::write(copy, (&val as *const u64).cast(), 8) };
    let e = std::io::Error::last_os_error();
    close(copy);
    assert_eq!(n, 8, "write to fd {fd} of {pid}: {e}");
}

/// The largest `ticks N` printed so far.
fn ticks_of(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.strip_prefix("ticks ")?.parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

/// The number after `key=` in a line like "FDS loop=5 ino=7".
fn field(line: &str, key: &str) -> i32 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

// ---------------------------------------------------------------------------
// Pipes and FIFOs
// ---------------------------------------------------------------------------

/// A writer child streams numbered records into a pipe, the parent reads and
/// checks them; checkpoint --kill mid-stream (the pipe full), restore: the
/// records go on with no gap, duplicate or reordering up to the target.
#[test]
fn pipe_stream_parent_child_kill_restore() {
    let h = Harness::new("ipc-stream");
    let mut wl = h.spawn_python("py_ipc_stream.py", &["40000"]);
    wl.wait_ready();
    wl.wait_line("got 24576", |l| l == "got 24576");
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    // The writer child was killed too; reap it so its pid is free.
    reap_orphans();
    let objs = object_summaries(&h, &img);
    let pipe = objs
        .iter()
        .find(|s| s.starts_with("pipe:["))
        .unwrap_or_else(|| panic!("no pipe in the image: {objs:?}"));
    assert!(
        pipe.contains("capacity 131072") && !pipe.contains(" 0 bytes buffered"),
        "the pipe should be caught with bytes in it and its 128 KiB capacity: {pipe}"
    );
    let at = last_got(&wl.output());
    let mut r = h.restore_bg(&img, pid);
    let target = at + 16384;
    r.wait_line(&wl, "records after restore", |l| {
        l.strip_prefix("got ")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v >= target)
    });
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "pipe stream restore");
    assert_parts_ok(&wl, &["stream"]);
    check_got_lines(&wl);
}

/// Checkpoints that leave the processes running must not consume a byte
/// of the pipe between writer child and reading parent.
#[test]
fn pipe_stream_checkpoint_without_kill_consumes_nothing() {
    let h = Harness::new("ipc-stream-cont");
    let mut wl = h.spawn_python("py_ipc_stream.py", &["30000"]);
    wl.wait_ready();
    for i in 0..2 {
        let at = last_got(&wl.output());
        let img = h.image_dir(&format!("img{i}"));
        h.checkpoint(&img, &[], wl.pid())
            .assert_success("cr_checkpoint (continue)");
        assert_running_untraced(wl.pid(), "stream reader after checkpoint");
        for (c, _) in children_of(wl.pid()) {
            assert_running_untraced(c, "stream writer after checkpoint");
        }
        let target = format!("got {}", at + 16384);
        wl.wait_line(&target, |l| l == target);
    }
    wl.go_and_expect_ok();
    assert_parts_ok(&wl, &["stream"]);
    check_got_lines(&wl);
}

fn children_of(pid: i32) -> Vec<(i32, String)> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .map(|c| (c, describe(c)))
        .collect()
}

const PIPE_PARTS: &[&str] = &[
    "buffered",
    "bigsize",
    "smallsize",
    "nonblock",
    "nowriter",
    "noreader",
    "fifo_rw",
    "fifo_ends",
    "fifo_reader_only",
    "dup_ends",
];

/// Pipes and FIFOs of one process with bytes buffered, capacities set with
/// F_SETPIPE_SZ, O_NONBLOCK, a closed write end (EOF after the data), a
/// closed read end (EPIPE), dup'ed ends.
#[test]
fn pipes_and_fifos_kill_restore() {
    let h = Harness::new("ipc-pipes");
    parts_kill_restore(
        &h,
        "py_ipc_pipes.py",
        PIPE_PARTS,
        "pipes and FIFOs",
        true,
        true,
    );
}

/// F_GETFL of restored pipe ends is exactly the original's (the access
/// mode and O_NONBLOCK; no O_LARGEFILE that a reopen through /proc adds).
#[test]
fn pipe_status_flags_exact() {
    let h = Harness::new("ipc-pipe-flags");
    parts_kill_restore(
        &h,
        "py_ipc_pipes.py",
        &["exact_flags"],
        "pipe status flags",
        false,
        false,
    );
}

// ---------------------------------------------------------------------------
// Unix sockets
// ---------------------------------------------------------------------------

const UNIX_PARTS: &[&str] = &[
    "stream",
    "dgram",
    "seqpacket",
    "listener",
    "queued",
    "fork",
    "abstract",
    "dgram_path",
    "unlinked",
    "shutdown",
    "stream_peer_closed",
];

/// socketpairs of every type with data queued both ways (an empty
/// datagram too), named and abstract listeners with accepted and
/// still-queued connections (in one process and across a fork), bound
/// datagram sockets, an unlinked name, a shutdown, a stream whose peer wrote
/// and closed.
#[test]
fn unix_sockets_kill_restore() {
    let h = Harness::new("ipc-unix");
    let mut wl = spawn_parts(&h, "py_ipc_unix.py", UNIX_PARTS);
    // No --check or earlier checkpoint first: their MSG_PEEK marks the empty
    // datagram, which a later peek with SO_PEEK_OFF skips (known limit).
    kill_restore_ok(&h, &mut wl, "unix sockets");
    assert_parts_ok(&wl, UNIX_PARTS);
    assert_parts_ok(&wl, &["fork child"]);
}

/// Checkpoints that leave the processes running consume nothing from any
/// socket queue: the original then finds every byte and datagram.
#[test]
fn unix_sockets_checkpoint_without_kill_consumes_nothing() {
    let h = Harness::new("ipc-unix-cont");
    let mut wl = spawn_parts(&h, "py_ipc_unix.py", UNIX_PARTS);
    for i in 0..2 {
        h.checkpoint(&h.image_dir(&format!("img{i}")), &[], wl.pid())
            .assert_success("unix sockets: cr_checkpoint (continue)");
        assert_running_untraced(wl.pid(), "unix sockets after checkpoint");
    }
    wl.go_and_expect_ok();
    assert_parts_ok(&wl, UNIX_PARTS);
    assert_parts_ok(&wl, &["fork child"]);
}

/// A connection not accepted yet whose client had already sent data: that
/// data waits where only accept() reads it. A checkpoint that lets the
/// process run on cannot take it off the queue, so it is refused by name
/// (`--check` too), and the process is left unharmed; `--kill` takes it
/// (the processes end), and after the restore accept() returns the
/// connection with the data.
#[test]
fn unix_queued_connection_with_early_data() {
    let h = Harness::new("ipc-queued-data");
    let mut wl = spawn_parts(&h, "py_ipc_unix.py", &["queued_data"]);
    let pid = wl.pid();
    let kws = ["not yet accepted", "fd "];
    let out = check_tool(&h, pid);
    out.assert_error(
        "--check of an unaccepted connection with data",
        CK_ERR,
        &kws,
    );
    assert_running_untraced(pid, "after --check");
    let out = h.checkpoint(&h.image_dir("img-cont"), &[], pid);
    let line = out.assert_error(
        "checkpoint (continue) of an unaccepted connection with data",
        CK_ERR,
        &kws,
    );
    assert!(
        line.contains(&format!("process {pid}:")),
        "the error names the process: {line:?}"
    );
    assert_running_untraced(pid, "after a refused checkpoint");
    kill_restore_ok(&h, &mut wl, "unaccepted connection with data");
    assert_parts_ok(&wl, &["queued_data"]);
}

/// Datagrams queued on a socket bound to a path, sent with sendto() by
/// another bound socket: recvfrom() still gives the sender's address.
#[test]
fn unix_dgram_sender_address_kept() {
    let h = Harness::new("ipc-dgram-sender");
    parts_kill_restore(
        &h,
        "py_ipc_unix.py",
        &["dgram_sender"],
        "sender address of queued datagrams",
        false,
        false,
    );
}

/// A datagram socket whose path was unlinked, with a datagram queued.
#[test]
fn unix_dgram_unlinked_name_with_queued_datagram() {
    let h = Harness::new("ipc-unlinked-queued");
    parts_kill_restore(
        &h,
        "py_ipc_unix.py",
        &["unlinked_queued"],
        "queued datagram on an unlinked name",
        false,
        false,
    );
}

/// A datagram socket connected to a socket whose path was then unlinked:
/// the connection carries data on after the restore.
#[test]
fn unix_dgram_connected_to_unlinked_name() {
    let h = Harness::new("ipc-unlinked-peer");
    parts_kill_restore(
        &h,
        "py_ipc_unix.py",
        &["unlinked_peer"],
        "datagram connection to an unlinked name",
        false,
        false,
    );
}

/// A datagram socketpair whose sending end wrote and was closed: the
/// datagrams still queued on the other end arrive after the restore (the
/// image must be restorable, or the checkpoint refused).
#[test]
fn unix_dgram_peer_closed_with_queued_data() {
    let h = Harness::new("ipc-dgram-closed");
    parts_kill_restore(
        &h,
        "py_ipc_unix.py",
        &["dgram_peer_closed"],
        "datagrams of a closed peer",
        false,
        false,
    );
}

/// The same for SOCK_SEQPACKET: the records, then EOF.
#[test]
fn unix_seqpacket_peer_closed_with_queued_data() {
    let h = Harness::new("ipc-seqpacket-closed");
    parts_kill_restore(
        &h,
        "py_ipc_unix.py",
        &["seqpacket_peer_closed"],
        "records of a closed seqpacket peer",
        false,
        false,
    );
}

/// A listener bound with a relative path (the process's cwd is its work
/// directory; cr_restart runs elsewhere): after the restore a client
/// connects through the path.
#[test]
fn unix_listener_bound_by_relative_path() {
    let h = Harness::new("ipc-relpath");
    parts_kill_restore(
        &h,
        "py_ipc_unix.py",
        &["relpath"],
        "relative socket path",
        false,
        false,
    );
}

// ---------------------------------------------------------------------------
// eventfd, signalfd, timerfd, epoll, inotify
// ---------------------------------------------------------------------------

/// An epoll loop over a periodic timerfd, an eventfd, a signalfd and an
/// inotify instance keeps running after the restore: the timer ticks on,
/// and an eventfd write, a signal and file creations made by the test after
/// the restore arrive with the right epoll data and watch descriptors.
#[test]
fn epoll_loop_eventfd_signalfd_timerfd_inotify_kill_restore() {
    epoll_loop(&[]);
}

/// The same with a gap in the inotify watch descriptors (1, 3: watch 2 was
/// removed before the checkpoint): the restored instance must deliver only
/// the two IN_CREATE events, nothing left over from rebuilding the gap.
#[test]
fn inotify_watch_descriptor_gap_kill_restore() {
    epoll_loop(&["wdgap"]);
}

fn epoll_loop(args: &[&str]) {
    let h = Harness::new("ipc-events");
    let mut wl = h.spawn_wl("wl_ipc_events", args);
    wl.wait_ready();
    let fds = wl.wait_line("FDS", |l| l.starts_with("FDS "));
    let loopfd = field(&fds, "loop");
    wl.wait_line("ticks 3", |l| l == "ticks 3");
    let pid = wl.pid();
    assert_check_ok(&h, pid, "events");
    // Checkpoint right after a tick was read: the next expiry is 100 ms
    // away (a timer caught expired but unread is wl_ipc_timer's case).
    let n = ticks_of(&wl.output()) + 1;
    let line = format!("ticks {n}");
    wl.wait_line(&line, |l| l == line);
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let at = ticks_of(&wl.output());
    let mut r = h.restore_bg(&img, pid);
    let target = at + 3;
    r.wait_line(&wl, "timer ticks after restore", |l| {
        l.strip_prefix("ticks ")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v >= target)
    });
    r.restored.signal(libc::SIGUSR1);
    write_u64_to_fd_of(pid, loopfd, 7);
    touch(&wl.workdir.join("other/created-in-other"));
    touch(&wl.workdir.join("watched/created-after-restore"));
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "epoll loop restore");
    assert_parts_ok(
        &wl,
        &[
            "timerfd periodic",
            "timerfd one-shot",
            "eventfd counter",
            "eventfd semaphore",
            "epoll eventfd",
            "epoll signalfd",
            "signalfd pending",
            "epoll inotify",
        ],
    );
}

/// A periodic timerfd caught expired but not yet read (the kernel shows
/// `it_value: (0, 0)` then) keeps its interval and goes on ticking.
#[test]
fn timerfd_periodic_expired_unread_kill_restore() {
    let h = Harness::new("ipc-timer-expired");
    let mut wl = h.spawn_wl("wl_ipc_timer", &["expired"]);
    wl.wait_ready();
    kill_restore_ok(&h, &mut wl, "expired periodic timerfd");
    assert_parts_ok(&wl, &["expired periodic timerfd"]);
}

/// An absolute (TFD_TIMER_ABSTIME) CLOCK_REALTIME timerfd stays due at the
/// same wall-clock time although 1.5 s pass between checkpoint and restore.
#[test]
fn timerfd_absolute_realtime_kill_restore() {
    let h = Harness::new("ipc-timer-abs");
    let mut wl = h.spawn_wl("wl_ipc_timer", &["absolute"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    // Downtime is the point of this test, not a wait for something: an
    // absolute timer must not move with it.
    std::thread::sleep(Duration::from_millis(1500));
    let mut r = h.restore_bg(&img, pid);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "absolute timerfd restore");
    assert_parts_ok(&wl, &["absolute timerfd"]);
}

// ---------------------------------------------------------------------------
// memfd, deleted and O_TMPFILE files, shared descriptions, fd numbers
// ---------------------------------------------------------------------------

/// fd_list with the names of deleted files (O_TMPFILE files are named by
/// their inode, which a restore cannot keep; deleted files are checked by
/// `deleted_file_keeps_its_name`) and pipe inodes (new pipes) replaced by
/// placeholders.
fn fd_list_anon_deleted(pid: i32) -> Vec<(i32, String)> {
    fd_list(pid)
        .into_iter()
        .map(|(fd, t)| {
            if t.ends_with(" (deleted)") && !t.starts_with("/memfd:") {
                (fd, "a deleted file".to_string())
            } else if t.starts_with("pipe:[") {
                (fd, "a pipe".to_string())
            } else {
                (fd, t)
            }
        })
        .collect()
}

const FILE_PARTS: &[&str] = &[
    "memfd_sealed",
    "memfd_mmap",
    "deleted",
    "deleted_mmap",
    "tmpfile",
    "dup_fork",
    "cloexec_high",
    "fork_anon",
];

#[test]
fn memfd_deleted_tmpfile_shared_fds_kill_restore() {
    let h = Harness::new("ipc-files");
    let mut wl = spawn_parts(&h, "py_ipc_files.py", FILE_PARTS);
    assert_check_ok(&h, wl.pid(), "files");
    let fds = fd_list_anon_deleted(wl.pid());
    assert!(
        fds.iter().any(|(fd, _)| *fd == 900) && fds.iter().any(|(fd, _)| *fd == 5000),
        "the workload should hold fds 900 and 5000: {fds:?}"
    );
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    reap_orphans();
    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(30));
    assert_eq!(
        fd_list_anon_deleted(pid),
        fds,
        "restored fds (numbers and targets) differ from the original's"
    );
    assert!(
        !wl.workdir.join("deleted.dat").exists(),
        "the restore left the deleted file's path behind"
    );
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "files restore");
    assert_parts_ok(&wl, FILE_PARTS);
    assert_parts_ok(&wl, &["dup_fork child", "fork_anon child"]);
}

/// A file deleted while open still shows its old path in /proc/PID/fd
/// after the restore ("PATH (deleted)").
#[test]
fn deleted_file_keeps_its_name() {
    let h = Harness::new("ipc-deleted-name");
    parts_kill_restore(
        &h,
        "py_ipc_files.py",
        &["deleted_name"],
        "name of a deleted file",
        false,
        false,
    );
}

// ---------------------------------------------------------------------------
// File locks
// ---------------------------------------------------------------------------

#[test]
fn flock_posix_ofd_locks_kill_restore() {
    let h = Harness::new("ipc-locks");
    let mut wl = h.spawn_python("py_ipc_locks.py", &[]);
    wl.wait_ready();
    let pid = wl.pid();
    let f = |n: &str| wl.workdir.join(n);
    let (fex, fsh, fpo, fofd) = (
        f("flock_ex.dat"),
        f("flock_sh.dat"),
        f("posix.dat"),
        f("ofd.dat"),
    );
    // Sanity: before the checkpoint the locks are held.
    assert_busy("flock LOCK_EX before", try_flock(&fex, libc::LOCK_EX), &wl);
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    // The original is dead: its locks are gone.
    assert_eq!(
        try_flock(&fex, libc::LOCK_EX),
        Ok(()),
        "locks of a dead process"
    );

    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(30));
    assert_busy(
        "flock(LOCK_EX) on flock_ex.dat",
        try_flock(&fex, libc::LOCK_EX),
        &wl,
    );
    assert_busy(
        "flock(LOCK_SH) on flock_ex.dat",
        try_flock(&fex, libc::LOCK_SH),
        &wl,
    );
    assert_eq!(
        try_flock(&fsh, libc::LOCK_SH),
        Ok(()),
        "flock(LOCK_SH) on flock_sh.dat (held shared) must be granted\n{}",
        wl.diag()
    );
    assert_busy(
        "flock(LOCK_EX) on flock_sh.dat",
        try_flock(&fsh, libc::LOCK_EX),
        &wl,
    );
    assert_busy(
        "F_SETLK write on posix.dat 10-19",
        try_lock(&fpo, libc::F_SETLK, libc::F_WRLCK, 10, 10),
        &wl,
    );
    assert_busy(
        "F_SETLK read on posix.dat 19",
        try_lock(&fpo, libc::F_SETLK, libc::F_RDLCK, 19, 1),
        &wl,
    );
    assert_eq!(
        getlk(&fpo, 0, 0),
        (libc::F_WRLCK, 10, 10, pid),
        "F_GETLK on posix.dat: (type, start, len, holder)\n{}",
        wl.diag()
    );
    assert_eq!(
        try_lock(&fpo, libc::F_SETLK, libc::F_WRLCK, 20, 20),
        Ok(()),
        "F_SETLK write on the free range 20-39 of posix.dat\n{}",
        wl.diag()
    );
    assert_eq!(
        try_lock(&fpo, libc::F_SETLK, libc::F_RDLCK, 40, 10),
        Ok(()),
        "F_SETLK read on 40-49 of posix.dat (held for reading) must be granted\n{}",
        wl.diag()
    );
    assert_busy(
        "F_SETLK write on posix.dat 40-49",
        try_lock(&fpo, libc::F_SETLK, libc::F_WRLCK, 40, 10),
        &wl,
    );
    assert_busy(
        "F_OFD_SETLK write on ofd.dat",
        try_lock(&fofd, libc::F_OFD_SETLK, libc::F_WRLCK, 0, 0),
        &wl,
    );
    assert_busy(
        "F_OFD_SETLK read on ofd.dat",
        try_lock(&fofd, libc::F_OFD_SETLK, libc::F_RDLCK, 150, 1),
        &wl,
    );
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "locks restore");
    assert_parts_ok(&wl, &["locks child"]);
    // Released: everything can be taken now.
    assert_eq!(try_flock(&fex, libc::LOCK_EX), Ok(()), "flock after exit");
    assert_eq!(try_flock(&fsh, libc::LOCK_EX), Ok(()), "flock after exit");
    assert_eq!(
        try_lock(&fpo, libc::F_SETLK, libc::F_WRLCK, 0, 0),
        Ok(()),
        "POSIX lock after exit"
    );
    assert_eq!(
        try_lock(&fofd, libc::F_OFD_SETLK, libc::F_WRLCK, 0, 0),
        Ok(()),
        "OFD lock after exit"
    );
}

/// A read lease being broken by a child of the tree, blocked opening the
/// file for writing: after --kill and the restore the lease is still being
/// broken (no second SIGIO), the child waits for it again (its open
/// restarted), and gets the file once the workload gives the lease up.
#[test]
fn lease_broken_by_a_child_kill_restore() {
    let h = Harness::new("ipc-lease-tree");
    let mut wl = h.spawn_python("py_ipc_leases.py", &["tree"]);
    wl.wait_ready();
    kill_restore_ok(&h, &mut wl, "lease being broken by a child");
}

/// The pids /proc/locks shows blocked on a lease (any file).
fn lease_waiters() -> Vec<i32> {
    read_text(Path::new("/proc/locks"))
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.len() > 5 && w[1..4] == ["->", "LEASE", "BREAKER"])
                .then(|| w[5].parse().ok())
                .flatten()
        })
        .collect()
}

/// A lease being broken by a process outside the tree, blocked opening the
/// file: it would get the file once the holder is killed, not wait for the
/// restored lease, so --check and --kill refuse, naming that process; the
/// workload runs on, gives the lease up, and the opener gets the file.
#[test]
fn lease_awaited_outside_the_tree_refused() {
    let h = Harness::new("ipc-lease-outside");
    let mut wl = h.spawn_python("py_ipc_leases.py", &["outside"]);
    wl.wait_line("LEASED", |l| l == "LEASED");
    let file = wl.workdir.join("leased.dat");
    let mut opener = std::process::Command::new(python3())
        .args([
            "-c",
            "import os, sys; os.close(os.open(sys.argv[1], os.O_WRONLY))",
        ])
        .arg(&file)
        .spawn()
        .expect("start the opener");
    let who = opener.id() as i32;
    wl.wait_ready();
    wait_until(
        &format!("the opener {who} to be blocked on the lease"),
        Duration::from_secs(60),
        || lease_waiters().contains(&who),
        || wl.diag(),
    );
    let pid = wl.pid();
    let opener_kw = format!("process {who}");
    let kws = ["outside the tree", opener_kw.as_str(), "lease"];
    check_tool(&h, pid).assert_error("--check of a lease awaited outside", CK_ERR, &kws);
    assert_running_untraced(pid, "after --check");
    let out = h.checkpoint(&h.image_dir("img"), &["--kill"], pid);
    let line = out.assert_error("checkpoint --kill of a lease awaited outside", CK_ERR, &kws);
    assert!(
        line.contains(&format!("process {pid}:")),
        "the error names the process: {line:?}"
    );
    assert_running_untraced(pid, "after a refused checkpoint");
    assert!(
        lease_waiters().contains(&who),
        "the opener stopped waiting for the lease"
    );
    wl.go_and_expect_ok();
    let st = opener.wait().expect("wait for the opener");
    assert!(st.success(), "the opener: {st}");
}

/// A lock the image holds was taken by another process between checkpoint
/// and restore: the restore fails with one error line naming the lock and
/// leaves no process behind; once the lock is free, the same image restores.
#[test]
fn restore_refused_while_another_process_holds_the_lock() {
    let h = Harness::new("ipc-lock-taken");
    let mut wl = h.spawn_python("py_ipc_locks.py", &[]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let path = wl.workdir.join("flock_ex.dat");
    let fd = open_rw(&path);
    // SAFETY: flock on our own fd.
    let r = unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(r, 0, "flock: {}", std::io::Error::last_os_error());
    let out = h.restore_sync(&img, pid);
    let line = out.assert_error(
        "restore while the lock is held elsewhere",
        "cr_restart: error: ",
        &["flock_ex.dat"],
    );
    assert_mentions_any(&line, &["lock"], "restore with a taken lock");
    assert_no_restored(pid, &wl.exe, "restore with a taken lock");
    close(fd);
    kill_restore_again(&h, &mut wl, &img);
}

/// Restores `img` (the workload already checkpointed and dead), goes, OK.
fn kill_restore_again(h: &Harness, wl: &mut Workload, img: &Path) {
    let mut r = h.restore_bg(img, wl.pid());
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, wl);
    assert_restored_ok(&out, wl, "restore once the lock is free");
}

// ---------------------------------------------------------------------------
// Refused sockets
// ---------------------------------------------------------------------------

/// `--check` and `--kill` both refuse the socket by name and fd number; the
/// workload runs on untraced and verifies OK (its pipe and socketpair data
/// untouched).
fn refused_socket(mode: &str, keywords: &[&str]) {
    refused(mode, keywords, true, true);
}

/// `check`: run `--check` first (it must refuse too); `kill`: then
/// `--kill` (refused). Either way the workload must verify OK at go.
fn refused(mode: &str, keywords: &[&str], check: bool, kill: bool) {
    let h = Harness::new(&format!("ipc-refuse-{mode}"));
    let mut wl = h.spawn_python("py_ipc_refuse.py", &[mode]);
    wl.wait_ready();
    let line = wl.wait_line("SOCKFD", |l| l.starts_with("SOCKFD "));
    let fd: i32 = line["SOCKFD ".len()..].parse().expect("fd number");
    let pid = wl.pid();
    let fd_kw = format!("fd {fd} ");
    let mut kws: Vec<&str> = keywords.to_vec();
    kws.push(&fd_kw);
    kws.push("not supported");

    if check {
        check_refuses(&h, pid, fd, mode, keywords, &kws);
    }
    if kill {
        let img = h.image_dir("img");
        let out = h.checkpoint(&img, &["--kill"], pid);
        let err = out.assert_error(
            &format!("checkpoint --kill of a {mode} socket"),
            CK_ERR,
            &kws,
        );
        assert!(
            err.contains(&format!("process {pid}:")),
            "error names the process: {err:?}"
        );
        assert_running_untraced(pid, &format!("after a refused checkpoint ({mode})"));
    }
    wl.go_and_expect_ok();
}

/// `--check` exits 1 with one stderr line naming the process, the fd and
/// `keywords`, and lists that fd (only that one) as CANNOT BE SAVED.
fn check_refuses(h: &Harness, pid: i32, fd: i32, mode: &str, keywords: &[&str], kws: &[&str]) {
    let fd_kw = format!("fd {fd} ");
    let out = check_tool(h, pid);
    let err = out.assert_error(&format!("--check of a {mode} socket"), CK_ERR, kws);
    assert!(
        err.contains(&format!("process {pid}:")),
        "--check error names the process: {err:?}"
    );
    let listed = out
        .stdout
        .lines()
        .find(|l| l.contains(&fd_kw) && l.contains("CANNOT BE SAVED"))
        .unwrap_or_else(|| panic!("--check lists no refused fd {fd}\n{}", out.show()));
    assert_mentions_any(listed, keywords, "--check line");
    assert_eq!(
        out.stdout
            .lines()
            .filter(|l| l.contains("CANNOT BE SAVED"))
            .count(),
        1,
        "only the {mode} socket is refused (pipe and socketpair are fine)\n{}",
        out.show()
    );
    assert_running_untraced(pid, "after --check");
}

/// A netlink socket with a dump's answer not read yet: refused by name
/// (netlink cannot show queued messages without taking them), and the
/// workload then reads that answer in full.
#[test]
fn netlink_socket_with_unread_messages_refused_by_name() {
    refused_socket("netlink_unread", &["netlink", "not read yet"]);
}

/// A mode of py_ipc_refuse.py that is saved now: `--check` finds every fd
/// saveable, a checkpoint that continues leaves the socket as it was, and
/// after --kill and a restore the workload checks it.
fn saved_socket(mode: &str) {
    let h = Harness::new(&format!("ipc-saved-{mode}"));
    let mut wl = h.spawn_python("py_ipc_refuse.py", &[mode]);
    wl.wait_ready();
    wl.wait_line("SOCKFD", |l| l.starts_with("SOCKFD "));
    let pid = wl.pid();
    assert_check_ok(&h, pid, mode);
    h.checkpoint(&h.image_dir("img-cont"), &[], pid)
        .assert_success(&format!("{mode}: cr_checkpoint (continue)"));
    assert_running_untraced(pid, &format!("{mode} after a checkpoint that continues"));
    kill_restore_ok(&h, &mut wl, mode);
}

/// A NETLINK_ROUTE socket in two multicast groups with a raised buffer:
/// the restored workload finds its port id, groups and buffer, and its
/// RTM_GETLINK dump is answered.
#[test]
fn netlink_socket_saved_and_restored() {
    saved_socket("netlink");
}

/// A packet socket bound to lo for IPv4, all-multicast there: the restored
/// workload finds it bound so and sees a datagram it sends over lo.
#[test]
fn packet_socket_saved_and_restored() {
    saved_socket("packet");
}

/// A raw ICMP socket with an ICMP filter: the restored workload finds the
/// filter and gets the reply to its echo request.
#[test]
fn raw_socket_saved_and_restored() {
    saved_socket("raw");
}

/// A TCP connection whose peer closed (CLOSE-WAIT), once refused: the
/// restored workload reads the bytes before the end of the stream, then
/// the end.
#[test]
fn tcp_close_wait_saved_and_restored() {
    saved_socket("tcp_close_wait");
}

/// A unix socket with a pipe's read end in flight (SCM_RIGHTS, not received
/// yet, the sender's copy closed): the checkpoint that continues leaves it
/// in flight, and the restored workload receives the fd and reads the
/// pipe's bytes through it.
#[test]
fn scm_rights_in_flight_kill_restore() {
    saved_socket("scm_rights");
}
