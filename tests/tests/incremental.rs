//! Incremental checkpoints: chains of images (a full one, then incremental ones
//! that store only the pages written since their parent), pre-dumps,
//! compression, compaction, deletion, and refusals of broken chains. The
//! workload (`wl_chain`) changes its memory between checkpoints (writes, new
//! and unmapped regions, mremap, mprotect, brk, MADV_DONTNEED, a new child
//! process each round) and verifies all of it, and its child's copy, after
//! every restore.

use cr_tests::*;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

const CK_ERR: &str = "cr_checkpoint: error: ";
const RS_ERR: &str = "cr_restart: error: ";
const IM_ERR: &str = "cr_image: error: ";

/// Size of the workload's memory in MiB (it has a child with a COW copy).
const MIB: &str = "16";

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn s(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

fn os(p: &Path) -> &OsStr {
    p.as_os_str()
}

fn spawn_chain(h: &Harness, rounds: u32) -> Workload {
    let rounds = rounds.to_string();
    h.spawn_wl("wl_chain", &["--rounds", &rounds, "--mib", MIB])
}

/// Waits for `READY r` and for the workload to sleep in its polling loop.
fn wait_ready(wl: &mut Workload, r: u32) {
    let want = format!("READY {r}");
    wl.wait_line(&want, |l| l == want);
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
}

/// Creates the trigger of round `r`.
fn next_round(wl: &Workload, r: u32) {
    touch(&wl.workdir.join(format!("round-{r}")));
}

/// Waits until none of `pids` exists any more (reaping those reparented to us).
fn wait_gone(pids: &[i32], ctx: &str) {
    wait_until(
        &format!("{ctx}: processes {pids:?} to be gone"),
        Duration::from_secs(20),
        || {
            reap_orphans();
            pids.iter().all(|&p| proc_status(p).is_none())
        },
        || {
            pids.iter()
                .map(|&p| describe(p))
                .collect::<Vec<_>>()
                .join("\n")
        },
    );
}

/// Checks that no process of this workload (its exe, with its work directory
/// on the command line) is left, e.g. after a refused restore.
fn assert_nothing_left(wl: &Workload, ctx: &str) {
    let dir = wl.workdir.to_string_lossy().into_owned();
    let ours = || -> Vec<i32> {
        let Ok(rd) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        rd.flatten()
            .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
            .filter(|&p| {
                is_alive(p)
                    && std::fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|x| x == wl.exe)
                    && String::from_utf8_lossy(
                        &std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default(),
                    )
                    .contains(&dir)
            })
            .collect()
    };
    wait_until(
        &format!("{ctx}: the workload's processes to be gone"),
        Duration::from_secs(20),
        || {
            reap_orphans();
            ours().is_empty()
        },
        || {
            ours()
                .iter()
                .map(|&p| describe(p))
                .collect::<Vec<_>>()
                .join("\n")
        },
    );
}

/// Removes the `verify` and `round-*` triggers of the work directory.
fn clear_triggers(wl: &Workload) {
    for e in std::fs::read_dir(&wl.workdir)
        .expect("read workdir")
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == "verify" || name.starts_with("round-") {
            std::fs::remove_file(e.path()).expect("remove trigger");
        }
    }
}

/// Puts the workload's stdout back to `printed`, what it held when the image
/// to be restored was taken (the restored process writes on at that offset),
/// so that the restored process's own lines can be told apart.
fn reset_stdout(wl: &Workload, printed: &str) {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&wl.stdout)
        .and_then(|mut f| {
            f.set_len(0)?;
            f.write_all(printed.as_bytes())
        })
        .expect("rewrite stdout");
}

/// A chain of images of one workload.
struct Chain {
    /// img1 (full, after `READY 0`), img2 (after `READY 1`, parent img1), ...
    imgs: Vec<PathBuf>,
    /// The workload's stdout when each image was taken.
    out: Vec<String>,
}

/// Runs the rounds 0..=rounds of `wl`: after `READY r`, checkpoints into
/// `img{r+1}` (with `--parent img{r}` from the second on) and starts the next
/// round. Every checkpoint gets `extra`; all but the last get `--track-mem`
/// if `track`; the last one gets `--kill` (the tree is reaped).
fn build_chain(h: &Harness, wl: &mut Workload, rounds: u32, extra: &[&str], track: bool) -> Chain {
    let pid = wl.pid();
    let mut chain = Chain {
        imgs: Vec::new(),
        out: Vec::new(),
    };
    for r in 0..=rounds {
        wait_ready(wl, r);
        let img = h.image_dir(&format!("img{}", r + 1));
        let last = r == rounds;
        let mut args: Vec<&str> = extra.to_vec();
        if track && !last {
            args.push("--track-mem");
        }
        if let Some(parent) = chain.imgs.last() {
            args.push("--parent");
            args.push(s(parent));
        }
        if last {
            args.push("--kill");
        }
        let tree = tree_pids(pid);
        let out = h.checkpoint(&img, &args, pid);
        out.assert_success(&format!("checkpoint after READY {r}"));
        eprintln!(
            "checkpoint {} ({args:?}) took {:?}",
            img.display(),
            out.elapsed
        );
        chain.out.push(wl.output());
        chain.imgs.push(img);
        if last {
            wl.reap_killed();
            wait_gone(&tree, "after the checkpoint with --kill");
        } else {
            for p in tree_pids(pid) {
                assert_running_untraced(p, &format!("after the checkpoint after READY {r}"));
            }
            next_round(wl, r + 1);
        }
    }
    chain
}

