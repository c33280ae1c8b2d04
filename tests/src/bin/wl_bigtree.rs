//! Workload: a tree of many processes with private, shared and
//! copy-on-write memory and pipes between them, checked from inside after
//! a restore.
//!
//! The root maps shared anonymous memory (one slot of 512 words per
//! process, each filled by the root with its pattern) and 1 MiB of private
//! memory shared copy-on-write with its children, makes one pipe to each
//! child and one pipe from all children back, and forks PROCS-1 children.
//! Every process fills MIB MiB of private memory of its own (seeded by its
//! index) and writes the second half of its shared slot. The root then
//! writes a message into each child's pipe, which stays unread, and says
//! READY. Once `<workdir>/go` exists, every process checks all of the
//! shared memory (each slot as its owner wrote it), the copy-on-write
//! memory and its own private memory; each child reads its message from
//! its pipe and answers `ok INDEX` (or `fail INDEX why`) through the pipe
//! back; the root collects every answer, reaps its children and prints OK
//! or FAIL: reasons.
//!
//! Usage: wl_bigtree WORKDIR PROCS MIB

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const SLOT_WORDS: usize = 512;
const COW_BYTES: usize = 1 << 20;

fn say(s: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn wyrand(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0xa076_1d64_78bd_642f);
    let t = u128::from(*state) * u128::from(*state ^ 0xe703_7ed1_a0b4_28db);
    ((t >> 64) as u64) ^ (t as u64)
}

fn pattern(slot: usize, k: usize) -> u64 {
    ((slot as u64) << 32) ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// `len` bytes of anonymous memory (`shared` or private), as words.
fn map(len: usize, shared: bool) -> &'static mut [u64] {
    let kind = if shared {
        libc::MAP_SHARED
    } else {
        libc::MAP_PRIVATE
    };
    // SAFETY: a fresh anonymous mapping, never unmapped, used as words only.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            kind | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        std::slice::from_raw_parts_mut(p.cast::<u64>(), len / 8)
    }
}

fn fill_private(index: usize, words: &mut [u64]) {
    let mut st = 0x5eed ^ index as u64;
    for w in words.iter_mut() {
        *w = wyrand(&mut st);
    }
}

fn check_private(index: usize, words: &[u64]) -> Option<String> {
    let mut st = 0x5eed ^ index as u64;
    let at = words.iter().position(|&w| w != wyrand(&mut st))?;
    Some(format!(
        "process {index}: private memory differs at word {at}"
    ))
}

/// Every slot: first half the root's pattern, second half its owner's.
fn check_shared(index: usize, shared: &[AtomicU64], procs: usize) -> Vec<String> {
    let mut f = Vec::new();
    for slot in 0..procs {
        for k in 0..SLOT_WORDS {
            let want = if k < SLOT_WORDS / 2 {
                pattern(slot, k)
            } else {
                !pattern(slot, k)
            };
            let got = shared[slot * SLOT_WORDS + k].load(Ordering::SeqCst);
            if got != want {
                f.push(format!(
                    "process {index}: shared slot {slot} word {k} is {got:#x}"
                ));
                break;
            }
        }
    }
    f
}

fn check_cow(index: usize, cow: &[u64]) -> Option<String> {
    let at = cow
        .iter()
        .enumerate()
        .position(|(k, &w)| w != pattern(1 << 20, k))?;
    Some(format!(
        "process {index}: copy-on-write memory differs at word {at}"
    ))
}

fn write_all(fd: i32, b: &[u8]) -> bool {
    // SAFETY: writes a valid buffer of its length.
    unsafe { libc::write(fd, b.as_ptr().cast(), b.len()) == b.len() as isize }
}

fn message(index: usize) -> String {
    format!("to {index}: {}\n", "x".repeat(index * 7 % 100))
}

