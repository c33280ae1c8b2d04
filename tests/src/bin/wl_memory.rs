//! wl_memory WORKDIR [SIZE_MIB]
//!
//! Fills about SIZE_MIB (default 64) of memory of every kind with pseudo-random
//! data that can be recomputed (xorshift stream seeded per page from a per-run
//! seed), prints `READY`, waits for `go`, then verifies every page:
//!
//! * brk heap: many 64 KiB mallocs (below the mmap threshold) and a raw sbrk()
//!   region; the program break itself must be unchanged;
//! * anonymous private mmaps: fully written, every other page written (holes read
//!   zero), written then partly MADV_DONTNEED'ed (those pages read zero);
//! * a region between two PROT_NONE guard pages;
//! * a region made read-only after filling;
//! * MAP_SHARED|MAP_ANONYMOUS;
//! * a private file mapping of a temp file, modified in some pages (the others
//!   must still show the file, which must be unchanged on disk), plus a read-only
//!   private mapping of the same file;
//! * a MAP_SHARED file mapping written through memory (memory and file via
//!   pread must agree, and the mapping must still be shared with the file);
//! * a 3 MiB array on the main stack;
//! * never-touched pages, read-only-touched pages, and a sparse 256 MiB
//!   MAP_NORESERVE area: all must read zero (except the few written pages).
//!
//! Mapping permissions/kinds are checked in /proc/self/maps. Prints OK or FAIL.
//!
//! `wl_memory WORKDIR SIZE_MIB EXTRA,...` also checks, for each EXTRA named:
//! `named`: an anonymous region named with PR_SET_VMA_ANON_NAME (`[anon:cr-test-named]` in maps) and a
//! `advised`: a region with MADV_DONTFORK + MADV_DONTDUMP (VmFlags `dc` and `dd`
//! in smaps); `reserve`: a 1 TiB PROT_NONE MAP_NORESERVE address-space
//! reservation with a few chunks made read-write and filled (as language
//! runtimes reserve heaps); `split` / `split4`: a region of 10000 / 4 pages
//! split into as many VMAs by alternating protections (rw-p, r--p, rw-p, ...);
//! `mremap`: a region grown (and moved) with mremap; `thp`: an 8 MiB
//! MADV_HUGEPAGE region; `fileoff`: a private file mapping at a non-zero offset.

use std::ffi::CString;
use std::path::Path;

use cr_tests::wl::{self, PAGE};

const WORDS: usize = PAGE / 8;
const STACK_BYTES: usize = 3 << 20;

/// What a page must hold: the stream of a seed, or zeros.
#[derive(Clone, Copy)]
enum Want {
    Seed(u64),
    Zero,
}

struct Region {
    name: String,
    base: *mut u64,
    pages: usize,
    /// Page index -> expected content.
    want: Box<dyn Fn(usize) -> Want>,
}

struct Ctx {
    seed: u64,
    regions: Vec<Region>,
}

const R_HEAP: u64 = 1;
const R_SBRK: u64 = 2;
const R_ANON1: u64 = 3;
const R_ANON2: u64 = 4;
const R_ANON3: u64 = 5;
const R_GUARD: u64 = 6;
const R_RO: u64 = 7;
const R_SHM: u64 = 8;
const R_FILE: u64 = 9;
const R_FILE_MOD: u64 = 10;
const R_FSHARED: u64 = 11;
const R_STACK: u64 = 12;
const R_SPARSE: u64 = 13;
const R_NAMED: u64 = 14;
const R_ADVISED: u64 = 15;
const R_RESERVED: u64 = 16;
const R_SPLIT: u64 = 17;
const R_MREMAP: u64 = 18;
const R_THP: u64 = 19;

/// VmFlags of the VMA containing `addr`, from /proc/self/smaps.
fn vm_flags(addr: usize) -> Option<Vec<String>> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some((a, b)) = first.split_once('-') {
            if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                inside = a <= addr && addr < b;
                continue;
            }
        }
        if inside {
            if let Some(f) = line.strip_prefix("VmFlags:") {
                return Some(f.split_whitespace().map(str::to_string).collect());
            }
        }
    }
    None
}

/// # Safety
/// `base` must point to `pages * PAGE` bytes of readable memory, 8-byte aligned.
unsafe fn page_slice<'a>(base: *mut u64, page: usize) -> &'a mut [u64] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(base.add(page * WORDS), WORDS) }
}

