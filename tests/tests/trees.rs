//! Threads, signals and process trees: multi-threaded programs (Rust and
//! python3), pending signals with payloads and interval timers, a fork tree
//! with shared memory, sessions, groups and a zombie, a tree sharing private
//! memory copy-on-write (anonymous, and a private mapping of a file), and a bash loop with its child process — each
//! checkpointed, killed and restored, and checked by the program itself
//! (the copy-on-write tree also checkpointed while it runs on).

use cr_tests::*;
use std::time::{Duration, Instant};

/// After `cr_checkpoint --kill` of a tree: the descendants were reparented
/// to us (the tests run as a child subreaper); reap them so every PID is
/// free again before the restore.
fn reap_descendants(pids: &[i32]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    for &p in pids {
        loop {
            let mut st = 0;
            // SAFETY: waitpid with a valid out pointer; WNOHANG never blocks.
            let r = unsafe { libc::waitpid(p, &mut st, libc::WNOHANG | libc::__WALL) };
            if r == p || !std::path::Path::new(&format!("/proc/{p}")).exists() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "process {p} did not go away after the kill"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// `wl` with `args`, a tree of `n` processes (`what`), checkpointed with
/// `--kill`, its descendants reaped: the workload, its PIDs (root first)
/// and the image.
fn killed_tree(
    h: &Harness,
    wl: &str,
    args: &[&str],
    n: usize,
    what: &str,
) -> (Workload, Vec<i32>, std::path::PathBuf) {
    let mut wl = h.spawn_wl(wl, args);
    wl.wait_ready();
    let pids = tree_pids(wl.pid());
    assert_eq!(pids.len(), n, "{what}: {pids:?}\n{}", wl.diag());
    let img = h.image_dir("img");
    checkpoint_kill(h, &mut wl, &img);
    reap_descendants(&pids[1..]);
    (wl, pids, img)
}

/// Wait until the restored tree of `pid` has `n` processes.
fn wait_tree(pid: i32, n: usize, within: Duration, wl: &Workload) {
    wait_until(
        "the restored tree",
        within,
        || tree_pids(pid).len() == n,
        || wl.diag(),
    );
}

fn last_total(out: &str) -> u64 {
    out.lines()
        .filter_map(|l| l.strip_prefix("total "))
        .filter_map(|v| v.parse().ok())
        .next_back()
        .unwrap_or(0)
}

/// Checkpoint --kill a workload tree, restore it, wait until it prints a
/// larger `total` (it runs again), let it finish, and expect OK.
fn kill_restore_with_progress(h: &Harness, wl: &mut Workload, ctx: &str) {
    wl.wait_line("a total line", |l| l.starts_with("total "));
    let pid = wl.pid();
    let pids = tree_pids(pid);
    let img = h.image_dir("img");
    checkpoint_kill(h, wl, &img);
    reap_descendants(&pids[1..]);
    let at = last_total(&wl.output());
    let mut r = h.restore_bg(&img, pid);
    r.wait_line(wl, "progress after restore", |l| {
        l.strip_prefix("total ")
            .and_then(|v| v.parse::<u64>().ok())
            .is_some_and(|v| v > at)
    });
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, wl);
    assert_restored_ok(&out, wl, ctx);
}

#[test]
fn sixteen_threads_with_shared_state_under_a_mutex() {
    let h = Harness::new("threads16");
    let mut wl = h.spawn_wl("wl_threads", &["16"]);
    wl.wait_ready();
    let tasks = std::fs::read_dir(format!("/proc/{}/task", wl.pid()))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(tasks, 18, "16 workers + a waiter + main\n{}", wl.diag());
    kill_restore_with_progress(&h, &mut wl, "16-thread restore");
}

#[test]
fn threads_survive_checkpoint_with_continue() {
    let h = Harness::new("threads-cont");
    let mut wl = h.spawn_wl("wl_threads", &["8"]);
    wl.wait_ready();
    wl.wait_line("a total line", |l| l.starts_with("total "));
    let img = h.image_dir("img");
    h.checkpoint(&img, &[], wl.pid())
        .assert_success("cr_checkpoint (continue)");
    assert_running_untraced(wl.pid(), "threads after checkpoint");
    for t in std::fs::read_dir(format!("/proc/{}/task", wl.pid()))
        .expect("task dir")
        .flatten()
    {
        let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
        assert!(
            status.contains("TracerPid:\t0"),
            "thread {:?} still traced",
            t.file_name()
        );
    }
    wl.go_and_expect_ok();
}

#[test]
fn python3_with_threads() {
    let h = Harness::new("py-threads");
    let mut wl = h.spawn_python("py_threads.py", &[]);
    wl.wait_ready();
    kill_restore_with_progress(&h, &mut wl, "python3 threads restore");
}

#[test]
fn pending_signals_altstack_and_itimer() {
    let h = Harness::new("signals");
    // ITIMER_REAL armed for 3 s; the image waits longer than that before the
    // restore, so a timer that kept running (or fired) would be caught.
    let mut wl = h.spawn_wl("wl_signals", &["3000"]);
    wl.wait_ready();
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    let shown = h.cr_image(&["show".as_ref(), "--json".as_ref(), img.as_os_str()]);
    shown.assert_success("cr_image show --json");
    assert!(shown.stdout.contains("\"itimers\""), "{}", shown.show());
    let t0 = Instant::now();
    wait_until(
        "the image to age past the timer",
        Duration::from_secs(5),
        || t0.elapsed() > Duration::from_millis(3500),
        String::new,
    );
    let mut r = h.restore_bg(&img, pid);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "signals restore");
}

#[test]
fn fork_tree_with_shared_memory_sessions_groups_and_a_zombie() {
    let h = Harness::new("tree");
    let mut wl = h.spawn_wl("wl_tree", &[]);
    wl.wait_ready();
    let pid = wl.pid();
    let pids = tree_pids(pid);
    assert_eq!(
        pids.len(),
        4,
        "root, zombie, child, grandchild: {pids:?}\n{}",
        wl.diag()
    );
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    reap_descendants(&pids[1..]);
    let mut r = h.restore_bg(&img, pid);
    wait_tree(pid, 4, Duration::from_secs(30), &wl);
    assert_eq!(tree_pids(pid), pids, "restored tree has other PIDs");
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "tree restore");
}

