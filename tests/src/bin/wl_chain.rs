//! wl_chain WORKDIR [--rounds N] [--mib M] [--seed S] [--self-test]
//!
//! A process that changes its memory in rounds, to be checkpointed after each
//! round into a chain of incremental images, and that verifies all of its
//! memory after a restore.
//!
//! Protocol:
//! * sets up about M MiB (default 32) of memory of several kinds and forks a
//!   child, prints `READY 0`;
//! * polls (nanosleep, 3 ms) for `WORKDIR/round-R` with R = the next round
//!   (1..=N, default N = 4); when it appears, performs all mutations of round R
//!   and prints `READY R`; after `READY N` it only waits for `verify`;
//! * whenever `WORKDIR/verify` exists (checked first in the same loop), it
//!   verifies all its memory against its model, has its live child verify its
//!   own copy, and prints `OK` (exit 0) or `FAIL: ...` (exit 1). The child never
//!   prints READY or OK; it may print `FAIL: child ...` before exiting 1.
//! * `--self-test`: runs all rounds without waiting for files (verifying its
//!   model after every round), then verifies as above and prints `OK`.
//!
//! Memory: anonymous private regions, a brk heap, a MAP_PRIVATE mapping of a
//! file created in WORKDIR (some pages COW-written), and a MAP_SHARED anonymous
//! region shared with the child. Its page 0 is a control page (child handshake
//! and the version table of the shared pages); the others are data.
//!
//! Every page starts with (magic, region id, page index, version) and the rest
//! is an xorshift stream derived from them; version 0 means "must read as
//! zero". The model (which page of which region holds which version) lives in
//! the process's own memory. Region ids and page indices are logical: they
//! follow the pages when a region is moved or split.
//!
//! Each round R (parent; pages written get version R + 1):
//! 1. writes random pages (5-10 %) of every anonymous region and of the heap,
//!    a few pages of the file mapping, 10 % of the shared pages; then the
//!    previous round's child checks all of its memory (including the shared
//!    pages just written by the parent, which proves the mapping is shared)
//!    and exits; the parent reaps it and fails if it did not exit 0;
//! 2. maps a new anonymous region (60 % of its pages written); unmaps a whole
//!    older region (even rounds) or a hole in the middle of the largest one
//!    (odd rounds, splitting it in two);
//! 3. moves a region with mremap(MREMAP_MAYMOVE|MREMAP_FIXED) into a free spot
//!    and grows it in place there (mremap without MAYMOVE), and grows another
//!    one with MREMAP_MAYMOVE (the kernel decides whether it moves);
//! 4. makes a read-only region read-write again and writes to it (VMA merge),
//!    and makes a middle part of another region read-only (VMA split);
//! 5. grows the heap with sbrk and writes the new part (odd rounds), or shrinks
//!    it with brk (even rounds);
//! 6. MADV_DONTNEEDs a few written pages (anonymous and heap pages then read
//!    zero; a file page reads the file's content again);
//! 7. forks the child of this round: it writes a few pages of its own copy
//!    (version 0xC00000 + R + 1) and keeps polling for `verify` (or the
//!    parent's verify flag in the control page), or for the parent's request
//!    to check itself and exit (next round). It dies with its parent
//!    (PR_SET_PDEATHSIG SIGKILL).
//!
//! At verify, the parent also writes a token into the control page which the
//! child must answer through the same shared page.

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

use cr_tests::wl::{self, PAGE};

// ---------------------------------------------------------------------------
// Allocator: a bump allocator in its own mapping, so that nothing but this
// program's explicit sbrk/brk calls ever moves the program break (glibc's
// malloc would grow the heap with brk, and shrinking it would cut its memory).
// ---------------------------------------------------------------------------

struct Bump;

static ARENA_NEXT: AtomicUsize = AtomicUsize::new(0);
static ARENA_END: AtomicUsize = AtomicUsize::new(0);
const ARENA_BYTES: usize = 256 << 20;

// SAFETY: alloc returns blocks that are aligned, sized as asked and disjoint
// (a bump pointer in a private mapping that is never unmapped); the program is
// single-threaded (a forked child has its own copy of the allocator's state).
unsafe impl GlobalAlloc for Bump {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let mut next = ARENA_NEXT.load(Ordering::Relaxed);
        if next == 0 {
            // SAFETY: a fresh mapping chosen by the kernel.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    ARENA_BYTES,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return std::ptr::null_mut();
            }
            next = p as usize;
            ARENA_END.store(next + ARENA_BYTES, Ordering::Relaxed);
        }
        let start = (next + l.align() - 1) & !(l.align() - 1);
        let end = start + l.size();
        if end > ARENA_END.load(Ordering::Relaxed) {
            return std::ptr::null_mut();
        }
        ARENA_NEXT.store(end, Ordering::Relaxed);
        start as *mut u8
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // Only the last block is given back.
        if p as usize + l.size() == ARENA_NEXT.load(Ordering::Relaxed) {
            ARENA_NEXT.store(p as usize, Ordering::Relaxed);
        }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
        let next = ARENA_NEXT.load(Ordering::Relaxed);
        if p as usize + l.size() == next
            && p as usize + new_size <= ARENA_END.load(Ordering::Relaxed)
        {
            // The last block grows or shrinks in place.
            ARENA_NEXT.store(p as usize + new_size, Ordering::Relaxed);
            return p;
        }
        // SAFETY: the caller guarantees a valid, non-zero size for the alignment.
        let np = unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, l.align())) };
        if !np.is_null() {
            // SAFETY: both blocks are valid for the copied length and disjoint.
            unsafe { std::ptr::copy_nonoverlapping(p, np, l.size().min(new_size)) };
        }
        np
    }
}

