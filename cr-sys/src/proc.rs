//! Reading /proc: the one home of it in the workspace. The `procfs` crate
//! parses stat, status, maps/smaps, the fd table and the thread list; what it
//! lacks is parsed here (fdinfo, which has a line format per file kind).
//! Errors keep the path they came from, and a process that is gone reads as
//! `NotFound`, so callers can tell "exited" from "refused".

use crate::error::{io_err, Result, SysError};
use procfs::process::{MMapPath, Process};
use std::path::PathBuf;

pub use procfs::process::{FDTarget, Stat, Status};

/// A `procfs` error as a `SysError` naming the file.
fn proc_err(path: String) -> impl FnOnce(procfs::ProcError) -> SysError {
    move |e| {
        use procfs::ProcError as E;
        let kind = match &e {
            E::NotFound(_) => std::io::ErrorKind::NotFound,
            E::PermissionDenied(_) => std::io::ErrorKind::PermissionDenied,
            _ => std::io::ErrorKind::InvalidData,
        };
        SysError::Io {
            path,
            source: std::io::Error::new(kind, e.to_string()),
        }
    }
}

fn process(pid: i32) -> Result<Process> {
    Process::new(pid).map_err(proc_err(format!("/proc/{pid}")))
}

/// One mapping of /proc/PID/maps (plus VmFlags when read from smaps).
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
    /// As /proc shows it: "" (anonymous), "[heap]", "/usr/lib/x.so", ...
    pub path: String,
    /// Two-letter VmFlags (smaps only).
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

    /// Whether `o` has the same line in /proc/PID/maps: bounds,
    /// protection, sharing, offset, device, inode and path (VmFlags aside).
    pub fn same_line(&self, o: &MapEntry) -> bool {
        (
            self.start,
            self.end,
            self.prot,
            self.shared,
            self.offset,
            self.dev_major,
            self.dev_minor,
            self.inode,
        ) == (
            o.start,
            o.end,
            o.prot,
            o.shared,
            o.offset,
            o.dev_major,
            o.dev_minor,
            o.inode,
        ) && self.path == o.path
    }
}

fn map_entry(m: &procfs::process::MemoryMap) -> MapEntry {
    use procfs::process::MMPermissions as P;
    let mut prot = 0;
    if m.perms.contains(P::READ) {
        prot |= libc::PROT_READ as u32;
    }
    if m.perms.contains(P::WRITE) {
        prot |= libc::PROT_WRITE as u32;
    }
    if m.perms.contains(P::EXECUTE) {
        prot |= libc::PROT_EXEC as u32;
    }
    let path = match &m.pathname {
        MMapPath::Path(p) => p.to_string_lossy().into_owned(),
        MMapPath::Heap => "[heap]".into(),
        MMapPath::Stack => "[stack]".into(),
        MMapPath::TStack(t) => format!("[stack:{t}]"),
        MMapPath::Vdso => "[vdso]".into(),
        MMapPath::Vvar => "[vvar]".into(),
        MMapPath::Vsyscall => "[vsyscall]".into(),
        MMapPath::Rollup => "[rollup]".into(),
        MMapPath::Anonymous => String::new(),
        MMapPath::Vsys(key) => format!("/SYSV{:08x} (deleted)", *key as u32),
        MMapPath::Other(s) => format!("[{s}]"),
    };
    MapEntry {
        start: m.address.0,
        end: m.address.1,
        prot,
        shared: m.perms.contains(P::SHARED),
        offset: m.offset,
        dev_major: m.dev.0 as u32,
        dev_minor: m.dev.1 as u32,
        inode: m.inode,
        path,
        vm_flags: Vec::new(),
    }
}

/// The mappings of a process (/proc/PID/maps).
pub fn maps(pid: i32) -> Result<Vec<MapEntry>> {
    let m = process(pid)?
        .maps()
        .map_err(proc_err(format!("/proc/{pid}/maps")))?;
    Ok(m.iter().map(map_entry).collect())
}

/// The mappings of a process with their VmFlags (/proc/PID/smaps).
pub fn smaps(pid: i32) -> Result<Vec<MapEntry>> {
    let path = format!("/proc/{pid}/smaps");
    let text = std::fs::read(&path).map_err(io_err(&path))?;
    parse_smaps(&text).map_err(|why| SysError::Io {
        path,
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
    })
}

