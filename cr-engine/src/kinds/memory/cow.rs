//! Private memory a parent and its child share copy-on-write, shared again
//! by the restore.
//!
//! A process that filled private memory (anonymous, or a private mapping
//! of a file: the pages it wrote are its anonymous copies) and then forked
//! shares those pages with its child until either writes one. Restored one process
//! at a time, every page would be written in each process: the memory
//! doubles and a program comparing physical frames (pagemap) sees them
//! apart. So, while the stubs are forked (`kinds::tree::restore::spawn`),
//! each stub first fills, at a spare address ("slot"), the mappings it
//! shares with its parent or a child, before it forks its children:
//!
//! - a mapping a process has exactly as its parent has it (same bounds,
//!   protection, kind, flags and name, and file and offset; private
//!   anonymous, heap or a private mapping of a file, not the stack, not
//!   `MADV_DONTFORK`/`MADV_WIPEONFORK`), and at least half of
//!   whose saved pages are the parent's, is kept as inherited at the fork
//!   (a child that mapped memory after the fork where its parent did too
//!   has the same mapping and none of the pages: it is mapped afresh by
//!   its rebuild, its pages written by the worker pool): only its pages whose saved content differs from the
//!   parent's page at that address are written (the image's store holds
//!   each content once, so "same place in the store" is "same content"),
//!   and the pages the parent had and it had not are dropped
//!   (`MADV_DONTNEED`: they read as zero, or as the file, as before);
//! - a mapping it shares with a child, not inherited, is mapped afresh in
//!   its slot (a file mapping from its file, at its offset: the pages
//!   never written stay the file's) and filled whole;
//! - inherited slots it does not keep are unmapped.
//!
//! The files are opened by the restorer before it forks the root's stub
//! ([`Cow::open_files`]): every stub has them at the same numbers. Not
//! when the tree has a mount namespace of its own (kind "mounts"): its
//! paths name files of mounts made after the stubs are forked.
//!
//! Its rebuild then moves each slot to the mapping's saved address
//! (`mremap`, which moves the page tables: the pages stay shared) instead
//! of mapping it, and fills only the other pages ([`Placed`]).
//!
//! The slots lie in one free area of the root's stub (inherited by every
//! stub), clear of every saved mapping of the tree, so that no move lands
//! on a slot still waiting. Pages that were equal by chance (not really
//! shared) are shared too: harmless, a write copies them. A restore with
//! `--lazy-pages` shares nothing (its pages arrive after the release).

use super::fill::{self, Pages};
use super::{compared_flags, free_range};
use crate::error::{RestoreError, StepContext};
use crate::restore::Restorer;
use cr_image::chain::{Piece, Source};
use cr_image::model::{Checkpoint, Process, Vma, VmaKind};
use cr_image::store::{Loc, PAGE};
use cr_sys::ptrace::Tracee;
use cr_sys::remote::{find_syscall_insn, Injector};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use tracing::{debug, info};

/// Slots start at the same offset in a 2 MiB frame as their mapping (a
/// huge page moved stays one).
const HUGE: u64 = 2 << 20;

/// A mapping held at `at` until its process's rebuild moves it to
/// `start..end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub start: u64,
    pub end: u64,
    pub at: u64,
}

/// The slots each process (by image PID) holds when its rebuild starts.
#[derive(Default)]
pub struct Placed(HashMap<u32, Vec<Slot>>);

impl Placed {
    /// The address ranges of process `pid`'s slots (kept while its stub's
    /// own memory goes).
    pub fn ranges(&self, pid: u32) -> Vec<(u64, u64)> {
        self.0.get(&pid).map_or_else(Vec::new, |s| {
            s.iter().map(|s| (s.at, s.at + s.end - s.start)).collect()
        })
    }

    /// Process `pid`'s slots, taken by the restore of its memory.
    pub fn take(&mut self, pid: u32) -> Vec<Slot> {
        self.0.remove(&pid).unwrap_or_default()
    }
}

/// Whether `v` may be shared with a relative: private memory that a fork
/// copies, anonymous (heap included; not the stack: it grows down, and is
/// written at once anyway) or, with `files`, a private mapping of a file.
fn shareable(v: &Vma, files: bool) -> bool {
    let kind = match v.kind {
        VmaKind::AnonPrivate | VmaKind::Heap => true,
        VmaKind::FilePrivate => files && !v.is_shmem(),
        _ => false,
    };
    kind && !v.shared
        && !v.has_flag("gd")
        && !v.has_flag("dc")
        && !v.has_flag("wf")
        && !v.has_flag("dp")
        // hugetlb memory (kept out: its slot would need huge pages too).
        && v.huge_page_size == 0
}

