//! Section of kind "sysv": the System V IPC objects of a checkpoint —
//! shared memory segments (with their memory in a content file), semaphore
//! sets (values, last-operation process) and message queues (every message
//! with its type), each with its id, key, owner and permissions; for a tree
//! with an IPC namespace of its own, every object of it and its limits.
//! Attaches of a segment are mappings of kind `SysvShm` (see [`super::memory`]).

use super::memory::{PageFile, PAGE};
use super::{at, need, pb, ser, Bad, Checkpoint, VmaKind};
use serde::Serialize;
use std::collections::HashSet;

/// The IPC limits of a namespace that are saved with it (/proc/sys/kernel).
pub const SYSCTLS: &[&str] = &[
    "shmmax",
    "shmall",
    "shmmni",
    "shm_rmid_forced",
    "msgmax",
    "msgmnb",
    "msgmni",
    "sem",
];

/// The largest semaphore value (SEMVMX) and set (SEMMSL's ceiling).
const SEMVMX: u32 = 32767;
const MAX_SEMS: usize = 65536;
/// The largest message accepted.
const MAX_MSG: usize = 1 << 26;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct SysvIpc {
    /// The tree had an IPC namespace of its own: every object of it.
    pub own_namespace: bool,
    /// Its limits (own namespace only): (name in /proc/sys/kernel, value).
    pub sysctls: Vec<(String, String)>,
    pub shm: Vec<ShmSegment>,
    pub sem: Vec<SemSet>,
    pub msg: Vec<MsgQueue>,
}

