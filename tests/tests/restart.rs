//! Restart scenarios: consecutive counter, checkpoint-and-continue, repeated
//! cycles with --detach, --stop, and the image inspection tool.

use cr_tests::*;
use std::ffi::OsStr;
use std::time::Duration;

/// Checkpoint --kill, restore, go: the printed sequence has no gap and no
/// duplicate, and the workload's own checksum of it matches.
#[test]
fn counter_kill_restore_is_consecutive() {
    let h = Harness::new("counter");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    wl.wait_line("count 30", |l| l == "count 30");
    let pid = wl.pid();
    let fds_before = fd_list(pid);
    let img = h.image_dir("img");

    let out = h.checkpoint(&img, &["--kill", "--no-fsync"], pid);
    out.assert_success("cr_checkpoint --kill --no-fsync");
    wl.reap_killed();
    let at_ckpt = last_count(&wl.output());
    check_consecutive_counts(&wl.output()).unwrap_or_else(|e| panic!("before restore: {e}"));

    let mut r = h.restore_bg(&img, pid);
    let target = format!("count {}", at_ckpt + 30);
    r.wait_line(&wl, &target, |l| l == target);
    assert_eq!(
        fd_list(pid),
        fds_before,
        "restored fds differ from the original's"
    );
    wl.go();
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&res, &wl, "counter restore");
    let text = wl.output();
    let last = check_consecutive_counts(&text).unwrap_or_else(|e| panic!("{e}\n{}", wl.diag()));
    assert!(
        text.lines().any(|l| l == format!("final {last}")),
        "missing `final {last}`\n{}",
        wl.diag()
    );
    assert!(last >= at_ckpt + 30, "counter did not go on after restore");
}

/// Checkpoint while the process keeps running; let it finish; then restore the
/// same image: the copy is back at the checkpoint and reaches OK too, writing
/// its output at the saved offset of stdout.
#[test]
fn checkpoint_continue_then_restore_same_image() {
    let h = Harness::new("continue");
    let mut wl = h.spawn_wl("wl_memory", &["16"]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");

    // Its shared file mapping is written after the checkpoint: saved, so
    // the copy finds it as it was.
    h.checkpoint(&img, &["--save-files"], pid)
        .assert_success("cr_checkpoint (continue)");
    assert_running_untraced(pid, "after checkpoint without --kill/--stop");
    let saved_len = wl.stdout_len();
    assert_eq!(wl.output(), "READY\n");

    wl.go_and_expect_ok();
    assert_eq!(wl.output(), "READY\nOK\n", "original's output");
    wl.remove_go();
    // Mark what the original wrote after the checkpoint (same size), so we can
    // see the restored copy write its own OK at the saved offset.
    wl.scribble_stdout(saved_len, b"__\n");

    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(60));
    assert_eq!(wl.output(), "READY\n__\n", "restored copy must wait for go");
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restore of a checkpoint taken with continue");
    assert_eq!(
        wl.output(),
        "READY\nOK\n",
        "restored copy must write OK at the saved stdout offset"
    );
}

/// Four rounds: checkpoint --kill, restore --detach (the restored process is not
/// our child: cr_restart exits at once), checkpoint the restored pid again...
#[test]
fn repeated_cycles_with_detach() {
    let h = Harness::new("cycles");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let fds_before = fd_list(pid);

    let img1 = h.image_dir("img1");
    checkpoint_kill(&h, &mut wl, &img1);
    let mut current = h.restore_detach(&img1, pid);
    for round in 1..=4 {
        let at = last_count(&wl.output());
        let target = format!("count {}", at + 20);
        {
            let p = &mut current;
            wl.wait_line_while(
                &format!("round {round}: {target}"),
                LINE_TIMEOUT,
                |l| l == target,
                || !p.has_exited(),
                || describe(pid),
            );
        }
        assert_eq!(
            fd_list(pid),
            fds_before,
            "round {round}: fds of the restored process"
        );
        assert_running_untraced(pid, &format!("round {round}: restored process"));
        if round == 4 {
            break;
        }
        let img = h.image_dir(&format!("img{}", round + 1));
        h.checkpoint(&img, &["--kill"], pid)
            .assert_success(&format!(
                "round {}: cr_checkpoint --kill of a restored process",
                round + 1
            ));
        let st = current.wait_exit(Duration::from_secs(20), || wl.diag());
        if let Some(st) = st {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(
                st.signal(),
                Some(libc::SIGKILL),
                "round {round}: {}",
                status_str(Some(st))
            );
        }
        check_consecutive_counts(&wl.output()).unwrap_or_else(|e| panic!("round {round}: {e}"));
        current = h.restore_detach(&img, pid);
    }
    wl.go();
    let st = current.wait_exit(EXIT_TIMEOUT, || wl.diag());
    if let Some(st) = st {
        assert!(
            st.success(),
            "final process: {}\n{}",
            status_str(Some(st)),
            wl.diag()
        );
    }
    let text = wl.output();
    check_consecutive_counts(&text).unwrap_or_else(|e| panic!("{e}\n{}", wl.diag()));
    assert_eq!(text.lines().last(), Some("OK"), "{}", wl.diag());
}

