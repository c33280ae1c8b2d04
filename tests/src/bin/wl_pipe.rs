//! wl_pipe WORKDIR MODE
//!
//! Holds an fd of a kind the checkpointer refuses, so that cr_checkpoint must fail
//! and name it. MODE `pipe`: both ends of a pipe (some data in it); MODE `socket`:
//! a unix socketpair; MODE `eventfd`: an eventfd (read and written as a
//! counter). Prints `READY fds A B`, waits for `go`, then checks that the fds
//! still work (the failed checkpoint did not harm them) and prints OK or FAIL.

use cr_tests::wl;

fn main() {
    let args = wl::args("wl_pipe WORKDIR pipe|socket|eventfd");
    let mode = args.rest.first().cloned().unwrap_or_default();
    let state = wl::ProcState::setup(&args.workdir);
    let go = wl::Go::new(&args.workdir);
    let mut fds = [0i32; 2];
    let r = match mode.as_str() {
        // SAFETY: fds has room for two ints.
        "pipe" => unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) },
        // SAFETY: fds has room for two ints.
        "socket" => unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                fds.as_mut_ptr(),
            )
        },
        "eventfd" => {
            // SAFETY: eventfd has no pointer arguments.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            fds = [fd, fd];
            if fd < 0 {
                -1
            } else {
                0
            }
        }
        other => wl::fail(&format!("unknown mode {other:?}")),
    };
    if r != 0 {
        wl::fail(&format!("{mode}: {}", std::io::Error::last_os_error()));
    }
    let (rd, wr) = (fds[0], fds[1]);
    if mode == "eventfd" {
        if let Err(e) = wl::write_all_fd(wr, &5u64.to_ne_bytes()) {
            wl::fail(&e);
        }
        wl::say(&format!("READY fds {rd}"));
        go.wait();
        let mut problems = Vec::new();
        if let Err(e) = wl::write_all_fd(wr, &7u64.to_ne_bytes()) {
            problems.push(e);
        }
        let mut v = [0u8; 8];
        // SAFETY: v has 8 writable bytes.
        let n = unsafe { libc::read(rd, v.as_mut_ptr().cast(), 8) };
        if n != 8 || u64::from_ne_bytes(v) != 12 {
            problems.push(format!(
                "eventfd read {n} bytes, value {}",
                u64::from_ne_bytes(v)
            ));
        }
        state.verify(&mut problems);
        wl::finish(&problems);
    }
    if let Err(e) = wl::write_all_fd(wr, b"before") {
        wl::fail(&e);
    }
    wl::say(&format!("READY fds {rd} {wr}"));
    go.wait();

    let mut problems = Vec::new();
    if let Err(e) = wl::write_all_fd(wr, b"+after") {
        problems.push(e);
    }
    let mut buf = [0u8; 64];
    // SAFETY: buf has 64 writable bytes.
    let n = unsafe { libc::read(rd, buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        problems.push(format!("read: {}", std::io::Error::last_os_error()));
    } else if &buf[..n as usize] != b"before+after" {
        problems.push(format!(
            "{mode} holds {:?}, expected \"before+after\"",
            String::from_utf8_lossy(&buf[..n as usize])
        ));
    }
    state.verify(&mut problems);
    wl::finish(&problems);
}