/// `struct ipc_perm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct IpcPerm {
    /// 0: IPC_PRIVATE.
    pub key: i32,
    pub uid: u32,
    pub gid: u32,
    pub cuid: u32,
    pub cgid: u32,
    #[serde(serialize_with = "ser::octal")]
    pub mode: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShmSegment {
    pub id: i32,
    #[serde(flatten)]
    pub perm: IpcPerm,
    pub size: u64,
    /// Removed (IPC_RMID) while attached.
    pub removed: bool,
    pub locked: bool,
    pub hugetlb: bool,
    /// Image pids (0: outside the image); informational.
    pub cpid: u32,
    pub lpid: u32,
    pub nattch: u64,
    pub content: Option<PageFile>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SemSet {
    pub id: i32,
    #[serde(flatten)]
    pub perm: IpcPerm,
    pub values: Vec<u32>,
    /// The process of each semaphore's last operation (an image pid, 0: none).
    pub pids: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MsgQueue {
    pub id: i32,
    #[serde(flatten)]
    pub perm: IpcPerm,
    pub qbytes: u64,
    /// Oldest first.
    pub messages: Vec<SysvMessage>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SysvMessage {
    pub mtype: i64,
    #[serde(rename = "bytes", serialize_with = "ser::len")]
    pub text: Vec<u8>,
}

impl ShmSegment {
    /// Bytes of address space an attach covers.
    pub fn mapped_len(&self) -> u64 {
        self.size.div_ceil(PAGE) * PAGE
    }
}

impl SysvIpc {
    pub fn is_empty(&self) -> bool {
        !self.own_namespace && self.shm.is_empty() && self.sem.is_empty() && self.msg.is_empty()
    }

    /// The segment with id `id`.
    pub fn segment(&self, id: i32) -> Option<&ShmSegment> {
        self.shm.iter().find(|s| s.id == id)
    }

    /// The content files of the segments.
    pub fn content_files(&self) -> impl Iterator<Item = &PageFile> {
        self.shm.iter().filter_map(|s| s.content.as_ref())
    }

    pub(crate) fn from_pb(s: pb::SysvIpc) -> Result<SysvIpc, Bad> {
        let sysctls = s
            .sysctls
            .into_iter()
            .map(|c| {
                let ok = SYSCTLS.contains(&c.name.as_str())
                    && !c.value.is_empty()
                    && c.value.len() < 128
                    && c.value
                        .bytes()
                        .all(|b| b.is_ascii_digit() || b == b' ' || b == b'\t');
                if !ok {
                    return Err(format!("bad IPC limit {:?} = {:?}", c.name, c.value));
                }
                Ok((c.name, c.value))
            })
            .collect::<Result<_, _>>()?;
        let shm = s
            .shm
            .into_iter()
            .map(|x| {
                let id = x.id;
                at(ShmSegment::from_pb(x), || {
                    format!("System V shared memory segment {id}")
                })
            })
            .collect::<Result<_, _>>()?;
        let sem = s
            .sem
            .into_iter()
            .map(|x| {
                let id = x.id;
                at(SemSet::from_pb(x), || {
                    format!("System V semaphore set {id}")
                })
            })
            .collect::<Result<_, _>>()?;
        let msg = s
            .msg
            .into_iter()
            .map(|x| {
                let id = x.id;
                at(MsgQueue::from_pb(x), || {
                    format!("System V message queue {id}")
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(SysvIpc {
            own_namespace: s.own_namespace,
            sysctls,
            shm,
            sem,
            msg,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::SysvIpc {
        pb::SysvIpc {
            own_namespace: self.own_namespace,
            sysctls: self
                .sysctls
                .iter()
                .map(|(n, v)| pb::Sysctl {
                    name: n.clone(),
                    value: v.clone(),
                })
                .collect(),
            shm: self.shm.iter().map(ShmSegment::to_pb).collect(),
            sem: self.sem.iter().map(SemSet::to_pb).collect(),
            msg: self.msg.iter().map(MsgQueue::to_pb).collect(),
        }
    }
}

impl IpcPerm {
    fn from_pb(p: Option<pb::IpcPerm>) -> Result<IpcPerm, Bad> {
        let p = need(p, "its owner and permissions")?;
        Ok(IpcPerm {
            key: p.key,
            uid: p.uid,
            gid: p.gid,
            cuid: p.cuid,
            cgid: p.cgid,
            mode: p.mode & 0o777,
        })
    }

    fn to_pb(self) -> Option<pb::IpcPerm> {
        Some(pb::IpcPerm {
            key: self.key,
            uid: self.uid,
            gid: self.gid,
            cuid: self.cuid,
            cgid: self.cgid,
            mode: self.mode,
        })
    }
}

fn check_id(id: i32) -> Result<(), Bad> {
    if id < 0 {
        return Err(format!("bad id {id}"));
    }
    Ok(())
}

impl ShmSegment {
    fn from_pb(s: pb::ShmSegment) -> Result<ShmSegment, Bad> {
        check_id(s.id)?;
        if s.size == 0 || s.size > super::memory::TASK_TOP {
            return Err(format!("a size of {} bytes", s.size));
        }
        let content = s.content.map(PageFile::from_pb).transpose()?;
        if let Some(c) = &content {
            if c.extents
                .iter()
                .any(|e| e.file_offset + e.len() > s.size.div_ceil(PAGE) * PAGE)
            {
                return Err("content beyond its size".into());
            }
        }
        Ok(ShmSegment {
            id: s.id,
            perm: IpcPerm::from_pb(s.perm)?,
            size: s.size,
            removed: s.removed,
            locked: s.locked,
            hugetlb: s.hugetlb,
            cpid: s.cpid,
            lpid: s.lpid,
            nattch: s.nattch,
            content,
        })
    }

    fn to_pb(&self) -> pb::ShmSegment {
        pb::ShmSegment {
            id: self.id,
            perm: self.perm.to_pb(),
            size: self.size,
            removed: self.removed,
            locked: self.locked,
            hugetlb: self.hugetlb,
            cpid: self.cpid,
            lpid: self.lpid,
            nattch: self.nattch,
            content: self.content.as_ref().map(PageFile::to_pb),
        }
    }
}

impl SemSet {
    fn from_pb(s: pb::SemSet) -> Result<SemSet, Bad> {
        check_id(s.id)?;
        if s.values.is_empty() || s.values.len() > MAX_SEMS {
            return Err(format!("{} semaphores", s.values.len()));
        }
        if !s.pids.is_empty() && s.pids.len() != s.values.len() {
            return Err("as many pids as semaphores expected".into());
        }
        if let Some(v) = s.values.iter().find(|&&v| v > SEMVMX) {
            return Err(format!("a semaphore value of {v}"));
        }
        Ok(SemSet {
            id: s.id,
            perm: IpcPerm::from_pb(s.perm)?,
            pids: if s.pids.is_empty() {
                vec![0; s.values.len()]
            } else {
                s.pids
            },
            values: s.values,
        })
    }

    fn to_pb(&self) -> pb::SemSet {
        pb::SemSet {
            id: self.id,
            perm: self.perm.to_pb(),
            values: self.values.clone(),
            pids: self.pids.clone(),
        }
    }
}

impl MsgQueue {
    fn from_pb(q: pb::MsgQueue) -> Result<MsgQueue, Bad> {
        check_id(q.id)?;
        let mut total = 0usize;
        let messages = q
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                total = total.saturating_add(m.text.len());
                if m.mtype <= 0 || m.text.len() > MAX_MSG || total > MAX_MSG {
                    return Err(format!(
                        "message {i}: type {} with {} bytes",
                        m.mtype,
                        m.text.len()
                    ));
                }
                Ok(SysvMessage {
                    mtype: m.mtype,
                    text: m.text,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(MsgQueue {
            id: q.id,
            perm: IpcPerm::from_pb(q.perm)?,
            qbytes: q.qbytes,
            messages,
        })
    }

    fn to_pb(&self) -> pb::MsgQueue {
        pb::MsgQueue {
            id: self.id,
            perm: self.perm.to_pb(),
            qbytes: self.qbytes,
            messages: self
                .messages
                .iter()
                .map(|m| pb::SysvMessage {
                    mtype: m.mtype,
                    text: m.text.clone(),
                })
                .collect(),
        }
    }
}

/// Ids and keys unique per kind; every pid an image process; every attach
/// of a segment (a `SysvShm` mapping) naming a saved segment and lying in it.
pub(crate) fn validate(ck: &Checkpoint) -> Result<(), Bad> {
    let s = ck.sysv.as_ref();
    if let Some(s) = s {
        let kinds: [(&str, Vec<(i32, i32)>); 3] = [
            (
                "shared memory segment",
                s.shm.iter().map(|x| (x.id, x.perm.key)).collect(),
            ),
            (
                "semaphore set",
                s.sem.iter().map(|x| (x.id, x.perm.key)).collect(),
            ),
            (
                "message queue",
                s.msg.iter().map(|x| (x.id, x.perm.key)).collect(),
            ),
        ];
        for (what, list) in kinds {
            let (mut ids, mut keys) = (HashSet::new(), HashSet::new());
            for (id, key) in list {
                if !ids.insert(id) {
                    return Err(format!("System V {what} {id} is listed twice"));
                }
                if key != 0 && !keys.insert(key) {
                    return Err(format!("two System V {what}s have the key {key:#x}"));
                }
            }
        }
        let pids = s
            .shm
            .iter()
            .flat_map(|x| [x.cpid, x.lpid])
            .chain(s.sem.iter().flat_map(|x| x.pids.iter().copied()));
        for pid in pids {
            if pid != 0 && ck.process(pid).is_none() {
                return Err(format!(
                    "System V IPC refers to process {pid}, which is not in the image"
                ));
            }
        }
    }
    for p in &ck.processes {
        for v in p.vmas.iter().filter(|v| v.kind == VmaKind::SysvShm) {
            let seg = s.and_then(|s| i32::try_from(v.inode).ok().and_then(|id| s.segment(id)));
            let fits = seg.is_some_and(|g| {
                v.pgoff
                    .checked_add(v.len())
                    .is_some_and(|e| e <= g.mapped_len())
            });
            if !fits || !v.shared {
                return Err(format!(
                    "process {}: mapping at {:#x} attaches System V shared memory {}, which is not in the image",
                    p.pid, v.start, v.inode
                ));
            }
        }
    }
    Ok(())
}
