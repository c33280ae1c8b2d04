//! Kind "task": what a process is apart from its resources — its name
//! (comm), executable (path and GNU build id), working directory, umask,
//! personality, command line, scheduling (policy with
//! SCHED_RESET_ON_FORK, real-time priority, nice), I/O priority, timer
//! slack, OOM score adjustment, the prctl switches child-subreaper and
//! THP-disable, and the membarrier registrations of its memory.
//!
//! Capture reads /proc (stat, status, personality, cwd and exe links,
//! cmdline, oom_score_adj, timerslack_ns), the executable's build id
//! (goblin), ioprio_get and sched_getattr from outside, and asks the
//! process (PR_GET_CHILD_SUBREAPER, PR_GET_THP_DISABLE). Restore sets them by
//! injected system calls (chdir, umask, personality, PR_SET_NAME,
//! sched_setscheduler, setpriority, the prctls) before the other threads
//! are made, so they inherit the scheduling, I/O priority and timer slack;
//! oom_score_adj, timerslack_ns and the I/O priority are set from the
//! restorer. The executable link comes back with the mm fields (kind
//! "memory").
//!
//! A chroot comes back last of all ([`chroot`], before the credentials):
//! every path of the image (cwd, files, mappings) is as the checkpointer
//! saw it, from outside the chroot.
//!
//! Scheduling, I/O priority and timer slack here are the main thread's;
//! the other threads are made with them, then get their own scheduling,
//! I/O priority and timer slack (kind "threads").

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use cr_image::model::Process;
use cr_sys::proc;

pub struct Task;

const PR_SET_CHILD_SUBREAPER: u64 = 36;
const PR_SET_THP_DISABLE: u64 = 41;

/// The scheduling policy (with SCHED_RESET_ON_FORK) and real-time priority,
/// then the nice value (which a real-time policy keeps for later): queued
/// with the task's other calls (the caller flushes), not a stop of their
/// own.
fn sched(stub: &mut crate::stub::Stub<'_>, t: &cr_image::model::Task) -> Result<(), RestoreError> {
    let param = stub.put(&(t.sched_priority as i32).to_le_bytes())?;
    stub.later(
        "sched_setscheduler",
        libc::SYS_sched_setscheduler,
        [0, t.sched_policy as u64, param, 0, 0, 0],
        format!(
            "cannot set scheduling policy {:#x} priority {}",
            t.sched_policy, t.sched_priority
        ),
    )?;
    stub.later(
        "setpriority",
        libc::SYS_setpriority,
        [libc::PRIO_PROCESS as u64, 0, t.nice as i64 as u64, 0, 0, 0],
        format!("cannot set nice value {}", t.nice),
    )?;
    Ok(())
}

