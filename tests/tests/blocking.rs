//! Checkpoint while the process is blocked in a syscall; after restore the
//! syscall must complete as if nothing happened.

use cr_tests::*;
use std::time::{Duration, Instant};

const SECS: u64 = 3;

fn block_case(mode: &str, nr: i64, needs_signal: bool) {
    let h = Harness::new(&format!("block-{mode}"));
    let t0 = Instant::now();
    let secs = SECS.to_string();
    let mut wl = h.spawn_wl("wl_block", &[mode, &secs]);
    wl.wait_ready();
    wl.wait_blocked_in(&[nr], Duration::from_secs(2));
    let pid = wl.pid();
    let img = h.image_dir("img");

    let ck = h.checkpoint(&img, &["--kill"], pid);
    ck.assert_success(&format!(
        "cr_checkpoint --kill of a process blocked in {mode}"
    ));
    wl.reap_killed();
    assert_eq!(
        wl.output(),
        "READY\n",
        "the original returned from {mode} before the checkpoint finished ({:?}): the test \
         needs the dump to take less than {SECS} s",
        ck.elapsed
    );

    let mut r = h.restore_bg(&img, pid);
    if needs_signal {
        r.wait_blocked_in(&wl, &[nr], Duration::from_secs(30));
        r.restored.signal(libc::SIGUSR1);
    }
    let out = r.wait(Duration::from_secs(SECS + 60), &wl);
    assert_restored_ok(
        &out,
        &wl,
        &format!("restore of a process blocked in {mode}"),
    );
    let lines = wl.lines();
    assert_eq!(
        lines.len(),
        3,
        "expected READY, elapsed_ms, OK\n{}",
        wl.diag()
    );
    let elapsed: u128 = lines[1]
        .strip_prefix("elapsed_ms ")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("bad elapsed line {:?}", lines[1]));
    let wall = t0.elapsed().as_millis();
    assert!(
        elapsed <= wall + 100,
        "{mode}: the workload measured {elapsed} ms in the syscall but only {wall} ms passed"
    );
    if !needs_signal {
        assert!(
            elapsed + 20 >= SECS as u128 * 1000,
            "{mode}: slept {elapsed} ms < {SECS} s"
        );
    }
}

#[test]
fn blocked_in_nanosleep_with_rem() {
    block_case("nanosleep", libc::SYS_nanosleep, false);
}

#[test]
fn blocked_in_nanosleep_without_rem() {
    block_case("nanosleep-norem", libc::SYS_nanosleep, false);
}

#[test]
fn blocked_in_clock_nanosleep_relative() {
    block_case("clock", libc::SYS_clock_nanosleep, false);
}

#[test]
fn blocked_in_clock_nanosleep_abstime() {
    block_case("abs", libc::SYS_clock_nanosleep, false);
}

#[test]
fn blocked_in_poll_with_timeout() {
    block_case("poll", libc::SYS_poll, false);
}

#[test]
fn blocked_in_select_with_timeout() {
    block_case("select", libc::SYS_select, false);
}

#[test]
fn blocked_in_pause_woken_by_restored_handler() {
    block_case("pause", libc::SYS_pause, true);
}

#[test]
fn blocked_in_sigsuspend_woken_by_restored_handler() {
    block_case("sigsuspend", libc::SYS_rt_sigsuspend, true);
}

/// The SIGUSR1 handler is SA_ONSTACK on a sigaltstack: after restore it must
/// still run on that stack, and sigaltstack() must report it.
#[test]
fn blocked_in_pause_handler_on_sigaltstack() {
    block_case("altstack", libc::SYS_pause, true);
}

/// A blocked SIGHUP is pending at checkpoint time: after restore it is still
/// pending, and its handler runs once it is unblocked.
#[test]
fn blocked_in_pause_with_pending_signal() {
    block_case("pending", libc::SYS_pause, true);
}

/// Threads in calls that end with EINTR on any stop (epoll_wait,
/// epoll_pwait, sigtimedwait, semtimedop, recv under SO_RCVTIMEO) never see
/// one, through checkpoints that let the process go on and through a
/// --kill checkpoint and restore: no signal is ever sent to the workload,
/// so an EINTR could only come from our freeze.
#[test]
fn freeze_never_surfaces_eintr() {
    let h = Harness::new("eintr");
    let mut wl = h.spawn_wl("wl_eintr", &[]);
    wl.wait_ready();
    let pid = wl.pid();
    for i in 0..4 {
        let img = h.image_dir(&format!("cont{i}"));
        h.checkpoint(&img, &[], pid)
            .assert_success("checkpoint-and-continue of threads in epoll_wait and co");
    }
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    // Restored and let go: the main thread polls for `go` in nanosleep.
    r.wait_blocked_in(
        &wl,
        &[libc::SYS_nanosleep, libc::SYS_clock_nanosleep],
        Duration::from_secs(30),
    );
    let restored = r.restored.pid;
    for i in 0..2 {
        let again = h.image_dir(&format!("again{i}"));
        h.checkpoint(&again, &[], restored)
            .assert_success("checkpoint-and-continue of the restored process");
    }
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "threads blocked in EINTR-prone calls");
}
