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
/// freeze (by pid), with the exact paths of their file mappings.
#[derive(Default)]
pub struct EarlyMaps(HashMap<i32, Early>);

/// One process's early read: its mappings and, index for index, the
/// map_files link of each file mapping.
struct Early {
    maps: Vec<MapEntry>,
    links: Vec<Option<String>>,
}

impl EarlyMaps {
    /// smaps of each of `pids`, while they run, and the map_files link of
    /// each file mapping (what classifying it reads: ~300 links for a
    /// process with many libraries, read here instead of while frozen, see
    /// [`EarlyMaps::link`]); a process whose smaps cannot be read is left
    /// out (read in full once frozen).
    pub fn read(pids: &[i32]) -> EarlyMaps {
        let mut out = HashMap::new();
        for &pid in pids {
            match proc::smaps(pid) {
                Ok(maps) => {
                    let links = maps
                        .iter()
                        .map(|m| {
                            let link = format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end);
                            m.path
                                .starts_with('/')
                                .then(|| proc::read_link(&link).ok())
                                .flatten()
                        })
                        .collect();
                    out.insert(pid, Early { maps, links });
                }
                Err(e) => debug!(pid, error = %e, "smaps not read before the freeze"),
            }
        }
        EarlyMaps(out)
    }

    /// An early read made of `maps` and `links` (by start address), for tests.
    #[cfg(test)]
    pub fn of(pid: i32, maps: Vec<MapEntry>, links: &[(u64, &str)]) -> EarlyMaps {
        let links = maps
            .iter()
            .map(|m| {
                let l = links.iter().find(|l| l.0 == m.start);
                l.map(|l| l.1.to_string())
            })
            .collect();
        EarlyMaps(HashMap::from([(pid, Early { maps, links })]))
    }

    /// The exact path of file mapping `now` of frozen process `pid`, as its
    /// map_files link read before the freeze gave it, when that still holds:
    /// the early read has a mapping with the same line (bounds, protection,
    /// sharing, offset, device, inode and path as /proc/PID/maps shows them
    /// now), and its link was the shown path itself. The shown path is
    /// d_path's, as the link's; the two differ only where maps escapes a
    /// newline ("\012") or the parser trims blanks at the end, so a link
    /// with a backslash or ending in a blank is never reused. None: read
    /// the link again (a mapping made, moved or replaced since, or a file
    /// renamed or deleted: its line changed).
    pub fn link(&self, pid: i32, now: &MapEntry) -> Option<&str> {
        let early = self.0.get(&pid)?;
        let i = early.maps.partition_point(|e| e.start < now.start);
        let (e, link) = (early.maps.get(i)?, early.links.get(i)?.as_deref()?);
        let exact =
            link == now.path && !link.contains('\\') && !link.ends_with(char::is_whitespace);
        (e.same_line(now) && exact).then_some(link)
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
        if let Some(maps) = proc::maps_with_flags(pid, &before.maps)? {
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
    use super::{differs, EarlyMaps};
    use cr_sys::proc::{self, MapEntry};

    fn entry(start: u64, inode: u64, path: &str) -> MapEntry {
        MapEntry {
            start,
            end: start + 0x1000,
            prot: libc::PROT_READ as u32,
            offset: 0,
            dev_major: 8,
            dev_minor: 1,
            inode,
            path: path.into(),
            ..Default::default()
        }
    }

    /// A link read before the freeze is reused only for the same line and
    /// a path that maps shows exactly; anything else is read again.
    #[test]
    fn early_links_only_for_unchanged_lines() {
        let before = vec![
            entry(0x1000, 7, "/lib/a.so"),
            entry(0x3000, 8, "/tmp/x\\012y"),
            entry(0x5000, 9, "/tmp/b"),
            entry(0x7000, 0, ""),
        ];
        let early = EarlyMaps::of(
            42,
            before.clone(),
            &[
                (0x1000, "/lib/a.so"),
                (0x3000, "/tmp/x\ny"),
                (0x5000, "/tmp/b "),
            ],
        );
        assert_eq!(early.link(42, &before[0]), Some("/lib/a.so"));
        // Another process, or no early read of it.
        assert_eq!(early.link(43, &before[0]), None);
        // The mapping changed: another file (inode), moved, grown,
        // reprotected, another offset, renamed or deleted.
        let mut m = before[0].clone();
        m.inode = 70;
        assert_eq!(early.link(42, &m), None);
        let mut m = before[0].clone();
        m.end += 0x1000;
        assert_eq!(early.link(42, &m), None);
        let mut m = before[0].clone();
        m.prot |= libc::PROT_WRITE as u32;
        assert_eq!(early.link(42, &m), None);
        let mut m = before[0].clone();
        m.offset = 0x1000;
        assert_eq!(early.link(42, &m), None);
        let mut m = before[0].clone();
        m.path = "/lib/a.so (deleted)".into();
        assert_eq!(early.link(42, &m), None);
        let mut m = before[0].clone();
        m.start = 0x2000;
        m.end = 0x3000;
        assert_eq!(early.link(42, &m), None);
        // The link and the shown path differ (an escaped newline, a blank
        // trimmed at the end): read again.
        assert_eq!(early.link(42, &before[1]), None);
        assert_eq!(early.link(42, &before[2]), None);
        // No link (anonymous memory).
        assert_eq!(early.link(42, &before[3]), None);
    }

    /// Live: a file mapped by this process, read early; the same line gives
    /// the early link, the file renamed since is read again (the new name).
    #[test]
    fn early_links_of_a_live_mapping() {
        let dir = std::env::temp_dir().join(format!("cr-early-links-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::write(&a, vec![1u8; 4096]).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&a)
            .unwrap();
        let w = cr_sys::mem::FileWindow::map(&f, 0, 4096, "test file").unwrap();
        let at = w.bytes().as_ptr() as u64;
        let pid = std::process::id() as i32;
        let early = EarlyMaps::read(&[pid]);
        let find = || {
            proc::maps(pid)
                .unwrap()
                .into_iter()
                .find(|m| m.start == at)
                .expect("the test's mapping")
        };
        let now = find();
        assert_eq!(early.link(pid, &now), Some(a.to_str().unwrap()));
        let v = crate::kinds::memory::dump::classify_with(pid, &now, early.link(pid, &now));
        assert_eq!(v.unwrap().path, a.to_str().unwrap());
        std::fs::rename(&a, &b).unwrap();
        let now = find();
        assert_eq!(early.link(pid, &now), None, "renamed: its line changed");
        let v = crate::kinds::memory::dump::classify_with(pid, &now, early.link(pid, &now));
        assert_eq!(v.unwrap().path, b.to_str().unwrap());
        drop(w);
        let _ = std::fs::remove_dir_all(&dir);
    }

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
