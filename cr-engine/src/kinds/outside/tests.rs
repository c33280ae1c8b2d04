//! The rules by which an outside file counts as changed.

use super::*;
use std::io::Write;

fn record(path: &std::path::Path, append: bool) -> OutsideFile {
    let md = std::fs::metadata(path).unwrap();
    identity(
        &path.to_string_lossy(),
        "fd 3 of process 1",
        &md,
        Vec::new(),
        append,
    )
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cr-outside-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn unchanged_file_passes_and_every_change_is_named() {
    let d = scratch("rules");
    let p = d.join("data");
    std::fs::write(&p, b"0123456789").unwrap();
    let f = record(&p, false);
    assert_eq!(change(&f, true), None);

    // Same size, new content: the mtime tells.
    let before = f.mtime_ns;
    std::fs::write(&p, b"abcdefghij").unwrap();
    cr_sys::fdio::set_times_nofollow(&p, before + 5_000_000_000).unwrap();
    let c = change(&f, true).expect("a rewritten file is changed");
    assert!(c.starts_with("was modified"), "{c}");

    // Replaced by rename with the same size and mtime: the inode tells
    // (same boot only).
    let q = d.join("new");
    std::fs::write(&q, b"0123456789").unwrap();
    cr_sys::fdio::set_times_nofollow(&q, before).unwrap();
    std::fs::rename(&q, &p).unwrap();
    let c = change(&f, true).expect("a replaced file is changed");
    assert!(c.starts_with("was replaced"), "{c}");
    assert_eq!(change(&f, false), None, "another boot: inodes say nothing");

    std::fs::write(&p, b"short").unwrap();
    assert_eq!(change(&f, false).unwrap(), "has 5 bytes, had 10");
    std::fs::remove_file(&p).unwrap();
    assert_eq!(change(&f, false).unwrap(), "is gone");
    std::fs::create_dir(&p).unwrap();
    assert_eq!(
        change(&f, false).unwrap(),
        "is now a directory, was a regular file"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_output_file_may_be_written_but_not_shortened_or_replaced_and_a_directory_only_has_to_exist() {
    let d = scratch("log");
    let p = d.join("log");
    std::fs::write(&p, b"line 1\n").unwrap();
    let f = record(&p, true);
    let mut w = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
    w.write_all(b"line 2\n").unwrap();
    assert_eq!(change(&f, true), None, "a log that grew");
    std::fs::write(&p, b"LINE 1\nLINE 2\n").unwrap();
    assert_eq!(change(&f, true), None, "an output file rewritten");
    std::fs::write(&p, b"").unwrap();
    assert!(change(&f, true).unwrap().starts_with("has 0 bytes"));
    let q = d.join("rotated");
    std::fs::write(&q, b"line 1\nline 2\nline 3\n").unwrap();
    std::fs::rename(&q, &p).unwrap();
    assert!(change(&f, true).unwrap().starts_with("was replaced"));

    let dir = record(&d, false);
    std::fs::write(d.join("other"), b"x").unwrap();
    assert_eq!(
        change(&dir, true),
        None,
        "a directory whose entries changed"
    );
    std::fs::remove_dir_all(&d).unwrap();
    assert_eq!(change(&dir, true).unwrap(), "is gone");
}

#[test]
fn an_elf_file_is_judged_by_its_build_id() {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let md = std::fs::metadata(&exe).unwrap();
    let id = cr_sys::elf::file_build_id(&exe.to_string_lossy()).unwrap();
    if id.is_empty() {
        // The test binary is linked with a build id (the default of the
        // toolchain); without one the rule cannot be shown.
        panic!("{} has no GNU build id", exe.display());
    }
    let mut f = identity(&exe.to_string_lossy(), "the executable", &md, id, false);
    // Same build: other size and mtime records do not matter.
    f.size += 1;
    f.mtime_ns -= 1;
    assert_eq!(change(&f, true), None);
    f.build_id = vec![0xab; 20];
    let c = change(&f, true).unwrap();
    assert!(c.starts_with("is another build (build id "), "{c}");
    assert!(c.ends_with(&format!("was {})", "ab".repeat(20))), "{c}");
}

#[test]
fn pseudo_files_and_a_jobs_own_dev_shm_are_not_outside_files() {
    assert!(skipped("/proc/1/status", false));
    assert!(skipped("/dev/null", false));
    assert!(skipped("/tmp/x (deleted)", false));
    assert!(skipped("anon_inode:[eventfd]", false));
    assert!(!skipped("/dev/shm/seg", false));
    assert!(skipped("/dev/shm/seg", true));
    assert!(!skipped("/var/lib/data", true));
}

#[test]
fn times_read_as_rfc3339() {
    assert_eq!(
        when(1_700_000_000_123_456_789),
        "2023-11-14T22:13:20.123456789Z"
    );
}
