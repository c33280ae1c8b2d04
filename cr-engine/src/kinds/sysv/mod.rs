//! Kind "sysv": System V IPC — shared memory segments, semaphore sets and
//! message queues — for the whole tree.
//!
//! Which objects a checkpoint holds:
//!
//! - a tree with an IPC namespace of its own (a `cr_run` job): every object
//!   of that namespace, and its limits; restored into a new namespace;
//! - a tree in the host's namespace, where other programs have objects too
//!   and a process's use of a semaphore or queue leaves no trace in /proc:
//!   every segment a process of the tree attaches (its mappings say so),
//!   the unattached segments a process of the tree created, the semaphore
//!   sets and message queues whose last operation was made by a process of
//!   the tree (last-op pid of a semaphore; last send or receive pid of a
//!   queue), those the user names (`--ipc-key KEY`, `--ipc-owner UID`),
//!   and those an earlier checkpoint or the restore of the same tree held:
//!   a small state file per root process (`crate::pidstate`) remembers
//!   them, since the kernel's pids of a restored object name the restorer.
//!
//! What is saved: id, key, owner, group, creator, permissions; a segment's
//! size and memory (a content file of the image, read through a mapping
//! of the tree's, or through a short read-only attach of ours when none
//! maps it), whether it was removed (IPC_RMID) while attached, SHM_LOCK and
//! SHM_HUGETLB; a set's values and the process of each semaphore's last
//! operation; a queue's capacity and every message with its type, copied
//! with MSG_COPY (nothing is taken from the queue, a checkpoint that lets
//! the processes run on changes nothing). Not saved, because Linux shows
//! them nowhere: the SEM_UNDO adjustments of each process (after a restore,
//! a process that exits does not undo the operations it made before the
//! checkpoint), and the times and pids the kernel keeps (set again by the
//! restore's own calls; a semaphore's last-op pid is made right by an
//! operation of that very process, when it is in the tree).
//!
//! Restore ([`check`], [`prepare`]): the objects are made again with their
//! ids (`cr_sys::sysv::create`, through the `*_next_id` sysctls) before any
//! process is rebuilt. In the host's namespace an id held by another object
//! is refused in one line naming it, unless that object is a leftover of
//! the checkpointed processes (same kind, id and key, and nobody uses it:
//! no attach, no waiter, no live process made its last operation), which is
//! replaced. Each process attaches its segments at their addresses
//! ([`Attaches`], from the memory kind); segments removed while attached
//! are removed again at the release. A restore that fails removes every
//! object it made.

#[cfg(test)]
mod tests;

use crate::capture::Dump;
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::kinds::files;
use crate::restore::{Rebuild, Restorer};
use crate::stub::Stub;
use cr_image::model::sysv::SYSCTLS;
use cr_image::model::{
    Checkpoint, IpcPerm, MsgQueue, Process, SemSet, ShmSegment, SysvIpc, SysvMessage, Vma, VmaKind,
};
use cr_sys::sysv::{self as ks, Kind};
use cr_sys::{ns, proc, SysError, PAGE_SIZE};
use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::os::fd::OwnedFd;
use tracing::{debug, info};

/// Alignment of a temporary attach of a huge page segment.
const HUGE_ALIGN: u64 = 2 << 20;

fn perm(p: &ks::Perm) -> IpcPerm {
    IpcPerm {
        key: p.key,
        uid: p.uid,
        gid: p.gid,
        cuid: p.cuid,
        cgid: p.cgid,
        mode: p.mode & 0o777,
    }
}

/// The objects a tree in the host's namespace held at its last
/// checkpoint or restore, by root process: "shm ID" lines.
const HELD: crate::pidstate::PidState = crate::pidstate::PidState("sysv");

fn kind_word(k: Kind) -> &'static str {
    match k {
        Kind::Shm => "shm",
        Kind::Sem => "sem",
        Kind::Msg => "msg",
    }
}

/// What root process `root` held (see [`HELD`]).
fn held(root: i32) -> HashSet<(Kind, i32)> {
    let text = HELD.read(root).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (k, id) = l.split_once(' ')?;
            let k = [Kind::Shm, Kind::Sem, Kind::Msg]
                .into_iter()
                .find(|&x| kind_word(x) == k)?;
            Some((k, id.parse().ok()?))
        })
        .collect()
}

