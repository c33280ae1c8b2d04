//! Benchmark workload of `cr-bench incr`: `bench_dirty SIZE_MIB [SEED]`.
//!
//! Maps SIZE_MIB MiB of anonymous private memory and fills every page with
//! its own pseudo-random data (no two pages alike, none zero: neither dedup
//! nor zero-page elision helps, and it does not compress). It keeps a
//! version number per page (a `u32` array on the heap): word 0 of page `p`
//! is [`mark`]`(seed, p, version[p])`, words 1..511 are the page's fixed
//! stream [`fill_page`]. Prints `READY addr=HEX len=N pages=N fill_s=SECS`.
//!
//! Commands come one at a time in the file `cmd` of the working directory
//! (cr-bench writes `cmd.tmp` and renames it; the workload reads and
//! deletes it, then answers on stdout with the command's id). It looks for
//! the file every millisecond. A command is one line, `ID VERB ARGS`:
//!
//! - `ID dirty PPM RSEED`: writes word 0 of PPM parts per million of the
//!   pages (distinct pages, chosen with a PRNG seeded by RSEED), bumping
//!   their versions. Answers `DONE ID pages=K secs=S`.
//! - `ID verify WRITES`: checks every word of every page against the model,
//!   and that the versions add up to WRITES (the pages cr-bench asked to
//!   write) plus the pages the background writer wrote. Answers
//!   `OK ID pages=N writes=W bg=B secs=S` or `FAIL ID ...`.
//! - `ID rate PAGES_PER_S`: background writer: from now on, between two
//!   looks at `cmd`, it writes random pages at that steady rate (0 stops
//!   it; time spent frozen is not caught up). Answers `RATE ID bg=B`, B the
//!   pages it wrote so far.
//! - `ID exit`: exits 0 (answers `BYE ID`).
//!
//! The process stays single-threaded. It exits by itself after an hour
//! without a command. cr-bench starts it with stdin on /dev/null and
//! stdout/stderr on regular files; a restored copy answers on the same
//! files (command ids are never reused, so old lines cannot be mistaken
//! for an answer).

use clap::builder::RangedU64ValueParser;
use clap::Parser;
use std::io::Write;
use std::process::exit;
use std::time::{Duration, Instant};

const PAGE: usize = 4096;
const WORDS: usize = PAGE / 8;
const IDLE_EXIT: Duration = Duration::from_secs(3600);
/// Seed of the pages when none is given.
const DEFAULT_SEED: u64 = 0x00d1_27c0_ffee;

/// Benchmark workload of `cr-bench incr`: SIZE_MIB MiB of pages of their own
/// pseudo-random data that it dirties and checks on command (commands in the
/// file `cmd` of the working directory, answers on stdout).
#[derive(Parser)]
#[command(name = "bench_dirty")]
struct Cli {
    /// Size of the workload's memory, in MiB.
    #[arg(value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    size_mib: usize,
    /// Seed of the pages' pseudo-random data.
    #[arg(default_value_t = DEFAULT_SEED)]
    seed: u64,
}

/// wyrand: 64-bit output per step, ~1 ns per u64.
#[inline(always)]
fn wyrand(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0xa076_1d64_78bd_642f);
    let t = u128::from(*state) * u128::from(*state ^ 0xe703_7ed1_a0b4_28db);
    ((t >> 64) as u64) ^ (t as u64)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Word 0 of page `p` at version `v`.
#[inline(always)]
fn mark(seed: u64, p: usize, v: u32) -> u64 {
    splitmix(splitmix(seed ^ 0x6d61_726b) ^ ((p as u64) << 24) ^ u64::from(v))
}

/// The PRNG state that words 1..511 of page `p` come from.
#[inline(always)]
fn page_state(seed: u64, p: usize) -> u64 {
    splitmix(seed ^ (p as u64).wrapping_mul(0xD1B5_4A32_D192_ED03))
}

