//! Objects several fds or mappings may share, captured once per checkpoint:
//! pipes and FIFOs with the bytes buffered in them, unix sockets (filled in
//! by [`crate::unix`]), and the content of files that exist nowhere else
//! (memfds, files deleted while open, O_TMPFILE files), written to their own
//! file of the image. Also the path behind an inotify watch.

use cr_image::{proto, ImageDir, PageWriter};
use cr_sys::{fdio, PAGE_SIZE};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, MetadataExt};

/// Largest run of file content per extent (as for memory pages).
const RUN: u64 = 1 << 20;

/// Objects of one checkpoint, keyed by (kind, inode).
pub struct Objects<'a> {
    dir: &'a ImageDir,
    fsync: bool,
    map: BTreeMap<(i32, u64), proto::FileObject>,
    /// TCP connections left in repair mode until the dump ends.
    pub repaired: Vec<crate::inet::Repaired>,
}

impl<'a> Objects<'a> {
    pub fn new(dir: &'a ImageDir, fsync: bool) -> Self {
        Objects {
            dir,
            fsync,
            map: BTreeMap::new(),
            repaired: Vec::new(),
        }
    }

    pub fn into_vec(self) -> Vec<proto::FileObject> {
        self.map.into_values().collect()
    }

    pub fn get_mut(&mut self, kind: proto::ObjectKind, id: u64) -> Option<&mut proto::FileObject> {
        self.map.get_mut(&(kind as i32, id))
    }

    pub fn insert(&mut self, obj: proto::FileObject) {
        self.map.insert((obj.kind, obj.id), obj);
    }

    pub fn contains(&self, kind: proto::ObjectKind, id: u64) -> bool {
        self.map.contains_key(&(kind as i32, id))
    }

    /// The pipe (or FIFO at `fifo_path`) behind fd `fd` of `pid`: its
    /// capacity and buffered bytes, read without consuming them.
    pub fn pipe(
        &mut self,
        pid: i32,
        fd: i32,
        ino: u64,
        fifo_path: Option<&str>,
    ) -> Result<(), String> {
        let kind = if fifo_path.is_some() {
            proto::ObjectKind::FifoObject
        } else {
            proto::ObjectKind::PipeObject
        };
        if self.contains(kind, ino) {
            return Ok(());
        }
        let err = |e: cr_sys::SysError| {
            format!(
                "a pipe whose data cannot be read: {}",
                cr_sys::error::one_line(&e)
            )
        };
        // A new read-only description of the same pipe: the data is shared,
        // our flags are our own.
        let r = fdio::open(
            &format!("/proc/{pid}/fd/{fd}"),
            libc::O_RDONLY | libc::O_NONBLOCK,
        )
        .map_err(err)?;
        let pipe_size = fdio::pipe_size(&r).map_err(err)?;
        let pipe_data = fdio::peek_pipe(&r).map_err(err)?;
        self.insert(proto::FileObject {
            id: ino,
            kind: kind as i32,
            pipe_data,
            pipe_size,
            path: fifo_path.unwrap_or_default().to_string(),
            ..Default::default()
        });
        Ok(())
    }

    /// The pty pair `index` (fd `fd` of `pid` is its master or a slave):
    /// terminal settings, window size and foreground group. Bytes in flight
    /// in the pair's buffers are not saved.
    pub fn pty(&mut self, pid: i32, fd: i32, index: u32, master: bool) -> Result<(), String> {
        if self.contains(proto::ObjectKind::PtyObject, index as u64) {
            return Ok(());
        }
        let err = |e: cr_sys::SysError| {
            format!(
                "pseudo-terminal {index}, whose state cannot be read: {}",
                cr_sys::error::one_line(&e)
            )
        };
        let fd = fdio::steal_fd(pid, fd).map_err(err)?;
        if master && fdio::pty_locked(&fd).map_err(err)? {
            self.insert(proto::FileObject {
                id: index as u64,
                kind: proto::ObjectKind::PtyObject as i32,
                pty_index: index,
                pty_locked: true,
                ..Default::default()
            });
            return Ok(());
        }
        let slave = if master {
            fdio::pty_peer(&fd, libc::O_RDONLY).map_err(err)?
        } else {
            fd
        };
        let fg = fdio::foreground(&slave).unwrap_or(0);
        self.insert(proto::FileObject {
            id: index as u64,
            kind: proto::ObjectKind::PtyObject as i32,
            pty_index: index,
            pty_fg_pgrp: fg.max(0) as u32,
            termios: fdio::tcgets(&slave).map_err(err)?,
            winsize: fdio::get_winsize(&slave).unwrap_or_default(),
            ..Default::default()
        });
        Ok(())
    }

    /// The content of a memfd or deleted file open as fd `fd` of `pid`.
    pub fn file_content(
        &mut self,
        pid: i32,
        fd: i32,
        ino: u64,
        link: &str,
        memfd: bool,
    ) -> Result<(), String> {
        self.content_from(&format!("/proc/{pid}/fd/{fd}"), ino, link, memfd)
    }

