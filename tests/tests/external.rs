//! Fds leading outside the tree (here a pipe whose other end the test
//! holds): the checkpoint records them as external, and the restore binds
//! them to what the user names (`--inherit-fd FD=PATH|fd:M`, by number or
//! by what they led to), to /dev/null with `--external-to-null`, or is
//! refused, naming the fd, when one is left unbound. The workload writes to
//! the fd after restore and checks what it got.

use cr_tests::*;
use std::ffi::OsStr;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Writes `before` to fd 5, then after `go` writes `after` to it and
/// checks it is open for writing.
const SCRIPT: &str = "import os, sys, time, fcntl
os.write(5, b'before\\n')
print('READY', flush=True)
while not os.path.exists(os.path.join(sys.argv[1], 'go')):
    time.sleep(0.02)
mode = fcntl.fcntl(5, fcntl.F_GETFL) & os.O_ACCMODE
if mode != os.O_WRONLY:
    print('FAIL fd 5 access mode', mode, flush=True); sys.exit(1)
if os.write(5, b'after\\n') != 6:
    print('FAIL short write', flush=True); sys.exit(1)
print('OK', flush=True)
";

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two new fds into the array; we own them.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both fds were just created and are owned by nothing else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// The workload with fd 5 the write end of a pipe whose read end we keep,
/// checkpointed with --kill; returns it, the image, and our read end.
fn killed_with_outside_pipe(h: &Harness) -> (Workload, std::path::PathBuf, std::fs::File) {
    let (r, w) = pipe();
    let mut wl = h.spawn_program_fds(
        "external",
        Path::new("/usr/bin/env"),
        &["python3", "-c", SCRIPT].map(OsStr::new),
        &[],
        &[(w.as_raw_fd(), 5)],
    );
    drop(w);
    wl.wait_ready();
    let mut r = std::fs::File::from(r);
    let mut got = [0u8; 7];
    r.read_exact(&mut got).expect("read before");
    assert_eq!(&got, b"before\n");
    let img = h.image_dir("img");
    checkpoint_kill(h, &mut wl, &img);
    (wl, img, r)
}

#[test]
fn unbound_external_fd_is_refused_then_bound_to_a_path() {
    let h = Harness::new("external-path");
    let (wl, img, pipe_r) = killed_with_outside_pipe(&h);
    let pid = wl.pid();
    let out = h.restore_sync(&img, pid);
    let key = format!("pipe:[{}]", pipe_r.metadata().expect("fstat").ino());
    out.assert_error(
        "restore with fd 5 unbound",
        "cr_restart: error: ",
        &["fd 5", &key, "--inherit-fd"],
    );
    assert_no_restored(pid, &wl.exe, "after a refused restore");

    let log = h.dir.join("bound.log");
    let arg = format!("--inherit-fd=5={}", log.display());
    let mut r = h.restore_bg_args(&img, pid, &[OsStr::new(&arg)]);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restore with fd 5 bound to a file");
    assert_eq!(
        read_text(&log),
        "after\n",
        "what the restored process wrote to fd 5"
    );
}

#[test]
fn external_fd_bound_by_key_to_an_fd_of_cr_restart() {
    let h = Harness::new("external-fd");
    let (wl, img, pipe_r) = killed_with_outside_pipe(&h);
    let pid = wl.pid();
    let key = format!("pipe:[{}]", pipe_r.metadata().expect("fstat").ino());
    let (r2, w2) = pipe();
    let arg = format!("--inherit-fd={key}=fd:7");
    let run = RunOpts {
        fds: vec![(w2.as_raw_fd(), 7)],
        ..Default::default()
    };
    let mut r = h.restore_bg_with(&img, pid, &[OsStr::new(&arg)], &run);
    drop(w2);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(
        &out,
        &wl,
        "restore with the pipe bound to cr_restart's fd 7",
    );
    let mut got = String::new();
    std::fs::File::from(r2)
        .read_to_string(&mut got)
        .expect("read the new pipe");
    assert_eq!(
        got, "after\n",
        "what the restored process wrote through fd 7"
    );
}

#[test]
fn external_fd_to_null_and_a_binding_that_binds_nothing() {
    let h = Harness::new("external-null");
    let (wl, img, _pipe_r) = killed_with_outside_pipe(&h);
    let pid = wl.pid();
    let out = h
        .restore_bg_args(&img, pid, &[OsStr::new("--inherit-fd=9=/dev/null")])
        .wait_plain(TOOL_TIMEOUT);
    out.assert_error(
        "an --inherit-fd that binds no fd of the image",
        "cr_restart: error: ",
        &["--inherit-fd 9=/dev/null", "fd 9"],
    );
    assert_no_restored(pid, &wl.exe, "after a refused restore");
    let mut r = h.restore_bg_args(&img, pid, &[OsStr::new("--external-to-null")]);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restore with --external-to-null");
}