/// Remember that root process `root` holds the objects of `s`.
fn hold(root: i32, s: &SysvIpc) {
    if s.own_namespace || (s.is_empty() && HELD.read(root).is_none()) {
        return;
    }
    let text: String = objects(s)
        .map(|(k, id, _)| format!("{} {id}\n", kind_word(k)))
        .collect();
    if let Err(e) = HELD.write(root, &text) {
        tracing::warn!(root, error = %e, "cannot record the System V objects of the tree; its next checkpoint may miss those last used by another process");
    }
}

/// What the checkpoint knows of the tree before it reads the objects.
struct Tree {
    pids: HashSet<i32>,
    /// Held at the tree's last checkpoint or restore.
    held: HashSet<(Kind, i32)>,
    /// Segments the tree attaches: id -> (pid, start, end) of one mapping.
    attached: BTreeMap<i32, (i32, u64, u64)>,
    keys: Vec<i32>,
    owners: Vec<u32>,
    own: bool,
}

impl Tree {
    /// An image pid (0 when the process is not in the tree).
    fn pid(&self, pid: i32) -> u32 {
        if self.pids.contains(&pid) {
            pid as u32
        } else {
            0
        }
    }

    /// Named by the user, or held before.
    fn named(&self, kind: Kind, id: i32, p: &ks::Perm) -> bool {
        (p.key != 0 && self.keys.contains(&p.key))
            || self.owners.contains(&p.uid)
            || self.held.contains(&(kind, id))
    }
}

/// The System V IPC objects of the frozen tree (`images`, root first).
pub fn capture(d: &Dump<'_>, images: &[Process]) -> Result<Option<SysvIpc>, CheckpointError> {
    let Some(root) = images.first().map(|p| p.pid as i32) else {
        return Ok(None);
    };
    let sys = |pid: i32| move |e| CheckpointError::from_sys(pid, e);
    crate::kinds::tree::same_namespace(images, "ipc", "an IPC")?;
    let mut attached = BTreeMap::new();
    for p in images.iter().filter(|p| !p.is_zombie()) {
        for v in p.vmas.iter().filter(|v| v.kind == VmaKind::SysvShm) {
            attached
                .entry(v.inode as i32)
                .or_insert((p.pid as i32, v.start, v.end));
        }
    }
    let tree = Tree {
        pids: images.iter().map(|p| p.pid as i32).collect(),
        held: held(root),
        attached,
        keys: d.opts.ipc_keys.clone(),
        owners: d.opts.ipc_owners.clone(),
        own: ns::differs(root, "ipc").map_err(sys(root))?,
    };
    let ns_fd = if tree.own {
        Some(ns::open(root, "ipc").map_err(sys(root))?)
    } else {
        None
    };
    let dir = d.dir.clone();
    let fsync = d.opts.fsync();
    let image_id = d.image_id;
    let s = ns::in_ipc_ns(ns_fd.as_ref(), || {
        read_all(&tree, &dir, image_id, fsync, root)
    })?;
    hold(root, &s);
    debug!(
        root,
        own = s.own_namespace,
        shm = s.shm.len(),
        sem = s.sem.len(),
        msg = s.msg.len(),
        "System V IPC saved"
    );
    Ok(Some(s).filter(|s| !s.is_empty()))
}

