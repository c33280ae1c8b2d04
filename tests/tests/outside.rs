//! Files outside the image: a restore refuses, naming the file, when one
//! the processes rely on changed since the checkpoint (unless
//! `--allow-changed-files`), and `cr_checkpoint --save-files` makes the
//! image self-contained (changed or deleted files are put back).
//!
//! The workload is wl_append: it writes numbered records to `append.dat`
//! (O_WRONLY|O_APPEND) and `plain.dat` (O_WRONLY, at its own offset) and
//! holds read-only, read-write and directory fds; it checks its fds and
//! the files' records itself after restore. Its write-only files may be
//! written after a checkpoint (outputs); the others may not.

use cr_tests::*;
use std::ffi::OsStr;

/// wl_append checkpointed with --kill (and `opts`) after 20 records.
fn checkpointed(h: &Harness, opts: &[&str]) -> (Workload, std::path::PathBuf) {
    let mut wl = h.spawn_wl("wl_append", &["5"]);
    wl.wait_ready();
    let app = wl.workdir.join("files/append.dat");
    wait_until(
        "20 records",
        LINE_TIMEOUT,
        || file_len(&app) >= 20 * REC,
        || wl.diag(),
    );
    let img = h.image_dir("img");
    let mut all = vec!["--kill"];
    all.extend_from_slice(opts);
    h.checkpoint(&img, &all, wl.pid())
        .assert_success("cr_checkpoint --kill");
    wl.reap_killed();
    (wl, img)
}

/// The restored workload writes 20 more records, is let go, and reports OK;
/// both files then hold the same records.
fn runs_on(mut r: Restore, wl: &Workload, ctx: &str) {
    let app = wl.workdir.join("files/append.dat");
    let plain = wl.workdir.join("files/plain.dat");
    let n0 = file_len(&app) / REC;
    wait_until(
        "20 more records after restore",
        LINE_TIMEOUT,
        || file_len(&app) >= (n0 + 20) * REC,
        || format!("{}\n{}", r.diag(), wl.diag()),
    );
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, wl);
    assert_restored_ok(&out, wl, ctx);
    let n = check_records(&app).unwrap_or_else(|e| panic!("{ctx}: {e}\n{}", wl.diag()));
    assert_eq!(check_records(&plain), Ok(n), "{ctx}: plain.dat");
}

#[test]
fn a_changed_file_refuses_the_restore_by_name_unless_allowed() {
    let h = Harness::new("outside-changed");
    let (wl, img) = checkpointed(&h, &[]);
    let pid = wl.pid();
    // Open read-write: the workload's state may depend on what it holds.
    let plain = wl.workdir.join("files/readwrite.dat");
    let exe = workload_path("wl_append");

    // Same bytes, new mtime: another program wrote it meanwhile.
    let md = std::fs::metadata(&plain).unwrap();
    let later = md.modified().unwrap() + std::time::Duration::from_secs(7);
    std::fs::File::options()
        .write(true)
        .open(&plain)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let out = h.restore_sync(&img, pid);
    let line = out.assert_error(
        "restore over a modified readwrite.dat",
        "cr_restart: ",
        &[
            "readwrite.dat",
            "fd ",
            "was modified",
            "--allow-changed-files",
        ],
    );
    assert!(line.contains(&plain.display().to_string()), "{line}");
    assert_no_restored(pid, &exe, "refused restore");
    let set_mtime = |t| {
        std::fs::File::options()
            .write(true)
            .open(&plain)
            .unwrap()
            .set_modified(t)
            .unwrap()
    };
    set_mtime(md.modified().unwrap());

    // A deleted file is named as gone.
    let ro = wl.workdir.join("files/readonly.dat");
    let ro_data = read_bytes(&ro);
    std::fs::remove_file(&ro).unwrap();
    let out = h.restore_sync(&img, pid);
    out.assert_error(
        "restore without readonly.dat",
        "cr_restart: ",
        &["readonly.dat", "is gone"],
    );
    assert_no_restored(pid, &exe, "refused restore");
    std::fs::write(&ro, ro_data).unwrap();
    set_mtime(later);

    // Asked for: restored anyway, each change a warning; the workload's
    // own checks pass (the content is the same).
    let r = h.restore_bg_args(&img, pid, &[OsStr::new("--allow-changed-files")]);
    runs_on(r, &wl, "restore with --allow-changed-files");
}

#[test]
fn save_files_puts_back_changed_and_deleted_files() {
    let h = Harness::new("outside-saved");
    let (wl, img) = checkpointed(&h, &["--save-files"]);
    let pid = wl.pid();
    let app = wl.workdir.join("files/append.dat");
    let plain = wl.workdir.join("files/plain.dat");
    let at_checkpoint = read_bytes(&plain);
    check_records(&plain).expect("plain.dat at checkpoint");

    // The image lists them as saved.
    let show = h.cr_image(&["show".as_ref(), img.as_os_str()]);
    show.assert_success("cr_image show");
    assert!(
        show.stdout.contains("saved file") && show.stdout.contains("plain.dat"),
        "cr_image show lists no saved plain.dat\n{}",
        show.show()
    );

    // Both files destroyed after the checkpoint.
    std::fs::remove_file(&app).unwrap();
    std::fs::write(&plain, b"garbage").unwrap();
    let r = h.restore_bg(&img, pid);
    runs_on(r, &wl, "restore of a self-contained image");
    assert!(
        read_bytes(&plain).starts_with(&at_checkpoint),
        "plain.dat does not begin with its content at the checkpoint"
    );
}

#[test]
fn save_file_of_a_missing_path_is_refused_and_the_process_runs_on() {
    let h = Harness::new("outside-missing");
    let mut wl = h.spawn_wl("wl_append", &["5"]);
    wl.wait_ready();
    let img = h.image_dir("img");
    let out = h.checkpoint(&img, &["--save-file", "/nonexistent/x.dat"], wl.pid());
    out.assert_error(
        "--save-file of a missing path",
        "cr_checkpoint: ",
        &["/nonexistent/x.dat", "--save-file"],
    );
    assert_running_untraced(wl.pid(), "after a refused checkpoint");
    wl.go_and_expect_ok();
}
