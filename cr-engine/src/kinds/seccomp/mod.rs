//! Kind "seccomp": the seccomp state of every thread — strict mode, or its
//! chain of filters (each filter's BPF program and flags), read with
//! PTRACE_SECCOMP_GET_FILTER / _METADATA (needs CAP_SYS_ADMIN).
//!
//! Restore installs a thread's filters (oldest first) as its very last
//! system calls, after its credentials: a filter may forbid any of the
//! calls a restore makes, and installing one needs no_new_privs or
//! CAP_SYS_ADMIN, which the thread then has if it had them when it
//! installed them. A thread that dropped CAP_SYS_ADMIN after installing
//! filters without no_new_privs (installed as root, then setuid to a
//! user) gets them before its credentials instead, while it still has the
//! capability ([`When::BeforeCreds`]): possible because the stubs are
//! traced with PTRACE_O_SUSPEND_SECCOMP, so the filters judge none of the
//! calls injected after them. Where the restorer cannot suspend filters
//! (it lacks CAP_SYS_ADMIN, or has a filter of its own), such a thread is
//! refused by name.
//! The main thread installs them after the restorer's scratch memory is
//! gone, with the program written for a moment below its stack pointer
//! (the bytes there are put back before it runs).
//!
//! Threads that share their filters (made after the filters went on, or
//! synchronised with SECCOMP_FILTER_FLAG_TSYNC) must share them again: the
//! kernel lets a later TSYNC succeed only when every other thread's filters
//! are an ancestor of the caller's. When every other thread has the same
//! chain and the main thread's chain begins with it ([`shared_prefix`]),
//! the main thread installs that prefix with TSYNC — the others, done by
//! then, install nothing of their own.

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use cr_image::model::{Process, SeccompFilter, SeccompMode, Thread, ThreadSeccomp};
use cr_sys::mem;
use cr_sys::proc;
use cr_sys::remote::Injector;

const SECCOMP_SET_MODE_FILTER: u64 = 1;
const SECCOMP_MODE_STRICT: u64 = 1;
const PR_SET_SECCOMP: u64 = 22;
/// Flags that act only when a filter is installed (synchronising the other
/// threads, asking for a listener fd): not part of the filter's state.
const INSTALL_ONLY_FLAGS: u64 = 1 | 8 | 16;
/// SECCOMP_FILTER_FLAG_NEW_LISTENER: a user-space supervisor gets the calls.
const NEW_LISTENER: u64 = 8;
const CAP_SYS_ADMIN: u64 = 1 << 21;
/// SECCOMP_FILTER_FLAG_TSYNC: the filter goes on every thread of the process.
const TSYNC: u64 = 1;

/// Read the seccomp state of every thread of `cx` into `p`.
pub fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
    let pid = cx.pid;
    let sys = |e| CheckpointError::from_sys(pid, e);
    for (t, th) in cx.probe.tracees().iter().zip(p.threads.iter_mut()) {
        let mode = proc::task_status(pid, t.tid())
            .map_err(sys)?
            .seccomp
            .unwrap_or(0);
        th.seccomp = match mode {
            0 => ThreadSeccomp::default(),
            1 => ThreadSeccomp {
                mode: SeccompMode::Strict,
                chain: Vec::new(),
            },
            _ => {
                // Index 0 is the oldest filter of the chain.
                let mut chain = Vec::new();
                while let Some((program, flags)) =
                    t.seccomp_filter(chain.len() as u64).map_err(sys)?
                {
                    if flags & NEW_LISTENER != 0 {
                        return Err(CheckpointError::unsupported(
                            pid,
                            format!(
                                "thread {}: a seccomp filter that hands system calls to a user-space supervisor (SECCOMP_FILTER_FLAG_NEW_LISTENER)",
                                t.tid()
                            ),
                        ));
                    }
                    let f = SeccompFilter {
                        program,
                        flags: flags & !INSTALL_ONLY_FLAGS,
                    };
                    let i = match p.seccomp_filters.iter().position(|x| *x == f) {
                        Some(i) => i,
                        None => {
                            p.seccomp_filters.push(f);
                            p.seccomp_filters.len() - 1
                        }
                    };
                    chain.push(i as u32);
                }
                ThreadSeccomp {
                    mode: SeccompMode::Filter,
                    chain,
                }
            }
        };
    }
    Ok(())
}

