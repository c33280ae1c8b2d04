//! wl_ipc_events WORKDIR [wdgap]
//!
//! An event loop on epoll that must keep running across checkpoint and
//! restore. It holds:
//!
//! * `plain`: an eventfd with counter 42 (read once after the restore: 42),
//!   and `big`, one with counter 0x1_0000_0005 (more than eventfd() takes);
//! * `sem`: an EFD_SEMAPHORE eventfd with counter 3 (three reads of 1, then EAGAIN);
//! * `loopfd`: an eventfd in the epoll set (the test writes 7 to it after the restore);
//! * `sfd`: a signalfd for SIGUSR1 in the epoll set (the test sends SIGUSR1 after the restore);
//! * `sfd2`: a signalfd for SIGUSR2, not in the set, with a SIGUSR2 queued by
//!   sigqueue (value 777) before the checkpoint, read after the restore;
//! * `tick`: a periodic timerfd (100 ms) in the epoll set, counted;
//! * `once`: a one-shot timerfd due in 1000 s (its remaining time is checked);
//! * `ino`: an inotify instance in the epoll set with IN_CREATE watches on
//!   WORKDIR/other (wd A) and WORKDIR/watched (wd B; with `wdgap`, a watch
//!   added and removed in between leaves a gap); after the restore the test
//!   creates a file in each, and exactly those two events must arrive.
//!
//! Prints `FDS loop=N ino=N` and `WDS other=A watched=B`, then `READY`, and
//! `ticks N` after each read of the timer (N: ticks so far). Once WORKDIR/go
//! exists and every expected event arrived (or 10 s passed), it checks
//! everything, prints one line per check (`... OK` / `... FAIL: why`) and
//! `OK` or `FAIL: ...`.

use cr_tests::wl::{self, check, errno_str};
use std::ffi::CString;

const T_TICK: u64 = 0x7101;
const T_LOOP: u64 = 0x7102;
const T_SIG: u64 = 0x7103;
const T_INO: u64 = 0x7104;
/// Long enough that a checkpoint taken right after a `ticks` line is done
/// before the next expiry (a periodic timerfd caught expired but unread is
/// checked on its own by wl_ipc_timer).
const TICK_NS: u64 = 100_000_000;
const ONCE_S: i64 = 1000;
const BIG_COUNT: u64 = 0x1_0000_0005;

/// read(2) of one u64 (eventfd, timerfd); Err(errno) on failure.
fn read_u64(fd: i32) -> Result<u64, i32> {
    let mut v = 0u64;
    // SAFETY: v is 8 writable bytes.
    let n = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    if n == 8 {
        Ok(v)
    } else {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }
}

fn read_siginfo(fd: i32) -> Option<libc::signalfd_siginfo> {
    // SAFETY: signalfd_siginfo is plain old data; all-zero is valid.
    let mut si: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::signalfd_siginfo>();
    // SAFETY: si is `size` writable bytes.
    let n = unsafe { libc::read(fd, (&mut si as *mut libc::signalfd_siginfo).cast(), size) };
    (n == size as isize).then_some(si)
}

fn gettime(fd: i32) -> (u64, u64) {
    // SAFETY: itimerspec is plain old data.
    let mut it: libc::itimerspec = unsafe { std::mem::zeroed() };
    // SAFETY: it is a valid, writable itimerspec.
    check(
        unsafe { libc::timerfd_gettime(fd, &mut it) },
        "timerfd_gettime",
    );
    let ns = |t: libc::timespec| t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64;
    (ns(it.it_value), ns(it.it_interval))
}

fn add_watch(ino: i32, dir: &std::path::Path) -> i32 {
    if let Err(e) = std::fs::create_dir_all(dir) {
        wl::fail(&format!("mkdir {}: {e}", dir.display()));
    }
    let c = CString::new(dir.as_os_str().as_encoded_bytes()).expect("no NUL");
    // SAFETY: c is a valid NUL-terminated path.
    check(
        unsafe { libc::inotify_add_watch(ino, c.as_ptr(), libc::IN_CREATE | libc::IN_MOVED_TO) },
        "inotify_add_watch",
    )
}

fn epoll_add(ep: i32, fd: i32, tag: u64) {
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: tag,
    };
    // SAFETY: ev is a valid epoll_event.
    check(
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev) },
        "epoll_ctl",
    );
}

/// "sigmask:\t0000000000000200" of /proc/self/fdinfo/FD.
fn fdinfo_field(fd: i32, key: &str) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
}