/// The entries of an smaps text with their VmFlags as the kernel spells
/// them: `procfs` keeps only the mnemonics it knows, and a newer kernel
/// has more that a restore needs (`dp`, MAP_DROPPABLE, Linux 6.12).
pub fn parse_smaps(text: &[u8]) -> std::result::Result<Vec<MapEntry>, String> {
    use procfs::FromBufRead;
    let maps = procfs::process::MemoryMaps::from_buf_read(text).map_err(|e| e.to_string())?;
    let mut out: Vec<MapEntry> = maps.iter().map(map_entry).collect();
    let text = String::from_utf8_lossy(text);
    // One VmFlags line per entry, after its header line.
    let mut i = None;
    for line in text.lines() {
        if line.starts_with(|c: char| c.is_ascii_uppercase()) {
            if let (Some(i), Some(f)) = (i, line.strip_prefix("VmFlags:")) {
                let e: &mut MapEntry = out.get_mut(i).ok_or("more entries than parsed")?;
                e.vm_flags = f.split_whitespace().map(str::to_string).collect();
            }
        } else if !line.is_empty() {
            i = Some(i.map_or(0, |i| i + 1));
        }
    }
    if i.map_or(0, |i| i + 1) != out.len() {
        return Err(format!("{} entries parsed, {:?} headers", out.len(), i));
    }
    Ok(out)
}

/// The mappings of a process from /proc/PID/maps, each with the VmFlags
/// of the entry of `earlier` (an [`smaps`] read, sorted by address) that
/// has the same line; None when some line has no such entry (a mapping
/// made, moved, split or changed since). Reading maps walks no page, where
/// smaps counts every resident page of every mapping for Rss/Pss (and
/// seq_file computes a record twice when it does not fit what is left of
/// its buffer): for a large process the difference is most of a second.
/// madvise and mlock change VmFlags without changing the line: what the
/// caller makes of flags read earlier is up to it.
pub fn maps_with_flags(pid: i32, earlier: &[MapEntry]) -> Result<Option<Vec<MapEntry>>> {
    let mut now = maps(pid)?;
    for m in now.iter_mut() {
        let i = earlier.partition_point(|e| e.start < m.start);
        match earlier.get(i) {
            Some(e) if e.same_line(m) => m.vm_flags = e.vm_flags.clone(),
            _ => return Ok(None),
        }
    }
    Ok(Some(now))
}

/// /proc/PID/stat.
pub fn stat(pid: i32) -> Result<Stat> {
    process(pid)?
        .stat()
        .map_err(proc_err(format!("/proc/{pid}/stat")))
}

/// When process `pid` started, in seconds since the epoch (to about a
/// second: the kernel's boot time is whole seconds).
pub fn started_secs(pid: i32) -> Result<i64> {
    let st = stat(pid)?;
    let boot = procfs::boot_time_secs().map_err(proc_err("/proc/stat".into()))?;
    Ok((boot + st.starttime / procfs::ticks_per_second()) as i64)
}

/// /proc/PID/status.
pub fn status(pid: i32) -> Result<Status> {
    process(pid)?
        .status()
        .map_err(proc_err(format!("/proc/{pid}/status")))
}

/// /proc/PID/task/TID/status: what differs per thread (ids in a PID
/// namespace, signal state).
pub fn task_status(pid: i32, tid: i32) -> Result<Status> {
    let path = format!("/proc/{pid}/task/{tid}/status");
    process(pid)?
        .task_from_tid(tid)
        .and_then(|t| t.status())
        .map_err(proc_err(path))
}

/// What a thread's signals and seccomp say (lines SigPnd, ShdPnd, SigIgn
/// and Seccomp of /proc/PID/task/TID/status), read without parsing the
/// rest: asked before every batch of injected calls
/// (`remote::trap_free`), where [`task_status`]'s full parse cost as much
/// as a few ptrace stops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SigState {
    pub sigpnd: u64,
    pub shdpnd: u64,
    pub sigign: u64,
    /// None when the kernel has no seccomp line.
    pub seccomp: Option<u32>,
}

pub fn task_sig_state(pid: i32, tid: i32) -> Result<SigState> {
    let path = format!("/proc/{pid}/task/{tid}/status");
    let text = std::fs::read(&path).map_err(io_err(&path))?;
    parse_sig_state(&text).map_err(|why| SysError::Io {
        path,
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, why),
    })
}

/// A signal line missing or not hex is an error, never "nothing pending"
/// (`trap_free` then says no: a batch is not run blind).
fn parse_sig_state(text: &[u8]) -> std::result::Result<SigState, String> {
    let (mut pnd, mut shd, mut ign) = (None, None, None);
    let mut seccomp = None;
    for line in text.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let value = std::str::from_utf8(&line[colon + 1..]).unwrap_or("").trim();
        let hex = || u64::from_str_radix(value, 16).ok();
        match &line[..colon] {
            b"SigPnd" => pnd = hex(),
            b"ShdPnd" => shd = hex(),
            b"SigIgn" => ign = hex(),
            b"Seccomp" => seccomp = value.parse().ok(),
            _ => {}
        }
    }
    match (pnd, shd, ign) {
        (Some(sigpnd), Some(shdpnd), Some(sigign)) => Ok(SigState {
            sigpnd,
            shdpnd,
            sigign,
            seccomp,
        }),
        _ => Err("no readable SigPnd, ShdPnd and SigIgn lines".into()),
    }
}