    /// The content of a memfd or deleted file reachable at `open_path` (a
    /// /proc magic link), shown to users as `link`.
    pub fn content_from(
        &mut self,
        open_path: &str,
        ino: u64,
        link: &str,
        memfd: bool,
    ) -> Result<(), String> {
        let kind = if memfd {
            proto::ObjectKind::MemfdObject
        } else {
            proto::ObjectKind::DeletedFileObject
        };
        if self.contains(kind, ino) {
            return Ok(());
        }
        let err = |e: String| format!("{link}, whose content cannot be saved: {e}");
        let file = File::open(open_path).map_err(|e| err(e.to_string()))?;
        let md = file.metadata().map_err(|e| err(e.to_string()))?;
        let name = link.strip_suffix(" (deleted)").unwrap_or(link);
        let (path, seals) = if memfd {
            let owned =
                std::os::fd::OwnedFd::from(file.try_clone().map_err(|e| err(e.to_string()))?);
            let seals = fdio::seals(&owned).unwrap_or(0);
            (
                name.strip_prefix("/memfd:").unwrap_or(name).to_string(),
                seals,
            )
        } else {
            (name.to_string(), 0)
        };
        let fname = format!("file-{ino}.img");
        let writer = PageWriter::create_named(self.dir, &fname).map_err(|e| err(e.to_string()))?;
        let size = md.len();
        let ranges = cr_sys::mem::data_ranges(&file, 0, size)
            .map_err(|e| err(cr_sys::error::one_line(&e)))?;
        let mut extents = Vec::new();
        let mut out_off = 0u64;
        let mut buf = Vec::new();
        for (a, b) in ranges {
            let a = a & !(PAGE_SIZE - 1);
            let mut off = a;
            while off < b {
                let len = (b - off).min(RUN);
                let pages = len.div_ceil(PAGE_SIZE);
                buf.clear();
                buf.resize((pages * PAGE_SIZE) as usize, 0);
                let want = len.min(size - off) as usize;
                file.read_exact_at(&mut buf[..want], off)
                    .map_err(|e| err(e.to_string()))?;
                writer
                    .write_at(out_off, &buf)
                    .map_err(|e| err(e.to_string()))?;
                extents.push(proto::PageExtent {
                    vaddr: off,
                    nr_pages: pages as u32,
                    offset: out_off,
                    xxh3: cr_image::checksum(&buf),
                });
                out_off += buf.len() as u64;
                off += pages * PAGE_SIZE;
            }
        }
        let content = writer
            .finish(out_off, extents, self.fsync)
            .map_err(|e| err(e.to_string()))?;
        self.insert(proto::FileObject {
            id: ino,
            kind: kind as i32,
            path,
            content: Some(content),
            size,
            mode: md.mode() & 0o7777,
            seals,
            ..Default::default()
        });
        Ok(())
    }
}

/// One inotify watch from its fdinfo line (the part after "inotify wd:"):
/// "1 ino:3c4a7 sdev:fe00000 mask:300 ignored_mask:0 fhandle-bytes:8
/// fhandle-type:1 f_handle:a7c4030000000000". The path is found by opening
/// the file handle on the watched file's mount.
pub fn inotify_watch(v: &str, _with_data: bool) -> Result<proto::InotifyWatch, String> {
    let bad = || format!("an inotify watch that cannot be read ({v})");
    let mut words = v.split_whitespace();
    let wd: i32 = words.next().and_then(|w| w.parse().ok()).ok_or_else(bad)?;
    let field = |name: &str| -> Option<String> {
        v.split_whitespace()
            .find_map(|w| w.strip_prefix(name).map(str::to_string))
    };
    let sdev = field("sdev:")
        .and_then(|s| u64::from_str_radix(&s, 16).ok())
        .ok_or_else(bad)?;
    let mask = field("mask:")
        .and_then(|s| u32::from_str_radix(&s, 16).ok())
        .ok_or_else(bad)?;
    let htype = field("fhandle-type:")
        .and_then(|s| i32::from_str_radix(&s, 16).ok())
        .ok_or_else(bad)?;
    let handle = field("f_handle:").ok_or_else(bad)?;
    let handle: Vec<u8> = (0..handle.len() / 2)
        .map(|i| u8::from_str_radix(&handle[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    let (maj, min) = (sdev >> 20, sdev & 0xfffff);
    let mount = mount_point(maj, min).ok_or_else(|| {
        format!("an inotify watch on device {maj}:{min}, which has no mount here")
    })?;
    let mfd = fdio::open(&mount, libc::O_RDONLY | libc::O_DIRECTORY).map_err(|e| {
        format!(
            "an inotify watch on {mount}: {}",
            cr_sys::error::one_line(&e)
        )
    })?;
    let path = fdio::path_of_handle(&mfd, htype, &handle).map_err(|e| {
        format!(
            "an inotify watch whose file cannot be found ({})",
            cr_sys::error::one_line(&e)
        )
    })?;
    if path.ends_with(" (deleted)") {
        return Err(format!("an inotify watch on the deleted file {path}"));
    }
    Ok(proto::InotifyWatch { wd, mask, path })
}

/// A mount point of the device `maj:min`, from /proc/self/mountinfo.
fn mount_point(maj: u64, min: u64) -> Option<String> {
    let mut text = String::new();
    File::open("/proc/self/mountinfo")
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    let want = format!("{maj}:{min}");
    text.lines()
        .find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.get(2) == Some(&want.as_str()) && w.get(3) == Some(&"/"))
                .then(|| w.get(4).map(|s| s.to_string()))
                .flatten()
        })
        .or_else(|| {
            text.lines().find_map(|l| {
                let w: Vec<&str> = l.split_whitespace().collect();
                (w.get(2) == Some(&want.as_str()))
                    .then(|| w.get(4).map(|s| s.to_string()))
                    .flatten()
            })
        })
}
