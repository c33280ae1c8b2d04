//! A python3 interpreter with state in memory (dicts, lists, a generator, a
//! Random, a running hash, a 16 MiB bytearray) survives checkpoint --kill and
//! restore, and its recomputation after restore matches.

use cr_tests::*;

fn last_step(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.strip_prefix("step "))
        .filter_map(|v| v.parse().ok())
        .max()
        .unwrap_or(0)
}

#[test]
fn python_state_kill_restore() {
    let h = Harness::new("python");
    let mut wl = h.spawn_python("py_state.py", &[]);
    wl.wait_ready();
    wl.wait_line("step 40", |l| l == "step 40");
    let pid = wl.pid();
    let fds_before = fd_list(pid);
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let at = last_step(&wl.output());

    let mut r = h.restore_bg(&img, pid);
    let target = format!("step {}", at + 20);
    r.wait_line(&wl, &target, |l| l == target);
    assert_eq!(
        fd_list(pid),
        fds_before,
        "restored fds differ from the original's"
    );
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "python restore");

    // Steps are printed 1, 2, 3, ... with READY after 20, across the restore.
    let mut expect = 1;
    for l in wl.lines() {
        if let Some(v) = l.strip_prefix("step ") {
            assert_eq!(
                v.parse::<u64>().ok(),
                Some(expect),
                "step sequence\n{}",
                wl.diag()
            );
            expect += 1;
        }
    }
    assert!(
        expect > at + 20,
        "python did not go on after restore\n{}",
        wl.diag()
    );
}
