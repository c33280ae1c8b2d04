//! wl_vmflags WORKDIR [new]
//!
//! VmFlags changed without changing a mapping's line in /proc/PID/maps.
//! Maps three anonymous regions A, B, C of 64 pages, each between PROT_NONE
//! guard pages (so each stays its own VMA), fills them, prints `READY`,
//! then waits for WORKDIR/change. There it advises each whole region (A:
//! MADV_DONTDUMP -> `dd`, B: MADV_WIPEONFORK -> `wf`, C: MADV_HUGEPAGE ->
//! `hg`, or MADV_RANDOM -> `rr` on a kernel without transparent huge
//! pages), rewrites half of A, with `new` maps and fills a new region D
//! (without it no line of maps changes at all), checks that
//! the lines of A, B, C in /proc/self/maps did not change and that smaps
//! shows the flags, and prints `CHANGED`. On `go` it checks every page of
//! A-D and the VmFlags of A-C from /proc/self/smaps, and prints OK or FAIL.

use cr_tests::wl::{self, PAGE};

const PAGES: usize = 64;
const WORDS: usize = PAGE / 8;

struct Region {
    name: &'static str,
    base: *mut u64,
    /// The seed of each page's content.
    seeds: Vec<u64>,
}

impl Region {
    fn page(&self, i: usize) -> &[u64] {
        // SAFETY: `base` maps PAGES read-write pages for the whole run.
        unsafe { std::slice::from_raw_parts(self.base.add(i * WORDS), WORDS) }
    }

    fn fill(&mut self, i: usize, s: u64) {
        self.seeds[i] = s;
        // SAFETY: as in `page`; `&mut self`: no other view of it now.
        let page = unsafe { std::slice::from_raw_parts_mut(self.base.add(i * WORDS), WORDS) };
        wl::fill_page(page, s);
    }

    fn check(&self, problems: &mut Vec<String>) {
        for (i, &s) in self.seeds.iter().enumerate() {
            if let Some(w) = wl::check_page(self.page(i), s) {
                problems.push(format!("{}: page {i} word {w} differs", self.name));
            }
        }
    }

    fn addr(&self) -> usize {
        self.base as usize
    }
}

/// A read-write region of PAGES pages with a PROT_NONE page on each side.
fn guarded(name: &'static str) -> Region {
    let len = (PAGES + 2) * PAGE;
    // SAFETY: a fresh private anonymous mapping, ours until exit.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        wl::fail(&format!("mmap {name}: {}", wl::errno_str()));
    }
    let base = (p as usize + PAGE) as *mut libc::c_void;
    // SAFETY: the middle of the mapping just made.
    wl::check(
        unsafe { libc::mprotect(base, PAGES * PAGE, libc::PROT_READ | libc::PROT_WRITE) },
        "mprotect",
    );
    Region {
        name,
        base: base as *mut u64,
        seeds: vec![0; PAGES],
    }
}

/// The VmFlags of the mapping that starts at `addr` (/proc/self/smaps).
fn vm_flags(addr: usize) -> Option<Vec<String>> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut inside = false;
    for line in text.lines() {
        let head = line.split(' ').next().unwrap_or("");
        // A mapping's header: "START-END perms offset dev inode [path]".
        if let Some((a, b)) = head.split_once('-') {
            if let (Ok(start), Ok(_)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = start == addr;
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

/// The line of /proc/self/maps of the mapping at `addr`.
fn line(addr: usize) -> Option<String> {
    wl::read_maps()
        .into_iter()
        .find(|m| m.start == addr)
        .map(|m| format!("{:x}-{:x} {} {}", m.start, m.end, m.perms, m.path))
}

fn main() {
    let args = wl::args("wl_vmflags WORKDIR [new]");
    let new = args.rest.iter().any(|a| a == "new");
    let seed = wl::fresh_seed();
    let mut regions: Vec<Region> = ["A", "B", "C"].into_iter().map(guarded).collect();
    for (r, reg) in regions.iter_mut().enumerate() {
        for i in 0..PAGES {
            reg.fill(i, wl::page_seed(seed, r as u64, i as u64));
        }
    }
    let lines: Vec<Option<String>> = regions.iter().map(|r| line(r.addr())).collect();
    // The reads of the checks once now, so that the heap they take is
    // there before `change` (the [heap] line stays as it is).
    for r in &regions {
        std::hint::black_box(vm_flags(r.addr()));
    }
    wl::say("READY");
    wl::Go::at(&args.workdir.join("change")).wait();

    let advise = |r: &Region, advice: i32| {
        // SAFETY: a whole region of ours; advice changes no content here.
        unsafe { libc::madvise(r.base as *mut libc::c_void, PAGES * PAGE, advice) }
    };
    wl::check(advise(&regions[0], libc::MADV_DONTDUMP), "MADV_DONTDUMP");
    wl::check(
        advise(&regions[1], libc::MADV_WIPEONFORK),
        "MADV_WIPEONFORK",
    );
    let third = if advise(&regions[2], libc::MADV_HUGEPAGE) == 0 {
        "hg"
    } else {
        wl::check(advise(&regions[2], libc::MADV_RANDOM), "MADV_RANDOM");
        "rr"
    };
    let want = [("A", "dd"), ("B", "wf"), ("C", third)];
    for i in 0..PAGES / 2 {
        regions[0].fill(i, wl::page_seed(seed, 10, i as u64));
    }
    if new {
        let mut d = guarded("D");
        for i in 0..PAGES {
            d.fill(i, wl::page_seed(seed, 3, i as u64));
        }
        regions.push(d);
    }
    let mut problems = Vec::new();
    for (r, before) in regions.iter().zip(&lines) {
        let now = line(r.addr());
        if now != *before {
            problems.push(format!(
                "{}: its maps line changed: {before:?} -> {now:?}",
                r.name
            ));
        }
    }
    check_flags(&regions, &want, &mut problems);
    if !problems.is_empty() {
        wl::finish(&problems);
    }
    wl::say("CHANGED");
    wl::Go::new(&args.workdir).wait();

    let mut problems = Vec::new();
    for r in &regions {
        r.check(&mut problems);
    }
    check_flags(&regions, &want, &mut problems);
    wl::finish(&problems);
}

/// Each region of `want` shows its flag in smaps.
fn check_flags(regions: &[Region], want: &[(&str, &str)], problems: &mut Vec<String>) {
    for &(name, flag) in want {
        let r = regions.iter().find(|r| r.name == name).expect("a region");
        match vm_flags(r.addr()) {
            Some(f) if f.iter().any(|x| x == flag) => {}
            f => problems.push(format!("{name}: VmFlags {f:?} lack {flag}")),
        }
    }
}