/// Whether `a` and `b` are the same mapping as a fork leaves it.
fn same(a: &Vma, b: &Vma) -> bool {
    a.start == b.start
        && a.end == b.end
        && a.prot == b.prot
        && a.kind == b.kind
        && a.anon_name == b.anon_name
        && compared_flags(a) == compared_flags(b)
        && (!a.kind.is_file()
            || (a.path == b.path
                && a.dev == b.dev
                && a.inode == b.inode
                && a.pgoff == b.pgoff
                && a.object == b.object))
}

/// What the stubs of one restore share, decided from the image.
pub struct Cow<'a> {
    procs: &'a [Process],
    pages: &'a Pages<'a>,
    pieces: &'a HashMap<u32, Vec<Piece>>,
    workers: usize,
    /// Per process (image order): the parent's index.
    parent: Vec<Option<usize>>,
    /// Per process: indices of its VMAs it keeps as inherited from its parent.
    kept: Vec<Vec<usize>>,
    /// Per process: indices of its VMAs it holds in slots before it forks
    /// (those it keeps, and those a child keeps).
    held: Vec<Vec<usize>>,
    /// Slot address of every held (start, end), once laid out.
    slots: HashMap<(u64, u64), u64>,
    /// The files of the held file mappings, opened by the restorer (by
    /// the path it opened), and that path of each (process, VMA index).
    opened: HashMap<String, OwnedFd>,
    path_of: HashMap<(usize, usize), String>,
    laid_out: bool,
    placed: Placed,
}