/// Restores `img`, taken when the workload had printed `printed`; waits until
/// the restored tree (parent and child) sleeps in its polling loop.
fn restore_tree(h: &Harness, wl: &Workload, img: &Path, printed: &str) -> (Restore, Vec<i32>) {
    clear_triggers(wl);
    reset_stdout(wl, printed);
    let mut r = h.restore_bg(img, wl.pid());
    let tree = wait_restored(wl, &mut r, img, printed);
    (r, tree)
}

/// True if `pid` runs `exe`, untraced, asleep in the polling loop.
fn is_polling(pid: i32, exe: &Path) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe)
        && matches!(proc_status(pid), Some(s) if s.state == 'S' && s.tracer_pid == 0)
        && blocked_syscall(pid).is_some_and(|n| POLL_SLEEP_SYSCALLS.contains(&n))
}

/// Waits until the tree restored by `r` (parent and child) sleeps in its
/// polling loop, having printed nothing; returns its pids.
fn wait_restored(wl: &Workload, r: &mut Restore, img: &Path, printed: &str) -> Vec<i32> {
    let pid = wl.pid();
    r.wait_blocked_in(wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(60));
    wait_until(
        &format!("the restored tree of {} (parent and child)", img.display()),
        Duration::from_secs(10),
        || tree_pids(pid).len() == 2,
        || format!("tree {:?}\n{}", tree_pids(pid), wl.diag()),
    );
    let tree = tree_pids(pid);
    assert_eq!(
        wl.output().get(printed.len()..),
        Some(""),
        "the restored process of {} printed something before it was told to",
        img.display()
    );
    tree
}

/// Touches `verify`; expects the restored tree to exit 0 after printing
/// exactly `expect` (ending in OK) after what it had `printed` before.
fn verify_restored(
    wl: &Workload,
    mut r: Restore,
    tree: &[i32],
    printed: &str,
    expect: &str,
    ctx: &str,
) {
    touch(&wl.workdir.join("verify"));
    let out = r.wait(EXIT_TIMEOUT, wl);
    assert_restored_ok(&out, wl, ctx);
    assert_eq!(
        wl.output().get(printed.len()..),
        Some(expect),
        "{ctx}: output of the restored process\n{}",
        wl.diag()
    );
    wait_gone(tree, ctx);
}

/// Restores `img` and has it verify itself (OK expected).
fn restore_verify(h: &Harness, wl: &Workload, img: &Path, printed: &str, ctx: &str) {
    let (r, tree) = restore_tree(h, wl, img, printed);
    verify_restored(wl, r, &tree, printed, "OK\n", ctx);
}

/// `cr_image stats --json IMG`.
fn stats(h: &Harness, img: &Path) -> serde_json::Value {
    let out = h.cr_image(&[OsStr::new("stats"), OsStr::new("--json"), os(img)]);
    out.assert_success("cr_image stats --json");
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("cr_image stats --json: not JSON ({e})\n{}", out.show()))
}

/// The stats of process `pid` in a stats object.
fn proc_stats(v: &serde_json::Value, pid: i32) -> &serde_json::Value {
    v["processes"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["pid"].as_i64() == Some(i64::from(pid))))
        .unwrap_or_else(|| panic!("no process {pid} in stats {v}"))
}

fn num(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("no number {key:?} in {v}"))
}

