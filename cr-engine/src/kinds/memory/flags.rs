//! The mappings' VmFlags without a page walk while frozen.
//!
//! VmFlags (advice, locking, fork and dump behaviour...) exist only in
//! /proc/PID/smaps, whose read counts every resident page of every mapping
//! (Rss, Pss...): 0.2-0.3 s per GiB under load, and seq_file does it twice
//! for a big mapping (the record that no longer fits its buffer is
//! computed, dropped and computed again). So:
//!
//! Experimental, off unless [`EARLY_FLAGS_ENV`] is set:
//!
//! 1. [`EarlyMaps::read`]: smaps of every process of the tree, read while
//!    it still runs (before the freeze);
//! 2. [`read_frozen`]: while frozen, only /proc/PID/maps (no page walk);
//!    every line unchanged since takes the VmFlags read before; if any line
//!    changed (a mapping made, moved, split, reprotected), smaps is read
//!    again in full, as before;
//! 3. [`Borrowed::check`]: madvise and mlock change VmFlags without
//!    changing the line, so the flags that were taken from the early read
//!    are read again when the processes are let go: still frozen for a
//!    checkpoint that stops or kills them (exact), right after the thaw for
//!    one that continues them. Flags that differ from the early read fail
//!    the checkpoint (the image is removed, the processes run on).
//!
//! After the thaw the program may have changed a mapping again: a
//! mapping whose line changed is compared with every mapping now over its
//! range, on the flags mprotect leaves alone; a mapping gone entirely
//! cannot be compared, and a change made before the freeze and undone
//! after the thaw, before the check, goes unseen (both within the few
//! hundred ms between the two reads): then the image holds the flags of
//! the early read. Flags of ours are not compared: userfaultfd
//! write-protect (`uw`, the dirty tracker, which a dump may start or
//! stop) and missing mode (`um`); a tracker range borrowed from the early
//! read but replaced since by a new mapping of the same line is caught by
//! the tracker's own scan (see `tracking::begin`).

use super::VM_FLAGS_NOT_COMPARED;

/// Set (to anything) in a checkpoint's environment, it reads the flags
/// before the freeze as described above; unset, smaps is read while
/// frozen. Off by default: a program that changes a mapping's flags
/// without changing its line while the checkpoint runs (a JVM committing
/// its heap drops `nr`, seen in CI) fails the check and so the checkpoint.
pub const EARLY_FLAGS_ENV: &str = "CR_EARLY_VMFLAGS";
use crate::CheckpointError;
use cr_sys::proc::{self, MapEntry};
use std::collections::HashMap;
use tracing::debug;

/// The mappings of the processes of a tree, read from smaps before the
/// freeze (by pid).
#[derive(Default)]
pub struct EarlyMaps(HashMap<i32, Vec<MapEntry>>);

impl EarlyMaps {
    /// smaps of each of `pids`, while they run; a process whose smaps
    /// cannot be read is left out (read in full once frozen).
    pub fn read(pids: &[i32]) -> EarlyMaps {
        let mut out = HashMap::new();
        for &pid in pids {
            match proc::smaps(pid) {
                Ok(m) => {
                    out.insert(pid, m);
                }
                Err(e) => debug!(pid, error = %e, "smaps not read before the freeze"),
            }
        }
        EarlyMaps(out)
    }
}

/// Mappings whose VmFlags came from an [`EarlyMaps`], by process.
#[derive(Default)]
pub struct Borrowed(Vec<(i32, Vec<MapEntry>)>);

/// The mappings of the frozen process `pid` with their VmFlags: from
/// `early` when no line changed since (recorded in `borrowed`), else from
/// a full smaps read.
pub fn read_frozen(
    pid: i32,
    early: Option<&EarlyMaps>,
    borrowed: &mut Borrowed,
) -> cr_sys::error::Result<Vec<MapEntry>> {
    if let Some(before) = early.and_then(|e| e.0.get(&pid)) {
        if let Some(maps) = proc::maps_with_flags(pid, before)? {
            borrowed.0.push((pid, maps.clone()));
            return Ok(maps);
        }
        debug!(pid, "mappings changed since smaps was read: read again");
    }
    proc::smaps(pid)
}

/// Advice only: huge pages wanted or not, KSM merging, read-ahead. A
/// program may change it at any time (Go's runtime toggles huge-page
/// advice on its heap as it grows and scavenges); a stale value costs
/// performance, never correctness.
const ADVICE: &[&str] = &["hg", "nh", "mg", "sr", "sl"];

/// The flags compared: what the program asked for, less the protection
/// (`rd`, `wr`, `ex`: in the line, and mprotect may change it after the
/// thaw), and, unless `exact`, less the advice ([`ADVICE`]).
fn asked(flags: &[String], exact: bool) -> Vec<&str> {
    flags
        .iter()
        .map(String::as_str)
        .filter(|f| !VM_FLAGS_NOT_COMPARED.contains(f) && !["rd", "wr", "ex"].contains(f))
        .filter(|f| exact || !ADVICE.contains(f))
        .collect()
}

impl Borrowed {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Read smaps again and compare the flags of every borrowed mapping
    /// with those of the mappings over its range now (see the module
    /// docs). A process gone meanwhile has nothing to compare. `exact`:
    /// the processes are still frozen, every flag is compared; else they
    /// run again and a change of advice alone is let pass (it may as well
    /// have come after the thaw; the image keeps the early read's advice),
    /// so that a program that keeps changing it does not fail every
    /// checkpoint.
    pub fn check(&self, exact: bool) -> Result<(), CheckpointError> {
        for (pid, maps) in &self.0 {
            let pid = *pid;
            let now = match proc::smaps(pid) {
                Ok(n) => n,
                Err(cr_sys::SysError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::NotFound =>
                {
                    continue
                }
                Err(e) => return Err(CheckpointError::from_sys(pid, e)),
            };
            for b in maps {
                let want = asked(&b.vm_flags, exact);
                let i = now.partition_point(|n| n.end <= b.start);
                let over = now[i..].iter().take_while(|n| n.start < b.end);
                for n in over {
                    let got = asked(&n.vm_flags, exact);
                    if got != want {
                        return Err(CheckpointError::FlagsChanged {
                            pid,
                            start: b.start,
                            end: b.end,
                            before: want.join(" "),
                            after: got.join(" "),
                        });
                    }
                }
            }
            debug!(
                pid,
                mappings = maps.len(),
                "flags read before the freeze checked"
            );
        }
        Ok(())
    }
}
