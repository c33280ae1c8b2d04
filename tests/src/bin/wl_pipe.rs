//! wl_pipe WORKDIR MODE
//!
//! Holds one fd object and checks it after `go`. MODE `pipe`: both ends of a
//! pipe (some data in it); `socket`: a unix socketpair (data queued);
//! `eventfd`: an eventfd (read and written as a counter) — all three are
//! saved and restored. `netlink`: a netlink socket and `raw`: a raw IPv4
//! socket (ICMP) — both refused by the checkpointer, which must
//! name them and leave the process unharmed. Prints `READY fds A B`, waits
//! for `go`, then checks that the fds still work and prints OK or FAIL.

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
        // SAFETY: socket has no pointer arguments.
        "netlink" => unsafe {
            let fd = libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0);
            fds = [fd, fd];
            if fd < 0 {
                -1
            } else {
                0
            }
        },
        // SAFETY: socket has no pointer arguments.
        "raw" => unsafe {
            let fd = libc::socket(
                libc::AF_INET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::IPPROTO_ICMP,
            );
            fds = [fd, fd];
            if fd < 0 {
                -1
            } else {
                0
            }
        },
        other => wl::fail(&format!("unknown mode {other:?}")),
    };
    if r != 0 {
        wl::fail(&format!("{mode}: {}", std::io::Error::last_os_error()));
    }
    let (rd, wr) = (fds[0], fds[1]);
    if mode == "netlink" || mode == "raw" {
        wl::say(&format!("READY fds {rd}"));
        go.wait();
        let mut problems = Vec::new();
        let mut ty: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: the kernel writes at most len bytes into ty.
        let r = unsafe {
            libc::getsockopt(
                rd,
                libc::SOL_SOCKET,
                libc::SO_DOMAIN,
                (&mut ty as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        let want = if mode == "raw" {
            libc::AF_INET
        } else {
            libc::AF_NETLINK
        };
        if r != 0 || ty != want {
            problems.push(format!("{mode} socket fd {rd}: domain {ty} (r {r})"));
        }
        state.verify(&mut problems);
        wl::finish(&problems);
    }
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