/// Asserts that the stats `v` of an image name `parent` (its directory or its
/// id) as parent.
fn assert_parent(h: &Harness, v: &serde_json::Value, parent: &Path) {
    let p = v["parent"]
        .as_str()
        .unwrap_or_else(|| panic!("no parent in {v}"));
    let pid = stats(h, parent)["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let name = parent
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    assert!(
        (!pid.is_empty() && p == pid) || p.ends_with(&name),
        "parent {p:?} should be {} (id {pid:?})\n{v}",
        parent.display()
    );
}

/// Checks the stats of a chain: img1 is full, every later image names its
/// parent, was made with `dirty` and references pages of the parent; the root
/// process stores much less than in the full image.
fn assert_chain_stats(h: &Harness, chain: &Chain, pid: i32, dirty: &str) {
    let first = stats(h, &chain.imgs[0]);
    assert!(first["parent"].is_null(), "img1 has no parent: {first}");
    let full = proc_stats(&first, pid);
    assert_eq!(full["dirty"], "full", "img1: {first}");
    assert_eq!(num(full, "pages_parent"), 0, "img1: {first}");
    let full_stored = num(full, "pages_stored");
    eprintln!("stats of img1: {first}");
    assert!(
        full_stored > 1000,
        "img1 stores only {full_stored} pages: {first}"
    );
    for k in 1..chain.imgs.len() {
        let v = stats(h, &chain.imgs[k]);
        eprintln!("stats of img{}: {v}", k + 1);
        assert_parent(h, &v, &chain.imgs[k - 1]);
        let p = proc_stats(&v, pid);
        assert_eq!(p["dirty"], dirty, "img{}: {v}", k + 1);
        assert!(num(p, "pages_parent") > 0, "img{}: {v}", k + 1);
        let stored = num(p, "pages_stored");
        assert!(
            stored * 3 < full_stored,
            "img{}: the root stores {stored} pages, the full image {full_stored}: {v}",
            k + 1
        );
        assert!(num(&v, "store_bytes") > 0, "img{}: {v}", k + 1);
    }
}

fn image_rm(h: &Harness, args: &[&str], img: &Path) -> ToolOutput {
    let mut a: Vec<&OsStr> = vec![OsStr::new("rm")];
    a.extend(args.iter().map(OsStr::new));
    a.push(os(img));
    h.cr_image(&a)
}

fn image_verify(h: &Harness, img: &Path) -> ToolOutput {
    h.cr_image(&[OsStr::new("verify"), os(img)])
}

/// Touches `verify` for the original (never checkpointed with --kill)
/// workload; expects it to print OK last and exit 0.
fn verify_original(wl: &mut Workload, ctx: &str) {
    touch(&wl.workdir.join("verify"));
    let (o, e) = (wl.stdout.clone(), wl.stderr.clone());
    let st = wl.proc.wait_exit(EXIT_TIMEOUT, || files_diag(&o, &e));
    assert!(
        st.is_some_and(|s| s.success()) && wl.lines().last().map(String::as_str) == Some("OK"),
        "{ctx}: the workload should print OK and exit 0, got {}\n{}",
        status_str(st),
        wl.diag()
    );
}

/// Whether the kernel keeps soft-dirty bits (pagemap bit 55 set on a page
/// just written).
fn soft_dirty_supported() -> bool {
    use std::io::{Read, Seek, SeekFrom};
    // SAFETY: a fresh private anonymous page, written once and unmapped.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED, "mmap");
    // SAFETY: the page was just mapped read-write.
    unsafe { std::ptr::write_volatile(p as *mut u64, 1) };
    let mut entry = [0u8; 8];
    let ok = std::fs::File::open("/proc/self/pagemap")
        .and_then(|mut f| {
            f.seek(SeekFrom::Start((p as u64 / 4096) * 8))?;
            f.read_exact(&mut entry)
        })
        .is_ok();
    // SAFETY: unmapping the page mapped above.
    unsafe { libc::munmap(p, 4096) };
    ok && u64::from_ne_bytes(entry) & (1 << 55) != 0
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

/// A chain of five images with uffd-wp dirty tracking (the default method on
/// this kernel): every incremental image stores a fraction of the full one and
/// references the rest; the last and every intermediate image restore and
/// verify; a restored intermediate image goes on with its rounds; a restored
/// tree killed leaves nothing behind and its image restores again.
#[test]
fn chain_of_five_with_uffd_tracking() {
    let h = Harness::new("incr-uffd");
    let mut wl = spawn_chain(&h, 4);
    let pid = wl.pid();
    let chain = build_chain(&h, &mut wl, 4, &[], true);
    assert_chain_stats(&h, &chain, pid, "uffd-wp");
    for img in &chain.imgs {
        image_verify(&h, img).assert_success(&format!("cr_image verify {}", img.display()));
    }

    restore_verify(&h, &wl, &chain.imgs[4], &chain.out[4], "restore of img5");

    // img3 (after READY 2) goes on with rounds 3 and 4, then verifies.
    let (mut r, tree) = restore_tree(&h, &wl, &chain.imgs[2], &chain.out[2]);
    for round in 3..=4 {
        next_round(&wl, round);
        let want = format!("READY {round}");
        r.wait_line(&wl, &want, |l| l == want);
    }
    let tree_now = tree_pids(pid);
    assert_eq!(tree_now.len(), 2, "parent and the child of round 4");
    verify_restored(
        &wl,
        r,
        &tree_now,
        &chain.out[2],
        "READY 3\nREADY 4\nOK\n",
        "img3 restored, two more rounds",
    );
    wait_gone(&tree, "the tree restored from img3");

    // img2 restored and killed: nothing stays; then restored again.
    let (mut r, tree) = restore_tree(&h, &wl, &chain.imgs[1], &chain.out[1]);
    r.restored.signal(libc::SIGKILL);
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGKILL),
        "cr_restart after its process was killed\n{}",
        out.show()
    );
    wait_gone(&tree, "the killed tree restored from img2");
    restore_verify(
        &h,
        &wl,
        &chain.imgs[1],
        &chain.out[1],
        "img2 restored again",
    );

    restore_verify(&h, &wl, &chain.imgs[3], &chain.out[3], "restore of img4");
    restore_verify(&h, &wl, &chain.imgs[0], &chain.out[0], "restore of img1");
}