impl<'a> Cow<'a> {
    /// The plan for `ck` (nothing shared with `lazy`: see the module docs).
    pub fn new(
        ck: &'a Checkpoint,
        pages: &'a Pages<'a>,
        pieces: &'a HashMap<u32, Vec<Piece>>,
        workers: usize,
        lazy: bool,
    ) -> Cow<'a> {
        let procs = &ck.processes[..];
        // See the module docs.
        let files = ck.mounts.is_none();
        let live = |p: &Process| !p.is_zombie();
        let parent: Vec<Option<usize>> = procs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                procs[..i]
                    .iter()
                    .position(|q| q.pid == p.ppid && live(q))
                    .filter(|_| live(p))
            })
            .collect();
        let none = Vec::new();
        let pieces_of = |p: &Process| pieces.get(&p.pid).unwrap_or(&none);
        // What each process keeps as inherited: a mapping its parent has
        // the same, most of whose pages are still the parent's. Bounds
        // and flags alone do not tell: a child that mapped memory after
        // the fork where its parent did too has the same mapping, none of
        // the pages, and is better given a mapping of its own (filled with
        // the other pages by the worker pool) than every page written over
        // an inherited copy while the stubs are forked.
        let kept: Vec<Vec<usize>> = procs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let Some(j) = parent[i].filter(|_| !lazy) else {
                    return Vec::new();
                };
                let q = &procs[j];
                p.vmas
                    .iter()
                    .enumerate()
                    .filter(|(_, v)| {
                        shareable(v, files)
                            && q.vmas.iter().any(|w| shareable(w, files) && same(w, v))
                            && mostly_inherited(pieces_of(p), pieces_of(q), v.start, v.end)
                    })
                    .map(|(k, _)| k)
                    .collect()
            })
            .collect();
        // What each process holds in slots: what it keeps, and what a
        // child of it keeps.
        let held: Vec<Vec<usize>> = procs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let kept_by_child = |v: &Vma| {
                    (0..procs.len())
                        .filter(|&c| parent[c] == Some(i))
                        .any(|c| kept[c].iter().any(|&k| same(v, &procs[c].vmas[k])))
                };
                p.vmas
                    .iter()
                    .enumerate()
                    .filter(|&(k, v)| kept[i].contains(&k) || kept_by_child(v))
                    .map(|(k, _)| k)
                    .collect()
            })
            .collect();
        Cow {
            procs,
            pages,
            pieces,
            workers,
            parent,
            kept,
            held,
            slots: HashMap::new(),
            opened: HashMap::new(),
            path_of: HashMap::new(),
            laid_out: false,
            placed: Placed::default(),
        }
    }

    /// Open the file of every held file mapping, in the restorer: before
    /// it forks the root's stub, so that every stub has them at the same
    /// numbers to map them ([`Cow::before_fork`]). The restorer's are
    /// closed with [`Cow::into_placed`], the stubs' as they are rebuilt.
    pub fn open_files(&mut self, r: &mut Restorer<'_>) -> Result<(), RestoreError> {
        for (i, held) in self.held.iter().enumerate() {
            for &k in held {
                let v = &self.procs[i].vmas[k];
                if !v.kind.is_file() {
                    continue;
                }
                let path = fill::file_path(r, v)?;
                if !self.opened.contains_key(&path) {
                    let f = std::fs::File::open(&path)
                        .map_err(|source| cr_sys::SysError::Io {
                            path: path.clone(),
                            source,
                        })
                        .step(|| format!("cannot open {} to map it at {:#x}", v.path, v.start))?;
                    self.opened.insert(path.clone(), f.into());
                }
                self.path_of.insert((i, k), path);
            }
        }
        Ok(())
    }

    /// The slots every process holds, for the rebuilds.
    pub fn into_placed(self) -> Placed {
        self.placed
    }

    /// Lay the slots out in a range free in the root's stub (`root`) and
    /// in every saved mapping of the tree.
    fn lay_out(&mut self, root: i32) -> Result<(), RestoreError> {
        let mut ranges: Vec<(u64, u64)> = self
            .held
            .iter()
            .zip(self.procs)
            .flat_map(|(h, p)| h.iter().map(|&k| (p.vmas[k].start, p.vmas[k].end)))
            .collect();
        ranges.sort();
        ranges.dedup();
        if ranges.is_empty() {
            return Ok(());
        }
        let len: u64 = ranges.iter().map(|(s, e)| e - s + HUGE + PAGE as u64).sum();
        let mut used: Vec<(u64, u64)> = self
            .procs
            .iter()
            .flat_map(|p| p.vmas.iter().map(|v| (v.start, v.end)))
            .collect();
        let ours = cr_sys::proc::maps(root)?;
        used.extend(ours.iter().map(|m| (m.start, m.end)));
        let base = free_range(used, len, HUGE).ok_or_else(|| {
            RestoreError::Unsupported(format!(
                "no free address range of {len} bytes for the memory shared copy-on-write"
            ))
        })?;
        let mut at = base;
        for (s, e) in ranges {
            let off = (s % HUGE + HUGE - at % HUGE) % HUGE;
            at += off;
            self.slots.insert((s, e), at);
            at += e - s + PAGE as u64;
        }
        debug!(
            base,
            len,
            slots = self.slots.len(),
            "copy-on-write slots laid out"
        );
        Ok(())
    }

    fn slot(&self, v: &Vma) -> u64 {
        self.slots[&(v.start, v.end)]
    }

    /// Process `i`'s step in its stub `t`, before it forks its children:
    /// keep what it inherited and shares, write what differs, map and fill
    /// what it shares with its children only, drop the rest.
    pub fn before_fork(&mut self, i: usize, t: &mut Tracee) -> Result<(), RestoreError> {
        // In the root's stub, the first: every stub is a fork of it.
        if !self.laid_out {
            self.lay_out(t.tid())?;
            self.laid_out = true;
        }
        let procs = self.procs;
        let p = &procs[i];
        let inherited: Vec<&Vma> = self.parent[i].map_or_else(Vec::new, |j| {
            self.held[j].iter().map(|&k| &procs[j].vmas[k]).collect()
        });
        let held: Vec<(usize, &Vma)> = self.held[i].iter().map(|&k| (k, &p.vmas[k])).collect();
        let keeps: Vec<&Vma> = self.kept[i].iter().map(|&k| &p.vmas[k]).collect();
        if inherited.is_empty() && held.is_empty() {
            return Ok(());
        }
        let pid = t.tid();
        let none = Vec::new();
        let mine = self.pieces.get(&p.pid).unwrap_or(&none);
        let theirs = self.parent[i]
            .and_then(|j| self.pieces.get(&procs[j].pid))
            .unwrap_or(&none);
        let ip = find_syscall_insn(pid)?;
        let mut inj = Injector::new(t, ip)?;
        for v in inherited
            .iter()
            .filter(|v| !keeps.iter().any(|h| same(h, v)))
        {
            let at = self.slot(v);
            inj.call("munmap", libc::SYS_munmap, [at, v.len(), 0, 0, 0, 0])
                .step(|| format!("cannot unmap the inherited copy of {:#x}", v.start))?;
        }
        let mut writes = Vec::new();
        let (mut kept, mut dropped) = (0u64, 0u64);
        for &(k, v) in &held {
            let at = self.slot(v);
            let shift = |x: u64| x - v.start + at;
            let own = inside(mine, v.start, v.end);
            if keeps.iter().any(|h| same(h, v)) {
                let d = diff(&own, &inside(theirs, v.start, v.end));
                for &(s, e) in &d.drop {
                    inj.call(
                        "madvise",
                        libc::SYS_madvise,
                        [shift(s), e - s, libc::MADV_DONTNEED as u64, 0, 0, 0],
                    )
                    .step(|| format!("cannot drop the inherited pages {s:#x}-{e:#x}"))?;
                    dropped += (e - s) / PAGE as u64;
                }
                kept += d.same;
                writes.extend(d.write.into_iter().map(|w| Piece {
                    vaddr: shift(w.vaddr),
                    ..w
                }));
                continue;
            }
            let mut flags = libc::MAP_PRIVATE | libc::MAP_FIXED_NOREPLACE;
            if v.has_flag("nr") {
                flags |= libc::MAP_NORESERVE;
            }
            // A file mapping from its file (opened by `open_files`, the
            // stub has it), the others anonymous.
            let (fd, off) = match self.path_of.get(&(i, k)) {
                Some(path) => (self.opened[path].as_raw_fd() as u64, v.pgoff),
                None => {
                    flags |= libc::MAP_ANONYMOUS;
                    (u64::MAX, 0)
                }
            };
            let prot = (libc::PROT_READ | libc::PROT_WRITE) as u64;
            let got = inj
                .call(
                    "mmap",
                    libc::SYS_mmap,
                    [at, v.len(), prot, flags as u64, fd, off],
                )
                .step(|| format!("cannot map {:#x}-{:#x} at {at:#x}", v.start, v.end))?;
            if got != at {
                return Err(RestoreError::Unsupported(format!(
                    "mapping {:#x}-{:#x} landed at {got:#x}, not {at:#x}",
                    v.start, v.end
                )));
            }
            writes.extend(own.into_iter().map(|w| Piece {
                vaddr: shift(w.vaddr),
                ..w
            }));
        }
        inj.finish()?;
        self.pages.want(&writes);
        let written = fill::fill(pid, self.pages, &writes, self.workers, &|_| {})?;
        info!(
            pid = p.pid,
            mappings = held.len(),
            kept_mappings = keeps.len(),
            shared_pages = kept,
            written_pages = written / PAGE as u64,
            dropped_pages = dropped,
            "memory shared copy-on-write in place"
        );
        let slots = held
            .iter()
            .map(|&(_, v)| Slot {
                start: v.start,
                end: v.end,
                at: self.slot(v),
            })
            .collect();
        self.placed.0.insert(p.pid, slots);
        Ok(())
    }
}