/// When in a thread's restore its seccomp state is installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Before its credentials, while it still has CAP_SYS_ADMIN: the
    /// filters of a thread that could not install them with its own
    /// credentials (see [`before_creds`]).
    BeforeCreds,
    /// As its very last system calls: every other thread.
    Last,
}

/// Whether the thread of `p` could install its filters with its saved
/// credentials (the kernel asks for no_new_privs or CAP_SYS_ADMIN).
fn installs_with_own_creds(p: &Process) -> bool {
    let c = &p.identity.creds;
    c.no_new_privs || c.cap_eff & CAP_SYS_ADMIN != 0
}

/// Whether thread `th`'s filters go on before its credentials: it cannot
/// install them with its own; `suspended`: the restorer traces the stubs
/// with PTRACE_O_SUSPEND_SECCOMP, so the filters judge none of the calls
/// the restore injects after them. Refused by name when they are not.
pub fn before_creds(p: &Process, th: &Thread, suspended: bool) -> Result<bool, RestoreError> {
    if th.seccomp.mode != SeccompMode::Filter || installs_with_own_creds(p) {
        return Ok(false);
    }
    if suspended {
        return Ok(true);
    }
    Err(RestoreError::Unsupported(format!(
        "thread {} has seccomp filters but neither no_new_privs nor CAP_SYS_ADMIN, and the restorer cannot suspend filters (PTRACE_O_SUSPEND_SECCOMP needs CAP_SYS_ADMIN and no filter of its own) to install them before the credentials",
        th.tid
    )))
}

/// The length of the chain the threads of `p` share, installed once by the
/// main thread with TSYNC: every other thread has this same chain (and no
/// filter of its own on top) and the main thread's begins with it. `None`
/// when there is one thread or the chains do not fit that shape (each
/// thread then installs its own copy).
pub fn shared_prefix(p: &Process) -> Option<usize> {
    let (main, others) = p.threads.split_first()?;
    let first = others.first()?;
    let all_filter = p
        .threads
        .iter()
        .all(|t| t.seccomp.mode == SeccompMode::Filter);
    let chain = &first.seccomp.chain;
    let same = others.iter().all(|t| t.seccomp.chain == *chain);
    (all_filter && same && !chain.is_empty() && main.seccomp.chain.starts_with(chain))
        .then_some(chain.len())
}

/// Whether `th`'s filters come to it from the main thread's TSYNC.
fn synced_from_main(p: &Process, th: &Thread) -> bool {
    th.tid != p.threads[0].tid && shared_prefix(p).is_some()
}

