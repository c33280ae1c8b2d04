//! Kind "identity": credentials (uids, gids, groups), capability sets,
//! no_new_privs, keep-caps, dumpable, resource limits, and the audit login
//! uid (its session id is the kernel's to give: a new one comes with it).
//!
//! Restore sets the limits from outside (prlimit) and the credentials last,
//! per thread (they are per-thread in the kernel), after every privileged
//! step of the restore. A restore never gives a process more than its image
//! had, and a caller that is not root may only restore images whose
//! credentials are its own.

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use crate::stub::Stub;
use cr_image::model::identity::MAX_GROUPS;
use cr_image::model::{Creds, Process, RLimit};
use cr_sys::remote::Injector;
use cr_sys::{limits, mem, proc};
use tracing::warn;

pub struct Identity;

const CAP_V3: u32 = 0x2008_0522;
const PR_CAP_AMBIENT: u64 = 47;
const PR_CAP_AMBIENT_RAISE: u64 = 2;

impl Kind for Identity {
    const NAME: &'static str = "identity";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let s = &cx.status;
        let mut creds = Creds {
            uids: [s.ruid, s.euid, s.suid, s.fuid],
            gids: [s.rgid, s.egid, s.sgid, s.fgid],
            groups: s.groups.clone(),
            cap_inh: s.capinh,
            cap_prm: s.capprm,
            cap_eff: s.capeff,
            cap_bnd: s.capbnd.unwrap_or(0),
            cap_amb: s.capamb.unwrap_or(0),
            no_new_privs: s.nonewprivs == Some(1),
            keep_caps: false,
            dumpable: 0,
        };
        // Asked with the rest of the main thread's state (`crate::asked`).
        creds.keep_caps = cx.main.keep_caps;
        creds.dumpable = cx.main.dumpable;
        p.identity.creds = creds;
        p.identity.rlimits = limits::get_all(pid)
            .map_err(sys)?
            .into_iter()
            .take(cr_image::model::identity::RLIMITS)
            .map(|(soft, hard)| RLimit { soft, hard })
            .collect();
        p.identity.loginuid = loginuid(pid);
        Ok(())
    }

    /// Resource limits, then the main thread's credentials: the last steps
    /// before its registers.
    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        let pid = cx.stub.pid();
        set_rlimits(pid, &p.identity.rlimits)?;
        let args = cx.stub.thread_args();
        set_creds(&mut cx.stub.inj, args, p.pid, &p.identity.creds)
    }
}

