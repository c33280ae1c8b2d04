//! Workload: memory shared copy-on-write between a parent and its
//! children, checked from inside (content, physical frames, isolation).
//!
//! The root maps MIB MiB of private anonymous memory, writes every page
//! (version 0), forks N children, then rewrites the pages `k % 16 == 15`
//! (version 1). Child `c` (id `c + 1`) rewrites the pages `k % 8 == c`;
//! child 0 then forks a grandchild (id `N + 1`) that rewrites the pages
//! `k % 8 == 7`. Each process knows the version of every page of itself
//! and of its parent: a page of the same version in both must be the same
//! physical page (pagemap PFN, root only), one of another version must not.
//! Once the root wrote its pages (`rooted`), every descendant checks that
//! (once before `READY`, proving the expectation on the original) and
//! says so with `ready.<id>`; the root prints the tree's Pss and Rss
//! (`pss_before_kb`, `rss_before_kb`) and `READY`.
//!
//! After `<workdir>/go` (the restored tree): the root prints the tree's
//! Pss and Rss again (`pss_after_kb`, ...); everyone checks its content,
//! the descendants the sharing again (`checked.<id>`). Then isolation: the
//! root writes a page shared by all (`pwrote`), each descendant checks it
//! still reads the old one and writes another shared page (`cwrote.<id>`),
//! which the root must not see; after `alldone` everyone checks its whole
//! content again. The root prints OK or FAIL: reason.
//!
//! With `file`, the memory is a private mapping of a file (`WORKDIR/cow.data`,
//! every page of version 7) and the root leaves the pages `k % 16 == 14`
//! as they are (nobody writes them): those must stay the file's pages
//! (pagemap "file page" bit, content), the written ones anonymous.
//!
//! Usage: wl_cow WORKDIR [MIB] [N] [file]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const PAGE: usize = 4096;
const WORDS: usize = PAGE / 8;
/// Page rewritten by the root in the isolation phase, then by the others.
const ROOT_WRITES: usize = 4;
const OTHERS_WRITE: usize = 12;
/// The content of the file's pages (`file`).
const FILE_VERSION: u64 = 7;
/// Whether the memory maps a file (`file`).
static FILE: AtomicBool = AtomicBool::new(false);

/// Whether page `k` is never written (the file's own, `file` only).
fn never_written(k: usize) -> bool {
    FILE.load(Ordering::Relaxed) && k % 16 == 14
}

fn say(s: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}");
    let _ = out.flush();
}

fn word(k: usize, w: usize, version: u64) -> u64 {
    ((k as u64) << 24) ^ ((w as u64) << 1) ^ version.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 1
}

/// Who a process is in the tree.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Root,
    Child(usize),
    Grandchild,
}

impl Role {
    /// The version of page `k` this process wrote last before the checkpoint.
    fn version(self, k: usize) -> u64 {
        if never_written(k) {
            return FILE_VERSION;
        }
        match self {
            Role::Root if k % 16 == 15 => 1,
            Role::Child(c) if k % 8 == c => 10 + c as u64,
            Role::Grandchild if k % 8 == 7 => 100,
            Role::Grandchild if k.is_multiple_of(8) => 10,
            _ => 0,
        }
    }

    fn parent(self) -> Role {
        match self {
            Role::Grandchild => Role::Child(0),
            _ => Role::Root,
        }
    }

    fn id(self, n: usize) -> usize {
        match self {
            Role::Root => 0,
            Role::Child(c) => c + 1,
            Role::Grandchild => n + 1,
        }
    }
}

struct Mem {
    base: *mut u64,
    pages: usize,
}

impl Mem {
    fn page(&self, k: usize) -> &[u64] {
        assert!(k < self.pages);
        // SAFETY: k < pages; the mapping lives for the whole process and
        // is used by one thread.
        unsafe { std::slice::from_raw_parts(self.base.add(k * WORDS), WORDS) }
    }

    fn write(&mut self, k: usize, version: u64) {
        assert!(k < self.pages);
        // SAFETY: as in `page`; `&mut self` makes this the only borrow.
        let page = unsafe { std::slice::from_raw_parts_mut(self.base.add(k * WORDS), WORDS) };
        for (w, v) in page.iter_mut().enumerate() {
            *v = word(k, w, version);
        }
    }