/// The same chain with `--dirty hash` (pages compared by their hashes with
/// the parent's: works on every kernel).
#[test]
fn chain_of_five_with_hash_dirty_detection() {
    let h = Harness::new("incr-hash");
    let mut wl = spawn_chain(&h, 4);
    let pid = wl.pid();
    let chain = build_chain(&h, &mut wl, 4, &["--dirty", "hash"], false);
    assert_chain_stats(&h, &chain, pid, "hash");
    restore_verify(&h, &wl, &chain.imgs[4], &chain.out[4], "restore of img5");
    restore_verify(&h, &wl, &chain.imgs[2], &chain.out[2], "restore of img3");
}

/// A process restored from a chain is checkpointed again on top of it (its
/// dirty tracking, if any, started with the restore, not with the parent
/// image): the new image restores and verifies.
#[test]
fn restored_process_checkpointed_on_top_of_its_chain() {
    let h = Harness::new("incr-restored");
    let mut wl = spawn_chain(&h, 3);
    let pid = wl.pid();
    let chain = build_chain(&h, &mut wl, 2, &[], true);
    let (mut r, tree) = restore_tree(&h, &wl, &chain.imgs[2], &chain.out[2]);
    next_round(&wl, 3);
    r.wait_line(&wl, "READY 3", |l| l == "READY 3");
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    let tree_now = tree_pids(pid);
    let img4 = h.image_dir("img4");
    h.checkpoint(&img4, &["--parent", s(&chain.imgs[2]), "--kill"], pid)
        .assert_success("checkpoint of the restored process with --parent img3");
    let printed = wl.output();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_eq!(
        out.status.code(),
        Some(128 + libc::SIGKILL),
        "cr_restart after its process was checkpointed with --kill\n{}",
        out.show()
    );
    wait_gone(&tree, "the tree restored from img3");
    wait_gone(&tree_now, "the tree checkpointed into img4");
    let v = stats(&h, &img4);
    eprintln!("stats of img4: {v}");
    assert_parent(&h, &v, &chain.imgs[2]);
    restore_verify(
        &h,
        &wl,
        &img4,
        &printed,
        "img4, taken of a restored process",
    );
}

/// Incremental images on a parent other than the last checkpoint: the
/// tracking restarted at the last checkpoint does not tell what changed since
/// an older one, which must be noticed (or the image would take stale pages
/// from its parent). img3 has parent img1 (skipping img2); img4 has parent
/// img2 (skipping img3). Both restore and verify.
#[test]
fn incremental_on_an_older_parent() {
    let h = Harness::new("incr-branch");
    let mut wl = spawn_chain(&h, 3);
    let pid = wl.pid();
    let d: Vec<PathBuf> = (1..=4).map(|k| h.image_dir(&format!("img{k}"))).collect();
    let mut printed = Vec::new();
    let plan: [&[&str]; 4] = [
        &["--track-mem"],
        &["--track-mem", "--parent", s(&d[0])],
        &["--track-mem", "--parent", s(&d[0])],
        &["--parent", s(&d[1]), "--kill"],
    ];
    let tree = tree_pids(pid);
    for (r, args) in plan.iter().enumerate() {
        wait_ready(&mut wl, r as u32);
        h.checkpoint(&d[r], args, pid)
            .assert_success(&format!("checkpoint img{} {args:?}", r + 1));
        printed.push(wl.output());
        if r < 3 {
            next_round(&wl, r as u32 + 1);
        }
    }
    wl.reap_killed();
    wait_gone(&tree, "after --kill");
    for k in [2, 3] {
        let v = stats(&h, &d[k]);
        eprintln!("stats of img{}: {v}", k + 1);
        assert_parent(&h, &v, &d[if k == 2 { 0 } else { 1 }]);
    }
    restore_verify(&h, &wl, &d[3], &printed[3], "img4 (parent img2, not img3)");
    restore_verify(&h, &wl, &d[2], &printed[2], "img3 (parent img1, not img2)");

    // img1 has two dependants: rm refuses, rm --rebase folds it into both.
    let out = image_rm(&h, &[], &d[0]);
    let line = out.assert_error("cr_image rm img1 (two dependants)", IM_ERR, &[]);
    assert_mentions_any(&line, &["img2", "img3"], "rm of a parent names a dependant");
    image_rm(&h, &["--rebase"], &d[0]).assert_success("cr_image rm --rebase img1");
    assert!(!d[0].exists(), "rm --rebase left {}", d[0].display());
    for k in [1, 2, 3] {
        image_verify(&h, &d[k]).assert_success(&format!("cr_image verify img{}", k + 1));
    }
    restore_verify(
        &h,
        &wl,
        &d[2],
        &printed[2],
        "img3 after img1 was folded into it",
    );
    restore_verify(
        &h,
        &wl,
        &d[3],
        &printed[3],
        "img4 after img1 was folded into img2",
    );
}

