//! Memory of every kind survives checkpoint --kill and restore.

use cr_tests::*;
use std::ffi::OsStr;
use std::time::Duration;

/// Checkpoints a workload of `size_mib` MiB with --kill, restores it with
/// `cr_restart DIR` in the background, triggers the check.
fn memory_kill_restore(name: &str, size_mib: u32, extra: &[&str]) {
    memory_kill_restore_with(name, size_mib, extra, &[]);
}

/// Like `memory_kill_restore`, cr_restart given `restore_args` too; returns
/// its output.
fn memory_kill_restore_with(
    name: &str,
    size_mib: u32,
    extra: &[&str],
    restore_args: &[&str],
) -> ToolOutput {
    let h = Harness::new(name);
    let size = size_mib.to_string();
    let mut args = vec![size.as_str()];
    args.extend_from_slice(extra);
    let mut wl = h.spawn_wl("wl_memory", &args);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let fds_before = fd_list(pid);
    let img = h.image_dir("img");

    let ck = checkpoint_kill(&h, &mut wl, &img);
    eprintln!("checkpoint of {size_mib} MiB took {:?}", ck.elapsed);
    assert!(
        img.join("checkpoint.img").is_file(),
        "no checkpoint.img in {}",
        img.display()
    );
    assert!(
        store_file(&img).is_file(),
        "no page store in {}",
        img.display()
    );

    let run = RunOpts {
        env: vec![("CR_LOG".into(), "info".into())],
        ..RunOpts::default()
    };
    let args: Vec<&OsStr> = restore_args.iter().map(OsStr::new).collect();
    let mut r = h.restore_bg_with(&img, pid, &args, &run);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(120));
    // With --lazy-pages the userfaultfd was closed in the process: its fd
    // table is the image's.
    assert_eq!(
        fd_list(pid),
        fds_before,
        "restored fds differ from the original's"
    );
    assert_eq!(
        wl.output(),
        "READY\n",
        "restored process printed something before go"
    );
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "memory restore");
    assert_eq!(wl.lines(), ["READY", "OK"], "whole stdout of the workload");
    out
}

#[test]
fn memory_300mib_kill_restore() {
    memory_kill_restore("memory300", 300, &[]);
}

#[test]
fn memory_small_kill_restore() {
    memory_kill_restore("memory8", 8, &[]);
}

/// VMA attributes: a PR_SET_VMA_ANON_NAME name (if the kernel has them),
/// MADV_DONTFORK/MADV_DONTDUMP.
#[test]
fn memory_vma_name_and_madvise_flags() {
    memory_kill_restore("memory-attrs", 8, &["named,advised"]);
}

/// A 1 TiB PROT_NONE reservation with a few read-write chunks inside.
#[test]
fn memory_huge_prot_none_reservation() {
    memory_kill_restore("memory-reserve", 8, &["reserve"]);
}

/// Four adjacent anonymous VMAs with alternating protections (rw-p, r--p,
/// rw-p, r--p): the smallest case of the one below.
#[test]
fn memory_adjacent_vmas_alternating_protection() {
    memory_kill_restore("memory-split4", 8, &["split4"]);
}

/// 10000 VMAs (one region, alternating rw-/r-- page by page).
#[test]
fn memory_10000_vmas() {
    memory_kill_restore("memory-split", 8, &["split"]);
}

/// A region grown and moved with mremap.
#[test]
fn memory_mremap_grown_region() {
    memory_kill_restore("memory-mremap", 8, &["mremap"]);
}

/// A MADV_HUGEPAGE region (transparent huge pages where the kernel gives them).
#[test]
fn memory_transparent_huge_pages() {
    memory_kill_restore("memory-thp", 8, &["thp"]);
}

/// A private file mapping that starts at a non-zero file offset.
#[test]
fn memory_file_mapping_at_offset() {
    memory_kill_restore("memory-fileoff", 8, &["fileoff"]);
}

/// Post-copy restore (`--lazy-pages`): the process runs before its private
/// anonymous pages are in; each is put in on first touch or pushed in the
/// background from the image; every kind of memory checks itself.
#[test]
fn memory_lazy_pages_restore() {
    let out = memory_kill_restore_with("memory-lazy", 300, &["split4,mremap"], &["--lazy-pages"]);
    assert!(
        out.stderr.contains("post-copy complete"),
        "cr_restart did not serve the pages through its userfaultfd\n{}",
        out.show()
    );
}