/// Read the objects of the tree in the calling thread's IPC namespace.
fn read_all(
    tree: &Tree,
    dir: &cr_image::ImageDir,
    image_id: &str,
    fsync: bool,
    root: i32,
) -> Result<SysvIpc, CheckpointError> {
    let sys = |e| CheckpointError::from_sys(root, e);
    let mut out = SysvIpc {
        own_namespace: tree.own,
        ..Default::default()
    };
    if tree.own {
        for name in SYSCTLS {
            let v = proc::sys_value(&format!("/proc/sys/kernel/{name}"));
            if !v.is_empty() {
                out.sysctls.push((name.to_string(), v));
            }
        }
    }
    let listed: std::collections::BTreeSet<i32> = ks::list(Kind::Shm)
        .map_err(sys)?
        .iter()
        .map(|x| x.0)
        .collect();
    if let Some((&id, &(pid, start, _))) = tree.attached.iter().find(|(id, _)| !listed.contains(id))
    {
        return Err(CheckpointError::unsupported(
            pid,
            format!("mapping at {start:#x} attaches System V shared memory {id}, which its IPC namespace does not list"),
        ));
    }
    for id in listed {
        let needed = tree.own || tree.attached.contains_key(&id);
        let Some(st) = unless_foreign(ks::shm_stat(id), needed).map_err(sys)? else {
            continue;
        };
        let take = tree.own
            || tree.attached.contains_key(&id)
            || (st.nattch == 0 && tree.pids.contains(&st.cpid))
            || tree.named(Kind::Shm, id, &st.perm);
        if take {
            out.shm.push(
                segment(tree, id, &st, dir, image_id, fsync).map_err(|what| {
                    CheckpointError::unsupported(
                        root,
                        format!("System V shared memory segment {id}: {what}"),
                    )
                })?,
            );
        }
    }
    for (id, _) in ks::list(Kind::Sem).map_err(sys)? {
        let stat = ks::sem_stat(id).and_then(|st| Ok((st, ks::sem_pids(id, st.nsems)?)));
        let Some((st, pids)) = unless_foreign(stat, tree.own).map_err(sys)? else {
            continue;
        };
        if tree.own
            || pids.iter().any(|p| tree.pids.contains(p))
            || tree.named(Kind::Sem, id, &st.perm)
        {
            out.sem.push(SemSet {
                id,
                perm: perm(&st.perm),
                values: ks::sem_values(id, st.nsems)
                    .map_err(sys)?
                    .into_iter()
                    .map(u32::from)
                    .collect(),
                pids: pids.iter().map(|&p| tree.pid(p)).collect(),
            });
        }
    }
    for (id, _) in ks::list(Kind::Msg).map_err(sys)? {
        let Some(st) = unless_foreign(ks::msg_stat(id), tree.own).map_err(sys)? else {
            continue;
        };
        // A pid of the tree that last sent or received, unless the
        // process now holding that pid started after the operation: a
        // queue left by an earlier program whose pid was reused.
        let made = |pid: i32, at: i64| {
            tree.pids.contains(&pid)
                && !(at != 0 && proc::started_secs(pid).is_ok_and(|s| s > at + 2))
        };
        let used = made(st.lspid, st.stime) || made(st.lrpid, st.rtime);
        if tree.own || used || tree.named(Kind::Msg, id, &st.perm) {
            out.msg.push(MsgQueue {
                id,
                perm: perm(&st.perm),
                qbytes: st.qbytes,
                messages: messages(id, &st).map_err(sys)?,
            });
        }
    }
    Ok(out)
}

/// The state of an object, or None for one of the host's namespace that
/// we may not read (another user's, for a checkpoint that is not root's)
/// or that went away meanwhile, unless the tree `needed` it.
fn unless_foreign<T>(
    r: cr_sys::error::Result<T>,
    needed: bool,
) -> cr_sys::error::Result<Option<T>> {
    match r {
        Err(SysError::Syscall { source, .. })
            if !needed && [libc::EACCES, libc::EINVAL, libc::EIDRM].contains(&source.0) =>
        {
            Ok(None)
        }
        r => r.map(Some),
    }
}

