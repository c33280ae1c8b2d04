//! System V IPC objects of the calling thread's IPC namespace: shared
//! memory segments, semaphore sets and message queues. Listing them
//! (`/proc/sysvipc`), reading their state without changing it (IPC_STAT,
//! GETALL, GETPID, and `msgrcv` with MSG_COPY, which copies a message out
//! of a queue without taking it), and making them again with a chosen id.
//!
//! How the kernel hands out ids: with CONFIG_CHECKPOINT_RESTORE, writing an
//! id to `/proc/sys/kernel/{shm,sem,msg}_next_id` makes the next object of
//! that kind created in the namespace get it, if its slot (id modulo the
//! slot count) is free; otherwise it silently gets the next free slot, so
//! [`create`] checks the id it got. The sysctl goes back to -1 after each
//! creation. These files, like `/proc/sysvipc`, show the namespace of the
//! thread that opens them: see `ns::in_ipc_ns` to reach another one.
//!
//! Linux counts attaches per mapping: a segment attached once whose
//! mapping `mprotect` split in two has `shm_nattch` 2.

use crate::error::{io_err, Errno, Result, SysError};
use std::fs::File;
use std::os::unix::fs::OpenOptionsExt;

/// The mode bit of a segment removed (IPC_RMID) while still attached.
pub const SHM_DEST: u32 = 0o1000;
/// The mode bit of a segment locked in memory (SHM_LOCK).
pub const SHM_LOCKED: u32 = 0o2000;
const SHM_LOCK: i32 = 11;

/// A kind of System V IPC object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Shm,
    Sem,
    Msg,
}

impl Kind {
    /// As users and `ipcrm` name it.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Shm => "shared memory segment",
            Kind::Sem => "semaphore set",
            Kind::Msg => "message queue",
        }
    }

    /// The `ipcrm` option that removes one of this kind by id.
    pub fn ipcrm(self) -> &'static str {
        match self {
            Kind::Shm => "-m",
            Kind::Sem => "-s",
            Kind::Msg => "-q",
        }
    }

    fn short(self) -> &'static str {
        match self {
            Kind::Shm => "shm",
            Kind::Sem => "sem",
            Kind::Msg => "msg",
        }
    }
}

/// `struct ipc_perm`, as the engines need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Perm {
    pub key: i32,
    pub uid: u32,
    pub gid: u32,
    pub cuid: u32,
    pub cgid: u32,
    /// Permission bits, and for a segment SHM_DEST and SHM_LOCKED.
    pub mode: u32,
}

fn perm(p: &libc::ipc_perm) -> Perm {
    Perm {
        key: p.__key,
        uid: p.uid,
        gid: p.gid,
        cuid: p.cuid,
        cgid: p.cgid,
        mode: p.mode as u32,
    }
}

/// `struct shmid_ds` (pids in the caller's PID namespace).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ShmStat {
    pub perm: Perm,
    pub size: u64,
    pub atime: i64,
    pub dtime: i64,
    pub ctime: i64,
    pub cpid: i32,
    pub lpid: i32,
    pub nattch: u64,
}

/// `struct semid_ds`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SemStat {
    pub perm: Perm,
    pub nsems: u32,
    pub otime: i64,
    pub ctime: i64,
}

/// `struct msqid_ds` (pids in the caller's PID namespace).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MsgStat {
    pub perm: Perm,
    pub qnum: u64,
    pub qbytes: u64,
    pub cbytes: u64,
    pub lspid: i32,
    pub lrpid: i32,
    pub stime: i64,
    pub rtime: i64,
    pub ctime: i64,
}

fn call_err(what: impl FnOnce() -> String) -> SysError {
    SysError::Syscall {
        what: what(),
        source: Errno::last(),
    }
}

/// Every object of `kind` in the caller's namespace: (id, key), by id.
pub fn list(kind: Kind) -> Result<Vec<(i32, i32)>> {
    let path = format!("/proc/sysvipc/{}", kind.short());
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let mut out = Vec::new();
    for line in text.lines().skip(1) {
        let mut cols = line.split_whitespace();
        let (Some(key), Some(id)) = (cols.next(), cols.next()) else {
            continue;
        };
        match (key.parse::<i32>(), id.parse::<i32>()) {
            (Ok(k), Ok(i)) => out.push((i, k)),
            _ => {
                return Err(SysError::Parse {
                    path,
                    what: format!("bad line {line:?}"),
                })
            }
        }
    }
    out.sort();
    Ok(out)
}