#[test]
fn bash_loop_with_a_child_keeps_complete_ordered_output() {
    let h = Harness::new("bash-loop");
    let script = "for i in $(seq 1 80); do echo line $i; sleep 0.05; done; echo DONE";
    let bash = std::path::Path::new("/bin/bash");
    let mut wl = h.spawn_program("bash", bash, &["-c".as_ref(), script.as_ref()], &[]);
    wl.wait_line("line 20", |l| l == "line 20");
    let pid = wl.pid();
    // Catch it while it waits for its `sleep` child.
    wait_until(
        "bash with a child",
        Duration::from_secs(10),
        || tree_pids(pid).len() > 1,
        || wl.diag(),
    );
    let pids = tree_pids(pid);
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    reap_descendants(&pids[1..]);
    let out = h.restore_sync(&img, pid);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", out.show(), wl.diag());
    let lines = wl.lines();
    let numbers: Vec<u32> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("line ")?.parse().ok())
        .collect();
    assert_eq!(
        numbers,
        (1..=80).collect::<Vec<_>>(),
        "output lost, doubled or reordered\n{}",
        wl.diag()
    );
    assert_eq!(
        lines.last().map(String::as_str),
        Some("DONE"),
        "{}",
        wl.diag()
    );
}

/// A figure `name VALUE` the workload printed (the last one).
fn figure(out: &str, name: &str) -> u64 {
    out.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            while let Some(k) = w.next() {
                if k == name {
                    return w.next()?.parse().ok();
                }
            }
            None
        })
        .next_back()
        .unwrap_or_else(|| panic!("the workload printed no {name}:\n{out}"))
}

