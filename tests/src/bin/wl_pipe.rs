//! wl_pipe WORKDIR MODE
//!
//! Holds one fd object and checks it after `go`. MODE `pipe`: both ends of a
//! pipe (some data in it); `socket`: a unix socketpair (data queued);
//! `eventfd`: an eventfd (read and written as a counter) — all three are
//! saved and restored. `io_uring`: an io_uring instance and `packet_ring`:
//! a packet socket with a frame queued in its transmit ring and not sent —
//! both refused by the checkpointer,
//! which must name them and leave the process unharmed. Prints `READY fds A B`, waits
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
        "io_uring" => {
            // struct io_uring_params: 120 bytes, zeroed but for what the
            // kernel fills in.
            let mut params = [0u8; 120];
            // SAFETY: params is the 120-byte struct io_uring_setup reads and writes.
            let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) }
                as i32;
            fds = [fd, fd];
            if fd < 0 {
                -1
            } else {
                0
            }
        }
        "packet_ring" => {
            // SAFETY: socket has no pointer arguments.
            let fd =
                unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
            // struct tpacket_req: block size, block count, frame size, frame count.
            let req: [u32; 4] = [4096, 1, 2048, 2];
            // SAFETY: req is the 16-byte struct tpacket_req PACKET_TX_RING reads.
            let r = unsafe { libc::setsockopt(fd, 263, 13, req.as_ptr().cast(), 16) };
            fds = [fd, fd];
            // Its first frame handed to the kernel (TP_STATUS_SEND_REQUEST)
            // and never sent (no send(2)): what a checkpoint cannot keep.
            // SAFETY: maps the 4096-byte ring of our own socket, nothing else.
            let ring = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if fd < 0 || r != 0 || ring == libc::MAP_FAILED {
                -1
            } else {
                // SAFETY: tp_status, the first word of the first frame header.
                unsafe { std::ptr::write_volatile(ring.cast::<libc::c_ulong>(), 1) };
                0
            }
        }
        other => wl::fail(&format!("unknown mode {other:?}")),
    };
    if r != 0 {
        wl::fail(&format!("{mode}: {}", std::io::Error::last_os_error()));
    }
    let (rd, wr) = (fds[0], fds[1]);
    if mode == "io_uring" || mode == "packet_ring" {
        wl::say(&format!("READY fds {rd}"));
        go.wait();
        let mut problems = Vec::new();
        // Still open and of the same kind.
        let link = std::fs::read_link(format!("/proc/self/fd/{rd}"))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        let want = if mode == "io_uring" {
            "anon_inode:[io_uring]"
        } else {
            "socket:["
        };
        if !link.starts_with(want) {
            problems.push(format!("{mode} fd {rd} is now {link:?}"));
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