#[cfg(test)]
#[test]
fn sig_state_of_a_status_file() {
    let text = b"Name:\tcat\nSigQ:\t0/63\nSigPnd:\t0000000000000100\nShdPnd:\t0000000000000000\nSigBlk:\t0000000000000000\nSigIgn:\t0000000000000004\nSeccomp:\t2\nSeccomp_filters:\t1\n";
    assert_eq!(
        parse_sig_state(text).unwrap(),
        SigState {
            sigpnd: 0x100,
            shdpnd: 0,
            sigign: 4,
            seccomp: Some(2)
        }
    );
    // A kernel without the line: None (taken for a filter by `trap_free`).
    let no_seccomp = b"SigPnd:\t0\nShdPnd:\t0\nSigIgn:\t0000000000000001\n";
    assert_eq!(parse_sig_state(no_seccomp).unwrap().seccomp, None);
    // A signal line missing or garbled: an error, not "nothing pending".
    assert!(parse_sig_state(b"SigIgn:\t0000000000000001\nSeccomp:\t0\n").is_err());
    assert!(parse_sig_state(b"SigPnd:\tzz\nShdPnd:\t0\nSigIgn:\t0\n").is_err());
}

/// The innermost id of a per-namespace list of status (NSpid, NSpgid,
/// NSsid): the id as the process's own PID namespace sees it.
pub fn ns_last(ids: &Option<Vec<i32>>) -> Option<u32> {
    ids.as_ref()?.last().map(|&i| i as u32)
}

/// How many PID namespace levels a per-namespace list has.
pub fn ns_depth(ids: &Option<Vec<i32>>) -> usize {
    ids.as_ref().map_or(0, Vec::len)
}

/// PF_KTHREAD in the stat flags field.
pub const PF_KTHREAD: u32 = 0x0020_0000;

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

    /// The value of the first line `key:`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.extra
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Every line `key:`.
    pub fn all<'a>(&'a self, key: &'a str) -> impl Iterator<Item = &'a str> {
        self.extra
            .iter()
            .filter(move |(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// The file a watch or mark of inotify or fanotify is on, as fdinfo shows
/// it: "sdev:fe00000 ... fhandle-bytes:8 fhandle-type:1 f_handle:a7c40300...".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchedHandle {
    /// The filesystem's device (kernel encoding: major << 20 | minor).
    pub sdev: u64,
    pub handle_type: i32,
    pub handle: Vec<u8>,
}

impl WatchedHandle {
    /// Read from the words of one fdinfo line.
    pub fn parse(line: &str) -> Option<WatchedHandle> {
        let sdev = u64::from_str_radix(&field(line, "sdev:")?, 16).ok()?;
        let handle_type = i32::from_str_radix(&field(line, "fhandle-type:")?, 16).ok()?;
        let hex = field(line, "f_handle:")?;
        let handle = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok())
            .collect::<Option<Vec<u8>>>()?;
        Some(WatchedHandle {
            sdev,
            handle_type,
            handle,
        })
    }

    /// (major, minor) of its filesystem.
    pub fn dev(&self) -> (u32, u32) {
        ((self.sdev >> 20) as u32, (self.sdev & 0xfffff) as u32)
    }
}

/// The value of the word `name` ("mask:") of an fdinfo line.
fn field(line: &str, name: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name).map(str::to_string))
}

fn hex_field(line: &str, name: &str) -> Option<u32> {
    u32::from_str_radix(&field(line, name)?, 16).ok()
}

/// A fanotify group as its fdinfo shows it: "fanotify flags:c02
/// event-flags:8000", then one line per mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FanotifyInfo {
    /// fanotify_init's flags and event_f_flags.
    pub flags: u32,
    pub event_flags: u32,
    pub marks: Vec<FanotifyMarkInfo>,
}

