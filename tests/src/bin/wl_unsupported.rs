//! wl_unsupported WORKDIR tty|thread|child
//!
//! A process with a pseudo-terminal master, a second thread or a child (once
//! refused by the checkpointer, now all saved; the only workload with a tty, a
//! second thread or a child, on purpose): `tty` holds a pseudo-terminal master
//! (prints `READY fds N`); `thread` runs a second thread (`READY tid N`);
//! `child` has a child process (`READY child N`). All wait for `go`, then check
//! that the tty / thread / child still work and print OK or FAIL.

use cr_tests::wl;

fn main() {
    let args = wl::args("wl_unsupported WORKDIR tty|thread|child");
    let mode = args.rest.first().cloned().unwrap_or_default();
    let state = wl::ProcState::setup(&args.workdir);
    let go = wl::Go::new(&args.workdir);
    let mut problems = Vec::new();
    match mode.as_str() {
        "tty" => {
            // SAFETY: posix_openpt has no pointer arguments.
            let fd = unsafe { libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC) };
            if fd < 0 {
                wl::fail(&format!(
                    "posix_openpt: {}",
                    std::io::Error::last_os_error()
                ));
            }
            wl::say(&format!("READY fds {fd}"));
            go.wait();
            // SAFETY: fd is ours; isatty only queries.
            if unsafe { libc::isatty(fd) } != 1 {
                // A pty master is not a tty for isatty on Linux: check it is open.
                // SAFETY: as above.
                if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                    problems.push(format!("pty master fd {fd} is gone"));
                }
            }
        }
        "thread" => {
            let workdir = args.workdir.clone();
            let t = std::thread::spawn(move || {
                let go = wl::Go::new(&workdir);
                go.wait();
                7u32
            });
            // SAFETY: gettid has no preconditions.
            let tid = unsafe { libc::syscall(libc::SYS_gettid) };
            wl::say(&format!("READY tid {tid}"));
            go.wait();
            match t.join() {
                Ok(7) => {}
                other => problems.push(format!("thread ended with {other:?}")),
            }
        }
        "child" => {
            // SAFETY: the child only makes raw syscalls and exits with _exit.
            let child = unsafe { libc::fork() };
            if child < 0 {
                wl::fail("fork");
            }
            if child == 0 {
                // SAFETY: prctl/getppid/access/nanosleep/_exit are async-signal-safe.
                unsafe {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    let path = std::ffi::CString::new(
                        args.workdir.join("go").as_os_str().as_encoded_bytes(),
                    )
                    .unwrap_or_default();
                    for _ in 0..12_000 {
                        if libc::access(path.as_ptr(), libc::F_OK) == 0 {
                            libc::_exit(5);
                        }
                        let ts = libc::timespec {
                            tv_sec: 0,
                            tv_nsec: 20_000_000,
                        };
                        libc::nanosleep(&ts, std::ptr::null_mut());
                    }
                    libc::_exit(6);
                }
            }
            wl::say(&format!("READY child {child}"));
            go.wait();
            let mut st = 0;
            // SAFETY: waiting for our own child.
            let r = unsafe { libc::waitpid(child, &mut st, 0) };
            if r != child || !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 5 {
                problems.push(format!("child {child}: waitpid {r}, status {st:#x}"));
            }
        }
        other => wl::fail(&format!("unknown mode {other:?}")),
    }
    state.verify(&mut problems);
    wl::finish(&problems);
}