/// `cr_image compact` makes a self-contained image; `cr_image rm` refuses to
/// delete an image another one depends on, `rm --rebase` folds it into its
/// dependant; the compacted image restores after the whole chain is gone.
#[test]
fn compact_rm_and_rebase() {
    let h = Harness::new("incr-compact");
    let mut wl = spawn_chain(&h, 4);
    let chain = build_chain(&h, &mut wl, 4, &[], true);
    let d = &chain.imgs;

    let c = h.image_dir("compacted");
    h.cr_image(&[
        OsStr::new("compact"),
        os(&d[4]),
        OsStr::new("--out"),
        os(&c),
    ])
    .assert_success("cr_image compact img5 --out compacted");
    let v = stats(&h, &c);
    assert!(
        v["parent"].is_null(),
        "a compacted image has no parent: {v}"
    );
    for p in v["processes"].as_array().expect("processes") {
        assert_eq!(num(p, "pages_parent"), 0, "compacted: {v}");
    }
    image_verify(&h, &c).assert_success("cr_image verify compacted");

    // img5 depends on img4.
    let out = image_rm(&h, &[], &d[3]);
    let line = out.assert_error("cr_image rm img4 (img5 depends on it)", IM_ERR, &[]);
    assert_mentions_any(&line, &["img5"], "rm of a parent names its dependant");
    assert!(
        d[3].join("checkpoint.img").is_file(),
        "a refused rm deleted img4"
    );

    image_rm(&h, &["--rebase"], &d[3]).assert_success("cr_image rm --rebase img4");
    assert!(!d[3].exists(), "rm --rebase left {}", d[3].display());
    assert_parent(&h, &stats(&h, &d[4]), &d[2]);
    image_verify(&h, &d[4]).assert_success("cr_image verify img5 after the rebase");
    restore_verify(
        &h,
        &wl,
        &d[4],
        &chain.out[4],
        "img5 after img4 was folded into it",
    );

    // Leaf first, the chain can go; the compacted copy stands alone.
    for k in [4, 2, 1, 0] {
        image_rm(&h, &[], &d[k]).assert_success(&format!("cr_image rm img{}", k + 1));
        assert!(!d[k].exists(), "rm left {}", d[k].display());
    }
    restore_verify(
        &h,
        &wl,
        &c,
        &chain.out[4],
        "the compacted image, chain deleted",
    );
}

/// A pre-dump copies the memory while the process runs; the real checkpoint
/// with it as parent stores only what changed since, and restores.
#[test]
fn pre_dump_then_checkpoint() {
    let h = Harness::new("incr-predump");
    let mut wl = spawn_chain(&h, 1);
    let pid = wl.pid();
    wait_ready(&mut wl, 0);
    let pre = h.image_dir("predump");
    h.checkpoint(&pre, &["--pre-dump"], pid)
        .assert_success("cr_checkpoint --pre-dump");
    assert_running_untraced(pid, "after the pre-dump");
    next_round(&wl, 1);
    wait_ready(&mut wl, 1);
    let img = h.image_dir("img");
    let tree = tree_pids(pid);
    h.checkpoint(&img, &["--parent", s(&pre), "--kill"], pid)
        .assert_success("cr_checkpoint --parent PREDUMP --kill");
    let printed = wl.output();
    wl.reap_killed();
    wait_gone(&tree, "after --kill");

    let v = stats(&h, &img);
    assert_parent(&h, &v, &pre);
    let p = proc_stats(&v, pid);
    assert!(num(p, "pages_parent") > 0, "{v}");
    assert_ne!(p["dirty"], "full", "{v}");

    // A pre-dump alone is no image to restore.
    let out = h.restore_sync(&pre, pid);
    let line = out.assert_error("restore of a pre-dump", RS_ERR, &[]);
    assert_mentions_any(
        &line,
        &["pre-dump", "predump", "pre_dump"],
        "restore of a pre-dump",
    );
    assert_nothing_left(&wl, "after the refused restore of a pre-dump");

    restore_verify(
        &h,
        &wl,
        &img,
        &printed,
        "restore of the checkpoint over a pre-dump",
    );
}

