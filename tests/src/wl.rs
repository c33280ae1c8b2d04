//! Workload-side helpers, shared by the `wl_*` binaries.
//!
//! Workloads write their stdout with plain `write(2)` calls (stdout is a regular
//! file, never a pipe), so that nothing sits in a user-space buffer and every line
//! lands in the file at the moment it is printed.
//!
//! Protocol: `wl_NAME WORKDIR [ARGS...]`; the workload sets up its state, prints
//! `READY`, waits for `WORKDIR/go` by polling with nanosleep, then checks itself
//! and prints `OK` (exit 0) or `FAIL: reason` (exit 1).
//!
//! [`msg`]: the numbered, self-checking messages of the TCP workloads.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A workload gives up on its own after this long, so nothing lingers forever
/// even if the test process that started it was killed.
pub const SELF_TIMEOUT: Duration = Duration::from_secs(240);

/// Page size of x86_64.
pub const PAGE: usize = 4096;

/// Writes all of `buf` to file descriptor `fd`, retrying on EINTR / short writes.
pub fn write_all_fd(fd: i32, mut buf: &[u8]) -> Result<(), String> {
    while !buf.is_empty() {
        // SAFETY: buf is a valid readable slice of buf.len() bytes.
        let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(format!("write(fd {fd}): {e}"));
        }
        buf = &buf[n as usize..];
    }
    Ok(())
}

/// Prints one line on stdout with a single write(2), after `TAG ` when
/// `WL_TAG=TAG` is in the environment (the tasks of one srun step sharing
/// one output).
pub fn say(line: &str) {
    let tag = std::env::var("WL_TAG").ok();
    let mut s = String::with_capacity(line.len() + 1);
    if let Some(t) = tag {
        s.push_str(&t);
        s.push(' ');
    }
    s.push_str(line);
    s.push('\n');
    // If stdout is gone there is nobody to tell.
    let _ = write_all_fd(1, s.as_bytes());
}

/// Prints one line on stderr (diagnostics that the test shows on failure).
pub fn note(line: &str) {
    let mut s = String::with_capacity(line.len() + 1);
    s.push_str(line);
    s.push('\n');
    let _ = write_all_fd(2, s.as_bytes());
}

/// Prints `FAIL: msg` and exits 1.
pub fn fail(msg: &str) -> ! {
    say(&format!("FAIL: {msg}"));
    std::process::exit(1)
}

/// The calling thread's errno, in words.
pub fn errno_str() -> String {
    std::io::Error::last_os_error().to_string()
}

/// The result of a system call, or (when negative) `FAIL: what: errno` and exit 1.
pub fn check<T: Copy + Into<i64>>(r: T, what: &str) -> T {
    if r.into() < 0 {
        fail(&format!("{what}: {}", errno_str()));
    }
    r
}

/// Prints `OK` and exits 0.
pub fn ok() -> ! {
    say("OK");
    std::process::exit(0)
}

/// Prints `FAIL: ...` for every problem (at most 20), or `OK`; then exits.
pub fn finish(problems: &[String]) -> ! {
    if problems.is_empty() {
        ok();
    }
    for p in problems.iter().skip(1).take(19) {
        note(&format!("also: {p}"));
    }
    let more = if problems.len() > 1 {
        format!(" (+{} more problems, see stderr)", problems.len() - 1)
    } else {
        String::new()
    };
    fail(&format!("{}{more}", problems[0]))
}