#[global_allocator]
static GLOBAL: Bump = Bump;

// ---------------------------------------------------------------------------
// Pages
// ---------------------------------------------------------------------------

const WORDS: usize = PAGE / 8;
const MAGIC: u64 = 0x6368_6169_6e70_6731; // "chainpg1"
/// Version of a file-mapping page that shows the file's own content.
const V_FILE: u32 = 0x00F1_1E00;
/// Versions written by the child of a round: V_CHILD + generation.
const V_CHILD: u32 = 0x00C0_0000;
const ACK_XOR: u64 = 0x0ac0_ac0a_c0ac_0ac0;
const MAX_SHM: usize = 960;

/// # Safety
/// `addr` must be the start of a mapped, readable page (writable if written to).
unsafe fn page<'a>(addr: usize) -> &'a mut [u64] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(addr as *mut u64, WORDS) }
}

fn stream_seed(seed: u64, id: u32, idx: u32, ver: u32) -> u64 {
    wl::page_seed(
        seed ^ wl::mix64(u64::from(ver) ^ 0x7665_7273),
        u64::from(id),
        u64::from(idx),
    )
}

fn fill(p: &mut [u64], seed: u64, id: u32, idx: u32, ver: u32) {
    p[0] = MAGIC;
    p[1] = u64::from(id);
    p[2] = u64::from(idx);
    p[3] = u64::from(ver);
    wl::fill_page(&mut p[4..], stream_seed(seed, id, idx, ver));
}

/// None if `p` holds what (id, idx, ver) says, else what is wrong.
fn check(p: &[u64], seed: u64, id: u32, idx: u32, ver: u32) -> Option<String> {
    if ver == 0 {
        let w = p.iter().position(|&x| x != 0)?;
        return Some(format!(
            "expected a zero page, found word {w} = {:#x} (header: id {}, page {}, version {:#x})",
            p[w], p[1], p[2], p[3]
        ));
    }
    if p[0] != MAGIC || p[1] != u64::from(id) || p[2] != u64::from(idx) || p[3] != u64::from(ver) {
        if p.iter().all(|&x| x == 0) {
            return Some(format!("expected version {ver:#x}, found a zero page"));
        }
        return Some(format!(
            "expected (id {id}, page {idx}, version {ver:#x}), found (id {}, page {}, version {:#x}){}",
            p[1],
            p[2],
            p[3],
            if p[0] != MAGIC { " and a bad magic" } else { "" }
        ));
    }
    wl::check_page(&p[4..], stream_seed(seed, id, idx, ver))
        .map(|w| format!("header ok (version {ver:#x}) but word {} differs", w + 4))
}

// ---------------------------------------------------------------------------
// Small system helpers
// ---------------------------------------------------------------------------

fn errno() -> std::io::Error {
    std::io::Error::last_os_error()
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).expect("path without NUL")
}

fn mmap_anon(pages: usize, prot: i32, flags: i32, what: &str) -> usize {
    // SAFETY: a fresh mapping chosen by the kernel (addr NULL).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE,
            prot,
            libc::MAP_ANONYMOUS | flags,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        wl::fail(&format!("mmap {what} ({pages} pages): {}", errno()));
    }
    p as usize
}

fn mprotect(addr: usize, pages: usize, prot: i32, what: &str) {
    // SAFETY: the range lies in mappings of this program that hold no Rust objects.
    if unsafe { libc::mprotect(addr as *mut libc::c_void, pages * PAGE, prot) } != 0 {
        wl::fail(&format!("mprotect {what} at {addr:#x}: {}", errno()));
    }
}

fn munmap(addr: usize, pages: usize, what: &str) {
    // SAFETY: the range lies in mappings of this program that hold no Rust objects.
    if unsafe { libc::munmap(addr as *mut libc::c_void, pages * PAGE) } != 0 {
        wl::fail(&format!("munmap {what} at {addr:#x}: {}", errno()));
    }
}

fn sbrk_now() -> usize {
    // SAFETY: sbrk(0) only queries the program break.
    unsafe { libc::sbrk(0) as usize }
}

fn getpid() -> i32 {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() }
}

fn getppid() -> i32 {
    // SAFETY: getppid has no preconditions.
    unsafe { libc::getppid() }
}

fn child_exit(code: i32) -> ! {
    // SAFETY: _exit ends the (forked, single-threaded) process at once.
    unsafe { libc::_exit(code) }
}

/// A waitpid(WNOHANG) result: Some(raw status) once `pid` has exited.
fn try_reap(pid: i32) -> Result<Option<i32>, String> {
    let mut st = 0;
    // SAFETY: st is a valid int; WNOHANG never blocks.
    let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
    match r {
        0 => Ok(None),
        r if r == pid => Ok(Some(st)),
        _ => Err(format!("waitpid({pid}): {}", errno())),
    }
}

fn status_text(st: i32) -> String {
    if libc::WIFEXITED(st) {
        format!("exit {}", libc::WEXITSTATUS(st))
    } else if libc::WIFSIGNALED(st) {
        format!("signal {}", libc::WTERMSIG(st))
    } else {
        format!("status {st:#x}")
    }
}

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(wl::mix64(seed) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

// ---------------------------------------------------------------------------
// Model
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Anon,
    Heap,
    File,
    Shared,
}

