//! Chains of incremental images: an image whose pages are partly "unchanged
//! since the parent" refers to its parent directory (by path and image
//! id), which may refer to its own, and so on.
//!
//! - [`walk`] (and [`Chain::open`] with it) follows and checks the references (a missing parent,
//!   or a directory now holding another image, is refused by name);
//! - [`Chain::resolve`] says for every page of a process where its bytes
//!   are (which image's store, which block);
//! - [`flatten`] merges the first images of a chain into one (compaction,
//!   and rewriting the dependants of an image that is removed);
//! - the `dependants` file of a parent lists the images made on top of it,
//!   so that removing or overwriting it can be refused.

use crate::dir::ImageDir;
use crate::model::{Checkpoint, Compression, MemStats, Memory, PageAt, PageRun, ParentRef};
use crate::store::{page_hash, Loc, StoreReader, StoreWriter, PAGE};
use crate::{io_err, ImageError, Result};
use std::path::{Component, Path, PathBuf};

/// Deepest chain followed (a loop of references is refused).
const MAX_DEPTH: usize = 4096;
/// File of a parent image listing its children: `ID<TAB>PATH` lines.
pub const DEPENDANTS_FILE: &str = "dependants";

pub struct Link {
    pub dir: ImageDir,
    pub ck: Checkpoint,
}

impl Link {
    /// The memory of process `pid` in this image.
    pub fn memory(&self, pid: u32) -> Option<&Memory> {
        self.ck.process(pid).map(|p| &p.memory)
    }
}

/// An image and its ancestors: `links[0]` is the image itself.
pub struct Chain {
    pub links: Vec<Link>,
}

/// The directory a parent reference points to.
pub fn parent_dir(child: &Path, p: &ParentRef) -> PathBuf {
    child.join(&p.path)
}

/// How a child at `child` names `parent`: a relative path when both are
/// under a common root, so a tree of images can be moved as a whole.
pub fn relative_path(child: &Path, parent: &Path) -> String {
    let (Ok(c), Ok(p)) = (child.canonicalize(), parent.canonicalize()) else {
        return parent.to_string_lossy().into_owned();
    };
    let cc: Vec<Component> = c.components().collect();
    let pc: Vec<Component> = p.components().collect();
    let common = cc.iter().zip(&pc).take_while(|(a, b)| a == b).count();
    let mut rel = PathBuf::new();
    for _ in common..cc.len() {
        rel.push("..");
    }
    for comp in &pc[common..] {
        rel.push(comp);
    }
    if rel.as_os_str().is_empty() {
        ".".into()
    } else {
        rel.to_string_lossy().into_owned()
    }
}

/// Follow the chain of the image at `path`: `open` reads one image and
/// gives what its caller keeps of it, its image id and the parent it is
/// incremental on; the walk checks each parent (it exists, it still holds
/// the image the child was made on, no loop). Every reader of chains
/// (a restore's [`Chain::open`], the agents' image transfers with their
/// cache of links) walks with it. Returns each directory (as its child's
/// link names it) with its value, `path` first.
pub fn walk<T>(
    path: &Path,
    mut open: impl FnMut(&Path) -> Result<(T, String, Option<ParentRef>)>,
) -> Result<Vec<(PathBuf, T)>> {
    let (top, _, mut parent) = open(path)?;
    let mut out = vec![(path.to_path_buf(), top)];
    let mut seen: Vec<PathBuf> = path.canonicalize().into_iter().collect();
    while let Some(p) = parent {
        let child = out.last().expect("one link at least").0.clone();
        let ppath = parent_dir(&child, &p);
        let parent_err = |what: String| ImageError::Parent {
            child: child.clone(),
            parent: ppath.clone(),
            what,
        };
        if let Ok(c) = ppath.canonicalize() {
            if seen.contains(&c) {
                return Err(parent_err("its chain of parents loops".into()));
            }
            seen.push(c);
        }
        if out.len() >= MAX_DEPTH {
            return Err(parent_err(format!(
                "the chain is deeper than {MAX_DEPTH} images"
            )));
        }
        let (value, id, next) = open(&ppath).map_err(|e| parent_err(crate::one_line(&e)))?;
        if id != p.image_id {
            return Err(parent_err(format!(
                "it now holds another image (id {}, expected {})",
                short(&id),
                short(&p.image_id)
            )));
        }
        out.push((ppath, value));
        parent = next;
    }
    Ok(out)
}