fn mmap(len: usize, prot: i32, flags: i32, fd: i32, what: &str) -> *mut u64 {
    // SAFETY: a fresh mapping chosen by the kernel (addr NULL).
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        wl::fail(&format!(
            "mmap {what} ({len} bytes): {}",
            std::io::Error::last_os_error()
        ));
    }
    p.cast()
}

fn mprotect(p: *mut u64, len: usize, prot: i32, what: &str) {
    // SAFETY: p..p+len is a mapping we own.
    if unsafe { libc::mprotect(p.cast(), len, prot) } != 0 {
        wl::fail(&format!(
            "mprotect {what}: {}",
            std::io::Error::last_os_error()
        ));
    }
}

impl Ctx {
    fn fill(&self, base: *mut u64, pages: usize, want: &dyn Fn(usize) -> Want) {
        for i in 0..pages {
            if let Want::Seed(s) = want(i) {
                // SAFETY: callers pass mappings of `pages` writable pages.
                fill_seeded(unsafe { page_slice(base, i) }, s);
            }
        }
    }

    /// Registers a region and fills it according to `want`.
    fn add(&mut self, name: &str, base: *mut u64, pages: usize, want: Box<dyn Fn(usize) -> Want>) {
        self.fill(base, pages, &*want);
        self.regions.push(Region {
            name: name.to_string(),
            base,
            pages,
            want,
        });
    }

    fn seeded(&self, id: u64) -> Box<dyn Fn(usize) -> Want> {
        let seed = self.seed;
        Box::new(move |i| Want::Seed(wl::page_seed(seed, id, i as u64)))
    }

    fn verify(&self, problems: &mut Vec<String>) {
        for r in &self.regions {
            let mut bad = 0usize;
            let mut first = None;
            for i in 0..r.pages {
                // SAFETY: every registered region stays mapped and readable.
                let page = unsafe { page_slice(r.base, i) };
                let res = match (r.want)(i) {
                    Want::Seed(s) => wl::check_page(page, s),
                    Want::Zero => page.iter().position(|&w| w != 0),
                };
                if let Some(w) = res {
                    bad += 1;
                    if first.is_none() {
                        first = Some((i, w, page[w]));
                    }
                }
            }
            if let Some((i, w, v)) = first {
                problems.push(format!(
                    "{}: {bad} of {} pages wrong; first: page {i} (addr {:#x}) word {w} = {v:#x}",
                    r.name,
                    r.pages,
                    r.base as usize + i * PAGE
                ));
            }
        }
    }
}

fn fill_seeded(page: &mut [u64], s: u64) {
    wl::fill_page(page, s);
}

fn create_file(path: &Path, pages: usize, content: Option<(u64, u64)>) -> i32 {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).expect("no NUL");
    // SAFETY: valid path string.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
            0o644,
        )
    };
    if fd < 0 {
        wl::fail(&format!(
            "create {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: fd is ours.
    if unsafe { libc::ftruncate(fd, (pages * PAGE) as i64) } != 0 {
        wl::fail("ftruncate");
    }
    if let Some((seed, id)) = content {
        let mut buf = vec![0u64; WORDS];
        for i in 0..pages {
            wl::fill_page(&mut buf, wl::page_seed(seed, id, i as u64));
            // SAFETY: buf holds PAGE bytes.
            let n = unsafe { libc::pwrite(fd, buf.as_ptr().cast(), PAGE, (i * PAGE) as i64) };
            if n != PAGE as isize {
                wl::fail("pwrite file content");
            }
        }
    }
    fd
}

fn chk2(problems: &mut Vec<String>, r: Result<(), String>) {
    if let Err(e) = r {
        problems.push(e);
    }
}

fn pread_page(fd: i32, page: usize, buf: &mut [u64]) -> bool {
    // SAFETY: buf holds PAGE bytes.
    let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), PAGE, (page * PAGE) as i64) };
    n == PAGE as isize
}