struct Region {
    id: u32,
    kind: Kind,
    base: usize,
    /// Logical index of page 0 (a region split by a hole keeps its id).
    idx0: u32,
    /// Version of every page (0: zero page).
    ver: Vec<u32>,
    /// Read-only pages.
    ro: Vec<bool>,
    /// Round in which it was created.
    born: u32,
}

impl Region {
    fn len(&self) -> usize {
        self.ver.len()
    }
    fn addr(&self, i: usize) -> usize {
        self.base + i * PAGE
    }
    fn all_rw(&self) -> bool {
        !self.ro.iter().any(|&r| r)
    }
}

/// The control page at the start of the shared region.
#[repr(C)]
struct Ctl {
    magic: AtomicU64,
    /// The parent asks the child of generation <= exit_gen to check itself and exit.
    exit_gen: AtomicU64,
    /// The child of generation g stores g once its own writes are done.
    child_ready: AtomicU64,
    /// Set by the parent when it verifies (the child verifies too).
    verify: AtomicU64,
    token: AtomicU64,
    ack: AtomicU64,
    nver: AtomicU64,
    /// Versions of the shared data pages.
    vers: [AtomicU32; MAX_SHM],
}

const _: () = assert!(std::mem::size_of::<Ctl>() <= PAGE);

struct St {
    workdir: PathBuf,
    seed: u64,
    rng: Rng,
    /// Page budget (MiB * 256).
    t: usize,
    regions: Vec<Region>,
    next_id: u32,
    /// Expected program break (end of the heap region).
    heap_end: usize,
    file_path: PathBuf,
    ctl: &'static Ctl,
    pid: i32,
    /// The live child: (pid, generation).
    child: Option<(i32, u64)>,
    /// Set in a child: its generation.
    child_gen: Option<u64>,
    parent_pid: i32,
    started: u64,
    /// Pages written in the current round (for the log).
    written: usize,
}

impl St {
    fn new_id(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id
    }

    fn region_idx(&self, kind: Kind) -> usize {
        self.regions
            .iter()
            .position(|r| r.kind == kind)
            .expect("region kind present")
    }

    /// Writes page `i` of region `ri` with version `v`.
    fn write(&mut self, ri: usize, i: usize, v: u32) {
        let seed = self.seed;
        let r = &mut self.regions[ri];
        assert!(!r.ro[i], "write to a read-only page");
        // SAFETY: page i of a mapped, writable region of the model.
        fill(unsafe { page(r.addr(i)) }, seed, r.id, r.idx0 + i as u32, v);
        r.ver[i] = v;
        if r.kind == Kind::Shared {
            self.ctl.vers[i].store(v, Ordering::SeqCst);
        }
        self.written += 1;
    }

    /// Writes about `pct` percent of the pages of region `ri` (at least one),
    /// chosen at random, skipping read-only ones.
    fn write_random(&mut self, ri: usize, pct: usize, v: u32) {
        let n = self.regions[ri].len();
        let k = (n * pct / 100).max(1);
        for _ in 0..k {
            let i = self.rng.below(n);
            if !self.regions[ri].ro[i] {
                self.write(ri, i, v);
            }
        }
    }

    /// Adds a region of `pages` pages at `base`, all zero.
    fn add_region(&mut self, kind: Kind, base: usize, pages: usize, born: u32) -> usize {
        let id = self.new_id();
        self.regions.push(Region {
            id,
            kind,
            base,
            idx0: 0,
            ver: vec![0; pages],
            ro: vec![false; pages],
            born,
        });
        self.regions.len() - 1
    }

    fn timed_out(&self) -> bool {
        wl::mono_ns().saturating_sub(self.started) > wl::SELF_TIMEOUT.as_nanos() as u64
    }

    // --- setup -----------------------------------------------------------