/// What a fanotify mark is on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FanotifyObject {
    /// "fanotify ino:a0402b sdev:fe00000 ... f_handle:..."
    Inode(WatchedHandle),
    /// "fanotify mnt_id:1b ..." (the id of /proc/PID/mountinfo).
    Mount { mnt_id: u64 },
    /// "fanotify sdev:fe00000 ..." (FAN_MARK_FILESYSTEM).
    Filesystem { sdev: u64 },
    /// A line of another kind (a newer kernel's): its key.
    Other(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FanotifyMarkInfo {
    pub on: FanotifyObject,
    pub mflags: u32,
    pub mask: u32,
    pub ignored_mask: u32,
}

impl FdInfo {
    /// The fanotify group of this fdinfo (None: not one, or unreadable;
    /// a mark line that cannot be read is `Other`).
    pub fn fanotify(&self) -> Option<FanotifyInfo> {
        let head = self.get("fanotify flags")?;
        let flags = u32::from_str_radix(head.split_whitespace().next()?, 16).ok()?;
        let event_flags = hex_field(head, "event-flags:")?;
        let marks = self
            .extra
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix("fanotify ")?, v)))
            .filter(|(k, _)| *k != "flags")
            .map(|(k, v)| {
                // The key's value is the line's first word.
                let line = format!("{k}:{v}");
                let first = || u64::from_str_radix(v.split_whitespace().next()?, 16).ok();
                let on = match k {
                    "ino" => WatchedHandle::parse(&line).map(FanotifyObject::Inode),
                    "mnt_id" => first().map(|mnt_id| FanotifyObject::Mount { mnt_id }),
                    "sdev" => first().map(|sdev| FanotifyObject::Filesystem { sdev }),
                    _ => None,
                };
                let mark = |on| {
                    Some(FanotifyMarkInfo {
                        on,
                        mflags: hex_field(&line, "mflags:")?,
                        mask: hex_field(&line, "mask:")?,
                        ignored_mask: hex_field(&line, "ignored_mask:")?,
                    })
                };
                on.and_then(mark).unwrap_or(FanotifyMarkInfo {
                    on: FanotifyObject::Other(line),
                    mflags: 0,
                    mask: 0,
                    ignored_mask: 0,
                })
            })
            .collect();
        Some(FanotifyInfo {
            flags,
            event_flags,
            marks,
        })
    }
}

/// A BPF map as its fdinfo shows it ("map_type:\t2", "key_size:\t4",
/// "value_size:\t4", "max_entries:\t8", "map_flags:\t0x4",
/// "map_extra:\t0x0", "memlock:\t...", "map_id:\t12", "frozen:\t1").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BpfMapFdInfo {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
    pub map_extra: u64,
    pub memlock: u64,
    pub map_id: u32,
    /// Frozen (BPF_MAP_FREEZE): no more writes from system calls.
    pub frozen: bool,
}

impl FdInfo {
    /// The BPF map of this fdinfo (None: not one, or unreadable).
    pub fn bpf_map(&self) -> Option<BpfMapFdInfo> {
        let dec = |k: &str| self.get(k)?.parse::<u64>().ok();
        let hex = |k: &str| {
            let v = self.get(k)?;
            u64::from_str_radix(v.trim_start_matches("0x"), 16).ok()
        };
        Some(BpfMapFdInfo {
            map_type: dec("map_type")? as u32,
            key_size: dec("key_size")? as u32,
            value_size: dec("value_size")? as u32,
            max_entries: dec("max_entries")? as u32,
            map_flags: hex("map_flags")? as u32,
            map_extra: hex("map_extra").unwrap_or(0),
            memlock: dec("memlock").unwrap_or(0),
            map_id: dec("map_id")? as u32,
            frozen: dec("frozen").unwrap_or(0) != 0,
        })
    }
}

/// The mount point of the mount whose id (mountinfo's first field) is
/// `mnt_id`, as our mount namespace sees it.
pub fn mount_point_by_id(mnt_id: u64) -> Option<PathBuf> {
    let mounts = Process::myself().ok()?.mountinfo().ok()?;
    mounts
        .iter()
        .find(|m| m.mnt_id as u64 == mnt_id)
        .map(|m| m.mount_point.clone())
}

/// /proc/PID/fdinfo/FD.
pub fn fdinfo(pid: i32, fd: i32) -> Result<FdInfo> {
    Ok(FdInfo::parse(&read_string(&format!(
        "/proc/{pid}/fdinfo/{fd}"
    ))?))
}

/// The open fds of a process with what they lead to, sorted by number
/// (an fd closed while the table is read is left out).
pub fn fds(pid: i32) -> Result<Vec<(i32, FDTarget)>> {
    let path = format!("/proc/{pid}/fd");
    let mut out: Vec<(i32, FDTarget)> = process(pid)?
        .fd()
        .map_err(proc_err(path))?
        .filter_map(|f| f.ok())
        .map(|f| (f.fd, f.target))
        .collect();
    out.sort_by_key(|(fd, _)| *fd);
    Ok(out)
}

