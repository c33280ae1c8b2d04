//! The mappings' VmFlags without a page walk while frozen.
//!
//! VmFlags (advice, locking, fork and dump behaviour...) exist only in
//! /proc/PID/smaps, whose read counts every resident page of every mapping
//! (Rss, Pss...): 0.2-0.3 s per GiB under load, and seq_file does it twice
//! for a big mapping (the record that no longer fits its buffer is
//! computed, dropped and computed again). So:
//!
//! On unless [`EARLY_FLAGS_ENV`] is `0`:
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
//!    one that continues them. Flags that a restore needs right and that
//!    differ from the early read fail the checkpoint (the image is
//!    removed, the processes run on); others (advice, `nr`) are logged and
//!    the image keeps the early read's (see [`CHECKED`]).
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

/// Set to `0` in a checkpoint's environment, smaps is read while frozen
/// (a page walk of all resident memory inside the freeze) instead of as
/// described above.
pub const EARLY_FLAGS_ENV: &str = "CR_EARLY_VMFLAGS";

/// Whether this checkpoint reads the flags before the freeze (see
/// [`EARLY_FLAGS_ENV`]).
pub fn early_wanted() -> bool {
    std::env::var_os(EARLY_FLAGS_ENV).is_none_or(|v| v != "0")
}
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

/// The flags a restore needs right: a child must not inherit (`dc`) or
/// must get zeroes (`wf`), locked in memory (`lo`), left out of core
/// dumps (`dd`), may hold guard regions (`gu`: only those mappings have
/// their pagemap read for them). The rest the check lets pass: advice (huge pages, KSM,
/// read-ahead) costs performance when stale, never correctness, and a
/// program may change it at any time (Go's runtime toggles huge-page
/// advice on its heap); `nr` (no swap reserved) only decides whether the
/// restore's mmap is charged, and a JVM drops it on its heap as it commits
/// memory (seen in CI). A mapping that gained `nr` is the exception: the
/// image, without it, would have the restore reserve what may be far more
/// than the machine has.
const CHECKED: &[&str] = &["dc", "wf", "lo", "dd", "gu"];

/// What of `now` differs from `before` on the flags a restore needs
/// (see [`CHECKED`]), as (before, after) lists for the error message.
fn differs(before: &[String], now: &[String]) -> Option<(String, String)> {
    let pick = |f: &[String]| -> Vec<String> {
        f.iter()
            .filter(|x| CHECKED.contains(&x.as_str()))
            .cloned()
            .collect()
    };
    let has = |f: &[String], x: &str| f.iter().any(|y| y == x);
    let (b, n) = (pick(before), pick(now));
    let gained_nr = has(now, "nr") && !has(before, "nr");
    (b != n || gained_nr).then(|| (before.join(" "), now.join(" ")))
}

impl Borrowed {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Read smaps again and compare the flags of every borrowed mapping
    /// with those of the mappings over its range now (see the module
    /// docs), on the flags a restore needs ([`CHECKED`]); a difference on
    /// the others is logged and the image keeps the early read's. A
    /// process gone meanwhile has nothing to compare.
    pub fn check(&self) -> Result<(), CheckpointError> {
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
                let i = now.partition_point(|n| n.end <= b.start);
                let over = now[i..].iter().take_while(|n| n.start < b.end);
                for n in over {
                    if let Some((before, after)) = differs(&b.vm_flags, &n.vm_flags) {
                        return Err(CheckpointError::FlagsChanged {
                            pid,
                            start: b.start,
                            end: b.end,
                            before,
                            after,
                        });
                    }
                    if n.vm_flags != b.vm_flags {
                        debug!(
                            pid,
                            start = b.start,
                            before = %b.vm_flags.join(" "),
                            after = %n.vm_flags.join(" "),
                            "flags changed since the early read (not needed by a restore)"
                        );
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

#[cfg(test)]
mod tests {
    use super::differs;

    fn f(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    /// What fails a checkpoint and what is let pass, by flag.
    #[test]
    fn only_the_flags_a_restore_needs_count() {
        // A JVM committing its heap: nr dropped.
        assert_eq!(differs(&f("mr mw me nr"), &f("mr mw me")), None);
        // Advice and protection changes.
        assert_eq!(differs(&f("rd wr mr mw hg"), &f("rd mr mw nh")), None);
        for (before, after) in [
            ("rd wr mr mw", "rd wr mr mw dd"),
            ("rd wr mr mw wf", "rd wr mr mw"),
            ("rd wr mr mw", "rd wr mr mw dc"),
            ("rd wr mr mw", "rd wr mr mw lo"),
            ("mr mw me", "mr mw me nr"),
        ] {
            assert_eq!(
                differs(&f(before), &f(after)),
                Some((before.into(), after.into())),
                "{before} -> {after}"
            );
        }
    }
}
