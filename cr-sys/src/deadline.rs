//! A deadline for a blocking system call of the calling thread, so that a
//! tracer can sleep in `waitpid` until its tracee stops instead of polling
//! it, and still never wait for good.
//!
//! Each thread that asks gets a POSIX timer of its own (`timer_create` with
//! `SIGEV_THREAD_ID`: the signal goes to that thread, never to another one
//! of the process) that sends [`wake_signal`]. Its handler does nothing and
//! is installed without `SA_RESTART`, so a blocking call the signal
//! interrupts returns `EINTR`; the caller then looks at the clock.
//!
//! Where the kernel surprises: a signal that fires after the caller's last
//! look at the clock but before it entered the blocking call is handled on
//! the way into the call and interrupts nothing; the call would then sleep
//! on. So the timer fires again every [`REFIRE`] after the deadline until
//! it is disarmed. Once `timer_settime` has disarmed it, no signal of it
//! can come any more (one already queued is handled on the return from
//! that very call), so nothing later in the thread is interrupted.
//!
//! A thread without a timer (the signal's action is someone else's, or the
//! kernel refused a timer) gets `None` and the caller polls instead.

use crate::error::Errno;
use std::cell::OnceCell;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tracing::debug;

/// How often the timer fires again once the deadline has passed.
pub const REFIRE: Duration = Duration::from_millis(5);

/// The signal of the per-thread timers: SIGRTMAX - 1 (glibc keeps the
/// lowest realtime signals for itself; nothing of ours uses this one).
pub fn wake_signal() -> i32 {
    libc::SIGRTMAX() - 1
}

extern "C" fn on_wake(_sig: libc::c_int) {}

/// Install the do-nothing handler once per process; false when the signal
/// already has an action of someone else's (then it is left alone).
fn handler_installed() -> bool {
    static INSTALLED: OnceLock<bool> = OnceLock::new();
    *INSTALLED.get_or_init(|| {
        let sig = wake_signal();
        // SAFETY: sigaction is plain data; zeroed is a valid empty value.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: a query (act NULL) of a valid signal into our local.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &mut old) } != 0 {
            return false;
        }
        if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != on_wake as *const () as usize {
            debug!(
                sig,
                "the deadline signal has an action of its own; tracers poll"
            );
            return false;
        }
        // SAFETY: as above.
        let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
        sa.sa_sigaction = on_wake as *const () as usize;
        // No SA_RESTART: the interrupted call must return EINTR.
        sa.sa_flags = 0;
        // SAFETY: sa_mask is a valid sigset_t inside our local.
        unsafe { libc::sigemptyset(&mut sa.sa_mask) };
        // SAFETY: a valid action whose handler is async-signal-safe (empty).
        unsafe { libc::sigaction(sig, &sa, std::ptr::null_mut()) == 0 }
    })
}

/// The calling thread's timer (its kernel id), deleted when the thread ends.
struct ThreadTimer(libc::c_int);

impl ThreadTimer {
    fn create() -> Result<ThreadTimer, Errno> {
        let sig = wake_signal();
        // SAFETY: sigevent is plain data (a union and padding); zeroed is valid.
        let mut sev: libc::sigevent = unsafe { std::mem::zeroed() };
        sev.sigev_notify = libc::SIGEV_THREAD_ID;
        sev.sigev_signo = sig;
        // SAFETY: gettid has no preconditions.
        sev.sigev_notify_thread_id = unsafe { libc::gettid() };
        let mut id: libc::c_int = 0;
        // Raw: glibc's timer_t wraps the kernel's id for SIGEV_THREAD.
        // SAFETY: sev and id are valid for the call's duration.
        let r = unsafe {
            libc::syscall(
                libc::SYS_timer_create,
                libc::CLOCK_MONOTONIC,
                &mut sev as *mut libc::sigevent,
                &mut id as *mut libc::c_int,
            )
        };
        if r != 0 {
            return Err(Errno::last());
        }
        // The thread may have inherited a mask blocking the signal: a
        // blocked one would never interrupt anything.
        // SAFETY: set is a valid sigset_t on our stack.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, sig);
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
        Ok(ThreadTimer(id))
    }

    /// Arm (first expiry `first` from now, then every `every`); zero disarms.
    fn set(&self, first: Duration, every: Duration) -> Result<(), Errno> {
        let ts = |d: Duration| libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        let spec = libc::itimerspec {
            it_interval: ts(every),
            it_value: ts(first),
        };
        // SAFETY: spec is valid for the call; the old value is not asked for.
        let r = unsafe {
            libc::syscall(
                libc::SYS_timer_settime,
                self.0,
                0,
                &spec as *const libc::itimerspec,
                std::ptr::null_mut::<libc::itimerspec>(),
            )
        };
        if r != 0 {
            return Err(Errno::last());
        }
        Ok(())
    }
}