/// Current CLOCK_MONOTONIC time in nanoseconds.
pub fn mono_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// Current time of `clock` in nanoseconds.
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid, writable timespec.
    let r = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(r, 0, "clock_gettime failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Sleeps `ms` milliseconds with glibc's nanosleep (clock_nanosleep underneath),
/// finishing the sleep if a signal interrupts it.
pub fn sleep_ms(ms: u64) {
    let mut req = libc::timespec {
        tv_sec: (ms / 1000) as libc::time_t,
        tv_nsec: ((ms % 1000) * 1_000_000) as libc::c_long,
    };
    loop {
        let mut rem = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: req and rem are valid timespecs.
        let r = unsafe { libc::nanosleep(&req, &mut rem) };
        if r == 0 {
            return;
        }
        req = rem;
    }
}

/// Parsed command line of a workload: the work directory and the other arguments.
pub struct Args {
    pub workdir: PathBuf,
    pub rest: Vec<String>,
}

/// Reads `WORKDIR [ARGS...]`, or fails with a usage message.
pub fn args(usage: &str) -> Args {
    let mut it = std::env::args().skip(1);
    let Some(workdir) = it.next() else {
        fail(&format!("usage: {usage}"));
    };
    Args {
        workdir: PathBuf::from(workdir),
        rest: it.collect(),
    }
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("path without NUL")
}

/// True if `path` exists (access(2), no allocation on the hot path beyond the CString).
pub fn exists(path: &CString) -> bool {
    // SAFETY: path is a valid NUL-terminated string.
    unsafe { libc::access(path.as_ptr(), libc::F_OK) == 0 }
}

/// The go trigger of a work directory.
pub struct Go {
    path: CString,
    started: u64,
}

impl Go {
    pub fn new(workdir: &Path) -> Go {
        Go {
            path: cpath(&workdir.join("go")),
            started: mono_ns(),
        }
    }

    /// True once `go` exists. Fails the workload once SELF_TIMEOUT has passed.
    pub fn check(&self) -> bool {
        if exists(&self.path) {
            return true;
        }
        if mono_ns().saturating_sub(self.started) > SELF_TIMEOUT.as_nanos() as u64 {
            fail("timed out waiting for the go file");
        }
        false
    }

    /// A trigger file of another name: one a process of a workload makes
    /// for another to wait for.
    pub fn at(path: &Path) -> Go {
        Go {
            path: cpath(path),
            started: mono_ns(),
        }
    }

    /// Whether the file exists within `limit`, polled every 20 ms
    /// (nanosleep).
    pub fn appeared(&self, limit: Duration) -> bool {
        let deadline = mono_ns().saturating_add(limit.as_nanos() as u64);
        while !exists(&self.path) {
            if mono_ns() > deadline {
                return false;
            }
            sleep_ms(20);
        }
        true
    }

    /// Waits for `go`; fails the workload once SELF_TIMEOUT has passed.
    pub fn wait(&self) {
        let spent = Duration::from_nanos(mono_ns().saturating_sub(self.started));
        if !self.appeared(SELF_TIMEOUT.saturating_sub(spent)) {
            fail("timed out waiting for the go file");
        }
    }
}

/// splitmix64: turns any 64-bit value into a well-mixed one.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seed of one page: depends on the run's seed, the region and the page index.
pub fn page_seed(seed: u64, region: u64, page: u64) -> u64 {
    mix64(seed ^ mix64(region.wrapping_mul(0x1000_0000_01b3) ^ mix64(page)))
}

/// Fills one page (512 u64) with the xorshift64* stream of `s`.
pub fn fill_page(page: &mut [u64], s: u64) {
    let mut x = s | 1;
    for w in page.iter_mut() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        *w = x.wrapping_mul(0x2545_f491_4f6c_dd1d);
    }
}

/// Index of the first word of `page` that differs from the stream of `s`.
pub fn check_page(page: &[u64], s: u64) -> Option<usize> {
    let mut x = s | 1;
    for (i, w) in page.iter().enumerate() {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        if *w != x.wrapping_mul(0x2545_f491_4f6c_dd1d) {
            return Some(i);
        }
    }
    None
}

/// A seed that differs from run to run (time, pid), so that stale data from
/// another run can never pass a check by accident.
pub fn fresh_seed() -> u64 {
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() } as u64;
    mix64(clock_ns(libc::CLOCK_REALTIME) ^ (pid << 40) ^ mono_ns())
}

/// One line of /proc/self/maps.
#[derive(Debug, Clone)]
pub struct MapEntry {
    pub start: usize,
    pub end: usize,
    pub perms: String,
    pub path: String,
}

/// Parses /proc/self/maps. The path is everything after the inode column
/// (spaces included); the kernel shows a newline in it as `\012`, which is
/// turned back into `\n`.
pub fn read_maps() -> Vec<MapEntry> {
    let text = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut out = Vec::new();
    for line in text.lines() {
        let mut fields = Vec::with_capacity(5);
        let mut rest = line;
        for _ in 0..5 {
            rest = rest.trim_start_matches(' ');
            let end = rest.find(' ').unwrap_or(rest.len());
            fields.push(&rest[..end]);
            rest = &rest[end..];
        }
        let path = rest.trim_start_matches(' ').replace("\\012", "\n");
        let Some((a, b)) = fields[0].split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
        else {
            continue;
        };
        out.push(MapEntry {
            start,
            end,
            perms: fields[1].to_string(),
            path,
        });
    }
    out
}

/// Checks that every page of [start, start+len) is mapped with exactly `perms`
/// (e.g. "r--p") and, if `path` is given, backed by that file.
pub fn check_mapping(
    maps: &[MapEntry],
    what: &str,
    start: usize,
    len: usize,
    perms: &str,
    path: Option<&Path>,
) -> Result<(), String> {
    let end = start + len;
    let mut addr = start;
    while addr < end {
        let Some(m) = maps.iter().find(|m| m.start <= addr && addr < m.end) else {
            return Err(format!("{what}: address {addr:#x} is not mapped"));
        };
        if m.perms != perms {
            return Err(format!(
                "{what}: {:#x}-{:#x} has perms {} instead of {perms}",
                m.start, m.end, m.perms
            ));
        }
        if let Some(p) = path {
            let want = p.to_string_lossy();
            if m.path != want {
                return Err(format!(
                    "{what}: {:#x}-{:#x} maps {:?} instead of {want:?}",
                    m.start, m.end, m.path
                ));
            }
        }
        addr = m.end;
    }
    Ok(())
}