    fn holds(&self, k: usize, version: u64) -> bool {
        self.page(k)
            .iter()
            .enumerate()
            .all(|(w, v)| *v == word(k, w, version))
    }

    /// Pages whose content is not `version_of(k)`.
    fn check(&self, version_of: impl Fn(usize) -> u64) -> Vec<String> {
        let bad: Vec<usize> = (0..self.pages)
            .filter(|&k| !self.holds(k, version_of(k)))
            .collect();
        match bad.first() {
            None => Vec::new(),
            Some(k) => vec![format!(
                "{} pages hold other content, first {k} (expected version {})",
                bad.len(),
                version_of(*k)
            )],
        }
    }

    fn addr(&self) -> u64 {
        self.base as u64
    }
}

/// pagemap: the page is present; is a file page (or shared anonymous).
const PM_PRESENT: u64 = 1 << 63;
const PM_FILE: u64 = 1 << 61;

/// The pagemap entry of every page of the region at `addr` in process `pid`.
fn pagemap(pid: i32, addr: u64, pages: usize) -> Result<Vec<u64>, String> {
    let path = format!("/proc/{pid}/pagemap");
    let f = File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    let mut buf = vec![0u8; pages * 8];
    f.read_exact_at(&mut buf, addr / PAGE as u64 * 8)
        .map_err(|e| format!("{path}: {e}"))?;
    Ok(buf
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}

/// The PFN (0: not present or not readable) of every page of the region
/// at `addr` in process `pid`.
fn pfns(pid: i32, addr: u64, pages: usize) -> Result<Vec<u64>, String> {
    Ok(pagemap(pid, addr, pages)?
        .into_iter()
        .map(|e| {
            if e & PM_PRESENT != 0 {
                e & ((1 << 55) - 1)
            } else {
                0
            }
        })
        .collect())
}

/// With `file`: the pages never written hold the file's content and are
/// its pages (read first, so present), the written ones are anonymous.
fn check_file_pages(mem: &Mem) -> Vec<String> {
    if !FILE.load(Ordering::Relaxed) {
        return Vec::new();
    }
    let unread: Vec<usize> = (0..mem.pages)
        .filter(|&k| never_written(k) && !mem.holds(k, FILE_VERSION))
        .collect();
    let entries = match pagemap(std::process::id() as i32, mem.addr(), mem.pages) {
        Ok(e) => e,
        Err(e) => return vec![e],
    };
    let (mut anon, mut file) = (Vec::new(), Vec::new());
    for (k, e) in entries.iter().enumerate() {
        let is_file = e & PM_PRESENT != 0 && e & PM_FILE != 0;
        if never_written(k) && !is_file {
            anon.push(k);
        }
        if !never_written(k) && is_file {
            file.push(k);
        }
    }
    let mut f = Vec::new();
    if let Some(k) = unread.first() {
        f.push(format!(
            "{} pages never written do not hold the file's content, first {k}",
            unread.len()
        ));
    }
    if let Some(k) = anon.first() {
        f.push(format!(
            "{} pages never written are not the file's pages, first {k} (pagemap {:#x})",
            anon.len(),
            entries[*k]
        ));
    }
    if let Some(k) = file.first() {
        f.push(format!(
            "{} written pages are file pages, first {k} (pagemap {:#x})",
            file.len(),
            entries[*k]
        ));
    }
    f
}

/// Pages of the same version as the parent's must be its very pages,
/// the others not (pages never written: see [`check_file_pages`]).
fn check_sharing(mem: &Mem, me: Role, parent: i32) -> Vec<String> {
    let mut f = check_file_pages(mem);
    let (mine, theirs) = match (
        pfns(std::process::id() as i32, mem.addr(), mem.pages),
        pfns(parent, mem.addr(), mem.pages),
    ) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => {
            f.push(e);
            return f;
        }
    };
    let (mut apart, mut together, mut shared) = (Vec::new(), Vec::new(), 0);
    for k in (0..mem.pages).filter(|&k| !never_written(k)) {
        let expect = me.version(k) == me.parent().version(k);
        let same = mine[k] != 0 && mine[k] == theirs[k];
        match (expect, same) {
            (true, false) => apart.push(k),
            (false, true) => together.push(k),
            (true, true) => shared += 1,
            _ => {}
        }
    }
    if let Some(k) = apart.first() {
        f.push(format!(
            "{} unchanged pages are not shared with the parent, first {k} (pfn {:#x} vs {:#x})",
            apart.len(),
            mine[*k],
            theirs[*k]
        ));
    }
    if let Some(k) = together.first() {
        f.push(format!(
            "{} changed pages are shared with the parent, first {k}",
            together.len()
        ));
    }
    if f.is_empty() && shared == 0 {
        f.push("no page shared at all".into());
    }
    f
}

