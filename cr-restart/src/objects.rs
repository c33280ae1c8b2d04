//! The shared objects of an image, created first inside the restorer
//! itself: pipes and FIFOs refilled with their buffered bytes, memfds and
//! deleted files with their content, unix sockets connected again
//! ([`crate::unix`]). The rebuilt processes then take descriptions of them
//! (pidfd_getfd from the restorer, see [`crate::fds`]), or map them through
//! /proc/RESTORER/fd/N.

use crate::error::{RestoreError, StepContext};
use cr_image::{proto, ImageDir, PageReader};
use cr_sys::fdio;
use proto::ObjectKind;
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

/// Objects held by the restorer, by (kind, id).
#[derive(Default)]
pub struct Objects {
    /// Pipes and FIFOs: (read side, write side) — a FIFO is one O_RDWR fd twice.
    pipes: HashMap<(i32, u64), PipeEnds>,
    /// memfds and deleted files, open read-write.
    files: HashMap<(i32, u64), OwnedFd>,
    /// Deleted files whose O_TMPFILE description was handed out already.
    tmpfile_taken: std::cell::RefCell<std::collections::HashSet<u64>>,
    /// Unix sockets.
    pub(crate) sockets: HashMap<u64, OwnedFd>,
    /// Pty pairs by index: the master.
    ptys: HashMap<u64, OwnedFd>,
    /// TCP and UDP sockets.
    inet: HashMap<u64, OwnedFd>,
    /// Connections in repair mode until the release.
    inet_pending: std::cell::RefCell<Vec<crate::inet::Pending>>,
}

impl Objects {
    /// Create every object of the image.
    pub fn prepare(
        img: &ImageDir,
        ck: &proto::Checkpoint,
        addr_map: &crate::inet::AddrMap,
    ) -> Result<Objects, RestoreError> {
        let mut o = Objects::default();
        // Listeners before the connections that share their ports.
        let inet = ck
            .objects
            .iter()
            .filter(|x| x.kind == ObjectKind::InetSocketObject as i32);
        let (listeners, others): (Vec<_>, Vec<_>) = inet.partition(|x| crate::inet::is_listener(x));
        for obj in listeners.into_iter().chain(others) {
            let (sock, pending) = crate::inet::create(obj, addr_map)?;
            o.inet.insert(obj.id, sock);
            o.inet_pending.get_mut().extend(pending);
        }
        for obj in &ck.objects {
            let kind = ObjectKind::try_from(obj.kind).unwrap_or(ObjectKind::Unspecified);
            match kind {
                ObjectKind::PipeObject => {
                    let (r, w) = fdio::pipe(libc::O_NONBLOCK | libc::O_CLOEXEC)
                        .step(|| format!("cannot create pipe:[{}]", obj.id))?;
                    fill_pipe(&w, obj)?;
                    o.pipes
                        .insert((obj.kind, obj.id), PipeEnds::new(r, Some(w)));
                }
                ObjectKind::FifoObject => {
                    let rw = fdio::open(&obj.path, libc::O_RDWR | libc::O_NONBLOCK)
                        .step(|| format!("cannot open the FIFO {}", obj.path))?;
                    fill_pipe(&rw, obj)?;
                    o.pipes.insert((obj.kind, obj.id), PipeEnds::new(rw, None));
                }
                ObjectKind::MemfdObject | ObjectKind::DeletedFileObject => {
                    let f = file_object(img, obj, kind == ObjectKind::MemfdObject)?;
                    o.files.insert((obj.kind, obj.id), f);
                }
                ObjectKind::UnixSocketObject | ObjectKind::InetSocketObject => {}
                ObjectKind::PtyObject => {
                    let what = format!("cannot recreate pseudo-terminal {}", obj.pty_index);
                    let m = fdio::open_pty_index(obj.pty_index).step(|| what.clone())?;
                    let slave = fdio::pty_peer(&m, libc::O_RDWR).step(|| what.clone())?;
                    if !obj.termios.is_empty() {
                        fdio::tcsets(std::os::fd::AsFd::as_fd(&slave), &obj.termios)
                            .step(|| what.clone())?;
                    }
                    if !obj.winsize.is_empty() {
                        fdio::set_winsize(&slave, &obj.winsize).step(|| what.clone())?;
                    }
                    if obj.pty_locked {
                        fdio::set_pty_locked(&m, true).step(|| what)?;
                    }
                    o.ptys.insert(obj.id, m);
                }
                ObjectKind::Unspecified => {
                    return Err(RestoreError::Unsupported(format!(
                        "object {} of kind {} is not supported by this version",
                        obj.id, obj.kind
                    )))
                }
            }
        }
        o.sockets = crate::unix::prepare(ck)?;
        Ok(o)
    }