pub fn shm_stat(id: i32) -> Result<ShmStat> {
    // SAFETY: all-zero bytes are a valid shmid_ds (integers only).
    let mut ds: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: IPC_STAT writes one shmid_ds into `ds`.
    if unsafe { libc::shmctl(id, libc::IPC_STAT, &mut ds) } < 0 {
        return Err(call_err(|| format!("shmctl({id}, IPC_STAT)")));
    }
    Ok(ShmStat {
        perm: perm(&ds.shm_perm),
        size: ds.shm_segsz as u64,
        atime: ds.shm_atime,
        dtime: ds.shm_dtime,
        ctime: ds.shm_ctime,
        cpid: ds.shm_cpid,
        lpid: ds.shm_lpid,
        nattch: ds.shm_nattch,
    })
}

pub fn sem_stat(id: i32) -> Result<SemStat> {
    // SAFETY: all-zero bytes are a valid semid_ds (integers only).
    let mut ds: libc::semid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: IPC_STAT writes one semid_ds through the pointer passed as
    // the `union semun` argument.
    if unsafe { libc::semctl(id, 0, libc::IPC_STAT, &mut ds as *mut libc::semid_ds) } < 0 {
        return Err(call_err(|| format!("semctl({id}, IPC_STAT)")));
    }
    Ok(SemStat {
        perm: perm(&ds.sem_perm),
        nsems: ds.sem_nsems as u32,
        otime: ds.sem_otime,
        ctime: ds.sem_ctime,
    })
}

/// The values of the `n` semaphores of set `id` (GETALL).
pub fn sem_values(id: i32, n: u32) -> Result<Vec<u16>> {
    let mut v = vec![0u16; n as usize];
    // SAFETY: GETALL writes `nsems` unsigned shorts through the array
    // pointer, and `v` holds that many (n is the set's nsems).
    if unsafe { libc::semctl(id, 0, libc::GETALL, v.as_mut_ptr()) } < 0 {
        return Err(call_err(|| format!("semctl({id}, GETALL)")));
    }
    Ok(v)
}

/// semctl commands that answer one number per semaphore.
fn sem_each(id: i32, n: u32, cmd: i32, name: &str) -> Result<Vec<i32>> {
    (0..n as i32)
        .map(|i| {
            // SAFETY: GETPID, GETNCNT and GETZCNT take no argument.
            let r = unsafe { libc::semctl(id, i, cmd) };
            if r < 0 {
                Err(call_err(|| format!("semctl({id}, {i}, {name})")))
            } else {
                Ok(r)
            }
        })
        .collect()
}

/// The PID of the last operation on each semaphore (0: none; in the
/// caller's PID namespace).
pub fn sem_pids(id: i32, n: u32) -> Result<Vec<i32>> {
    sem_each(id, n, libc::GETPID, "GETPID")
}

/// How many processes wait on the semaphores of set `id` (for an increase
/// or for zero).
pub fn sem_waiters(id: i32, n: u32) -> Result<u64> {
    let a = sem_each(id, n, libc::GETNCNT, "GETNCNT")?;
    let b = sem_each(id, n, libc::GETZCNT, "GETZCNT")?;
    Ok(a.iter().chain(&b).map(|&x| x as u64).sum())
}

pub fn msg_stat(id: i32) -> Result<MsgStat> {
    // SAFETY: all-zero bytes are a valid msqid_ds (integers only).
    let mut ds: libc::msqid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: IPC_STAT writes one msqid_ds into `ds`.
    if unsafe { libc::msgctl(id, libc::IPC_STAT, &mut ds) } < 0 {
        return Err(call_err(|| format!("msgctl({id}, IPC_STAT)")));
    }
    Ok(MsgStat {
        perm: perm(&ds.msg_perm),
        qnum: ds.msg_qnum,
        qbytes: ds.msg_qbytes,
        cbytes: ds.__msg_cbytes,
        lspid: ds.msg_lspid,
        lrpid: ds.msg_lrpid,
        stime: ds.msg_stime,
        rtime: ds.msg_rtime,
        ctime: ds.msg_ctime,
    })
}