fn sigset(sigs: &[i32]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain old data; sigemptyset initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for &s in sigs {
        // SAFETY: as above.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    set
}

/// Inotify events: (wd, mask, name).
fn read_inotify(fd: i32) -> Vec<(i32, u32, String)> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: buf has buf.len() writable bytes.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            return out;
        }
        let mut off = 0usize;
        while off + 16 <= n as usize {
            let wd = i32::from_ne_bytes(buf[off..off + 4].try_into().expect("4 bytes"));
            let mask = u32::from_ne_bytes(buf[off + 4..off + 8].try_into().expect("4 bytes"));
            let len =
                u32::from_ne_bytes(buf[off + 12..off + 16].try_into().expect("4 bytes")) as usize;
            let name = &buf[off + 16..(off + 16 + len).min(n as usize)];
            let name = String::from_utf8_lossy(name)
                .trim_end_matches('\0')
                .to_string();
            out.push((wd, mask, name));
            off += 16 + len;
        }
    }
}

struct Checks {
    problems: Vec<String>,
}

impl Checks {
    fn item(&mut self, name: &str, problems: Vec<String>) {
        if problems.is_empty() {
            wl::say(&format!("{name} OK"));
        } else {
            let msg = problems.join("; ");
            wl::say(&format!("{name} FAIL: {msg}"));
            self.problems.push(format!("{name}: {msg}"));
        }
    }
}