/// Post-copy that fails once the process runs: the process is killed (it
/// cannot run on without its pages), cr_restart says so in one line, and
/// the image, untouched, restores again.
#[test]
fn memory_lazy_pages_failure_kills_and_keeps_image() {
    let h = Harness::new("memory-lazy-fail");
    let mut wl = h.spawn_wl("wl_memory", &["64"]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);

    let run = RunOpts {
        env: vec![("CR_FAULT_INJECT".into(), "lazy-transfer".into())],
        ..RunOpts::default()
    };
    let mut r = h.restore_bg_with(&img, pid, &[OsStr::new("--lazy-pages")], &run);
    let out = r.wait_plain(TOOL_TIMEOUT);
    out.assert_error(
        "post-copy failing after the release",
        "cr_restart: error: ",
        &["post-copy", "killed", "lazy-transfer"],
    );
    // The killed process (reparented to us) is reaped with its handle.
    drop(r);
    wait_until(
        "the killed process to be gone",
        Duration::from_secs(10),
        || {
            // Ours to reap (we are a subreaper); then the pid is free.
            reap_orphans();
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
        },
        || describe(pid),
    );
    assert_no_restored(pid, &wl.exe, "failed post-copy");

    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(120));
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restore after a failed post-copy");
}

/// Most a tool may hold resident at once, in KiB, whatever the size of
/// the memory it checkpoints or restores (issue 22).
const TOOL_RSS_BOUND_KIB: u64 = 64 * 1024;

/// Asserts the tool's peak RSS (ru_maxrss from wait4) is within
/// [`TOOL_RSS_BOUND_KIB`].
fn assert_rss_bounded(out: &ToolOutput, what: &str) {
    let kib = out
        .max_rss_kib
        .unwrap_or_else(|| panic!("{what}: no peak RSS (not reaped as our child)"));
    eprintln!("{what}: peak RSS {:.1} MiB", kib as f64 / 1024.0);
    assert!(
        kib < TOOL_RSS_BOUND_KIB,
        "{what}: peak RSS {kib} KiB, over the bound of {TOOL_RSS_BOUND_KIB} KiB\n{}",
        out.show()
    );
}

/// The tools' peak RSS stays bounded below the memory they move: a
/// process with 256 MiB of written memory checkpointed in the default
/// mode (it runs on: its memory is copied out while frozen and stored
/// while it runs), then with --kill, and restored (--detach); each tool
/// under 64 MiB, and the restored process checks every page.
#[test]
fn memory_256mib_tools_peak_rss_bounded() {
    let h = Harness::new("memory-rss");
    let mut wl = h.spawn_wl("wl_memory", &["256"]);
    wl.wait_ready();
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let pid = wl.pid();
    let resident = proc_status(pid).map_or(0, |st| st.vm_rss_kib);
    assert!(
        resident > 3 * TOOL_RSS_BOUND_KIB,
        "the workload has only {resident} KiB resident: the bound would say nothing"
    );
    let debug = RunOpts {
        env: vec![("CR_LOG".into(), "debug".into())],
        ..RunOpts::default()
    };

    // The default mode: the process runs on.
    let out = h.checkpoint_with(&h.image_dir("continue"), &[], pid, &debug);
    out.assert_success("cr_checkpoint (continue)");
    assert!(
        out.stderr.contains("ran_on=true"),
        "the process did not run on before its memory was stored (no snapshot)\n{}",
        out.show()
    );
    assert_rss_bounded(&out, "cr_checkpoint (continue)");
    assert_running_untraced(pid, "after the checkpoint that continues");

    let img = h.image_dir("kill");
    let out = checkpoint_kill(&h, &mut wl, &img);
    assert_rss_bounded(&out, "cr_checkpoint --kill");

    // Detached: a cr_restart that waits for the restored process would
    // count its peak RSS too (wait4 gives the largest of a child and the
    // children it reaped).
    let (mut restored, out) = h.restore_detach_out(&img, pid);
    assert_rss_bounded(&out, "cr_restart --detach");
    wl.go();
    let st = restored.wait_exit(EXIT_TIMEOUT, || wl.diag());
    assert!(
        st.is_some_and(|s| s.success()),
        "restored workload ended with {}\n{}",
        status_str(st),
        wl.diag()
    );
    assert_eq!(wl.lines(), ["READY", "OK"], "whole stdout of the workload");
}
