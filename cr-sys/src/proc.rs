//! Parsers of /proc/PID files: maps and smaps, stat, status, fd and fdinfo,
//! children. Each takes the text so it can be unit tested on fixtures.

use crate::error::{io_err, Result, SysError};
use std::collections::BTreeMap;

/// One line of /proc/PID/maps (plus VmFlags when read from smaps).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MapEntry {
    pub start: u64,
    pub end: u64,
    /// PROT_READ | PROT_WRITE | PROT_EXEC bits.
    pub prot: u32,
    pub shared: bool,
    pub offset: u64,
    pub dev_major: u32,
    pub dev_minor: u32,
    pub inode: u64,
    pub path: String,
    pub vm_flags: Vec<String>,
}

impl MapEntry {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    pub fn has_flag(&self, f: &str) -> bool {
        self.vm_flags.iter().any(|x| x == f)
    }
}

fn parse_map_line(line: &str) -> Option<MapEntry> {
    let mut it = line.splitn(6, ' ');
    let range = it.next()?;
    let perms = it.next()?;
    let offset = it.next()?;
    let dev = it.next()?;
    let inode = it.next()?;
    let path = it.next().unwrap_or("").trim_start().to_string();
    let (s, e) = range.split_once('-')?;
    let (maj, min) = dev.split_once(':')?;
    let pb = perms.as_bytes();
    if pb.len() < 4 {
        return None;
    }
    let mut prot = 0u32;
    if pb[0] == b'r' {
        prot |= libc::PROT_READ as u32;
    }
    if pb[1] == b'w' {
        prot |= libc::PROT_WRITE as u32;
    }
    if pb[2] == b'x' {
        prot |= libc::PROT_EXEC as u32;
    }
    Some(MapEntry {
        start: u64::from_str_radix(s, 16).ok()?,
        end: u64::from_str_radix(e, 16).ok()?,
        prot,
        shared: pb[3] == b's',
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev_major: u32::from_str_radix(maj, 16).ok()?,
        dev_minor: u32::from_str_radix(min, 16).ok()?,
        inode: inode.parse().ok()?,
        path,
        vm_flags: Vec::new(),
    })
}

/// Parse /proc/PID/maps or /proc/PID/smaps text (VmFlags filled from smaps).
pub fn parse_maps(text: &str, path: &str) -> Result<Vec<MapEntry>> {
    let mut out: Vec<MapEntry> = Vec::new();
    for line in text.lines() {
        let first = line.split(' ').next().unwrap_or("");
        if first.ends_with(':') {
            if let (Some(rest), Some(last)) = (line.strip_prefix("VmFlags:"), out.last_mut()) {
                last.vm_flags = rest.split_whitespace().map(str::to_string).collect();
            }
            continue;
        }
        if line.is_empty() {
            continue;
        }
        out.push(parse_map_line(line).ok_or_else(|| SysError::Parse {
            path: path.to_string(),
            what: format!("bad maps line {line:?}"),
        })?);
    }
    Ok(out)
}

pub fn read_string(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(io_err(path))
}

pub fn read_bytes(path: &str) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(io_err(path))
}

pub fn read_link(path: &str) -> Result<String> {
    std::fs::read_link(path)
        .map(|p| p.to_string_lossy().into_owned())
        .map_err(io_err(path))
}

pub fn read_maps(pid: i32) -> Result<Vec<MapEntry>> {
    let path = format!("/proc/{pid}/maps");
    parse_maps(&read_string(&path)?, &path)
}

pub fn read_smaps(pid: i32) -> Result<Vec<MapEntry>> {
    let path = format!("/proc/{pid}/smaps");
    parse_maps(&read_string(&path)?, &path)
}

/// /proc/PID/stat. `field(n)` uses the numbering of proc(5) (1 = pid).
#[derive(Debug, Clone)]
pub struct Stat {
    pub pid: i32,
    pub comm: String,
    pub state: char,
    /// Fields 3.. as text.
    rest: Vec<String>,
}

