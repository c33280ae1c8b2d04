//! Who may do what through the agent's Unix socket. The caller is known by
//! its credentials (SO_PEERCRED). Root may act on any process and image;
//! any other user only on processes whose real, effective and saved uids
//! are all its own (every process of the tree), and on image directories
//! it owns. A new image directory must be made in a directory the user
//! owns or in a sticky world-writable one (like /tmp); it is handed to the
//! user once written.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The caller of a local request.
#[derive(Debug, Clone, Copy)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: i32,
}

impl Caller {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }

    fn denied(&self, what: String) -> String {
        format!("permission denied: {what} (you are uid {})", self.uid)
    }

    /// `pid` and every process of its tree belong to the caller.
    pub fn check_process(&self, pid: i32) -> Result<(), String> {
        if self.is_root() {
            return Ok(());
        }
        let pids = cr_engine::kinds::tree::walk(pid).map_err(|e| cr_sys::error::one_line(&e))?;
        for p in pids {
            let st = cr_sys::proc::status(p).map_err(|e| cr_sys::error::one_line(&e))?;
            let uids = [st.ruid, st.euid, st.suid];
            if uids.iter().any(|&u| u != self.uid) {
                let owner = uids[0];
                return Err(self.denied(format!("process {p} belongs to uid {owner}")));
            }
        }
        Ok(())
    }

    /// An existing image directory the caller may read (it owns it).
    pub fn check_image(&self, dir: &Path) -> Result<(), String> {
        self.check_owned(dir, "image")
    }

    /// An existing file or directory (`what`: how to name it) the caller
    /// owns.
    pub fn check_owned(&self, path: &Path, what: &str) -> Result<(), String> {
        if self.is_root() {
            return Ok(());
        }
        let md = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if md.uid() != self.uid {
            return Err(self.denied(format!(
                "{what} {} belongs to uid {}",
                path.display(),
                md.uid()
            )));
        }
        Ok(())
    }

    /// A directory the caller may write a new image to.
    pub fn check_new_image(&self, dir: &Path) -> Result<(), String> {
        if self.is_root() {
            return Ok(());
        }
        if dir.exists() {
            return self.check_image(dir);
        }
        let parent = match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let md = std::fs::metadata(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        let sticky_open = md.mode() & 0o1002 == 0o1002;
        if md.uid() != self.uid && !sticky_open {
            return Err(self.denied(format!(
                "{} belongs to uid {} and is not a sticky world-writable directory",
                parent.display(),
                md.uid()
            )));
        }
        Ok(())
    }

    /// Hand a directory written by the agent (and everything in it) to the caller.
    pub fn give(&self, dir: &Path) {
        if self.is_root() {
            return;
        }
        fn walk(p: &Path, uid: u32, gid: u32) -> std::io::Result<()> {
            std::os::unix::fs::lchown(p, Some(uid), Some(gid))?;
            if std::fs::symlink_metadata(p)?.is_dir() {
                for e in std::fs::read_dir(p)? {
                    walk(&e?.path(), uid, gid)?;
                }
            }
            Ok(())
        }
        if let Err(e) = walk(dir, self.uid, self.gid) {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot hand the image to its user");
        }
    }
}