/// A pre-dump, then a checkpoint on it that lets the process run on (its
/// memory planned while frozen from the tracker's scan and a scan for the
/// pages emptied since, the parent's hashes copied once it runs), then
/// one on that which kills it. Between them the workload writes, maps,
/// unmaps, moves and empties pages (MADV_DONTNEED, which must read zero
/// and not the pre-dump's content); both images restore and verify.
#[test]
fn pre_dump_then_checkpoint_that_continues() {
    let h = Harness::new("incr-predump-cont");
    let mut wl = spawn_chain(&h, 2);
    let pid = wl.pid();
    wait_ready(&mut wl, 0);
    let pre = h.image_dir("predump");
    h.checkpoint(&pre, &["--pre-dump"], pid)
        .assert_success("cr_checkpoint --pre-dump");
    next_round(&wl, 1);
    wait_ready(&mut wl, 1);
    let img1 = h.image_dir("img1");
    h.checkpoint(&img1, &["--parent", s(&pre)], pid)
        .assert_success("cr_checkpoint --parent PREDUMP (the process runs on)");
    let printed1 = wl.output();
    for p in tree_pids(pid) {
        assert_running_untraced(p, "after the checkpoint on the pre-dump");
    }
    let v = stats(&h, &img1);
    assert_parent(&h, &v, &pre);
    let p = proc_stats(&v, pid);
    assert!(num(p, "pages_parent") > 0, "{v}");
    assert_eq!(p["dirty"], "uffd-wp", "{v}");

    next_round(&wl, 2);
    wait_ready(&mut wl, 2);
    let img2 = h.image_dir("img2");
    let tree = tree_pids(pid);
    h.checkpoint(&img2, &["--parent", s(&img1), "--kill"], pid)
        .assert_success("cr_checkpoint --parent IMG1 --kill");
    let printed2 = wl.output();
    wl.reap_killed();
    wait_gone(&tree, "after --kill");

    restore_verify(
        &h,
        &wl,
        &img1,
        &printed1,
        "restore of the checkpoint on a pre-dump that continued",
    );
    restore_verify(&h, &wl, &img2, &printed2, "restore of the checkpoint on it");
}

fn compressed_chain(method: &str) {
    let h = Harness::new(&format!("incr-{method}"));
    let mut wl = spawn_chain(&h, 1);
    let chain = build_chain(&h, &mut wl, 1, &["--compress", method], true);
    for img in &chain.imgs {
        let v = stats(&h, img);
        assert_eq!(v["compression"], method, "{}: {v}", img.display());
    }
    assert_parent(&h, &stats(&h, &chain.imgs[1]), &chain.imgs[0]);
    image_verify(&h, &chain.imgs[1]).assert_success("cr_image verify img2");
    restore_verify(&h, &wl, &chain.imgs[1], &chain.out[1], "restore of img2");

    // Compacted in place, img2 no longer needs img1.
    h.cr_image(&[OsStr::new("compact"), os(&chain.imgs[1])])
        .assert_success("cr_image compact img2 (in place)");
    let v = stats(&h, &chain.imgs[1]);
    assert!(v["parent"].is_null(), "compacted in place: {v}");
    for p in v["processes"].as_array().expect("processes") {
        assert_eq!(num(p, "pages_parent"), 0, "compacted in place: {v}");
    }
    image_rm(&h, &[], &chain.imgs[0]).assert_success("cr_image rm img1 after compaction");
    restore_verify(
        &h,
        &wl,
        &chain.imgs[1],
        &chain.out[1],
        "img2 compacted in place",
    );
}

#[test]
fn chain_compressed_with_lz4() {
    compressed_chain("lz4");
}

#[test]
fn chain_compressed_with_zstd() {
    compressed_chain("zstd");
}

/// A restore whose parent image lost its page store, or has a damaged one,
/// is refused with one line naming the parent and leaves nothing running;
/// `cr_image verify` refuses the chain too. One flipped byte may sit in pages
/// the child image does not need: then the restore may go ahead, but the
/// restored tree must verify OK. Repaired, the chain restores.
#[test]
fn broken_parent_is_refused() {
    let h = Harness::new("incr-broken");
    let mut wl = spawn_chain(&h, 2);
    let pid = wl.pid();
    let chain = build_chain(&h, &mut wl, 2, &[], true);
    let (d2, d3) = (&chain.imgs[1], &chain.imgs[2]);
    let store = store_file(d2);
    let backup = h.dir.join("store-backup");
    std::fs::copy(&store, &backup).expect("back up the store");
    let verify_refused = |what: &str| {
        let v = image_verify(&h, d3);
        let line = v.assert_error(&format!("cr_image verify img3 ({what})"), IM_ERR, &[]);
        assert_mentions_any(&line, &["img2"], &format!("verify ({what}) names img2"));
    };
    let restore_refused = |out: &ToolOutput, what: &str| {
        let line = out.assert_error(&format!("restore of img3 ({what})"), RS_ERR, &[]);
        assert_mentions_any(&line, &["img2"], &format!("restore ({what}) names img2"));
        assert_no_restored(pid, &wl.exe, what);
        assert_nothing_left(&wl, what);
    };

    let what = "the parent's page store deleted";
    std::fs::remove_file(&store).expect("remove the store");
    verify_refused(what);
    restore_refused(&h.restore_sync(d3, pid), what);

    let len = std::fs::metadata(&backup).expect("stat store").len();
    assert!(len > 8192, "{} has only {len} bytes", store.display());
    let what = "one flipped byte in the middle of the parent's page store";
    std::fs::copy(&backup, &store).expect("put the store back");
    flip_byte(&store, len / 2);
    verify_refused(what);
    clear_triggers(&wl);
    reset_stdout(&wl, &chain.out[2]);
    let mut r = h.restore_bg(d3, pid);
    let t0 = std::time::Instant::now();
    loop {
        if !r.running() {
            restore_refused(&r.wait_plain(TOOL_TIMEOUT), what);
            break;
        }
        if is_polling(pid, &wl.exe) {
            eprintln!("{what}: img3 does not need the damaged block; it restored");
            let tree = wait_restored(&wl, &mut r, d3, &chain.out[2]);
            verify_restored(&wl, r, &tree, &chain.out[2], "OK\n", what);
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{what}: cr_restart neither failed nor restored\n{}\n{}",
            r.diag(),
            wl.diag()
        );
        std::thread::sleep(Duration::from_millis(10));
    }

    let what = "a flipped byte in every page of the parent's page store";
    std::fs::copy(&backup, &store).expect("put the store back");
    for off in (len / 2 % 4096..len).step_by(4096) {
        flip_byte(&store, off);
    }
    verify_refused(what);
    restore_refused(&h.restore_sync(d3, pid), what);

    std::fs::copy(&backup, &store).expect("put the store back");
    image_verify(&h, d3).assert_success("cr_image verify img3 once repaired");
    restore_verify(&h, &wl, d3, &chain.out[2], "img3 once img2 is repaired");
}

