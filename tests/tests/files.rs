//! Regular-file fds (O_APPEND and plain writers, offsets), a directory fd and
//! device fds survive checkpoint --kill and restore.

use cr_tests::*;

#[test]
fn append_and_plain_writers_kill_restore() {
    append_kill_restore("5");
}

/// The same with a writer that never pauses (frozen mid-stream).
#[test]
fn busy_append_writer_kill_restore() {
    append_kill_restore("0");
}

fn append_kill_restore(sleep_ms: &str) {
    let h = Harness::new("append");
    let mut wl = h.spawn_wl("wl_append", &[sleep_ms]);
    wl.wait_ready();
    let app = wl.workdir.join("files/append.dat");
    let plain = wl.workdir.join("files/plain.dat");
    wait_until(
        "50 records",
        LINE_TIMEOUT,
        || file_len(&app) >= 50 * REC,
        || wl.diag(),
    );
    let pid = wl.pid();
    let fds_before = fd_list(pid);
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);

    let n0 = check_records(&app).unwrap_or_else(|e| panic!("after checkpoint: {e}"));
    // Each record goes to append.dat, then to plain.dat: a busy writer may
    // be frozen between the two writes.
    let p0 = check_records(&plain).unwrap_or_else(|e| panic!("plain.dat after checkpoint: {e}"));
    assert!(
        p0 == n0 || p0 + 1 == n0,
        "plain.dat has {p0} records at checkpoint, append.dat {n0}"
    );

    let mut r = h.restore_bg(&img, pid);
    wait_until(
        "30 more records after restore",
        LINE_TIMEOUT,
        || file_len(&app) >= (n0 + 30) * REC,
        || format!("{}\n{}", r.cmdline, wl.diag()),
    );
    assert!(r.running(), "cr_restart exited early\n{}", r.diag());
    assert_eq!(
        fd_list(pid),
        fds_before,
        "restored fds differ from the original's"
    );
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "append restore");

    let n = check_records(&app).unwrap_or_else(|e| panic!("{e}\n{}", wl.diag()));
    assert_eq!(check_records(&plain), Ok(n), "plain.dat after the run");
    assert!(
        n >= n0 + 30,
        "only {n} records after restore (had {n0} at checkpoint)"
    );
    assert_eq!(
        read_bytes(&app),
        read_bytes(&plain),
        "append.dat and plain.dat differ"
    );
    assert!(
        wl.lines().iter().any(|l| *l == format!("records {n}")),
        "workload's own count differs from the files' {n} records\n{}",
        wl.diag()
    );
}

/// Work files (stdout, mapped files, record files) in a directory whose name
/// has spaces and non-ASCII characters.
#[test]
fn paths_with_spaces_and_unicode() {
    let h = Harness::new("paths");
    let mut wl = h.spawn_wl_in("work dir ü ✓ (1)", "wl_memory", &["8", "fileoff"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, std::time::Duration::from_secs(60));
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "paths with spaces and unicode");
}

/// A newline in the directory name (shown escaped in /proc/PID/maps).
#[test]
fn paths_with_newline() {
    let h = Harness::new("newline");
    let mut wl = h.spawn_wl_in("work\ndir", "wl_memory", &["8"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, std::time::Duration::from_secs(60));
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "paths with a newline");
}
