//! Workload: signal state across checkpoint/restore, checked from inside.
//!
//! Before READY it blocks SIGRTMIN+1 and SIGUSR2, queues two real-time
//! signals carrying payloads 4242 and 4343 and one SIGUSR2, installs an
//! alternate signal stack with an SA_ONSTACK handler for SIGUSR1, and arms
//! ITIMER_REAL (`ARM_MS` milliseconds). After `<workdir>/go` appears it
//! unblocks the signals and checks: both payloads arrive in order, SIGUSR2
//! once, the SIGUSR1 handler runs on the alternate stack, and SIGALRM fires.
//! Prints OK or FAIL: reason.
//!
//! Usage: wl_signals WORKDIR [ARM_MS]

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

static RT_COUNT: AtomicUsize = AtomicUsize::new(0);
static RT_VALUES: [AtomicI32; 4] = [const { AtomicI32::new(0) }; 4];
static USR2: AtomicUsize = AtomicUsize::new(0);
static ALRM: AtomicUsize = AtomicUsize::new(0);
static USR1_SP: AtomicU64 = AtomicU64::new(0);

const ALT_SIZE: usize = 64 * 1024;
static mut ALT_STACK: [u8; ALT_SIZE] = [0; ALT_SIZE];

extern "C" fn on_rt(_sig: i32, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let v = unsafe { (*info).si_value().sival_ptr as usize as i32 };
    let i = RT_COUNT.fetch_add(1, Ordering::SeqCst);
    if i < 4 {
        RT_VALUES[i].store(v, Ordering::SeqCst);
    }
}

extern "C" fn on_usr2(_: i32) {
    USR2.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_alrm(_: i32) {
    ALRM.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_usr1(_: i32) {
    let local = 0u8;
    USR1_SP.store(&local as *const u8 as u64, Ordering::SeqCst);
}

fn install(sig: i32, handler: usize, flags: i32) {
    // SAFETY: plain sigaction with a handler of the right signature.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler;
        sa.sa_flags = flags;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
    }
}

fn say(s: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn sleep_ms(ms: u64) {
    std::thread::sleep(std::time::Duration::from_millis(ms));
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = std::path::PathBuf::from(&args[1]);
    let arm_ms: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(4000);
    let rt = libc::SIGRTMIN() + 1;
    install(rt, on_rt as *const () as usize, libc::SA_SIGINFO);
    install(libc::SIGUSR2, on_usr2 as *const () as usize, 0);
    install(
        libc::SIGALRM,
        on_alrm as *const () as usize,
        libc::SA_RESTART,
    );
    install(
        libc::SIGUSR1,
        on_usr1 as *const () as usize,
        libc::SA_ONSTACK,
    );
    // SAFETY: plain libc calls on valid, process-lifetime memory.
    let alt_base = unsafe {
        let base = std::ptr::addr_of_mut!(ALT_STACK) as *mut u8;
        let ss = libc::stack_t {
            ss_sp: base.cast(),
            ss_flags: 0,
            ss_size: ALT_SIZE,
        };
        assert_eq!(libc::sigaltstack(&ss, std::ptr::null_mut()), 0);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, rt);
        libc::sigaddset(&mut set, libc::SIGUSR2);
        assert_eq!(
            libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()),
            0
        );
        for v in [4242usize, 4343] {
            let val = libc::sigval {
                sival_ptr: v as *mut libc::c_void,
            };
            assert_eq!(libc::sigqueue(libc::getpid(), rt, val), 0);
        }
        libc::raise(libc::SIGUSR2);
        let it = libc::itimerval {
            it_interval: libc::timeval {
                tv_sec: 0,
                tv_usec: 0,
            },
            it_value: libc::timeval {
                tv_sec: (arm_ms / 1000) as i64,
                tv_usec: ((arm_ms % 1000) * 1000) as i64,
            },
        };
        assert_eq!(
            libc::setitimer(libc::ITIMER_REAL, &it, std::ptr::null_mut()),
            0
        );
        base as u64
    };
    say("READY");
    while !dir.join("go").exists() {
        sleep_ms(20);
    }
    let mut fails = Vec::new();
    if ALRM.load(Ordering::SeqCst) != 0 {
        fails.push(
            "SIGALRM fired before go (timer not restored with its remaining time?)".to_string(),
        );
    }
    // SAFETY: plain libc calls.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, rt);
        libc::sigaddset(&mut set, libc::SIGUSR2);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::raise(libc::SIGUSR1);
    }
    let got: Vec<i32> = (0..RT_COUNT.load(Ordering::SeqCst).min(4))
        .map(|i| RT_VALUES[i].load(Ordering::SeqCst))
        .collect();
    if got != [4242, 4343] {
        fails.push(format!("real-time payloads {got:?}, expected [4242, 4343]"));
    }
    if USR2.load(Ordering::SeqCst) != 1 {
        fails.push(format!(
            "SIGUSR2 delivered {} times",
            USR2.load(Ordering::SeqCst)
        ));
    }
    let sp = USR1_SP.load(Ordering::SeqCst);
    if !(alt_base..alt_base + ALT_SIZE as u64).contains(&sp) {
        fails.push(format!(
            "SIGUSR1 handler ran at sp {sp:#x}, not on the alternate stack"
        ));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(arm_ms + 10_000);
    while ALRM.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
        sleep_ms(10);
    }
    if ALRM.load(Ordering::SeqCst) != 1 {
        fails.push("SIGALRM (ITIMER_REAL) never fired".to_string());
    }
    if fails.is_empty() {
        say("OK");
    } else {
        say(&format!("FAIL: {}", fails.join("; ")));
        std::process::exit(1);
    }
}