fn main() {
    let args = wl::args("wl_ipc_events WORKDIR [wdgap]");
    let workdir = args.workdir.clone();
    let state = wl::ProcState::setup(&workdir);
    let go = wl::Go::new(&workdir);
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };

    // SAFETY: eventfd has no pointer arguments.
    let plain = check(
        unsafe { libc::eventfd(42, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) },
        "eventfd",
    );
    // SAFETY: as above.
    let sem = check(
        unsafe { libc::eventfd(3, libc::EFD_SEMAPHORE | libc::EFD_NONBLOCK) },
        "eventfd",
    );
    // SAFETY: as above.
    let loopfd = check(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) }, "eventfd");
    // A counter above 32 bits (eventfd() itself only takes an unsigned int).
    // SAFETY: as above.
    let big = check(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK) }, "eventfd");
    if let Err(e) = wl::write_all_fd(big, &BIG_COUNT.to_ne_bytes()) {
        wl::fail(&e);
    }

    let both = sigset(&[libc::SIGUSR1, libc::SIGUSR2]);
    // SAFETY: both is a valid sigset; single-threaded process.
    check(
        unsafe { libc::sigprocmask(libc::SIG_BLOCK, &both, std::ptr::null_mut()) },
        "sigprocmask",
    );
    let usr1 = sigset(&[libc::SIGUSR1]);
    let usr2 = sigset(&[libc::SIGUSR2]);
    // SAFETY: usr1 is a valid sigset.
    let sfd = check(
        unsafe { libc::signalfd(-1, &usr1, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) },
        "signalfd",
    );
    // SAFETY: usr2 is a valid sigset.
    let sfd2 = check(
        unsafe { libc::signalfd(-1, &usr2, libc::SFD_NONBLOCK) },
        "signalfd",
    );
    let sfd_mask = fdinfo_field(sfd, "sigmask:").unwrap_or_default();
    let sfd2_mask = fdinfo_field(sfd2, "sigmask:").unwrap_or_default();
    let val = libc::sigval {
        sival_ptr: 777usize as *mut libc::c_void,
    };
    // SAFETY: queues a blocked signal to ourselves.
    check(
        unsafe { libc::sigqueue(me, libc::SIGUSR2, val) },
        "sigqueue",
    );

    // SAFETY: timerfd_create has no pointer arguments.
    let tick = check(
        unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK) },
        "timerfd_create",
    );
    let ts = |ns: u64| libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    };
    let periodic = libc::itimerspec {
        it_interval: ts(TICK_NS),
        it_value: ts(TICK_NS),
    };
    // SAFETY: periodic is a valid itimerspec.
    check(
        unsafe { libc::timerfd_settime(tick, 0, &periodic, std::ptr::null_mut()) },
        "timerfd_settime",
    );
    // SAFETY: as above.
    let once = check(
        unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK) },
        "timerfd_create",
    );
    let one_shot = libc::itimerspec {
        it_interval: ts(0),
        it_value: ts(ONCE_S as u64 * 1_000_000_000),
    };
    // SAFETY: one_shot is a valid itimerspec.
    check(
        unsafe { libc::timerfd_settime(once, 0, &one_shot, std::ptr::null_mut()) },
        "timerfd_settime",
    );

    // SAFETY: inotify_init1 has no pointer arguments.
    let ino = check(
        unsafe { libc::inotify_init1(libc::IN_NONBLOCK) },
        "inotify_init1",
    );
    let wd_other = add_watch(ino, &workdir.join("other"));
    if args.rest.iter().any(|a| a == "wdgap") {
        // A watch removed again: the watch descriptors have a gap (1, 3).
        let wd_gone = add_watch(ino, &workdir.join("gone"));
        // SAFETY: inotify_rm_watch has no pointer arguments.
        check(
            unsafe { libc::inotify_rm_watch(ino, wd_gone) },
            "inotify_rm_watch",
        );
        // Its IN_IGNORED event, read now: nothing is left in the queue.
        let ignored = read_inotify(ino);
        if ignored.len() != 1 || ignored[0].1 & libc::IN_IGNORED == 0 {
            wl::fail(&format!("after inotify_rm_watch: events {ignored:?}"));
        }
    }
    let wd_watched = add_watch(ino, &workdir.join("watched"));

    // SAFETY: epoll_create1 has no pointer arguments.
    let ep = check(
        unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) },
        "epoll_create1",
    );
    epoll_add(ep, tick, T_TICK);
    epoll_add(ep, loopfd, T_LOOP);
    epoll_add(ep, sfd, T_SIG);
    epoll_add(ep, ino, T_INO);

    wl::say(&format!("FDS loop={loopfd} ino={ino}"));
    wl::say(&format!("WDS other={wd_other} watched={wd_watched}"));
    wl::say("READY");

    let mut ticks = 0u64;
    let mut ticks_at_go: Option<u64> = None;
    let mut go_at = 0u64;
    let mut loop_total = 0u64;
    let mut sigs: Vec<(u32, i32)> = Vec::new();
    let mut events: Vec<(i32, u32, String)> = Vec::new();
    let mut bad_tags: Vec<u64> = Vec::new();
    loop {
        // SAFETY: epoll_event is plain old data.
        let mut evs: [libc::epoll_event; 8] = unsafe { std::mem::zeroed() };
        // SAFETY: evs has room for 8 events.
        let n = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), 8, 50) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            wl::fail(&format!("epoll_wait: {}", errno_str()));
        }
        for ev in evs.iter().take(n.max(0) as usize) {
            let tag = ev.u64;
            match tag {
                T_TICK => {
                    if let Ok(v) = read_u64(tick) {
                        ticks += v;
                        wl::say(&format!("ticks {ticks}"));
                    }
                }
                T_LOOP => {
                    if let Ok(v) = read_u64(loopfd) {
                        loop_total += v;
                        wl::say(&format!("eventfd {v}"));
                    }
                }
                T_SIG => {
                    while let Some(si) = read_siginfo(sfd) {
                        wl::say(&format!("signal {}", si.ssi_signo));
                        sigs.push((si.ssi_signo, si.ssi_code));
                    }
                }
                T_INO => {
                    for e in read_inotify(ino) {
                        wl::say(&format!("inotify wd {} mask {:#x} name {}", e.0, e.1, e.2));
                        events.push(e);
                    }
                }
                other => {
                    bad_tags.push(other);
                }
            }
        }
        if ticks_at_go.is_none() && go.check() {
            ticks_at_go = Some(ticks);
            go_at = wl::mono_ns();
        }
        if let Some(t0) = ticks_at_go {
            let all = loop_total >= 7 && !sigs.is_empty() && events.len() >= 2 && ticks >= t0 + 3;
            if all || wl::mono_ns() - go_at > 10_000_000_000 {
                break;
            }
        }
    }

    let mut c = Checks {
        problems: Vec::new(),
    };
    let mut p = Vec::new();
    if ticks < ticks_at_go.unwrap_or(0) + 3 {
        p.push(format!(
            "the periodic timerfd stopped: {ticks} ticks, {} at go",
            ticks_at_go.unwrap_or(0)
        ));
    }
    let (value, interval) = gettime(tick);
    if interval != TICK_NS || value == 0 || value > TICK_NS {
        p.push(format!(
            "periodic timerfd: value {value} ns, interval {interval} ns (want interval {TICK_NS})"
        ));
    }
    c.item("timerfd periodic", p);

    let mut p = Vec::new();
    let (value, interval) = gettime(once);
    let full = ONCE_S as u64 * 1_000_000_000;
    if interval != 0 || value == 0 || value > full || value < full - 120_000_000_000 {
        p.push(format!(
            "one-shot timerfd: {value} ns left, interval {interval} (armed for {full} ns)"
        ));
    }
    c.item("timerfd one-shot", p);

    let mut p = Vec::new();
    match read_u64(plain) {
        Ok(42) => {}
        other => p.push(format!("plain eventfd read {other:?}, want Ok(42)")),
    }
    match read_u64(plain) {
        Err(libc::EAGAIN) => {}
        other => p.push(format!(
            "second read of the plain eventfd: {other:?}, want EAGAIN"
        )),
    }
    // SAFETY: fcntl with F_GETFD/F_GETFL has no pointer arguments.
    let (fdfl, fl) = unsafe {
        (
            libc::fcntl(plain, libc::F_GETFD),
            libc::fcntl(plain, libc::F_GETFL),
        )
    };
    if fdfl & libc::FD_CLOEXEC == 0 || fl & libc::O_NONBLOCK == 0 {
        p.push(format!(
            "plain eventfd: F_GETFD {fdfl:#x} F_GETFL {fl:#o} (want CLOEXEC and NONBLOCK)"
        ));
    }
    match read_u64(big) {
        Ok(BIG_COUNT) => {}
        other => p.push(format!(
            "big eventfd read {other:?}, want Ok({BIG_COUNT:#x})"
        )),
    }
    c.item("eventfd counter", p);

    let mut p = Vec::new();
    let reads: Vec<Result<u64, i32>> = (0..4).map(|_| read_u64(sem)).collect();
    if reads != vec![Ok(1), Ok(1), Ok(1), Err(libc::EAGAIN)] {
        p.push(format!(
            "semaphore eventfd reads {reads:?}, want 1, 1, 1, EAGAIN ({})",
            fdinfo_field(sem, "eventfd-semaphore:").unwrap_or_default()
        ));
    }
    c.item("eventfd semaphore", p);

    let mut p = Vec::new();
    if loop_total != 7 {
        p.push(format!(
            "eventfd in epoll: got {loop_total}, want 7 (written by the test)"
        ));
    }
    c.item("epoll eventfd", p);

    let mut p = Vec::new();
    if sigs.len() != 1 || sigs[0].0 != libc::SIGUSR1 as u32 {
        p.push(format!(
            "signals read from the signalfd in epoll: {sigs:?}, want one SIGUSR1"
        ));
    }
    let m = fdinfo_field(sfd, "sigmask:").unwrap_or_default();
    if m != sfd_mask {
        p.push(format!("signalfd mask {m}, was {sfd_mask}"));
    }
    c.item("epoll signalfd", p);

    let mut p = Vec::new();
    match read_siginfo(sfd2) {
        Some(si) => {
            if si.ssi_signo != libc::SIGUSR2 as u32
                || si.ssi_code != libc::SI_QUEUE
                || si.ssi_int != 777
                || si.ssi_pid != me as u32
            {
                p.push(format!(
                    "queued signal read as signo {} code {} int {} pid {} (want {} SI_QUEUE 777 {me})",
                    si.ssi_signo,
                    si.ssi_code,
                    si.ssi_int,
                    si.ssi_pid,
                    libc::SIGUSR2
                ));
            }
        }
        None => p.push(format!(
            "no SIGUSR2 pending on the second signalfd: {}",
            errno_str()
        )),
    }
    let m = fdinfo_field(sfd2, "sigmask:").unwrap_or_default();
    if m != sfd2_mask {
        p.push(format!("signalfd mask {m}, was {sfd2_mask}"));
    }
    c.item("signalfd pending", p);

    let mut p = Vec::new();
    let want = [
        (wd_other, "created-in-other"),
        (wd_watched, "created-after-restore"),
    ];
    for (wd, name) in want {
        if !events
            .iter()
            .any(|e| e.0 == wd && e.1 & libc::IN_CREATE != 0 && e.2 == name)
        {
            p.push(format!(
                "no IN_CREATE of {name} on wd {wd}; events: {events:?}"
            ));
        }
    }
    if events.len() != 2 {
        p.push(format!(
            "{} inotify events, want 2: {events:?}",
            events.len()
        ));
    }
    c.item("epoll inotify", p);

    let mut p = Vec::new();
    if !bad_tags.is_empty() {
        p.push(format!("epoll returned unknown data {bad_tags:x?}"));
    }
    state.verify(&mut p);
    c.item("process", p);

    wl::finish(&c.problems);
}