impl Kind for Task {
    const NAME: &'static str = "task";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let t = &mut p.task;
        t.comm = cx.stat.comm.clone();
        t.exe = proc::read_link(&format!("/proc/{pid}/exe")).map_err(sys)?;
        t.cwd = proc::read_link(&format!("/proc/{pid}/cwd")).map_err(sys)?;
        t.root = proc::read_link(&format!("/proc/{pid}/root")).map_err(sys)?;
        t.umask = cx.status.umask.unwrap_or(0o022);
        t.personality =
            u32::from_str_radix(&proc::sys_value(&format!("/proc/{pid}/personality")), 16)
                .unwrap_or(0);
        t.cmdline = proc::read_bytes(&format!("/proc/{pid}/cmdline")).unwrap_or_default();
        // Through the magic link: the very file, even if replaced or deleted since.
        t.exe_build_id =
            cr_sys::elf::file_build_id(&format!("/proc/{pid}/exe")).unwrap_or_default();
        // sched_getattr from outside: what sched_getscheduler in the
        // process would answer, without a round trip through it.
        t.sched_policy = cr_sys::sched::policy(pid).map_err(sys)?;
        t.sched_priority = cx.stat.rt_priority.unwrap_or(0);
        t.nice = cx.stat.nice as i32;
        t.oom_score_adj = proc::sys_value(&format!("/proc/{pid}/oom_score_adj"))
            .parse()
            .unwrap_or(0);
        t.timer_slack_ns = proc::sys_value(&format!("/proc/{pid}/timerslack_ns"))
            .parse()
            .unwrap_or(0);
        t.ioprio = cr_sys::sched::io_priority(pid).map_err(sys)?;
        // Asked with the rest of the main thread's state (`crate::asked`).
        t.child_subreaper = cx.main.child_subreaper;
        t.thp_disable = cx.main.thp_disable;
        t.membarrier = cx.main.membarrier;
        Ok(())
    }

    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        let t = &p.task;
        // A working directory removed since is made again, and removed.
        let ghost = match crate::kinds::files::ghost::removed(&t.cwd) {
            Some(_) => Some(crate::kinds::files::ghost::dir(cx.r, &t.cwd)?),
            None => None,
        };
        let stub = &mut cx.stub;
        let what = || format!("cannot change directory to {}", t.cwd);
        match ghost {
            Some(d) => {
                let fd = stub
                    .open_at_ours(d, ".", libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC)
                    .step(what)?;
                let r = stub.call("fchdir", libc::SYS_fchdir, [fd, 0, 0, 0, 0, 0]);
                stub.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
                r.step(what)?;
            }
            None => {
                let cwd = stub.put_str(&t.cwd)?;
                stub.later("chdir", libc::SYS_chdir, [cwd, 0, 0, 0, 0, 0], what())?;
            }
        }
        // Queued ([`Stub::later`]): run together, in order, with what
        // `sched` asks.
        stub.later(
            "umask",
            libc::SYS_umask,
            [t.umask as u64 & 0o777, 0, 0, 0, 0, 0],
            "cannot set the umask".into(),
        )?;
        stub.later(
            "personality",
            libc::SYS_personality,
            [t.personality as u64, 0, 0, 0, 0, 0],
            format!("cannot set personality {:#x}", t.personality),
        )?;
        let comm = stub.put_str(&t.comm)?;
        stub.later(
            "prctl(PR_SET_NAME)",
            libc::SYS_prctl,
            [libc::PR_SET_NAME as u64, comm, 0, 0, 0, 0],
            format!("cannot name the process {:?}", t.comm),
        )?;
        sched(stub, t)?;
        if t.child_subreaper {
            stub.later(
                "prctl(PR_SET_CHILD_SUBREAPER)",
                libc::SYS_prctl,
                [PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0, 0],
                "cannot make the process a child subreaper".into(),
            )?;
        }
        if t.thp_disable {
            stub.later(
                "prctl(PR_SET_THP_DISABLE)",
                libc::SYS_prctl,
                [PR_SET_THP_DISABLE, 1, 0, 0, 0, 0],
                "cannot disable transparent huge pages".into(),
            )?;
        }
        // The membarrier registrations of the memory, each REGISTER_*
        // command again (the memory the restore fills is this one).
        for bit in (0..32).map(|b| 1u32 << b).filter(|b| t.membarrier & b != 0) {
            stub.later(
                "membarrier",
                libc::SYS_membarrier,
                [bit as u64, 0, 0, 0, 0, 0],
                format!("cannot register the memory for membarrier command {bit:#x}"),
            )?;
        }
        stub.flush()?;
        let write = |file: &str, value: String| {
            let path = format!("/proc/{}/{file}", stub.pid());
            std::fs::write(&path, &value)
                .map_err(|source| cr_sys::SysError::Io {
                    path: path.clone(),
                    source,
                })
                .step(|| format!("cannot set {file} {value}"))
        };
        // Lowering it below what the restorer has needs CAP_SYS_RESOURCE.
        write("oom_score_adj", t.oom_score_adj.to_string())?;
        // Another process's: CAP_SYS_NICE. A real-time thread's is 0 (not
        // settable, and not used).
        if t.timer_slack_ns != 0 {
            write("timerslack_ns", t.timer_slack_ns.to_string())?;
        }
        if t.ioprio != 0 {
            cr_sys::sched::set_io_priority(stub.pid(), t.ioprio)
                .step(|| format!("cannot set I/O priority {:#x}", t.ioprio))?;
        }
        Ok(())
    }
}

/// `--verify`: name, executable, working directory, umask, personality,
/// scheduling, I/O priority, timer slack, oom_score_adj, the prctls.
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    let (a, b) = (&image.task, &now.task);
    c.same("task", "name", &a.comm, &b.comm);
    c.same("task", "executable", &a.exe, &b.exe);
    c.same(
        "task",
        "executable build id",
        &a.exe_build_id,
        &b.exe_build_id,
    );
    c.same("task", "working directory", &a.cwd, &b.cwd);
    c.same("task", "root directory (chroot)", &a.root, &b.root);
    c.same("task", "umask", &a.umask, &b.umask);
    c.same("task", "personality", &a.personality, &b.personality);
    c.same("task", "command line", &a.cmdline, &b.cmdline);
    c.same("scheduling", "policy", &a.sched_policy, &b.sched_policy);
    c.same(
        "scheduling",
        "real-time priority",
        &a.sched_priority,
        &b.sched_priority,
    );
    c.same("scheduling", "nice", &a.nice, &b.nice);
    c.same("task", "oom_score_adj", &a.oom_score_adj, &b.oom_score_adj);
    if a.timer_slack_ns != 0 {
        c.same("task", "timer slack", &a.timer_slack_ns, &b.timer_slack_ns);
    }
    c.same("task", "I/O priority", &a.ioprio, &b.ioprio);
    c.same(
        "task",
        "child subreaper",
        &a.child_subreaper,
        &b.child_subreaper,
    );
    c.same("task", "THP disabled", &a.thp_disable, &b.thp_disable);
    c.same(
        "task",
        "membarrier registrations",
        &a.membarrier,
        &b.membarrier,
    );
}

/// The process's root directory (chroot), once everything it opens by
/// path is open: the paths of the image are seen from outside it.
pub fn chroot(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let root = &p.task.root;
    if root.is_empty() || root == "/" {
        return Ok(());
    }
    // A root shared (CLONE_FS) with processes rebuilt after this one: the
    // last of them changes it, once their paths are opened.
    if !crate::kinds::tree::restore::last_sharing(cx.r.ck, p, |q| q.fs_of) {
        return Ok(());
    }
    let stub = &mut cx.stub;
    let path = stub.put_str(root)?;
    stub.call("chroot", libc::SYS_chroot, [path, 0, 0, 0, 0, 0])
        .step(|| format!("cannot chroot to {root}"))?;
    Ok(())
}
