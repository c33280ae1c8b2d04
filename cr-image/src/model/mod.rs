//! The typed image: what a checkpoint holds, as Rust values the engines
//! use. The protobuf messages of `proto/image.proto` stay private to this
//! module ([`pb`]); [`Checkpoint::decode`] turns them into these types and
//! checks every value on the way (enum values, lengths, indexes, address
//! ranges, references between processes, fds and objects), so nothing an
//! image says can make an engine panic or index out of bounds.
//!
//! One file per resource kind holds its section of the image, with its
//! conversion and its checks: [`tree`] (ids and state of a process),
//! [`task`], [`memory`], [`threads`], [`signals`], [`timers`],
//! [`identity`], [`seccomp`], [`fds`] (the fd table and every kind of open
//! file) and [`objects`] (what fds share: pipes, sockets, file contents,
//! ptys); for the whole tree, [`sysv`] (System V IPC objects) and
//! [`mounts`] (a job's own mount namespace) and [`uts`] (its own host
//! name).

pub mod cgroups;
pub mod fds;
pub mod identity;
pub mod memory;
pub mod mounts;
pub mod netns;
pub mod objects;
pub mod outside;
pub mod seccomp;
mod ser;
pub mod signals;
pub mod sysv;
pub mod task;
pub mod threads;
pub mod timers;
pub mod tree;
pub mod uts;

pub use cgroups::{Cgroup, CgroupDir};
pub use fds::{Fd, FdKind, FdOwner, FileLock, LeaseBreak, LockKind, SharedFd};
pub use identity::{Creds, Identity, RLimit};
pub use memory::{
    AioRing, Compression, DirtyMethod, MemStats, Memory, Mm, PageAt, PageExtent, PageFile, PageRun,
    PageStore, ShmOwner, StoreBlock, Vma, VmaKind, AIO_EVENT,
};
pub use mounts::{
    Mount, MountKind, MountNs, Propagation, Tmpfs, TmpfsEntry, TmpfsKind, NEW_FS_TYPES,
};
pub use netns::{NetDevice, NetNs};
pub use objects::{inet_proto_name, Object, ObjectKind, ObjectTag};
pub use outside::OutsideFile;
pub use seccomp::{SeccompFilter, SeccompMode, ThreadSeccomp};
pub use signals::{AltStack, SigAction, SigInfo, Signals};
pub use sysv::{IpcPerm, MsgQueue, SemSet, ShmSegment, SysvIpc, SysvMessage};
pub use task::{Sched, Task};
pub use threads::{GpRegs, Rseq, Thread};
pub use timers::{ITimer, Notify, PosixTimer, Timers};
pub use tree::ProcState;
pub use uts::UtsNs;

use prost::Message;
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// The generated protobuf messages of `proto/image.proto`.
#[allow(clippy::all)]
pub(crate) mod pb {
    include!(concat!(env!("OUT_DIR"), "/cr.image.v3.rs"));
}

/// What is wrong with an image's metadata, said as "where: what".
pub type Bad = String;

/// A required sub-message.
pub(crate) fn need<T>(v: Option<T>, what: &str) -> Result<T, Bad> {
    v.ok_or_else(|| format!("{what} is missing"))
}

/// An enum value this build knows (an unknown one was written by a newer
/// version, or is damage: never a silent default).
pub(crate) fn known<E: TryFrom<i32>>(v: i32, what: &str) -> Result<E, Bad> {
    E::try_from(v).map_err(|_| format!("{what} has the unknown value {v}"))
}

/// A `oneof` whose case this build knows (an absent one was written by a
/// newer version, or is damage).
pub(crate) fn known_case<T>(v: Option<T>, what: &str) -> Result<T, Bad> {
    v.ok_or_else(|| format!("{what} is of a kind this build does not know"))
}

/// Prefix a problem with where it was found.
pub(crate) fn at<T>(r: Result<T, Bad>, place: impl FnOnce() -> String) -> Result<T, Bad> {
    r.map_err(|e| format!("{}: {e}", place()))
}

