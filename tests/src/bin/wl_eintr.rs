//! wl_eintr WORKDIR
//!
//! Threads that sit in system calls which return EINTR on any signal, SA_RESTART
//! or not, each in a loop with a short timeout:
//!
//! | thread    | call                                                 | normal result  |
//! |-----------|------------------------------------------------------|----------------|
//! | epoll     | epoll_wait(epfd of an idle pipe, 150 ms)             | 0              |
//! | epoll_p   | epoll_pwait(same, 150 ms, empty mask)                | 0              |
//! | sigwait   | rt_sigtimedwait(SIGUSR2 (blocked), 150 ms)           | EAGAIN         |
//! | semop     | semtimedop(private semaphore at 0, wait for 1, 150ms)| EAGAIN         |
//! | recv      | recv on a socketpair with SO_RCVTIMEO 150 ms         | EAGAIN         |
//!
//! No signal is ever sent to this process, so an EINTR can only come from the
//! checkpointer stopping it: the freeze must be invisible. Prints `READY`, runs
//! until `go` exists, then prints OK, or FAIL with the calls that saw EINTR.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cr_tests::wl;

const TIMEOUT_MS: i32 = 150;

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn must(what: &str, r: libc::c_long) -> libc::c_long {
    if r < 0 {
        wl::fail(&format!("{what}: {}", std::io::Error::last_os_error()));
    }
    r
}

/// One call of a thread's loop: Ok(()) for the normal result, Err(errno).
type Call = Box<dyn FnMut() -> Result<(), i32> + Send>;

fn calls(rcv_sock: &mut i32, sem_id: &mut i32) -> Vec<(&'static str, Call)> {
    let mut pipe = [0i32; 2];
    // SAFETY: pipe writes two fds into the array.
    must("pipe", unsafe { libc::pipe(pipe.as_mut_ptr()) } as _);
    // SAFETY: plain syscall.
    let ep = must("epoll_create1", unsafe { libc::epoll_create1(0) } as _) as i32;
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 7,
    };
    // SAFETY: ev is a valid epoll_event.
    must(
        "epoll_ctl",
        unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, pipe[0], &mut ev) } as _,
    );

    // SAFETY: a private semaphore set of one semaphore (value 0).
    let sem = must(
        "semget",
        unsafe { libc::semget(libc::IPC_PRIVATE, 1, 0o600) } as _,
    ) as i32;

    let mut sp = [0i32; 2];
    // SAFETY: socketpair writes two fds into the array.
    must("socketpair", unsafe {
        libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM, 0, sp.as_mut_ptr())
    } as _);
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: TIMEOUT_MS as i64 * 1000,
    };
    // SAFETY: tv is a valid timeval of the given size.
    must("setsockopt", unsafe {
        libc::setsockopt(
            sp[0],
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as u32,
        )
    } as _);

    *rcv_sock = sp[0];
    *sem_id = sem;
    let timed = |r: libc::c_long, normal: i32| -> Result<(), i32> {
        match r {
            0.. => Ok(()),
            _ if errno() == normal => Ok(()),
            _ => Err(errno()),
        }
    };
    vec![
        (
            "epoll_wait",
            Box::new(move || {
                let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
                // SAFETY: out has room for 4 events.
                let r = unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 4, TIMEOUT_MS) };
                timed(r as _, 0)
            }) as Call,
        ),
        (
            "epoll_pwait",
            Box::new(move || {
                let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
                // SAFETY: sigset_t is plain data, emptied before use.
                let mut none: libc::sigset_t = unsafe { std::mem::zeroed() };
                // SAFETY: none is a valid sigset_t.
                unsafe { libc::sigemptyset(&mut none) };
                // SAFETY: out has room for 4 events; none is a valid mask.
                let r = unsafe { libc::epoll_pwait(ep, out.as_mut_ptr(), 4, TIMEOUT_MS, &none) };
                timed(r as _, 0)
            }),
        ),
        (
            "rt_sigtimedwait",
            Box::new(move || {
                // SAFETY: sigset_t is plain data, emptied before use.
                let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
                // SAFETY: set is a valid sigset_t.
                unsafe {
                    libc::sigemptyset(&mut set);
                    libc::sigaddset(&mut set, libc::SIGUSR2);
                }
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: TIMEOUT_MS as i64 * 1_000_000,
                };
                // SAFETY: valid set and timespec; no siginfo wanted.
                let r = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &ts) };
                timed(r as _, libc::EAGAIN)
            }),
        ),
        (
            "semtimedop",
            Box::new(move || {
                // Wait for the value to be 0 after taking 1: blocks, it is 0.
                let mut op = libc::sembuf {
                    sem_num: 0,
                    sem_op: -1,
                    sem_flg: 0,
                };
                let ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: TIMEOUT_MS as i64 * 1_000_000,
                };
                // SAFETY: one valid sembuf and a valid timespec.
                let r = unsafe { libc::syscall(libc::SYS_semtimedop, sem, &mut op, 1, &ts) };
                timed(r, libc::EAGAIN)
            }),
        ),
        (
            "recv",
            Box::new(move || {
                let mut b = [0u8; 16];
                // SAFETY: b is a valid buffer of its length.
                let r = unsafe { libc::recv(sp[0], b.as_mut_ptr().cast(), b.len(), 0) };
                timed(r as _, libc::EAGAIN)
            }),
        ),
    ]
}