/// Message number `index` (0: the oldest) of queue `id`, copied without
/// taking it from the queue or touching the queue's times and pids
/// (MSG_COPY): its type and bytes. `max` bounds its size.
pub fn msg_copy(id: i32, index: u64, max: usize) -> Result<(i64, Vec<u8>)> {
    let mut buf = vec![0u8; 8 + max];
    // SAFETY: `buf` holds a struct msgbuf (a long, then `max` bytes of
    // text) and msgrcv writes at most that; with MSG_COPY the message type
    // argument is the index of the message to copy.
    let r = unsafe {
        libc::msgrcv(
            id,
            buf.as_mut_ptr().cast(),
            max,
            index as libc::c_long,
            libc::IPC_NOWAIT | libc::MSG_COPY,
        )
    };
    if r < 0 {
        let e = Errno::last();
        return Err(SysError::Syscall {
            what: if e.0 == libc::ENOSYS {
                "msgrcv(MSG_COPY): this kernel lacks CONFIG_CHECKPOINT_RESTORE, which reads a queue without emptying it".into()
            } else {
                format!("msgrcv({id}, message {index}, MSG_COPY)")
            },
            source: e,
        });
    }
    let mtype = i64::from_ne_bytes(buf[..8].try_into().unwrap_or([0; 8]));
    buf.truncate(8 + r as usize);
    buf.drain(..8);
    Ok((mtype, buf))
}

/// The memory of segment `id` as a file (its shmem inode), through a
/// short attach of our own: read-only unless `write`. Attaching and
/// detaching set the segment's last-attach pid and times.
pub fn shm_file(id: i32, size: u64, write: bool) -> Result<File> {
    let flags = if write { 0 } else { libc::SHM_RDONLY };
    // SAFETY: shmat maps the segment at an address the kernel chooses in
    // our address space; nothing else uses that range, and it is detached
    // below before anything could.
    let addr = unsafe { libc::shmat(id, std::ptr::null(), flags) };
    if addr as isize == -1 {
        return Err(call_err(|| format!("shmat({id})")));
    }
    let start = addr as u64;
    let end = start + size.div_ceil(crate::PAGE_SIZE).max(1) * crate::PAGE_SIZE;
    let path = format!("/proc/self/map_files/{start:x}-{end:x}");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .custom_flags(libc::O_CLOEXEC)
        .open(&path)
        .map_err(io_err(&path));
    // SAFETY: `addr` is the attach made above, used by nothing else.
    unsafe { libc::shmdt(addr) };
    f
}

/// Make an object of `kind` with `key` (0: IPC_PRIVATE) and permission
/// bits `mode`, exactly with id `id`: `size` bytes of a segment (`flags`:
/// SHM_HUGETLB), `size` semaphores of a set; with `creator`, as that
/// (uid, gid) (see [`as_creator`]). Nothing is left behind when the kernel
/// gives another id (the slot is taken).
pub fn create(
    kind: Kind,
    id: i32,
    key: i32,
    size: u64,
    mode: u32,
    flags: i32,
    creator: Option<(u32, u32)>,
) -> Result<()> {
    // Written with our own capabilities (CAP_CHECKPOINT_RESTORE), before
    // the creator's ids take them away.
    set_next_id(kind, id)?;
    let f = libc::IPC_CREAT | libc::IPC_EXCL | (mode & 0o777) as i32 | flags;
    let get = || {
        // SAFETY: plain system calls with integer arguments.
        let got = unsafe {
            match kind {
                Kind::Shm => libc::shmget(key, size as usize, f),
                Kind::Sem => libc::semget(key, size as i32, f),
                Kind::Msg => libc::msgget(key, f),
            }
        };
        if got < 0 {
            let e = Errno::last();
            return Err(SysError::Syscall {
                what: format!(
                    "creating {} {id} (key {key:#x}){}",
                    kind.name(),
                    if e.0 == libc::EEXIST {
                        ": its key is taken"
                    } else {
                        ""
                    }
                ),
                source: e,
            });
        }
        Ok(got)
    };
    let got = match creator {
        Some((uid, gid)) => as_creator(uid, gid, get),
        None => get(),
    };
    let got = match got {
        Ok(g) => g,
        Err(e) => {
            let _ = set_next_id(kind, -1);
            return Err(e);
        }
    };
    if got != id {
        let _ = remove(kind, got);
        return Err(SysError::Syscall {
            what: format!("creating {} {id}: the kernel gave id {got}", kind.name()),
            source: Errno(libc::EEXIST),
        });
    }
    Ok(())
}