/// 64 MiB of private memory written by a parent, then forked to four
/// children (one with a grandchild), each of which rewrote its own pages:
/// after checkpoint --kill and restore, the unchanged pages are the very
/// pages of the parent again (pagemap PFNs, checked by the processes), the
/// changed ones are not, writes stay private, and the tree's Pss is what
/// it was, not six times the memory.
#[test]
fn memory_shared_copy_on_write_stays_shared_after_restore() {
    restore_cow_tree("cow", &["64", "4"]);
}

/// The same tree with 640 MiB (163,840 pages), more than the page store's
/// dedup cache remembers (2^17 pages): the children's unchanged pages are
/// found as their parent's by address, not by that cache, so they are
/// stored once and shared again after the restore (pagemap PFNs, checked
/// by the processes; the tree's Pss).
#[test]
fn memory_shared_copy_on_write_beyond_the_dedup_cache_stays_shared() {
    restore_cow_tree("cowbig", &["640", "4"]);
}

/// The same tree over a private mapping of a file (16 MiB): the pages the
/// parent wrote before the fork are shared with its children again after
/// checkpoint --kill and restore (pagemap PFNs), those a child wrote are
/// its own, and those nobody wrote are still the file's pages (pagemap
/// "file page" bit, content) — all checked by the processes — and the
/// tree's Pss is what it was.
#[test]
fn private_file_memory_shared_copy_on_write_stays_shared_after_restore() {
    restore_cow_tree("cowfile", &["16", "4", "file"]);
}

/// `wl_cow` with `args` (a tree of six processes) checkpointed with
/// `--kill` and restored: the processes check themselves, and the tree's
/// Pss must be what it was (unshared, it would be six times the memory).
fn restore_cow_tree(name: &str, args: &[&str]) {
    let h = Harness::new(name);
    let (wl, pids, img) = killed_tree(&h, "wl_cow", args, 6, "root, 4 children, a grandchild");
    let t0 = Instant::now();
    let mut r = h.restore_bg(&img, pids[0]);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, &format!("copy-on-write tree restore ({args:?})"));
    let text = wl.output();
    let (before, after) = (
        figure(&text, "pss_before_kb"),
        figure(&text, "pss_after_kb"),
    );
    eprintln!(
        "tree Pss {before} kB before, {after} kB after the restore (Rss {} kB, {} kB); restore and run {:?}",
        figure(&text, "rss_before_kb"),
        figure(&text, "rss_after_kb"),
        t0.elapsed()
    );
    assert!(
        after <= before + before / 5,
        "the restored tree uses {after} kB (Pss), it used {before} kB\n{}",
        wl.diag()
    );
}

/// The same tree checkpointed three times while it runs on (a full dump,
/// one that starts dirty tracking, one incremental from it): reading its
/// pages must not end their sharing (process_vm_readv's read pin would
/// copy every shared page), so after the checkpoints the unchanged pages
/// are still the parent's (pagemap PFNs, checked by the processes), the
/// content is intact, and the tree's Pss is what it was.
#[test]
fn memory_shared_copy_on_write_stays_shared_after_checkpoints_that_continue() {
    let h = Harness::new("cowcont");
    let mut wl = h.spawn_wl("wl_cow", &["64", "4"]);
    wl.wait_ready();
    let pid = wl.pid();
    assert_eq!(tree_pids(pid).len(), 6, "{}", wl.diag());
    let (a, b, c) = (h.image_dir("a"), h.image_dir("b"), h.image_dir("c"));
    let t0 = Instant::now();
    for (img, opts) in [
        (&a, vec![]),
        (
            &b,
            vec!["--track-mem", "--parent", a.to_str().expect("utf-8")],
        ),
        (&c, vec!["--parent", b.to_str().expect("utf-8")]),
    ] {
        h.checkpoint(img, &opts, pid)
            .assert_success(&format!("cr_checkpoint {opts:?} (continue)"));
    }
    let took = t0.elapsed();
    wl.go_and_expect_ok();
    let text = wl.output();
    let (before, after) = (
        figure(&text, "pss_before_kb"),
        figure(&text, "pss_after_kb"),
    );
    eprintln!(
        "tree Pss {before} kB before, {after} kB after three checkpoints that continue (Rss {} kB, {} kB); checkpoints {took:?}",
        figure(&text, "rss_before_kb"),
        figure(&text, "rss_after_kb"),
    );
    // Unshared, the tree would hold 6 x 64 MiB.
    assert!(
        after <= before + before / 5,
        "after the checkpoints the tree uses {after} kB (Pss), it used {before} kB\n{}",
        wl.diag()
    );
}