impl Chain {
    /// Open the image at `path` and every parent it refers to.
    pub fn open(path: &Path) -> Result<Chain> {
        let links = walk(path, |p| {
            let dir = ImageDir::open(p)?;
            let ck = dir.read_checkpoint()?;
            let (id, parent) = (ck.meta.image_id.clone(), ck.parent.clone());
            Ok((Link { dir, ck }, id, parent))
        })?;
        let mut links: Vec<Link> = links.into_iter().map(|(_, l)| l).collect();
        // Images of format 3.1 write only their stored pages' hashes: each
        // link's parent pages take theirs from the link after it, filled
        // first (the oldest image has no parent pages).
        for k in (0..links.len()).rev() {
            let (head, tail) = links.split_at_mut(k + 1);
            let (link, parent) = (&mut head[k], tail.first());
            for p in &mut link.ck.processes {
                p.memory
                    .fill_parent_hashes(parent.and_then(|l| l.memory(p.pid)))
                    .map_err(|what| ImageError::Invalid {
                        path: link.dir.path().into(),
                        what: format!("process {}: its parent pages' hashes: {what}", p.pid),
                    })?;
            }
        }
        Ok(Chain { links })
    }

    pub fn top(&self) -> &Link {
        &self.links[0]
    }

    /// Where every page of process `pid` of the top image lives, following
    /// parents up to link `max_link` (pages beyond it come out as
    /// [`Source::Parent`]).
    pub fn resolve(&self, pid: u32, max_link: usize) -> Result<Vec<Piece>> {
        let mut out = Vec::new();
        let Some(mem) = self.links[0].memory(pid) else {
            return Ok(out);
        };
        for r in &mem.runs {
            self.resolve_run(0, pid, r, r.vaddr, r.pages as u64, max_link, &mut out)?;
        }
        Ok(out)
    }

    /// Resolve pages `[vaddr, vaddr + pages)` of run `r` of link `k`.
    #[allow(clippy::too_many_arguments)]
    fn resolve_run(
        &self,
        k: usize,
        pid: u32,
        r: &PageRun,
        vaddr: u64,
        pages: u64,
        max_link: usize,
        out: &mut Vec<Piece>,
    ) -> Result<()> {
        let skip = (vaddr - r.vaddr) / PAGE as u64;
        match r.at {
            PageAt::Store { block, page } => out.push(Piece {
                vaddr,
                pages: pages as u32,
                src: Source::Store {
                    link: k,
                    loc: Loc {
                        block,
                        page: page + skip as u32,
                    },
                },
            }),
            PageAt::Zero => out.push(Piece {
                vaddr,
                pages: pages as u32,
                src: Source::Zero,
            }),
            PageAt::Parent if k >= max_link => out.push(Piece {
                vaddr,
                pages: pages as u32,
                src: Source::Parent,
            }),
            PageAt::Parent => self.resolve_in(k + 1, pid, vaddr, pages, max_link, out)?,
        }
        Ok(())
    }

