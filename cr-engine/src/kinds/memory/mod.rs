//! Kind "memory": every mapping of a process, its pages, and the mm fields
//! (code/data/brk/stack/arg/env bounds, auxiliary vector, exe link).
//!
//! - [`dump`]: classify the mappings and copy the pages that must be saved
//!   into the image's page store (on the shared [`pool`]);
//! - [`tracking`]: which pages were written since the parent image
//!   (userfaultfd write-protect, soft-dirty, or page hashes);
//! - [`fill`]: map every mapping again and fill its pages;
//! - [`cow`]: memory a parent shares copy-on-write with its children,
//!   filled before the stubs fork, so it is shared again;
//! - [`vdso`]: the kernel's special mappings;
//! - [`flags`]: the mappings' VmFlags read before the freeze, checked after.
//!
//! Capture runs in two steps ([`plan_process`] while the process is frozen,
//! [`copy_process`] which may run after it is let go: a pre-dump), so a
//! checkpoint and a pre-dump share one path. Restore: the stub's own memory
//! goes ([`unmap_stub`]), the vDSO moves, every mapping comes back and is
//! filled, then its protections and advice; the mm fields last
//! ([`set_mm`]), once the old executable is no longer mapped.

pub mod cow;
pub mod dump;
pub mod fill;
pub mod flags;
pub mod lazy;
pub mod pool;
pub mod remote;
#[cfg(test)]
mod tests;
pub mod tracking;
pub mod vdso;

pub use fill::Pages;
pub use flags::{early_wanted, Borrowed, EarlyMaps, EARLY_FLAGS_ENV};

use crate::capture::{Dump, Proc};
use crate::error::{CheckpointError, RestoreError, StepContext};
use crate::interrupt;
use crate::kinds::{files, Kind, Stash};
use crate::restore::Rebuild;
use crate::stub::{Stub, SCRATCH};
use cr_image::chain::MemIndex;
use cr_image::model::{DirtyMethod, Mm, Process, ShmOwner, Vma, VmaKind};
use cr_sys::proc::{self, MapEntry};
use cr_sys::PAGE_SIZE;
use std::collections::HashMap;

pub struct Memory;

/// Room after the scratch area where the vDSO pages are parked while moving.
pub const PARK: u64 = 64 * 1024;
const TASK_TOP: u64 = 0x7fff_ffff_f000;
const PR_SET_MM: u64 = 35;
const PR_SET_MM_MAP: u64 = 14;

/// Where kind "memory"'s time goes in one process's capture (µs per
/// step, at debug level): the steps lap it as they go.
#[derive(Default)]
struct MemLaps(crate::capture::Laps);

fn mem_lap(stash: &mut Stash, name: &'static str) {
    stash.get::<MemLaps>().0.lap(name);
}

/// Dirty trackers of one dump.
#[derive(Default)]
pub struct Trackers {
    /// Left running: (pid, method, fd), recorded once the image is committed.
    pub kept: Vec<(i32, DirtyMethod, i32)>,
    /// No longer wanted: released only after the processes run on (the
    /// kernel removes the write protection from every page when the last
    /// reference goes, which must not lengthen the freeze).
    pub released: Vec<tracking::Released>,
}

/// The trackers of a dump, for its end.
pub fn take_trackers(stash: &mut Stash) -> Trackers {
    stash.take().unwrap_or_default()
}

/// Shared anonymous memory objects seen so far in the tree: (dev, inode)
/// -> the first mapping of the object (its pid and VMA), and the object's
/// ranges (byte offsets, sorted) whose pages some shared mapping stores.
#[derive(Default)]
struct ShmOwners(HashMap<(u64, u64), (ShmOwner, Ranges)>);

/// Sorted, disjoint `[start, end)` ranges.
type Ranges = Vec<(u64, u64)>;