    fn setup(&mut self) {
        let t = self.t;
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let v = 1;

        // Anonymous regions: full, every other page, full with a read-only
        // middle, 3/4 random.
        for (k, pages) in [t / 4, t / 6, t / 8, t / 12].into_iter().enumerate() {
            let pages = pages.max(8);
            let base = mmap_anon(pages, rw, libc::MAP_PRIVATE, "anonymous region");
            let ri = self.add_region(Kind::Anon, base, pages, 0);
            for i in 0..pages {
                let w = match k {
                    1 => i % 2 == 0,
                    3 => self.rng.below(4) != 0,
                    _ => true,
                };
                if w {
                    self.write(ri, i, v);
                }
            }
            if k == 2 {
                let (a, n) = (pages / 4, pages / 4);
                mprotect(base + a * PAGE, n, libc::PROT_READ, "setup read-only part");
                self.regions[ri].ro[a..a + n].fill(true);
            }
        }

        // The heap: a page-aligned part of the brk area, all written.
        let hp = (t / 16).max(4);
        let cur = sbrk_now();
        let base = cur.div_ceil(PAGE) * PAGE;
        // SAFETY: grows the program break; the area is only used through the model.
        let r = unsafe { libc::sbrk((base - cur + hp * PAGE) as libc::intptr_t) };
        if r as isize == -1 {
            wl::fail(&format!("sbrk: {}", errno()));
        }
        self.heap_end = base + hp * PAGE;
        let ri = self.add_region(Kind::Heap, base, hp, 0);
        for i in 0..hp {
            self.write(ri, i, v);
        }

        // The file and its private mapping (every 8th page COW-written).
        let fp = (t / 16).max(4);
        let id = self.new_id();
        let path = self.workdir.join("chain-file.bin");
        let c = cpath(&path);
        // SAFETY: a valid path string.
        let fd = unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
                0o644,
            )
        };
        if fd < 0 {
            wl::fail(&format!("create {}: {}", path.display(), errno()));
        }
        let mut buf = vec![0u64; WORDS];
        for i in 0..fp {
            fill(&mut buf, self.seed, id, i as u32, V_FILE);
            // SAFETY: buf holds PAGE bytes.
            let n = unsafe { libc::pwrite(fd, buf.as_ptr().cast(), PAGE, (i * PAGE) as i64) };
            if n != PAGE as isize {
                wl::fail(&format!("write {}: {}", path.display(), errno()));
            }
        }
        // SAFETY: a fresh private mapping of our file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                fp * PAGE,
                rw,
                libc::MAP_PRIVATE,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            wl::fail(&format!("mmap {}: {}", path.display(), errno()));
        }
        // SAFETY: closing our fd; the mapping stays.
        unsafe { libc::close(fd) };
        self.file_path = std::fs::canonicalize(&path).unwrap_or(path);
        self.regions.push(Region {
            id,
            kind: Kind::File,
            base: p as usize,
            idx0: 0,
            ver: vec![V_FILE; fp],
            ro: vec![false; fp],
            born: 0,
        });
        let ri = self.regions.len() - 1;
        let mut sink = 0u64;
        for i in 0..fp {
            if i % 8 == 0 {
                self.write(ri, i, v);
            } else {
                // Fault the page in from the file.
                // SAFETY: page i of the mapping.
                sink ^= unsafe { std::ptr::read_volatile(self.regions[ri].addr(i) as *const u64) };
            }
        }
        std::hint::black_box(sink);

        // The shared region's data pages (page 0, the control page, is set up
        // in main), all written.
        let ri = self.region_idx(Kind::Shared);
        for i in 0..self.regions[ri].len() {
            self.write(ri, i, v);
        }
    }

    // --- rounds ----------------------------------------------------------

    fn round(&mut self, r: u32) {
        let v = r + 1;
        self.written = 0;

        // 1. Shared pages first: the previous child checks them before it exits.
        let si = self.region_idx(Kind::Shared);
        self.write_random(si, 10, v);
        self.retire_child();

        for ri in 0..self.regions.len() {
            let pct = 5 + self.rng.below(6);
            match self.regions[ri].kind {
                Kind::Anon | Kind::Heap => self.write_random(ri, pct, v),
                Kind::File => self.write_random(ri, 3, v),
                Kind::Shared => {}
            }
        }

        // 2. A new region; an old one (or a hole in one) unmapped.
        self.new_region(r, v);
        self.unmap_some(r);

        // 3. mremap.
        self.remap(v);

        // 4. mprotect.
        self.protect(v);

        // 5. heap.
        self.heap(r, v);

        // 6. MADV_DONTNEED.
        self.dontneed();

        // 7. The child of this round.
        self.fork_child(u64::from(r) + 1);

        let live: usize = self.regions.iter().map(|x| x.len()).sum();
        wl::note(&format!(
            "round {r}: wrote {} pages; {} regions, {live} pages",
            self.written,
            self.regions.len()
        ));
    }

    fn new_region(&mut self, r: u32, v: u32) {
        let n = (self.t / 32).max(4);
        let base = mmap_anon(
            n,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE,
            "new region",
        );
        let ri = self.add_region(Kind::Anon, base, n, r);
        for i in 0..n {
            if self.rng.below(10) < 6 {
                self.write(ri, i, v);
            }
        }
    }

    fn unmap_some(&mut self, r: u32) {
        if r.is_multiple_of(2) {
            // The oldest region created by an earlier round.
            let old = self
                .regions
                .iter()
                .enumerate()
                .filter(|(_, x)| x.kind == Kind::Anon && x.born >= 1 && x.born < r)
                .min_by_key(|(_, x)| (x.born, x.id))
                .map(|(i, _)| i);
            if let Some(i) = old {
                let reg = self.regions.remove(i);
                munmap(reg.base, reg.len(), "old region");
                return;
            }
        }
        // A hole in the middle of the largest region.
        let Some(i) = self
            .regions
            .iter()
            .enumerate()
            .filter(|(_, x)| x.kind == Kind::Anon && x.len() >= 16)
            .max_by_key(|(_, x)| x.len())
            .map(|(i, _)| i)
        else {
            return;
        };
        let n = self.regions[i].len();
        let h = (n / 8).max(1);
        let a = n / 2 - h / 2;
        munmap(self.regions[i].addr(a), h, "hole");
        let reg = &mut self.regions[i];
        let right = Region {
            id: reg.id,
            kind: Kind::Anon,
            base: reg.addr(a + h),
            idx0: reg.idx0 + (a + h) as u32,
            ver: reg.ver[a + h..].to_vec(),
            ro: reg.ro[a + h..].to_vec(),
            born: reg.born,
        };
        reg.ver.truncate(a);
        reg.ro.truncate(a);
        self.regions.insert(i + 1, right);
    }

    /// Anonymous regions that can be mremap'ed: read-write, at least 4 pages,
    /// inside one VMA. Smallest first.
    fn remap_candidates(&self) -> Vec<usize> {
        let maps = wl::read_maps();
        let mut c: Vec<usize> = (0..self.regions.len())
            .filter(|&i| {
                let r = &self.regions[i];
                r.kind == Kind::Anon
                    && r.len() >= 4
                    && r.all_rw()
                    && maps
                        .iter()
                        .any(|m| m.start <= r.base && r.base + r.len() * PAGE <= m.end)
            })
            .collect();
        c.sort_by_key(|&i| (self.regions[i].len(), self.regions[i].id));
        c
    }

    fn grow_model(&mut self, ri: usize, base: usize, g: usize, v: u32) {
        let reg = &mut self.regions[ri];
        let n = reg.len();
        reg.base = base;
        reg.ver.resize(n + g, 0);
        reg.ro.resize(n + g, false);
        for i in n..n + g {
            if (i - n).is_multiple_of(2) {
                self.write(ri, i, v);
            }
        }
    }

    fn remap(&mut self, v: u32) {
        let cand = self.remap_candidates();
        if cand.is_empty() {
            wl::note("no region to mremap this round");
            return;
        }
        let cap = (self.t / 64).max(1);
        // Move one of the 3 smallest into a free spot, then grow it in place.
        let x = cand[self.rng.below(cand.len().min(3))];
        let n = self.regions[x].len();
        let g = (n / 4).clamp(1, cap);
        let spot = mmap_anon(
            n + g,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
            "free spot",
        );
        let old = self.regions[x].base;
        // SAFETY: moves a mapping of the model onto our own reservation.
        let q = unsafe {
            libc::mremap(
                old as *mut libc::c_void,
                n * PAGE,
                n * PAGE,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                spot as *mut libc::c_void,
            )
        };
        if q as usize != spot {
            wl::fail(&format!(
                "mremap FIXED {old:#x} ({n} pages) -> {spot:#x}: {:?} {}",
                q,
                errno()
            ));
        }
        self.regions[x].base = spot;
        munmap(spot + n * PAGE, g, "tail of the free spot");
        // SAFETY: grows the mapping in place (no MAYMOVE) into the hole just made.
        let q = unsafe { libc::mremap(spot as *mut libc::c_void, n * PAGE, (n + g) * PAGE, 0) };
        if q as usize != spot {
            wl::fail(&format!(
                "mremap grow in place at {spot:#x} ({n} -> {} pages): {}",
                n + g,
                errno()
            ));
        }
        self.grow_model(x, spot, g, v);

        // Grow another one, moving it if the kernel wants to.
        let Some(&y) = cand.iter().find(|&&i| i != x) else {
            return;
        };
        let n = self.regions[y].len();
        let g = (n / 4).clamp(1, cap);
        let old = self.regions[y].base;
        // SAFETY: grows (maybe moves) a mapping of the model.
        let q = unsafe {
            libc::mremap(
                old as *mut libc::c_void,
                n * PAGE,
                (n + g) * PAGE,
                libc::MREMAP_MAYMOVE,
            )
        };
        if q == libc::MAP_FAILED {
            wl::fail(&format!("mremap MAYMOVE {old:#x}: {}", errno()));
        }
        self.grow_model(y, q as usize, g, v);
    }

    fn protect(&mut self, v: u32) {
        // A read-only run back to read-write, and written.
        let with_ro: Vec<usize> = (0..self.regions.len())
            .filter(|&i| !self.regions[i].all_rw())
            .collect();
        let mut restored = None;
        if !with_ro.is_empty() {
            let ri = with_ro[self.rng.below(with_ro.len())];
            let reg = &self.regions[ri];
            let a = reg.ro.iter().position(|&x| x).expect("has ro pages");
            let b = a + reg.ro[a..].iter().take_while(|&&x| x).count();
            mprotect(
                reg.addr(a),
                b - a,
                libc::PROT_READ | libc::PROT_WRITE,
                "back to read-write",
            );
            self.regions[ri].ro[a..b].fill(false);
            for i in (a..b).step_by(2) {
                self.write(ri, i, v);
            }
            restored = Some(ri);
        }
        // A middle part of another region read-only.
        let cand: Vec<usize> = (0..self.regions.len())
            .filter(|&i| {
                let r = &self.regions[i];
                r.kind == Kind::Anon && r.len() >= 8 && r.all_rw() && Some(i) != restored
            })
            .collect();
        if cand.is_empty() {
            return;
        }
        let ri = cand[self.rng.below(cand.len())];
        let n = self.regions[ri].len();
        let k = (n / 8).max(1);
        let a = 1 + self.rng.below(n - k - 1);
        mprotect(
            self.regions[ri].addr(a),
            k,
            libc::PROT_READ,
            "read-only part",
        );
        self.regions[ri].ro[a..a + k].fill(true);
    }

    fn heap(&mut self, r: u32, v: u32) {
        let hi = self.region_idx(Kind::Heap);
        let now = sbrk_now();
        if now != self.heap_end {
            wl::fail(&format!(
                "the program break moved behind our back: {now:#x}, expected {:#x}",
                self.heap_end
            ));
        }
        if r % 2 == 1 {
            let g = (self.t / 64).max(1);
            // SAFETY: grows the program break; the area is only used through the model.
            let p = unsafe { libc::sbrk((g * PAGE) as libc::intptr_t) };
            if p as usize != self.heap_end {
                wl::fail(&format!("sbrk +{g} pages: {}", errno()));
            }
            self.heap_end += g * PAGE;
            let n = self.regions[hi].len();
            self.regions[hi].ver.resize(n + g, 0);
            self.regions[hi].ro.resize(n + g, false);
            for i in n..n + g {
                if self.rng.below(4) != 0 {
                    self.write(hi, i, v);
                }
            }
        } else {
            let n = self.regions[hi].len();
            let s = (self.t / 128).max(1).min(n - 1);
            let end = self.heap_end - s * PAGE;
            // SAFETY: shrinks the program break; the pages beyond belong to the
            // model only, which forgets them.
            if unsafe { libc::brk(end as *mut libc::c_void) } != 0 {
                wl::fail(&format!("brk shrink to {end:#x}: {}", errno()));
            }
            self.heap_end = end;
            self.regions[hi].ver.truncate(n - s);
            self.regions[hi].ro.truncate(n - s);
        }
    }

    /// MADV_DONTNEEDs up to `count` written pages of regions of `kind`.
    fn dontneed_some(&mut self, kind: Kind, count: usize) {
        let idx: Vec<usize> = (0..self.regions.len())
            .filter(|&i| self.regions[i].kind == kind)
            .collect();
        if idx.is_empty() {
            return;
        }
        let (mut done, mut tries) = (0, 0);
        while done < count && tries < 200 {
            tries += 1;
            let ri = idx[self.rng.below(idx.len())];
            let i = self.rng.below(self.regions[ri].len());
            let reg = &mut self.regions[ri];
            let back = if kind == Kind::File { V_FILE } else { 0 };
            if reg.ver[i] == back {
                continue;
            }
            // SAFETY: one page of a private mapping of the model.
            if unsafe { libc::madvise(reg.addr(i) as *mut libc::c_void, PAGE, libc::MADV_DONTNEED) }
                != 0
            {
                wl::fail(&format!("madvise DONTNEED {:#x}: {}", reg.addr(i), errno()));
            }
            reg.ver[i] = back;
            done += 1;
        }
    }

    fn dontneed(&mut self) {
        self.dontneed_some(Kind::Anon, 8);
        self.dontneed_some(Kind::Heap, 2);
        self.dontneed_some(Kind::File, 1);
    }

    // --- the child -------------------------------------------------------

    /// Asks the live child to check itself and exit; reaps it.
    fn retire_child(&mut self) {
        let Some((pid, gen)) = self.child.take() else {
            return;
        };
        self.ctl.exit_gen.store(gen, Ordering::SeqCst);
        match self.wait_child(pid) {
            Ok(st) if libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0 => {}
            Ok(st) => wl::fail(&format!(
                "child {pid} (generation {gen}) failed its check on exit: {}",
                status_text(st)
            )),
            Err(e) => wl::fail(&e),
        }
    }

    /// Waits (polling, at most 60 s) for the child to exit.
    fn wait_child(&self, pid: i32) -> Result<i32, String> {
        let t0 = wl::mono_ns();
        loop {
            if let Some(st) = try_reap(pid)? {
                return Ok(st);
            }
            if wl::mono_ns() - t0 > 60_000_000_000 {
                // SAFETY: kill(2) of our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let _ = self.wait_child_killed(pid);
                return Err(format!("child {pid} did not exit within 60 s"));
            }
            wl::sleep_ms(2);
        }
    }

    fn wait_child_killed(&self, pid: i32) -> Option<i32> {
        let mut st = 0;
        // SAFETY: st is a valid int; the child was just SIGKILLed.
        let r = unsafe { libc::waitpid(pid, &mut st, 0) };
        (r == pid).then_some(st)
    }

    fn fork_child(&mut self, gen: u64) {
        // SAFETY: the program is single-threaded; the child continues with its
        // own copy of everything and ends with _exit.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            wl::fail(&format!("fork: {}", errno()));
        }
        if pid == 0 {
            self.child_main(gen);
        }
        self.child = Some((pid, gen));
        let t0 = wl::mono_ns();
        while self.ctl.child_ready.load(Ordering::SeqCst) != gen {
            if let Ok(Some(st)) = try_reap(pid) {
                self.child = None;
                wl::fail(&format!(
                    "child {pid} (generation {gen}) exited before it was ready: {}",
                    status_text(st)
                ));
            }
            if wl::mono_ns() - t0 > 60_000_000_000 {
                wl::fail(&format!("child {pid} (generation {gen}) never got ready"));
            }
            wl::sleep_ms(1);
        }
    }

    fn child_main(&mut self, gen: u64) -> ! {
        // SAFETY: prctl with integer arguments.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) };
        if getppid() != self.pid {
            child_exit(1);
        }
        self.parent_pid = self.pid;
        self.pid = getpid();
        self.child = None;
        self.child_gen = Some(gen);
        self.rng = Rng::new(self.seed ^ gen.wrapping_mul(0xc41d_c41d));
        let v = V_CHILD + gen as u32;
        // A few pages of its own copy.
        let anon: Vec<usize> = (0..self.regions.len())
            .filter(|&i| self.regions[i].kind == Kind::Anon)
            .collect();
        for _ in 0..16 {
            let ri = anon[self.rng.below(anon.len())];
            let i = self.rng.below(self.regions[ri].len());
            if !self.regions[ri].ro[i] {
                self.write(ri, i, v);
            }
        }
        let hi = self.region_idx(Kind::Heap);
        for _ in 0..2 {
            let i = self.rng.below(self.regions[hi].len());
            self.write(hi, i, v);
        }
        let fi = self.region_idx(Kind::File);
        let i = self.rng.below(self.regions[fi].len());
        self.write(fi, i, v);
        self.dontneed_some(Kind::Anon, 1);
        self.ctl.child_ready.store(gen, Ordering::SeqCst);

        let verify = cpath(&self.workdir.join("verify"));
        loop {
            if wl::exists(&verify) || self.ctl.verify.load(Ordering::SeqCst) != 0 {
                self.child_check_and_exit(true);
            }
            if self.ctl.exit_gen.load(Ordering::SeqCst) >= gen {
                self.child_check_and_exit(false);
            }
            if getppid() != self.parent_pid || self.timed_out() {
                child_exit(1);
            }
            wl::sleep_ms(3);
        }
    }

    fn child_check_and_exit(&mut self, answer: bool) -> ! {
        let gen = self.child_gen.unwrap_or(0);
        // The shared pages hold what the parent's table says.
        let si = self.region_idx(Kind::Shared);
        for i in 0..self.regions[si].len() {
            self.regions[si].ver[i] = self.ctl.vers[i].load(Ordering::SeqCst);
        }
        let problems = self.check_all();
        if answer {
            let t0 = wl::mono_ns();
            loop {
                let t = self.ctl.token.load(Ordering::SeqCst);
                if t != 0 {
                    self.ctl.ack.store(t ^ ACK_XOR, Ordering::SeqCst);
                    break;
                }
                if wl::mono_ns() - t0 > 30_000_000_000 {
                    wl::say(&format!(
                        "FAIL: child {} (generation {gen}): no token from the parent in the shared page",
                        self.pid
                    ));
                    child_exit(1);
                }
                wl::sleep_ms(1);
            }
        }
        if problems.is_empty() {
            child_exit(0);
        }
        for p in problems.iter().skip(1).take(19) {
            wl::note(&format!("child also: {p}"));
        }
        wl::say(&format!(
            "FAIL: child {} (generation {gen}): {}{}",
            self.pid,
            problems[0],
            if problems.len() > 1 {
                format!(" (+{} more problems, see stderr)", problems.len() - 1)
            } else {
                String::new()
            }
        ));
        child_exit(1)
    }

    // --- verification ----------------------------------------------------

    /// Checks every page of the model, the mappings' permissions, the program
    /// break, the shared version table and the file on disk.
    fn check_all(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let who = if self.child_gen.is_some() {
            "child"
        } else {
            "parent"
        };
        if getpid() != self.pid {
            problems.push(format!("{who}: pid is {}, was {}", getpid(), self.pid));
        }
        for r in &self.regions {
            let mut bad = 0;
            let mut first = None;
            for i in 0..r.len() {
                // SAFETY: every page of the model is mapped and readable.
                let p = unsafe { page(r.addr(i)) };
                if let Some(what) = check(p, self.seed, r.id, r.idx0 + i as u32, r.ver[i]) {
                    bad += 1;
                    first.get_or_insert((i, what));
                }
            }
            if let Some((i, what)) = first {
                problems.push(format!(
                    "{who}: region {} ({:?}, {} pages at {:#x}): {bad} pages wrong; first: page {} at {:#x}: {what}",
                    r.id,
                    r.kind,
                    r.len(),
                    r.base,
                    r.idx0 as usize + i,
                    r.addr(i)
                ));
            }
        }

        // Mappings.
        let maps = wl::read_maps();
        for r in &self.regions {
            let path = (r.kind == Kind::File).then_some(self.file_path.as_path());
            let mut i = 0;
            while i < r.len() {
                let ro = r.ro[i];
                let j = i + r.ro[i..].iter().take_while(|&&x| x == ro).count();
                let perms = match (r.kind, ro) {
                    (Kind::Shared, _) => "rw-s",
                    (_, true) => "r--p",
                    (_, false) => "rw-p",
                };
                if let Err(e) = wl::check_mapping(
                    &maps,
                    &format!("{who}: region {} ({:?})", r.id, r.kind),
                    r.addr(i),
                    (j - i) * PAGE,
                    perms,
                    path,
                ) {
                    problems.push(e);
                }
                i = j;
            }
        }
        let hr = &self.regions[self.region_idx(Kind::Heap)];
        if !maps
            .iter()
            .any(|m| m.path == "[heap]" && m.start <= hr.base && hr.base < m.end)
        {
            problems.push(format!(
                "{who}: the heap region {:#x} is not in [heap]",
                hr.base
            ));
        }
        let brk = sbrk_now();
        if brk != self.heap_end {
            problems.push(format!(
                "{who}: program break is {brk:#x}, expected {:#x}",
                self.heap_end
            ));
        }
        if let Some(m) = maps
            .iter()
            .find(|m| m.start <= self.heap_end && self.heap_end < m.end)
        {
            problems.push(format!(
                "{who}: the page after the program break {:#x} is mapped ({:#x}-{:#x} {} {})",
                self.heap_end, m.start, m.end, m.perms, m.path
            ));
        }

        // The parent's shared version table (the child takes it as its model).
        if self.child_gen.is_none() {
            let sr = &self.regions[self.region_idx(Kind::Shared)];
            if self.ctl.magic.load(Ordering::SeqCst) != MAGIC
                || self.ctl.nver.load(Ordering::SeqCst) != sr.len() as u64
            {
                problems.push(format!("{who}: the shared control page is damaged"));
            }
            if let Some(i) =
                (0..sr.len()).find(|&i| self.ctl.vers[i].load(Ordering::SeqCst) != sr.ver[i])
            {
                problems.push(format!(
                    "{who}: shared version table says page {i} is version {:#x}, the model {:#x}",
                    self.ctl.vers[i].load(Ordering::SeqCst),
                    sr.ver[i]
                ));
            }
        }

        // The file on disk is unchanged.
        let fr = &self.regions[self.region_idx(Kind::File)];
        match std::fs::File::open(&self.file_path) {
            Err(e) => problems.push(format!("{who}: open {}: {e}", self.file_path.display())),
            Ok(f) => {
                use std::os::fd::AsRawFd;
                let mut buf = vec![0u64; WORDS];
                for i in 0..fr.len() {
                    // SAFETY: buf holds PAGE bytes.
                    let n = unsafe {
                        libc::pread(
                            f.as_raw_fd(),
                            buf.as_mut_ptr().cast(),
                            PAGE,
                            (i * PAGE) as i64,
                        )
                    };
                    let bad = if n != PAGE as isize {
                        Some(format!("short read ({n})"))
                    } else {
                        check(&buf, self.seed, fr.id, i as u32, V_FILE)
                    };
                    if let Some(what) = bad {
                        problems.push(format!(
                            "{who}: {} changed on disk at page {i}: {what}",
                            self.file_path.display()
                        ));
                        break;
                    }
                }
            }
        }
        problems
    }

    /// The parent's verification: itself, and the live child (which must also
    /// answer a token through the shared page). Prints OK or FAIL and exits.
    fn parent_verify(&mut self) -> ! {
        let token = wl::mix64(wl::mono_ns() ^ 0x70_6b6e) | 1;
        self.ctl.token.store(token, Ordering::SeqCst);
        self.ctl.verify.store(1, Ordering::SeqCst);
        let mut problems = self.check_all();
        if let Some((pid, gen)) = self.child.take() {
            let t0 = wl::mono_ns();
            let mut status = None;
            while self.ctl.ack.load(Ordering::SeqCst) != token ^ ACK_XOR {
                match try_reap(pid) {
                    Ok(Some(st)) => {
                        status = Some(st);
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        problems.push(e);
                        break;
                    }
                }
                if wl::mono_ns() - t0 > 30_000_000_000 {
                    break;
                }
                wl::sleep_ms(1);
            }
            if self.ctl.ack.load(Ordering::SeqCst) != token ^ ACK_XOR {
                problems.push(format!(
                    "child {pid} (generation {gen}) did not answer the token through the shared page"
                ));
            }
            let st = match status {
                Some(st) => Ok(st),
                None => self.wait_child(pid),
            };
            match st {
                Ok(st) if libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0 => {}
                Ok(st) => problems.push(format!(
                    "child {pid} (generation {gen}) failed its check: {}",
                    status_text(st)
                )),
                Err(e) => problems.push(e),
            }
        } else {
            problems.push("no live child to verify".into());
        }
        wl::finish(&problems)
    }
}

