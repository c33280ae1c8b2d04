//! Content files of file objects (memfds, deleted files): raw page data,
//! written at offsets chosen in advance, read back run by run with each
//! run's checksum verified. Process memory goes to the page store instead.

use crate::dir::{ImageDir, TMP_SUFFIX};
use crate::model::{PageExtent, PageFile};
use crate::{checksum, io_err, ImageError, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Writer of `NAME.tmp`; renamed by [`ImageDir::commit`].
pub struct PageWriter {
    file: File,
    path: PathBuf,
    name: String,
}

impl PageWriter {
    /// A page-structured file named `name` in `dir`.
    pub fn create_named(dir: &ImageDir, name: &str) -> Result<Self> {
        let name = name.to_string();
        let path = dir.file(&format!("{name}{TMP_SUFFIX}"));
        let file = File::create(&path).map_err(io_err(&path))?;
        Ok(PageWriter { file, path, name })
    }

    /// Write `data` at byte `offset` (safe to call from several threads).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.file
            .write_all_at(data, offset)
            .map_err(io_err(&self.path))
    }

    /// Flush to stable storage if asked, and describe the file.
    pub fn finish(self, size: u64, extents: Vec<PageExtent>, fsync: bool) -> Result<PageFile> {
        if fsync {
            self.file.sync_all().map_err(io_err(&self.path))?;
        }
        Ok(PageFile {
            name: self.name,
            size,
            extents,
        })
    }
}

/// Reader of a committed page file.
pub struct PageReader {
    file: File,
    path: PathBuf,
}

impl PageReader {
    /// Open a page file and check it has the recorded size.
    /// (The name was checked when the image was read.)
    pub fn open(dir: &ImageDir, pf: &PageFile) -> Result<Self> {
        let path = dir.file(&pf.name);
        let file = File::open(&path).map_err(io_err(&path))?;
        let actual = file.metadata().map_err(io_err(&path))?.len();
        if actual != pf.size {
            return Err(ImageError::Truncated {
                path,
                expected: pf.size,
                actual,
            });
        }
        Ok(PageReader { file, path })
    }

    /// Read one run into `buf` (resized to fit) and verify its checksum.
    pub fn read_extent(&self, ext: &PageExtent, buf: &mut Vec<u8>) -> Result<()> {
        let len = ext.len() as usize;
        buf.resize(len, 0);
        self.file
            .read_exact_at(&mut buf[..len], ext.offset)
            .map_err(io_err(&self.path))?;
        if checksum(&buf[..len]) != ext.xxh3 {
            return Err(ImageError::Checksum {
                path: self.path.clone(),
                context: format!(
                    " in the pages of {:#x}..{:#x}",
                    ext.file_offset,
                    ext.file_offset + len as u64
                ),
            });
        }
        Ok(())
    }
}
