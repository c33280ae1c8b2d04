//! cr_run and PID namespaces: a job runs as PID 1 of its own namespace, is
//! checkpointed through the PID of cr_run (into the job's `--dir`), and is
//! restored into a fresh namespace with every PID as it was — twice from
//! one image, both copies side by side.

use cr_tests::*;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

fn status_field(pid: i32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

fn children(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|s| s.parse().ok())
        .collect()
}

#[test]
fn cr_run_job_is_pid_1_and_its_status_is_returned() {
    let h = Harness::new("cr-run-status");
    let out = h.dir.join("out");
    let st = Command::new(tool_path("cr_run"))
        .args(["--", "/bin/sh", "-c", "echo pid $$; exit 7"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("out"))
        .status()
        .expect("run cr_run");
    assert_eq!(st.code(), Some(7));
    assert_eq!(read_text(&out).trim(), "pid 1");
}

#[test]
fn job_tree_restored_twice_side_by_side_in_new_pid_namespaces() {
    let h = Harness::new("pidns-twice");
    let img = h.image_dir("img");
    let wl_tree = workload_path("wl_tree");
    let mut wl = h.spawn_job("cr_run", &img, &[wl_tree.as_os_str()], &[]);
    wl.wait_ready();
    let job = children(wl.pid());
    assert_eq!(job.len(), 1, "cr_run runs one job\n{}", wl.diag());
    assert!(
        status_field(job[0], "NSpid:").ends_with("\t1")
            || status_field(job[0], "NSpid:").ends_with(" 1"),
        "the job is PID 1 of its namespace: {}",
        status_field(job[0], "NSpid:")
    );

    // Through cr_run's PID, into the job's --dir.
    checkpoint_kill_job(
        &h,
        &mut wl,
        TOOL_TIMEOUT,
        "cr_checkpoint --kill <cr_run pid>",
    );
    assert!(
        Path::new(&img).join("checkpoint.img").exists(),
        "image not in the job's --dir"
    );
    wl.remove_go();

    let a = h.restore_job(&img);
    let b = h.restore_job(&img);
    // Both copies run at once, each as PID 1 of its own namespace, with the
    // child and grandchild at their saved PIDs inside.
    for r in [&a, &b] {
        wait_until(
            "a restored job",
            Duration::from_secs(30),
            || r.root().is_some(),
            || format!("{}\n{}", r.diag(), wl.diag()),
        );
        let root = r.root().expect("the restored root");
        let ns = status_field(root, "NSpid:");
        assert!(
            ns.split_whitespace().last() == Some("1"),
            "restored root is not PID 1 inside: {ns}"
        );
    }
    wl.go();
    for mut r in [a, b] {
        let st = r.wait(EXIT_TIMEOUT, &|| wl.diag());
        assert_eq!(
            st.code(),
            Some(0),
            "a restored copy failed its own checks\n{}",
            wl.diag()
        );
    }
}

/// `cr_checkpoint --kill` of a cr_run job whose PID 1 has three threads or
/// more returns, and the whole job is gone (cr_run reports the SIGKILL). It
/// used to hang: the last thread of the namespace's init to exit waits in
/// the kernel (zap_pid_ns_processes) until every other PID of the
/// namespace is freed, its sibling threads included, which are traced
/// zombies only the checkpointer can reap, while the checkpointer waited
/// for that very thread. Which thread exits last is a race: several rounds.
#[test]
fn kill_of_a_multithreaded_job_returns() {
    let wl_threads = workload_path("wl_threads");
    // wl_threads N runs N workers, a waiter and the main thread.
    for (round, workers) in ["1", "1", "2", "4", "8", "16"].into_iter().enumerate() {
        let h = Harness::new(&format!("pidns-kill-threads-{round}"));
        let img = h.image_dir("img");
        let mut wl = h.spawn_job("cr_run", &img, &[wl_threads.as_os_str()], &[workers]);
        wl.wait_ready();
        let job = children(wl.pid());
        assert_eq!(job.len(), 1, "cr_run runs one job\n{}", wl.diag());
        let threads = std::fs::read_dir(format!("/proc/{}/task", job[0]))
            .map(|d| d.count())
            .unwrap_or(0);
        assert_eq!(
            threads,
            workers.parse::<usize>().expect("workers") + 2,
            "threads of the job\n{}",
            wl.diag()
        );
        checkpoint_kill_job(
            &h,
            &mut wl,
            Duration::from_secs(30),
            &format!("cr_checkpoint --kill of a job with {threads} threads (round {round})"),
        );
        assert!(
            !Path::new(&format!("/proc/{}", job[0])).exists(),
            "the job ({}) is gone once cr_run has exited",
            job[0]
        );
        assert!(
            img.join("checkpoint.img").exists(),
            "no image in {}",
            img.display()
        );
    }
}

/// A user who may not create a PID namespace is told how to go on.
#[test]
fn cr_run_as_non_root_names_no_pidns() {
    let h = Harness::new("cr-run-nobody");
    let run = RunOpts {
        as_user: Some((65534, 65534)),
        ..Default::default()
    };
    let out = h.run_tool("cr_run", &["/bin/true"].map(std::ffi::OsStr::new), &run);
    out.assert_error(
        "cr_run as nobody",
        "cr_run: error: ",
        &["cannot create a PID namespace", "--no-pidns"],
    );
    let out = h.run_tool(
        "cr_run",
        &["--no-pidns", "/bin/true"].map(std::ffi::OsStr::new),
        &run,
    );
    out.assert_success("cr_run --no-pidns as nobody");
}

/// A sandbox in a network namespace of its own with loopback alone
/// (as `unshare -n` makes), holding TCP and UDP sockets on 127.0.0.1: cr_restart
/// makes a new namespace like it, where the sockets come back and work.
#[test]
fn a_network_namespace_of_its_own_is_made_again() {
    let h = Harness::new("netns-own");
    let mut wl = h.spawn_python("py_netns.py", &[]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &["--kill"], pid)
        .assert_success("checkpoint of a process in a network namespace of its own");
    wl.reap_killed();
    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(60));
    wl.go();
    let res = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(
        &res,
        &wl,
        "restore of a process in a network namespace of its own",
    );
}