/// Ask `ready` every `every` until it answers or `limit` has passed:
/// `Ok(Some(..))` with the first answer, `Ok(None)` when the time is up
/// (the caller says what never came). For a state the kernel offers no
/// wait for: a socket's queues or TCP state, which move on their own
/// within a moment.
pub fn poll<T, E>(
    limit: Duration,
    every: Duration,
    mut ready: impl FnMut() -> Result<Option<T>, E>,
) -> Result<Option<T>, E> {
    let end = Instant::now() + limit;
    loop {
        if let Some(t) = ready()? {
            return Ok(Some(t));
        }
        if Instant::now() >= end {
            return Ok(None);
        }
        std::thread::sleep(every);
    }
}

#[cfg(test)]
impl ThreadTimer {
    /// Time left to its next expiry (zero: disarmed).
    fn left(&self) -> Duration {
        let mut spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
        };
        // SAFETY: spec is a writable itimerspec for the kernel to fill.
        let r = unsafe {
            libc::syscall(
                libc::SYS_timer_gettime,
                self.0,
                &mut spec as *mut libc::itimerspec,
            )
        };
        assert_eq!(r, 0, "timer_gettime: {}", Errno::last());
        Duration::new(spec.it_value.tv_sec as u64, spec.it_value.tv_nsec as u32)
    }
}

impl Drop for ThreadTimer {
    fn drop(&mut self) {
        // SAFETY: deletes our own timer id; no memory is passed.
        unsafe { libc::syscall(libc::SYS_timer_delete, self.0) };
    }
}

thread_local! {
    /// The thread's timer, made on first use (None: this thread polls).
    static TIMER: OnceCell<Option<ThreadTimer>> = const { OnceCell::new() };
}

/// Run `call` (one blocking system call that returns `Err(EINTR)` when a
/// signal interrupts it) until it returns something else or `deadline`
/// passes (`Some(Err(ETIMEDOUT))`), the calling thread's timer armed for the
/// deadline. `None` when this thread has no timer: the caller polls.
/// `EINTR` before the deadline (another signal) calls again.
pub fn blocking<T>(
    deadline: Instant,
    mut call: impl FnMut() -> Result<T, Errno>,
) -> Option<Result<T, Errno>> {
    TIMER.with(|cell| {
        let timer = cell.get_or_init(|| {
            if !handler_installed() {
                return None;
            }
            match ThreadTimer::create() {
                Ok(t) => Some(t),
                Err(e) => {
                    debug!(error = %e, "no timer for a deadline; this thread polls");
                    None
                }
            }
        });
        let timer = timer.as_ref()?;
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Some(Err(Errno(libc::ETIMEDOUT)));
        }
        if let Err(e) = timer.set(left, REFIRE) {
            debug!(error = %e, "cannot arm the deadline timer; polling");
            return None;
        }
        let out = loop {
            match call() {
                Err(e) if e.0 == libc::EINTR => {
                    if Instant::now() >= deadline {
                        break Err(Errno(libc::ETIMEDOUT));
                    }
                }
                other => break other,
            }
        };
        // Disarming cannot fail for our own valid timer; if it did, the
        // signal would still only ever run the empty handler.
        let _ = timer.set(Duration::ZERO, Duration::ZERO);
        Some(out)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A read of a pipe nobody writes returns at the deadline, not before,
    /// and the thread is not interrupted afterwards.
    #[test]
    fn a_blocked_read_returns_at_the_deadline() {
        let (r, _w) = nix::unistd::pipe().unwrap();
        use std::os::fd::AsRawFd;
        let fd = r.as_raw_fd();
        let start = Instant::now();
        let got = blocking(start + Duration::from_millis(50), || {
            let mut b = [0u8; 1];
            // SAFETY: b is a valid 1-byte buffer.
            let n = unsafe { libc::read(fd, b.as_mut_ptr().cast(), 1) };
            if n < 0 {
                Err(Errno::last())
            } else {
                Ok(n)
            }
        })
        .expect("a timer for this thread");
        let took = start.elapsed();
        assert_eq!(got.unwrap_err().0, libc::ETIMEDOUT);
        assert!(took >= Duration::from_millis(50), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        // Disarmed: nothing can interrupt the thread afterwards.
        let left = TIMER.with(|t| t.get().and_then(Option::as_ref).map(ThreadTimer::left));
        assert_eq!(
            left,
            Some(Duration::ZERO),
            "the thread's timer after the call"
        );
    }

    /// A call that returns at once is not delayed, on several threads.
    #[test]
    fn quick_calls_on_many_threads() {
        let hs: Vec<_> = (0..8)
            .map(|_| {
                std::thread::spawn(|| {
                    for _ in 0..100 {
                        let r = blocking(Instant::now() + Duration::from_secs(5), || Ok(7));
                        assert_eq!(r.unwrap().unwrap(), 7);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
    }
}
