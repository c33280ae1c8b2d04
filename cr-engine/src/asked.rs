//! What several kinds ask a frozen process's main thread with injected
//! system calls, asked at once: one batch, one stop of the thread (see
//! [`crate::probe`]), instead of one or more per kind. The kinds take
//! their answers from [`MainAnswers`]; what only the other threads can
//! tell, kind "threads" asks each of them.

use crate::probe::{word, Probe};
use cr_image::model::signals::NSIG;
use cr_image::model::AltStack;
use cr_sys::error::Result;
use cr_sys::proc::Status;

use crate::kinds::threads::PR_GET_TID_ADDRESS;
const PR_GET_CHILD_SUBREAPER: u64 = 37;
const PR_GET_THP_DISABLE: u64 = 42;
const MEMBARRIER_CMD_GET_REGISTRATIONS: u64 = 1 << 9;

/// Where each answer lands in the scratch page.
const ACTIONS: u64 = 0; // NSIG x struct sigaction (32 bytes)
const TID_ADDRESS: u64 = 2048;
const PDEATHSIG: u64 = 2056;
const ALTSTACK: u64 = 2064; // stack_t (24 bytes)
const ITIMERS: u64 = 2088; // 3 x struct itimerval (32 bytes)
const SUBREAPER: u64 = 2184;
const END: u64 = 2192;

/// The main thread's answers.
#[derive(Debug, Default, Clone)]
pub struct MainAnswers {
    pub clear_child_tid: u64,
    pub pdeathsig: i32,
    pub sigaltstack: AltStack,
    /// Every signal's `struct sigaction` (kernel layout: handler, flags,
    /// restorer, mask), zero for those not asked (their default action).
    pub actions: Vec<u8>,
    /// ITIMER_REAL, ITIMER_VIRTUAL, ITIMER_PROF: `struct itimerval` each.
    pub itimers: Vec<u8>,
    pub keep_caps: bool,
    pub dumpable: u32,
    pub child_subreaper: bool,
    pub thp_disable: bool,
    pub brk: u64,
    /// prctl(PR_GET_TIMERSLACK) (0 for a real-time thread).
    pub timer_slack_ns: u64,
    /// membarrier(MEMBARRIER_CMD_GET_REGISTRATIONS): the REGISTER_*
    /// commands of the process's memory (0: none, or a kernel before 6.3,
    /// which answers EINVAL).
    pub membarrier: u32,
}

/// Signal `sig`'s bit in a signal set of /proc/PID/status.
fn bit(sig: u32) -> u64 {
    1u64 << (sig - 1)
}

/// Ask the main thread of the frozen process of `probe` (whose
/// /proc/PID/status is `status`) everything at once: the actions of the
/// signals it catches or ignores and SIGCHLD's, then the rest.
pub fn main_thread(probe: &mut Probe<'_>, status: &Status) -> Result<MainAnswers> {
    let s = probe.scratch()?;
    let asked = status.sigcgt | status.sigign | bit(libc::SIGCHLD as u32);
    let mut calls: Vec<(&'static str, i64, [u64; 6])> = (1..=NSIG)
        .filter(|&sig| {
            sig != libc::SIGKILL as u32 && sig != libc::SIGSTOP as u32 && asked & bit(sig) != 0
        })
        .map(|sig| {
            (
                "rt_sigaction",
                libc::SYS_rt_sigaction,
                [sig as u64, 0, s + ACTIONS + (sig as u64 - 1) * 32, 8, 0, 0],
            )
        })
        .collect();
    let first = calls.len();
    calls.extend([
        (
            "prctl(PR_GET_TID_ADDRESS)",
            libc::SYS_prctl,
            [PR_GET_TID_ADDRESS, s + TID_ADDRESS, 0, 0, 0, 0],
        ),
        (
            "prctl(PR_GET_PDEATHSIG)",
            libc::SYS_prctl,
            [libc::PR_GET_PDEATHSIG as u64, s + PDEATHSIG, 0, 0, 0, 0],
        ),
        (
            "sigaltstack",
            libc::SYS_sigaltstack,
            [0, s + ALTSTACK, 0, 0, 0, 0],
        ),
        (
            "getitimer",
            libc::SYS_getitimer,
            [0, s + ITIMERS, 0, 0, 0, 0],
        ),
        (
            "getitimer",
            libc::SYS_getitimer,
            [1, s + ITIMERS + 32, 0, 0, 0, 0],
        ),
        (
            "getitimer",
            libc::SYS_getitimer,
            [2, s + ITIMERS + 64, 0, 0, 0, 0],
        ),
        (
            "prctl(PR_GET_KEEPCAPS)",
            libc::SYS_prctl,
            [libc::PR_GET_KEEPCAPS as u64, 0, 0, 0, 0, 0],
        ),
        (
            "prctl(PR_GET_DUMPABLE)",
            libc::SYS_prctl,
            [libc::PR_GET_DUMPABLE as u64, 0, 0, 0, 0, 0],
        ),
        (
            "prctl(PR_GET_CHILD_SUBREAPER)",
            libc::SYS_prctl,
            [PR_GET_CHILD_SUBREAPER, s + SUBREAPER, 0, 0, 0, 0],
        ),
        (
            "prctl(PR_GET_THP_DISABLE)",
            libc::SYS_prctl,
            [PR_GET_THP_DISABLE, 0, 0, 0, 0, 0],
        ),
        ("brk", libc::SYS_brk, [0; 6]),
        // Answered as the return value (0 for a real-time thread).
        (
            "prctl(PR_GET_TIMERSLACK)",
            libc::SYS_prctl,
            [libc::PR_GET_TIMERSLACK as u64, 0, 0, 0, 0, 0],
        ),
        // Last: the one whose failure (an older kernel) is no error.
        (
            "membarrier(MEMBARRIER_CMD_GET_REGISTRATIONS)",
            libc::SYS_membarrier,
            [MEMBARRIER_CMD_GET_REGISTRATIONS, 0, 0, 0, 0, 0],
        ),
    ]);
    let mut got = probe.calls_raw(0, &calls)?;
    let membarrier = got.pop().filter(|&r| r > 0).unwrap_or(0) as u32;
    let got = probe.checked(0, &calls[..got.len()], got)?;
    let r = &got[first..];
    let mut raw = vec![0u8; END as usize];
    probe.read(0, &mut raw)?;
    // Never asked: left as zero (the default action).
    for sig in (1..=NSIG).filter(|&sig| asked & bit(sig) == 0) {
        raw[(sig as usize - 1) * 32..sig as usize * 32].fill(0);
    }
    let at = |off: u64| &raw[off as usize..];
    Ok(MainAnswers {
        clear_child_tid: word(at(TID_ADDRESS), 0),
        pdeathsig: word(at(PDEATHSIG), 0) as u32 as i32,
        sigaltstack: AltStack {
            sp: word(at(ALTSTACK), 0),
            flags: word(at(ALTSTACK), 1) as u32 as i32,
            size: word(at(ALTSTACK), 2),
        },
        actions: raw[..NSIG as usize * 32].to_vec(),
        itimers: raw[ITIMERS as usize..ITIMERS as usize + 96].to_vec(),
        keep_caps: r[6] == 1,
        dumpable: (r[7] as u32).min(2),
        child_subreaper: word(at(SUBREAPER), 0) as u32 != 0,
        thp_disable: r[9] != 0,
        brk: r[10],
        timer_slack_ns: r[11],
        membarrier,
    })
}
