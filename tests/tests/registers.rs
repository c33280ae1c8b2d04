//! CPU register state (general-purpose, EFLAGS, AVX/AVX-512 vector and mask
//! registers, MXCSR, x87 control word) survives checkpoint and restore, both
//! when frozen in user space mid-computation and when blocked in a syscall, and
//! is not disturbed by a checkpoint of a process that keeps running.

use cr_tests::*;
use std::time::Duration;

fn wait_running_in_user_space(wl: &Workload) {
    let pid = wl.pid();
    wait_until(
        "the spinning workload to be on the CPU",
        Duration::from_secs(10),
        || matches!(proc_status(pid), Some(s) if s.state == 'R'),
        || wl.diag(),
    );
}

fn regs_kill_restore(mode: &str) {
    let h = Harness::new(&format!("regs-{mode}"));
    let mut wl = h.spawn_wl("wl_regs", &[mode]);
    wl.wait_ready();
    if mode == "spin" {
        wait_running_in_user_space(&wl);
    } else {
        wl.wait_blocked_in(&[libc::SYS_nanosleep], Duration::from_secs(10));
    }
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    // Let the restored process run on for a while before it checks itself.
    wait_until(
        "the restored process to run",
        Duration::from_secs(60),
        || {
            matches!(proc_status(pid), Some(s) if s.tracer_pid == 0 && (s.state == 'R' || s.state == 'S'))
                && std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == wl.exe)
        },
        || wl.diag(),
    );
    std::thread::sleep(Duration::from_millis(200)); // let it compute on restored registers
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, &format!("registers ({mode})"));
}

#[test]
fn registers_frozen_in_user_space_kill_restore() {
    regs_kill_restore("spin");
}

#[test]
fn registers_blocked_in_syscall_kill_restore() {
    regs_kill_restore("sleep");
}

/// Three checkpoints of a process that keeps running (mid-computation): it
/// must not notice anything.
#[test]
fn registers_undisturbed_by_checkpoint_in_place() {
    let h = Harness::new("regs-inplace");
    let mut wl = h.spawn_wl("wl_regs", &["spin"]);
    wl.wait_ready();
    let pid = wl.pid();
    for i in 1..=3 {
        wait_running_in_user_space(&wl);
        let img = h.image_dir(&format!("img{i}"));
        h.checkpoint(&img, &[], pid)
            .assert_success(&format!("checkpoint {i} (continue)"));
        assert_running_untraced(pid, &format!("after checkpoint {i}"));
    }
    wl.go_and_expect_ok();
}