fn main() {
    let args = wl::args("wl_memory WORKDIR [SIZE_MIB]");
    let size_mib: usize = args
        .rest
        .first()
        .map(|s| s.parse().unwrap_or_else(|_| wl::fail("bad SIZE_MIB")))
        .unwrap_or(64);
    let extras: Vec<String> = args
        .rest
        .get(1)
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    for e in &extras {
        if ![
            "named", "advised", "reserve", "split", "split4", "mremap", "thp", "fileoff",
        ]
        .contains(&e.as_str())
        {
            wl::fail(&format!("unknown extra {e:?}"));
        }
    }
    // The big stack array lives in this frame for the whole run.
    let mut stack = [0u64; STACK_BYTES / 8];
    run(&args, size_mib, &extras, std::hint::black_box(&mut stack));
}

#[inline(never)]
fn run(args: &wl::Args, size_mib: usize, extras: &[String], stack: &mut [u64; STACK_BYTES / 8]) {
    let extra = |name: &str| extras.iter().any(|e| e == name);
    let state = wl::ProcState::setup(&args.workdir);
    let go = wl::Go::new(&args.workdir);
    let seed = wl::fresh_seed();
    let mut cx = Ctx {
        seed,
        regions: Vec::new(),
    };
    let total = size_mib.max(1) * 256;
    let part = |num: usize, den: usize| (total * num / den).max(1);
    let rw = libc::PROT_READ | libc::PROT_WRITE;
    let anon = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;

    // --- brk heap: 64 KiB mallocs, then a raw sbrk region.
    let chunk_pages = 16;
    let nchunks = part(1, 6).div_ceil(chunk_pages);
    let mut chunks = Vec::with_capacity(nchunks);
    for _ in 0..nchunks {
        // SAFETY: plain malloc; the memory is never freed.
        let p = unsafe { libc::malloc(chunk_pages * PAGE) } as *mut u64;
        if p.is_null() {
            wl::fail("malloc");
        }
        chunks.push(p);
    }
    let sbrk_pages = part(1, 16).min(1024);
    // SAFETY: grows the program break; the region is ours until exit.
    let raw = unsafe { libc::sbrk(((sbrk_pages + 1) * PAGE) as libc::intptr_t) };
    if raw as isize == -1 {
        wl::fail("sbrk");
    }
    let sbrk_base = ((raw as usize).div_ceil(PAGE) * PAGE) as *mut u64;
    let maps = wl::read_maps();
    let in_heap = |p: usize| {
        maps.iter()
            .any(|m| m.path == "[heap]" && m.start <= p && p < m.end)
    };
    let heap_chunks = chunks.iter().filter(|&&p| in_heap(p as usize)).count();
    if heap_chunks * 10 < nchunks * 9 {
        wl::fail(&format!(
            "only {heap_chunks} of {nchunks} mallocs are in [heap]"
        ));
    }
    if !in_heap(sbrk_base as usize) {
        wl::fail("sbrk region is not in [heap]");
    }
    for (k, &p) in chunks.iter().enumerate() {
        let s = seed;
        cx.add(
            &format!("heap malloc chunk {k}"),
            p,
            chunk_pages,
            Box::new(move |i| Want::Seed(wl::page_seed(s, R_HEAP, (k * chunk_pages + i) as u64))),
        );
    }
    let w = cx.seeded(R_SBRK);
    cx.add("sbrk region", sbrk_base, sbrk_pages, w);

    // --- anonymous private mappings.
    let a1 = part(1, 5);
    let p1 = mmap(a1 * PAGE, rw, anon, -1, "anon1");
    let w = cx.seeded(R_ANON1);
    cx.add("anon private (full)", p1, a1, w);

    let a2 = part(1, 10);
    let p2 = mmap(a2 * PAGE, rw, anon, -1, "anon2");
    let s = seed;
    cx.add(
        "anon private (every other page)",
        p2,
        a2,
        Box::new(move |i| {
            if i.is_multiple_of(2) {
                Want::Seed(wl::page_seed(s, R_ANON2, i as u64))
            } else {
                Want::Zero
            }
        }),
    );

    let a3 = part(1, 10);
    let p3 = mmap(a3 * PAGE, rw, anon, -1, "anon3");
    let w = cx.seeded(R_ANON3);
    cx.fill(p3, a3, &*w);
    for i in (0..a3).step_by(8) {
        // SAFETY: page i of our own mapping.
        unsafe { libc::madvise(p3.add(i * WORDS).cast(), PAGE, libc::MADV_DONTNEED) };
    }
    cx.regions.push(Region {
        name: "anon private (filled, every 8th page MADV_DONTNEED)".into(),
        base: p3,
        pages: a3,
        want: Box::new(move |i| {
            if i.is_multiple_of(8) {
                Want::Zero
            } else {
                Want::Seed(wl::page_seed(s, R_ANON3, i as u64))
            }
        }),
    });

    // --- guarded region: [PROT_NONE][data][PROT_NONE].
    let g = part(1, 20);
    let pg = mmap((g + 2) * PAGE, rw, anon, -1, "guarded");
    // SAFETY: stays inside the mapping of g + 2 pages.
    let (g_lo, g_data, g_hi) = unsafe { (pg, pg.add(WORDS), pg.add((g + 1) * WORDS)) };
    let w = cx.seeded(R_GUARD);
    cx.add("guarded region", g_data, g, w);
    mprotect(g_lo, PAGE, libc::PROT_NONE, "low guard");
    mprotect(g_hi, PAGE, libc::PROT_NONE, "high guard");

    // --- read-only after filling.
    let ro = part(1, 12);
    let pro = mmap(ro * PAGE, rw, anon, -1, "read-only");
    let w = cx.seeded(R_RO);
    cx.add("read-only region", pro, ro, w);
    mprotect(pro, ro * PAGE, libc::PROT_READ, "read-only");

    // --- shared anonymous.
    let shm = part(1, 10);
    let pshm = mmap(
        shm * PAGE,
        rw,
        libc::MAP_SHARED | libc::MAP_ANONYMOUS,
        -1,
        "shared anon",
    );
    let w = cx.seeded(R_SHM);
    cx.add("shared anonymous", pshm, shm, w);

    // --- private file mapping, modified in every 5th page; and a read-only view.
    let fp = part(1, 20);
    let fpriv_path = args.workdir.join("private-map.bin");
    let fd_priv = create_file(&fpriv_path, fp, Some((seed, R_FILE)));
    let pfp = mmap(fp * PAGE, rw, libc::MAP_PRIVATE, fd_priv, "private file");
    let pfro = mmap(
        fp * PAGE,
        libc::PROT_READ,
        libc::MAP_PRIVATE,
        fd_priv,
        "private file ro",
    );
    // SAFETY: closing our fd; the mappings stay.
    unsafe { libc::close(fd_priv) };
    let modw = move |i: usize| {
        if i.is_multiple_of(5) {
            Want::Seed(wl::page_seed(s, R_FILE_MOD, i as u64))
        } else {
            Want::Seed(wl::page_seed(s, R_FILE, i as u64))
        }
    };
    for i in (0..fp).step_by(5) {
        if let Want::Seed(x) = modw(i) {
            // SAFETY: page i of the private file mapping (writable).
            wl::fill_page(unsafe { page_slice(pfp, i) }, x);
        }
    }
    // Touch (read) the other pages too, so they are faulted in from the file.
    let mut sink = 0u64;
    for i in 0..fp {
        // SAFETY: page i of the mapping.
        sink ^= unsafe { *pfp.add(i * WORDS) };
    }
    std::hint::black_box(sink);
    cx.regions.push(Region {
        name: "private file mapping (every 5th page modified)".into(),
        base: pfp,
        pages: fp,
        want: Box::new(modw),
    });
    cx.regions.push(Region {
        name: "read-only private file mapping".into(),
        base: pfro,
        pages: fp,
        want: Box::new(move |i| Want::Seed(wl::page_seed(s, R_FILE, i as u64))),
    });

    // --- shared file mapping written through memory.
    let fs = part(1, 20);
    let fshared_path = args.workdir.join("shared-map.bin");
    let fd_shared = create_file(&fshared_path, fs, None);
    let pfs = mmap(fs * PAGE, rw, libc::MAP_SHARED, fd_shared, "shared file");
    // SAFETY: closing our fd; the mapping stays.
    unsafe { libc::close(fd_shared) };
    let w = cx.seeded(R_FSHARED);
    cx.add("shared file mapping", pfs, fs, w);

    // --- the stack array.
    let stack_pages = STACK_BYTES / PAGE;
    let pst = stack.as_mut_ptr();
    let w = cx.seeded(R_STACK);
    cx.add("stack array", pst, stack_pages, w);

    // --- zero pages: never touched; touched by reads only; sparse NORESERVE.
    let untouched = 2048;
    let pun = mmap(untouched * PAGE, rw, anon, -1, "untouched");
    let readonly_touched = 256;
    let prt = mmap(readonly_touched * PAGE, rw, anon, -1, "read-touched");
    for i in 0..readonly_touched {
        // SAFETY: reading page i of our mapping (maps the zero page).
        sink ^= unsafe { std::ptr::read_volatile(prt.add(i * WORDS)) };
    }
    std::hint::black_box(sink);
    let sparse_pages = 65536; // 256 MiB
    let psp = mmap(
        sparse_pages * PAGE,
        rw,
        anon | libc::MAP_NORESERVE,
        -1,
        "sparse",
    );
    let sparse_written: Vec<usize> = (0..16).map(|k| k * 4099 % sparse_pages).collect();
    for &i in &sparse_written {
        // SAFETY: page i of the sparse mapping.
        wl::fill_page(
            unsafe { page_slice(psp, i) },
            wl::page_seed(seed, R_SPARSE, i as u64),
        );
    }

    // Pages to check in the sparse area: the written ones and 64 others.
    let sparse_checked: Vec<usize> = sparse_written
        .iter()
        .copied()
        .chain((0..64).map(|k| (k * 1021 + 7) % sparse_pages))
        .collect();

    // --- extras: a named anonymous region, a region with madvise flags.
    let mut named: Option<*mut u64> = None;
    let mut advised: Option<*mut u64> = None;
    let mut reserved_chunks: Vec<*mut u64> = Vec::new();
    let mut reservation: Option<(*mut u64, usize)> = None;
    let mut split: Option<(*mut u64, usize)> = None;
    if extra("named") {
        let p = mmap(16 * PAGE, rw, anon, -1, "named");
        let w = cx.seeded(R_NAMED);
        cx.add("named anonymous region", p, 16, w);
        let name = c"cr-test-named";
        // SAFETY: prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME) on our own mapping.
        let r = unsafe { libc::prctl(0x5356_4d41, 0, p as usize, 16 * PAGE, name.as_ptr()) };
        if r == 0 {
            named = Some(p);
        } else {
            // Kernels without CONFIG_ANON_VMA_NAME: nothing to check.
            wl::note(&format!(
                "PR_SET_VMA_ANON_NAME not available ({}), name not checked",
                std::io::Error::last_os_error()
            ));
        }
    }
    if extra("advised") {
        let q = mmap(16 * PAGE, rw, anon, -1, "advised");
        let w = cx.seeded(R_ADVISED);
        cx.add("madvised region", q, 16, w);
        // SAFETY: madvise on our own mapping.
        unsafe {
            libc::madvise(q.cast(), 16 * PAGE, libc::MADV_DONTFORK);
            libc::madvise(q.cast(), 16 * PAGE, libc::MADV_DONTDUMP);
        }
        let f = vm_flags(q as usize).unwrap_or_default();
        if !f.iter().any(|x| x == "dc") || !f.iter().any(|x| x == "dd") {
            wl::fail(&format!("madvise did not set dc/dd: {f:?}"));
        }
        advised = Some(q);
    }
    if extra("reserve") {
        // 1 TiB PROT_NONE reservation with 4 read-write chunks of 16 pages.
        let res_len = 1usize << 40;
        let base = mmap(
            res_len,
            libc::PROT_NONE,
            anon | libc::MAP_NORESERVE,
            -1,
            "1 TiB reservation",
        );
        for k in 0..4usize {
            // SAFETY: inside the reservation.
            let chunk = unsafe { base.add(k * (res_len / 4 / 8) + 12_345 * WORDS) };
            mprotect(chunk, 16 * PAGE, rw, "reservation chunk");
            let s2 = seed;
            cx.add(
                &format!("chunk {k} of the 1 TiB reservation"),
                chunk,
                16,
                Box::new(move |i| Want::Seed(wl::page_seed(s2, R_RESERVED, (k * 16 + i) as u64))),
            );
            reserved_chunks.push(chunk);
        }
        reservation = Some((base, res_len));
    }
    for (name, n) in [("split", 10_000usize), ("split4", 4)] {
        if !extra(name) {
            continue;
        }
        // n pages in one mapping, every other one then made read-only: n VMAs.
        let p = mmap(n * PAGE, rw, anon, -1, "split region");
        let w = cx.seeded(R_SPLIT);
        cx.add(&format!("region split into {n} VMAs"), p, n, w);
        for i in (1..n).step_by(2) {
            // SAFETY: page i of the mapping.
            mprotect(
                unsafe { p.add(i * WORDS) },
                PAGE,
                libc::PROT_READ,
                "split page",
            );
        }
        split = Some((p, n));
    }
    let mut thp: Option<*mut u64> = None;
    let mut fileoff: Option<(*mut u64, usize)> = None;
    if extra("mremap") {
        // 64 pages filled, grown to 128 with mremap (may move), then filled up.
        let p = mmap(64 * PAGE, rw, anon, -1, "to be remapped");
        let w = cx.seeded(R_MREMAP);
        cx.fill(p, 64, &*w);
        // A neighbour right behind it, so that growing has to move the mapping.
        // SAFETY: a hint address only (no MAP_FIXED).
        let blocker = unsafe { libc::mmap(p.add(64 * WORDS).cast(), PAGE, rw, anon, -1, 0) };
        // SAFETY: remapping our own mapping.
        let q = unsafe { libc::mremap(p.cast(), 64 * PAGE, 128 * PAGE, libc::MREMAP_MAYMOVE) };
        if q == libc::MAP_FAILED {
            wl::fail(&format!("mremap: {}", std::io::Error::last_os_error()));
        }
        let q = q as *mut u64;
        wl::note(&format!(
            "mremap moved {p:p} -> {q:p} (blocker {blocker:p})"
        ));
        let s3 = seed;
        let want: Box<dyn Fn(usize) -> Want> =
            Box::new(move |i| Want::Seed(wl::page_seed(s3, R_MREMAP, i as u64)));
        for i in 64..128 {
            if let Want::Seed(x) = want(i) {
                // SAFETY: page i of the grown mapping.
                wl::fill_page(unsafe { page_slice(q, i) }, x);
            }
        }
        cx.regions.push(Region {
            name: "mremap-grown region".into(),
            base: q,
            pages: 128,
            want,
        });
    }
    if extra("thp") {
        // 8 MiB, 2 MiB aligned, MADV_HUGEPAGE, filled.
        let raw = mmap(10 << 20, rw, anon, -1, "thp");
        let p = ((raw as usize).div_ceil(2 << 20) * (2 << 20)) as *mut u64;
        // SAFETY: madvise inside our mapping.
        unsafe { libc::madvise(p.cast(), 8 << 20, libc::MADV_HUGEPAGE) };
        let w = cx.seeded(R_THP);
        cx.add("MADV_HUGEPAGE region", p, (8 << 20) / PAGE, w);
        thp = Some(p);
    }
    if extra("fileoff") {
        // Read-only private mapping of the private-map file from page 3 on.
        let c = CString::new(fpriv_path.as_os_str().as_encoded_bytes()).expect("no NUL");
        // SAFETY: valid path.
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        let n = fp.saturating_sub(3).max(1);
        // SAFETY: a fresh mapping of our file at offset 3 pages.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                n * PAGE,
                libc::PROT_READ,
                libc::MAP_PRIVATE,
                fd,
                (3 * PAGE) as i64,
            )
        };
        if p == libc::MAP_FAILED || fp < 4 {
            wl::fail("mmap of the file at an offset");
        }
        // SAFETY: closing our fd.
        unsafe { libc::close(fd) };
        let p = p as *mut u64;
        let s4 = seed;
        cx.regions.push(Region {
            name: "private file mapping at offset 3 pages".into(),
            base: p,
            pages: n,
            want: Box::new(move |i| Want::Seed(wl::page_seed(s4, R_FILE, (i + 3) as u64))),
        });
        fileoff = Some((p, n));
    }

    // Make sure the shared file mapping reached the page cache of the file.
    // SAFETY: msync on our mapping.
    unsafe { libc::msync(pfs.cast(), fs * PAGE, libc::MS_SYNC) };

    let filled_mib = cx.regions.iter().map(|r| r.pages).sum::<usize>() / 256;
    wl::note(&format!(
        "seed {seed:#x}, {filled_mib} MiB in {} regions",
        cx.regions.len()
    ));

    // SAFETY: sbrk(0) only queries the break.
    let brk_ready = unsafe { libc::sbrk(0) } as usize;
    wl::say("READY");
    go.wait();
    // SAFETY: sbrk(0) only queries the break.
    let brk_now = unsafe { libc::sbrk(0) } as usize;

    let mut problems = Vec::new();
    if brk_now != brk_ready {
        problems.push(format!("program break is {brk_now:#x}, was {brk_ready:#x}"));
    }
    cx.verify(&mut problems);

    // Zero regions.
    let zero_check = |name: &str,
                      base: *mut u64,
                      pages: &mut dyn Iterator<Item = usize>,
                      problems: &mut Vec<String>| {
        for i in pages {
            // SAFETY: page i of a mapping we own.
            let page = unsafe { page_slice(base, i) };
            if let Some(w) = page.iter().position(|&x| x != 0) {
                problems.push(format!(
                    "{name}: page {i} word {w} = {:#x}, expected 0",
                    page[w]
                ));
                return;
            }
        }
    };
    zero_check("untouched mapping", pun, &mut (0..untouched), &mut problems);
    zero_check(
        "read-touched mapping",
        prt,
        &mut (0..readonly_touched),
        &mut problems,
    );
    for &i in &sparse_checked {
        // SAFETY: page i of the sparse mapping.
        let page = unsafe { page_slice(psp, i) };
        let res = if sparse_written.contains(&i) {
            wl::check_page(page, wl::page_seed(seed, R_SPARSE, i as u64))
        } else {
            page.iter().position(|&x| x != 0)
        };
        if let Some(w) = res {
            problems.push(format!(
                "sparse NORESERVE area: page {i} word {w} = {:#x}",
                page[w]
            ));
            break;
        }
    }

    // Files on disk.
    let mut buf = vec![0u64; WORDS];
    match std::fs::File::open(&fpriv_path) {
        Err(e) => problems.push(format!("open {}: {e}", fpriv_path.display())),
        Ok(f) => {
            use std::os::fd::AsRawFd;
            for i in 0..fp {
                if !pread_page(f.as_raw_fd(), i, &mut buf)
                    || wl::check_page(&buf, wl::page_seed(seed, R_FILE, i as u64)).is_some()
                {
                    problems.push(format!("private-map.bin changed on disk at page {i}"));
                    break;
                }
            }
        }
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&fshared_path)
    {
        Err(e) => problems.push(format!("open {}: {e}", fshared_path.display())),
        Ok(f) => {
            use std::os::fd::AsRawFd;
            let fd = f.as_raw_fd();
            for i in 0..fs {
                if !pread_page(fd, i, &mut buf)
                    || wl::check_page(&buf, wl::page_seed(seed, R_FSHARED, i as u64)).is_some()
                {
                    problems.push(format!(
                        "shared-map.bin on disk differs from memory at page {i}"
                    ));
                    break;
                }
            }
            // Still shared? memory -> file, then file -> memory; put both back.
            let last = fs - 1;
            // SAFETY: page `last` of the shared file mapping.
            let mem = unsafe { page_slice(pfs, last) };
            let saved = mem[0];
            mem[0] = 0x5151_5151_5151_5151;
            pread_page(fd, last, &mut buf);
            if buf[0] != 0x5151_5151_5151_5151 {
                problems
                    .push("shared file mapping: a store to memory does not reach the file".into());
            }
            mem[0] = saved;
            let marker = 0x7272_7272_7272_7272u64.to_ne_bytes();
            // SAFETY: 8 valid bytes.
            unsafe { libc::pwrite(fd, marker.as_ptr().cast(), 8, (last * PAGE + 8) as i64) };
            // SAFETY: page `last` of the mapping.
            let seen = unsafe { std::ptr::read_volatile(pfs.add(last * WORDS + 1)) };
            if seen != 0x7272_7272_7272_7272 {
                problems.push(
                    "shared file mapping: a write to the file does not show in memory".into(),
                );
            }
            let want = wl::page_seed(seed, R_FSHARED, last as u64);
            let mut tmp = vec![0u64; WORDS];
            wl::fill_page(&mut tmp, want);
            // SAFETY: page `last` of the mapping.
            unsafe { std::ptr::write_volatile(pfs.add(last * WORDS + 1), tmp[1]) };
        }
    }

    // Mapping kinds and permissions.
    let maps = wl::read_maps();
    let mut chk = |r: Result<(), String>| {
        if let Err(e) = r {
            problems.push(e);
        }
    };
    chk(wl::check_mapping(
        &maps,
        "low guard page",
        g_lo as usize,
        PAGE,
        "---p",
        None,
    ));
    chk(wl::check_mapping(
        &maps,
        "high guard page",
        g_hi as usize,
        PAGE,
        "---p",
        None,
    ));
    chk(wl::check_mapping(
        &maps,
        "guarded region",
        g_data as usize,
        g * PAGE,
        "rw-p",
        None,
    ));
    chk(wl::check_mapping(
        &maps,
        "read-only region",
        pro as usize,
        ro * PAGE,
        "r--p",
        None,
    ));
    chk(wl::check_mapping(
        &maps,
        "shared anonymous",
        pshm as usize,
        shm * PAGE,
        "rw-s",
        None,
    ));
    chk(wl::check_mapping(
        &maps,
        "private file mapping",
        pfp as usize,
        fp * PAGE,
        "rw-p",
        Some(&fpriv_path),
    ));
    chk(wl::check_mapping(
        &maps,
        "read-only private file mapping",
        pfro as usize,
        fp * PAGE,
        "r--p",
        Some(&fpriv_path),
    ));
    chk(wl::check_mapping(
        &maps,
        "shared file mapping",
        pfs as usize,
        fs * PAGE,
        "rw-s",
        Some(&fshared_path),
    ));
    chk(wl::check_mapping(
        &maps,
        "sparse area",
        psp as usize,
        sparse_pages * PAGE,
        "rw-p",
        None,
    ));
    let in_named = |p: usize, name: &str| {
        maps.iter()
            .any(|m| m.path == name && m.start <= p && p < m.end)
    };
    if !in_named(sbrk_base as usize, "[heap]") {
        problems.push(format!("sbrk region {sbrk_base:p} is not in [heap]"));
    }
    if !in_named(pst as usize, "[stack]") {
        problems.push(format!("stack array {pst:p} is not in [stack]"));
    }

    if let Some(p) = named {
        match maps
            .iter()
            .find(|m| m.start <= p as usize && (p as usize) < m.end)
        {
            Some(m) if m.path == "[anon:cr-test-named]" => {}
            Some(m) => problems.push(format!("named region {p:p} is shown as {:?}", m.path)),
            None => problems.push(format!("named region {p:p} is not mapped")),
        }
    }
    if let Some((base, len)) = reservation {
        // Everything but the chunks is still PROT_NONE.
        let mut at = base as usize;
        for &c in &reserved_chunks {
            chk2(
                &mut problems,
                wl::check_mapping(&maps, "reservation", at, c as usize - at, "---p", None),
            );
            chk2(
                &mut problems,
                wl::check_mapping(
                    &maps,
                    "reservation chunk",
                    c as usize,
                    16 * PAGE,
                    "rw-p",
                    None,
                ),
            );
            at = c as usize + 16 * PAGE;
        }
        chk2(
            &mut problems,
            wl::check_mapping(
                &maps,
                "reservation",
                at,
                base as usize + len - at,
                "---p",
                None,
            ),
        );
    }
    if let Some((p, n)) = split {
        for i in 0..n {
            let perms = if i % 2 == 1 { "r--p" } else { "rw-p" };
            if let Err(e) = wl::check_mapping(
                &maps,
                "split region",
                p as usize + i * PAGE,
                PAGE,
                perms,
                None,
            ) {
                problems.push(e);
                break;
            }
        }
    }
    if let Some(p) = thp {
        let f = vm_flags(p as usize).unwrap_or_default();
        if !f.iter().any(|x| x == "hg") {
            problems.push(format!("MADV_HUGEPAGE region {p:p} lost VmFlag hg: {f:?}"));
        }
    }
    if let Some((p, n)) = fileoff {
        chk2(
            &mut problems,
            wl::check_mapping(
                &maps,
                "file mapping at offset",
                p as usize,
                n * PAGE,
                "r--p",
                Some(&fpriv_path),
            ),
        );
    }
    if let Some(q) = advised {
        let f = vm_flags(q as usize).unwrap_or_default();
        for flag in ["dc", "dd"] {
            if !f.iter().any(|x| x == flag) {
                problems.push(format!("madvised region {q:p} lost VmFlag {flag}: {f:?}"));
            }
        }
    }
    state.verify(&mut problems);
    wl::finish(&problems);
}
