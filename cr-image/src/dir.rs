//! An image directory: where its files live and how a checkpoint is
//! committed (page files first, `checkpoint.img` last, each renamed into
//! place), so a directory holds either a complete image or none.
//!
//! A new image written into a directory that already holds one replaces
//! it atomically: its files have names of their own (`pages-<ID>.img`,
//! `file-<INODE>-<ID>.img`), the old `checkpoint.img` stays valid until the
//! new one is renamed over it, and the old image's files are removed only
//! when the caller settles the checkpoint ([`ImageDir::settle`]); one that
//! is called off after the commit puts the old image back
//! ([`ImageDir::undo`]). A directory the checkpoint created is removed
//! when the checkpoint fails.

use crate::{header, io_err, Checkpoint, ImageError, Result};
use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const CHECKPOINT_FILE: &str = "checkpoint.img";
pub const TMP_SUFFIX: &str = ".tmp";
/// How the names of an image's data files begin (page stores, content of
/// memfds and deleted files, System V segments, a job's /dev/shm files,
/// outside files saved with `--save-files`).
const DATA_PREFIXES: &[&str] = &["pages-", "file-", "sysv-shm-", "shm-file-", "saved-"];
/// The replaced `checkpoint.img`, kept (a hard link) until the new image
/// is settled or undone.
const PREVIOUS_FILE: &str = "checkpoint.img.prev";

#[derive(Debug, Clone)]
pub struct ImageDir {
    path: PathBuf,
    /// The directory did not exist before [`ImageDir::create`].
    created: bool,
}

impl ImageDir {
    /// Use (and create if needed) `path` as the directory of a new image.
    /// What an earlier checkpoint that died left behind is cleaned up.
    pub fn create(path: &Path) -> Result<Self> {
        let created = !path.exists();
        std::fs::create_dir_all(path).map_err(io_err(path))?;
        let d = ImageDir {
            path: path.into(),
            created,
        };
        d.discard_tmp();
        let prev = d.file(PREVIOUS_FILE);
        if prev.exists() {
            // A checkpoint died between its commit and its settle: the
            // newer image (if readable) wins.
            if d.read_checkpoint().is_ok() {
                let _ = std::fs::remove_file(&prev);
            } else {
                let _ = std::fs::rename(&prev, d.file(CHECKPOINT_FILE));
            }
        }
        Ok(d)
    }

    /// The name of content file `what` (e.g. `file-1234`) of the image
    /// `image_id`: unique to that image.
    pub fn content_name(what: &str, image_id: &str) -> String {
        format!("{what}-{}.img", &image_id[..image_id.len().min(16)])
    }