    /// Resolve `[vaddr, vaddr + pages)` of process `pid` in link `k`.
    fn resolve_in(
        &self,
        k: usize,
        pid: u32,
        vaddr: u64,
        pages: u64,
        max_link: usize,
        out: &mut Vec<Piece>,
    ) -> Result<()> {
        let end = vaddr + pages * PAGE as u64;
        let missing = |from: u64| {
            let child = &self.links[k - 1];
            match self.links.get(k) {
                Some(p) => ImageError::Parent {
                    child: child.dir.path().into(),
                    parent: p.dir.path().into(),
                    what: format!(
                        "process {pid}'s pages {from:#x}..{end:#x} are not in it"
                    ),
                },
                None => ImageError::Invalid {
                    path: child.dir.path().into(),
                    what: format!(
                        "process {pid}'s pages {from:#x}..{end:#x} refer to a parent, and it has none"
                    ),
                },
            }
        };
        let link = self.links.get(k).ok_or_else(|| missing(vaddr))?;
        let mem = link.memory(pid).ok_or_else(|| missing(vaddr))?;
        let mut at = vaddr;
        let first = mem.runs.partition_point(|r| r.end() <= at);
        for r in &mem.runs[first..] {
            if at >= end {
                break;
            }
            if r.vaddr > at {
                return Err(missing(at));
            }
            let run_end = r.end();
            let stop = run_end.min(end);
            self.resolve_run(k, pid, r, at, (stop - at) / PAGE as u64, max_link, out)?;
            at = stop;
        }
        if at < end {
            return Err(missing(at));
        }
        Ok(())
    }
}

/// Where the bytes of a resolved piece are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// In the store of link `link`, consecutive in one block from `loc`.
    Store { link: usize, loc: Loc },
    /// All zero.
    Zero,
    /// Beyond the links asked for.
    Parent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub vaddr: u64,
    pub pages: u32,
    pub src: Source,
}

/// Finds pages of one process's memory by address.
pub struct MemIndex<'a> {
    mem: &'a Memory,
    /// Index in `mem.hashes` of each run's first page.
    hash_at: Vec<usize>,
}

impl<'a> MemIndex<'a> {
    pub fn new(mem: &'a Memory) -> Self {
        let mut n = 0;
        let hash_at = mem
            .runs
            .iter()
            .map(|r| {
                let at = n;
                if mem.has_hashes(r) {
                    n += r.pages as usize;
                }
                at
            })
            .collect();
        MemIndex { mem, hash_at }
    }

    /// The hash of the page at `vaddr`, if the image holds data for it
    /// (and its hash: an image read by itself, not through its chain, has
    /// none for its parent pages).
    pub fn hash_of(&self, vaddr: u64) -> Option<u64> {
        let i = self.mem.runs.partition_point(|r| r.end() <= vaddr);
        let r = self.mem.runs.get(i)?;
        if r.vaddr > vaddr || !self.mem.has_hashes(r) {
            return None;
        }
        let idx = self.hash_at[i] + ((vaddr - r.vaddr) / PAGE as u64) as usize;
        self.mem.hashes.get(idx).copied()
    }
}

impl MemIndex<'_> {
    /// The hash of the page at `vaddr` and its place in the store, if this
    /// image stored it (not in its parent image, not zero).
    pub fn stored_at(&self, vaddr: u64) -> Option<(u64, crate::store::Loc)> {
        let i = self.mem.runs.partition_point(|r| r.end() <= vaddr);
        let r = self.mem.runs.get(i)?;
        let PageAt::Store { block, page } = r.at else {
            return None;
        };
        if r.vaddr > vaddr {
            return None;
        }
        let k = (vaddr - r.vaddr) / PAGE as u64;
        let h = *self.mem.hashes.get(self.hash_at[i] + k as usize)?;
        Some((
            h,
            crate::store::Loc {
                block,
                page: page + k as u32,
            },
        ))
    }
}

/// [`MemIndex::hash_of`] for addresses asked in increasing order: walks the
/// runs instead of searching them.
pub struct MemCursor<'a, 'b> {
    ix: &'b MemIndex<'a>,
    i: usize,
}

impl MemIndex<'_> {
    pub fn cursor(&self) -> MemCursor<'_, '_> {
        MemCursor { ix: self, i: 0 }
    }
}

impl MemCursor<'_, '_> {
    pub fn hash_of(&mut self, vaddr: u64) -> Option<u64> {
        let runs = &self.ix.mem.runs;
        while runs.get(self.i).is_some_and(|r| r.end() <= vaddr) {
            self.i += 1;
        }
        let r = runs.get(self.i)?;
        if r.vaddr > vaddr || !self.ix.mem.has_hashes(r) {
            return None;
        }
        let idx = self.ix.hash_at[self.i] + ((vaddr - r.vaddr) / PAGE as u64) as usize;
        self.ix.mem.hashes.get(idx).copied()
    }

