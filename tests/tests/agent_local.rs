//! The agent's Unix socket and who may do what through it
//! (docs/CLUSTER.md, Security): one standalone agent (no coordinator) in a
//! network namespace of its own, its socket in the harness directory
//! (traversable by everyone), and `cr_checkpoint` / `cr_restart` run with
//! `CR_AGENT_SOCKET` set, as root or as uid 65534.
//!
//! * uid 65534 cannot checkpoint a process of root: one error line saying
//!   permission denied and naming the uid; the process runs on, untraced,
//!   and verifies itself;
//! * uid 65534 checkpoints its own process (the image directory is its
//!   own) and restores it through the agent (`cr_restart --detach` prints
//!   the PID); the restored process verifies itself;
//! * uid 65534 cannot restore an image of root: one error line, nothing
//!   restored.
//!
//! The workload is wl_counter (`count N` lines, checks its running
//! checksum, pid, cwd and umask at `go`).

use cr_tests::cluster::{spawn_wl_as, AgentOpts, Cluster};
use cr_tests::{
    assert_no_restored, assert_running_untraced, check_consecutive_counts, last_count, wait_until,
    Harness, Proc, RunOpts, ToolOutput, Workload,
};
use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

const NOBODY: u32 = 65534;
const CK_ERR: &str = "cr_checkpoint: error: ";
const RS_ERR: &str = "cr_restart: error: ";

/// One node (n1) with a standalone agent.
fn standalone(h: &Harness) -> Cluster<'_> {
    let c = Cluster::new(h, 1);
    c.start_agent_with(
        1,
        &AgentOpts {
            standalone: true,
            ..Default::default()
        },
    );
    c
}

/// How to run a tool through the agent, as root or as nobody.
fn via_agent(c: &Cluster, as_nobody: bool) -> RunOpts {
    RunOpts {
        env: vec![(
            "CR_AGENT_SOCKET".into(),
            c.socket(1).to_string_lossy().into_owned(),
        )],
        as_user: as_nobody.then_some((NOBODY, NOBODY)),
        ..Default::default()
    }
}

/// A directory owned by nobody, for its images.
fn nobody_dir(h: &Harness) -> PathBuf {
    let d = h.dir.join("nobody");
    std::fs::create_dir_all(&d).expect("mkdir");
    std::os::unix::fs::chown(&d, Some(NOBODY), Some(NOBODY)).expect("chown");
    d
}

/// `cr_checkpoint --dir IMG OPTS... PID` through the agent.
fn checkpoint(
    h: &Harness,
    c: &Cluster,
    nobody: bool,
    img: &Path,
    opts: &[&str],
    pid: i32,
) -> ToolOutput {
    h.checkpoint_with(img, opts, pid, &via_agent(c, nobody))
}

/// `cr_restart --detach IMG` through the agent.
fn restart_detach(h: &Harness, c: &Cluster, nobody: bool, img: &Path) -> ToolOutput {
    h.run_tool(
        "cr_restart",
        &[OsStr::new("--detach"), img.as_os_str()],
        &via_agent(c, nobody),
    )
}

/// Waits for `more` new count lines, then go, then the OK line written by
/// the (restored) process, and checks the count lines have no gap.
fn expect_ok_after_go(wl: &Workload, c: &Cluster, more: u64) {
    let base = last_count(&wl.output());
    wait_until(
        &format!("{} to count {more} more", wl.label),
        Duration::from_secs(20),
        || last_count(&wl.output()) >= base + more,
        || format!("{}\n{}", wl.diag(), c.diag()),
    );
    wl.go();
    wait_until(
        &format!("{} to print OK or FAIL", wl.label),
        Duration::from_secs(30),
        || {
            wl.output()
                .lines()
                .any(|l| l == "OK" || l.starts_with("FAIL"))
        },
        || format!("{}\n{}", wl.diag(), c.diag()),
    );
    let out = wl.output();
    assert!(
        out.lines().any(|l| l == "OK"),
        "{} should verify itself OK\n{}",
        wl.label,
        wl.diag()
    );
    if let Err(e) = check_consecutive_counts(&out) {
        panic!("{}: count lines: {e}\n{}", wl.label, wl.diag());
    }
}