/// Process-wide state that every workload checks after restore: pid, cwd, umask,
/// /proc/self/{cmdline,environ,comm,auxv} and /proc/self/exe.
pub struct ProcState {
    pid: i32,
    cwd: PathBuf,
    umask: u32,
    /// (name, content) of /proc/self files that a restore must reproduce.
    proc_files: Vec<(&'static str, Vec<u8>)>,
    exe: PathBuf,
}

const PROC_FILES: [&str; 4] = ["cmdline", "environ", "comm", "auxv"];

fn read_proc_files() -> Vec<(&'static str, Vec<u8>)> {
    PROC_FILES
        .iter()
        .map(|f| {
            (
                *f,
                std::fs::read(format!("/proc/self/{f}")).unwrap_or_default(),
            )
        })
        .collect()
}

impl ProcState {
    /// chdir()s into `workdir/cwd`, sets umask 027, and remembers pid, cwd, umask.
    pub fn setup(workdir: &Path) -> ProcState {
        let dir = workdir.join("cwd");
        if let Err(e) = std::fs::create_dir_all(&dir) {
            fail(&format!("mkdir {}: {e}", dir.display()));
        }
        if let Err(e) = std::env::set_current_dir(&dir) {
            fail(&format!("chdir {}: {e}", dir.display()));
        }
        // SAFETY: umask has no preconditions.
        unsafe { libc::umask(0o027) };
        ProcState {
            // SAFETY: getpid has no preconditions.
            pid: unsafe { libc::getpid() },
            cwd: std::env::current_dir().unwrap_or_default(),
            umask: 0o027,
            proc_files: read_proc_files(),
            exe: std::fs::read_link("/proc/self/exe").unwrap_or_default(),
        }
    }

    /// Compares the current pid, cwd and umask with the remembered ones.
    pub fn verify(&self, problems: &mut Vec<String>) {
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        if pid != self.pid {
            problems.push(format!("pid is {pid}, was {}", self.pid));
        }
        match std::env::current_dir() {
            Ok(c) if c == self.cwd => {}
            Ok(c) => problems.push(format!(
                "cwd is {}, was {}",
                c.display(),
                self.cwd.display()
            )),
            Err(e) => problems.push(format!("getcwd: {e}")),
        }
        // SAFETY: umask has no preconditions; it is set back right away.
        let m = unsafe { libc::umask(0o022) };
        // SAFETY: as above.
        unsafe { libc::umask(m) };
        if m != self.umask {
            problems.push(format!("umask is {m:o}, was {:o}", self.umask));
        }
        for ((name, before), (_, now)) in self.proc_files.iter().zip(read_proc_files()) {
            if *before != now {
                problems.push(format!(
                    "/proc/self/{name} is {:?}, was {:?}",
                    String::from_utf8_lossy(&now[..now.len().min(200)]),
                    String::from_utf8_lossy(&before[..before.len().min(200)])
                ));
            }
        }
        let exe = std::fs::read_link("/proc/self/exe").unwrap_or_default();
        if exe != self.exe {
            problems.push(format!(
                "/proc/self/exe is {}, was {}",
                exe.display(),
                self.exe.display()
            ));
        }
    }
}

/// Numbered, self-checking 64-byte messages, as `wl_tcp` and `wl_ring`
/// exchange them: the number, a tag naming the connection and direction, and
/// six words derived from both, so that a gap, a duplicate, a message of
/// another connection or a corrupted byte is noticed by the receiver.
pub mod msg {
    use super::mix64;

    /// Size of one message.
    pub const MSG: usize = 64;

    /// The tag of direction `dir` of the connection named `id` (wl_tcp: the
    /// client's port; wl_ring: the index of the member that connected).
    pub fn tag(id: u16, dir: u64) -> u64 {
        0x7c00_0000_0000_0000 | (u64::from(id) << 8) | dir
    }

    /// Word `i` of the bytes derived from the two header fields and the tag.
    pub fn word(a: u64, b: u64, t: u64, i: u64) -> u64 {
        mix64(a ^ b.rotate_left(17) ^ t.rotate_left(32) ^ (i << 56))
    }

    /// Writes the message with header fields `a` (the number) and `b` (the
    /// tag, or another value such as a count) and the words of tag `t`.
    pub fn encode(buf: &mut [u8; MSG], a: u64, b: u64, t: u64) {
        buf[0..8].copy_from_slice(&a.to_le_bytes());
        buf[8..16].copy_from_slice(&b.to_le_bytes());
        for i in 0..6 {
            let o = 16 + 8 * i;
            buf[o..o + 8].copy_from_slice(&word(a, b, t, i as u64).to_le_bytes());
        }
    }

    /// Field `i` (little-endian u64) of a message.
    pub fn field(m: &[u8], i: usize) -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&m[8 * i..8 * i + 8]);
        u64::from_le_bytes(w)
    }

    /// The first payload word that does not match tag `t`, if any:
    /// (index, expected, got).
    pub fn bad_word(m: &[u8], t: u64) -> Option<(usize, u64, u64)> {
        let (a, b) = (field(m, 0), field(m, 1));
        (0..6).find_map(|i| {
            let want = word(a, b, t, i as u64);
            let got = field(m, 2 + i);
            (got != want).then_some((i, want, got))
        })
    }
}