/// `/proc/sys/kernel/{shm,sem,msg}_next_id` of the caller's namespace.
pub fn set_next_id(kind: Kind, id: i32) -> Result<()> {
    let path = format!("/proc/sys/kernel/{}_next_id", kind.short());
    std::fs::write(&path, format!("{id}\n")).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => SysError::Command {
            what: format!("choosing the id of a System V {}", kind.name()),
            detail: format!("this kernel lacks {path} (CONFIG_CHECKPOINT_RESTORE)"),
        },
        _ => SysError::Syscall {
            what: format!("writing {path}"),
            source: Errno(e.raw_os_error().unwrap_or(libc::EIO)),
        },
    })
}

/// Owner, group and permission bits of an object (IPC_SET); for a queue
/// also its size in bytes (0: unchanged).
pub fn set_perm(kind: Kind, id: i32, uid: u32, gid: u32, mode: u32, qbytes: u64) -> Result<()> {
    let what = || format!("setting the owner of {} {id} (IPC_SET)", kind.name());
    // SAFETY: (each arm) IPC_STAT fills a zeroed struct of the kind's
    // type, IPC_SET reads it back; both only through that pointer.
    let r = unsafe {
        match kind {
            Kind::Shm => {
                let mut ds: libc::shmid_ds = std::mem::zeroed();
                if libc::shmctl(id, libc::IPC_STAT, &mut ds) < 0 {
                    return Err(call_err(what));
                }
                (ds.shm_perm.uid, ds.shm_perm.gid, ds.shm_perm.mode) = (uid, gid, mode as u16);
                libc::shmctl(id, libc::IPC_SET, &mut ds)
            }
            Kind::Sem => {
                let mut ds: libc::semid_ds = std::mem::zeroed();
                if libc::semctl(id, 0, libc::IPC_STAT, &mut ds as *mut libc::semid_ds) < 0 {
                    return Err(call_err(what));
                }
                (ds.sem_perm.uid, ds.sem_perm.gid, ds.sem_perm.mode) = (uid, gid, mode as u16);
                libc::semctl(id, 0, libc::IPC_SET, &mut ds as *mut libc::semid_ds)
            }
            Kind::Msg => {
                let mut ds: libc::msqid_ds = std::mem::zeroed();
                if libc::msgctl(id, libc::IPC_STAT, &mut ds) < 0 {
                    return Err(call_err(what));
                }
                (ds.msg_perm.uid, ds.msg_perm.gid, ds.msg_perm.mode) = (uid, gid, mode as u16);
                if qbytes != 0 {
                    ds.msg_qbytes = qbytes;
                }
                libc::msgctl(id, libc::IPC_SET, &mut ds)
            }
        }
    };
    if r < 0 {
        return Err(call_err(what));
    }
    Ok(())
}

/// Lock segment `id` in memory (SHM_LOCK).
pub fn shm_lock(id: i32) -> Result<()> {
    // SAFETY: SHM_LOCK ignores the buffer argument.
    if unsafe { libc::shmctl(id, SHM_LOCK, std::ptr::null_mut()) } < 0 {
        return Err(call_err(|| format!("shmctl({id}, SHM_LOCK)")));
    }
    Ok(())
}

/// Set every semaphore of set `id` (SETALL; the last-operation pid of
/// each becomes ours, and every process's undo value for them zero).
pub fn sem_set_all(id: i32, values: &[u16]) -> Result<()> {
    let mut v = values.to_vec();
    // SAFETY: SETALL reads the set's nsems unsigned shorts through the
    // array pointer; `values` comes from a set of that size.
    if unsafe { libc::semctl(id, 0, libc::SETALL, v.as_mut_ptr()) } < 0 {
        return Err(call_err(|| format!("semctl({id}, SETALL)")));
    }
    Ok(())
}

/// Queue a message of type `mtype` on queue `id`, never waiting.
pub fn msg_send(id: i32, mtype: i64, text: &[u8]) -> Result<()> {
    let mut buf = Vec::with_capacity(8 + text.len());
    buf.extend_from_slice(&mtype.to_ne_bytes());
    buf.extend_from_slice(text);
    // SAFETY: `buf` is a struct msgbuf: a long, then `text.len()` bytes.
    if unsafe { libc::msgsnd(id, buf.as_ptr().cast(), text.len(), libc::IPC_NOWAIT) } < 0 {
        return Err(call_err(|| {
            format!(
                "queueing a message of {} bytes on message queue {id}",
                text.len()
            )
        }));
    }
    Ok(())
}