    /// A new open file description of the object behind `f` with `f`'s
    /// access mode, for the process to take.
    pub fn description(&self, f: &proto::Fd) -> Result<OwnedFd, RestoreError> {
        let kind = proto::FdKind::try_from(f.kind).unwrap_or(proto::FdKind::Unspecified);
        let accmode = f.flags as i32 & libc::O_ACCMODE;
        let missing = || {
            RestoreError::Unsupported(format!(
                "fd {} refers to object {} missing from the image",
                f.fd, f.object
            ))
        };
        let what = || format!("cannot open {} again as fd {}", f.path, f.fd);
        match kind {
            proto::FdKind::Pipe | proto::FdKind::Fifo => {
                let ok = if kind == proto::FdKind::Pipe {
                    ObjectKind::PipeObject
                } else {
                    ObjectKind::FifoObject
                };
                let ends = self.pipes.get(&(ok as i32, f.object)).ok_or_else(missing)?;
                // The ends pipe2 made carry no O_LARGEFILE, unlike any open():
                // a description that had none gets one of them.
                if f.flags as i32 & KERNEL_O_LARGEFILE == 0 {
                    if let Some(end) = ends.take_original(accmode) {
                        return Ok(end);
                    }
                }
                fdio::reopen(&ends.anchor, accmode).step(what)
            }
            proto::FdKind::Memfd | proto::FdKind::DeletedFile => {
                let ok = if kind == proto::FdKind::Memfd {
                    ObjectKind::MemfdObject
                } else {
                    ObjectKind::DeletedFileObject
                };
                let file = self.files.get(&(ok as i32, f.object)).ok_or_else(missing)?;
                // A file made with O_TMPFILE keeps that in its flags; our own
                // description was made the same way, so the first such fd gets it.
                if f.flags as i32 & O_TMPFILE_BIT != 0
                    && accmode == libc::O_RDWR
                    && self.tmpfile_taken.borrow_mut().insert(f.object)
                {
                    return file
                        .try_clone()
                        .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())));
                }
                fdio::reopen(file, accmode).step(what)
            }
            proto::FdKind::Pty => {
                let m = self.ptys.get(&f.object).ok_or_else(missing)?;
                if is_pty_master(f.rdev) {
                    m.try_clone()
                        .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())))
                } else {
                    fdio::pty_peer(m, accmode).step(what)
                }
            }
            proto::FdKind::UnixSocket | proto::FdKind::InetSocket => {
                let s = if kind == proto::FdKind::UnixSocket {
                    self.sockets.get(&f.object)
                } else {
                    self.inet.get(&f.object)
                }
                .ok_or_else(missing)?;
                s.try_clone()
                    .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())))
            }
            _ => Err(missing()),
        }
    }

    /// At the release: TCP connections leave repair mode (see [`crate::inet`]).
    pub fn finish_inet(&self, guard_secs: u32) -> Result<(), RestoreError> {
        let pending = std::mem::take(&mut *self.inet_pending.borrow_mut());
        crate::inet::finish(&self.inet, pending, guard_secs)
    }

    /// Path through which a process maps the content object `id`.
    pub fn map_path(&self, v: &proto::Vma) -> Option<String> {
        let f = self
            .files
            .get(&(ObjectKind::MemfdObject as i32, v.object))
            .or_else(|| {
                self.files
                    .get(&(ObjectKind::DeletedFileObject as i32, v.object))
            })?;
        Some(format!("/proc/{}/fd/{}", std::process::id(), f.as_raw_fd()))
    }
}

/// A pipe held by the restorer: its read end (through which new
/// descriptions of either end are opened) and the original ends, each
/// handed to the first fd that needs exactly it.
struct PipeEnds {
    anchor: OwnedFd,
    read_taken: std::cell::Cell<bool>,
    write: std::cell::RefCell<Option<OwnedFd>>,
}