/// Put thread `th`'s seccomp state on the thread of `inj`: its last
/// system calls. `buf` is writable memory of the process for the programs
/// (`len` bytes); what was there is put back. The first `tsync` filters of
/// the chain go on every thread of the process (the other threads have
/// no filter yet).
fn install(
    inj: &mut Injector<'_>,
    p: &Process,
    th: &Thread,
    (buf, len): (u64, u64),
    tsync: usize,
) -> Result<(), RestoreError> {
    let pid = inj.pid();
    let what = || format!("cannot install the seccomp filters of thread {}", th.tid);
    match th.seccomp.mode {
        SeccompMode::None => Ok(()),
        SeccompMode::Strict => {
            inj.call(
                "prctl(PR_SET_SECCOMP)",
                libc::SYS_prctl,
                [PR_SET_SECCOMP, SECCOMP_MODE_STRICT, 0, 0, 0, 0],
            )
            .step(what)?;
            Ok(())
        }
        SeccompMode::Filter => {
            let mut saved = vec![0u8; len as usize];
            mem::read_vm(pid, buf, &mut saved)?;
            let r = (|| {
                for (n, &i) in th.seccomp.chain.iter().enumerate() {
                    let f = &p.seccomp_filters[i as usize];
                    let flags = if n < tsync { f.flags | TSYNC } else { f.flags };
                    // struct sock_fprog { u16 len; (pad) struct sock_filter *filter; }
                    let mut fprog = Vec::with_capacity(16 + f.program.len());
                    fprog.extend_from_slice(&((f.program.len() / 8) as u64).to_le_bytes());
                    fprog.extend_from_slice(&(buf + 16).to_le_bytes());
                    fprog.extend_from_slice(&f.program);
                    mem::write_vm(pid, buf, &fprog)?;
                    let r = inj.call(
                        "seccomp",
                        libc::SYS_seccomp,
                        [SECCOMP_SET_MODE_FILTER, flags, buf, 0, 0, 0],
                    )?;
                    if r != 0 {
                        // TSYNC: the thread that could not take the filter.
                        return Ok(r);
                    }
                }
                Ok(0)
            })();
            mem::write_vm(pid, buf, &saved)?;
            match r.step(what)? {
                0 => Ok(()),
                tid => Err(RestoreError::Unsupported(format!(
                    "thread {tid} cannot take the seccomp filters it shares with thread {}",
                    th.tid
                ))),
            }
        }
    }
}

/// Room for the biggest chain entry: a `sock_fprog` and a program.
fn need(p: &Process, th: &Thread) -> u64 {
    th.seccomp
        .chain
        .iter()
        .map(|&i| 16 + p.seccomp_filters[i as usize].program.len() as u64)
        .max()
        .unwrap_or(0)
}

/// A thread (the main one only [`When::BeforeCreds`]) while the
/// restorer's scratch memory (at `args`, `room` bytes) is still mapped:
/// its seccomp state if it goes on `when`.
pub fn restore_thread(
    inj: &mut Injector<'_>,
    p: &Process,
    th: &Thread,
    (args, room): (u64, u64),
    when: When,
    suspended: bool,
) -> Result<(), RestoreError> {
    if (when == When::BeforeCreds) != before_creds(p, th, suspended)? || synced_from_main(p, th) {
        return Ok(());
    }
    let len = need(p, th);
    if len > room {
        return Err(RestoreError::Unsupported(format!(
            "thread {}: a seccomp program of {len} bytes",
            th.tid
        )));
    }
    install(inj, p, th, (args, len), main_tsync(p, th))
}

/// How many of `th`'s filters it installs with TSYNC: the shared prefix
/// if it is the main thread.
fn main_tsync(p: &Process, th: &Thread) -> usize {
    if th.tid == p.threads[0].tid {
        shared_prefix(p).unwrap_or(0)
    } else {
        0
    }
}

/// The main thread, after the restorer's scratch memory is gone: the
/// programs go below its stack pointer, in its own stack mapping (unless
/// they went on before its credentials, [`When::BeforeCreds`]).
pub fn restore_main(
    inj: &mut Injector<'_>,
    p: &Process,
    suspended: bool,
) -> Result<(), RestoreError> {
    let th = &p.threads[0];
    if th.seccomp.mode == SeccompMode::None || before_creds(p, th, suspended)? {
        return Ok(());
    }
    let len = need(p, th);
    // Past the red zone, 16-aligned.
    let buf = th.regs.rsp.saturating_sub(512 + len) & !15;
    let fits = p
        .vmas
        .iter()
        .any(|v| v.start <= buf && th.regs.rsp <= v.end && v.prot & libc::PROT_WRITE as u32 != 0);
    if len > 0 && !fits {
        return Err(RestoreError::Unsupported(format!(
            "thread {}: no room below its stack pointer for its seccomp filters",
            th.tid
        )));
    }
    install(inj, p, th, (buf, len), main_tsync(p, th))
}