/// What of `[a, b)` the sorted, disjoint `covered` leaves out; `covered`
/// then includes `[a, b)`.
fn uncover(covered: &mut Vec<(u64, u64)>, a: u64, b: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = a;
    for &(s, e) in covered.iter() {
        if e <= at || s >= b {
            continue;
        }
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
    }
    if at < b {
        out.push((at, b));
    }
    covered.push((a, b));
    covered.sort();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(covered.len());
    for &(s, e) in covered.iter() {
        match merged.last_mut() {
            Some(m) if s <= m.1 => m.1 = m.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    *covered = merged;
    out
}

/// What a dump of one process will do, decided while it is frozen.
pub struct ProcessPlan {
    plan: dump::Plan,
    dirty: dump::Dirty,
}

impl ProcessPlan {
    /// Bytes of pages to read.
    pub fn bytes(&self) -> u64 {
        self.plan.bytes
    }
}

/// Mappings, trackers and the reading plan of the frozen process `cx`:
/// fills `p.vmas`. `live`: the pages will be read while the process runs
/// (a pre-dump).
pub fn plan_process(
    cx: &mut Proc<'_, '_>,
    p: &mut Process,
    live: bool,
) -> Result<ProcessPlan, CheckpointError> {
    let pid = cx.pid;
    let sys = |e| CheckpointError::from_sys(pid, e);
    let (maps, vmas, shm_reads) = mappings(cx, live)?;
    mem_lap(&mut cx.d.stash, "files");
    // A mapping registered in missing mode has pages that exist only in
    // whoever serves its userfaultfd (a post-copy restore not finished):
    // the pagemap shows them absent, as if zero.
    if let Some(m) = maps.iter().find(|m| m.has_flag("um")) {
        return Err(CheckpointError::Unsupported {
            pid,
            what: format!(
                "mapping {:#x}-{:#x} still waits for pages of a post-copy restore (userfaultfd missing mode); checkpoint it once every page is in",
                m.start, m.end
            ),
        });
    }
    if !live && p.fd_table_of.is_none() {
        packet_rings_held(pid, &vmas, p)?;
    }
    let keep = live || (cx.d.opts.track() && cx.d.opts.action() != crate::Action::Kill);
    let parent = cx.d.parent.filter(|l| l.memory(pid as u32).is_some());
    let begun = tracking::begin(
        &mut cx.probe,
        &maps,
        &vmas,
        parent.map(|l| l.ck.meta.image_id.as_str()),
        cx.d.method,
        keep,
    )?;
    mem_lap(&mut cx.d.stash, "tracking");
    let index = parent.and_then(|l| l.memory(pid as u32)).map(MemIndex::new);
    let plan = dump::plan(pid, &vmas, &shm_reads, index.as_ref(), &begun.dirty)?;
    mem_lap(&mut cx.d.stash, "plan");
    if begun.clear_soft_dirty {
        cr_sys::dirty::clear_soft_dirty(pid).map_err(sys)?;
    }
    p.vmas = vmas;
    p.memory.dirty = begun.used;
    p.memory.tracking = begun.kept.map(|k| k.0);
    let t = cx.d.stash.get::<Trackers>();
    t.released.extend(begun.released);
    if let Some((method, fd)) = begun.kept {
        t.kept.push((pid, method, fd));
    }
    Ok(ProcessPlan {
        plan,
        dirty: begun.dirty,
    })
}

/// A mapping of a socket is mapped again from the restored socket: only a
/// packet socket's rings are, from an fd of the process (kind "packet").
fn packet_rings_held(pid: i32, vmas: &[Vma], p: &Process) -> Result<(), CheckpointError> {
    for v in vmas.iter().filter(|v| v.kind == VmaKind::PacketRing) {
        let held = p.fds.iter().any(|f| {
            matches!(f.kind, cr_image::model::FdKind::PacketSocket { object } if object == v.inode)
        });
        if !held {
            return Err(CheckpointError::unsupported(
                pid,
                format!(
                    "mapping {:#x}-{:#x} of {}, not a packet socket the process holds open (only a packet socket's rings are mapped again, from its fd)",
                    v.start, v.end, v.path
                ),
            ));
        }
    }
    Ok(())
}

/// The mappings of the frozen process `cx` as /proc shows them and as the
/// image holds them (memfds and deleted files as objects unless `live`,
/// shared anonymous memory with its first mapping in the tree), and the
/// object ranges each shared anonymous mapping stores (by its start: what
/// no earlier mapping of the object covers).
#[allow(clippy::type_complexity)]
fn mappings(
    cx: &mut Proc<'_, '_>,
    live: bool,
) -> Result<(Vec<MapEntry>, Vec<Vma>, dump::ShmReads), CheckpointError> {
    let pid = cx.pid;
    let sys = |e| CheckpointError::from_sys(pid, e);
    // Our scratch page is not the process's memory.
    cx.probe.unmap().map_err(sys)?;
    mem_lap(&mut cx.d.stash, "unmap");
    // A capture for --verify compares with smaps read now, frozen.
    let early = cx.d.early.filter(|_| !cx.d.verifying());
    let maps = flags::read_frozen(pid, early, cx.d.stash.get::<Borrowed>()).map_err(sys)?;
    mem_lap(&mut cx.d.stash, "maps");
    // The map_files links read before the freeze, for the lines unchanged.
    let mut vmas = maps
        .iter()
        .map(|m| dump::classify_with(pid, m, early.and_then(|e| e.link(pid, m))))
        .collect::<Result<Vec<_>, _>>()?;
    mem_lap(&mut cx.d.stash, "classify");
    for v in vmas.iter_mut().filter(|v| v.kind == VmaKind::Aio) {
        v.aio = Some(crate::kinds::aio::capture(pid, v)?);
    }
    // Guard regions are pte markers, seen in pagemap only; `gu` marks the
    // mappings that ever had one (Linux 6.18).
    if vmas.iter().any(|v| v.has_flag("gu")) {
        let pagemap = cr_sys::pagemap::Pagemap::open(pid).map_err(sys)?;
        for v in vmas.iter_mut().filter(|v| v.has_flag("gu")) {
            v.guards = pagemap.guards(v.start, v.end).map_err(sys)?;
        }
    }
    if !live {
        // (A private mapping of shared anonymous memory is of that object.)
        for v in vmas
            .iter_mut()
            .filter(|v| v.kind.is_file() && !v.is_shmem())
        {
            v.object = files::mapping_object(cx, v)?;
            v.relink = files::mapping_relink(cx.pid, v)?;
        }
    }
    let owners = cx.d.stash.get::<ShmOwners>();
    let mut reads = dump::ShmReads::new();
    for v in vmas.iter_mut().filter(|v| v.is_shmem()) {
        let me = ShmOwner {
            pid: pid as u32,
            start: v.start,
            end: v.end,
        };
        let (first, covered) = owners
            .0
            .entry((v.dev, v.inode))
            .or_insert_with(|| (me, Vec::new()));
        if *first != me {
            v.shm_owner = Some(*first);
        }
        // The object's pages go with the shared mappings (a private one
        // holds its own copies there).
        if v.shared {
            reads.insert(v.start, uncover(covered, v.pgoff, v.pgoff + v.len()));
        }
    }
    Ok((maps, vmas, reads))
}

/// Copy the pages `plan` says into the store: fills `p.memory`.
pub fn copy_process(
    d: &mut Dump<'_>,
    p: &mut Process,
    plan: ProcessPlan,
) -> Result<(), CheckpointError> {
    d.read += plan.plan.bytes;
    store_process(d, p, plan, None)
}

/// Hash, compare and store the pages of `plan`, read from the process or
/// from its snapshot (taken while it was frozen, in `d.arena`): fills
/// `p.memory`.
fn store_process(
    d: &mut Dump<'_>,
    p: &mut Process,
    plan: ProcessPlan,
    snap: Option<&dump::Snapshot>,
) -> Result<(), CheckpointError> {
    let pid = p.pid as i32;
    drop(plan.dirty);
    let index = d.parent.and_then(|l| l.memory(p.pid)).map(MemIndex::new);
    let kin_mem = d.stash.get::<Kin>().0.remove(&p.ppid);
    let kin = kin_mem.as_ref().map(MemIndex::new);
    let bytes = plan.plan.bytes;
    let what = if snap.is_some() {
        "writing memory"
    } else {
        "copying memory"
    };
    let progress = d.opts.progress.start(what, bytes);
    let arena = d.arena.as_deref();
    let snapshot = snap.zip(arena);
    let mem = dump::copy(
        &dump::Copy {
            pid,
            vmas: &p.vmas,
            parent: index.as_ref(),
            kin: kin.as_ref(),
            store: d.store.ok_or_else(|| {
                CheckpointError::Invalid("a capture for --verify stores no page".into())
            })?,
            workers: d.opts.workers(),
            live: d.opts.pre_dump,
            snapshot,
        },
        plan.plan,
        &|done| progress.set(done),
    )?;
    progress.finish();
    let (dirty, tracking) = (p.memory.dirty, p.memory.tracking);
    p.memory = mem;
    p.memory.dirty = dirty;
    p.memory.tracking = tracking;
    drop(kin);
    let kin = &mut d.stash.get::<Kin>().0;
    if let Some(m) = kin_mem {
        kin.insert(p.ppid, m);
    }
    // Kept for its children, if it has any (a copy of its runs and
    // hashes: 8 bytes a page, for parents only).
    if proc::children(pid).is_ok_and(|c| !c.is_empty()) {
        kin.insert(p.pid, p.memory.clone());
    }
    Ok(())
}

/// The stored memory of the processes that have children in the tree, by
/// PID, for their children's dumps ([`dump::Copy::kin`]).
#[derive(Default)]
struct Kin(HashMap<u32, cr_image::model::Memory>);

/// Processes whose memory was copied out while frozen, to store later.
#[derive(Default)]
struct Snapshots(Vec<(u32, ProcessPlan, dump::Snapshot)>);

/// Whether some process's pages wait in snapshots (see [`store_snapshots`]).
pub fn has_snapshots(d: &mut Dump<'_>) -> bool {
    !d.stash.get::<Snapshots>().0.is_empty()
}

/// Store the pages copied out of the frozen processes, now that they run
/// again: fills the memory of `images`.
pub fn store_snapshots(d: &mut Dump<'_>, images: &mut [Process]) -> Result<(), CheckpointError> {
    let snaps = std::mem::take(&mut d.stash.get::<Snapshots>().0);
    for (pid, plan, snap) in snaps {
        interrupt::check().map_err(CheckpointError::Interrupted)?;
        if let Some(p) = images.iter_mut().find(|p| p.pid == pid) {
            store_process(d, p, plan, Some(&snap))?;
        }
    }
    Ok(())
}

impl Kind for Memory {
    const NAME: &'static str = "memory";

    fn capture(cx: &mut Proc<'_, '_>, p: &mut Process) -> Result<(), CheckpointError> {
        let pid = cx.pid;
        let sys = |e| CheckpointError::from_sys(pid, e);
        // Asked with the rest of the main thread's state (`crate::asked`).
        let brk = cx.main.brk;
        let s = &cx.stat;
        p.mm = Mm {
            start_code: s.startcode,
            end_code: s.endcode,
            start_data: s.start_data.unwrap_or(0),
            end_data: s.end_data.unwrap_or(0),
            start_brk: s.start_brk.unwrap_or(0),
            brk,
            start_stack: s.startstack,
            arg_start: s.arg_start.unwrap_or(0),
            arg_end: s.arg_end.unwrap_or(0),
            env_start: s.env_start.unwrap_or(0),
            env_end: s.env_end.unwrap_or(0),
            auxv: proc::read_bytes(&format!("/proc/{pid}/auxv")).map_err(sys)?,
        };
        if cx.d.verifying() {
            p.vmas = mappings(cx, false)?.1;
            return Ok(());
        }
        *cx.d.stash.get::<MemLaps>() = MemLaps::default();
        let plan = plan_process(cx, p, false)?;
        let bytes = plan.bytes();
        let region =
            cx.d.arena
                .as_deref_mut()
                .and_then(|a| a.take(bytes as usize));
        let Some(region) = region else {
            return copy_process(cx.d, p, plan);
        };
        // Copied out now, hashed and stored once the tree runs again.
        let progress = cx.d.opts.progress.start("copying memory", bytes);
        let arena = cx.d.arena.as_deref_mut().expect("the arena gave a region");
        let snap = dump::snapshot(
            pid,
            &plan.plan,
            arena,
            region,
            cx.d.opts.workers(),
            &|done| progress.set(done),
        )?;
        progress.finish();
        cx.d.read += bytes;
        cx.d.stash.get::<Snapshots>().0.push((p.pid, plan, snap));
        mem_lap(&mut cx.d.stash, "snapshot");
        if let Some(l) = cx.d.stash.take::<MemLaps>() {
            tracing::debug!(pid, laps = %l.0, bytes, "memory captured (µs per step)");
        }
        Ok(())
    }

    /// Map every saved mapping, fill its pages, then its protections.
    /// With `--lazy-pages` only the pages outside private anonymous
    /// mappings are filled now; those inside are served once the process
    /// runs ([`lazy`]).
    fn restore(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
        // Mappings already filled and shared with a relative ([`cow`]).
        let placed = cx.r.stash.get::<cow::Placed>().take(p.pid);
        let t = std::time::Instant::now();
        let filled = fill::map_all(cx, p, &placed)?;
        cx.r.stash.get::<crate::restore::RebuildTimes>().maps += t.elapsed();
        let t = std::time::Instant::now();
        let lazy_ranges: Vec<(u64, u64)> = if cx.r.opts.lazy_pages {
            p.vmas
                .iter()
                .zip(&filled)
                .filter(|(v, f)| **f && lazy::is_lazy(v, &p.mm))
                .map(|(v, _)| (v.start, v.end))
                .collect()
        } else {
            Vec::new()
        };
        let mut in_slots: Vec<(u64, u64)> = placed.iter().map(|s| (s.start, s.end)).collect();
        in_slots.sort();
        let rest = lazy::split(cx.pieces, &in_slots).0;
        let (now, later) = lazy::split(&rest, &lazy_ranges);
        if cx.defer_fill && lazy_ranges.is_empty() {
            // The caller fills these pages on the pool while it rebuilds
            // other processes, then calls [`finish_deferred`].
            cx.fill = Some(Deferred {
                pid: cx.stub.pid(),
                now,
                filled,
            });
            return Ok(());
        }
        // Pages arriving from another node: those needed now first.
        cx.pages.want(&now);
        let progress =
            cx.r.opts
                .progress
                .start("restoring memory", fill::bytes(&now));
        fill::fill(cx.stub.pid(), cx.pages, &now, cx.r.opts.workers(), &|d| {
            progress.set(d)
        })?;
        progress.finish();
        cx.r.stash.get::<crate::restore::RebuildTimes>().pages_now += t.elapsed();
        if !lazy_ranges.is_empty() {
            let t = std::time::Instant::now();
            lazy::start(cx, &lazy_ranges, later)?;
            cx.r.stash.get::<crate::restore::RebuildTimes>().lazy += t.elapsed();
        }
        fill::finish(cx, p, &filled)
    }
}

/// The fill of one process left to the caller of the rebuild
/// ([`Rebuild::defer_fill`]): its mappings are in place, writable where
/// pages go, and nothing else of the rebuild touches them until
/// [`finish_deferred`].
pub struct Deferred {
    /// The stub's PID.
    pub pid: i32,
    /// The pages to write (the memory shared copy-on-write is in already).
    pub now: Vec<cr_image::chain::Piece>,
    /// Which mappings are writable until [`finish_deferred`].
    filled: Vec<bool>,
}

impl Deferred {
    /// Write the pages into the process (any thread may: no ptrace).
    pub fn fill(
        &self,
        pages: &fill::Pages<'_>,
        workers: usize,
        progress: &cr_image::progress::Progress,
    ) -> Result<u64, RestoreError> {
        pages.want(&self.now);
        let bar = progress.start("restoring memory", fill::bytes(&self.now));
        let n = fill::fill(self.pid, pages, &self.now, workers, &|d| bar.set(d))?;
        bar.finish();
        Ok(n)
    }
}

/// The last step of a deferred memory restore, once its pages are in:
/// final protections, madvise flags, locks and names.
pub fn finish_deferred(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    d: Deferred,
) -> Result<(), RestoreError> {
    fill::finish(cx, p, &d.filled)
}

/// Map the stub's scratch area at an address neither the saved mappings
/// nor the stub's own use; returns where the vDSO may be parked (right
/// after it). After the parking room, the page where batches of queued
/// calls run ([`Stub::code`]), mapped read-write-executable when batches
/// are wanted and the stub can run them (see `crate::probe`): not where
/// W^X is enforced, which refuses it.
pub fn map_scratch(
    stub: &mut Stub<'_>,
    saved: &[Vma],
    ours: &[MapEntry],
) -> Result<u64, RestoreError> {
    let mut used: Vec<(u64, u64)> = saved.iter().map(|v| (v.start, v.end)).collect();
    used.extend(ours.iter().map(|m| (m.start, m.end)));
    let cand = free_range(used, SCRATCH + PARK + PAGE_SIZE, PAGE_SIZE).ok_or_else(|| {
        RestoreError::Unsupported("no free address range for the restorer".into())
    })?;
    stub.inj
        .mmap_anon(cand, SCRATCH)
        .step(|| format!("cannot map scratch memory at {cand:#x}"))?;
    stub.scratch = cand;
    let pid = stub.pid();
    if crate::probe::batching_wanted() && cr_sys::remote::trap_free(pid, pid) {
        let at = cand + SCRATCH + PARK;
        let rwx = (libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC) as u64;
        let flags = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE) as u64;
        let r = stub
            .inj
            .syscall_raw(libc::SYS_mmap, [at, PAGE_SIZE, rwx, flags, u64::MAX, 0])?;
        stub.code = (r as u64 == at).then_some(at);
    }
    Ok(cand + SCRATCH)
}

/// The lowest address from 4 GiB up, aligned to `align`, where `len`
/// bytes overlap none of the `used` ranges (None: none below the top of
/// user space).
pub fn free_range(mut used: Vec<(u64, u64)>, len: u64, align: u64) -> Option<u64> {
    used.sort();
    let mut cand: u64 = 1 << 32;
    for (s, e) in used {
        if e <= cand {
            continue;
        }
        if s >= cand + len {
            break;
        }
        cand = e.next_multiple_of(align);
    }
    (cand + len <= TASK_TOP).then_some(cand)
}

/// Unmap everything of the stub (`maps`) except the kernel's special
/// mappings, the scratch area with its parking room and the ranges `kept`
/// (memory shared copy-on-write, see [`cow`]).
pub fn unmap_stub(
    stub: &mut Stub<'_>,
    maps: &[MapEntry],
    kept: &[(u64, u64)],
) -> Result<(), RestoreError> {
    let mut keep: Vec<(u64, u64)> = maps
        .iter()
        .filter(|m| {
            matches!(
                m.path.as_str(),
                "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]"
            )
        })
        .map(|m| (m.start, m.end))
        .collect();
    keep.push((stub.scratch, stub.scratch + SCRATCH + PARK + PAGE_SIZE));
    keep.extend_from_slice(kept);
    keep.sort();
    let mut from = PAGE_SIZE;
    for (s, e) in keep.into_iter().chain([(TASK_TOP, TASK_TOP)]) {
        let s = s.min(TASK_TOP);
        if s > from {
            stub.later(
                "munmap",
                libc::SYS_munmap,
                [from, s - from, 0, 0, 0, 0],
                format!("cannot unmap the stub's memory {from:#x}-{s:#x}"),
            )?;
        }
        from = from.max(e);
    }
    stub.flush()?;
    Ok(())
}

/// PR_SET_MM_MAP: code/data/brk/stack/arg/env bounds, auxv and the exe link.
pub fn set_mm(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let stub = &mut cx.stub;
    let m = &p.mm;
    let exe = &p.task.exe;
    let auxv = stub.put(&m.auxv)?;
    let exe_fd = if exe.ends_with(" (deleted)") {
        None
    } else {
        Some(
            stub.open(exe, libc::O_RDONLY | libc::O_CLOEXEC)
                .step(|| format!("cannot open the executable {exe}"))?,
        )
    };
    let mut map = Vec::with_capacity(104);
    for v in m.bounds().into_iter().chain([auxv]) {
        map.extend_from_slice(&v.to_le_bytes());
    }
    map.extend_from_slice(&(m.auxv.len() as u32).to_le_bytes());
    map.extend_from_slice(&exe_fd.map_or(u32::MAX, |fd| fd as u32).to_le_bytes());
    let addr = stub.put(&map)?;
    let r = stub
        .call(
            "prctl(PR_SET_MM_MAP)",
            libc::SYS_prctl,
            [PR_SET_MM, PR_SET_MM_MAP, addr, map.len() as u64, 0, 0],
        )
        .step(|| format!("cannot set the mm fields (brk {:#x}, exe {exe})", m.brk));
    if let Some(fd) = exe_fd {
        stub.call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    }
    r.map(|_| ())
}

/// VmFlags that say how the kernel holds a mapping now rather than what
/// the program asked for: accountable (`ac`), soft-dirty (`sd`), userfaultfd
/// write-protect (`uw`, a tracker of ours), userfaultfd missing (`um`: a
/// post-copy restore still putting pages in), may have guard regions
/// (`gu`: set by the first MADV_GUARD_INSTALL, kept once they are removed;
/// the guard regions themselves are compared).
const VM_FLAGS_NOT_COMPARED: &[&str] = &["ac", "sd", "uw", "um", "gu"];

/// The VmFlags of `v` that say what the program asked for.
fn compared_flags(v: &Vma) -> Vec<&str> {
    v.vm_flags
        .iter()
        .map(String::as_str)
        .filter(|f| !VM_FLAGS_NOT_COMPARED.contains(f))
        .collect()
}

/// The mappings as a program can tell them apart: neighbours the kernel
/// merges when they are made afresh (same protection, sharing, kind, file
/// and following offset, flags and name) counted as one. A process may hold
/// them split only by their history (memory that belonged to different
/// anon_vmas); a restore maps each, and the kernel merges them.
fn merged(vmas: &[Vma]) -> Vec<Vma> {
    let mut out: Vec<Vma> = Vec::with_capacity(vmas.len());
    for v in vmas {
        if let Some(prev) = out.last_mut() {
            let follows = prev.end == v.start
                && prev.prot == v.prot
                && prev.shared == v.shared
                && prev.kind == v.kind
                && prev.path == v.path
                && prev.dev == v.dev
                && prev.inode == v.inode
                && compared_flags(prev) == compared_flags(v)
                && prev.anon_name == v.anon_name
                && prev.object == v.object
                && prev.shm_owner.is_none()
                && v.shm_owner.is_none()
                && (!v.kind.is_file() || prev.pgoff + prev.len() == v.pgoff);
            if follows {
                prev.end = v.end;
                for &(a, b) in &v.guards {
                    match prev.guards.last_mut() {
                        Some(g) if g.1 == a => g.1 = b,
                        _ => prev.guards.push((a, b)),
                    }
                }
                continue;
            }
        }
        let mut v = v.clone();
        // A System V attach is named after the segment's key, which a
        // restore sets only once the segment is attached; its id (the
        // inode) names it.
        // A packet ring maps a socket made again, under a new inode
        // ("socket:[N]"); the kind says what it is.
        if matches!(v.kind, VmaKind::SysvShm | VmaKind::PacketRing) {
            v.path.clear();
        }
        out.push(v);
    }
    out
}

/// `--verify`: the mm fields, and every mapping with its bounds,
/// protection, sharing, kind, offset, file, flags (VmFlags: locked,
/// advice, growth...) and name.
pub fn verify(c: &mut crate::verify::Compare<'_>, image: &Process, now: &Process) {
    let (a, b) = (&image.mm, &now.mm);
    c.same(
        "mm",
        "(code, data, brk, stack, arg and env bounds)",
        &a.bounds(),
        &b.bounds(),
    );
    c.same("mm", "auxiliary vector", &a.auxv, &b.auxv);
    let (vi, vn) = (merged(&image.vmas), merged(&now.vmas));
    let bounds = |v: &[Vma]| {
        v.iter()
            .map(|m| format!("{:#x}-{:#x} {}", m.start, m.end, m.path))
            .collect::<Vec<_>>()
    };
    if !c.same_list("memory", "mapping", &bounds(&vi), &bounds(&vn)) {
        return;
    }
    for (x, y) in vi.iter().zip(&vn) {
        let what = format!("mapping {:#x}-{:#x} ({})", x.start, x.end, x.path);
        c.same(&what, "protection", &x.prot, &y.prot);
        c.same(&what, "shared", &x.shared, &y.shared);
        c.same(&what, "kind", &x.kind, &y.kind);
        c.same(&what, "file offset", &x.pgoff, &y.pgoff);
        c.same(&what, "path", &x.path, &y.path);
        // (Which file: its path here; that it is the same file, kind
        // "outside" checks before the restore; a job's /dev/shm is a new
        // file system.)
        c.same(&what, "flags", &compared_flags(x), &compared_flags(y));
        c.same(&what, "name", &x.anon_name, &y.anon_name);
        let owner = |o: &Option<ShmOwner>, map: bool| {
            o.map(|o| {
                let pid = if map { c.image_pid(o.pid) } else { o.pid };
                (pid, o.start, o.end)
            })
        };
        let (ox, oy) = (owner(&x.shm_owner, false), owner(&y.shm_owner, true));
        c.same(&what, "shared with", &ox, &oy);
        c.same(&what, "AIO ring", &x.aio, &y.aio);
        c.same(&what, "guard regions", &x.guards, &y.guards);
    }
}