fn fill_page(seed: u64, p: usize, page: &mut [u64]) {
    let mut st = page_state(seed, p);
    page[0] = mark(seed, p, 0);
    for w in &mut page[1..] {
        *w = wyrand(&mut st);
    }
}

/// Number of the first bad word of page `p`, if any.
fn check_page(seed: u64, p: usize, v: u32, page: &[u64]) -> Option<usize> {
    if page[0] != mark(seed, p, v) {
        return Some(0);
    }
    let mut st = page_state(seed, p);
    page[1..]
        .iter()
        .position(|&w| w != wyrand(&mut st))
        .map(|i| i + 1)
}

fn say(line: &str) {
    let mut o = std::io::stdout().lock();
    if o.write_all(line.as_bytes())
        .and_then(|_| o.write_all(b"\n"))
        .and_then(|_| o.flush())
        .is_err()
    {
        exit(1);
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("bench_dirty: {msg}");
    say(&format!("FAIL - {msg}"));
    exit(1);
}

struct Work {
    seed: u64,
    /// The pages, as words.
    mem: &'static mut [u64],
    pages: usize,
    /// Version of every page (how many times word 0 was rewritten).
    versions: Vec<u32>,
    /// Pages written by the background writer, and its PRNG.
    bg_written: u64,
    bg_rng: u64,
    /// Background rate (pages per second) and fractional pages owed.
    bg_rate: f64,
    bg_owed: f64,
    bg_last: Instant,
}

impl Work {
    #[inline(always)]
    fn write(&mut self, p: usize) {
        self.versions[p] = self.versions[p].wrapping_add(1);
        let v = self.versions[p];
        // A volatile store, so that the write is never elided or merged.
        // SAFETY: p < pages, so the word is inside the mapping we own.
        unsafe { std::ptr::write_volatile(&mut self.mem[p * WORDS], mark(self.seed, p, v)) };
    }

    /// `dirty PPM RSEED`: returns the number of pages written.
    fn dirty(&mut self, ppm: u64, rseed: u64) -> usize {
        let k =
            ((self.pages as u128 * u128::from(ppm.min(1_000_000)) + 500_000) / 1_000_000) as usize;
        let mut seen = vec![0u64; self.pages.div_ceil(64)];
        let mut rng = splitmix(rseed ^ 0x6469_7274);
        let mut done = 0;
        if k * 2 > self.pages {
            // Many pages: a pass in order, each page with probability k/n.
            let mut left = self.pages;
            let mut want = k;
            for p in 0..self.pages {
                if want == 0 {
                    break;
                }
                if (wyrand(&mut rng) % left as u64) < want as u64 {
                    self.write(p);
                    want -= 1;
                    done += 1;
                }
                left -= 1;
            }
            return done;
        }
        while done < k {
            let p = (wyrand(&mut rng) % self.pages as u64) as usize;
            if seen[p / 64] & (1 << (p % 64)) != 0 {
                continue;
            }
            seen[p / 64] |= 1 << (p % 64);
            self.write(p);
            done += 1;
        }
        done
    }

    /// `verify WRITES`: Ok(summary) or Err(problem).
    fn verify(&self, writes: u64) -> Result<String, String> {
        let mut bad = 0usize;
        let mut first = None;
        let mut sum = 0u64;
        for p in 0..self.pages {
            let v = self.versions[p];
            sum += u64::from(v);
            if let Some(w) = check_page(self.seed, p, v, &self.mem[p * WORDS..(p + 1) * WORDS]) {
                bad += 1;
                first.get_or_insert((p, w));
            }
        }
        let expected = writes + self.bg_written;
        if bad > 0 {
            let (p, w) = first.unwrap_or_default();
            let addr = self.mem.as_ptr() as usize + p * PAGE + w * 8;
            return Err(format!(
                "{bad} of {} pages differ from the model; first: page {p} (version {}) word {w} at 0x{addr:x}",
                self.pages, self.versions[p]
            ));
        }
        if sum != expected {
            return Err(format!(
                "the page versions add up to {sum} writes, expected {expected} ({writes} asked \
                 for + {} by the background writer)",
                self.bg_written
            ));
        }
        Ok(format!(
            "pages={} writes={writes} bg={}",
            self.pages, self.bg_written
        ))
    }

    /// The background writer's share since its last turn.
    fn background(&mut self) {
        if self.bg_rate <= 0.0 {
            return;
        }
        let now = Instant::now();
        // Time frozen (or a late wake-up) is not caught up: at most 10 ms.
        let dt = (now - self.bg_last).as_secs_f64().min(0.010);
        self.bg_last = now;
        self.bg_owed += self.bg_rate * dt;
        while self.bg_owed >= 1.0 {
            self.bg_owed -= 1.0;
            let p = (wyrand(&mut self.bg_rng) % self.pages as u64) as usize;
            self.write(p);
            self.bg_written += 1;
        }
    }
}

fn main() {
    let Cli { size_mib, seed } = Cli::parse();
    // Keep only stdin/stdout/stderr: descriptors inherited from whoever
    // started us are not part of the workload.
    // SAFETY: closes fds we never use; nothing in this process refers to them.
    unsafe {
        libc::close_range(3, libc::c_uint::MAX, 0);
    }
    let len = size_mib
        .checked_mul(1 << 20)
        .unwrap_or_else(|| fail("size overflows usize"));
    let pages = len / PAGE;

    let t0 = Instant::now();
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
    // (so u64 aligned), and exclusively ours for the life of the process.
    let mem: &'static mut [u64] = unsafe { std::slice::from_raw_parts_mut(addr.cast(), len / 8) };
    for (p, page) in mem.chunks_exact_mut(WORDS).enumerate() {
        fill_page(seed, p, page);
    }
    let mut w = Work {
        seed,
        mem,
        pages,
        versions: vec![0u32; pages],
        bg_written: 0,
        bg_rng: splitmix(seed ^ 0x6267),
        bg_rate: 0.0,
        bg_owed: 0.0,
        bg_last: Instant::now(),
    };
    say(&format!(
        "READY addr={:x} len={len} pages={pages} fill_s={:.3}",
        addr as usize,
        t0.elapsed().as_secs_f64()
    ));

    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 1_000_000,
    };
    let mut last_cmd = Instant::now();
    loop {
        match std::fs::read_to_string("cmd") {
            Ok(text) => {
                let _ = std::fs::remove_file("cmd");
                last_cmd = Instant::now();
                handle(&mut w, text.trim());
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => fail(&format!("read cmd: {e}")),
        }
        if last_cmd.elapsed() > IDLE_EXIT {
            exit(0);
        }
        w.background();
        // SAFETY: `ts` is a valid timespec; a null remainder pointer is allowed.
        unsafe {
            libc::nanosleep(&ts, std::ptr::null_mut());
        }
    }
}

fn handle(w: &mut Work, line: &str) {
    let f: Vec<&str> = line.split_whitespace().collect();
    let id = f.first().copied().unwrap_or("-");
    let num = |i: usize| -> u64 {
        f.get(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fail(&format!("bad command {line:?}")))
    };
    let t0 = Instant::now();
    match f.get(1).copied() {
        Some("dirty") => {
            let k = w.dirty(num(2), num(3));
            say(&format!(
                "DONE {id} pages={k} secs={:.6}",
                t0.elapsed().as_secs_f64()
            ));
        }
        Some("verify") => match w.verify(num(2)) {
            Ok(s) => say(&format!(
                "OK {id} {s} secs={:.3}",
                t0.elapsed().as_secs_f64()
            )),
            Err(e) => say(&format!("FAIL {id} {e}")),
        },
        Some("rate") => {
            w.bg_rate = num(2) as f64;
            w.bg_owed = 0.0;
            w.bg_last = Instant::now();
            say(&format!("RATE {id} bg={}", w.bg_written));
        }
        Some("exit") => {
            say(&format!("BYE {id}"));
            exit(0);
        }
        _ => say(&format!("FAIL {id} unknown command {line:?}")),
    }
}