    /// The hashes of the parent's pages from `vaddr` to the end of the run
    /// that holds it (what [`MemCursor::hash_of`] gives page by page, in
    /// one slice); `Err(next)` when the parent stores no page at `vaddr`
    /// (or it was read by itself and has no hash for it):
    /// `next` is where that stops being so (the next run, or the end of a
    /// run of zero pages; `u64::MAX`: never).
    pub fn hashes_from(&mut self, vaddr: u64) -> Result<&[u64], u64> {
        let runs = &self.ix.mem.runs;
        while runs.get(self.i).is_some_and(|r| r.end() <= vaddr) {
            self.i += 1;
        }
        let Some(r) = runs.get(self.i) else {
            return Err(u64::MAX);
        };
        if r.vaddr > vaddr {
            return Err(r.vaddr);
        }
        if !self.ix.mem.has_hashes(r) {
            return Err(r.end());
        }
        let first = self.ix.hash_at[self.i];
        let idx = first + ((vaddr - r.vaddr) / PAGE as u64) as usize;
        self.ix
            .mem
            .hashes
            .get(idx..first + r.pages as usize)
            .ok_or(r.end())
    }
}

impl MemCursor<'_, '_> {
    /// Append the parent's hashes of the `pages` pages from `vaddr` on to
    /// `out`; `Err(at)`: the parent holds no page at `at`.
    pub fn extend_hashes(&mut self, vaddr: u64, pages: u64, out: &mut Vec<u64>) -> Result<(), u64> {
        let end = vaddr + pages * PAGE as u64;
        let mut at = vaddr;
        while at < end {
            let hs = self.hashes_from(at).map_err(|_| at)?;
            let n = (hs.len() as u64).min((end - at) / PAGE as u64);
            if n == 0 {
                return Err(at);
            }
            out.extend_from_slice(&hs[..n as usize]);
            at += n * PAGE as u64;
        }
        Ok(())
    }
}

/// Append `pages` pages at `vaddr` to `runs`, merging with the last run
/// when it continues it (in the same block, for stored pages).
pub fn push_run(runs: &mut Vec<PageRun>, vaddr: u64, pages: u32, at: PageAt) {
    if let Some(last) = runs.last_mut() {
        let continues = last.end() == vaddr
            && match (last.at, at) {
                (
                    PageAt::Store {
                        block: b1,
                        page: p1,
                    },
                    PageAt::Store {
                        block: b2,
                        page: p2,
                    },
                ) => b1 == b2 && p1 + last.pages == p2,
                (a, b) => a == b,
            };
        if continues {
            last.pages += pages;
            return;
        }
    }
    runs.push(PageRun { vaddr, pages, at });
}

