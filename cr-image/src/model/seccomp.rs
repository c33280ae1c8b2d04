//! Section of kind "seccomp": the filters of a process's threads. Threads
//! usually share most of their chain (they inherit it), so the filters are
//! kept once per process and each thread lists its chain by index, oldest
//! first.

use super::{pb, ser, Bad, Process};
use serde::Serialize;

/// The largest program the kernel takes (BPF_MAXINSNS).
pub const MAX_INSNS: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SeccompFilter {
    /// Raw `struct sock_filter` instructions (8 bytes each).
    #[serde(rename = "program_bytes", serialize_with = "ser::len")]
    pub program: Vec<u8>,
    /// SECCOMP_FILTER_FLAG_* it was installed with.
    pub flags: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SeccompMode {
    #[default]
    None,
    /// SECCOMP_MODE_STRICT: read, write, exit and sigreturn only.
    Strict,
    /// SECCOMP_MODE_FILTER.
    Filter,
}

/// A thread's seccomp state.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ThreadSeccomp {
    pub mode: SeccompMode,
    /// Indexes into the process's filters, oldest first.
    pub chain: Vec<u32>,
}

impl ThreadSeccomp {
    pub(crate) fn from_pb(mode: u32, chain: Vec<u32>) -> Result<ThreadSeccomp, Bad> {
        let mode = match mode {
            0 => SeccompMode::None,
            1 => SeccompMode::Strict,
            2 => SeccompMode::Filter,
            m => return Err(format!("seccomp mode {m}")),
        };
        if (mode == SeccompMode::Filter) == chain.is_empty() {
            return Err(format!(
                "seccomp mode {mode:?} with {} filters",
                chain.len()
            ));
        }
        Ok(ThreadSeccomp { mode, chain })
    }

    pub(crate) fn mode_pb(&self) -> u32 {
        match self.mode {
            SeccompMode::None => 0,
            SeccompMode::Strict => 1,
            SeccompMode::Filter => 2,
        }
    }
}

impl SeccompFilter {
    pub(crate) fn from_pb(f: pb::SeccompFilter) -> Result<SeccompFilter, Bad> {
        let n = f.program.len() / 8;
        if !f.program.len().is_multiple_of(8) || n == 0 || n > MAX_INSNS {
            return Err(format!("a seccomp program of {} bytes", f.program.len()));
        }
        Ok(SeccompFilter {
            program: f.program,
            flags: f.flags,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::SeccompFilter {
        pb::SeccompFilter {
            program: self.program.clone(),
            flags: self.flags,
        }
    }
}

/// Every thread's chain names filters of the process.
pub(crate) fn validate(p: &Process) -> Result<(), Bad> {
    for t in &p.threads {
        if let Some(i) = t
            .seccomp
            .chain
            .iter()
            .find(|&&i| i as usize >= p.seccomp_filters.len())
        {
            return Err(format!(
                "thread {}: seccomp filter {i} of {}",
                t.tid,
                p.seccomp_filters.len()
            ));
        }
    }
    Ok(())
}