/// Every message of queue `id`, oldest first, copied.
fn messages(id: i32, st: &ks::MsgStat) -> cr_sys::error::Result<Vec<SysvMessage>> {
    let max = (st.cbytes as usize).max(1);
    let mut out = Vec::with_capacity(st.qnum as usize);
    for i in 0..st.qnum {
        match ks::msg_copy(id, i, max) {
            Ok((mtype, text)) => out.push(SysvMessage { mtype, text }),
            // Taken meanwhile by a process outside the tree.
            Err(SysError::Syscall { source, .. }) if source.0 == libc::ENOMSG => break,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Segment `id` with its memory saved in the image.
fn segment(
    tree: &Tree,
    id: i32,
    st: &ks::ShmStat,
    dir: &cr_image::ImageDir,
    image_id: &str,
    fsync: bool,
) -> Result<ShmSegment, String> {
    // Through a mapping of the tree when there is one: our own attach
    // would change its last-attach pid and times.
    let mapped = tree.attached.get(&id).and_then(|&(pid, start, end)| {
        File::open(format!("/proc/{pid}/map_files/{start:x}-{end:x}")).ok()
    });
    let file = match mapped {
        Some(f) => f,
        None => ks::shm_file(id, st.size, false).map_err(|e| cr_sys::error::one_line(&e))?,
    };
    let hugetlb = cr_sys::fdio::fs_magic(&file).is_ok_and(|m| m == cr_sys::fdio::HUGETLBFS_MAGIC);
    let content = files::save_content(dir, image_id, &format!("sysv-shm-{id}"), &file, fsync)?;
    Ok(ShmSegment {
        id,
        perm: perm(&st.perm),
        size: st.size,
        removed: st.perm.mode & ks::SHM_DEST != 0,
        locked: st.perm.mode & ks::SHM_LOCKED != 0,
        hugetlb,
        cpid: tree.pid(st.cpid),
        lpid: tree.pid(st.lpid),
        nattch: st.nattch,
        content: Some(content),
    })
}

/// What a checkpoint of the tree `pids` (root first) would hold, in words
/// (`cr_checkpoint --check`).
pub fn summary(root: i32, pids: &[i32]) -> String {
    if ns::differs(root, "ipc").unwrap_or(false) {
        return "System V IPC: its own namespace, saved whole".into();
    }
    let attached: std::collections::BTreeSet<u64> = pids
        .iter()
        .flat_map(|&p| proc::maps(p).unwrap_or_default())
        .filter(|m| m.path.starts_with("/SYSV"))
        .map(|m| m.inode)
        .collect();
    format!(
        "System V IPC of the host's namespace: {} segments attached {attached:?}, and the segments, semaphore sets and queues the tree created or used last",
        attached.len()
    )
}

// ---------------------------------------------------------------- restore

/// What a restore made, removed again unless the restore completes.
#[derive(Default)]
struct Made {
    /// The IPC namespace they are in (None: ours).
    ns: Option<OwnedFd>,
    objects: Vec<(Kind, i32)>,
    /// Segments to remove once attached (they were removed while attached).
    rmid: Vec<i32>,
    done: bool,
}

impl Drop for Made {
    fn drop(&mut self) {
        if self.done || self.objects.is_empty() {
            return;
        }
        let objects = std::mem::take(&mut self.objects);
        let r = ns::in_ipc_ns(self.ns.as_ref(), || {
            for &(k, id) in objects.iter().rev() {
                if let Err(e) = ks::remove(k, id) {
                    tracing::warn!(error = %cr_sys::error::one_line(&e), "cannot remove what a failed restore made");
                }
            }
            Ok::<(), SysError>(())
        });
        if let Err(e) = r {
            tracing::warn!(error = %cr_sys::error::one_line(&e), "cannot remove the System V objects of a failed restore");
        }
    }
}

/// Every object of the image: (kind, id, key).
fn objects(s: &SysvIpc) -> impl Iterator<Item = (Kind, i32, i32)> + '_ {
    let shm = s.shm.iter().map(|x| (Kind::Shm, x.id, x.perm.key));
    let sem = s.sem.iter().map(|x| (Kind::Sem, x.id, x.perm.key));
    let msg = s.msg.iter().map(|x| (Kind::Msg, x.id, x.perm.key));
    shm.chain(sem).chain(msg)
}

/// Why the object `id` of `kind` in our namespace is in use (None: a
/// leftover nobody uses).
fn in_use(kind: Kind, id: i32, ours: &HashSet<i32>) -> cr_sys::error::Result<Option<String>> {
    let live = |p: i32| p > 0 && !ours.contains(&p) && cr_sys::clone::pid_exists(p);
    Ok(match kind {
        Kind::Shm => {
            let st = ks::shm_stat(id)?;
            (st.nattch > 0).then(|| format!("attached {} times", st.nattch))
        }
        Kind::Sem => {
            let st = ks::sem_stat(id)?;
            let waiting = ks::sem_waiters(id, st.nsems)?;
            let pids = ks::sem_pids(id, st.nsems)?;
            if waiting > 0 {
                Some(format!("{waiting} processes wait on it"))
            } else {
                pids.into_iter()
                    .find(|&p| live(p))
                    .map(|p| format!("used by process {p}"))
            }
        }
        Kind::Msg => {
            let st = ks::msg_stat(id)?;
            [st.lspid, st.lrpid]
                .into_iter()
                .find(|&p| live(p))
                .map(|p| format!("used by process {p}"))
        }
    })
}

/// The objects of our namespace in the way of the image's (ids or keys
/// taken): the leftovers to replace, or the first one that is someone
/// else's, refused. `ours`: the image's pids (its processes, or their
/// stubs, are not "someone else").
fn in_the_way(s: &SysvIpc, ours: &HashSet<i32>) -> Result<Vec<(Kind, i32)>, RestoreError> {
    let mut replace = Vec::new();
    for kind in [Kind::Shm, Kind::Sem, Kind::Msg] {
        let present = ks::list(kind)?;
        for (k, id, key) in objects(s).filter(|o| o.0 == kind) {
            for &(pid_, pkey) in present
                .iter()
                .filter(|(i, pk)| *i == id || (key != 0 && *pk == key))
            {
                let taken = |why: String| RestoreError::SysvTaken {
                    kind: k.name(),
                    id,
                    key,
                    why,
                    ipcrm: format!("ipcrm {} {pid_}", k.ipcrm()),
                };
                let used = in_use(k, pid_, ours)?;
                let by = |what: String| match &used {
                    Some(why) => format!("{what}, {why}"),
                    None => what,
                };
                if pid_ != id {
                    return Err(taken(by(format!(
                        "its key is taken by {} {pid_}",
                        k.name()
                    ))));
                }
                if pkey != key {
                    return Err(taken(by(format!(
                        "the id is taken by another {} (key {pkey:#x})",
                        k.name()
                    ))));
                }
                if let Some(why) = used {
                    return Err(taken(format!("the id is taken, {why}")));
                }
                replace.push((k, id));
            }
        }
    }
    Ok(replace)
}

/// Refuse, before anything is made, an image whose objects' ids or keys
/// are taken in our namespace by objects in use (a tree with its own
/// namespace gets a new one: nothing to check).
pub fn check(ck: &Checkpoint) -> Result<(), RestoreError> {
    match &ck.sysv {
        Some(s) if !s.own_namespace => in_the_way(s, &image_pids(ck)).map(|_| ()),
        _ => Ok(()),
    }
}

fn image_pids(ck: &Checkpoint) -> HashSet<i32> {
    ck.processes.iter().map(|p| p.pid as i32).collect()
}

/// For a restore on behalf of user `uid`/`gid` (the agent's, as root):
/// the image's objects of the host's namespace must be that user's (owner
/// and creator), or the restore would make objects in another's name. A
/// namespace of the tree's own is new and its alone.
pub fn check_owner(ck: &Checkpoint, uid: u32, gid: u32) -> Result<(), RestoreError> {
    let Some(s) = ck.sysv.as_ref().filter(|s| !s.own_namespace) else {
        return Ok(());
    };
    let perms = s
        .shm
        .iter()
        .map(|x| (Kind::Shm, x.id, x.perm))
        .chain(s.sem.iter().map(|x| (Kind::Sem, x.id, x.perm)))
        .chain(s.msg.iter().map(|x| (Kind::Msg, x.id, x.perm)));
    for (k, id, p) in perms {
        if [p.uid, p.cuid] != [uid; 2] || [p.gid, p.cgid] != [gid; 2] {
            return Err(RestoreError::Unsupported(format!(
                "System V {} {id} belongs to uid {} (creator {}); only root or that user may restore it (you are uid {uid})",
                k.name(),
                p.uid,
                p.cuid
            )));
        }
    }
    Ok(())
}

/// Make the image's objects (in the new IPC namespace of the root stub
/// `root`, or in ours), before any process is rebuilt.
pub fn prepare(r: &mut Restorer<'_>, root: i32) -> Result<(), RestoreError> {
    let (ck, img) = (r.ck, r.img);
    let Some(s) = &ck.sysv else {
        return Ok(());
    };
    let made = r.stash.get::<Made>();
    if s.own_namespace {
        made.ns = Some(ns::open(root, "ipc")?);
    }
    let ours = image_pids(ck);
    let Made {
        ns, objects, rmid, ..
    } = made;
    ns::in_ipc_ns(ns.as_ref(), || make_all(s, img, &ours, objects, rmid))?;
    info!(
        shm = s.shm.len(),
        sem = s.sem.len(),
        msg = s.msg.len(),
        own_namespace = s.own_namespace,
        "System V IPC objects made"
    );
    Ok(())
}

/// Make every object in the calling thread's namespace; `made` lists what
/// exists so far, whatever happens.
fn make_all(
    s: &SysvIpc,
    img: &cr_image::ImageDir,
    ours: &HashSet<i32>,
    made: &mut Vec<(Kind, i32)>,
    rmid: &mut Vec<i32>,
) -> Result<(), RestoreError> {
    for (name, value) in &s.sysctls {
        let path = format!("/proc/sys/kernel/{name}");
        std::fs::write(&path, value)
            .map_err(|source| SysError::Io {
                path: path.clone(),
                source,
            })
            .step(|| format!("cannot set the IPC limit {name} to {value}"))?;
    }
    if !s.own_namespace {
        for (k, id) in in_the_way(s, ours)? {
            info!(
                id,
                kind = k.name(),
                "replacing a leftover of the checkpointed processes"
            );
            ks::remove(k, id)?;
        }
    }
    // Root makes them as their creators; another user as itself.
    let root = proc::own_ids().1 == 0;
    let create = |kind: Kind, id: i32, p: &IpcPerm, size: u64, flags: i32| {
        let creator = root.then_some((p.cuid, p.cgid));
        ks::create(kind, id, p.key, size, p.mode, flags, creator)
            .step(|| format!("cannot make System V {} {id} again", kind.name()))
    };
    for g in &s.shm {
        let flags = if g.hugetlb { libc::SHM_HUGETLB } else { 0 };
        create(Kind::Shm, g.id, &g.perm, g.size, flags)?;
        made.push((Kind::Shm, g.id));
        if let Some(pf) = &g.content {
            let f = ks::shm_file(g.id, g.size, true)?;
            files::refill(
                img,
                pf,
                &f,
                g.size,
                &format!("System V shared memory {}", g.id),
            )?;
        }
        ks::set_perm(Kind::Shm, g.id, g.perm.uid, g.perm.gid, g.perm.mode, 0)?;
        if g.locked {
            ks::shm_lock(g.id)?;
        }
        if g.removed {
            rmid.push(g.id);
        }
    }
    for m in &s.sem {
        create(Kind::Sem, m.id, &m.perm, m.values.len() as u64, 0)?;
        made.push((Kind::Sem, m.id));
        let values: Vec<u16> = m.values.iter().map(|&v| v as u16).collect();
        ks::sem_set_all(m.id, &values)?;
        ks::set_perm(Kind::Sem, m.id, m.perm.uid, m.perm.gid, m.perm.mode, 0)?;
    }
    for q in &s.msg {
        create(Kind::Msg, q.id, &q.perm, 0, 0)?;
        made.push((Kind::Msg, q.id));
        ks::set_perm(
            Kind::Msg,
            q.id,
            q.perm.uid,
            q.perm.gid,
            q.perm.mode,
            q.qbytes,
        )
        .step(|| {
            format!(
                "cannot give message queue {} its capacity of {} bytes",
                q.id, q.qbytes
            )
        })?;
        for m in &q.messages {
            ks::msg_send(q.id, m.mtype, &m.text)?;
        }
    }
    Ok(())
}

/// Give process `p` (its stub in `cx`) the last operation on the
/// semaphores whose last operation was its own: an increment and a
/// decrement in one atomic call, which leave the value as it is.
pub fn restore_process(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let Some(s) = &cx.r.ck.sysv else {
        return Ok(());
    };
    for set in &s.sem {
        let mut ops = Vec::new();
        for (i, (&v, &pid)) in set.values.iter().zip(&set.pids).enumerate() {
            if pid != p.pid {
                continue;
            }
            // struct sembuf: sem_num, sem_op, sem_flg (no SEM_UNDO).
            let (a, b): (i16, i16) = if v == 0 { (1, -1) } else { (-1, 1) };
            for op in [a, b] {
                ops.extend_from_slice(&(i as u16).to_ne_bytes());
                ops.extend_from_slice(&op.to_ne_bytes());
                ops.extend_from_slice(&0i16.to_ne_bytes());
            }
        }
        // At most SEMOPM (500 by default) operations per call.
        for chunk in ops.chunks(6 * 500) {
            let addr = cx.stub.put(chunk)?;
            cx.stub
                .call(
                    "semop",
                    libc::SYS_semop,
                    [set.id as u64, addr, (chunk.len() / 6) as u64, 0, 0, 0],
                )
                .step(|| {
                    format!(
                        "cannot operate on semaphore set {} as process {}",
                        set.id, p.pid
                    )
                })?;
        }
    }
    Ok(())
}

/// Segments removed while attached are removed again, now that every
/// process attached them; what the restore made stays, held by the tree
/// (`root`: its root process).
pub fn release(r: &mut Restorer<'_>, root: i32) -> Result<(), RestoreError> {
    let Some(made) = r.stash.peek::<Made>() else {
        return Ok(());
    };
    if let Some(s) = &r.ck.sysv {
        hold(root, s);
    }
    let rmid = made.rmid.clone();
    ns::in_ipc_ns(made.ns.as_ref(), || {
        for id in rmid {
            ks::remove(Kind::Shm, id)?;
        }
        Ok::<(), SysError>(())
    })?;
    r.stash.get::<Made>().done = true;
    Ok(())
}

/// The attaches of one process being restored: each group of mappings
/// that came from one `shmat` (the same segment at the same base address,
/// split by `mprotect` or `munmap`) is made by one attach, so `shmdt` of
/// the base address still detaches all of them.
pub struct Attaches<'a> {
    vmas: &'a [Vma],
    done: HashSet<usize>,
}

impl<'a> Attaches<'a> {
    pub fn new(vmas: &'a [Vma]) -> Self {
        Attaches {
            vmas,
            done: HashSet::new(),
        }
    }

    /// Attach the segment of mapping `i` (and the rest of its group) in
    /// `stub`: at a free address first, each piece then moved to its
    /// address (mremap), the rest detached, each piece given its protection.
    pub fn attach(
        &mut self,
        stub: &mut Stub<'_>,
        r: &Restorer<'_>,
        i: usize,
    ) -> Result<(), RestoreError> {
        if !self.done.insert(i) {
            return Ok(());
        }
        let v = &self.vmas[i];
        let base = v.start.wrapping_sub(v.pgoff);
        let group: Vec<usize> = (0..self.vmas.len())
            .filter(|&j| {
                let w = &self.vmas[j];
                w.kind == VmaKind::SysvShm
                    && w.inode == v.inode
                    && w.start.wrapping_sub(w.pgoff) == base
            })
            .collect();
        let seg =
            r.ck.sysv
                .as_ref()
                .and_then(|s| s.segment(v.inode as i32))
                .ok_or_else(|| {
                    RestoreError::Unsupported(format!(
                    "mapping at {:#x} attaches System V shared memory {}, missing from the image",
                    v.start, v.inode
                ))
                })?;
        let len = seg.mapped_len();
        let write = group.iter().any(|&j| self.vmas[j].has_flag("mw"));
        let mut taken: Vec<(u64, u64)> = self.vmas.iter().map(|w| (w.start, w.end)).collect();
        taken.extend(proc::maps(stub.pid())?.iter().map(|m| (m.start, m.end)));
        let align = if seg.hugetlb { HUGE_ALIGN } else { PAGE_SIZE };
        let tmp = super::memory::free_range(taken, len, align).ok_or_else(|| {
            RestoreError::Unsupported(format!(
                "no free address range to attach System V shared memory {}",
                seg.id
            ))
        })?;
        let flags = if write { 0 } else { libc::SHM_RDONLY as u64 };
        let at = stub
            .call(
                "shmat",
                libc::SYS_shmat,
                [seg.id as u64, tmp, flags, 0, 0, 0],
            )
            .step(|| format!("cannot attach System V shared memory {}", seg.id))?;
        let given = libc::PROT_READ as u32 | if write { libc::PROT_WRITE as u32 } else { 0 };
        for &j in &group {
            self.done.insert(j);
            let w = &self.vmas[j];
            let got = stub
                .call(
                    "mremap",
                    libc::SYS_mremap,
                    [
                        at + w.pgoff,
                        w.len(),
                        w.len(),
                        (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64,
                        w.start,
                        0,
                    ],
                )
                .step(|| {
                    format!(
                        "cannot move the attach of System V shared memory {} to {:#x}",
                        seg.id, w.start
                    )
                })?;
            if got != w.start {
                return Err(RestoreError::Unsupported(format!(
                    "System V shared memory {} landed at {got:#x}, not {:#x}",
                    seg.id, w.start
                )));
            }
            if w.prot != given {
                stub.call(
                    "mprotect",
                    libc::SYS_mprotect,
                    [w.start, w.len(), w.prot as u64, 0, 0, 0],
                )
                .step(|| format!("cannot protect {:#x}-{:#x}", w.start, w.end))?;
            }
        }
        // What no mapping of the group covers.
        stub.call("munmap", libc::SYS_munmap, [at, len, 0, 0, 0, 0])?;
        debug!(
            pid = stub.pid(),
            id = seg.id,
            pieces = group.len(),
            "segment attached"
        );
        Ok(())
    }
}