/// The pieces of `pieces` (sorted) inside `[start, end)`.
fn inside(pieces: &[Piece], start: u64, end: u64) -> Vec<Piece> {
    super::lazy::split(pieces, &[(start, end)]).1
}

/// How a child's pages in one mapping differ from its parent's.
#[derive(Debug, Default, PartialEq, Eq)]
struct Diff {
    /// The child's pieces to write (its content differs, or the parent had none).
    write: Vec<Piece>,
    /// Ranges the parent had pages in and the child none.
    drop: Vec<(u64, u64)>,
    /// Pages kept as inherited.
    same: u64,
}

/// Whether at least as many of `child`'s pages in `[start, end)` are its
/// parent's (`parent`: the parent's pieces) as are its own, and at least one.
fn mostly_inherited(child: &[Piece], parent: &[Piece], start: u64, end: u64) -> bool {
    let d = diff(&inside(child, start, end), &inside(parent, start, end));
    let written: u64 = d.write.iter().map(|w| u64::from(w.pages)).sum();
    d.same > 0 && d.same >= written
}

/// Where the page at `addr` of piece `p` is.
fn source_at(p: &Piece, addr: u64) -> Source {
    match p.src {
        Source::Store { link, loc } => Source::Store {
            link,
            loc: Loc {
                block: loc.block,
                page: loc.page + ((addr - p.vaddr) / PAGE as u64) as u32,
            },
        },
        s => s,
    }
}

