//! Registers of a restored thread, with the syscall-restart fix-ups.
//!
//! A thread checkpointed inside a system call has `orig_rax` = the syscall
//! and `rax` = -ERESTART*. The kernel would have re-run the call on resume;
//! the restored thread is not inside the kernel, so we do it by hand: point
//! `rip` back at the `syscall` instruction with `rax` = the syscall number.
//! -ERESTART_RESTARTBLOCK (relative sleeps, poll with timeout) has kernel
//! state we cannot carry over: relative nanosleeps resume with the time
//! that was left (the kernel wrote it to the caller's `rem`), poll and timed
//! futex waits restart, everything else returns -EINTR.

use cr_image::proto::GpRegs;
use cr_sys::regs::{UserRegs, ERESTARTNOHAND, ERESTARTNOINTR, ERESTARTSYS, ERESTART_RESTARTBLOCK};

pub fn from_proto(r: &GpRegs) -> UserRegs {
    let mut u = cr_sys::regs::zeroed();
    u.r15 = r.r15;
    u.r14 = r.r14;
    u.r13 = r.r13;
    u.r12 = r.r12;
    u.rbp = r.rbp;
    u.rbx = r.rbx;
    u.r11 = r.r11;
    u.r10 = r.r10;
    u.r9 = r.r9;
    u.r8 = r.r8;
    u.rax = r.rax;
    u.rcx = r.rcx;
    u.rdx = r.rdx;
    u.rsi = r.rsi;
    u.rdi = r.rdi;
    u.orig_rax = r.orig_rax;
    u.rip = r.rip;
    u.cs = r.cs;
    u.eflags = r.eflags;
    u.rsp = r.rsp;
    u.ss = r.ss;
    u.fs_base = r.fs_base;
    u.gs_base = r.gs_base;
    u.ds = r.ds;
    u.es = r.es;
    u.fs = r.fs;
    u.gs = r.gs;
    u
}

/// Apply the restart fix-ups to registers saved at checkpoint time.
pub fn fix_syscall_restart(r: &mut UserRegs) {
    let nr = r.orig_rax as i64;
    if nr < 0 {
        return;
    }
    let again = |r: &mut UserRegs| {
        r.rax = r.orig_rax;
        r.rip -= 2;
    };
    match -(r.rax as i64) {
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
}