/// The pipes a process holds open: (fd, pipe inode), from the links of
/// /proc/PID/fd alone (one readlink per fd, no stat: what a search of
/// every process on the host for a pipe's other end can afford).
pub fn pipe_fds(pid: i32) -> Vec<(i32, u64)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let fd = e.file_name().to_str()?.parse().ok()?;
            Some((fd, pipe_ino(&std::fs::read_link(e.path()).ok()?)?))
        })
        .collect()
}

/// Whether fd `fd` of `pid` is still open on pipe `ino`.
pub fn holds_pipe(pid: i32, fd: i32, ino: u64) -> bool {
    std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
        .ok()
        .and_then(|l| pipe_ino(&l))
        == Some(ino)
}

/// The inode of a "pipe:[N]" fd link.
fn pipe_ino(link: &std::path::Path) -> Option<u64> {
    link.to_str()?
        .strip_prefix("pipe:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The text of /proc/PID/fd/N an fd target stands for ("pipe:[12]", "/x").
pub fn target_text(t: &FDTarget) -> String {
    match t {
        FDTarget::Path(p) => p.to_string_lossy().into_owned(),
        FDTarget::Socket(i) => format!("socket:[{i}]"),
        FDTarget::Net(i) => format!("net:[{i}]"),
        FDTarget::Pipe(i) => format!("pipe:[{i}]"),
        FDTarget::AnonInode(k) => format!("anon_inode:{k}"),
        FDTarget::MemFD(n) => format!("/memfd:{n}"),
        FDTarget::Other(k, i) => format!("{k}:[{i}]"),
        FDTarget::Unknown(k, v) => format!("{k}:{v}"),
    }
}

/// Thread ids of a process, sorted.
pub fn tasks(pid: i32) -> Result<Vec<i32>> {
    let mut out: Vec<i32> = process(pid)?
        .tasks()
        .map_err(proc_err(format!("/proc/{pid}/task")))?
        .filter_map(|t| t.ok())
        .map(|t| t.tid)
        .collect();
    out.sort();
    Ok(out)
}

/// Children of every thread of a process.
pub fn children(pid: i32) -> Result<Vec<i32>> {
    let mut out = Vec::new();
    for t in process(pid)?
        .tasks()
        .map_err(proc_err(format!("/proc/{pid}/task")))?
        .flatten()
    {
        // Threads may exit meanwhile.
        if let Ok(kids) = t.children() {
            out.extend(kids.into_iter().map(|k| k as i32));
        }
    }
    Ok(out)
}

/// Every process of the system (of our PID namespace).
pub fn all_pids() -> Vec<i32> {
    procfs::process::all_processes()
        .map(|it| it.flatten().map(|p| p.pid()).collect())
        .unwrap_or_default()
}

/// The control groups of process `pid` (/proc/PID/cgroup): for each
/// hierarchy, its controllers comma-joined as the kernel lists them
/// ("cpu,cpuacct", "name=systemd"; empty for the unified v2 hierarchy) and
/// the group's path, relative to our cgroup namespace's root.
pub fn cgroups(pid: i32) -> Result<Vec<(String, String)>> {
    let list = process(pid)?
        .cgroups()
        .map_err(proc_err(format!("/proc/{pid}/cgroup")))?;
    Ok(list
        .0
        .into_iter()
        .map(|c| (c.controllers.join(","), c.pathname))
        .collect())
}

/// The control groups of thread `tid` of process `pid`
/// (/proc/PID/task/TID/cgroup), as [`cgroups`] gives a process's: a v1
/// hierarchy moves threads one by one, and v2 has threaded groups.
pub fn task_cgroups(pid: i32, tid: i32) -> Result<Vec<(String, String)>> {
    let path = format!("/proc/{pid}/task/{tid}/cgroup");
    Ok(read_string(&path)?
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, group) = (f.next()?, f.next()?, f.next()?);
            Some((controllers.to_string(), group.to_string()))
        })
        .collect())
}

/// Where a cgroup hierarchy is mounted in our mount namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// As [`cgroups`] names the hierarchy.
    pub controllers: String,
    /// The group at the mount point (a mount may show a subtree only).
    pub root: String,
    pub mount_point: PathBuf,
}

/// The mount of each cgroup hierarchy we are in (a hierarchy mounted
/// nowhere here is left out). A v1 mount is the hierarchy whose
/// controllers are all among its super options ("name=X" included).
pub fn cgroup_mounts() -> Result<Vec<CgroupMount>> {
    let me = Process::myself().map_err(proc_err("/proc/self".into()))?;
    let mounts = me
        .mountinfo()
        .map_err(proc_err("/proc/self/mountinfo".into()))?;
    let mut out = Vec::new();
    for (controllers, _) in cgroups(std::process::id() as i32)? {
        let of_it = |m: &&procfs::process::MountInfo| {
            if controllers.is_empty() {
                return m.fs_type == "cgroup2";
            }
            m.fs_type == "cgroup"
                && controllers.split(',').all(|c| match c.split_once('=') {
                    Some((k, v)) => m.super_options.get(k) == Some(&Some(v.to_string())),
                    None => m.super_options.contains_key(c),
                })
        };
        // The mount showing the whole hierarchy, if there is one.
        let best = mounts.iter().filter(of_it).min_by_key(|m| m.root.len());
        if let Some(m) = best {
            out.push(CgroupMount {
                controllers: controllers.clone(),
                root: m.root.clone(),
                mount_point: m.mount_point.clone(),
            });
        }
    }
    Ok(out)
}

