//! File locks an fd holds, read from the "lock:" lines of
//! /proc/PID/fdinfo/FD (same format as /proc/locks):
//!
//! ```text
//! lock:   1: FLOCK  ADVISORY  WRITE 5122 fe:00:10010639 0 EOF
//! lock:   1: POSIX  ADVISORY  WRITE 5122 fe:00:10010639 5 14
//! lock:   1: OFDLCK ADVISORY  READ -1 fe:00:10010639 50 59
//! ```
//!
//! The kernel lists a lock on the fd whose open file description took it
//! (flock, OFD) or through which the process took it (POSIX). Lines
//! starting with "->" are waiters, not holders: a process blocked in
//! F_SETLKW or flock() asks again when its syscall restarts.

use cr_image::proto;
use cr_sys::proc::FdInfo;

/// The locks held through this fd.
pub fn of_fd(info: &FdInfo) -> Result<Vec<proto::FileLock>, String> {
    info.extra
        .iter()
        .filter(|(k, _)| k == "lock")
        .filter_map(|(_, v)| parse(v).transpose())
        .collect()
}

fn parse(line: &str) -> Result<Option<proto::FileLock>, String> {
    let w: Vec<&str> = line.split_whitespace().collect();
    // "1:" "FLOCK" "ADVISORY" "WRITE" pid dev:ino start end
    if w.len() < 8 || w[1] == "->" || w[0] == "->" {
        return Ok(None);
    }
    let kind = match w[1] {
        "FLOCK" => proto::LockKind::Flock,
        "POSIX" => proto::LockKind::Posix,
        "OFDLCK" => proto::LockKind::Ofd,
        "LEASE" | "DELEG" => return Err("holding a file lease (not supported)".into()),
        other => return Err(format!("holding a lock of kind {other} (not supported)")),
    };
    if w[2] == "MANDATORY" {
        return Err("holding a mandatory lock (not supported)".into());
    }
    let lock_type = match w[3] {
        "READ" => libc::F_RDLCK,
        "WRITE" => libc::F_WRLCK,
        other => return Err(format!("holding a lock of mode {other} (not supported)")),
    } as u32;
    let start: u64 = w[6]
        .parse()
        .map_err(|_| format!("an unreadable lock line {line:?}"))?;
    let len = match w[7] {
        "EOF" => 0,
        end => {
            end.parse::<u64>()
                .map_err(|_| format!("an unreadable lock line {line:?}"))?
                .saturating_sub(start)
                + 1
        }
    };
    Ok(Some(proto::FileLock {
        kind: kind as i32,
        lock_type,
        start,
        len,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines() {
        let l = parse("1: POSIX  ADVISORY  WRITE 5122 fe:00:10010639 5 14")
            .unwrap()
            .unwrap();
        assert_eq!(
            (l.kind, l.start, l.len),
            (proto::LockKind::Posix as i32, 5, 10)
        );
        let l = parse("1: FLOCK  ADVISORY  WRITE 5122 fe:00:10010639 0 EOF")
            .unwrap()
            .unwrap();
        assert_eq!(
            (l.kind, l.len, l.lock_type),
            (proto::LockKind::Flock as i32, 0, 1)
        );
        assert!(parse("1: -> POSIX  ADVISORY  WRITE 77 fe:00:1 0 EOF")
            .unwrap()
            .is_none());
        assert!(parse("1: LEASE  ACTIVE    READ 5 fe:00:1 0 EOF").is_err());
    }
}
