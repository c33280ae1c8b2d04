//! CPU affinity, I/O priority and scheduling of any thread
//! (sched_getaffinity / sched_setaffinity, ioprio_get / ioprio_set,
//! sched_getattr / sched_setscheduler, getpriority / setpriority on a
//! TID, from outside the process), the machine's online CPUs, and the kernel's CPU list notation
//! ("0-3,8").

use crate::error::{Errno, NixResult, Result, SysError};
use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
use nix::unistd::Pid;

/// The CPUs thread `tid` may run on, ascending.
pub fn affinity(tid: i32) -> Result<Vec<u32>> {
    let set = sched_getaffinity(Pid::from_raw(tid))
        .or_sys(|| format!("sched_getaffinity of thread {tid}"))?;
    Ok((0..CpuSet::count())
        .filter(|&i| set.is_set(i).unwrap_or(false))
        .map(|i| i as u32)
        .collect())
}

/// Let thread `tid` run on `cpus` only. The kernel intersects the set with
/// the thread's cpuset (cgroup) and refuses an empty result (EINVAL).
pub fn set_affinity(tid: i32, cpus: &[u32]) -> Result<()> {
    let what = || {
        format!(
            "sched_setaffinity of thread {tid} to CPUs {}",
            cpu_list(cpus)
        )
    };
    let mut set = CpuSet::new();
    for &c in cpus {
        set.set(c as usize).or_sys(what)?;
    }
    sched_setaffinity(Pid::from_raw(tid), &set).or_sys(what)
}

/// ioprio_get / ioprio_set's `which`: one thread, by TID.
const IOPRIO_WHO_PROCESS: libc::c_long = 1;

/// The I/O priority of thread `tid` as ioprio_get returns it (class << 13
/// | level); 0 when none was ever set (the kernel then derives one from
/// the nice value).
pub fn io_priority(tid: i32) -> Result<u32> {
    // SAFETY: ioprio_get takes two integers and touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_ioprio_get,
            IOPRIO_WHO_PROCESS,
            tid as libc::c_long,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("ioprio_get of thread {tid}"),
            source: Errno::last(),
        });
    }
    Ok(r as u32)
}

/// Set the I/O priority of thread `tid` (CAP_SYS_ADMIN for the real-time
/// class, CAP_SYS_NICE for another user's thread).
pub fn set_io_priority(tid: i32, prio: u32) -> Result<()> {
    // SAFETY: ioprio_set takes three integers and touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            tid as libc::c_long,
            prio as libc::c_long,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("ioprio_set of thread {tid} to {prio:#x}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// SCHED_RESET_ON_FORK as sched_getscheduler(2) ORs it into the policy.
const SCHED_RESET_ON_FORK: u32 = 0x4000_0000;
/// SCHED_FLAG_RESET_ON_FORK of sched_attr.sched_flags.
const SCHED_FLAG_RESET_ON_FORK: u64 = 1;

/// struct sched_attr of thread `tid` up to sched_period
/// (SCHED_ATTR_SIZE_VER0 is 48 bytes), as u32 words: { u32 size; u32
/// sched_policy; u64 sched_flags; s32 sched_nice; u32 sched_priority; ... }.
fn sched_attr(tid: i32) -> Result<[u32; 14]> {
    let mut attr = [0u32; 14];
    let size = std::mem::size_of_val(&attr) as u32;
    // Raw: neither libc nor nix wraps sched_getattr.
    // SAFETY: attr is a writable buffer of `size` bytes.
    let r = unsafe { libc::syscall(libc::SYS_sched_getattr, tid, attr.as_mut_ptr(), size, 0u32) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: format!("sched_getattr of thread {tid}"),
            source: crate::Errno::last(),
        });
    }
    Ok(attr)
}

/// The scheduling policy of thread `tid` exactly as sched_getscheduler(2)
/// run by that thread answers it (SCHED_RESET_ON_FORK ORed in), read from
/// outside with sched_getattr(2): no system call injected into it.
pub fn policy(tid: i32) -> Result<u32> {
    sched_attr(tid).map(|a| policy_of(&a))
}

/// The policy of a [`sched_attr`], with SCHED_RESET_ON_FORK ORed in.
fn policy_of(attr: &[u32; 14]) -> u32 {
    let policy = attr[1];
    let flags = u64::from(attr[2]) | u64::from(attr[3]) << 32;
    if flags & SCHED_FLAG_RESET_ON_FORK != 0 {
        policy | SCHED_RESET_ON_FORK
    } else {
        policy
    }
}

/// The scheduling of thread `tid`, from outside: its policy (as
/// [`policy`]), real-time priority (0 for a policy that has none) and
/// nice value (getpriority(PRIO_PROCESS, TID): each thread has its own on
/// Linux; a real-time thread keeps one for when it leaves its policy).
pub fn scheduling(tid: i32) -> Result<(u32, u32, i32)> {
    let attr = sched_attr(tid)?;
    // Raw: the system call answers 20 - nice (1..40), never an ambiguous -1.
    // SAFETY: getpriority takes two integers and touches no memory of ours.
    let r = unsafe {
        libc::syscall(
            libc::SYS_getpriority,
            libc::PRIO_PROCESS as libc::c_long,
            tid as libc::c_long,
        )
    };
    if r < 0 {
        return Err(SysError::Syscall {
            what: format!("getpriority of thread {tid}"),
            source: Errno::last(),
        });
    }
    Ok((policy_of(&attr), attr[5], 20 - r as i32))
}

/// Give thread `tid` scheduling `policy` (SCHED_RESET_ON_FORK ORed in as
/// sched_getscheduler answers it) with real-time `priority`, then nice
/// value `nice` (which a real-time policy keeps for later). From outside:
/// CAP_SYS_NICE for a real-time policy, a lower nice value or another
/// user's thread.
pub fn set_scheduling(tid: i32, policy: u32, priority: u32, nice: i32) -> Result<()> {
    let param = libc::sched_param {
        sched_priority: priority as i32,
    };
    // SAFETY: param is a valid sched_param that outlives the call.
    let r = unsafe { libc::sched_setscheduler(tid, policy as i32, &param) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: format!(
                "sched_setscheduler of thread {tid} to policy {policy:#x} priority {priority}"
            ),
            source: Errno::last(),
        });
    }
    // SAFETY: setpriority takes integers only.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: format!("setpriority of thread {tid} to nice {nice}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// The CPUs online on this machine (/sys/devices/system/cpu/online).
pub fn online_cpus() -> Result<Vec<u32>> {
    let path = "/sys/devices/system/cpu/online";
    let text = crate::proc::read_string(path)?;
    parse_cpu_list(&text).ok_or_else(|| SysError::Parse {
        path: path.to_string(),
        what: format!("bad CPU list {:?}", text.trim()),
    })
}

/// Parse the kernel's CPU list notation ("0-3,8,10-11"), ascending.
pub fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let a = part.parse::<u32>().ok()?;
                (a, a)
            }
        };
        if a > b || b >= CpuSet::count() as u32 {
            return None;
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// `cpus` (ascending) in the kernel's CPU list notation.
pub fn cpu_list(cpus: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            cpus[i].to_string()
        } else {
            format!("{}-{}", cpus[i], cpus[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_both_ways() {
        assert_eq!(parse_cpu_list("0-3,8\n"), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(cpu_list(&[]), "");
    }

    #[test]
    fn own_affinity_is_within_the_online_cpus() {
        let me = affinity(0).unwrap();
        let online = online_cpus().unwrap();
        assert!(!me.is_empty());
        assert!(me.iter().all(|c| online.contains(c)), "{me:?} {online:?}");
    }
}