/// Remove an object (IPC_RMID; an attached segment goes at its last detach).
pub fn remove(kind: Kind, id: i32) -> Result<()> {
    // SAFETY: IPC_RMID takes no buffer.
    let r = unsafe {
        match kind {
            Kind::Shm => libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()),
            Kind::Sem => libc::semctl(id, 0, libc::IPC_RMID),
            Kind::Msg => libc::msgctl(id, libc::IPC_RMID, std::ptr::null_mut()),
        }
    };
    if r < 0 {
        return Err(call_err(|| format!("removing {} {id}", kind.name())));
    }
    Ok(())
}

/// Run `f` with the calling thread's effective uid and gid set to `uid`
/// and `gid` (only this thread: the raw system calls, not glibc's, which
/// change every thread), so the objects it creates have them as creator;
/// they are set back after. Needs root.
pub fn as_creator<R>(uid: u32, gid: u32, f: impl FnOnce() -> Result<R>) -> Result<R> {
    let (mut r, mut e, mut s) = (0u32, 0u32, 0u32);
    let (mut gr, mut ge, mut gs) = (0u32, 0u32, 0u32);
    // SAFETY: getresuid/getresgid write three ids through valid pointers.
    unsafe {
        libc::syscall(libc::SYS_getresuid, &mut r, &mut e, &mut s);
        libc::syscall(libc::SYS_getresgid, &mut gr, &mut ge, &mut gs);
    }
    if (e, ge) == (uid, gid) {
        return f();
    }
    let set = |nr: libc::c_long, id: u32, name: &str| -> Result<()> {
        // SAFETY: a credential system call with integer arguments; it
        // changes the calling thread only (-1 leaves an id as it is).
        if unsafe { libc::syscall(nr, -1i32, id, -1i32) } < 0 {
            return Err(call_err(|| format!("{name}(-1, {id}, -1)")));
        }
        Ok(())
    };
    set(libc::SYS_setresgid, gid, "setresgid")?;
    if let Err(err) = set(libc::SYS_setresuid, uid, "setresuid") {
        let _ = set(libc::SYS_setresgid, ge, "setresgid");
        return Err(err);
    }
    let out = f();
    // Back to our own ids: the effective capabilities come back with uid 0.
    set(libc::SYS_setresuid, e, "setresuid")?;
    set(libc::SYS_setresgid, ge, "setresgid")?;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Objects made with a chosen id, read without being changed, removed.
    /// Runs in a new IPC namespace of its own thread (root).
    #[test]
    fn objects_round_trip_in_a_private_namespace() {
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWIPC).expect("unshare(IPC)");
            create(Kind::Msg, 4242, 77, 0, 0o640, 0, None).expect("create queue");
            msg_send(4242, 5, b"hello").expect("send");
            msg_send(4242, 2, b"world!").expect("send");
            assert_eq!(
                msg_copy(4242, 1, 64).expect("copy"),
                (2, b"world!".to_vec())
            );
            assert_eq!(msg_copy(4242, 0, 64).expect("copy"), (5, b"hello".to_vec()));
            let st = msg_stat(4242).expect("stat");
            assert_eq!((st.qnum, st.cbytes, st.perm.key), (2, 11, 77));
            create(Kind::Sem, 7, 0, 3, 0o600, 0, Some((65534, 65534))).expect("create set");
            sem_set_all(7, &[1, 2, 3]).expect("setall");
            assert_eq!(sem_values(7, 3).expect("getall"), vec![1, 2, 3]);
            create(Kind::Shm, 65536 + 9, 0, 8192, 0o600, 0, None).expect("create segment");
            let f = shm_file(65536 + 9, 8192, true).expect("segment file");
            use std::os::unix::fs::FileExt;
            f.write_all_at(b"abc", 4096).expect("write");
            let mut b = [0u8; 3];
            shm_file(65536 + 9, 8192, false)
                .expect("file")
                .read_exact_at(&mut b, 4096)
                .expect("read");
            assert_eq!(&b, b"abc");
            // The slot of 7 is taken: a second set asking for it is refused.
            assert!(create(Kind::Sem, 7, 0, 1, 0o600, 0, None).is_err());
            let st = sem_stat(7).expect("stat");
            assert_eq!((st.perm.cuid, st.perm.cgid, st.nsems), (65534, 65534, 3));
            let ids: Vec<i32> = list(Kind::Sem).expect("list").iter().map(|x| x.0).collect();
            assert_eq!(ids, vec![7]);
            for (k, id) in [(Kind::Msg, 4242), (Kind::Sem, 7), (Kind::Shm, 65545)] {
                remove(k, id).expect("remove");
            }
        })
        .join()
        .expect("the test thread");
    }
}
