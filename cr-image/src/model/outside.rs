//! Section of kind "outside": the files outside the image that its
//! processes rely on (open files, file mappings, executables and
//! libraries, working directories), as they were when it was taken, so a
//! restore can refuse to run on files that changed or are gone; and which
//! of them have their content saved in the image.

use super::{pb, ser, Bad, Checkpoint, ObjectTag};
use serde::Serialize;
use std::collections::HashSet;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct OutsideFile {
    pub path: String,
    /// What uses it, for messages ("fd 3 of process 12").
    pub used_by: String,
    #[serde(serialize_with = "ser::octal")]
    pub mode: u32,
    pub size: u64,
    pub mtime_ns: i64,
    pub dev: u64,
    pub ino: u64,
    /// GNU build id (ELF files), else empty.
    #[serde(serialize_with = "ser::hex_bytes")]
    pub build_id: Vec<u8>,
    /// Object id of its saved content (a `SavedFile`), if saved.
    pub saved: Option<u64>,
    /// Every use is a write-only fd (a log, an output): the processes
    /// never read it, so what was written since is harmless.
    pub write_only: bool,
    /// Named to be saved (`--save-file`), not only saved because open.
    pub listed: bool,
}

impl OutsideFile {
    pub(crate) fn from_pb(f: pb::OutsideFile) -> Result<OutsideFile, Bad> {
        if !f.path.starts_with('/') {
            return Err(format!("outside file {:?} has no absolute path", f.path));
        }
        if f.build_id.len() > 64 {
            return Err(format!(
                "outside file {}: a build id of {} bytes",
                f.path,
                f.build_id.len()
            ));
        }
        Ok(OutsideFile {
            path: f.path,
            used_by: f.used_by,
            mode: f.mode,
            size: f.size,
            mtime_ns: f.mtime_ns,
            dev: f.dev,
            ino: f.ino,
            build_id: f.build_id,
            saved: (f.saved != 0).then_some(f.saved),
            write_only: f.write_only,
            listed: f.listed,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::OutsideFile {
        pb::OutsideFile {
            path: self.path.clone(),
            used_by: self.used_by.clone(),
            mode: self.mode,
            size: self.size,
            mtime_ns: self.mtime_ns,
            dev: self.dev,
            ino: self.ino,
            build_id: self.build_id.clone(),
            saved: self.saved.unwrap_or(0),
            write_only: self.write_only,
            listed: self.listed,
        }
    }
}

/// Each path listed once; each saved content present in the objects.
pub(crate) fn validate(ck: &Checkpoint) -> Result<(), Bad> {
    let mut seen = HashSet::new();
    for f in &ck.outside_files {
        if !seen.insert(f.path.as_str()) {
            return Err(format!("outside file {} is listed twice", f.path));
        }
        if let Some(id) = f.saved {
            if ck.object(ObjectTag::SavedFile, id).is_none() {
                return Err(format!(
                    "outside file {}: its saved content (object {id}) is missing",
                    f.path
                ));
            }
        }
    }
    Ok(())
}