impl PipeEnds {
    fn new(anchor: OwnedFd, write: Option<OwnedFd>) -> Self {
        PipeEnds {
            anchor,
            read_taken: std::cell::Cell::new(write.is_none()),
            write: std::cell::RefCell::new(write),
        }
    }

    fn take_original(&self, accmode: i32) -> Option<OwnedFd> {
        match accmode {
            libc::O_RDONLY if !self.read_taken.replace(true) => self.anchor.try_clone().ok(),
            libc::O_WRONLY => self.write.borrow_mut().take(),
            _ => None,
        }
    }
}

/// O_LARGEFILE as the kernel reports it in f_flags (libc defines it as 0 on
/// 64-bit targets, where open() sets it anyway).
const KERNEL_O_LARGEFILE: i32 = 0o100000;

/// __O_TMPFILE (O_TMPFILE without O_DIRECTORY).
const O_TMPFILE_BIT: i32 = 0o20000000;

/// /dev/ptmx (5:2) rather than a /dev/pts/N slave.
pub fn is_pty_master(rdev: u64) -> bool {
    cr_sys::proc::is_dev(rdev, 5, 2)
}

fn fill_pipe(w: &OwnedFd, obj: &proto::FileObject) -> Result<(), RestoreError> {
    let what = || format!("cannot refill pipe:[{}]", obj.id);
    if obj.pipe_size != 0 {
        let size = obj.pipe_size.max(obj.pipe_data.len() as u32);
        if let Err(e) = fdio::set_pipe_size(w, size) {
            tracing::warn!(pipe = obj.id, size, error = %cr_sys::error::one_line(&e), "pipe capacity not restored");
        }
    }
    fdio::write_all(w, &obj.pipe_data).step(what)
}

/// A memfd, or an unnamed file in the directory of a deleted one, holding
/// the saved content.
fn file_object(
    img: &ImageDir,
    obj: &proto::FileObject,
    memfd: bool,
) -> Result<OwnedFd, RestoreError> {
    let fd = if memfd {
        fdio::memfd_create(&obj.path, libc::MFD_ALLOW_SEALING)
            .step(|| format!("cannot create memfd {}", obj.path))?
    } else {
        let path = std::path::Path::new(&obj.path);
        let dir = path
            .parent()
            .filter(|d| d.is_dir())
            .map(|d| d.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/tmp".into());
        let was_tmpfile = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('#'));
        // Made again at its old path and unlinked at once, so /proc shows
        // the same "PATH (deleted)"; an O_TMPFILE file (or a path taken
        // meanwhile) becomes an unnamed file of the same directory.
        let named = (!was_tmpfile)
            .then(|| fdio::open(&obj.path, libc::O_CREAT | libc::O_EXCL | libc::O_RDWR).ok())
            .flatten();
        match named {
            Some(fd) => {
                let _ = std::fs::remove_file(&obj.path);
                fd
            }
            None => fdio::open(&dir, libc::O_TMPFILE | libc::O_RDWR).step(|| {
                format!(
                    "cannot create an unnamed file in {dir} for the deleted {}",
                    obj.path
                )
            })?,
        }
    };
    let file = std::fs::File::from(fd);
    let what =
        |e: std::io::Error| RestoreError::Unsupported(format!("cannot refill {}: {e}", obj.path));
    if let Some(pf) = &obj.content {
        let reader = PageReader::open(img, pf)?;
        let mut buf = Vec::new();
        for ext in &pf.extents {
            reader.read_extent(ext, &mut buf)?;
            let end = (ext.vaddr + buf.len() as u64).min(obj.size);
            let n = end.saturating_sub(ext.vaddr) as usize;
            file.write_all_at(&buf[..n], ext.vaddr).map_err(what)?;
        }
    }
    file.set_len(obj.size).map_err(what)?;
    if !memfd {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(obj.mode))
            .map_err(what)?;
    }
    let fd = OwnedFd::from(file);
    if memfd && obj.seals != 0 {
        fdio::add_seals(&fd, obj.seals).step(|| format!("cannot seal memfd {}", obj.path))?;
    }
    Ok(fd)
}