/// Merge the first `merge + 1` images of `chain` into one image written to
/// `out` (its store; the caller commits the returned checkpoint): its pages
/// are its own, except those of images further up, which stay references
/// to `links[merge + 1]`. The image keeps its id (its content is the same).
pub fn flatten(
    chain: &Chain,
    merge: usize,
    out: &ImageDir,
    compression: Compression,
    fsync: bool,
) -> Result<Checkpoint> {
    let merge = merge.min(chain.links.len() - 1);
    let readers = chain.links[..=merge]
        .iter()
        .map(|l| match &l.ck.store {
            Some(s) => StoreReader::open(&l.dir, s).map(Some),
            None => Ok(None),
        })
        .collect::<Result<Vec<_>>>()?;
    let top = chain.top();
    let writer = StoreWriter::create(out, &crate::new_image_id()[..16], compression)?;
    let mut ck = top.ck.clone();
    let mut cur = None;
    let mut buf = Vec::new();
    for p in ck.processes.iter_mut().filter(|p| !p.is_zombie()) {
        let pieces = chain.resolve(p.pid, merge)?;
        let mem = &mut p.memory;
        let mut runs = Vec::with_capacity(pieces.len());
        let mut stats = MemStats::default();
        let mut hash_i = 0usize;
        for piece in pieces {
            match piece.src {
                Source::Zero => {
                    stats.pages_zero += piece.pages as u64;
                    push_run(&mut runs, piece.vaddr, piece.pages, PageAt::Zero);
                }
                Source::Parent => {
                    stats.pages_parent += piece.pages as u64;
                    hash_i += piece.pages as usize;
                    push_run(&mut runs, piece.vaddr, piece.pages, PageAt::Parent);
                }
                Source::Store { link, loc } => {
                    let reader = readers[link].as_ref().ok_or_else(|| ImageError::Invalid {
                        path: chain.links[link].dir.path().into(),
                        what: "pages refer to a store the image does not have".into(),
                    })?;
                    let data = reader.block(loc.block, &mut buf)?;
                    for i in 0..piece.pages as usize {
                        let at = (loc.page as usize + i) * PAGE;
                        let page = data.get(at..at + PAGE).ok_or_else(|| ImageError::Invalid {
                            path: reader.path().into(),
                            what: format!(
                                "page {} of block {} is beyond its end",
                                loc.page as usize + i,
                                loc.block
                            ),
                        })?;
                        let h = page_hash(page);
                        if mem.hashes.get(hash_i) != Some(&(h as u64)) {
                            return Err(ImageError::Checksum {
                                path: reader.path().into(),
                                context: format!(
                                    " (page {:#x} of process {} differs from its recorded hash)",
                                    piece.vaddr + (i * PAGE) as u64,
                                    p.pid
                                ),
                            });
                        }
                        hash_i += 1;
                        let (nloc, dup) = writer.add(&mut cur, h, page)?;
                        if dup {
                            stats.pages_dup += 1;
                        } else {
                            stats.pages_stored += 1;
                        }
                        push_run(
                            &mut runs,
                            piece.vaddr + (i * PAGE) as u64,
                            1,
                            PageAt::Store {
                                block: nloc.block,
                                page: nloc.page,
                            },
                        );
                    }
                }
            }
        }
        mem.runs = runs;
        stats.pages_read = mem.stats.pages_read;
        mem.stats = stats;
    }
    writer.close(cur)?;
    ck.store = Some(writer.finish(fsync)?);
    ck.parent = chain.links.get(merge + 1).map(|l| ParentRef {
        path: relative_path(out.path(), l.dir.path()),
        image_id: l.ck.meta.image_id.clone(),
    });
    Ok(ck)
}

/// Record `child` (image `child_id`) as made on top of the image at `parent`.
pub fn add_dependant(parent: &Path, child: &Path, child_id: &str) -> Result<()> {
    use std::io::Write;
    let path = parent.join(DEPENDANTS_FILE);
    let child = child.canonicalize().unwrap_or_else(|_| child.to_path_buf());
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io_err(&path))?;
    // One write(2) per line: concurrent appends do not interleave.
    f.write_all(format!("{child_id}\t{}\n", child.display()).as_bytes())
        .map_err(io_err(&path))
}

/// The images that still have the image at `dir` as their parent.
pub fn dependants(dir: &ImageDir) -> Result<Vec<PathBuf>> {
    let ck = dir.read_checkpoint()?;
    let Ok(text) = std::fs::read_to_string(dir.file(DEPENDANTS_FILE)) else {
        return Ok(Vec::new());
    };
    let me = dir.path().canonicalize().map_err(io_err(dir.path()))?;
    let mut out: Vec<PathBuf> = Vec::new();
    for line in text.lines() {
        let Some((_, path)) = line.split_once('\t') else {
            continue;
        };
        let path = PathBuf::from(path);
        let Ok(child) = ImageDir::open(&path).and_then(|d| d.read_checkpoint()) else {
            continue; // removed since
        };
        let Some(p) = child.parent else { continue };
        let points_here = parent_dir(&path, &p).canonicalize().is_ok_and(|c| c == me);
        if p.image_id == ck.meta.image_id && points_here && !out.contains(&path) {
            out.push(path);
        }
    }
    Ok(out)
}