/// The audit login uid of `pid`; None without the file (no audit).
fn loginuid(pid: i32) -> Option<u32> {
    proc::read_string(&format!("/proc/{pid}/loginuid"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// The audit login uid, written by the stub itself: the kernel takes it
/// from no other process (/proc/PID/loginuid of another is EPERM). Done
/// while the stub is still root with CAP_AUDIT_CONTROL and before any
/// chroot; refused by the kernel when loginuids are immutable
/// (audit_loginuid_immutable) and one is set already.
pub fn set_loginuid(stub: &mut Stub<'_>, p: &Process) -> Result<(), RestoreError> {
    let Some(want) = p.identity.loginuid else {
        return Ok(());
    };
    if loginuid(stub.pid()) == Some(want) {
        return Ok(());
    }
    let what = || format!("cannot set the audit login uid {want}");
    let fd = stub
        .open("/proc/self/loginuid", libc::O_WRONLY | libc::O_CLOEXEC)
        .step(what)?;
    let text = want.to_string();
    let r = stub.put(text.as_bytes()).and_then(|a| {
        stub.call(
            "write",
            libc::SYS_write,
            [fd, a, text.len() as u64, 0, 0, 0],
        )
    });
    stub.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    r.step(what)?;
    Ok(())
}

/// Refuse images a non-root caller does not own, and a caller that lacks
/// the privileges a restore needs.
pub fn check_caller(procs: &[Process]) -> Result<(), RestoreError> {
    let (uid, euid, gid, _) = proc::own_ids();
    if euid == 0 {
        return Ok(());
    }
    check_owner(procs, uid, gid)?;
    let has = |c| caps::has_cap(None, caps::CapSet::Effective, c).unwrap_or(false);
    if !has(caps::Capability::CAP_CHECKPOINT_RESTORE) && !has(caps::Capability::CAP_SYS_ADMIN) {
        return Err(RestoreError::Unsupported(
            "restoring processes at their PIDs needs CAP_CHECKPOINT_RESTORE (run cr_restart as root, or through the node's agent)".into(),
        ));
    }
    Ok(())
}

/// Every live process of the image runs as `uid`/`gid` only, without
/// capabilities: the user `uid` may restore it.
pub fn check_owner(procs: &[Process], uid: u32, gid: u32) -> Result<(), RestoreError> {
    for p in procs.iter().filter(|p| !p.is_zombie()) {
        let c = &p.identity.creds;
        if c.uids.iter().any(|&u| u != uid) || c.gids.iter().any(|&g| g != gid) || c.has_caps() {
            return Err(RestoreError::NotYours {
                pid: p.pid,
                uid: c.uids[0],
                caller: uid,
            });
        }
    }
    Ok(())
}

/// Set the saved resource limits from outside (prlimit). A hard limit above
/// ours cannot be raised without CAP_SYS_RESOURCE: it is capped, with a warning.
pub fn set_rlimits(pid: i32, rlimits: &[RLimit]) -> Result<(), RestoreError> {
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
/// memory of at least 4 * 2048 + 64 bytes.
pub fn set_creds(
    inj: &mut Injector<'_>,
    args: u64,
    tid: u32,
    c: &Creds,
) -> Result<(), RestoreError> {
    let pid = inj.pid();
    let what = |step: &str| format!("cannot restore the {step} of thread {tid}");
    let (uids, gids) = (&c.uids, &c.gids);
    // The per-thread argument area holds 2048 groups.
    if c.groups.len() > 2048.min(MAX_GROUPS) {
        return Err(RestoreError::Unsupported(format!(
            "thread {tid}: {} supplementary groups",
            c.groups.len()
        )));
    }
    // The bounding set first: dropping needs CAP_SETPCAP, which we still have.
    // Every capability this kernel knows (not only those the caps crate
    // names): a bit left set would give more than the image had.
    for bit in 0..=proc::cap_last_cap().min(63) {
        if c.cap_bnd & (1u64 << bit) == 0 {
            inj.call(
                "prctl(PR_CAPBSET_DROP)",
                libc::SYS_prctl,
                [libc::PR_CAPBSET_DROP as u64, bit as u64, 0, 0, 0, 0],
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
    if c.dumpable <= 1 {
        inj.call(
            "prctl(PR_SET_DUMPABLE)",
            libc::SYS_prctl,
            [
                libc::PR_SET_DUMPABLE as u64,
                u64::from(c.dumpable),
                0,
                0,
                0,
                0,
            ],
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

/// `--verify`: credentials, capabilities, resource limits.
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    c.same(
        "audit",
        "login uid",
        &image.identity.loginuid,
        &now.identity.loginuid,
    );
    let (a, b) = (&image.identity.creds, &now.identity.creds);
    c.same(
        "credentials",
        "uids (real, effective, saved, fs)",
        &a.uids,
        &b.uids,
    );
    c.same(
        "credentials",
        "gids (real, effective, saved, fs)",
        &a.gids,
        &b.gids,
    );
    c.same("credentials", "supplementary groups", &a.groups, &b.groups);
    c.same(
        "credentials",
        "inheritable capabilities",
        &a.cap_inh,
        &b.cap_inh,
    );
    c.same(
        "credentials",
        "permitted capabilities",
        &a.cap_prm,
        &b.cap_prm,
    );
    c.same(
        "credentials",
        "effective capabilities",
        &a.cap_eff,
        &b.cap_eff,
    );
    c.same("credentials", "bounding set", &a.cap_bnd, &b.cap_bnd);
    c.same(
        "credentials",
        "ambient capabilities",
        &a.cap_amb,
        &b.cap_amb,
    );
    c.same(
        "credentials",
        "no_new_privs",
        &a.no_new_privs,
        &b.no_new_privs,
    );
    c.same("credentials", "keep_caps", &a.keep_caps, &b.keep_caps);
    c.same("credentials", "dumpable", &a.dumpable, &b.dumpable);
    let (la, lb) = (&image.identity.rlimits, &now.identity.rlimits);
    c.same("resource limits", "count", &la.len(), &lb.len());
    for (i, (x, y)) in la.iter().zip(lb).enumerate() {
        c.same("resource limits", &format!("limit {i}"), x, y);
    }
}