/// The whole checkpoint of one process tree (`checkpoint.img`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Checkpoint {
    #[serde(flatten)]
    pub meta: Meta,
    pub root_pid: u32,
    /// The root is PID 1 of its own PID namespace (a `cr_run` job).
    pub pidns: bool,
    /// Parents before children; the root first.
    pub processes: Vec<Process>,
    pub objects: Vec<Object>,
    /// The nft table holding the image's TCP connections still until the
    /// restore (the processes were killed or stopped after the dump).
    pub netlock: Option<String>,
    pub parent: Option<ParentRef>,
    pub store: Option<PageStore>,
    /// Memory only, taken while the processes ran: not restorable alone.
    pub pre_dump: bool,
    /// kind "sysv": System V IPC objects (None: none).
    pub sysv: Option<SysvIpc>,
    /// kind "mounts": the tree's own mount namespace (None: the host's).
    pub mounts: Option<MountNs>,
    /// The directory of a cr_run job (`cr_run --dir`).
    pub job_dir: Option<String>,
    /// kind "uts": the tree's own UTS namespace (None: the host's).
    pub uts: Option<UtsNs>,
    /// kind "cgroups": the root group of the tree's own cgroup namespace in
    /// each hierarchy (None: the checkpointer's namespace).
    pub cgroupns: Option<Vec<Cgroup>>,
    /// kind "netns": the tree's own network namespace (None: the
    /// checkpointer's).
    pub netns: Option<NetNs>,
    /// Files outside the image it relies on, as they were.
    pub outside_files: Vec<OutsideFile>,
    /// kind "cgroups": the groups the tree relies on, parents first, with
    /// their settings (see [`CgroupDir`]).
    pub cgroup_dirs: Vec<CgroupDir>,
    /// kind "cgroups": the job's frame in the hierarchies named by
    /// `cr_checkpoint --cgroup-root` (the root process's group or one above
    /// it; a hierarchy not listed: the root process's group).
    pub cgroup_frames: Vec<Cgroup>,
}

/// Where and by what the image was taken.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Meta {
    pub tool_version: String,
    pub created_unix_ms: u64,
    pub hostname: String,
    pub kernel_release: String,
    pub boot_id: String,
    /// The root's network namespace ("net:[INODE]").
    pub netns: String,
    /// XCR0 of the CPU: restore refuses a CPU lacking any of these.
    #[serde(serialize_with = "ser::hex")]
    pub cpu_xfeatures: u64,
    /// 32 hex digits.
    pub image_id: String,
    /// GNU build id of the vDSO the processes used (empty: unknown).
    #[serde(serialize_with = "ser::hex_bytes")]
    pub vdso_build_id: Vec<u8>,
}

/// How an incremental image names its parent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParentRef {
    /// Relative to the image's directory when both share a root.
    pub path: String,
    pub image_id: String,
}

/// One process of the tree: its section per resource kind.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Process {
    // kind "tree"
    pub pid: u32,
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    /// Ids inside the process's own PID namespace (0: outside it).
    pub ns_pid: u32,
    pub ns_pgid: u32,
    pub ns_sid: u32,
    pub state: ProcState,
    /// The signal its parent gets when it exits (SIGCHLD; 0: none).
    pub exit_signal: i32,
    /// kind "task"
    #[serde(flatten)]
    pub task: Task,
    /// kind "memory"
    pub mm: Mm,
    pub vmas: Vec<Vma>,
    pub memory: Memory,
    /// kind "threads": the main thread first.
    pub threads: Vec<Thread>,
    /// kind "signals" (the per-thread part is in [`Thread`])
    #[serde(flatten)]
    pub signals: Signals,
    /// kind "timers"
    #[serde(flatten)]
    pub timers: Timers,
    /// kind "identity"
    #[serde(flatten)]
    pub identity: Identity,
    /// kind "fds", sorted by number.
    pub fds: Vec<Fd>,
    /// kind "tty": the pty object that is the controlling terminal.
    pub ctty_pty: Option<u64>,
    /// kind "tty": the controlling terminal is this console, virtual or
    /// serial terminal (its device number), which the process, a session
    /// leader, holds open (0: none, a pty, or one outside the tree).
    pub ctty_device: u64,
    /// kind "seccomp": the filters the threads' chains name.
    pub seccomp_filters: Vec<SeccompFilter>,
    /// kind "cgroups": one per hierarchy, sorted by controllers.
    pub cgroups: Vec<Cgroup>,
    /// kind "tree": the process (listed before it) whose fd table this
    /// one shares (CLONE_FILES); its own `fds` are then empty.
    pub fd_table_of: Option<u32>,
    /// kind "tree": the process (listed before it) whose working
    /// directory, root and umask this one shares (CLONE_FS).
    pub fs_of: Option<u32>,
}

impl Process {
    pub fn is_zombie(&self) -> bool {
        matches!(self.state, ProcState::Zombie { .. })
    }