impl Stat {
    pub fn parse(text: &str, path: &str) -> Result<Stat> {
        let bad = |what: &str| SysError::Parse {
            path: path.to_string(),
            what: what.to_string(),
        };
        let open = text.find('(').ok_or_else(|| bad("no '('"))?;
        let close = text.rfind(')').ok_or_else(|| bad("no ')'"))?;
        let pid = text[..open].trim().parse().map_err(|_| bad("bad pid"))?;
        let comm = text[open + 1..close].to_string();
        let rest: Vec<String> = text[close + 1..]
            .split_whitespace()
            .map(str::to_string)
            .collect();
        let state = rest
            .first()
            .and_then(|s| s.chars().next())
            .ok_or_else(|| bad("no state"))?;
        Ok(Stat {
            pid,
            comm,
            state,
            rest,
        })
    }

    /// Numeric field `n` (proc(5) numbering, n >= 4); 0 if absent.
    pub fn field(&self, n: usize) -> u64 {
        self.rest
            .get(n.wrapping_sub(3))
            .and_then(|s| s.parse::<i64>().ok())
            .map(|v| v as u64)
            .unwrap_or(0)
    }

    pub fn ppid(&self) -> i32 {
        self.field(4) as i32
    }
    pub fn flags(&self) -> u64 {
        self.field(9)
    }
    pub fn num_threads(&self) -> u64 {
        self.field(20)
    }
}

pub fn read_stat(pid: i32) -> Result<Stat> {
    let path = format!("/proc/{pid}/stat");
    Stat::parse(&read_string(&path)?, &path)
}

/// PF_KTHREAD in the stat flags field.
pub const PF_KTHREAD: u64 = 0x0020_0000;

/// /proc/PID/status as key -> value.
#[derive(Debug, Clone, Default)]
pub struct Status(pub BTreeMap<String, String>);

impl Status {
    pub fn parse(text: &str) -> Status {
        Status(
            text.lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.to_string(), v.trim().to_string()))
                .collect(),
        )
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.0.get(k).map(String::as_str)
    }

    pub fn int(&self, k: &str) -> Option<i64> {
        self.get(k)?.split_whitespace().next()?.parse().ok()
    }

    /// The innermost value of a per-namespace list ("NSpid", "NSpgid",
    /// "NSsid"): the id as the process's own PID namespace sees it.
    pub fn ns_last(&self, k: &str) -> Option<u32> {
        self.get(k)?.split_whitespace().last()?.parse().ok()
    }

    /// How many PID namespace levels a "NS*" list has.
    pub fn ns_depth(&self, k: &str) -> usize {
        self.get(k).map_or(0, |v| v.split_whitespace().count())
    }

    /// Umask (octal).
    pub fn umask(&self) -> Option<u32> {
        u32::from_str_radix(self.get("Umask")?, 8).ok()
    }
}

pub fn read_status(pid: i32) -> Result<Status> {
    Ok(Status::parse(&read_string(&format!("/proc/{pid}/status"))?))
}

/// /proc/PID/fdinfo/N.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FdInfo {
    pub pos: u64,
    /// f_flags, including O_CLOEXEC when the fd is close-on-exec.
    pub flags: u32,
    pub mnt_id: u64,
    /// Every other line, for type-specific state.
    pub extra: Vec<(String, String)>,
}

impl FdInfo {
    pub fn parse(text: &str) -> FdInfo {
        let mut fi = FdInfo::default();
        for l in text.lines() {
            let Some((k, v)) = l.split_once(':') else {
                continue;
            };
            let v = v.trim();
            match k {
                "pos" => fi.pos = v.parse().unwrap_or(0),
                "flags" => fi.flags = u32::from_str_radix(v, 8).unwrap_or(0),
                "mnt_id" => fi.mnt_id = v.parse().unwrap_or(0),
                _ => fi.extra.push((k.to_string(), v.to_string())),
            }
        }
        fi
    }
}

pub fn read_fdinfo(pid: i32, fd: i32) -> Result<FdInfo> {
    Ok(FdInfo::parse(&read_string(&format!(
        "/proc/{pid}/fdinfo/{fd}"
    ))?))
}

/// Open fds of a process with their link targets, sorted by number.
pub fn list_fds(pid: i32) -> Result<Vec<(i32, String)>> {
    let dir = format!("/proc/{pid}/fd");
    let mut out = Vec::new();
    for e in std::fs::read_dir(&dir).map_err(io_err(&dir))? {
        let e = e.map_err(io_err(&dir))?;
        let Some(fd) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        // An fd closed between readdir and readlink is simply gone.
        if let Ok(target) = read_link(&format!("{dir}/{fd}")) {
            out.push((fd, target));
        }
    }
    out.sort();
    Ok(out)
}

