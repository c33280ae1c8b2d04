//! wl_progress ROUNDS [WORKERS] [SLEEP_MS]
//!
//! A multi-process job that makes progress and checks itself, for batch
//! jobs that are checkpointed, killed and resumed (tests/tests/slurm.rs).
//! Prints `start PID` once when it starts from the beginning, then forks
//! WORKERS (default 2) children, each joined to it by two pipes. Each round
//! R (1..=ROUNDS) it sends R to every worker; a worker folds R into its
//! running hash (kept in its own memory) and answers it; the parent folds R
//! into its model of every worker's hash and compares. Every round it
//! prints `progress R` and sleeps SLEEP_MS (default 50). After the last
//! round every worker is told to exit (status 0 expected) and the parent
//! prints `OK`, or `FAIL: reason` at the first mismatch (exit 1).
//!
//! A job restored from a checkpoint goes on from the round it was at: its
//! output has one `start` line and `progress` numbers that never go back.

use cr_tests::wl;

fn fold(h: u64, r: u64, w: u64) -> u64 {
    wl::mix64(h ^ r.wrapping_mul(0x9e37) ^ w)
}

fn read_u64(fd: i32) -> Option<u64> {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        match nix_read(fd, &mut b[got..]) {
            0 => return None,
            n => got += n,
        }
    }
    Some(u64::from_le_bytes(b))
}

fn nix_read(fd: i32, buf: &mut [u8]) -> usize {
    loop {
        // SAFETY: buf is a valid writable buffer of buf.len() bytes.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            return n as usize;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            wl::fail(&format!("read fd {fd}: {}", wl::errno_str()));
        }
    }
}

fn send(fd: i32, v: u64) {
    if let Err(e) = wl::write_all_fd(fd, &v.to_le_bytes()) {
        wl::fail(&format!("write fd {fd}: {e}"));
    }
}

fn pipe() -> (i32, i32) {
    let mut p = [0i32; 2];
    // SAFETY: p has room for the two fds.
    wl::check(unsafe { libc::pipe(p.as_mut_ptr()) }, "pipe");
    (p[0], p[1])
}

/// A worker: answers each round with its hash; 0 means exit.
fn worker(w: u64, rx: i32, tx: i32) -> ! {
    let mut h = w;
    loop {
        match read_u64(rx) {
            None => wl::fail(&format!("worker {w}: the parent's pipe closed")),
            Some(0) => std::process::exit(0),
            Some(r) => {
                h = fold(h, r, w);
                send(tx, h);
            }
        }
    }
}

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize, d: u64| -> u64 {
        a.get(i)
            .map(|s| {
                s.parse()
                    .unwrap_or_else(|_| wl::fail(&format!("bad number {s:?}")))
            })
            .unwrap_or(d)
    };
    if a.is_empty() {
        wl::fail("usage: wl_progress ROUNDS [WORKERS] [SLEEP_MS]");
    }
    let (rounds, workers, sleep_ms) = (num(0, 0), num(1, 2), num(2, 50));
    // SAFETY: getpid has no preconditions.
    wl::say(&format!("start {}", unsafe { libc::getpid() }));
    let mut kids = Vec::new();
    for w in 1..=workers {
        let (to_rx, to_tx) = pipe();
        let (from_rx, from_tx) = pipe();
        // SAFETY: single-threaded; the child only reads, writes and exits.
        let pid = wl::check(unsafe { libc::fork() }, "fork");
        if pid == 0 {
            // SAFETY: closing the parent's ends in the child.
            unsafe {
                libc::close(to_tx);
                libc::close(from_rx);
            }
            worker(w, to_rx, from_tx);
        }
        // SAFETY: closing the child's ends in the parent.
        unsafe {
            libc::close(to_rx);
            libc::close(from_tx);
        }
        kids.push((w, pid, to_tx, from_rx, w));
    }
    for r in 1..=rounds {
        for k in kids.iter_mut() {
            send(k.2, r);
            k.4 = fold(k.4, r, k.0);
            match read_u64(k.3) {
                Some(h) if h == k.4 => {}
                Some(h) => wl::fail(&format!(
                    "round {r}: worker {} answered {h:#x}, expected {:#x}",
                    k.0, k.4
                )),
                None => wl::fail(&format!("round {r}: worker {} is gone", k.0)),
            }
        }
        wl::say(&format!("progress {r}"));
        wl::sleep_ms(sleep_ms);
    }
    for k in &kids {
        send(k.2, 0);
        let mut st = 0;
        // SAFETY: st is a valid int; k.1 is our child.
        wl::check(unsafe { libc::waitpid(k.1, &mut st, 0) }, "waitpid");
        if !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 0 {
            wl::fail(&format!("worker {} ended with status {st:#x}", k.0));
        }
    }
    wl::ok();
}
