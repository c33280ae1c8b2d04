//! Benchmark workload: `bench_mem SIZE_MIB [SEED]`.
//!
//! Maps SIZE_MIB MiB of anonymous private memory, fills every byte with
//! incompressible pseudo-random data (wyrand), prints
//! `READY <addr_hex> <len>` on stdout and then sleeps forever, one second at a
//! time, so that it can be checkpointed and restored.
//!
//! The process stays single-threaded (no threads are ever spawned). cr-bench
//! starts it with stdin on /dev/null and stdout/stderr on regular files.

use clap::builder::RangedU64ValueParser;
use clap::Parser;
use std::io::Write;
use std::process::exit;

/// Seed of the data when none is given.
const DEFAULT_SEED: u64 = 0x5eed_0fc0_ffee;

/// Benchmark workload of cr-bench: fills SIZE_MIB MiB of anonymous memory
/// with incompressible pseudo-random data, prints `READY <addr_hex> <len>`,
/// then sleeps until it is killed.
#[derive(Parser)]
#[command(name = "bench_mem")]
struct Cli {
    /// Size of the workload's memory, in MiB.
    #[arg(value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    size_mib: usize,
    /// Seed of the pseudo-random data.
    #[arg(default_value_t = DEFAULT_SEED)]
    seed: u64,
}

/// wyrand: 64-bit output per step, passes BigCrush, ~1 ns per u64.
#[inline(always)]
fn wyrand(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0xa076_1d64_78bd_642f);
    let t = u128::from(*state) * u128::from(*state ^ 0xe703_7ed1_a0b4_28db);
    ((t >> 64) as u64) ^ (t as u64)
}

fn main() {
    let Cli { size_mib, seed } = Cli::parse();
    // Keep only stdin/stdout/stderr: descriptors inherited from whoever
    // started us (pipes of a shell or CI runner) are not part of the workload.
    // SAFETY: closes fds we never use; nothing in this process refers to them.
    unsafe {
        libc::close_range(3, libc::c_uint::MAX, 0);
    }
    let len = size_mib
        .checked_mul(1 << 20)
        .unwrap_or_else(|| fail("size overflows usize"));

    // SAFETY: anonymous private mapping with no address hint; the kernel picks
    // a free range, nothing existing is replaced.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        fail(&format!(
            "mmap {len} bytes: {}",
            std::io::Error::last_os_error()
        ));
    }

    // SAFETY: the mapping is `len` bytes, readable and writable, page aligned
    // (so u64 aligned), zero-initialised by the kernel, and exclusively ours.
    let words = unsafe { std::slice::from_raw_parts_mut(addr.cast::<u64>(), len / 8) };
    let mut state = seed;
    for w in words.iter_mut() {
        *w = wyrand(&mut state);
    }

    let mut out = std::io::stdout().lock();
    if writeln!(out, "READY {:x} {}", addr as usize, len)
        .and_then(|()| out.flush())
        .is_err()
    {
        fail("cannot write READY line");
    }
    drop(out);

    let ts = libc::timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    loop {
        // SAFETY: `ts` is a valid timespec; a null remainder pointer is allowed.
        unsafe {
            libc::nanosleep(&ts, std::ptr::null_mut());
        }
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("bench_mem: {msg}");
    exit(1);
}
