//! The plainest pause of a job: the same-run limit of `cr-bench cluster`.
//!
//! Every member is stopped at once (one thread per member: every thread of
//! it `PTRACE_SEIZE`d and `PTRACE_INTERRUPT`ed, its stops waited for),
//! then each reads its private writable memory (`process_vm_readv` into
//! one reused 4 MiB buffer) while all stay stopped, then all are detached.
//! A member's pause runs from its first seize to its detach; the limit is
//! the longest. That is what any checkpoint of the whole job must do at
//! least (stop every thread at one moment, read what it writes, let it
//! go), without any protocol, image, lock or round trip between daemons:
//! the nodes of the test cluster share this machine, so all members of
//! all nodes are stopped from here.

use crate::{pvm_read, Res, CHUNK};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// The threads of `pid` (its `/proc/PID/task`).
fn tasks(pid: i32) -> Res<Vec<i32>> {
    let rd = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map_err(|e| format!("/proc/{pid}/task: {e}"))?;
    Ok(rd
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect())
}

/// Private writable mappings of `pid`: (start, length).
fn writable(pid: i32) -> Res<Vec<(usize, usize)>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map_err(|e| format!("/proc/{pid}/maps: {e}"))?;
    Ok(maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            if !perms.starts_with("rw") || !perms.ends_with('p') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let (a, b) = (
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            );
            Some((a, b.checked_sub(a)?))
        })
        .collect())
}

fn ptrace(req: libc::c_uint, tid: i32) -> Res<()> {
    // SAFETY: SEIZE, INTERRUPT and DETACH take no pointer (addr and data
    // are 0); they act on another process only.
    let r = unsafe { libc::ptrace(req, tid, 0usize, 0usize) };
    if r < 0 {
        return Err(format!(
            "ptrace {req} of {tid}: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Wait for the stop of seized thread `tid` (the interrupt's group stop);
/// `Ok(false)` if it died instead.
fn wait_stop(tid: i32) -> Res<bool> {
    let mut st = 0;
    loop {
        // SAFETY: `st` is a valid out-pointer for the duration of the call.
        let r = unsafe { libc::waitpid(tid, &mut st, libc::__WALL) };
        if r == tid {
            return Ok(libc::WIFSTOPPED(st));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("waitpid {tid}: {e}"));
        }
    }
}

/// Stop `pid` (all its threads), then at `all_stopped` read its memory
/// (if `read`), then at `all_read` let it go; how long it was stopped and
/// the bytes read.
fn pause_one(
    pid: i32,
    read: bool,
    all_stopped: &Barrier,
    all_read: &Barrier,
) -> Res<(Duration, u64)> {
    let tids = tasks(pid);
    let t0 = Instant::now();
    let mut seized = Vec::new();
    let mut res = Ok(0u64);
    for &tid in tids.as_deref().unwrap_or_default() {
        if ptrace(libc::PTRACE_SEIZE, tid).is_ok() {
            seized.push(tid);
            res = res.and(ptrace(libc::PTRACE_INTERRUPT, tid).map(|_| 0));
        }
    }
    for &tid in &seized {
        res = res.and(wait_stop(tid).map(|_| 0));
    }
    all_stopped.wait();
    if res.is_ok() && read {
        let mut buf = vec![0u8; CHUNK];
        let mut bytes = 0u64;
        for (start, len) in writable(pid).unwrap_or_default() {
            let mut off = 0;
            while off < len {
                let n = (len - off).min(CHUNK);
                // Unreadable pieces (a file mapping past its end) are skipped.
                if pvm_read(pid, start + off, buf.as_mut_ptr(), n).is_ok() {
                    bytes += n as u64;
                }
                off += n;
            }
        }
        res = Ok(bytes);
    }
    all_read.wait();
    for &tid in &seized {
        let _ = ptrace(libc::PTRACE_DETACH, tid);
    }
    let frozen = t0.elapsed();
    tids?;
    res.map(|b| (frozen, b))
}

/// The plainest pause of the processes `pids` (see the module docs): the
/// longest time one was stopped, and the bytes read from all.
pub(crate) fn limit_pause(pids: &[i32]) -> Res<(Duration, u64)> {
    pause_all(pids, true)
}

/// The plainest pause without reading memory: all stopped at once and let
/// go (what a freeze that copies nothing, e.g. after a pre-copy of a job
/// that wrote nothing since, must do at least).
pub(crate) fn stop_pause(pids: &[i32]) -> Res<Duration> {
    pause_all(pids, false).map(|(d, _)| d)
}

fn pause_all(pids: &[i32], read: bool) -> Res<(Duration, u64)> {
    let n = pids.len();
    let all_stopped = Arc::new(Barrier::new(n));
    let all_read = Arc::new(Barrier::new(n));
    let threads: Vec<_> = pids
        .iter()
        .map(|&pid| {
            let (s, r) = (all_stopped.clone(), all_read.clone());
            std::thread::spawn(move || pause_one(pid, read, &s, &r))
        })
        .collect();
    let mut longest = Duration::ZERO;
    let mut bytes = 0;
    for t in threads {
        let (d, b) = t
            .join()
            .map_err(|_| "a pausing thread panicked".to_string())??;
        longest = longest.max(d);
        bytes += b;
    }
    Ok((longest, bytes))
}
