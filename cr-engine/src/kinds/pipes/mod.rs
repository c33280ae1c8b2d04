//! Kind "pipes": pipes and FIFOs with the bytes buffered in them and their
//! capacity. The data is read with tee(2) from a description of our own,
//! never consumed, so a checkpoint that continues loses nothing. A pipe
//! whose other end is held only outside the tree leads outside (kind
//! [`external`](crate::kinds::external)).
//!
//! Restore: each pipe is made in the restorer and refilled; the processes
//! take descriptions of it (the original ends go to the fds that need
//! exactly them: pipe2's ends carry no O_LARGEFILE); a FIFO is opened by its
//! path.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{self, FdScan, OpenFd, TreeFds};
use crate::kinds::{external, files, Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::objects::{Fifo, Pipe};
use cr_image::model::{Checkpoint, Fd, FdKind, Object, ObjectKind, ObjectTag, Process};
use cr_sys::{fdio, proc};
use std::collections::{HashMap, HashSet};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

pub struct Pipes;

/// The pipes held by processes outside the tree, found by one search of
/// every other process on the host the first time a pipe with an end
/// missing in the tree is looked at. That search reads every fd on the
/// host (190,000 on a busy one take a second): the pre-flight makes it
/// before the freeze, and the frozen dump only confirms what it found.
#[derive(Default)]
pub struct Outside {
    /// Pipe inode -> (a process outside the tree holding it, its fd);
    /// None: not searched yet.
    held: Option<HashMap<u64, (i32, i32)>>,
    /// Found before the freeze (see [`Outside::take_early`]).
    early: bool,
    /// The pipes the tree held at that search.
    known: HashSet<u64>,
}

impl Outside {
    /// What the pre-flight's scan `tree` found, if it searched at all: the
    /// frozen dump's scan takes it with [`Outside::seed`].
    pub fn take_early(tree: &mut TreeFds) -> Option<Outside> {
        let mut o = tree.stash.take::<Outside>()?;
        o.held.as_ref()?;
        o.early = true;
        o.known = tree.pipe_ends.keys().copied().collect();
        Some(o)
    }

    pub fn seed(self, tree: &mut TreeFds) {
        *tree.stash.get::<Outside>() = self;
    }
}

/// A process outside the tree holding pipe `ino`, if any.
fn pipe_outside(cx: &mut FdScan<'_>, ino: u64) -> Option<i32> {
    let o = cx.tree.stash.get::<Outside>();
    if o.early {
        match o.held.as_ref().and_then(|h| h.get(&ino)).copied() {
            Some((p, fd)) if proc::holds_pipe(p, fd, ino) => return Some(p),
            // The tree held it before the freeze and nobody outside did.
            // (A process outside could have taken it since only through
            // /proc/PID/fd or a unix socket, in the moment before the
            // freeze: not searched for.)
            None if o.known.contains(&ino) => return None,
            // Its holder let it go, or a pipe made since: search again.
            _ => *o = Outside::default(),
        }
    }
    if o.held.is_none() {
        let me = std::process::id() as i32;
        let mut held = HashMap::new();
        for p in proc::all_pids() {
            if cx.tree.in_tree(p) || p == me {
                continue;
            }
            for (fd, i) in proc::pipe_fds(p) {
                held.entry(i).or_insert((p, fd));
            }
        }
        cx.tree.stash.get::<Outside>().held = Some(held);
    }
    let o = cx.tree.stash.get::<Outside>();
    o.held.as_ref()?.get(&ino).map(|&(p, _)| p)
}

impl FileKind for Pipes {
    fn name(&self) -> &'static str {
        "pipes"
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        let (ino, fifo) = match f.target {
            proc::FDTarget::Pipe(ino) => (*ino, None),
            // (An O_PATH fd of a FIFO is only a path: kind "files".)
            proc::FDTarget::Path(_)
                if f.md.as_ref().is_some_and(|m| m.file_type().is_fifo())
                    && !fds::is_path_only(f.info.flags) =>
            {
                (f.md.as_ref()?.ino(), Some(f.link.as_str()))
            }
            _ => return None,
        };
        if fifo.is_none() {
            let (r, w) = cx.tree.pipe_ends.get(&ino).copied().unwrap_or((true, true));
            if !(r && w) {
                if let Some(other) = pipe_outside(cx, ino) {
                    return Some(external::record(
                        f,
                        format!("a pipe shared with process {other} outside the tree"),
                    ));
                }
            }
        }
        if let Some(objs) = cx.objects.as_deref_mut() {
            let tag = if fifo.is_some() {
                ObjectTag::Fifo
            } else {
                ObjectTag::Pipe
            };
            if !objs.contains(tag, ino) {
                match read_pipe(f) {
                    Ok((data, capacity)) => objs.insert(Object {
                        id: ino,
                        kind: match (fifo, f.md.as_ref()) {
                            (Some(path), Some(md)) => ObjectKind::Fifo(Fifo {
                                path: path.to_string(),
                                data,
                                capacity,
                                mode: md.mode() & 0o7777,
                                uid: md.uid(),
                                gid: md.gid(),
                            }),
                            _ => ObjectKind::Pipe(Pipe { data, capacity }),
                        },
                    }),
                    Err(e) => return Some(Err(e)),
                }
            }
        }
        Some(Ok(Some(match fifo {
            Some(_) => FdKind::Fifo { object: ino },
            None => FdKind::Pipe { object: ino },
        })))
    }

    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        for o in &ck.objects {
            let ends = match &o.kind {
                ObjectKind::Pipe(p) => {
                    let (rd, wr) = fdio::pipe(libc::O_NONBLOCK | libc::O_CLOEXEC)
                        .step(|| format!("cannot create pipe:[{}]", o.id))?;
                    fill(&wr, o.id, &p.data, p.capacity)?;
                    Ends::new(rd, Some(wr))
                }
                ObjectKind::Fifo(f) => {
                    // A FIFO removed while open is made again, with its
                    // mode and owner (and removed).
                    let rw = match files::ghost::removed(&f.path) {
                        Some(_) => {
                            let node = (f.mode != 0).then_some(files::ghost::Node {
                                mode: libc::S_IFIFO | f.mode,
                                rdev: 0,
                                owner: (f.uid, f.gid),
                            });
                            let g = files::ghost::fifo(r, &f.path, node)?;
                            fdio::open(
                                &format!("/proc/self/fd/{g}"),
                                libc::O_RDWR | libc::O_NONBLOCK,
                            )
                        }
                        // Removed since the checkpoint: a FIFO holds no
                        // data of its own (what was in the pipe is in the
                        // image), so it is made again at its path.
                        None if std::fs::symlink_metadata(&f.path).is_err() => fifo_made_again(f),
                        None => fdio::open(&f.path, libc::O_RDWR | libc::O_NONBLOCK),
                    }
                    .step(|| format!("cannot open the FIFO {}", f.path))?;
                    fill(&rw, o.id, &f.data, f.capacity)?;
                    Ends::new(rw, None)
                }
                _ => continue,
            };
            r.stash.get::<Held>().0.insert((o.kind.tag(), o.id), ends);
        }
        Ok(())
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let key = match f.kind {
            FdKind::Pipe { object } => (ObjectTag::Pipe, object),
            FdKind::Fifo { object } => (ObjectTag::Fifo, object),
            _ => return None,
        };
        let accmode = f.flags as i32 & libc::O_ACCMODE;
        let Some(ends) = cx.r.stash.get::<Held>().0.get_mut(&key) else {
            return Some(Err(RestoreError::Unsupported(format!(
                "fd {} refers to pipe {} missing from the image",
                f.fd, key.1
            ))));
        };
        // The ends pipe2 made carry no O_LARGEFILE, unlike any open(): a
        // description that had none gets one of them.
        if f.flags as i32 & KERNEL_O_LARGEFILE == 0 {
            if let Some(end) = ends.take_original(accmode) {
                return Some(Ok(Opened::Ours(end)));
            }
        }
        Some(
            fdio::reopen(&ends.anchor, accmode)
                .step(|| format!("cannot open {} again as fd {}", f.path, f.fd))
                .map(Opened::Ours),
        )
    }
}