fn short(id: &str) -> &str {
    &id[..id.len().min(12)]
}

/// Files of the image at `dir` that belong to it: metadata, store, file
/// contents and the dependants list.
fn image_files(dir: &ImageDir, ck: &Checkpoint) -> Vec<PathBuf> {
    let mut v = vec![
        dir.file(crate::dir::CHECKPOINT_FILE),
        dir.file(DEPENDANTS_FILE),
    ];
    v.extend(crate::dir::data_files(ck).iter().map(|n| dir.file(n)));
    v
}

/// The compression of an image's store (none without a store).
fn compression_of(ck: &Checkpoint) -> Compression {
    ck.store
        .as_ref()
        .map_or(Compression::None, |s| s.compression)
}

/// Make the image at `path` self-contained: into `out` (a new directory),
/// or in place when `out` is None (dependants stay valid: same id, same
/// content). Returns the new checkpoint.
pub fn compact(
    path: &Path,
    out: Option<&Path>,
    compression: Option<Compression>,
    fsync: bool,
) -> Result<Checkpoint> {
    let chain = Chain::open(path)?;
    let top = chain.top();
    let compression = compression.unwrap_or_else(|| compression_of(&top.ck));
    match out {
        Some(out) => {
            if out.join(crate::dir::CHECKPOINT_FILE).exists() {
                return Err(ImageError::Invalid {
                    path: out.into(),
                    what: "it already holds an image (choose a new directory)".into(),
                });
            }
            let od = ImageDir::create(out)?;
            let mut ck = flatten(&chain, usize::MAX, &od, compression, fsync)?;
            for pf in crate::model::objects::content_files(&top.ck) {
                let from = top.dir.file(&pf.name);
                let to = od.file(&format!("{}{}", pf.name, crate::dir::TMP_SUFFIX));
                std::fs::copy(&from, &to).map_err(io_err(&from))?;
            }
            od.commit(&mut ck, fsync)?;
            od.settle(&crate::dir::data_files(&ck));
            Ok(ck)
        }
        None => rewrite_in_place(&chain, usize::MAX, compression, fsync),
    }
}

/// Replace the top image of `chain` by its merge with `merge` parents.
fn rewrite_in_place(
    chain: &Chain,
    merge: usize,
    compression: Compression,
    fsync: bool,
) -> Result<Checkpoint> {
    let merge = merge.min(chain.links.len() - 1);
    let top = chain.top();
    let mut ck = flatten(chain, merge, &top.dir, compression, fsync)?;
    top.dir.publish(&mut ck, fsync)?;
    if let Some(old) = &top.ck.store {
        if ck.store.as_ref().is_none_or(|s| s.name != old.name) {
            let _ = std::fs::remove_file(top.dir.file(&old.name));
        }
    }
    if let (Some(_), Some(l)) = (&ck.parent, chain.links.get(merge + 1)) {
        add_dependant(l.dir.path(), top.dir.path(), &ck.meta.image_id)?;
    }
    Ok(ck)
}

/// Delete the image at `path`. An image other images depend on is refused
/// unless `rebase`: then its pages are first folded into each dependant,
/// which then refers to this image's own parent. Returns the dependants
/// rewritten.
pub fn remove(path: &Path, rebase: bool, fsync: bool) -> Result<Vec<PathBuf>> {
    let dir = ImageDir::open(path)?;
    let ck = dir.read_checkpoint()?;
    let deps = dependants(&dir)?;
    if !deps.is_empty() && !rebase {
        let more = if deps.len() > 1 {
            format!(" and {} more", deps.len() - 1)
        } else {
            String::new()
        };
        return Err(ImageError::InUse {
            path: path.into(),
            what: format!(
                "it is the parent of {}{more}; use --rebase to fold it into its dependants, or compact them first",
                deps[0].display()
            ),
        });
    }
    for d in &deps {
        let chain = Chain::open(d)?;
        let compression = compression_of(&chain.top().ck);
        rewrite_in_place(&chain, 1, compression, fsync)?;
    }
    for f in image_files(&dir, &ck) {
        match std::fs::remove_file(&f) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&f)(e)),
        }
    }
    dir.discard_tmp();
    // Other files (not ours) keep the directory.
    let _ = std::fs::remove_dir(path);
    Ok(deps)
}