/// Thread ids of a process.
pub fn list_tasks(pid: i32) -> Result<Vec<i32>> {
    let dir = format!("/proc/{pid}/task");
    let mut out: Vec<i32> = std::fs::read_dir(&dir)
        .map_err(io_err(&dir))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    out.sort();
    Ok(out)
}

/// Children of every thread of a process.
pub fn children(pid: i32) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for tid in list_tasks(pid)? {
        let path = format!("/proc/{pid}/task/{tid}/children");
        // Threads may exit meanwhile.
        if let Ok(text) = std::fs::read_to_string(&path) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|s| s.parse::<i32>().ok()),
            );
        }
    }
    Ok(out)
}

/// Real and effective uid and gid of the calling process: (uid, euid, gid, egid).
pub fn own_ids() -> (u32, u32, u32, u32) {
    // SAFETY: these calls cannot fail and touch no memory.
    unsafe {
        (
            libc::getuid(),
            libc::geteuid(),
            libc::getgid(),
            libc::getegid(),
        )
    }
}

/// Highest capability number this kernel knows.
pub fn cap_last_cap() -> u32 {
    read_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Major number of a device number (st_rdev, or tty_nr of /proc/PID/stat,
/// which uses the same encoding).
pub fn dev_major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff)
}

/// Minor number of a device number (see [`dev_major`]).
pub fn dev_minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0xff)
}

/// Index N of the pty slave /dev/pts/N with device number `dev`, if it is one.
pub fn pty_slave_index(dev: u64) -> Option<u32> {
    let major = dev_major(dev);
    (136..=143)
        .contains(&major)
        .then(|| ((major - 136) << 8 | dev_minor(dev)) as u32)
}

/// The device `dev` is `major:minor`.
pub fn is_dev(dev: u64, major: u64, minor: u64) -> bool {
    (dev_major(dev), dev_minor(dev)) == (major, minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d6c5a3e000-55d6c5a40000 r--p 00000000 fd:01 1234                       /usr/bin/my prog
Size:                  8 kB
VmFlags: rd mr mw me dw sd
7ffd1c1e0000-7ffd1c201000 rw-p 00000000 00:00 0                          [stack]
Size:                132 kB
VmFlags: rd wr mr mw me gd ac
7f0000000000-7f0000001000 rw-s 00000000 00:01 42                         /dev/zero (deleted)
VmFlags: rd wr sh mr mw me ms sd
7f0000002000-7f0000003000 ---p 00000000 00:00 0 
";

    #[test]
    fn smaps_entries_and_flags() {
        let m = parse_maps(SMAPS, "smaps").unwrap();
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].path, "/usr/bin/my prog");
        assert_eq!(m[0].prot, libc::PROT_READ as u32);
        assert_eq!(
            (m[0].dev_major, m[0].dev_minor, m[0].inode),
            (0xfd, 1, 1234)
        );
        assert!(m[1].has_flag("gd"));
        assert_eq!(m[1].path, "[stack]");
        assert!(m[2].shared);
        assert_eq!(m[2].path, "/dev/zero (deleted)");
        assert_eq!(m[3].prot, 0);
        assert_eq!(m[3].path, "");
        assert!(m[3].vm_flags.is_empty());
    }

    #[test]
    fn stat_with_spaces_and_parens_in_comm() {
        let s = Stat::parse(
            "42 (a (b) c) S 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0",
            "stat",
        )
        .unwrap();
        assert_eq!(s.pid, 42);
        assert_eq!(s.comm, "a (b) c");
        assert_eq!(s.state, 'S');
        assert_eq!(s.ppid(), 1);
        assert_eq!(s.flags(), 4194560);
        assert_eq!(s.num_threads(), 1);
    }

    #[test]
    fn fdinfo_flags_are_octal() {
        let f = FdInfo::parse("pos:\t10\nflags:\t02102001\nmnt_id:\t25\nino:\t7\n");
        assert_eq!(f.pos, 10);
        assert_eq!(f.flags, 0o2102001);
        assert_eq!(f.mnt_id, 25);
        assert_eq!(f.extra, vec![("ino".to_string(), "7".to_string())]);
    }

    #[test]
    fn status_umask() {
        let s = Status::parse("Name:\tx\nUmask:\t0027\nTracerPid:\t0\n");
        assert_eq!(s.umask(), Some(0o27));
        assert_eq!(s.int("TracerPid"), Some(0));
    }
}