/// --stop leaves the process stopped (State T) and not traced; SIGCONT resumes it.
#[test]
fn checkpoint_stop_then_sigcont() {
    let h = Harness::new("stop");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");

    h.checkpoint(&img, &["--stop"], pid)
        .assert_success("cr_checkpoint --stop");
    wait_until(
        "State T and TracerPid 0 after --stop",
        Duration::from_secs(2),
        || matches!(proc_status(pid), Some(s) if s.state == 'T' && s.tracer_pid == 0),
        || describe(pid),
    );
    let len = wl.stdout_len();
    std::thread::sleep(Duration::from_millis(300)); // observation window: nothing may be printed
    assert_eq!(wl.stdout_len(), len, "a stopped process printed something");
    let st = proc_status(pid).expect("process exists");
    assert!(st.state == 'T' && st.tracer_pid == 0, "{}", describe(pid));

    h.cr_image(&[OsStr::new("verify"), img.as_os_str()])
        .assert_success("cr_image verify after --stop");

    wl.proc.signal(libc::SIGCONT);
    let at = last_count(&wl.output());
    let target = format!("count {}", at + 20);
    wl.wait_line(&target, |l| l == target);
    assert_running_untraced(pid, "after SIGCONT");
    wl.go_and_expect_ok();
    check_consecutive_counts(&wl.output()).unwrap_or_else(|e| panic!("{e}\n{}", wl.diag()));
}

/// `cr_image show --json` describes the process (pid, exe, fds, vmas, threads);
/// `cr_image verify` accepts an intact image; text `show` works.
#[test]
fn image_show_json_and_verify() {
    let h = Harness::new("imageshow");
    let mut wl = h.spawn_wl("wl_append", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &[], pid).assert_success("cr_checkpoint");
    assert_running_untraced(pid, "after checkpoint");

    h.cr_image(&[OsStr::new("verify"), img.as_os_str()])
        .assert_success("cr_image verify");
    let text = h.cr_image(&[OsStr::new("show"), img.as_os_str()]);
    text.assert_success("cr_image show");
    assert!(
        text.stdout.contains(&pid.to_string()),
        "text show lacks the pid\n{}",
        text.show()
    );

    let js = h.cr_image(&[OsStr::new("show"), OsStr::new("--json"), img.as_os_str()]);
    js.assert_success("cr_image show --json");
    let v: serde_json::Value = serde_json::from_str(&js.stdout)
        .unwrap_or_else(|e| panic!("show --json is not JSON: {e}\n{}", js.show()));
    let procs = v["processes"]
        .as_array()
        .unwrap_or_else(|| panic!("no processes array: {v}"));
    let p = procs
        .iter()
        .find(|p| p["pid"].as_i64() == Some(pid as i64))
        .unwrap_or_else(|| panic!("no process with pid {pid}: {v}"));
    assert_eq!(
        p["exe"].as_str(),
        Some(wl.exe.to_string_lossy().as_ref()),
        "exe of the process"
    );
    assert!(
        p["vmas"].as_array().is_some_and(|a| a.len() > 5),
        "vmas: {}",
        p["vmas"]
    );
    assert_eq!(
        p["threads"].as_array().map(Vec::len),
        Some(1),
        "threads: {}",
        p["threads"]
    );
    let fds = p["fds"]
        .as_array()
        .unwrap_or_else(|| panic!("no fds array: {p}"));
    let fd = |n: i64| {
        fds.iter()
            .find(|f| f["fd"].as_i64() == Some(n))
            .unwrap_or_else(|| panic!("fd {n} missing from {}", p["fds"]))
    };
    assert_eq!(fd(0)["path"].as_str(), Some("/dev/null"), "fd 0");
    assert_eq!(
        fd(1)["path"].as_str(),
        Some(wl.stdout.to_string_lossy().as_ref()),
        "fd 1"
    );
    assert_eq!(
        fd(2)["path"].as_str(),
        Some(wl.stderr.to_string_lossy().as_ref()),
        "fd 2"
    );
    let live = fd_list(pid);
    let append_path = wl.workdir.join("files/append.dat");
    let (app_fd, _) = live
        .iter()
        .find(|(_, t)| *t == append_path.to_string_lossy())
        .expect("workload has append.dat open");
    let app = fd(*app_fd as i64);
    let flags = json_uint(&app["flags"]).unwrap_or_else(|| panic!("flags of fd {app_fd}: {app}"));
    assert_ne!(
        flags & libc::O_APPEND as u64,
        0,
        "O_APPEND missing in flags of {app}"
    );
    assert!(
        json_uint(&app["pos"]).is_some_and(|p| p > 0 && p.is_multiple_of(64)),
        "pos of {app}"
    );
    for (n, target) in &live {
        let f = fd(*n as i64);
        assert_eq!(f["path"].as_str(), Some(target.as_str()), "path of fd {n}");
    }
    wl.go_and_expect_ok();
}