/// The mount point of device `major:minor` (the root of one of its mounts,
/// as our mount namespace sees it).
pub fn mount_point(major: u32, minor: u32) -> Option<PathBuf> {
    let mounts = Process::myself().ok()?.mountinfo().ok()?;
    let on_dev = || {
        mounts
            .iter()
            .filter(|m| m.majmin == format!("{major}:{minor}"))
    };
    on_dev()
        .find(|m| m.root == "/")
        .or_else(|| on_dev().next())
        .map(|m| m.mount_point.clone())
}

/// Every mount point of device `dev` (st_dev) as process `pid` sees it.
pub fn mount_points_of(pid: i32, dev: u64) -> Vec<PathBuf> {
    let majmin = format!("{}:{}", dev_major(dev), dev_minor(dev));
    let Ok(mounts) = Process::new(pid).and_then(|p| p.mountinfo()) else {
        return Vec::new();
    };
    mounts
        .iter()
        .filter(|m| m.majmin == majmin)
        .map(|m| m.mount_point.clone())
        .collect()
}

/// Write `text` to a kernel file (/proc, /sys, cgroupfs) in one write; the
/// error names the file and the kernel's errno.
pub fn write_string(path: &str, text: &str) -> Result<()> {
    std::fs::write(path, text).map_err(|e| SysError::Syscall {
        what: format!("writing {text:?} to {path}"),
        source: crate::error::Errno(e.raw_os_error().unwrap_or(libc::EIO)),
    })
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

/// A file of /proc/sys (or another one-line file), trimmed; empty if unreadable.
pub fn sys_value(path: &str) -> String {
    read_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Real and effective uid and gid of the calling process: (uid, euid, gid, egid).
pub fn own_ids() -> (u32, u32, u32, u32) {
    use nix::unistd::{getegid, geteuid, getgid, getuid};
    (
        getuid().as_raw(),
        geteuid().as_raw(),
        getgid().as_raw(),
        getegid().as_raw(),
    )
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

    #[test]
    fn pipes_held_are_found_by_link_and_let_go() {
        use std::os::fd::AsRawFd;
        let (r, w) = nix::unistd::pipe().expect("pipe");
        let me = std::process::id() as i32;
        let ino = std::fs::metadata(format!("/proc/self/fd/{}", r.as_raw_fd()))
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .expect("stat the pipe");
        let mut found: Vec<i32> = pipe_fds(me)
            .into_iter()
            .filter(|&(_, i)| i == ino)
            .map(|(fd, _)| fd)
            .collect();
        found.sort();
        assert_eq!(found, vec![r.as_raw_fd(), w.as_raw_fd()]);
        assert!(holds_pipe(me, w.as_raw_fd(), ino));
        assert!(!holds_pipe(me, w.as_raw_fd(), ino + 1));
        let fd = w.as_raw_fd();
        drop(w);
        assert!(!holds_pipe(me, fd, ino), "a closed fd still holds the pipe");
    }

    #[test]
    fn fanotify_fdinfo_is_read() {
        let f = FdInfo::parse(
            "pos:\t0\nflags:\t04002\nmnt_id:\t17\nino:\t1038\n\
             fanotify flags:c02 event-flags:8000\n\
             fanotify ino:a0402b sdev:fe00000 mflags:200 mask:40000100 ignored_mask:1 fhandle-bytes:8 fhandle-type:1 f_handle:2b40a00005be4072\n\
             fanotify sdev:fe00000 mflags:0 mask:8 ignored_mask:0\n\
             fanotify mnt_id:1b mflags:40 mask:20 ignored_mask:2\n\
             fanotify mnt_ns:4 mflags:0 mask:1000000 ignored_mask:0\n",
        );
        let g = f.fanotify().expect("a fanotify group");
        assert_eq!((g.flags, g.event_flags), (0xc02, 0x8000));
        assert_eq!(g.marks.len(), 4);
        let h = WatchedHandle {
            sdev: 0xfe00000,
            handle_type: 1,
            handle: vec![0x2b, 0x40, 0xa0, 0x00, 0x05, 0xbe, 0x40, 0x72],
        };
        assert_eq!(h.dev(), (254, 0));
        assert_eq!(
            g.marks[0],
            FanotifyMarkInfo {
                on: FanotifyObject::Inode(h),
                mflags: 0x200,
                mask: 0x4000_0100,
                ignored_mask: 1,
            }
        );
        assert_eq!(
            g.marks[1].on,
            FanotifyObject::Filesystem { sdev: 0xfe00000 }
        );
        assert_eq!(g.marks[1].mask, 8);
        assert_eq!(g.marks[2].on, FanotifyObject::Mount { mnt_id: 0x1b });
        assert_eq!((g.marks[2].mflags, g.marks[2].ignored_mask), (0x40, 2));
        assert!(matches!(&g.marks[3].on, FanotifyObject::Other(l) if l.starts_with("mnt_ns:")));
        assert_eq!(FdInfo::parse("pos:\t0\n").fanotify(), None);
    }

    /// maps_with_flags: the flags of smaps on every unchanged line; None
    /// once a line differs. On a `cat` that echoed a line (started, then
    /// blocked reading: its mappings hold still).
    #[test]
    fn maps_take_the_flags_of_unchanged_lines() {
        use std::io::{BufRead, BufReader, Write};
        use std::process::{Command, Stdio};
        let mut child = Command::new("cat")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("cat runs");
        let pid = child.id() as i32;
        let mut input = child.stdin.take().expect("its stdin");
        input.write_all(b"up\n").expect("write to cat");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("its stdout"))
            .read_line(&mut line)
            .expect("cat echoes");
        assert_eq!(line, "up\n");
        let full = smaps(pid).expect("smaps of cat");
        assert!(full.iter().any(|m| !m.vm_flags.is_empty()));
        let cheap = maps_with_flags(pid, &full).expect("maps of cat");
        assert_eq!(cheap.as_deref(), Some(&full[..]));
        let mut moved = full.clone();
        moved[0].end += PAGE;
        assert_eq!(maps_with_flags(pid, &moved).expect("maps of cat"), None);
        assert_eq!(maps_with_flags(pid, &full[1..]).expect("maps of cat"), None);
        drop(input);
        child.wait().expect("cat ends at end of input");
    }

    const PAGE: u64 = 4096;

    #[test]
    fn fdinfo_flags_are_octal() {
        let f = FdInfo::parse("pos:\t10\nflags:\t02102001\nmnt_id:\t25\nino:\t7\n");
        assert_eq!(f.pos, 10);
        assert_eq!(f.flags, 0o2102001);
        assert_eq!(f.mnt_id, 25);
        assert_eq!(f.get("ino"), Some("7"));
    }

    #[test]
    fn our_own_process() {
        let me = std::process::id() as i32;
        let st = stat(me).unwrap();
        assert_eq!(st.pid, me);
        assert!(tasks(me).unwrap().contains(&me));
        let maps = smaps(me).unwrap();
        assert!(maps.iter().any(|m| m.path == "[stack]" && m.has_flag("gd")));
        assert!(maps.iter().any(|m| m.path == "[vdso]"));
        let fds = fds(me).unwrap();
        assert!(fds.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(status(me).unwrap().umask.is_some());
    }

    #[test]
    fn a_process_that_is_gone_is_not_found() {
        let e = stat(i32::MAX - 1).unwrap_err();
        assert!(
            matches!(&e, SysError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound),
            "{e:?}"
        );
    }

    #[test]
    fn bpf_map_fdinfo() {
        let fi = FdInfo::parse(
            "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nmap_type:\t2\nkey_size:\t4\nvalue_size:\t8\nmax_entries:\t10\nmap_flags:\t0x4\nmap_extra:\t0x0\nmemlock:\t328\nmap_id:\t77\nfrozen:\t1\n",
        );
        let m = fi.bpf_map().unwrap();
        assert_eq!(
            (m.map_type, m.key_size, m.value_size, m.max_entries),
            (2, 4, 8, 10)
        );
        assert_eq!(
            (m.map_flags, m.map_id, m.frozen, m.memlock),
            (4, 77, true, 328)
        );
        assert!(FdInfo::parse("pos:\t0\nflags:\t02\n").bpf_map().is_none());
    }

    #[test]
    fn targets_read_as_in_proc() {
        for t in [
            "pipe:[12]",
            "socket:[7]",
            "anon_inode:[eventfd]",
            "/memfd:x (deleted)",
            "/a b",
        ] {
            let parsed: FDTarget = t.parse().unwrap();
            assert_eq!(target_text(&parsed), t);
        }
    }
}

/// Who holds a PID (or a TID) that a restore needs.
#[derive(Debug, Clone)]
pub struct PidHolder {
    pub pid: i32,
    pub comm: String,
    pub zombie: bool,
    /// Exiting (PF_EXITING): freeing its memory and files.
    pub exiting: bool,
    pub ppid: i32,
    pub parent_comm: String,
}

impl PidHolder {
    /// "`comm` (running)", "a zombie of `comm` that its parent 12 (`bash`)
    /// has not reaped"...
    pub fn describe(&self) -> String {
        if self.zombie {
            format!(
                "a zombie of `{}` that its parent {} (`{}`) has not reaped",
                self.comm, self.ppid, self.parent_comm
            )
        } else if self.exiting {
            format!("`{}`, still exiting", self.comm)
        } else {
            format!(
                "`{}` (running, parent {} `{}`)",
                self.comm, self.ppid, self.parent_comm
            )
        }
    }
}

/// The process or thread holding `pid`, if it still exists.
pub fn pid_holder(pid: i32) -> Option<PidHolder> {
    /// include/linux/sched.h
    const PF_EXITING: u32 = 0x4;
    let st = stat(pid).ok()?;
    let parent_comm = stat(st.ppid).map(|p| p.comm).unwrap_or_default();
    Some(PidHolder {
        pid,
        zombie: matches!(st.state, 'Z' | 'X'),
        exiting: st.flags & PF_EXITING != 0,
        ppid: st.ppid,
        parent_comm,
        comm: st.comm,
    })
}

/// A live process (not exiting, not a zombie) whose process group or
/// session is named `id` while no process has that PID: the kernel keeps
/// the number taken as long as a group or session has it, so no process
/// can be created with it (clone3 `set_tid` answers EEXIST). Answers its
/// PID and "process group" or "session".
pub fn group_or_session_of(id: i32) -> Option<(i32, &'static str)> {
    /// include/linux/sched.h
    const PF_EXITING: u32 = 0x4;
    all_pids().into_iter().find_map(|p| {
        let st = stat(p).ok()?;
        if matches!(st.state, 'Z' | 'X') || st.flags & PF_EXITING != 0 {
            return None;
        }
        if st.pgrp == id {
            Some((p, "process group"))
        } else if st.session == id {
            Some((p, "session"))
        } else {
            None
        }
    })
}

/// MemAvailable of /proc/meminfo, in bytes.
pub fn mem_available() -> Result<u64> {
    <procfs::Meminfo as procfs::Current>::current()
        .map_err(proc_err("/proc/meminfo".to_string()))
        .map(|m| m.mem_available.unwrap_or(m.mem_free))
}

/// A line of /proc/PID/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mnt_id: i32,
    pub parent_id: i32,
    /// "major:minor" of its file system.
    pub majmin: String,
    /// The directory of its file system it shows.
    pub root: String,
    /// Where it is, as the process sees it.
    pub mount_point: String,
    pub fs_type: String,
    pub source: String,
    /// Per-mount options (ro, nosuid, relatime...), sorted.
    pub options: Vec<String>,
    /// Super-block options ("key" or "key=value"), sorted.
    pub super_options: Vec<String>,
    /// The peer group it is shared in.
    pub shared: Option<u32>,
    /// The peer group it receives events from (a slave).
    pub master: Option<u32>,
}

/// The mounts process `pid` sees, in the order of its mountinfo.
pub fn mountinfo(pid: i32) -> Result<Vec<MountEntry>> {
    let path = format!("/proc/{pid}/mountinfo");
    let infos = Process::new(pid)
        .and_then(|p| p.mountinfo())
        .map_err(proc_err(path))?;
    let opts = |m: &std::collections::HashMap<String, Option<String>>| {
        let mut v: Vec<String> = m
            .iter()
            .map(|(k, v)| match v {
                Some(v) => format!("{k}={v}"),
                None => k.clone(),
            })
            .collect();
        v.sort();
        v
    };
    use procfs::process::MountOptFields as F;
    Ok(infos
        .iter()
        .map(|m| MountEntry {
            mnt_id: m.mnt_id,
            parent_id: m.pid,
            majmin: m.majmin.clone(),
            root: m.root.clone(),
            mount_point: m.mount_point.to_string_lossy().into_owned(),
            fs_type: m.fs_type.clone(),
            source: m.mount_source.clone().unwrap_or_default(),
            options: opts(&m.mount_options),
            super_options: opts(&m.super_options),
            shared: m.opt_fields.iter().find_map(|f| match f {
                F::Shared(g) => Some(*g),
                _ => None,
            }),
            master: m.opt_fields.iter().find_map(|f| match f {
                F::Master(g) => Some(*g),
                _ => None,
            }),
        })
        .collect())
}