/// A figure `name=VALUE` of every line of `log` holding `what`.
fn log_figures(log: &str, what: &str, name: &str) -> Vec<u64> {
    let key = format!("{name}=");
    log.lines()
        .filter(|l| l.contains(what))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix(key.as_str()))
                .and_then(|v| v.parse().ok())
        })
        .collect()
}

/// Six processes whose children each map 4 MiB of private memory after
/// the fork at the very address and size of the 4 MiB the root maps after
/// the fork (and all share 1 MiB copy-on-write): same bounds and flags,
/// none of the pages. The restore keeps only the copy-on-write memory as
/// inherited (its log: no process writes a whole 4 MiB over an inherited
/// copy while the stubs are forked) and maps the rest afresh; every
/// process checks its private and copy-on-write memory and its pipe.
#[test]
fn children_mapping_memory_after_the_fork_at_the_parents_address_get_their_own() {
    let h = Harness::new("samemap");
    let (wl, pids, img) = killed_tree(&h, "wl_bigtree", &["6", "4"], 6, "root and 5 children");
    let pid = pids[0];
    let mut r = h.restore_bg_env(&img, pid, &[("CR_LOG", "info")]);
    wait_tree(pid, 6, Duration::from_secs(60), &wl);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(
        &out,
        &wl,
        "restore of a tree mapping at its parent's address",
    );
    let what = "memory shared copy-on-write in place";
    let shared = log_figures(&out.stderr, what, "shared_pages");
    let written = log_figures(&out.stderr, what, "written_pages");
    // The root fills the 1 MiB (256 pages) its children keep; a child
    // keeps it whole. 4 MiB are 1024 pages.
    assert_eq!(written.len(), 6, "one line per process:\n{}", out.stderr);
    assert!(
        written.iter().all(|&w| w < 1024),
        "pages written over an inherited copy: {written:?}\n{}",
        out.stderr
    );
    assert!(
        shared.iter().filter(|&&s| s >= 256).count() == 5,
        "the copy-on-write memory is not kept by every child: {shared:?}\n{}",
        out.stderr
    );
}

/// Sixteen processes (a root and fifteen children), each with 4 MiB of
/// private memory of its own, all sharing anonymous shared memory and
/// 1 MiB copy-on-write, with a pipe from the root to each child holding an
/// unread message and a pipe back: checkpointed, killed, restored with
/// `--verify` (the processes' pages are written by the worker pool while
/// the next ones are rebuilt); every process checks its memory and its
/// pipe, the root collects the answers and prints OK. Before that, a
/// restore failing halfway through the tree leaves no process behind.
#[test]
fn sixteen_process_tree_with_private_shared_memory_and_pipes() {
    let h = Harness::new("bigtree");
    let (wl, pids, img) = killed_tree(&h, "wl_bigtree", &["16", "4"], 16, "root and 15 children");
    let pid = pids[0];
    // A restore failing while pages are still being written into some
    // processes and others are not rebuilt yet leaves nothing behind.
    let mut r = h.restore_bg_env(&img, pid, &[("CR_FAULT_INJECT", "restore-mid-tree")]);
    let out = r.wait_plain(TOOL_TIMEOUT);
    out.assert_error(
        "injected restore failure",
        "cr_restart: error: ",
        &["restore-mid-tree"],
    );
    wait_until(
        "the failed restore's processes to be gone",
        Duration::from_secs(10),
        || {
            reap_orphans();
            pids.iter().all(|p| !is_alive(*p))
        },
        || wl.diag(),
    );
    let mut r = h.restore_bg(&img, pid);
    wait_tree(pid, 16, Duration::from_secs(60), &wl);
    assert_eq!(tree_pids(pid), pids, "restored tree has other PIDs");
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "16-process tree restore");
}