    /// Remove what a failed checkpoint wrote: its `.tmp` files, and the
    /// directory itself if the checkpoint created it.
    pub fn abandon(&self) {
        if self.created {
            match std::fs::remove_dir_all(&self.path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(dir = %self.path.display(), error = %e, "cannot remove the directory of a failed checkpoint")
                }
            }
        } else {
            self.discard_tmp();
        }
    }

    /// Open an existing image directory.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_dir() {
            return Err(ImageError::MissingDir(path.into()));
        }
        if !path.join(CHECKPOINT_FILE).exists() {
            return Err(ImageError::NotAnImage(path.into()));
        }
        Ok(ImageDir {
            path: path.into(),
            created: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Read, check and decode `checkpoint.img`: the typed image, every
    /// value of it checked (see [`crate::model`]).
    pub fn read_checkpoint(&self) -> Result<Checkpoint> {
        let path = self.file(CHECKPOINT_FILE);
        let data = std::fs::read(&path).map_err(io_err(&path))?;
        let payload = header::decode(&path, header::KIND_CHECKPOINT, &data)?;
        Checkpoint::decode(payload).map_err(|what| ImageError::Invalid { path, what })
    }

    /// Make the checkpoint durable and visible: every file written as
    /// `NAME.tmp` is renamed, then `checkpoint.img` is replaced atomically.
    /// The image it replaces (if any) keeps its files until [`settle`]
    /// (or comes back with [`undo`]).
    ///
    /// [`settle`]: ImageDir::settle
    /// [`undo`]: ImageDir::undo
    pub fn commit(&self, ck: &mut Checkpoint, fsync: bool) -> Result<()> {
        let meta = self.file(CHECKPOINT_FILE);
        let prev = self.file(PREVIOUS_FILE);
        let _ = std::fs::remove_file(&prev);
        match std::fs::hard_link(&meta, &prev) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&prev)(e)),
        }
        self.publish(ck, fsync)
    }

    /// The checkpoint committed here, whose data files are `files` (see
    /// [`data_files`]), stays: the files of the image it replaced go.
    pub fn settle(&self, files: &HashSet<String>) {
        if let Ok(rd) = std::fs::read_dir(&self.path) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let ours =
                    DATA_PREFIXES.iter().any(|p| name.starts_with(p)) && name.ends_with(".img");
                if ours && !files.contains(&name) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        let _ = std::fs::remove_file(self.file(PREVIOUS_FILE));
    }

    /// Call off the checkpoint committed here, whose data files are
    /// `files`: the image it replaced comes back (or, in a directory the
    /// checkpoint created, nothing is left).
    pub fn undo(&self, files: &HashSet<String>) {
        if self.created {
            self.abandon();
            return;
        }
        let prev = self.file(PREVIOUS_FILE);
        let old = if prev.exists() {
            let _ = std::fs::rename(&prev, self.file(CHECKPOINT_FILE));
            self.read_checkpoint().ok()
        } else {
            let _ = std::fs::remove_file(self.file(CHECKPOINT_FILE));
            None
        };
        let keep = old.as_ref().map(data_files).unwrap_or_default();
        for name in files.difference(&keep) {
            let _ = std::fs::remove_file(self.file(name));
        }
        self.discard_tmp();
    }

    /// Rename the checkpoint's `.tmp` files into place and replace
    /// `checkpoint.img` atomically (the old metadata stays valid until the
    /// rename: used when the new files have names of their own).
    pub fn publish(&self, ck: &mut Checkpoint, fsync: bool) -> Result<()> {
        let meta = self.file(CHECKPOINT_FILE);
        for name in data_files(ck) {
            let fin = self.file(&name);
            let tmp = self.file(&format!("{name}{TMP_SUFFIX}"));
            if tmp.exists() || !fin.exists() {
                std::fs::rename(&tmp, &fin).map_err(io_err(&tmp))?;
            }
        }
        let tmp = self.file(&format!("{CHECKPOINT_FILE}{TMP_SUFFIX}"));
        let payload = ck.encode_lending();
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&header::frame(header::KIND_CHECKPOINT, &payload))
            .and_then(|()| f.write_all(&payload))
            .map_err(io_err(&tmp))?;
        drop(payload);
        if fsync {
            f.sync_all().map_err(io_err(&tmp))?;
        }
        drop(f);
        std::fs::rename(&tmp, &meta).map_err(io_err(&tmp))?;
        self.sync_dir(fsync)
    }

    /// Remove files of an unfinished checkpoint.
    pub fn discard_tmp(&self) {
        if let Ok(rd) = std::fs::read_dir(&self.path) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().ends_with(TMP_SUFFIX) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }

    fn sync_dir(&self, fsync: bool) -> Result<()> {
        if fsync {
            File::open(&self.path)
                .and_then(|d| d.sync_all())
                .map_err(io_err(&self.path))?;
        }
        Ok(())
    }
}

/// The names of the data files of `ck` in its directory: its page store
/// and its content files.
pub fn data_files(ck: &Checkpoint) -> HashSet<String> {
    crate::model::objects::content_files(ck)
        .map(|pf| pf.name.clone())
        .chain(ck.store.as_ref().map(|s| s.name.clone()))
        .collect()
}