/// FIFO `f`, removed since the checkpoint, made again at its path with
/// its mode and owner (0600 and ours for an older image): our read-write
/// fd of it.
fn fifo_made_again(f: &Fifo) -> cr_sys::error::Result<OwnedFd> {
    fdio::mkfifo(&f.path, 0o600)?;
    // Opened before its mode is set: a FIFO of mode 0 opens for root only.
    let fd = fdio::open(&f.path, libc::O_RDWR | libc::O_NONBLOCK)?;
    if f.mode != 0 {
        let node = files::ghost::Node {
            mode: libc::S_IFIFO | f.mode,
            rdev: 0,
            owner: (f.uid, f.gid),
        };
        files::ghost::set_owner_and_mode(&f.path, node)?;
    }
    tracing::warn!(
        path = f.path,
        "FIFO removed since the checkpoint: made again"
    );
    Ok(fd)
}

/// The capacity of the pipe behind `f` and its buffered bytes, read
/// without consuming them (from a new read-only description of our own:
/// the data is shared, our flags are ours).
fn read_pipe(f: &OpenFd<'_>) -> Result<(Vec<u8>, u32), String> {
    let err = |e: cr_sys::SysError| {
        format!(
            "a pipe whose data cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    };
    let r = fdio::open(
        &format!("/proc/{}/fd/{}", f.pid, f.fd),
        libc::O_RDONLY | libc::O_NONBLOCK,
    )
    .map_err(err)?;
    let capacity = fdio::pipe_size(&r).map_err(err)?;
    let data = fdio::peek_pipe(&r).map_err(err)?;
    Ok((data, capacity))
}

/// O_LARGEFILE as the kernel reports it in f_flags (libc defines it as 0 on
/// 64-bit targets, where open() sets it anyway).
const KERNEL_O_LARGEFILE: i32 = 0o100000;

/// The restorer's pipes, by object.
#[derive(Default)]
struct Held(HashMap<(ObjectTag, u64), Ends>);

/// A pipe held by the restorer: its read end (through which new
/// descriptions of either end are opened) and the original ends, each
/// handed to the first fd that needs exactly it.
struct Ends {
    anchor: OwnedFd,
    read_taken: bool,
    write: Option<OwnedFd>,
}

impl Ends {
    fn new(anchor: OwnedFd, write: Option<OwnedFd>) -> Self {
        Ends {
            anchor,
            read_taken: write.is_none(),
            write,
        }
    }

    fn take_original(&mut self, accmode: i32) -> Option<OwnedFd> {
        match accmode {
            libc::O_RDONLY if !self.read_taken => {
                self.read_taken = true;
                self.anchor.try_clone().ok()
            }
            libc::O_WRONLY => self.write.take(),
            _ => None,
        }
    }
}

fn fill(w: &OwnedFd, id: u64, data: &[u8], capacity: u32) -> Result<(), RestoreError> {
    if capacity != 0 {
        let size = capacity.max(data.len() as u32);
        if let Err(e) = fdio::set_pipe_size(w, size) {
            tracing::warn!(pipe = id, size, error = %cr_sys::error::one_line(&e), "pipe capacity not restored");
        }
    }
    fdio::write_all(w, data).step(|| format!("cannot refill pipe:[{id}]"))
}
