//! Checks that a PID names a user process this build can capture.

use crate::CheckpointError;
use cr_sys::proc;

/// Validate `pid` before anything is frozen.
pub fn validate(pid: i32) -> Result<(), CheckpointError> {
    if pid <= 0 || !std::path::Path::new(&format!("/proc/{pid}")).exists() {
        return Err(CheckpointError::NoSuchProcess(pid));
    }
    if pid == std::process::id() as i32 {
        return Err(CheckpointError::SelfCheckpoint);
    }
    let stat = proc::read_stat(pid).map_err(|_| CheckpointError::NoSuchProcess(pid))?;
    if stat.flags() & proc::PF_KTHREAD != 0 {
        return Err(CheckpointError::KernelThread(pid));
    }
    let status = proc::read_status(pid).map_err(|_| CheckpointError::NoSuchProcess(pid))?;
    if let Some(tgid) = status.int("Tgid") {
        if tgid as i32 != pid {
            return Err(CheckpointError::NotAProcess {
                tid: pid,
                tgid: tgid as i32,
            });
        }
    }
    if stat.state == 'Z' || stat.state == 'X' {
        return Err(CheckpointError::Zombie(pid));
    }
    Ok(())
}