/// Page by page, `child` (sorted pieces) against `parent` (sorted pieces)
/// over the same range.
fn diff(child: &[Piece], parent: &[Piece]) -> Diff {
    let page = PAGE as u64;
    let end = |p: &Piece| p.vaddr + p.pages as u64 * page;
    let mut d = Diff::default();
    // Every address where either side starts or stops holding pages.
    let mut cuts: Vec<u64> = child
        .iter()
        .chain(parent)
        .flat_map(|p| [p.vaddr, end(p)])
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let (mut ci, mut pi) = (0, 0);
    for w in cuts.windows(2) {
        let (s, e) = (w[0], w[1]);
        while child.get(ci).is_some_and(|p| end(p) <= s) {
            ci += 1;
        }
        while parent.get(pi).is_some_and(|p| end(p) <= s) {
            pi += 1;
        }
        let c = child.get(ci).filter(|p| p.vaddr <= s);
        let q = parent.get(pi).filter(|p| p.vaddr <= s);
        match (c, q) {
            (None, None) => {}
            (None, Some(_)) => match d.drop.last_mut() {
                Some(last) if last.1 == s => last.1 = e,
                _ => d.drop.push((s, e)),
            },
            (Some(c), q) => {
                // Within [s, e) both sides are single pieces: compare page by page.
                let mut a = s;
                while a < e {
                    let differs = q.is_none_or(|q| source_at(c, a) != source_at(q, a));
                    if differs {
                        push_page(&mut d.write, c, a);
                    } else {
                        d.same += 1;
                    }
                    a += page;
                }
            }
        }
    }
    d
}

/// Add page `addr` of piece `c` to `out`, extending the last piece when
/// it continues it.
fn push_page(out: &mut Vec<Piece>, c: &Piece, addr: u64) {
    let src = source_at(c, addr);
    if let Some(last) = out.last_mut() {
        let follows = last.vaddr + last.pages as u64 * PAGE as u64 == addr
            && source_at(last, addr - PAGE as u64) == prev_source(src);
        if follows {
            last.pages += 1;
            return;
        }
    }
    out.push(Piece {
        vaddr: addr,
        pages: 1,
        src,
    });
}

/// The source of the page before one at `s` in the same run, as a stored
/// piece continues it (a zero piece continues a zero piece).
fn prev_source(s: Source) -> Source {
    match s {
        Source::Store { link, loc } if loc.page > 0 => Source::Store {
            link,
            loc: Loc {
                block: loc.block,
                page: loc.page - 1,
            },
        },
        Source::Store { .. } => Source::Parent,
        s => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: u64 = PAGE as u64;

    fn stored(vaddr: u64, pages: u32, block: u32, page: u32) -> Piece {
        Piece {
            vaddr,
            pages,
            src: Source::Store {
                link: 0,
                loc: Loc { block, page },
            },
        }
    }

    #[test]
    fn equal_pages_are_kept_differing_ones_written_missing_ones_dropped() {
        // Parent: 8 pages from block 1. Child: the same first 3, then 2 of
        // its own (block 2), then the parent's 6th, then nothing.
        let parent = [stored(0x10000, 8, 1, 0)];
        let child = [
            stored(0x10000, 3, 1, 0),
            stored(0x10000 + 3 * P, 2, 2, 0),
            stored(0x10000 + 5 * P, 1, 1, 5),
        ];
        let d = diff(&child, &parent);
        assert_eq!(d.same, 4);
        assert_eq!(d.write, vec![stored(0x10000 + 3 * P, 2, 2, 0)]);
        assert_eq!(d.drop, vec![(0x10000 + 6 * P, 0x10000 + 8 * P)]);
    }

    #[test]
    fn a_mapping_is_kept_only_when_most_of_its_pages_are_the_parents() {
        let (s, e) = (0x10000, 0x10000 + 8 * P);
        let parent = [stored(s, 8, 1, 0)];
        // Mapped after the fork where the parent mapped too: all its own.
        assert!(!mostly_inherited(&[stored(s, 8, 2, 0)], &parent, s, e));
        // Nothing saved: nothing to keep.
        assert!(!mostly_inherited(&[], &parent, s, e));
        // Half rewritten: kept.
        let half = [stored(s, 4, 1, 0), stored(s + 4 * P, 4, 2, 0)];
        assert!(mostly_inherited(&half, &parent, s, e));
        // One page of eight the parent's: mapped afresh.
        let one = [stored(s, 1, 1, 0), stored(s + P, 7, 2, 0)];
        assert!(!mostly_inherited(&one, &parent, s, e));
    }

    #[test]
    fn pages_the_parent_lacks_are_written() {
        let child = [
            stored(0x20000, 2, 3, 4),
            Piece {
                vaddr: 0x20000 + 2 * P,
                pages: 2,
                src: Source::Zero,
            },
        ];
        let parent = [Piece {
            vaddr: 0x20000 + 3 * P,
            pages: 1,
            src: Source::Zero,
        }];
        let d = diff(&child, &parent);
        assert_eq!(d.same, 1);
        assert_eq!(
            d.write,
            vec![
                stored(0x20000, 2, 3, 4),
                Piece {
                    vaddr: 0x20000 + 2 * P,
                    pages: 1,
                    src: Source::Zero
                }
            ]
        );
        assert!(d.drop.is_empty());
    }
}