/// [`remove`] the image at `path`, then the pre-dumps under `within` it was
/// made on (its parent, that one's parent, ...) that no other image needs
/// any more: a pre-dump cannot be restored by itself, it is kept only as a
/// parent. Stops at the first ancestor that is not a pre-dump, still has
/// dependants, or lies outside `within`. Returns the directories removed,
/// `path` first.
pub fn remove_unused(
    path: &Path,
    rebase: bool,
    fsync: bool,
    within: &Path,
) -> Result<Vec<PathBuf>> {
    // Resolved before the child goes: its relative reference passes
    // through the child's directory.
    let parent_of = |dir: &Path, ck: &Checkpoint| {
        ck.parent
            .as_ref()
            .and_then(|p| parent_dir(dir, p).canonicalize().ok())
    };
    let ck = ImageDir::open(path)?.read_checkpoint()?;
    let mut next = parent_of(path, &ck);
    remove(path, rebase, fsync)?;
    let mut removed = vec![path.to_path_buf()];
    while let Some(p) = next.take().filter(|p| p.starts_with(within) && p != within) {
        let Ok(dir) = ImageDir::open(&p) else { break };
        let Ok(pck) = dir.read_checkpoint() else {
            break;
        };
        if !pck.pre_dump || !dependants(&dir)?.is_empty() {
            break;
        }
        next = parent_of(&p, &pck);
        remove(&p, false, fsync)?;
        removed.push(p);
    }
    Ok(removed)
}

/// Refuse to write a new image over the one at `path` while others depend
/// on it.
pub fn check_overwrite(path: &Path) -> Result<()> {
    let Ok(dir) = ImageDir::open(path) else {
        return Ok(());
    };
    let deps = dependants(&dir)?;
    match deps.first() {
        None => Ok(()),
        Some(d) => Err(ImageError::InUse {
            path: path.into(),
            what: format!(
                "it holds the parent of {}, which a new image here would break (choose another directory, or `cr_image rm --rebase` it first)",
                d.display()
            ),
        }),
    }
}

#[cfg(test)]
mod cursor_tests {
    use super::*;
    use crate::model::{Memory, PageRun};

    /// hashes_from gives, from any page of a stored run, the rest of its
    /// hashes; before a run, in a zero run and past the end, where that
    /// stops.
    #[test]
    fn hashes_from_gives_the_rest_of_a_run() {
        let p = PAGE as u64;
        let mem = Memory {
            runs: vec![
                PageRun {
                    vaddr: 10 * p,
                    pages: 3,
                    at: PageAt::Parent,
                },
                PageRun {
                    vaddr: 13 * p,
                    pages: 2,
                    at: PageAt::Zero,
                },
                PageRun {
                    vaddr: 20 * p,
                    pages: 2,
                    at: PageAt::Store { block: 0, page: 0 },
                },
            ],
            hashes: vec![1, 2, 3, 4, 5],
            ..Memory::default()
        };
        let ix = MemIndex::new(&mem);
        let mut c = ix.cursor();
        assert_eq!(c.hashes_from(5 * p), Err(10 * p));
        assert_eq!(c.hashes_from(10 * p), Ok(&[1u64, 2, 3][..]));
        assert_eq!(c.hashes_from(11 * p), Ok(&[2u64, 3][..]));
        assert_eq!(c.hashes_from(13 * p), Err(15 * p));
        assert_eq!(c.hashes_from(15 * p), Err(20 * p));
        assert_eq!(c.hashes_from(21 * p), Ok(&[5u64][..]));
        assert_eq!(c.hashes_from(22 * p), Err(u64::MAX));
        for page in 10..22 {
            let mut fresh = ix.cursor();
            let first = fresh.hashes_from(page * p).ok().map(|h| h[0]);
            assert_eq!(first, ix.cursor().hash_of(page * p), "page {page}");
        }
    }
}
