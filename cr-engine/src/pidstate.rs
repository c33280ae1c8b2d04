//! Small state files about live processes, kept between runs of the tools
//! (`/run/cr/WHAT/PID-STARTTIME` for root, `$TMPDIR/cr-WHAT-UID/` for
//! another user, or `$CR_STATE_DIR/WHAT/`): the start time in the name
//! tells a reused PID apart, and the files of processes that are gone are
//! swept away whenever one is written.

use cr_sys::proc;
use std::path::PathBuf;

/// One kind of state file ("tracking", "jobs").
pub struct PidState(pub &'static str);

impl PidState {
    fn dir(&self) -> PathBuf {
        if let Some(d) = std::env::var_os("CR_STATE_DIR") {
            return PathBuf::from(d).join(self.0);
        }
        let uid = proc::own_ids().1;
        if uid == 0 {
            PathBuf::from("/run/cr").join(self.0)
        } else {
            std::env::temp_dir().join(format!("cr-{}-{uid}", self.0))
        }
    }

    /// The file of `pid` as it is now (None: no such process).
    pub fn path(&self, pid: i32) -> Option<PathBuf> {
        let start = proc::stat(pid).ok()?.starttime;
        Some(self.dir().join(format!("{pid}-{start}")))
    }

    /// What was recorded about `pid` (this very process).
    pub fn read(&self, pid: i32) -> Option<String> {
        std::fs::read_to_string(self.path(pid)?).ok()
    }

    /// Record `text` about `pid` (sweeping the files of processes gone).
    pub fn write(&self, pid: i32, text: &str) -> std::io::Result<PathBuf> {
        self.sweep();
        let path = self
            .path(pid)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ESRCH))?;
        std::fs::create_dir_all(self.dir())?;
        std::fs::write(&path, text)?;
        Ok(path)
    }

    pub fn forget(&self, pid: i32) {
        if let Some(p) = self.path(pid) {
            let _ = std::fs::remove_file(p);
        }
    }

    /// Remove the files of processes that are gone (pid free, or reused by
    /// a process with another start time).
    fn sweep(&self) {
        let Ok(rd) = std::fs::read_dir(self.dir()) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let live = name
                .split_once('-')
                .and_then(|(p, _)| p.parse::<i32>().ok())
                .and_then(|p| self.path(p))
                .is_some_and(|p| p == e.path());
            if !live {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}
