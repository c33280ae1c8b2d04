//! Benchmark workload: `bench_fds N MIX`.
//!
//! Opens exactly N file descriptors (fd 3 upwards, kinds interleaved), prints
//! `READY n=N mix=MIX open_s=SECS files=F nofile=SOFT` on stdout and then
//! waits, polling every 10 ms with nanosleep for a file named `go` in its
//! working directory. When `go` appears it checks every fd and prints
//! `OK n=N verify_s=SECS` or `FAIL n=N problems=P: ...`, and exits 0 or 1.
//!
//! MIX:
//! - `files`: N fds on regular files: ceil(N/100) files of 4 KiB in
//!   `./files/`, each opened about 100 times, every open at its own offset,
//!   read-only, read-write or write-only, half of them close-on-exec; every
//!   10th fd is a dup (`dup` or `F_DUPFD_CLOEXEC`) of the fd before it and
//!   shares its offset.
//! - `pipes`: N/2 pipes (both ends, O_NONBLOCK), each with 8 to 31 bytes
//!   buffered (if N is odd, the last fd is a file).
//! - `mixed`: 40 % files (as above), 30 % pipe ends, 20 % unix stream
//!   socketpair ends (bytes queued in both directions), 10 % eventfds (each
//!   with its own counter).
//! - `eventfds`: N eventfds (diagnostic: every fd has the same /proc link
//!   target, `anon_inode:[eventfd]`).
//!
//! `open_s` is the time the process took to create all N fds with that state
//! (open + lseek + dup, pipe2 + write, socketpair + 2 writes, eventfd),
//! after the files themselves were created: the baseline a restore can be
//! compared with.
//!
//! The check after `go`, for every fd: it is open; close-on-exec, access mode
//! and O_NONBLOCK are as set; files: same device and inode, same offset, and
//! a dup still shares its offset with its original (moved through one, seen
//! through the other) while separate opens do not (their offsets differ);
//! pipes: both ends are one pipe (same inode), exactly the buffered bytes
//! come out, then a new token written to the write end comes out of the read
//! end; sockets: exactly the queued bytes in each direction, then a token
//! each way; eventfds: the counter. Also: no fd is open besides 0, 1, 2 and
//! the N, and the soft RLIMIT_NOFILE is unchanged.
//!
//! At start it closes every inherited fd above 2 and raises its soft
//! RLIMIT_NOFILE to the hard limit; it fails if N + 3 fds do not fit. It
//! stays single-threaded.

use clap::builder::RangedU64ValueParser;
use clap::{Parser, ValueEnum};
use std::ffi::CString;
use std::io::Write;
use std::process::exit;
use std::time::{Duration, Instant};

/// Size of every file of the `files` part (offsets stay below it).
const FILE_LEN: usize = 4096;
/// Opens per file (about).
const OPENS_PER_FILE: usize = 100;
/// The workload gives up waiting for `go` after this long.
const SELF_TIMEOUT: Duration = Duration::from_secs(3600);

