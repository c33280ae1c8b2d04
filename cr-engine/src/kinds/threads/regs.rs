//! Registers between ptrace's `user_regs_struct` and the image, and the
//! syscall-restart fix-ups of a restore.
//!
//! A thread checkpointed inside a system call has `orig_rax` = the syscall
//! and `rax` = -ERESTART*. The kernel would have re-run the call on resume;
//! the restored thread is not inside the kernel, so we do it by hand: point
//! `rip` back at the `syscall` instruction with `rax` = the syscall number.
//! -ERESTART_RESTARTBLOCK (relative sleeps, poll with timeout) has kernel
//! state we cannot carry over: relative nanosleeps resume with the time
//! that was left (the kernel wrote it to the caller's `rem`), poll and timed
//! futex waits restart, everything else returns -EINTR.

use cr_image::model::GpRegs;
use cr_sys::regs::{UserRegs, ERESTARTNOHAND, ERESTARTNOINTR, ERESTARTSYS, ERESTART_RESTARTBLOCK};

macro_rules! convert {
    ($($f:ident),*) => {
        /// Registers in their image form.
        pub fn to_model(r: &UserRegs) -> GpRegs {
            GpRegs { $($f: r.$f),* }
        }
        /// Registers as ptrace takes them.
        pub fn from_model(r: &GpRegs) -> UserRegs {
            let mut u = cr_sys::regs::zeroed();
            $(u.$f = r.$f;)*
            u
        }
    };
}
convert!(
    r15, r14, r13, r12, rbp, rbx, r11, r10, r9, r8, rax, rcx, rdx, rsi, rdi, orig_rax, rip, cs,
    eflags, rsp, ss, fs_base, gs_base, ds, es, fs, gs
);

/// System calls that return -EINTR when any signal — or a ptrace stop —
/// interrupts them, SA_RESTART or not: the epoll waits, sigtimedwait,
/// semop waits, AIO waits, and socket calls blocked under SO_RCVTIMEO /
/// SO_SNDTIMEO (the kernel restarts them by itself only without a timeout).
const EINTR_ON_STOP: &[i64] = &[
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_io_getevents,
    333, // io_pgetevents (not in the libc crate)
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_recvfrom,
    libc::SYS_recvmsg,
    libc::SYS_recvmmsg,
    libc::SYS_write,
    libc::SYS_writev,
    libc::SYS_sendto,
    libc::SYS_sendmsg,
    libc::SYS_sendmmsg,
    libc::SYS_accept,
    libc::SYS_accept4,
];

/// Hide our stop from a thread it pulled out of a system call.
///
/// PTRACE_INTERRUPT wakes a thread blocked in the calls of
/// [`EINTR_ON_STOP`] and they end with -EINTR, which the program would see
/// once we let it go (nginx logs one at every checkpoint). Where the
/// registers show such a call ending with -EINTR, they are changed to
/// -ERESTARTNOHAND: on resume the kernel runs the call again when no
/// handler is to run and still returns EINTR when a signal handler runs
/// first, which is what the program would have seen without us. A restore
/// runs it again too (see [`fix_syscall_restart`]). Returns whether `r`
/// was changed.
pub fn hide_stop_eintr(r: &mut UserRegs) -> bool {
    if r.rax as i64 != -(libc::EINTR as i64) || !EINTR_ON_STOP.contains(&(r.orig_rax as i64)) {
        return false;
    }
    r.rax = (-ERESTARTNOHAND) as u64;
    true
}

/// Apply the restart fix-ups to registers saved at checkpoint time.
pub fn fix_syscall_restart(r: &mut UserRegs) {
    let nr = r.orig_rax as i64;
    if nr < 0 {
        return;
    }
    let again = |r: &mut UserRegs| {
        r.rax = r.orig_rax;
        r.rip = r.rip.wrapping_sub(2);
    };
    match (r.rax as i64).wrapping_neg() {
        ERESTARTSYS | ERESTARTNOINTR | ERESTARTNOHAND => again(r),
        ERESTART_RESTARTBLOCK => match nr {
            // clock_nanosleep(clock, flags, req, rem): sleep what was left.
            libc::SYS_clock_nanosleep => {
                if r.r10 != 0 {
                    r.rdx = r.r10;
                }
                again(r)
            }
            // nanosleep(req, rem)
            libc::SYS_nanosleep => {
                if r.rsi != 0 {
                    r.rdi = r.rsi;
                }
                again(r)
            }
            // poll restarts with its full timeout; a timed futex wait re-checks
            // the futex word (absolute timeouts are exact, relative ones restart).
            libc::SYS_poll | libc::SYS_futex => again(r),
            _ => r.rax = (-libc::EINTR) as u64,
        },
        _ => {}
    }
    // The kernel must not apply its own restart logic on top.
    r.orig_rax = u64::MAX;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoll_eintr_becomes_a_restart() {
        let mut r = regs(libc::SYS_epoll_wait, -libc::EINTR as i64);
        assert!(hide_stop_eintr(&mut r));
        assert_eq!(r.rax as i64, -ERESTARTNOHAND);
        fix_syscall_restart(&mut r);
        assert_eq!((r.rax, r.rip), (libc::SYS_epoll_wait as u64, 0x1000));
    }

    #[test]
    fn other_results_are_left_alone() {
        for (nr, rax) in [
            (libc::SYS_epoll_wait, 3),
            (libc::SYS_openat, -libc::EINTR as i64),
            (-1, -libc::EINTR as i64),
        ] {
            let mut r = regs(nr, rax);
            assert!(!hide_stop_eintr(&mut r), "{nr} {rax}");
            assert_eq!(r.rax as i64, rax);
        }
    }

    fn regs(nr: i64, rax: i64) -> UserRegs {
        let mut r = cr_sys::regs::zeroed();
        r.orig_rax = nr as u64;
        r.rax = rax as u64;
        r.rip = 0x1002;
        r
    }

    #[test]
    fn restartable_syscall_runs_again() {
        let mut r = regs(libc::SYS_read, -ERESTARTSYS);
        fix_syscall_restart(&mut r);
        assert_eq!(
            (r.rax as i64, r.rip, r.orig_rax),
            (libc::SYS_read, 0x1000, u64::MAX)
        );
    }

    #[test]
    fn relative_sleep_resumes_with_remaining_time() {
        let mut r = regs(libc::SYS_clock_nanosleep, -ERESTART_RESTARTBLOCK);
        r.rdx = 0xaaa0;
        r.r10 = 0xbbb0;
        fix_syscall_restart(&mut r);
        assert_eq!(
            (r.rax as i64, r.rdx, r.rip),
            (libc::SYS_clock_nanosleep, 0xbbb0, 0x1000)
        );
    }

    #[test]
    fn other_restart_block_gets_eintr() {
        let mut r = regs(libc::SYS_ppoll, -ERESTART_RESTARTBLOCK);
        fix_syscall_restart(&mut r);
        assert_eq!((r.rax as i64, r.rip), (-libc::EINTR as i64, 0x1002));
    }

    #[test]
    fn finished_syscall_is_untouched() {
        let mut r = regs(libc::SYS_write, 5);
        fix_syscall_restart(&mut r);
        assert_eq!((r.rax, r.rip), (5, 0x1002));
    }

    #[test]
    fn registers_round_trip() {
        let mut u = cr_sys::regs::zeroed();
        u.rip = 1;
        u.gs = 27;
        u.fs_base = 0xabc;
        let back = from_model(&to_model(&u));
        assert_eq!((back.rip, back.gs, back.fs_base), (1, 27, 0xabc));
    }
}
