//! Benchmark workload: `bench_tree PROCS SIZE_MIB`, a process tree.
//!
//! The root forks PROCS-1 children (one flat level, so the tree has PROCS
//! processes). Every process maps SIZE_MIB MiB of anonymous private memory
//! and fills it with incompressible pseudo-random data of its own seed
//! (wyrand, seeded by its index), opens a file `f.INDEX` in the current
//! directory and writes one page to it (its offset is then 4096), and
//! shares a pipe with the others (inherited from the root). Once every
//! process is ready, the root prints `READY PID PID...` (root first) on
//! stdout. Then each waits, looking for a file named `go` in the current
//! directory every 5 ms; when it appears, each checks its memory against
//! its seed and its file's offset and prints one line, `OK INDEX` or
//! `FAIL INDEX why`, then sleeps until it is killed.
//!
//! cr-bench starts it with stdin on /dev/null and stdout/stderr on regular
//! files; all processes share the stdout file (one write per line).

use clap::builder::RangedU64ValueParser;
use clap::Parser;
use std::io::Write;
use std::process::exit;

const SEED: u64 = 0x5eed_0fc0_ffee;

/// Benchmark workload of cr-bench tree: PROCS processes of SIZE_MIB MiB of
/// written memory each; each checks itself once the file `go` appears.
#[derive(Parser)]
#[command(name = "bench_tree")]
struct Cli {
    /// Processes of the tree, the root included.
    #[arg(value_parser = RangedU64ValueParser::<usize>::new().range(1..=1024))]
    procs: usize,
    /// Memory of each process, in MiB.
    #[arg(value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    size_mib: usize,
}

#[inline(always)]
fn wyrand(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0xa076_1d64_78bd_642f);
    let t = u128::from(*state) * u128::from(*state ^ 0xe703_7ed1_a0b4_28db);
    ((t >> 64) as u64) ^ (t as u64)
}

fn seed(index: usize) -> u64 {
    SEED ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

fn main() {
    let Cli { procs, size_mib } = Cli::parse();
    // SAFETY: closes fds we never use; nothing in this process refers to them.
    unsafe {
        libc::close_range(3, libc::c_uint::MAX, 0);
    }
    let len = size_mib
        .checked_mul(1 << 20)
        .unwrap_or_else(|| fail(0, "size overflows usize"));
    let mut ready = [0i32; 2];
    // SAFETY: `ready` is a valid array of two ints.
    if unsafe { libc::pipe(ready.as_mut_ptr()) } != 0 {
        fail(0, "pipe");
    }
    let mut pids = vec![std::process::id() as i32];
    let mut index = 0;
    for i in 1..procs {
        // SAFETY: single-threaded process; the child only continues below.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            fail(0, "fork");
        }
        if pid == 0 {
            index = i;
            break;
        }
        pids.push(pid);
    }
    let mem = fill(index, len);
    let file = open_file(index);
    if index != 0 {
        // SAFETY: writes one byte from a valid buffer to our pipe.
        if unsafe { libc::write(ready[1], b"r".as_ptr().cast(), 1) } != 1 {
            fail(index, "cannot tell the root it is ready");
        }
    } else {
        let mut got = 0;
        let mut buf = [0u8; 64];
        while got < procs - 1 {
            // SAFETY: reads into a valid buffer of its length.
            let n = unsafe { libc::read(ready[0], buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                fail(0, "cannot learn that the children are ready");
            }
            got += n as usize;
        }
        let list: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
        say(&format!("READY {}\n", list.join(" ")));
    }
    wait_for_go();
    match check(index, mem, len, file) {
        Ok(()) => say(&format!("OK {index}\n")),
        Err(why) => say(&format!("FAIL {index} {why}\n")),
    }
    loop {
        sleep_ms(1000);
    }
}

/// `len` bytes of fresh memory written with the data of `index`. The
/// mapping is `index` pages longer than `len`: every process's has other
/// bounds: a restore before branch `tree2` took the children's mappings
/// (made after the fork, at the same address as the root's) for memory
/// shared copy-on-write with the root (`cr-engine` kinds/memory/cow.rs);
/// kept so that builds compare alike (see bench/README.md).
fn fill(index: usize, len: usize) -> &'static mut [u64] {
    // SAFETY: anonymous private mapping with no address hint.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len + index * 4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        fail(index, "mmap");
    }
    // SAFETY: the mapping is at least `len` bytes, readable and writable, page
    // aligned, ours alone and never unmapped.
    let words = unsafe { std::slice::from_raw_parts_mut(addr.cast::<u64>(), len / 8) };
    let mut st = seed(index);
    for w in words.iter_mut() {
        *w = wyrand(&mut st);
    }
    words
}

fn open_file(index: usize) -> i32 {
    let path = std::ffi::CString::new(format!("f.{index}")).expect("no NUL");
    // SAFETY: valid C string; the fd is ours.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
            0o600,
        )
    };
    let page = [index as u8; 4096];
    // SAFETY: writes a valid buffer of its length.
    if fd < 0 || unsafe { libc::write(fd, page.as_ptr().cast(), page.len()) } != 4096 {
        fail(index, "cannot write its file");
    }
    fd
}

fn wait_for_go() {
    while std::fs::metadata("go").is_err() {
        sleep_ms(5);
    }
}

fn check(index: usize, mem: &[u64], len: usize, file: i32) -> Result<(), String> {
    let mut st = seed(index);
    if let Some(at) = mem.iter().position(|&w| w != wyrand(&mut st)) {
        return Err(format!("memory differs at byte {} of {len}", at * 8));
    }
    // SAFETY: lseek on our own fd.
    let off = unsafe { libc::lseek(file, 0, libc::SEEK_CUR) };
    if off != 4096 {
        return Err(format!("file offset {off}, not 4096"));
    }
    Ok(())
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    if out
        .write_all(line.as_bytes())
        .and_then(|()| out.flush())
        .is_err()
    {
        exit(1);
    }
}

fn sleep_ms(ms: u64) {
    let ts = libc::timespec {
        tv_sec: (ms / 1000) as libc::time_t,
        tv_nsec: ((ms % 1000) * 1_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec; a null remainder pointer is allowed.
    unsafe {
        libc::nanosleep(&ts, std::ptr::null_mut());
    }
}

fn fail(index: usize, msg: &str) -> ! {
    eprintln!(
        "bench_tree {index}: {msg}: {}",
        std::io::Error::last_os_error()
    );
    exit(1);
}
