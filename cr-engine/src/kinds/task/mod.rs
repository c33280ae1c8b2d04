//! Kind "task": what a process is apart from its resources — its name
//! (comm), executable (path and GNU build id), working directory, umask,
//! personality and command line.
//!
//! Capture reads /proc (status, personality, cwd and exe links, cmdline)
//! and the executable's build id (goblin). Restore sets them by injected
//! system calls (chdir, umask, personality, PR_SET_NAME); the executable
//! link comes back with the mm fields (kind "memory").

#[cfg(test)]
mod tests;

use crate::capture::Proc;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::Kind;
use crate::restore::Rebuild;
use cr_image::model::Process;
use cr_sys::proc;

pub struct Task;

impl Kind for Task {
    const NAME: &'static str = "task";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        let t = &mut p.task;
        t.comm = cx.stat.comm.clone();
        t.exe = proc::read_link(&format!("/proc/{pid}/exe")).map_err(sys)?;
        t.cwd = proc::read_link(&format!("/proc/{pid}/cwd")).map_err(sys)?;
        t.umask = cx.status.umask.unwrap_or(0o022);
        t.personality =
            u32::from_str_radix(&proc::sys_value(&format!("/proc/{pid}/personality")), 16)
                .unwrap_or(0);
        t.cmdline = proc::read_bytes(&format!("/proc/{pid}/cmdline")).unwrap_or_default();
        // Through the magic link: the very file, even if replaced or deleted since.
        t.exe_build_id =
            cr_sys::elf::file_build_id(&format!("/proc/{pid}/exe")).unwrap_or_default();
        Ok(())
    }

    fn restore(cx: &mut Rebuild<'_, '_>, p: &Process) -> Result<(), RestoreError> {
        let stub = &mut cx.stub;
        let t = &p.task;
        let cwd = stub.put_str(&t.cwd)?;
        stub.call("chdir", libc::SYS_chdir, [cwd, 0, 0, 0, 0, 0])
            .step(|| format!("cannot change directory to {}", t.cwd))?;
        stub.call(
            "umask",
            libc::SYS_umask,
            [t.umask as u64 & 0o777, 0, 0, 0, 0, 0],
        )?;
        stub.call(
            "personality",
            libc::SYS_personality,
            [t.personality as u64, 0, 0, 0, 0, 0],
        )
        .step(|| format!("cannot set personality {:#x}", t.personality))?;
        let comm = stub.put_str(&t.comm)?;
        stub.call(
            "prctl(PR_SET_NAME)",
            libc::SYS_prctl,
            [libc::PR_SET_NAME as u64, comm, 0, 0, 0, 0],
        )?;
        Ok(())
    }
}
