//! Who a process is: credentials, capabilities, resource limits; and the
//! process-wide state this build refuses rather than loses (seccomp filters,
//! POSIX timers).

use crate::CheckpointError;
use cr_image::proto;
use cr_sys::proc::{self, Status};

/// Credentials from /proc/PID/status.
pub fn creds(status: &Status) -> proto::Creds {
    let ids = |k: &str| -> Vec<u32> {
        status
            .get(k)
            .unwrap_or("")
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect()
    };
    let cap = |k: &str| {
        status
            .get(k)
            .and_then(|v| u64::from_str_radix(v, 16).ok())
            .unwrap_or(0)
    };
    proto::Creds {
        uids: ids("Uid"),
        gids: ids("Gid"),
        groups: ids("Groups"),
        cap_inh: cap("CapInh"),
        cap_prm: cap("CapPrm"),
        cap_eff: cap("CapEff"),
        cap_bnd: cap("CapBnd"),
        cap_amb: cap("CapAmb"),
        no_new_privs: status.int("NoNewPrivs") == Some(1),
        keep_caps: false,
        dumpable: None,
    }
}

/// Refuse what would otherwise be lost silently.
pub fn check(pid: i32) -> Result<(), CheckpointError> {
    let unsupported = |what: String| CheckpointError::Unsupported { pid, what };
    let status = proc::read_status(pid).map_err(|e| CheckpointError::from_sys(pid, e))?;
    match status.int("Seccomp") {
        Some(0) | None => {}
        Some(mode) => {
            return Err(unsupported(format!(
                "seccomp {} ({} filters)",
                if mode == 1 { "strict mode" } else { "filter" },
                status.int("Seccomp_filters").unwrap_or(0)
            )))
        }
    }
    // Listed only with CONFIG_CHECKPOINT_RESTORE; absent means we cannot tell.
    if let Ok(timers) = proc::read_string(&format!("/proc/{pid}/timers")) {
        let n = timers.lines().filter(|l| l.starts_with("ID:")).count();
        if n > 0 {
            return Err(unsupported(format!("{n} POSIX timer(s) (timer_create)")));
        }
    }
    Ok(())
}
