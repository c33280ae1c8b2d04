//! wl_block WORKDIR MODE [SECONDS]
//!
//! Prints `READY` and blocks in one raw syscall, the state a checkpoint finds it in:
//!
//! | MODE             | syscall                                       | wakes up by   |
//! |------------------|-----------------------------------------------|---------------|
//! | nanosleep        | nanosleep(SECONDS, &rem)                      | timeout       |
//! | nanosleep-norem  | nanosleep(SECONDS, NULL)                      | timeout       |
//! | clock            | clock_nanosleep(MONOTONIC, 0, SECONDS, &rem)  | timeout       |
//! | abs              | clock_nanosleep(MONOTONIC, TIMER_ABSTIME, t)  | timeout       |
//! | poll             | poll(NULL, 0, SECONDS*1000)                   | timeout       |
//! | select           | select(0, NULL, NULL, NULL, SECONDS)          | timeout       |
//! | pause            | pause()                                       | SIGUSR1       |
//! | sigsuspend       | rt_sigsuspend(mask without SIGUSR1)           | SIGUSR1       |
//! | altstack         | pause(), SIGUSR1 handler SA_ONSTACK on a      | SIGUSR1       |
//! |                  | sigaltstack: must run on that stack           |               |
//! | pending          | pause() with a SIGHUP pending (blocked): once | SIGUSR1       |
//! |                  | unblocked after restore, its handler must run |               |
//!
//! Timed modes must return 0 (never EINTR) no earlier than asked; signal modes must
//! return EINTR after the restored SIGUSR1 handler ran. In every mode the signal
//! handlers (handler, flags, mask) and the blocked mask must be as before, as must
//! pid, cwd and umask. Prints `elapsed_ms N`, then OK or FAIL.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use cr_tests::wl;

static USR1_COUNT: AtomicU32 = AtomicU32::new(0);
static HUP_COUNT: AtomicU32 = AtomicU32::new(0);
static USR1_SP: AtomicUsize = AtomicUsize::new(0);

const ALT_SIZE: usize = 256 * 1024;

