//! Workload: a process tree checked from inside after restore.
//!
//! The root starts a new session, maps shared anonymous memory, forks a
//! zombie (exits at once with status 7, not reaped until the end) and a
//! child A that leads its own process group and forks grandchild B. All
//! three count in their own slot of the shared memory while they wait for
//! `<workdir>/go`. Then the root writes a token into the shared memory;
//! A and B must see it and answer (proving the memory is still shared
//! between processes); everyone checks its session, group and counters,
//! A its parent-death signal;
//! the root reaps the zombie (status 7) and its child, and prints OK or
//! FAIL: reason.
//!
//! Usage: wl_tree WORKDIR

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const SLOTS: usize = 8;

struct Shared {
    counters: [AtomicU64; SLOTS],
    token: AtomicU64,
    answers: [AtomicU64; SLOTS],
}

fn say(s: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn wait_go(dir: &std::path::Path, sh: &Shared, slot: usize, private: &mut u64) {
    while !dir.join("go").exists() {
        sh.counters[slot].fetch_add(1, Ordering::SeqCst);
        *private += 1;
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What every process checks about itself after go; returns failures.
fn check_self(sh: &Shared, slot: usize, private: u64, sid: i32, pgid: i32) -> Vec<String> {
    let mut f = Vec::new();
    let c = sh.counters[slot].load(Ordering::SeqCst);
    if c != private {
        f.push(format!(
            "slot {slot}: shared counter {c} != private {private}"
        ));
    }
    // SAFETY: getsid/getpgid take integers only.
    let (s, g) = unsafe { (libc::getsid(0), libc::getpgid(0)) };
    if s != sid || g != pgid {
        f.push(format!(
            "slot {slot}: session/group {s}/{g}, expected {sid}/{pgid}"
        ));
    }
    f
}

/// Wait for the root's token and answer it.
fn answer(sh: &Shared, slot: usize) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let t = sh.token.load(Ordering::SeqCst);
        if t != 0 {
            sh.answers[slot].store(t + slot as u64, Ordering::SeqCst);
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

fn wait_status(pid: i32) -> i32 {
    let mut st = 0;
    // SAFETY: waitpid with a valid out pointer.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    st
}

fn main() {
    let dir = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: wl_tree WORKDIR"));
    // SAFETY: plain syscalls; the shared mapping lives for the whole process
    // and is only accessed through atomics.
    let (sh, sid) = unsafe {
        let sid = libc::setsid();
        assert!(sid > 0, "setsid failed");
        let p = libc::mmap(
            std::ptr::null_mut(),
            std::mem::size_of::<Shared>().max(1 << 20),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        (&*(p as *const Shared), sid)
    };
    // SAFETY: fork in a single-threaded program; the child only uses its
    // own copy of memory, the shared mapping, and exits with _exit.
    let zombie = unsafe { libc::fork() };
    if zombie == 0 {
        // SAFETY: _exit never returns.
        unsafe { libc::_exit(7) };
    }
    // SAFETY: as above.
    let a = unsafe { libc::fork() };
    if a == 0 {
        // SAFETY: plain syscalls.
        let pgid = unsafe {
            libc::setpgid(0, 0);
            libc::getpid()
        };
        // SAFETY: as above.
        let b = unsafe { libc::fork() };
        let (slot, mut private) = (if b == 0 { 2 } else { 1 }, 0u64);
        if slot == 1 {
            // SAFETY: prctl with integer arguments.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0) };
        }
        wait_go(&dir, sh, slot, &mut private);
        let mut fails = check_self(sh, slot, private, sid, pgid);
        if slot == 1 {
            let mut sig = 0i32;
            // SAFETY: prctl writes an int through the pointer.
            unsafe { libc::prctl(libc::PR_GET_PDEATHSIG, &mut sig as *mut i32, 0, 0, 0) };
            if sig != libc::SIGTERM {
                fails.push(format!("parent-death signal {sig}, expected SIGTERM"));
            }
        }
        if !answer(sh, slot) {
            fails.push(format!("slot {slot}: never saw the root's token"));
        }
        if b != 0 {
            let st = wait_status(b);
            if !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 0 {
                fails.push(format!("grandchild failed (status {st:#x})"));
            }
        }
        for f in &fails {
            eprintln!("FAIL: {f}");
        }
        // SAFETY: _exit never returns.
        unsafe { libc::_exit(if fails.is_empty() { 0 } else { 1 }) };
    }
    let mut private = 0u64;
    // Let the tree settle (the grandchild exists) before saying READY.
    while sh.counters[2].load(Ordering::SeqCst) == 0 || sh.counters[1].load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(5));
    }
    say("READY");
    wait_go(&dir, sh, 0, &mut private);
    let mut fails = check_self(sh, 0, private, sid, sid);
    let token = 1000 + private;
    sh.token.store(token, Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(20);
    for slot in [1usize, 2] {
        while sh.answers[slot].load(Ordering::SeqCst) != token + slot as u64
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        if sh.answers[slot].load(Ordering::SeqCst) != token + slot as u64 {
            fails.push(format!(
                "no answer from slot {slot} through the shared memory"
            ));
        }
    }
    let st = wait_status(a);
    if !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 0 {
        fails.push(format!("child A failed (status {st:#x})"));
    }
    let st = wait_status(zombie);
    if !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 7 {
        fails.push(format!(
            "zombie reaped with status {st:#x}, expected exit 7"
        ));
    }
    if fails.is_empty() {
        say("OK");
    } else {
        say(&format!("FAIL: {}", fails.join("; ")));
        std::process::exit(1);
    }
}