/// A number in JSON, either as a number or as a string ("0o2102001", "0x41", "65").
fn json_uint(v: &serde_json::Value) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let s = v.as_str()?.trim();
    if let Some(o) = s.strip_prefix("0o") {
        u64::from_str_radix(o, 8).ok()
    } else if let Some(x) = s.strip_prefix("0x") {
        u64::from_str_radix(x, 16).ok()
    } else {
        s.parse().ok()
    }
}

/// Saved offset of `fd` of the (single) process in an image, from `show --json`.
fn saved_pos(h: &Harness, img: &std::path::Path, fd: i64) -> u64 {
    let js = h.cr_image(&[OsStr::new("show"), OsStr::new("--json"), img.as_os_str()]);
    js.assert_success("cr_image show --json");
    let v: serde_json::Value = serde_json::from_str(&js.stdout)
        .unwrap_or_else(|e| panic!("show --json is not JSON: {e}\n{}", js.show()));
    v["processes"][0]["fds"]
        .as_array()
        .and_then(|fds| fds.iter().find(|f| f["fd"].as_i64() == Some(fd)))
        .and_then(|f| json_uint(&f["pos"]))
        .unwrap_or_else(|| panic!("no pos of fd {fd} in {v}"))
}

/// A second checkpoint into a directory that already holds an image replaces
/// it: the restore goes on from the second checkpoint, not from the first.
#[test]
fn second_checkpoint_into_same_dir_replaces_image() {
    let h = Harness::new("samedir");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &[], pid)
        .assert_success("first checkpoint (continue)");
    let pos_a = saved_pos(&h, &img, 1);
    let at = last_count(&wl.output());
    let target = format!("count {}", at + 30);
    wl.wait_line(&target, |l| l == target);
    checkpoint_kill(&h, &mut wl, &img);
    let pos_b = saved_pos(&h, &img, 1);
    assert_eq!(
        pos_b,
        wl.stdout_len(),
        "saved stdout offset of the second image"
    );
    assert!(pos_a < pos_b, "offsets {pos_a} / {pos_b}");
    // Mark the lines printed between the two checkpoints ("count" -> "xount", same
    // length): a restore of the second image never writes there.
    let text = wl.output();
    let marked = text[pos_a as usize..pos_b as usize].replace("count ", "xount ");
    wl.scribble_stdout(pos_a, marked.as_bytes());
    let last_b = last_count(&text);

    let mut r = h.restore_bg(&img, pid);
    let target = format!("count {}", last_b + 10);
    r.wait_line(&wl, &target, |l| l == target);
    let now = wl.output();
    assert_eq!(
        &now[pos_a as usize..pos_b as usize],
        marked,
        "the restored process rewrote output from before the second checkpoint: \
         it was restored from the first image"
    );
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restore of the replaced image");
    let fixed = wl.output().replace("xount ", "count ");
    check_consecutive_counts(&fixed).unwrap_or_else(|e| panic!("{e}\n{}", wl.diag()));
}

/// `cr_restart DIR` exits with the restored process's exit status.
#[test]
fn restart_passes_on_exit_code() {
    let h = Harness::new("exitcode");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    let at = last_count(&wl.output());
    let target = format!("count {}", at + 5);
    r.wait_line(&wl, &target, |l| l == target);
    std::fs::write(wl.go_path(), "exit 42\n").expect("write go");
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_eq!(
        out.status.code(),
        Some(42),
        "cr_restart should exit with the restored process's status 42\n{}\n{}",
        out.show(),
        wl.diag()
    );
    assert_eq!(wl.lines().last().map(String::as_str), Some("OK"));
}