    /// The fd with number `fd`.
    pub fn fd(&self, fd: i32) -> Option<&Fd> {
        self.fds
            .binary_search_by_key(&fd, |f| f.fd)
            .ok()
            .map(|i| &self.fds[i])
    }
}

impl Checkpoint {
    /// Decode and check the protobuf payload of `checkpoint.img`.
    pub fn decode(payload: &[u8]) -> Result<Checkpoint, Bad> {
        let p = pb::Checkpoint::decode(payload).map_err(|e| format!("cannot decode: {e}"))?;
        let ck = Checkpoint::from_pb(p)?;
        ck.validate()?;
        Ok(ck)
    }

    /// The protobuf payload of `checkpoint.img`.
    pub fn encode(&self) -> Vec<u8> {
        self.to_pb().encode_to_vec()
    }

    /// [`encode`](Checkpoint::encode) that lends the page hashes to the
    /// encoder instead of copying them: they are 8 bytes a page, most of
    /// a large image's metadata, and a copy of them next to the encoded
    /// payload was the largest part of a dump's peak memory (8 MiB per GiB
    /// of memory with the copy; 4 without). They are back in place on
    /// return.
    ///
    /// A process with pages in the parent image writes only its stored
    /// pages' hashes (a new, shorter list: its hashes are not lent).
    pub fn encode_lending(&mut self) -> Vec<u8> {
        let lent: Vec<Option<Vec<u64>>> = self
            .processes
            .iter_mut()
            .map(|p| (!p.memory.omits_on_write()).then(|| std::mem::take(&mut p.memory.hashes)))
            .collect();
        let mut p = self.to_pb();
        let was_lent: Vec<bool> = lent.iter().map(Option::is_some).collect();
        for (pp, h) in p.processes.iter_mut().zip(lent) {
            if let (Some(m), Some(h)) = (pp.memory.as_mut(), h) {
                m.hashes = h;
            }
        }
        let payload = p.encode_to_vec();
        for ((proc_, pp), lent) in self.processes.iter_mut().zip(p.processes).zip(was_lent) {
            if let (Some(m), true) = (pp.memory, lent) {
                proc_.memory.hashes = m.hashes;
            }
        }
        payload
    }

    /// The process with image pid `pid`.
    pub fn process(&self, pid: u32) -> Option<&Process> {
        self.processes.iter().find(|p| p.pid == pid)
    }

    /// The object of kind `tag` with id `id`.
    pub fn object(&self, tag: ObjectTag, id: u64) -> Option<&Object> {
        self.objects
            .iter()
            .find(|o| o.id == id && o.kind.tag() == tag)
    }