/// SO_RCVTIMEO of `sock` as (seconds, microseconds).
fn rcvtimeo(sock: i32) -> (i64, i64) {
    let mut tv = libc::timeval {
        tv_sec: -1,
        tv_usec: -1,
    };
    let mut len = std::mem::size_of::<libc::timeval>() as u32;
    // SAFETY: tv and len are valid for getsockopt to write.
    unsafe {
        libc::getsockopt(
            sock,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &mut tv as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    (tv.tv_sec, tv.tv_usec)
}

fn main() {
    let a = wl::args("wl_eintr WORKDIR");
    // SIGUSR2 blocked in every thread, so rt_sigtimedwait waits for it.
    // SAFETY: sigset_t is plain data, emptied before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a valid sigset_t.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGUSR2);
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    let (mut rcv_sock, mut sem) = (-1, -1);
    for (name, mut call) in calls(&mut rcv_sock, &mut sem) {
        let stop = stop.clone();
        let rounds = rounds.clone();
        threads.push(std::thread::spawn(move || {
            let mut eintr = 0u64;
            let mut other = None;
            while !stop.load(Ordering::SeqCst) {
                match call() {
                    Ok(()) => {}
                    Err(libc::EINTR) => eintr += 1,
                    Err(e) => other = Some(e),
                }
                rounds.fetch_add(1, Ordering::SeqCst);
            }
            (name, eintr, other)
        }));
    }
    // Every thread has been round its loop once before READY.
    while rounds.load(Ordering::SeqCst) < 10 {
        std::thread::sleep(Duration::from_millis(10));
    }
    // As the kernel reports it (rounded to its clock ticks).
    let before = rcvtimeo(rcv_sock);
    wl::say("READY");
    wl::Go::new(&a.workdir).wait();
    let mut problems = Vec::new();
    // The receive timeout survives too (else the recv thread never ends).
    let after = rcvtimeo(rcv_sock);
    if after != before {
        problems.push(format!("SO_RCVTIMEO was {before:?}, is {after:?}"));
        // SAFETY: as below.
        unsafe { libc::semctl(sem, 0, libc::IPC_RMID) };
        wl::finish(&problems);
    }
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        let (name, eintr, other) = t.join().expect("thread");
        if eintr > 0 {
            problems.push(format!("{name} saw EINTR {eintr} times"));
        }
        if let Some(e) = other {
            problems.push(format!("{name} failed with errno {e}"));
        }
    }
    // SAFETY: removes our private semaphore set; no memory involved.
    unsafe { libc::semctl(sem, 0, libc::IPC_RMID) };
    wl::finish(&problems);
}