fn wait_go(dir: &std::path::Path) {
    while !dir.join("go").exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Read until `want` bytes or end of file.
fn read_exact(fd: i32, want: usize) -> Vec<u8> {
    let mut got = vec![0u8; want];
    let mut n = 0;
    while n < want {
        // SAFETY: reads into the unfilled rest of `got`.
        let r = unsafe { libc::read(fd, got[n..].as_mut_ptr().cast(), want - n) };
        if r <= 0 {
            break;
        }
        n += r as usize;
    }
    got.truncate(n);
    got
}

fn child(
    dir: &std::path::Path,
    index: usize,
    procs: usize,
    len: usize,
    from_root: i32,
    back: i32,
) -> ! {
    let shared = SHARED.get().expect("mapped");
    let private = map(len, false);
    fill_private(index, private);
    for k in SLOT_WORDS / 2..SLOT_WORDS {
        shared[index * SLOT_WORDS + k].store(!pattern(index, k), Ordering::SeqCst);
    }
    write_all(back, b"r");
    wait_go(dir);
    let mut fails = check_shared(index, shared, procs);
    fails.extend(check_private(index, private));
    fails.extend(check_cow(index, COW.get().expect("mapped")));
    let want = message(index);
    let got = read_exact(from_root, want.len());
    if got != want.as_bytes() {
        fails.push(format!(
            "process {index}: pipe gave {:?}",
            String::from_utf8_lossy(&got)
        ));
    }
    let line = if fails.is_empty() {
        format!("ok {index}\n")
    } else {
        format!("fail {index} {}\n", fails.join("; "))
    };
    write_all(back, line.as_bytes());
    // SAFETY: _exit never returns.
    unsafe { libc::_exit(if fails.is_empty() { 0 } else { 1 }) }
}

static SHARED: std::sync::OnceLock<&'static [AtomicU64]> = std::sync::OnceLock::new();
static COW: std::sync::OnceLock<&'static [u64]> = std::sync::OnceLock::new();

fn main() {
    let mut args = std::env::args().skip(1);
    let usage = "usage: wl_bigtree WORKDIR PROCS MIB";
    let dir = std::path::PathBuf::from(args.next().expect(usage));
    let procs: usize = args.next().and_then(|a| a.parse().ok()).expect(usage);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).expect(usage);
    let len = mib << 20;
    let words = map(procs * SLOT_WORDS * 8, true);
    // SAFETY: AtomicU64 has the size and alignment of u64; the shared
    // memory is only ever used through atomics from here on.
    let shared: &'static [AtomicU64] = unsafe { &*(words as *mut [u64] as *const [AtomicU64]) };
    for slot in 0..procs {
        for k in 0..SLOT_WORDS / 2 {
            shared[slot * SLOT_WORDS + k].store(pattern(slot, k), Ordering::SeqCst);
        }
    }
    let cow = map(COW_BYTES, false);
    for (k, w) in cow.iter_mut().enumerate() {
        *w = pattern(1 << 20, k);
    }
    let _ = SHARED.set(shared);
    let _ = COW.set(cow);
    let mut back = [0i32; 2];
    // SAFETY: valid array of two ints.
    assert_eq!(unsafe { libc::pipe(back.as_mut_ptr()) }, 0, "pipe");
    let mut to = Vec::new();
    for _ in 1..procs {
        let mut p = [0i32; 2];
        // SAFETY: valid array of two ints.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0, "pipe");
        to.push(p);
    }
    let mut kids = Vec::new();
    for index in 1..procs {
        // SAFETY: single-threaded; the child runs `child` and _exits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            for (j, p) in to.iter().enumerate() {
                // SAFETY: closes pipe ends this child does not use.
                unsafe {
                    libc::close(p[1]);
                    if j + 1 != index {
                        libc::close(p[0]);
                    }
                }
            }
            // SAFETY: as above.
            unsafe { libc::close(back[0]) };
            child(&dir, index, procs, len, to[index - 1][0], back[1]);
        }
        kids.push(pid);
    }
    // SAFETY: the root keeps the write ends to its children and the read
    // end back.
    unsafe {
        libc::close(back[1]);
        for p in &to {
            libc::close(p[0]);
        }
    }
    let private = map(len, false);
    fill_private(0, private);
    for (k, w) in shared[..SLOT_WORDS].iter().enumerate().skip(SLOT_WORDS / 2) {
        w.store(!pattern(0, k), Ordering::SeqCst);
    }
    let ready = read_exact(back[0], procs - 1);
    assert_eq!(ready.len(), procs - 1, "children ready");
    for (j, p) in to.iter().enumerate() {
        assert!(write_all(p[1], message(j + 1).as_bytes()), "message");
    }
    say("READY");
    wait_go(&dir);
    let mut fails = check_shared(0, shared, procs);
    fails.extend(check_private(0, private));
    fails.extend(check_cow(0, cow));
    // Every child's answer, each a line.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut text = String::new();
    while text.lines().count() < procs - 1 && Instant::now() < deadline {
        let mut buf = [0u8; 4096];
        // SAFETY: reads into a valid buffer.
        let r = unsafe { libc::read(back[0], buf.as_mut_ptr().cast(), buf.len()) };
        if r <= 0 {
            break;
        }
        text.push_str(&String::from_utf8_lossy(&buf[..r as usize]));
    }
    let oks = text.lines().filter(|l| l.starts_with("ok ")).count();
    fails.extend(
        text.lines()
            .filter(|l| !l.starts_with("ok "))
            .map(str::to_string),
    );
    if oks != procs - 1 {
        fails.push(format!("{oks} of {} children answered ok", procs - 1));
    }
    for pid in kids {
        let mut st = 0;
        // SAFETY: waitpid of our own child with a valid out pointer.
        unsafe { libc::waitpid(pid, &mut st, 0) };
        if !libc::WIFEXITED(st) || libc::WEXITSTATUS(st) != 0 {
            fails.push(format!("child {pid} ended with status {st:#x}"));
        }
    }
    if fails.is_empty() {
        say("OK");
    } else {
        say(&format!("FAIL: {}", fails.join("; ")));
        std::process::exit(1);
    }
}
