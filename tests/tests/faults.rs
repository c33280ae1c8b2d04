//! CR_FAULT_INJECT=<stage> makes cr_checkpoint fail on purpose; it must then
//! behave like any failure: one error line, non-zero exit, the target unharmed
//! (running, not traced, memory intact: it verifies OK later, even though --kill
//! was asked for), and no usable image left behind.

use cr_tests::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

fn fault_at(stage: &str) {
    fault_with(stage, &["--kill"]);
}

/// `opts`: the mode asked for (--kill, --stop or none): whatever it is, a
/// failed checkpoint must leave the target running.
fn fault_with(stage: &str, opts: &[&str]) {
    let h = Harness::new(&format!("fault-{stage}"));
    let mut wl = h.spawn_wl("wl_memory", &["16"]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    let run = RunOpts {
        env: vec![("CR_FAULT_INJECT".into(), stage.into())],
        ..Default::default()
    };
    let out = h.checkpoint_with(&img, opts, pid, &run);
    out.assert_error(
        &format!("cr_checkpoint {opts:?} with a fault at {stage}"),
        "cr_checkpoint: error: ",
        &[],
    );
    assert_running_untraced(pid, &format!("after a fault at {stage}"));
    assert!(
        !img.exists(),
        "a failed checkpoint left the directory it created: {}",
        img.display()
    );
    // Still sleeping in its poll loop, i.e. it went on running normally.
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(5));
    assert_eq!(wl.output(), "READY\n");
    wl.go_and_expect_ok();
    assert_eq!(wl.output(), "READY\nOK\n");

    // The pid is free now: a usable image would restore, see go and exit 0.
    let r = h.restore_sync(&img, pid);
    r.assert_error(
        &format!("restore of the image dir left by a fault at {stage}"),
        "cr_restart: error: ",
        &[],
    );
    assert_no_restored(pid, &wl.exe, "after a failed restore");
}

#[test]
fn fault_after_seize() {
    fault_at("after-seize");
}

#[test]
fn fault_after_registers() {
    fault_at("after-registers");
}

#[test]
fn fault_mid_memory() {
    fault_at("mid-memory");
}

#[test]
fn fault_before_commit() {
    fault_at("before-commit");
}

#[test]
fn fault_mid_memory_with_stop() {
    fault_with("mid-memory", &["--stop"]);
}

#[test]
fn fault_before_commit_with_stop() {
    fault_with("before-commit", &["--stop"]);
}

#[test]
fn fault_after_registers_without_kill() {
    fault_with("after-registers", &[]);
}

#[test]
fn fault_after_commit() {
    fault_at("after-commit");
}

/// Every file of an image directory with its bytes.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("image dir")
        .flatten()
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).expect("read image file"),
            )
        })
        .collect()
}

/// A checkpoint into a directory that holds an image replaces it whole
/// (nothing of the old image stays), and one that fails — before or after
/// its commit — leaves the old image exactly as it was.
#[test]
fn image_directory_is_replaced_atomically() {
    let h = Harness::new("replace");
    let mut wl = h.spawn_wl("wl_memory", &["16"]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    h.checkpoint(&img, &[], pid)
        .assert_success("first checkpoint");
    let first = contents(&img);
    for stage in ["before-commit", "after-commit"] {
        let run = RunOpts {
            env: vec![("CR_FAULT_INJECT".into(), stage.into())],
            ..Default::default()
        };
        h.checkpoint_with(&img, &[], pid, &run).assert_error(
            &format!("checkpoint over an image with a fault at {stage}"),
            "cr_checkpoint: error: ",
            &[],
        );
        assert_running_untraced(pid, &format!("after a fault at {stage}"));
        let now = contents(&img);
        assert!(
            now == first,
            "a checkpoint failing at {stage} changed the image it was to replace: {:?} -> {:?}",
            first.keys().collect::<Vec<_>>(),
            now.keys().collect::<Vec<_>>()
        );
    }
    h.checkpoint(&img, &[], pid)
        .assert_success("second checkpoint");
    let second = contents(&img);
    let pages: Vec<&String> = second.keys().filter(|n| n.starts_with("pages-")).collect();
    assert_eq!(
        pages.len(),
        1,
        "the directory holds the page stores of two images: {:?}",
        second.keys().collect::<Vec<_>>()
    );
    assert!(
        !first.contains_key(pages[0].as_str()),
        "the new image reused the old page store's name"
    );
    assert!(
        second
            .keys()
            .all(|n| n == "checkpoint.img" || n.starts_with("pages-")),
        "files other than the image's: {:?}",
        second.keys().collect::<Vec<_>>()
    );
    // The replacing image is the one that restores.
    wl.proc.kill_and_reap();
    let mut r = h.restore_bg(&img, pid);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restore of the replacing image");
}