    fn from_pb(p: pb::Checkpoint) -> Result<Checkpoint, Bad> {
        let m = need(p.meta, "the image's metadata")?;
        let meta = Meta {
            tool_version: m.tool_version,
            created_unix_ms: m.created_unix_ms,
            hostname: m.hostname,
            kernel_release: m.kernel_release,
            boot_id: m.boot_id,
            netns: m.netns,
            cpu_xfeatures: m.cpu_xfeatures,
            image_id: m.image_id,
            vdso_build_id: m.vdso_build_id,
        };
        let processes = p
            .processes
            .into_iter()
            .enumerate()
            .map(|(i, x)| {
                let pid = x.pid;
                at(Process::from_pb(x), || format!("process {pid} (#{i})"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let objects = p
            .objects
            .into_iter()
            .map(|o| {
                let id = o.id;
                at(Object::from_pb(o), || format!("object {id}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Checkpoint {
            meta,
            root_pid: p.root_pid,
            pidns: p.pidns,
            processes,
            objects,
            netlock: Some(p.netlock).filter(|n| !n.is_empty()),
            parent: p.parent.map(|r| ParentRef {
                path: r.path,
                image_id: r.image_id,
            }),
            store: p
                .store
                .map(|s| at(PageStore::from_pb(s), || "the page store".into()))
                .transpose()?,
            pre_dump: p.pre_dump,
            sysv: p
                .sysv
                .map(SysvIpc::from_pb)
                .transpose()?
                .filter(|s| !s.is_empty()),
            mounts: p.mounts.map(MountNs::from_pb).transpose()?,
            job_dir: Some(p.job_dir).filter(|d| !d.is_empty()),
            uts: p
                .uts
                .map(|u| at(UtsNs::from_pb(u), || "its UTS namespace".into()))
                .transpose()?,
            cgroupns: p
                .cgroupns
                .map(|c| at(cgroups::from_pb(c.roots), || "its cgroup namespace".into()))
                .transpose()?,
            netns: p
                .netns
                .map(|n| at(NetNs::from_pb(n), || "its network namespace".into()))
                .transpose()?,
            outside_files: p
                .outside_files
                .into_iter()
                .map(OutsideFile::from_pb)
                .collect::<Result<_, _>>()?,
            cgroup_dirs: p
                .cgroup_dirs
                .into_iter()
                .map(CgroupDir::from_pb)
                .collect::<Result<_, _>>()?,
            cgroup_frames: at(cgroups::from_pb(p.cgroup_frames), || {
                "its cgroup frames".into()
            })?,
        })
    }

    fn to_pb(&self) -> pb::Checkpoint {
        let m = &self.meta;
        pb::Checkpoint {
            meta: Some(pb::Meta {
                tool_version: m.tool_version.clone(),
                created_unix_ms: m.created_unix_ms,
                hostname: m.hostname.clone(),
                kernel_release: m.kernel_release.clone(),
                boot_id: m.boot_id.clone(),
                netns: m.netns.clone(),
                cpu_xfeatures: m.cpu_xfeatures,
                image_id: m.image_id.clone(),
                vdso_build_id: m.vdso_build_id.clone(),
            }),
            root_pid: self.root_pid,
            pidns: self.pidns,
            processes: self.processes.iter().map(Process::to_pb).collect(),
            objects: self.objects.iter().map(Object::to_pb).collect(),
            netlock: self.netlock.clone().unwrap_or_default(),
            parent: self.parent.as_ref().map(|r| pb::ParentRef {
                path: r.path.clone(),
                image_id: r.image_id.clone(),
            }),
            store: self.store.as_ref().map(PageStore::to_pb),
            pre_dump: self.pre_dump,
            sysv: self.sysv.as_ref().map(SysvIpc::to_pb),
            mounts: self.mounts.as_ref().map(MountNs::to_pb),
            job_dir: self.job_dir.clone().unwrap_or_default(),
            uts: self.uts.as_ref().map(UtsNs::to_pb),
            cgroupns: self.cgroupns.as_ref().map(|roots| pb::CgroupNs {
                roots: roots.iter().map(Cgroup::to_pb).collect(),
            }),
            netns: self.netns.as_ref().map(NetNs::to_pb),
            outside_files: self.outside_files.iter().map(OutsideFile::to_pb).collect(),
            cgroup_dirs: self.cgroup_dirs.iter().map(CgroupDir::to_pb).collect(),
            cgroup_frames: self.cgroup_frames.iter().map(Cgroup::to_pb).collect(),
        }
    }

    /// Everything that spans sections: ids, references, the tree's shape.
    fn validate(&self) -> Result<(), Bad> {
        if !is_image_id(&self.meta.image_id) {
            return Err(format!("bad image id {:?}", self.meta.image_id));
        }
        if let Some(p) = &self.parent {
            if !is_image_id(&p.image_id) || p.path.is_empty() {
                return Err(format!(
                    "bad parent reference {:?} (id {:?})",
                    p.path, p.image_id
                ));
            }
        }
        if let Some(n) = &self.netlock {
            if !n
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(format!("bad network lock name {n:?}"));
            }
        }
        let mut objects = HashSet::new();
        for o in &self.objects {
            if !objects.insert((o.kind.tag(), o.id)) {
                return Err(format!(
                    "object {} ({:?}) is listed twice",
                    o.id,
                    o.kind.tag()
                ));
            }
        }
        for o in &self.objects {
            at(o.validate(self), || format!("object {}", o.id))?;
        }
        tree::validate(self)?;
        sysv::validate(self)?;
        if let Some(d) = &self.job_dir {
            if !d.starts_with('/') || d.contains('\0') {
                return Err(format!("bad job directory {d:?}"));
            }
        }
        outside::validate(self)?;
        let blocks = self.store.as_ref().map_or(0, |s| s.blocks.len());
        let pids: HashMap<u32, usize> = self
            .processes
            .iter()
            .enumerate()
            .map(|(i, p)| (p.pid, i))
            .collect();
        for (i, p) in self.processes.iter().enumerate() {
            let place = || format!("process {}", p.pid);
            at(
                memory::validate(p, i, &pids, &self.processes, blocks, self),
                place,
            )?;
            at(threads::validate(p), place)?;
            at(seccomp::validate(p), place)?;
            at(timers::validate(p), place)?;
            at(fds::validate(p, i, &pids, &self.processes, &objects), place)?;
            if let Some(c) = p.ctty_pty {
                if !objects.contains(&(ObjectTag::Pty, c)) {
                    return Err(format!(
                        "process {}: its terminal refers to pty {c}, missing from the image",
                        p.pid
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Process {
    fn from_pb(p: pb::Process) -> Result<Process, Bad> {
        let state = tree::state_from_pb(p.state)?;
        let zombie = matches!(state, ProcState::Zombie { .. });
        Ok(Process {
            pid: p.pid,
            ppid: p.ppid,
            pgid: p.pgid,
            sid: p.sid,
            ns_pid: p.ns_pid,
            ns_pgid: p.ns_pgid,
            ns_sid: p.ns_sid,
            state,
            exit_signal: match p.exit_signal {
                0 => tree::SIGCHLD,
                -1 => 0,
                s @ 1..=64 => s,
                s => return Err(format!("exit signal {s}")),
            },
            task: p.task.map(Task::from_pb).transpose()?.unwrap_or_default(),
            mm: match p.mm {
                Some(m) => Mm::from_pb(m)?,
                None if zombie => Mm::default(),
                None => return Err("the mm fields are missing".into()),
            },
            vmas: p
                .vmas
                .into_iter()
                .map(|v| {
                    let s = v.start;
                    at(Vma::from_pb(v), || format!("mapping at {s:#x}"))
                })
                .collect::<Result<_, _>>()?,
            memory: p
                .memory
                .map(|m| at(Memory::from_pb(m), || "memory".into()))
                .transpose()?
                .unwrap_or_default(),
            threads: p
                .threads
                .into_iter()
                .map(|t| {
                    let tid = t.tid;
                    at(Thread::from_pb(t), || format!("thread {tid}"))
                })
                .collect::<Result<_, _>>()?,
            signals: p
                .signals
                .map(Signals::from_pb)
                .transpose()?
                .unwrap_or_default(),
            timers: p
                .timers
                .map(Timers::from_pb)
                .transpose()?
                .unwrap_or_default(),
            identity: match p.identity {
                Some(i) => Identity::from_pb(i)?,
                None if zombie => Identity::default(),
                None => return Err("the credentials are missing".into()),
            },
            fds: p
                .fds
                .into_iter()
                .map(|f| {
                    let n = f.fd;
                    at(Fd::from_pb(f), || format!("fd {n}"))
                })
                .collect::<Result<_, _>>()?,
            ctty_pty: p.ctty_pty.checked_sub(1),
            ctty_device: p.ctty_device,
            seccomp_filters: p
                .seccomp_filters
                .into_iter()
                .map(SeccompFilter::from_pb)
                .collect::<Result<_, _>>()?,
            cgroups: cgroups::from_pb(p.cgroups)?,
            fd_table_of: Some(p.fd_table_of).filter(|&o| o != 0),
            fs_of: Some(p.fs_of).filter(|&o| o != 0),
        })
    }

    fn to_pb(&self) -> pb::Process {
        pb::Process {
            pid: self.pid,
            ppid: self.ppid,
            pgid: self.pgid,
            sid: self.sid,
            ns_pid: self.ns_pid,
            ns_pgid: self.ns_pgid,
            ns_sid: self.ns_sid,
            state: Some(tree::state_to_pb(self.state)),
            exit_signal: match self.exit_signal {
                tree::SIGCHLD => 0,
                0 => -1,
                s => s,
            },
            task: Some(self.task.to_pb()),
            mm: Some(self.mm.to_pb()),
            vmas: self.vmas.iter().map(Vma::to_pb).collect(),
            memory: Some(self.memory.to_pb()),
            threads: self.threads.iter().map(Thread::to_pb).collect(),
            signals: Some(self.signals.to_pb()),
            timers: Some(self.timers.to_pb()),
            identity: Some(self.identity.to_pb()),
            fds: self.fds.iter().map(Fd::to_pb).collect(),
            ctty_pty: self.ctty_pty.map_or(0, |i| i + 1),
            ctty_device: self.ctty_device,
            seccomp_filters: self
                .seccomp_filters
                .iter()
                .map(SeccompFilter::to_pb)
                .collect(),
            cgroups: self.cgroups.iter().map(Cgroup::to_pb).collect(),
            fd_table_of: self.fd_table_of.unwrap_or(0),
            fs_of: self.fs_of.unwrap_or(0),
        }
    }
}

/// 32 lowercase hex digits.
pub fn is_image_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests;