/// `--parent` naming no image: refused, and the process goes on unharmed.
#[test]
fn missing_parent_is_refused() {
    let h = Harness::new("incr-noparent");
    let mut wl = spawn_chain(&h, 1);
    let pid = wl.pid();
    wait_ready(&mut wl, 0);
    let img = h.image_dir("img");
    let missing = h.dir.join("no-such-image");
    let out = h.checkpoint(&img, &["--parent", s(&missing), "--track-mem"], pid);
    let line = out.assert_error("--parent of a missing image", CK_ERR, &[]);
    assert_mentions_any(&line, &["no-such-image"], "--parent of a missing image");
    assert_running_untraced(pid, "after a refused --parent");
    assert!(
        !img.join("checkpoint.img").exists(),
        "a refused checkpoint wrote an image"
    );
    next_round(&wl, 1);
    wait_ready(&mut wl, 1);
    verify_original(&mut wl, "after a refused --parent");
}

/// `--dirty soft-dirty` on a kernel without soft-dirty bits: refused clearly,
/// for a full and for an incremental checkpoint; the process goes on, and
/// the chain made without it restores.
#[test]
fn soft_dirty_refused_without_kernel_support() {
    if soft_dirty_supported() {
        eprintln!("this kernel has soft-dirty bits: nothing to refuse, test skipped");
        return;
    }
    let h = Harness::new("incr-softdirty");
    let mut wl = spawn_chain(&h, 2);
    let pid = wl.pid();
    wait_ready(&mut wl, 0);
    let refused = |img: &Path, args: &[&str], ctx: &str| {
        let out = h.checkpoint(img, args, pid);
        out.assert_error(ctx, CK_ERR, &["soft-dirty"]);
        assert_running_untraced(pid, ctx);
        assert!(
            !img.join("checkpoint.img").exists(),
            "{ctx}: a refused checkpoint wrote an image"
        );
    };
    let d1 = h.image_dir("img1");
    refused(
        &d1,
        &["--track-mem", "--dirty", "soft-dirty"],
        "full checkpoint with --dirty soft-dirty",
    );
    h.checkpoint(&d1, &["--track-mem"], pid)
        .assert_success("full checkpoint with --track-mem");
    next_round(&wl, 1);
    wait_ready(&mut wl, 1);
    let d2 = h.image_dir("img2");
    refused(
        &d2,
        &["--parent", s(&d1), "--track-mem", "--dirty", "soft-dirty"],
        "incremental checkpoint with --dirty soft-dirty",
    );
    next_round(&wl, 2);
    wait_ready(&mut wl, 2);
    let d3 = h.image_dir("img3");
    let tree = tree_pids(pid);
    h.checkpoint(&d3, &["--parent", s(&d1), "--kill"], pid)
        .assert_success("incremental checkpoint after the refusals");
    let printed = wl.output();
    wl.reap_killed();
    wait_gone(&tree, "after --kill");
    restore_verify(
        &h,
        &wl,
        &d3,
        &printed,
        "restore after the soft-dirty refusals",
    );
}

/// Restores `img` of the `wl_vmflags` workload (checked with --verify, as
/// every restore of the suite), lets it check its memory and VmFlags.
fn restore_vmflags(h: &Harness, wl: &Workload, img: &Path, ctx: &str) {
    let mut r = h.restore_bg(img, wl.pid());
    r.wait_blocked_in(wl, POLL_SLEEP_SYSCALLS, Duration::from_secs(60));
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, wl);
    assert_restored_ok(&out, wl, ctx);
    assert_eq!(wl.lines(), ["READY", "CHANGED", "OK"], "{ctx}: stdout");
}

