//! wl_ipc_timer WORKDIR MODE
//!
//! MODE `expired`: a periodic timerfd (10 ms) that expires and is not read
//! before the checkpoint: the kernel then shows it with `ticks: 1` and
//! `it_value: (0, 0)` (a periodic timerfd is re-armed only when it is
//! read). After the restore the expiration must still be readable and the
//! timer must keep its 10 ms interval and go on ticking.
//!
//! MODE `absolute`: a CLOCK_REALTIME timerfd armed with TFD_TIMER_ABSTIME
//! for a moment one hour ahead, which must stay due at that same moment
//! (within 0.5 s; the test lets more than that pass between checkpoint and
//! restore).
//!
//! Prints `READY` (for `expired`: once the timer has expired), waits for
//! WORKDIR/go, checks, and prints an `... OK` / `... FAIL: why` line and `OK`
//! or `FAIL: ...`.

use cr_tests::wl;

const PERIOD_NS: u64 = 10_000_000;
const HOUR_NS: u64 = 3600 * 1_000_000_000;

fn ts(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

fn ns(t: libc::timespec) -> u64 {
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn timer(clock: i32, flags: i32, value: u64, interval: u64) -> i32 {
    // SAFETY: timerfd_create has no pointer arguments.
    let fd = unsafe { libc::timerfd_create(clock, libc::TFD_NONBLOCK) };
    if fd < 0 {
        wl::fail(&format!(
            "timerfd_create: {}",
            std::io::Error::last_os_error()
        ));
    }
    let it = libc::itimerspec {
        it_interval: ts(interval),
        it_value: ts(value),
    };
    // SAFETY: it is a valid itimerspec.
    if unsafe { libc::timerfd_settime(fd, flags, &it, std::ptr::null_mut()) } != 0 {
        wl::fail(&format!(
            "timerfd_settime: {}",
            std::io::Error::last_os_error()
        ));
    }
    fd
}

fn gettime(fd: i32) -> (u64, u64) {
    // SAFETY: itimerspec is plain old data.
    let mut it: libc::itimerspec = unsafe { std::mem::zeroed() };
    // SAFETY: it is a valid, writable itimerspec.
    unsafe { libc::timerfd_gettime(fd, &mut it) };
    (ns(it.it_value), ns(it.it_interval))
}

fn read_ticks(fd: i32) -> Result<u64, String> {
    let mut v = 0u64;
    // SAFETY: v is 8 writable bytes.
    let n = unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
    if n == 8 {
        Ok(v)
    } else {
        Err(std::io::Error::last_os_error().to_string())
    }
}

/// Wait until `fd` is readable (without reading it), at most `ms`.
fn wait_readable(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd of ours.
    unsafe { libc::poll(&mut p, 1, ms) == 1 }
}

fn fdinfo(fd: i32) -> String {
    std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("ticks") || l.starts_with("it_"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn main() {
    let args = wl::args("wl_ipc_timer WORKDIR expired|absolute");
    let mode = args.rest.first().cloned().unwrap_or_default();
    let state = wl::ProcState::setup(&args.workdir);
    let go = wl::Go::new(&args.workdir);
    let mut problems = Vec::new();
    match mode.as_str() {
        "expired" => expired(&go, &mut problems),
        "absolute" => absolute(&go, &mut problems),
        other => wl::fail(&format!("unknown mode {other:?}")),
    }
    state.verify(&mut problems);
    wl::finish(&problems);
}

fn expired(go: &wl::Go, problems: &mut Vec<String>) {
    let periodic = timer(libc::CLOCK_MONOTONIC, 0, PERIOD_NS, PERIOD_NS);
    // Let the timer expire (and stay expired: nobody reads it).
    if !wait_readable(periodic, 10_000) {
        wl::fail(&format!("the timer never expired ({})", fdinfo(periodic)));
    }
    wl::note(&format!("before: {}", fdinfo(periodic)));
    wl::say("READY");
    go.wait();
    let mut p = Vec::new();
    let (_, interval) = gettime(periodic);
    if interval != PERIOD_NS {
        p.push(format!(
            "interval is {interval} ns, was {PERIOD_NS} ({})",
            fdinfo(periodic)
        ));
    }
    match read_ticks(periodic) {
        Ok(n) if n >= 1 => {}
        other => p.push(format!(
            "the expiration before the checkpoint: read {other:?}"
        )),
    }
    // It keeps running: two more expirations arrive (each within 10 s).
    let mut later = 0;
    while later < 2 && wait_readable(periodic, 10_000) {
        later += read_ticks(periodic).unwrap_or(0);
    }
    if later < 2 {
        p.push(format!(
            "after the restore: {later} more ticks, want >= 2 ({})",
            fdinfo(periodic)
        ));
    }
    if p.is_empty() {
        wl::say("expired periodic timerfd OK");
    } else {
        wl::say(&format!("expired periodic timerfd FAIL: {}", p.join("; ")));
        problems.extend(p);
    }
}

fn absolute(go: &wl::Go, problems: &mut Vec<String>) {
    let due = wl::clock_ns(libc::CLOCK_REALTIME) + HOUR_NS;
    let abs = timer(libc::CLOCK_REALTIME, libc::TFD_TIMER_ABSTIME, due, 0);
    wl::say("READY");
    go.wait();
    let mut p = Vec::new();
    let (value, interval) = gettime(abs);
    let now = wl::clock_ns(libc::CLOCK_REALTIME);
    let left_want = due.saturating_sub(now);
    if interval != 0 || value.abs_diff(left_want) > 500_000_000 {
        p.push(format!(
            "absolute timer: {value} ns left, want {left_want} (due at the same wall-clock time)"
        ));
    }
    if p.is_empty() {
        wl::say("absolute timerfd OK");
    } else {
        wl::say(&format!("absolute timerfd FAIL: {}", p.join("; ")));
        problems.extend(p);
    }
}
