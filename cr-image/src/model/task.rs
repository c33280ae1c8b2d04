//! Section of kind "task": what a process is apart from its resources
//! (name, executable, working directory, umask, personality, command line).

use super::{pb, ser};
use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Task {
    pub comm: String,
    /// /proc/PID/exe at checkpoint time.
    pub exe: String,
    pub cwd: String,
    #[serde(serialize_with = "ser::octal")]
    pub umask: u32,
    pub personality: u32,
    /// Raw /proc/PID/cmdline (informational: the real one is in memory).
    #[serde(serialize_with = "cmdline")]
    pub cmdline: Vec<u8>,
    /// GNU build id of the executable (empty when it has none).
    #[serde(serialize_with = "ser::hex_bytes")]
    pub exe_build_id: Vec<u8>,
}

fn cmdline<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let text = String::from_utf8_lossy(v);
    let words: Vec<&str> = text.split('\0').filter(|w| !w.is_empty()).collect();
    let mut seq = s.serialize_seq(Some(words.len()))?;
    for w in words {
        seq.serialize_element(w)?;
    }
    seq.end()
}

impl Task {
    pub(crate) fn from_pb(t: pb::Task) -> Task {
        Task {
            comm: t.comm,
            exe: t.exe,
            cwd: t.cwd,
            umask: t.umask,
            personality: t.personality,
            cmdline: t.cmdline,
            exe_build_id: t.exe_build_id,
        }
    }

    pub(crate) fn to_pb(&self) -> pb::Task {
        pb::Task {
            comm: self.comm.clone(),
            exe: self.exe.clone(),
            cwd: self.cwd.clone(),
            umask: self.umask,
            personality: self.personality,
            cmdline: self.cmdline.clone(),
            exe_build_id: self.exe_build_id.clone(),
        }
    }
}