/// `cr_restart DIR` exits with 128+N when the restored process dies of signal N.
#[test]
fn restart_reports_signal_as_128_plus_signo() {
    let h = Harness::new("exitsignal");
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let mut r = h.restore_bg(&img, pid);
    let at = last_count(&wl.output());
    let target = format!("count {}", at + 5);
    r.wait_line(&wl, &target, |l| l == target);
    assert_running_untraced(pid, "restored process");
    r.restored.signal(libc::SIGTERM);
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGTERM),
        "cr_restart should exit 128+SIGTERM\n{}",
        out.show()
    );
}

/// One image restored twice in a row (the pid is free again in between): both
/// copies start from the checkpoint and reach OK.
#[test]
fn image_restored_twice() {
    let h = Harness::new("twice");
    let mut wl = h.spawn_wl("wl_memory", &["8"]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    // The first copy writes its shared file mapping: saved, so the second
    // finds it as it was.
    h.checkpoint(&img, &["--kill", "--save-files"], pid)
        .assert_success("cr_checkpoint --kill --save-files");
    wl.reap_killed();
    let saved = wl.stdout_len();
    for round in 1..=2 {
        let mut r = h.restore_bg(&img, pid);
        r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(60));
        let before = if round == 1 { "READY\n" } else { "READY\n__\n" };
        assert_eq!(wl.output(), before, "round {round}: printed before go");
        wl.go();
        let out = r.wait(EXIT_TIMEOUT, &wl);
        assert_restored_ok(&out, &wl, &format!("restore number {round}"));
        assert_eq!(wl.output(), "READY\nOK\n", "round {round}");
        wl.remove_go();
        wl.scribble_stdout(saved, b"__\n");
    }
}

/// A counter that never pauses, checkpointed with --kill while printing.
#[test]
fn busy_counter_kill_restore_is_consecutive() {
    let h = Harness::new("busycounter");
    let mut wl = h.spawn_wl("wl_counter", &["0"]);
    wl.wait_ready();
    wl.wait_line("count 2000", |l| l == "count 2000");
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let at = check_consecutive_counts(&wl.output()).unwrap_or_else(|e| panic!("{e}"));
    let mut r = h.restore_bg(&img, pid);
    let target = format!("count {}", at + 2000);
    r.wait_line(&wl, &target, |l| l == target);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "busy counter restore");
    check_consecutive_counts(&wl.output()).unwrap_or_else(|e| panic!("{e}\n{}", wl.diag()));
}

/// Ten checkpoints (continue) of a busy counter in a row: it must not notice.
#[test]
fn ten_checkpoints_in_place_of_a_busy_process() {
    let h = Harness::new("tenckpt");
    let mut wl = h.spawn_wl("wl_counter", &["0"]);
    wl.wait_ready();
    let pid = wl.pid();
    for i in 0..10 {
        let img = h.image_dir(&format!("img{i}"));
        h.checkpoint(&img, &[], pid)
            .assert_success(&format!("checkpoint {i}"));
        assert_running_untraced(pid, &format!("after checkpoint {i}"));
    }
    let at = last_count(&wl.output());
    let target = format!("count {}", at + 1000);
    wl.wait_line(&target, |l| l == target);
    wl.go_and_expect_ok();
    check_consecutive_counts(&wl.output()).unwrap_or_else(|e| panic!("{e}\n{}", wl.diag()));
}

/// Right after `cr_checkpoint --kill` the original may still hold its pid
/// (a zombie its parent has not reaped yet, or a big process still
/// freeing its memory): cr_restart waits for the pid instead of failing.
#[test]
fn restore_waits_for_the_killed_original_to_be_reaped() {
    let h = Harness::new("reaped-late");
    let mut wl = h.spawn_wl("wl_memory", &["64"]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], pid)
        .assert_success("cr_checkpoint --kill");
    // Its exit is over when the checkpoint returns; we, its parent, have
    // not reaped it: the pid is still taken.
    assert!(
        proc_status(pid).is_some_and(|s| s.state == 'Z'),
        "the killed original should be a zombie until reaped: {}",
        describe(pid)
    );
    let mut r = h.restore_bg(&img, pid);
    let cr = r.cr.pid;
    wait_until(
        "cr_restart waiting for the pid",
        Duration::from_secs(20),
        || {
            blocked_syscall(cr).is_some_and(|n| POLL_SLEEP_SYSCALLS.contains(&n))
                && proc_status(pid).is_some_and(|s| s.state == 'Z')
        },
        || {
            format!(
                "cr_restart: {}
original: {}",
                describe(cr),
                describe(pid)
            )
        },
    );
    wl.reap_killed();
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restore started while the original was a zombie");
}