fn usage() -> ! {
    wl::fail("usage: wl_chain WORKDIR [--rounds N] [--mib M] [--seed S] [--self-test]")
}

fn main() {
    let args = wl::args("wl_chain WORKDIR [--rounds N] [--mib M] [--seed S] [--self-test]");
    let (mut rounds, mut mib, mut seed, mut self_test) = (4u32, 32usize, 0x5eed_c4a1_u64, false);
    let mut it = args.rest.iter();
    while let Some(a) = it.next() {
        let mut num = |what: &str| -> u64 {
            it.next()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| wl::fail(&format!("{what} needs a number")))
        };
        match a.as_str() {
            "--rounds" => rounds = num("--rounds") as u32,
            "--mib" => mib = num("--mib") as usize,
            "--seed" => seed = num("--seed"),
            "--self-test" => self_test = true,
            _ => usage(),
        }
    }
    if mib == 0 || mib > 4096 {
        wl::fail("--mib must be 1..=4096");
    }
    if let Err(e) = std::fs::create_dir_all(&args.workdir) {
        wl::fail(&format!("mkdir {}: {e}", args.workdir.display()));
    }
    let t = mib * 256;

    // The shared region: a control page and the data pages.
    let shm = (t / 32).clamp(8, MAX_SHM);
    let shm_base = mmap_anon(
        shm + 1,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED,
        "shared region",
    );
    // SAFETY: page 0 of the shared mapping, zeroed, big enough for Ctl (checked
    // at compile time), never unmapped; only accessed through atomics.
    let ctl: &'static Ctl = unsafe { &*(shm_base as *const Ctl) };
    ctl.magic.store(MAGIC, Ordering::SeqCst);
    ctl.nver.store(shm as u64, Ordering::SeqCst);

    let mut st = St {
        workdir: args.workdir.clone(),
        seed,
        rng: Rng::new(seed),
        t,
        regions: Vec::new(),
        next_id: 0,
        heap_end: 0,
        file_path: PathBuf::new(),
        ctl,
        pid: getpid(),
        child: None,
        child_gen: None,
        parent_pid: getppid(),
        started: wl::mono_ns(),
        written: 0,
    };
    st.add_region(Kind::Shared, shm_base + PAGE, shm, 0);
    st.setup();
    st.fork_child(1);
    let live: usize = st.regions.iter().map(|x| x.len()).sum();
    wl::note(&format!(
        "setup: {} regions, {live} pages, seed {seed:#x}",
        st.regions.len()
    ));
    wl::say("READY 0");

    if self_test {
        for r in 1..=rounds {
            st.round(r);
            wl::say(&format!("READY {r}"));
            let problems = st.check_all();
            if !problems.is_empty() {
                wl::finish(&problems);
            }
        }
        st.parent_verify();
    }

    let verify = cpath(&args.workdir.join("verify"));
    let mut r = 0u32;
    let mut next = cpath(&args.workdir.join("round-1"));
    loop {
        if wl::exists(&verify) {
            st.parent_verify();
        }
        if r < rounds && wl::exists(&next) {
            r += 1;
            st.round(r);
            wl::say(&format!("READY {r}"));
            next = cpath(&args.workdir.join(format!("round-{}", r + 1)));
            continue;
        }
        if st.timed_out() {
            wl::fail("timed out waiting for the verify file");
        }
        wl::sleep_ms(3);
    }
}