/// Starts `wl_vmflags` and waits until it is ready and asleep.
fn spawn_vmflags(h: &Harness, args: &[&str]) -> Workload {
    let mut wl = h.spawn_wl("wl_vmflags", args);
    wl.wait_line("READY", |l| l == "READY");
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
    wl
}

/// Tells `wl_vmflags` to madvise its regions (their maps lines unchanged)
/// and map a new one; waits until it did.
fn change_vmflags(wl: &mut Workload) {
    touch(&wl.workdir.join("change"));
    wl.wait_line("CHANGED", |l| l == "CHANGED");
    wl.wait_blocked_in(POLL_SLEEP_SYSCALLS, Duration::from_secs(10));
}

/// Pre-dumped, then VmFlags changed by madvise without changing the maps
/// lines (MADV_DONTDUMP, MADV_WIPEONFORK, MADV_HUGEPAGE) and a new mapping,
/// then checkpointed on the pre-dump (the flags of unchanged lines are
/// read before the freeze, see `memory::flags`), killed and restored: the
/// workload finds its memory and its flags.
#[test]
fn pre_dump_then_madvise_vmflags_restored() {
    let h = Harness::new("incr-predump-vmflags");
    let mut wl = spawn_vmflags(&h, &["new"]);
    let pid = wl.pid();
    let pre = h.image_dir("predump");
    h.checkpoint(&pre, &["--pre-dump"], pid)
        .assert_success("cr_checkpoint --pre-dump");
    change_vmflags(&mut wl);
    let img = h.image_dir("img");
    h.checkpoint(&img, &["--parent", s(&pre), "--kill"], pid)
        .assert_success("cr_checkpoint --parent PREDUMP --kill");
    wl.reap_killed();
    let v = stats(&h, &img);
    assert_parent(&h, &v, &pre);
    restore_vmflags(&h, &wl, &img, "restore after madvise over a pre-dump");
}

/// VmFlags changed by madvise between the read of smaps (before the
/// freeze) and the freeze, the maps lines unchanged: the checkpoint that
/// continues the process finds it when it reads them again after the
/// thaw, fails in one line, removes its image, and the process runs on;
/// a checkpoint taken again saves and restores the new flags.
#[test]
fn madvise_before_the_freeze_vmflags_caught() {
    let h = Harness::new("incr-vmflags-race");
    // No new mapping: every line of maps stays, so the flags read before
    // the freeze are taken.
    let mut wl = spawn_vmflags(&h, &[]);
    let pid = wl.pid();
    let pre = h.image_dir("predump");
    h.checkpoint(&pre, &["--pre-dump"], pid)
        .assert_success("cr_checkpoint --pre-dump");
    let hold = h.image_dir("hold");
    std::fs::create_dir_all(&hold).expect("hold dir");
    let img = h.image_dir("img");
    let pid_s = pid.to_string();
    let args: Vec<&OsStr> = vec![
        OsStr::new("--dir"),
        os(&img),
        OsStr::new("--parent"),
        os(&pre),
        OsStr::new(&pid_s),
    ];
    let run = RunOpts {
        env: vec![(
            "CR_FAULT_HOLD".into(),
            format!("before-freeze:{}", s(&hold)),
        )],
        ..RunOpts::default()
    };
    let (mut ck, out, err, cmdline) = h.start_tool(&tool_path("cr_checkpoint"), &args, &run);
    let held = hold.join("held");
    wait_until(
        "cr_checkpoint to hold before the freeze",
        Duration::from_secs(30),
        || held.exists(),
        || files_diag(&out, &err),
    );
    change_vmflags(&mut wl);
    touch(&hold.join("release"));
    let st = ck.wait_exit(EXIT_TIMEOUT, || files_diag(&out, &err));
    let stderr = read_text(&err);
    assert!(
        st.is_some_and(|s| !s.success()),
        "{cmdline} should fail\n{}",
        files_diag(&out, &err)
    );
    let line = stderr
        .lines()
        .find(|l| l.starts_with(CK_ERR))
        .unwrap_or_else(|| panic!("no error line\n{}", files_diag(&out, &err)));
    assert_mentions_any(line, &["flags"], "madvise before the freeze");
    assert!(
        !img.join("checkpoint.img").exists(),
        "the failed checkpoint left its image"
    );
    assert_running_untraced(pid, "after the checkpoint that failed");

    let img = h.image_dir("img2");
    h.checkpoint(&img, &["--parent", s(&pre), "--kill"], pid)
        .assert_success("cr_checkpoint --parent PREDUMP --kill, again");
    wl.reap_killed();
    restore_vmflags(&h, &wl, &img, "restore of the checkpoint taken again");
}