/// uid 65534 cannot checkpoint a process of root through the agent.
#[test]
fn nobody_cannot_checkpoint_root_process() {
    let h = Harness::new("agent-local-deny");
    let c = standalone(&h);
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let img = nobody_dir(&h).join("img");
    let pid = wl.pid();
    let out = checkpoint(&h, &c, true, &img, &[], pid);
    let line = out.assert_error(
        "checkpoint of a root process by uid 65534 through the agent",
        CK_ERR,
        &["permission denied", &NOBODY.to_string()],
    );
    eprintln!("refused: {line}");
    assert_running_untraced(pid, "after the refused checkpoint");
    wl.go_and_expect_ok();
}

/// uid 65534 checkpoints (--kill) and restores its own process through the
/// agent; the image is its own; the restored process verifies itself.
#[test]
fn nobody_checkpoints_and_restores_own_process() {
    let h = Harness::new("agent-local-own");
    let c = standalone(&h);
    let mut wl = spawn_wl_as(&h, "wl_counter", &["5"], NOBODY, NOBODY);
    wl.wait_ready();
    let img = nobody_dir(&h).join("img");
    let pid = wl.pid();
    let out = checkpoint(&h, &c, true, &img, &["--kill"], pid);
    if !out.status.success() {
        panic!(
            "checkpoint by uid 65534 of its own process failed\n{}\n{}",
            out.show(),
            c.diag()
        );
    }
    wl.reap_killed();
    let owner = std::fs::metadata(&img)
        .unwrap_or_else(|e| panic!("stat {}: {e}\n{}", img.display(), c.diag()))
        .uid();
    assert_eq!(
        owner,
        NOBODY,
        "the image directory {} should belong to uid {NOBODY}",
        img.display()
    );

    let out = restart_detach(&h, &c, true, &img);
    if !out.status.success() {
        panic!(
            "cr_restart --detach by uid 65534 failed\n{}\n{}",
            out.show(),
            c.diag()
        );
    }
    let printed: Vec<&str> = out
        .stdout
        .lines()
        .filter(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(
        printed,
        vec![pid.to_string().as_str()],
        "cr_restart --detach must print the pid alone on one line\n{}",
        out.show()
    );
    let _restored = Proc::adopt(pid, "restored wl_counter (uid 65534)", None);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    assert!(
        status
            .lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("65534")),
        "the restored process should run as uid 65534:\n{status}"
    );
    // A process is dumpable unless it changed credentials: its /proc files
    // then belong to root and it can no longer read its own environ or auxv.
    let environ_owner = std::fs::metadata(format!("/proc/{pid}/environ")).map(|m| m.uid());
    assert_eq!(
        environ_owner.as_ref().ok(),
        Some(&NOBODY),
        "the restored process should be dumpable like the original (its /proc/{pid}/environ \
         owned by uid {NOBODY}, not root: PR_SET_DUMPABLE not restored after the change of \
         credentials?)\n{}\n{}",
        wl.diag(),
        c.diag()
    );
    expect_ok_after_go(&wl, &c, 20);
}

/// uid 65534 cannot restore an image of root through the agent (which root
/// then restores).
#[test]
fn nobody_cannot_restore_root_image() {
    let h = Harness::new("agent-local-root-img");
    let c = standalone(&h);
    let mut wl = h.spawn_wl("wl_counter", &["5"]);
    wl.wait_ready();
    let img = h.dir.join("root-img");
    let pid = wl.pid();
    let out = checkpoint(&h, &c, false, &img, &["--kill"], pid);
    if !out.status.success() {
        panic!(
            "checkpoint by root through the agent failed\n{}\n{}",
            out.show(),
            c.diag()
        );
    }
    wl.reap_killed();
    let out = restart_detach(&h, &c, true, &img);
    out.assert_error(
        "restore of root's image by uid 65534 through the agent",
        RS_ERR,
        &["permission denied"],
    );
    assert_no_restored(pid, &wl.exe, "after the refused restore");
    // The image is still good for root.
    let out = restart_detach(&h, &c, false, &img);
    if !out.status.success() {
        panic!(
            "cr_restart --detach by root failed\n{}\n{}",
            out.show(),
            c.diag()
        );
    }
    let _restored = Proc::adopt(pid, "restored wl_counter", None);
    expect_ok_after_go(&wl, &c, 20);
}
