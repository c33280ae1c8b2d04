//! Resource limits of another process: read from /proc, set with prlimit64.

use crate::error::{Errno, Result, SysError};

/// Every limit of `pid` as (soft, hard), from /proc/PID/limits (prlimit64
/// on another user's process would need CAP_SYS_RESOURCE).
pub fn get_all(pid: i32) -> Result<Vec<(u64, u64)>> {
    let path = format!("/proc/{pid}/limits");
    parse(&crate::proc::read_string(&path)?, &path)
}

/// Parse /proc/PID/limits: fixed columns (name 26, soft 21, hard 21), in
/// resource order; "unlimited" is RLIM_INFINITY.
pub fn parse(text: &str, path: &str) -> Result<Vec<(u64, u64)>> {
    let value = |s: &str| -> Option<u64> {
        match s.trim() {
            "unlimited" => Some(u64::MAX),
            v => v.parse().ok(),
        }
    };
    text.lines()
        .skip(1)
        .map(|l| {
            let soft = l.get(26..46).and_then(value);
            let hard = l.get(47..67).and_then(value);
            soft.zip(hard).ok_or_else(|| SysError::Parse {
                path: path.to_string(),
                what: format!("bad limits line {l:?}"),
            })
        })
        .collect()
}

/// Set limit `res` of `pid`.
pub fn set(pid: i32, res: u32, soft: u64, hard: u64) -> Result<()> {
    let new = libc::rlimit64 {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // Raw: nix's setrlimit only sets the caller's own limits (no prlimit).
    // SAFETY: `new` is a valid in pointer; no old value is asked for.
    let r = unsafe { libc::prlimit64(pid, res as _, &new, std::ptr::null_mut()) };
    if r != 0 {
        return Err(SysError::Syscall {
            what: format!("prlimit64 setting resource {res} of process {pid} to {soft}/{hard}"),
            source: Errno::last(),
        });
    }
    Ok(())
}

/// Raise this process's soft limit of open files to its hard one (a
/// daemon with a connection to and from each of thousands of nodes needs
/// more than the usual soft 1024); the limit now.
pub fn raise_nofile() -> Result<u64> {
    let me = std::process::id() as i32;
    let res = libc::RLIMIT_NOFILE as usize;
    let path = format!("/proc/{me}/limits");
    let (soft, hard) = *get_all(me)?.get(res).ok_or_else(|| SysError::Parse {
        path,
        what: "no line for open files".into(),
    })?;
    if soft < hard {
        set(me, res as u32, hard, hard)?;
    }
    Ok(hard)
}

#[cfg(test)]
mod tests {
    #[test]
    fn limits_text() {
        let t = "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max open files            123                  456                  files     \n";
        assert_eq!(
            super::parse(t, "x").unwrap(),
            vec![(u64::MAX, u64::MAX), (123, 456)]
        );
    }
}
