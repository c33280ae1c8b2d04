//! An image directory: where its files live and how a checkpoint is
//! committed (page files first, `checkpoint.img` last, each renamed into
//! place), so a directory holds either a complete image or none.

use crate::{header, io_err, Checkpoint, ImageError, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const CHECKPOINT_FILE: &str = "checkpoint.img";
pub const TMP_SUFFIX: &str = ".tmp";

#[derive(Debug, Clone)]
pub struct ImageDir {
    path: PathBuf,
}

impl ImageDir {
    /// Use (and create if needed) `path` as the directory of a new image.
    pub fn create(path: &Path) -> Result<Self> {
        std::fs::create_dir_all(path).map_err(io_err(path))?;
        let d = ImageDir { path: path.into() };
        d.discard_tmp();
        Ok(d)
    }

    /// Open an existing image directory.
    pub fn open(path: &Path) -> Result<Self> {
        if !path.is_dir() {
            return Err(ImageError::MissingDir(path.into()));
        }
        if !path.join(CHECKPOINT_FILE).exists() {
            return Err(ImageError::NotAnImage(path.into()));
        }
        Ok(ImageDir { path: path.into() })
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

    /// Make the checkpoint durable and visible: the older image in the
    /// directory (if any) stops being one, every file written as
    /// `NAME.tmp` is renamed, then `checkpoint.img` is written atomically.
    pub fn commit(&self, ck: &Checkpoint, fsync: bool) -> Result<()> {
        let meta = self.file(CHECKPOINT_FILE);
        match std::fs::remove_file(&meta) {
            Ok(()) => self.sync_dir(fsync)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&meta)(e)),
        }
        self.publish(ck, fsync)
    }

    /// Rename the checkpoint's `.tmp` files into place and replace
    /// `checkpoint.img` atomically (the old metadata stays valid until the
    /// rename: used when the new files have names of their own).
    pub fn publish(&self, ck: &Checkpoint, fsync: bool) -> Result<()> {
        let meta = self.file(CHECKPOINT_FILE);
        let names = crate::model::objects::content_files(ck)
            .map(|pf| pf.name.clone())
            .chain(ck.store.as_ref().map(|s| s.name.clone()));
        for name in names {
            let fin = self.file(&name);
            let tmp = self.file(&format!("{name}{TMP_SUFFIX}"));
            if tmp.exists() || !fin.exists() {
                std::fs::rename(&tmp, &fin).map_err(io_err(&tmp))?;
            }
        }
        let tmp = self.file(&format!("{CHECKPOINT_FILE}{TMP_SUFFIX}"));
        let framed = header::encode(header::KIND_CHECKPOINT, &ck.encode());
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&framed).map_err(io_err(&tmp))?;
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