/// Benchmark workload of `cr-bench fds`: opens exactly N fds of the kinds
/// MIX, prints `READY ...`, waits for a file `go` in its working directory,
/// then checks every fd and prints `OK ...` or `FAIL ...`.
#[derive(Parser)]
#[command(name = "bench_fds")]
struct Cli {
    /// Number of fds to open.
    #[arg(value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    n: usize,
    /// Kinds of the fds.
    #[arg(value_enum)]
    mix: Mix,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mix {
    Files,
    Pipes,
    Mixed,
    Eventfds,
}

/// What one fd is and what it must look like after a restore.
enum Obj {
    File {
        file: usize,
        pos: i64,
        acc: i32,
    },
    /// A dup of `of` (same description; the checks are those of `of`).
    Dup {
        of: i32,
    },
    PipeR {
        w: i32,
        data: Vec<u8>,
    },
    PipeW,
    Sock {
        peer: i32,
        inbound: Vec<u8>,
    },
    Event {
        count: u64,
    },
}

struct Entry {
    fd: i32,
    cloexec: bool,
    obj: Obj,
}

fn fail(msg: &str) -> ! {
    eprintln!("bench_fds: {msg}");
    let _ = writeln!(std::io::stdout(), "FAIL {msg}");
    exit(1);
}

fn errno_str() -> String {
    std::io::Error::last_os_error().to_string()
}

fn check(r: libc::c_int, what: &str) -> libc::c_int {
    if r < 0 {
        fail(&format!("{what}: {}", errno_str()));
    }
    r
}

fn write_all(fd: i32, buf: &[u8], what: &str) {
    // SAFETY: `buf` is a valid readable slice of buf.len() bytes.
    let r = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
    if r != buf.len() as isize {
        fail(&format!(
            "{what}: wrote {r} of {} ({})",
            buf.len(),
            errno_str()
        ));
    }
}

/// One non-blocking read of up to 4 KiB (None: error, e.g. EAGAIN).
fn read_some(fd: i32) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` is a writable buffer of buf.len() bytes.
    let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        return None;
    }
    buf.truncate(r as usize);
    Some(buf)
}

fn fstat(fd: i32) -> Option<libc::stat> {
    // SAFETY: a zeroed stat is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out-parameter.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return None;
    }
    Some(st)
}

fn seek_cur(fd: i32) -> i64 {
    // SAFETY: lseek takes only integers.
    unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) }
}

fn nofile() -> (u64, u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid out-parameter.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l);
    }
    (l.rlim_cur, l.rlim_max)
}

/// Payload of pipe/socket `i` (8 to 31 bytes, unique per object).
fn payload(tag: &str, i: usize) -> Vec<u8> {
    let mut v = format!("{tag}{i}:").into_bytes();
    let len = 8 + i % 24;
    while v.len() < len {
        v.push(b'a' + (v.len() % 26) as u8);
    }
    v
}

struct Builder {
    entries: Vec<Entry>,
    /// (dev, ino) of every file.
    files: Vec<(u64, u64)>,
    paths: Vec<CString>,
    opens_per_file: Vec<usize>,
    file_fds: usize,
    pipes: usize,
    socks: usize,
    events: usize,
}

impl Builder {
    fn open_file(&mut self) {
        let j = self.file_fds;
        self.file_fds += 1;
        if j % 10 == 9 {
            if let Some(prev) = self
                .entries
                .iter()
                .rev()
                .find(|e| matches!(e.obj, Obj::File { .. }))
            {
                let of = prev.fd;
                let cloexec = (j / 10).is_multiple_of(2);
                let fd = if cloexec {
                    // SAFETY: fcntl with integer arguments only.
                    unsafe { libc::fcntl(of, libc::F_DUPFD_CLOEXEC, 0) }
                } else {
                    // SAFETY: dup takes an integer.
                    unsafe { libc::dup(of) }
                };
                check(fd, "dup");
                self.entries.push(Entry {
                    fd,
                    cloexec,
                    obj: Obj::Dup { of },
                });
                return;
            }
        }
        let k = j % self.files.len();
        let c = self.opens_per_file[k];
        self.opens_per_file[k] += 1;
        let acc = [libc::O_RDONLY, libc::O_RDWR, libc::O_WRONLY][j % 3];
        let cloexec = j.is_multiple_of(2);
        let flags = acc | if cloexec { libc::O_CLOEXEC } else { 0 };
        // SAFETY: the path is a valid NUL-terminated string.
        let fd = check(unsafe { libc::open(self.paths[k].as_ptr(), flags) }, "open");
        // Distinct for the first FILE_LEN opens of a file (7 is odd).
        let pos = ((c * 7 + 1) % FILE_LEN) as i64;
        // SAFETY: lseek takes only integers.
        if unsafe { libc::lseek(fd, pos, libc::SEEK_SET) } != pos {
            fail(&format!("lseek: {}", errno_str()));
        }
        self.entries.push(Entry {
            fd,
            cloexec,
            obj: Obj::File { file: k, pos, acc },
        });
    }

    fn pipe(&mut self) {
        let i = self.pipes;
        self.pipes += 1;
        let cloexec = i.is_multiple_of(2);
        let mut fds = [0i32; 2];
        let flags = libc::O_NONBLOCK | if cloexec { libc::O_CLOEXEC } else { 0 };
        // SAFETY: `fds` has room for two ints.
        check(unsafe { libc::pipe2(fds.as_mut_ptr(), flags) }, "pipe2");
        let data = payload("pipe", i);
        write_all(fds[1], &data, "write to pipe");
        self.entries.push(Entry {
            fd: fds[0],
            cloexec,
            obj: Obj::PipeR { w: fds[1], data },
        });
        self.entries.push(Entry {
            fd: fds[1],
            cloexec,
            obj: Obj::PipeW,
        });
    }

    fn socketpair(&mut self) {
        let i = self.socks;
        self.socks += 1;
        let cloexec = i % 2 == 1;
        let mut fds = [0i32; 2];
        let ty =
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | if cloexec { libc::SOCK_CLOEXEC } else { 0 };
        // SAFETY: `fds` has room for two ints.
        check(
            unsafe { libc::socketpair(libc::AF_UNIX, ty, 0, fds.as_mut_ptr()) },
            "socketpair",
        );
        let to_b = payload("sock>", i);
        let to_a = payload("sock<", i + 7);
        write_all(fds[0], &to_b, "write to socket");
        write_all(fds[1], &to_a, "write to socket");
        self.entries.push(Entry {
            fd: fds[0],
            cloexec,
            obj: Obj::Sock {
                peer: fds[1],
                inbound: to_a,
            },
        });
        self.entries.push(Entry {
            fd: fds[1],
            cloexec,
            obj: Obj::Sock {
                peer: fds[0],
                inbound: to_b,
            },
        });
    }

    fn eventfd(&mut self) {
        let i = self.events;
        self.events += 1;
        let cloexec = i.is_multiple_of(2);
        let count = i as u64 * 3 + 1;
        let flags = libc::EFD_NONBLOCK | if cloexec { libc::EFD_CLOEXEC } else { 0 };
        // SAFETY: eventfd takes only integers.
        let fd = check(unsafe { libc::eventfd(count as u32, flags) }, "eventfd");
        self.entries.push(Entry {
            fd,
            cloexec,
            obj: Obj::Event { count },
        });
    }
}

fn main() {
    let Cli { n, mix } = Cli::parse();
    // Keep only stdin/stdout/stderr: descriptors inherited from whoever
    // started us are not part of the workload.
    // SAFETY: closes fds we never use; nothing in this process refers to them.
    unsafe {
        libc::close_range(3, libc::c_uint::MAX, 0);
    }
    let (_, hard) = nofile();
    let l = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: `l` is a valid rlimit; lowering or keeping the hard limit and
    // raising the soft one up to it needs no privilege.
    check(
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) },
        "setrlimit",
    );
    let (soft, _) = nofile();
    // 3 standard fds, the N, and one for reading /proc/self/fd in the check.
    if (n as u64) + 4 > soft {
        fail(&format!(
            "{n} fds do not fit: RLIMIT_NOFILE is {soft} (hard {hard}), need {} \
             (3 standard fds + {n} + 1 for the check)",
            n + 4
        ));
    }

    // How many fds of each kind.
    let (file_fds, pipes, socks, events) = match mix {
        Mix::Files => (n, 0, 0, 0),
        Mix::Pipes => (n % 2, n / 2, 0, 0),
        Mix::Mixed => {
            let pipes = n * 3 / 10 / 2;
            let socks = n * 2 / 10 / 2;
            let events = n / 10;
            (n - 2 * pipes - 2 * socks - events, pipes, socks, events)
        }
        Mix::Eventfds => (0, 0, 0, n),
    };

    // The files (untimed: creating them is not part of opening the fds).
    let nfiles = file_fds.div_ceil(OPENS_PER_FILE);
    let mut files = Vec::with_capacity(nfiles);
    let mut paths = Vec::with_capacity(nfiles);
    if nfiles > 0 {
        if let Err(e) = std::fs::create_dir_all("files") {
            fail(&format!("mkdir files: {e}"));
        }
        let content: Vec<u8> = (0..FILE_LEN).map(|i| (i % 251) as u8).collect();
        for k in 0..nfiles {
            let p = format!("files/f{k}");
            if let Err(e) = std::fs::write(&p, &content) {
                fail(&format!("write {p}: {e}"));
            }
            let md = std::fs::metadata(&p).unwrap_or_else(|e| fail(&format!("stat {p}: {e}")));
            use std::os::unix::fs::MetadataExt;
            files.push((md.dev(), md.ino()));
            paths.push(CString::new(p).expect("no NUL in path"));
        }
    }

    let mut b = Builder {
        entries: Vec::with_capacity(n),
        files,
        paths,
        opens_per_file: vec![0; nfiles],
        file_fds: 0,
        pipes: 0,
        socks: 0,
        events: 0,
    };
    let t0 = Instant::now();
    // Kinds interleaved, one unit of each kind that has some left per round.
    loop {
        let mut any = false;
        if b.file_fds < file_fds {
            b.open_file();
            any = true;
        }
        if b.pipes < pipes {
            b.pipe();
            any = true;
        }
        if b.socks < socks {
            b.socketpair();
            any = true;
        }
        if b.events < events {
            b.eventfd();
            any = true;
        }
        if !any {
            break;
        }
    }
    let open_s = t0.elapsed().as_secs_f64();
    if b.entries.len() != n {
        fail(&format!("opened {} fds, not {n}", b.entries.len()));
    }
    say(&format!(
        "READY n={n} mix={} open_s={open_s:.6} files={nfiles} nofile={soft}",
        mix.to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    ));

    wait_go();

    let t = Instant::now();
    let problems = verify(&b, n, soft);
    let verify_s = t.elapsed().as_secs_f64();
    if problems.is_empty() {
        say(&format!("OK n={n} verify_s={verify_s:.6}"));
        exit(0);
    }
    let shown: Vec<&str> = problems.iter().take(8).map(String::as_str).collect();
    say(&format!(
        "FAIL n={n} problems={}: {}",
        problems.len(),
        shown.join("; ")
    ));
    exit(1);
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        exit(3);
    }
}

/// Polls for `./go` every 10 ms.
fn wait_go() {
    let go = c"go";
    let t0 = Instant::now();
    let ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 10_000_000,
    };
    loop {
        // SAFETY: `go` is a valid NUL-terminated path.
        if unsafe { libc::access(go.as_ptr(), libc::F_OK) } == 0 {
            return;
        }
        if t0.elapsed() > SELF_TIMEOUT {
            fail("timed out waiting for the go file");
        }
        // SAFETY: `ts` is a valid timespec; a null remainder is allowed.
        unsafe {
            libc::nanosleep(&ts, std::ptr::null_mut());
        }
    }
}

fn link_of(fd: i32) -> String {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|e| format!("? ({e})"))
}

fn verify(b: &Builder, n: usize, soft: u64) -> Vec<String> {
    let mut problems = Vec::new();
    let by_fd: std::collections::HashMap<i32, &Entry> =
        b.entries.iter().map(|e| (e.fd, e)).collect();

    // Pass 1: every fd on its own (this drains the buffered bytes).
    for e in &b.entries {
        let fd = e.fd;
        // SAFETY: fcntl with integer arguments only.
        let fdfl = unsafe { libc::fcntl(fd, libc::F_GETFD) };
        if fdfl < 0 {
            problems.push(format!("fd {fd}: not open ({})", errno_str()));
            continue;
        }
        if (fdfl & libc::FD_CLOEXEC != 0) != e.cloexec {
            problems.push(format!("fd {fd}: close-on-exec is {}", !e.cloexec));
        }
        // SAFETY: fcntl with integer arguments only.
        let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        let Some(st) = fstat(fd) else {
            problems.push(format!("fd {fd}: fstat: {}", errno_str()));
            continue;
        };
        let ty = st.st_mode & libc::S_IFMT;
        let want_file = |k: usize, pos: i64, acc: i32, problems: &mut Vec<String>| {
            let (dev, ino) = b.files[k];
            if ty != libc::S_IFREG || st.st_dev != dev || st.st_ino != ino {
                problems.push(format!(
                    "fd {fd}: not files/f{k} (dev {} ino {}, is {})",
                    dev,
                    ino,
                    link_of(fd)
                ));
            }
            let got = seek_cur(fd);
            if got != pos {
                problems.push(format!(
                    "fd {fd} (files/f{k}): offset {got}, expected {pos}"
                ));
            }
            if fl & libc::O_ACCMODE != acc {
                problems.push(format!(
                    "fd {fd} (files/f{k}): access mode {}, expected {acc}",
                    fl & libc::O_ACCMODE
                ));
            }
        };
        let nonblock = |acc: i32, what: &str, problems: &mut Vec<String>| {
            if fl & libc::O_ACCMODE != acc || fl & libc::O_NONBLOCK == 0 {
                problems.push(format!(
                    "fd {fd} ({what}): flags 0o{fl:o}, expected access mode {acc} and O_NONBLOCK"
                ));
                // Do not let a later read block.
                // SAFETY: fcntl with integer arguments only.
                unsafe {
                    libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
                }
            }
        };
        match &e.obj {
            Obj::File { file, pos, acc } => want_file(*file, *pos, *acc, &mut problems),
            Obj::Dup { of } => match by_fd.get(of).map(|o| &o.obj) {
                Some(Obj::File { file, pos, acc }) => want_file(*file, *pos, *acc, &mut problems),
                _ => problems.push(format!("fd {fd}: internal: dup of a non-file")),
            },
            Obj::PipeR { w, data } => {
                nonblock(libc::O_RDONLY, "pipe read end", &mut problems);
                let same = fstat(*w).map(|s| s.st_ino);
                if ty != libc::S_IFIFO || same != Some(st.st_ino) {
                    problems.push(format!(
                        "fd {fd}: not the read end of the pipe of fd {w} ({} / {})",
                        link_of(fd),
                        link_of(*w)
                    ));
                }
                match read_some(fd) {
                    Some(got) if got == *data => {}
                    Some(got) => problems.push(format!(
                        "fd {fd} (pipe): buffered {:?}, expected {:?}",
                        String::from_utf8_lossy(&got),
                        String::from_utf8_lossy(data)
                    )),
                    None => problems.push(format!("fd {fd} (pipe): read: {}", errno_str())),
                }
            }
            Obj::PipeW => {
                nonblock(libc::O_WRONLY, "pipe write end", &mut problems);
                if ty != libc::S_IFIFO {
                    problems.push(format!("fd {fd}: not a pipe ({})", link_of(fd)));
                }
            }
            Obj::Sock { inbound, .. } => {
                nonblock(libc::O_RDWR, "socket", &mut problems);
                if ty != libc::S_IFSOCK {
                    problems.push(format!("fd {fd}: not a socket ({})", link_of(fd)));
                }
                match read_some(fd) {
                    Some(got) if got == *inbound => {}
                    Some(got) => problems.push(format!(
                        "fd {fd} (socket): queued {:?}, expected {:?}",
                        String::from_utf8_lossy(&got),
                        String::from_utf8_lossy(inbound)
                    )),
                    None => problems.push(format!("fd {fd} (socket): read: {}", errno_str())),
                }
            }
            Obj::Event { count } => {
                nonblock(libc::O_RDWR, "eventfd", &mut problems);
                let link = link_of(fd);
                if link != "anon_inode:[eventfd]" {
                    problems.push(format!("fd {fd}: not an eventfd ({link})"));
                }
                let mut v = 0u64;
                // SAFETY: reads 8 bytes into `v`.
                let r = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
                if r != 8 || v != *count {
                    problems.push(format!(
                        "fd {fd} (eventfd): read {r} bytes, counter {v}, expected {count}"
                    ));
                }
            }
        }
    }

    // Pass 2: the fds that belong together still do.
    for e in &b.entries {
        let fd = e.fd;
        match &e.obj {
            Obj::Dup { of } => {
                let Some(Obj::File { pos, .. }) = by_fd.get(of).map(|o| &o.obj) else {
                    continue;
                };
                let moved = pos + 1000;
                // SAFETY: lseek takes only integers.
                unsafe {
                    libc::lseek(fd, moved, libc::SEEK_SET);
                }
                let seen = seek_cur(*of);
                if seen != moved {
                    problems.push(format!(
                        "fd {fd}: no longer shares its offset with fd {of} (moved to {moved}, \
                         fd {of} is at {seen})"
                    ));
                }
                // SAFETY: lseek takes only integers.
                unsafe {
                    libc::lseek(fd, *pos, libc::SEEK_SET);
                }
            }
            Obj::PipeR { w, .. } => {
                let token = format!("token{fd}").into_bytes();
                // SAFETY: `token` is a valid readable buffer.
                let r = unsafe { libc::write(*w, token.as_ptr().cast(), token.len()) };
                let got = read_some(fd);
                if r != token.len() as isize || got.as_deref() != Some(&token[..]) {
                    problems.push(format!(
                        "pipe fd {w} -> fd {fd}: wrote {r}, read {:?}",
                        got.map(|g| String::from_utf8_lossy(&g).into_owned())
                    ));
                }
            }
            Obj::Sock { peer, .. } => {
                let token = format!("token{fd}>{peer}").into_bytes();
                // SAFETY: `token` is a valid readable buffer.
                let r = unsafe { libc::write(fd, token.as_ptr().cast(), token.len()) };
                let got = read_some(*peer);
                if r != token.len() as isize || got.as_deref() != Some(&token[..]) {
                    problems.push(format!(
                        "socket fd {fd} -> fd {peer}: wrote {r}, read {:?}",
                        got.map(|g| String::from_utf8_lossy(&g).into_owned())
                    ));
                }
            }
            _ => {}
        }
    }

    // Nothing else is open (read_dir itself holds one fd).
    match std::fs::read_dir("/proc/self/fd") {
        Ok(rd) => {
            let open: Vec<i32> = rd
                .flatten()
                .filter_map(|d| d.file_name().to_str()?.parse().ok())
                .collect();
            let extra: Vec<String> = open
                .iter()
                .filter(|&&fd| fd > 2 && !by_fd.contains_key(&fd))
                .map(|&fd| format!("{fd} ({})", link_of(fd)))
                .collect();
            // One of them is the directory being read.
            if extra.len() > 1 {
                problems.push(format!(
                    "{} fds open besides 0-2 and the {n} (one is the /proc/self/fd \
                     listing): {}",
                    extra.len(),
                    extra.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
        Err(e) => problems.push(format!("/proc/self/fd: {e}")),
    }
    let (now, _) = nofile();
    if now != soft {
        problems.push(format!("soft RLIMIT_NOFILE is {now}, expected {soft}"));
    }
    problems
}