extern "C" fn on_usr1(_sig: libc::c_int) {
    let local = 0u8;
    USR1_SP.store(
        std::hint::black_box(&local) as *const u8 as usize,
        Ordering::SeqCst,
    );
    USR1_COUNT.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_hup(_sig: libc::c_int) {
    HUP_COUNT.fetch_add(1, Ordering::SeqCst);
}

fn altstack() -> (usize, usize, i32) {
    // SAFETY: stack_t is plain data; querying only.
    let mut ss: libc::stack_t = unsafe { std::mem::zeroed() };
    // SAFETY: querying only (new stack is NULL).
    unsafe { libc::sigaltstack(std::ptr::null(), &mut ss) };
    (ss.ss_sp as usize, ss.ss_size, ss.ss_flags)
}

fn sigset(sigs: &[i32]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for &s in sigs {
        // SAFETY: set is a valid sigset_t, s a valid signal number.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    set
}

fn members(set: &libc::sigset_t) -> Vec<i32> {
    // SAFETY: set is a valid sigset_t.
    (1..65)
        .filter(|&s| unsafe { libc::sigismember(set, s) } == 1)
        .collect()
}

fn current_mask() -> Vec<i32> {
    // SAFETY: sigset_t is plain data.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: querying the mask only (set is NULL).
    unsafe { libc::sigprocmask(libc::SIG_BLOCK, std::ptr::null(), &mut old) };
    members(&old)
}

/// (handler, flags without SA_RESTORER, mask members) of a signal.
fn action_of(sig: i32) -> (usize, i32, Vec<i32>) {
    // SAFETY: sigaction is plain data.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: querying only (act is NULL).
    unsafe { libc::sigaction(sig, std::ptr::null(), &mut sa) };
    (sa.sa_sigaction, sa.sa_flags, members(&sa.sa_mask))
}

fn ts(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn main() {
    let args = wl::args("wl_block WORKDIR MODE [SECONDS]");
    let mode = args.rest.first().cloned().unwrap_or_default();
    let secs: u64 = args
        .rest
        .get(1)
        .map(|s| s.parse().unwrap_or_else(|_| wl::fail("bad SECONDS")))
        .unwrap_or(3);
    let state = wl::ProcState::setup(&args.workdir);

    // Signal state: a SIGUSR1 handler with a mask, SIGUSR2 ignored, SIGHUP blocked
    // (and SIGUSR1 too in sigsuspend mode, where only sigsuspend unblocks it).
    // SAFETY: sigaction is plain data.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_usr1 as *const () as usize;
    sa.sa_mask = sigset(&[libc::SIGTERM, libc::SIGWINCH]);
    sa.sa_flags = libc::SA_NODEFER;
    let mut alt: Option<(usize, usize)> = None;
    if mode == "altstack" {
        let stack = Box::leak(vec![0u8; ALT_SIZE].into_boxed_slice());
        let ss = libc::stack_t {
            ss_sp: stack.as_mut_ptr().cast(),
            ss_flags: 0,
            ss_size: ALT_SIZE,
        };
        // SAFETY: ss describes a leaked (never freed) buffer.
        if unsafe { libc::sigaltstack(&ss, std::ptr::null_mut()) } != 0 {
            wl::fail("sigaltstack");
        }
        alt = Some((stack.as_ptr() as usize, ALT_SIZE));
        sa.sa_flags |= libc::SA_ONSTACK;
    }
    if mode == "pending" {
        // SAFETY: sigaction is plain data.
        let mut hup: libc::sigaction = unsafe { std::mem::zeroed() };
        hup.sa_sigaction = on_hup as *const () as usize;
        // SAFETY: a valid sigaction with an async-signal-safe handler.
        unsafe { libc::sigaction(libc::SIGHUP, &hup, std::ptr::null_mut()) };
    }
    // SAFETY: sa is a valid sigaction with an async-signal-safe handler.
    if unsafe { libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) } != 0 {
        wl::fail("sigaction SIGUSR1");
    }
    // SAFETY: setting SIG_IGN is always safe.
    unsafe { libc::signal(libc::SIGUSR2, libc::SIG_IGN) };
    let blocked: &[i32] = if mode == "sigsuspend" {
        &[libc::SIGHUP, libc::SIGUSR1]
    } else {
        &[libc::SIGHUP]
    };
    let block = sigset(blocked);
    // SAFETY: block is a valid sigset_t.
    unsafe { libc::sigprocmask(libc::SIG_SETMASK, &block, std::ptr::null_mut()) };
    if mode == "pending" {
        // SIGHUP is blocked: this leaves it pending.
        // SAFETY: raise has no preconditions.
        unsafe { libc::raise(libc::SIGHUP) };
    }
    let mask_before = current_mask();
    let alt_before = altstack();
    let usr1_before = action_of(libc::SIGUSR1);
    let usr2_before = action_of(libc::SIGUSR2);
    if matches!(
        mode.as_str(),
        "pause" | "sigsuspend" | "altstack" | "pending"
    ) {
        // Nobody may wait forever: SIGALRM (default action: terminate).
        // SAFETY: alarm has no preconditions.
        unsafe { libc::alarm(wl::SELF_TIMEOUT.as_secs() as u32) };
    }

    let req_ns = secs * 1_000_000_000;
    let mut problems = Vec::new();
    let t0 = wl::mono_ns();
    wl::say("READY");
    let (ret, err, extra) = match mode.as_str() {
        "nanosleep" | "nanosleep-norem" => {
            let req = ts(req_ns);
            let mut rem = ts(0);
            let remp: *mut libc::timespec = if mode == "nanosleep" {
                &mut rem
            } else {
                std::ptr::null_mut()
            };
            // SAFETY: req is valid, remp is valid or NULL.
            let r = unsafe { libc::syscall(libc::SYS_nanosleep, &req, remp) };
            (r, errno(), format!("rem {}.{:09}", rem.tv_sec, rem.tv_nsec))
        }
        "clock" => {
            let req = ts(req_ns);
            let mut rem = ts(0);
            // SAFETY: req and rem are valid timespecs.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_clock_nanosleep,
                    libc::CLOCK_MONOTONIC,
                    0,
                    &req,
                    &mut rem,
                )
            };
            (r, errno(), format!("rem {}.{:09}", rem.tv_sec, rem.tv_nsec))
        }
        "abs" => {
            let target = ts(t0 + req_ns);
            // SAFETY: target is a valid timespec, rem is NULL.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_clock_nanosleep,
                    libc::CLOCK_MONOTONIC,
                    libc::TIMER_ABSTIME,
                    &target,
                    std::ptr::null_mut::<libc::timespec>(),
                )
            };
            (r, errno(), String::new())
        }
        "poll" => {
            // SAFETY: no fds (NULL, 0) and a timeout.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_poll,
                    std::ptr::null_mut::<libc::pollfd>(),
                    0,
                    (secs * 1000) as libc::c_int,
                )
            };
            (r, errno(), String::new())
        }
        "select" => {
            let mut tv = libc::timeval {
                tv_sec: secs as libc::time_t,
                tv_usec: 0,
            };
            // SAFETY: no fd sets, a valid timeval.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_select,
                    0,
                    std::ptr::null_mut::<libc::fd_set>(),
                    std::ptr::null_mut::<libc::fd_set>(),
                    std::ptr::null_mut::<libc::fd_set>(),
                    &mut tv,
                )
            };
            (
                r,
                errno(),
                format!("tv left {}.{:06}", tv.tv_sec, tv.tv_usec),
            )
        }
        "pause" | "altstack" | "pending" => {
            // SAFETY: pause has no arguments.
            let r = unsafe { libc::syscall(libc::SYS_pause) };
            (r, errno(), String::new())
        }
        "sigsuspend" => {
            let during = sigset(&[libc::SIGHUP]);
            // SAFETY: during is a valid sigset; the kernel sigset size is 8.
            let r = unsafe { libc::syscall(libc::SYS_rt_sigsuspend, &during, 8usize) };
            (r, errno(), String::new())
        }
        other => wl::fail(&format!("unknown mode {other:?}")),
    };
    let t1 = wl::mono_ns();
    let elapsed_ms = (t1 - t0) / 1_000_000;
    wl::say(&format!("elapsed_ms {elapsed_ms}"));

    let usr1 = USR1_COUNT.load(Ordering::SeqCst);
    match mode.as_str() {
        "pause" | "sigsuspend" | "altstack" | "pending" => {
            if ret != -1 || err != libc::EINTR {
                problems.push(format!(
                    "{mode} returned {ret} (errno {err}), expected -1/EINTR"
                ));
            }
            if usr1 != 1 {
                problems.push(format!("SIGUSR1 handler ran {usr1} times, expected 1"));
            }
        }
        _ => {
            if ret != 0 {
                problems.push(format!(
                    "{mode} returned {ret} (errno {err}, {extra}), expected 0"
                ));
            }
            if usr1 != 0 {
                problems.push(format!("SIGUSR1 handler ran {usr1} times, expected 0"));
            }
            if mode == "abs" {
                if t1 < t0 + req_ns {
                    problems.push(format!(
                        "woke {} ms before the absolute deadline",
                        (t0 + req_ns - t1) / 1_000_000
                    ));
                }
            } else if t1 - t0 + 20_000_000 < req_ns {
                problems.push(format!(
                    "{mode} slept only {elapsed_ms} ms of {} ms",
                    secs * 1000
                ));
            }
        }
    }
    let mask_after = current_mask();
    if mask_after != mask_before {
        problems.push(format!("blocked mask {mask_after:?}, was {mask_before:?}"));
    }
    let usr1_after = action_of(libc::SIGUSR1);
    if usr1_after != usr1_before {
        problems.push(format!(
            "SIGUSR1 action {usr1_after:?}, was {usr1_before:?}"
        ));
    }
    let usr2_after = action_of(libc::SIGUSR2);
    if usr2_after != usr2_before {
        problems.push(format!(
            "SIGUSR2 action {usr2_after:?}, was {usr2_before:?}"
        ));
    }
    let alt_after = altstack();
    if alt_after != alt_before {
        problems.push(format!(
            "sigaltstack is {alt_after:x?}, was {alt_before:x?}"
        ));
    }
    if let Some((lo, size)) = alt {
        let sp = USR1_SP.load(Ordering::SeqCst);
        if !(lo..lo + size).contains(&sp) {
            problems.push(format!(
                "SIGUSR1 handler ran with sp {sp:#x}, not on the alternate stack {lo:#x}+{size:#x}"
            ));
        }
    }
    if mode == "pending" {
        // SAFETY: sigset_t is plain data.
        let mut pend: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: pend is a valid sigset_t.
        unsafe { libc::sigpending(&mut pend) };
        if !members(&pend).contains(&libc::SIGHUP) {
            problems.push(format!(
                "SIGHUP is no longer pending (pending: {:?})",
                members(&pend)
            ));
        }
        let hup = sigset(&[libc::SIGHUP]);
        // SAFETY: unblocking SIGHUP, whose handler only counts.
        unsafe { libc::sigprocmask(libc::SIG_UNBLOCK, &hup, std::ptr::null_mut()) };
        let n = HUP_COUNT.load(Ordering::SeqCst);
        if n != 1 {
            problems.push(format!(
                "SIGHUP handler ran {n} times after unblocking, expected 1"
            ));
        }
    }
    state.verify(&mut problems);
    wl::finish(&problems);
}
