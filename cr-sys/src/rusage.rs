//! What a child used: its exit status and peak resident set, from
//! wait4(2) (the tests bound the tools' peak RSS with it).

use crate::error::{Errno, Result, SysError};

/// A child that ended: its raw wait status and peak RSS.
#[derive(Debug, Clone, Copy)]
pub struct Ended {
    /// The wait status as waitpid gives it.
    pub status: i32,
    /// `ru_maxrss`: the most memory it had resident at once, in KiB. A
    /// child started by vfork (posix_spawn) starts from its parent's
    /// peak: the kernel hands the old mm's peak on at exec.
    pub max_rss_kib: u64,
}

/// Reap child `pid` if it has ended (WNOHANG): None while it runs.
pub fn try_reap(pid: i32) -> Result<Option<Ended>> {
    let mut status = 0;
    // SAFETY: rusage is plain data, zero is a valid value of it.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: status and ru are valid for writes for the whole call;
    // WNOHANG never blocks.
    let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut ru) };
    match r {
        0 => Ok(None),
        r if r == pid => Ok(Some(Ended {
            status,
            max_rss_kib: ru.ru_maxrss.max(0) as u64,
        })),
        _ => Err(SysError::Syscall {
            what: format!("wait4({pid})"),
            source: Errno::last(),
        }),
    }
}