/// Whether `p` appears within a minute (another process of the tree makes it).
fn wait_file(p: &Path) -> bool {
    cr_tests::wl::Go::at(p).appeared(Duration::from_secs(60))
}

fn touch(p: &Path) {
    let _ = File::create(p);
}

/// Pss and Rss (kB) of `pid` and its descendants.
fn tree_usage(pid: i32) -> (u64, u64) {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        rollup
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (mut pss, mut rss) = (field("Pss:"), field("Rss:"));
    let kids =
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    for c in kids.split_whitespace().filter_map(|c| c.parse().ok()) {
        let (p, r) = tree_usage(c);
        pss += p;
        rss += r;
    }
    (pss, rss)
}

fn wait_status(pid: i32) -> i32 {
    let mut st = 0;
    // SAFETY: waitpid with a valid out pointer.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    st
}

fn exited_ok(st: i32) -> bool {
    libc::WIFEXITED(st) && libc::WEXITSTATUS(st) == 0
}

/// A descendant's life: before READY and after go.
fn descendant(dir: &Path, mem: &mut Mem, me: Role, n: usize) -> Vec<String> {
    let id = me.id(n);
    // SAFETY: getppid takes no argument.
    let parent = unsafe { libc::getppid() };
    if !wait_file(&dir.join("rooted")) {
        return vec!["the root never wrote its pages".into()];
    }
    let mut f = check_sharing(mem, me, parent);
    if !f.is_empty() {
        return f
            .into_iter()
            .map(|e| format!("before checkpoint: {e}"))
            .collect();
    }
    touch(&dir.join(format!("ready.{id}")));
    if !wait_file(&dir.join("go")) {
        return vec!["no go".into()];
    }
    f.extend(mem.check(|k| me.version(k)));
    f.extend(check_sharing(mem, me, parent));
    touch(&dir.join(format!("checked.{id}")));
    if !wait_file(&dir.join("pwrote")) {
        return vec!["the root never wrote".into()];
    }
    if !mem.holds(ROOT_WRITES, me.version(ROOT_WRITES)) {
        f.push(format!("the root's write to page {ROOT_WRITES} shows here"));
    }
    let mine = 50 + id as u64;
    mem.write(OTHERS_WRITE, mine);
    touch(&dir.join(format!("cwrote.{id}")));
    if !wait_file(&dir.join("alldone")) {
        return vec!["never all done".into()];
    }
    f.extend(mem.check(|k| {
        if k == OTHERS_WRITE {
            mine
        } else {
            me.version(k)
        }
    }));
    f
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().expect("usage: wl_cow WORKDIR [MIB] [N] [file]"));
    let mib: usize = args.next().map_or(64, |v| v.parse().expect("MIB"));
    let n: usize = args.next().map_or(4, |v| v.parse().expect("N"));
    FILE.store(args.next().as_deref() == Some("file"), Ordering::Relaxed);
    // Children rewrite pages `k % 8 < N`: pages 4 and 12 stay shared by all.
    assert!((1..=4).contains(&n), "N from 1 to 4");
    let pages = mib * 256;
    let file = FILE.load(Ordering::Relaxed).then(|| {
        let path = dir.join("cow.data");
        let bytes: Vec<u8> = (0..pages)
            .flat_map(|k| (0..WORDS).map(move |w| word(k, w, FILE_VERSION)))
            .flat_map(u64::to_ne_bytes)
            .collect();
        std::fs::write(&path, bytes).expect("write the mapped file");
        File::open(&path).expect("open the mapped file")
    });
    let (flags, fd) = match &file {
        Some(f) => (libc::MAP_PRIVATE, std::os::fd::AsRawFd::as_raw_fd(f)),
        None => (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1),
    };
    // SAFETY: a fresh private mapping, used only through `Mem`.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // The mapping holds the file.
    drop(file);
    let mut mem = Mem {
        base: base as *mut u64,
        pages,
    };
    for k in (0..pages).filter(|&k| !never_written(k)) {
        mem.write(k, 0);
    }
    let mut kids = Vec::new();
    for c in 0..n {
        // SAFETY: fork in a single-threaded program; the child uses its own
        // memory and ends with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let me = Role::Child(c);
            for k in (0..pages).filter(|k| k % 8 == c) {
                mem.write(k, me.version(k));
            }
            let mut gc = 0;
            if c == 0 {
                // SAFETY: as above.
                gc = unsafe { libc::fork() };
                if gc == 0 {
                    let me = Role::Grandchild;
                    for k in (0..pages).filter(|k| k % 8 == 7) {
                        mem.write(k, me.version(k));
                    }
                    let f = descendant(&dir, &mut mem, me, n);
                    for e in &f {
                        say(&format!("FAIL: grandchild: {e}"));
                    }
                    // SAFETY: _exit never returns.
                    unsafe { libc::_exit(i32::from(!f.is_empty())) };
                }
            }
            let mut f = descendant(&dir, &mut mem, me, n);
            if gc > 0 && !exited_ok(wait_status(gc)) {
                f.push("the grandchild failed".into());
            }
            for e in &f {
                say(&format!("FAIL: child {c}: {e}"));
            }
            // SAFETY: _exit never returns.
            unsafe { libc::_exit(i32::from(!f.is_empty())) };
        }
        kids.push(pid);
    }
    let me = Role::Root;
    for k in (0..pages).filter(|k| k % 16 == 15) {
        mem.write(k, me.version(k));
    }
    touch(&dir.join("rooted"));
    let ids = 1..=n + 1;
    let mut fails = Vec::new();
    for id in ids.clone() {
        if !wait_file(&dir.join(format!("ready.{id}"))) {
            fails.push(format!("process {id} never got ready"));
        }
    }
    // SAFETY: getpid takes no argument.
    let root = unsafe { libc::getpid() };
    let (pss, rss) = tree_usage(root);
    say(&format!("pss_before_kb {pss} rss_before_kb {rss}"));
    say("READY");
    if fails.is_empty() && wait_file(&dir.join("go")) {
        let (pss, rss) = tree_usage(root);
        say(&format!("pss_after_kb {pss} rss_after_kb {rss}"));
        fails.extend(mem.check(|k| me.version(k)));
        fails.extend(check_file_pages(&mem));
        for id in ids.clone() {
            if !wait_file(&dir.join(format!("checked.{id}"))) {
                fails.push(format!("process {id} never checked"));
            }
        }
        mem.write(ROOT_WRITES, 2);
        touch(&dir.join("pwrote"));
        for id in ids.clone() {
            if !wait_file(&dir.join(format!("cwrote.{id}"))) {
                fails.push(format!("process {id} never wrote"));
            }
        }
        if !mem.holds(OTHERS_WRITE, me.version(OTHERS_WRITE)) {
            fails.push(format!(
                "a descendant's write to page {OTHERS_WRITE} shows here"
            ));
        }
        touch(&dir.join("alldone"));
        fails.extend(mem.check(|k| if k == ROOT_WRITES { 2 } else { me.version(k) }));
    }
    for (c, pid) in kids.into_iter().enumerate() {
        if !exited_ok(wait_status(pid)) {
            fails.push(format!("child {c} failed"));
        }
    }
    if fails.is_empty() {
        say("OK");
    } else {
        say(&format!("FAIL: {}", fails.join("; ")));
        std::process::exit(1);
    }
}
