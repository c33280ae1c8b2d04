//! Identity of a restored process: resource limits, and credentials and
//! capabilities (set last, per thread: they are per-thread in the kernel,
//! and every privileged step of the restore must come before them).
//!
//! A restore never gives a process more than its image had; a caller that
//! is not root may only restore images whose credentials are its own.

use crate::error::{RestoreError, StepContext};
use cr_image::proto;
use cr_sys::remote::Injector;
use cr_sys::{limits, mem, proc};
use tracing::warn;

const CAP_V3: u32 = 0x2008_0522;
const PR_CAP_AMBIENT: u64 = 47;
const PR_CAP_AMBIENT_RAISE: u64 = 2;
/// Supplementary groups we can pass through the per-thread argument area.
pub const MAX_GROUPS: usize = 2048;

/// Refuse images a non-root caller does not own.
pub fn check_caller(procs: &[proto::Process]) -> Result<(), RestoreError> {
    let (uid, euid, gid, _) = proc::own_ids();
    if euid == 0 {
        return Ok(());
    }
    check_owner(procs, uid, gid)
}

/// Every live process of the image runs as `uid`/`gid` only, without
/// capabilities: the user `uid` may restore it.
pub fn check_owner(procs: &[proto::Process], uid: u32, gid: u32) -> Result<(), RestoreError> {
    for p in procs.iter().filter(|p| !p.zombie) {
        let c = p.creds.clone().unwrap_or_default();
        let caps = c.cap_prm | c.cap_eff | c.cap_inh | c.cap_amb;
        if c.uids.iter().any(|&u| u != uid) || c.gids.iter().any(|&g| g != gid) || caps != 0 {
            return Err(RestoreError::NotYours {
                pid: p.pid,
                uid: c.uids.first().copied().unwrap_or(0),
                caller: uid,
            });
        }
    }
    Ok(())
}

/// Set the saved resource limits from outside (prlimit). A hard limit above
/// ours cannot be raised without CAP_SYS_RESOURCE: it is capped, with a warning.
pub fn set_rlimits(pid: i32, rlimits: &[proto::RLimit]) -> Result<(), RestoreError> {
    let current = limits::get_all(pid)?;
    for (res, (l, &(_, cur_hard))) in rlimits.iter().zip(&current).enumerate() {
        if limits::set(pid, res as u32, l.soft, l.hard).is_ok() {
            continue;
        }
        let hard = l.hard.min(cur_hard);
        let soft = l.soft.min(hard);
        warn!(
            pid,
            resource = res,
            saved_soft = l.soft,
            saved_hard = l.hard,
            soft,
            hard,
            "resource limit capped to what the restorer may grant"
        );
        limits::set(pid, res as u32, soft, hard)?;
    }
    Ok(())
}

/// Give the calling thread of `inj` the saved credentials. `args` is scratch
/// memory of at least 4 * MAX_GROUPS + 64 bytes.
pub fn set_creds(
    inj: &mut Injector<'_>,
    args: u64,
    tid: u32,
    c: &proto::Creds,
) -> Result<(), RestoreError> {
    let pid = inj.pid();
    let what = |step: &str| format!("cannot restore the {step} of thread {tid}");
    let (uids, gids) = (&c.uids, &c.gids);
    if uids.len() < 4 || gids.len() < 4 {
        return Err(RestoreError::Unsupported(format!(
            "thread {tid}: incomplete credentials"
        )));
    }
    if c.groups.len() > MAX_GROUPS {
        return Err(RestoreError::Unsupported(format!(
            "thread {tid}: {} supplementary groups",
            c.groups.len()
        )));
    }
    // The bounding set first: dropping needs CAP_SETPCAP, which we still have.
    for cap in 0..=proc::cap_last_cap() {
        if c.cap_bnd & (1u64 << cap) == 0 {
            inj.call(
                "prctl(PR_CAPBSET_DROP)",
                libc::SYS_prctl,
                [libc::PR_CAPBSET_DROP as u64, cap as u64, 0, 0, 0, 0],
            )
            .step(|| what("capability bounding set"))?;
        }
    }
    let groups: Vec<u8> = c.groups.iter().flat_map(|g| g.to_le_bytes()).collect();
    if !groups.is_empty() {
        mem::write_vm(pid, args, &groups)?;
    }
    inj.call(
        "setgroups",
        libc::SYS_setgroups,
        [c.groups.len() as u64, args, 0, 0, 0, 0],
    )
    .step(|| what("supplementary groups"))?;
    inj.call(
        "setresgid",
        libc::SYS_setresgid,
        [gids[0] as u64, gids[1] as u64, gids[2] as u64, 0, 0, 0],
    )
    .step(|| what("group ids"))?;
    inj.call(
        "setfsgid",
        libc::SYS_setfsgid,
        [gids[3] as u64, 0, 0, 0, 0, 0],
    )?;
    // Keep the permitted set across the uid change; capset trims it next.
    inj.call(
        "prctl(PR_SET_KEEPCAPS)",
        libc::SYS_prctl,
        [libc::PR_SET_KEEPCAPS as u64, 1, 0, 0, 0, 0],
    )?;
    inj.call(
        "setresuid",
        libc::SYS_setresuid,
        [uids[0] as u64, uids[1] as u64, uids[2] as u64, 0, 0, 0],
    )
    .step(|| what("user ids"))?;
    inj.call(
        "setfsuid",
        libc::SYS_setfsuid,
        [uids[3] as u64, 0, 0, 0, 0, 0],
    )?;
    // struct __user_cap_header_struct + two __user_cap_data_struct (eff, prm, inh).
    let mut cap = Vec::with_capacity(32);
    cap.extend_from_slice(&CAP_V3.to_le_bytes());
    cap.extend_from_slice(&0u32.to_le_bytes());
    for half in [0, 32] {
        for set in [c.cap_eff, c.cap_prm, c.cap_inh] {
            cap.extend_from_slice(&((set >> half) as u32).to_le_bytes());
        }
    }
    mem::write_vm(pid, args, &cap)?;
    inj.call("capset", libc::SYS_capset, [args, args + 8, 0, 0, 0, 0])
        .step(|| what("capabilities"))?;
    for bit in 0..64u64 {
        if c.cap_amb & (1 << bit) != 0 {
            inj.call(
                "prctl(PR_CAP_AMBIENT)",
                libc::SYS_prctl,
                [PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, bit, 0, 0, 0],
            )
            .step(|| what("ambient capabilities"))?;
        }
    }
    inj.call(
        "prctl(PR_SET_KEEPCAPS)",
        libc::SYS_prctl,
        [libc::PR_SET_KEEPCAPS as u64, c.keep_caps as u64, 0, 0, 0, 0],
    )?;
    // Only 0 and 1 can be set; 2 (suid_dumpable) is what the uid change left.
    if let Some(d @ (0 | 1)) = c.dumpable {
        inj.call(
            "prctl(PR_SET_DUMPABLE)",
            libc::SYS_prctl,
            [libc::PR_SET_DUMPABLE as u64, u64::from(d), 0, 0, 0, 0],
        )?;
    }
    if c.no_new_privs {
        inj.call(
            "prctl(PR_SET_NO_NEW_PRIVS)",
            libc::SYS_prctl,
            [libc::PR_SET_NO_NEW_PRIVS as u64, 1, 0, 0, 0, 0],
        )?;
    }
    Ok(())
}
