//! Round trip of kind "memory": anonymous memory with a pattern, a
//! read-only region, a private file mapping written to, madvise advice
//! (fork, read-ahead), a guard region, droppable memory, and the mm
//! fields.

use crate::kinds::testkit::round_trip;

#[test]
fn memory_round_trip() {
    let rt = round_trip(
        "memory",
        r#"
import mmap, hashlib
big = mmap.mmap(-1, 32 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, 32 << 20, 4096):
    big[i:i + 8] = struct.pack("<Q", i * 2654435761 & 0xffffffffffffffff)
digest = hashlib.sha256(big).hexdigest()
path = os.path.join(DIR, "mapped")
with open(path, "wb") as f: f.write(b"x" * 65536)
fd = os.open(path, os.O_RDONLY)
filemap = mmap.mmap(fd, 65536, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
filemap[4096:4100] = b"mine"
ro = mmap.mmap(-1, 8192)
ro[0:5] = b"const"
addr = ctypes.addressof(ctypes.c_char.from_buffer(ro))
libc.mprotect(ctypes.c_void_p(addr), 8192, 1)   # PROT_READ
big.madvise(mmap.MADV_DONTFORK, 0, 1 << 20)
start = "%x-" % ctypes.addressof(ctypes.c_char.from_buffer(big))
seq = mmap.mmap(-1, 8192); seq.madvise(mmap.MADV_SEQUENTIAL)
rnd = mmap.mmap(-1, 8192); rnd.madvise(mmap.MADV_RANDOM)
guarded = mmap.mmap(-1, 4 * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
guarded[:] = b"g" * (4 * 4096)
gaddr = ctypes.addressof(ctypes.c_char.from_buffer(guarded))
if libc.madvise(ctypes.c_void_p(gaddr + 4096), 8192, 102) != 0:   # MADV_GUARD_INSTALL
    raise OSError(ctypes.get_errno(), "MADV_GUARD_INSTALL")
drop = mmap.mmap(-1, 8192, flags=0x08 | mmap.MAP_ANONYMOUS)     # MAP_DROPPABLE
drop[0:4] = b"drop"
def faults(addr):
    # write(2) into a pipe from a guard page: EFAULT (as any access).
    r, w = os.pipe()
    n = libc.write(w, ctypes.c_void_p(addr), 1)
    e = ctypes.get_errno()
    os.close(r)
    os.close(w)
    return n < 0 and e == errno.EFAULT
def vmflags(m):
    at = "%x-" % ctypes.addressof(ctypes.c_char.from_buffer(m))
    rest = open("/proc/self/smaps").read().split(at, 1)[1]
    return [l for l in rest.splitlines() if l.startswith("VmFlags:")][0].split()[1:]
"#,
        r#"
expect(hashlib.sha256(big).hexdigest() == digest, "the anonymous pattern")
expect(filemap[4096:4100] == b"mine" and filemap[0:4] == b"xxxx", "the private file mapping")
expect(ro[0:5] == b"const", "the read-only region")
maps = open("/proc/self/maps").read()
smaps = open("/proc/self/smaps").read().split(start, 1)[1]
flags = [l for l in smaps.splitlines() if l.startswith("VmFlags:")][0]
expect(" dc" in flags, "the madvise flag: " + flags)
expect("sr" in vmflags(seq) and "rr" in vmflags(rnd), "the read-ahead advice: %r %r" % (vmflags(seq), vmflags(rnd)))
expect([faults(gaddr + i * 4096) for i in range(4)] == [False, True, True, False], "the guard region")
expect(guarded[0:1] == b"g" and guarded[3 * 4096:3 * 4096 + 1] == b"g", "the pages around the guard region")
expect("dp" in vmflags(drop), "the droppable mapping: %r" % vmflags(drop))
expect(drop[0:4] == bytes(4), "the droppable memory, not saved, comes back empty")
expect(any(l.split()[1].startswith("r--") and ("%x" % addr) in l.split()[0] for l in maps.splitlines()), "the protection")
"#,
    );
    let (a, b) = rt.roots();
    // Compared as a program can tell them apart: neighbours split only by
    // their history (different anon_vmas) are mapped afresh on restore and
    // the kernel merges them.
    let shape = |p: &cr_image::model::Process| {
        super::merged(&p.vmas)
            .iter()
            .filter(|v| !v.kind.is_special())
            .map(|v| {
                let g = v.guards.clone();
                (v.start, v.end, v.prot, v.kind, v.vm_flags.clone(), g)
            })
            .collect::<Vec<_>>()
    };
    let (sa, sb) = (shape(a), shape(b));
    let only_a: Vec<_> = sa.iter().filter(|v| !sb.contains(v)).collect();
    let only_b: Vec<_> = sb.iter().filter(|v| !sa.contains(v)).collect();
    assert!(
        only_a.is_empty() && only_b.is_empty(),
        "the mappings changed: before only {only_a:x?}, after only {only_b:x?}"
    );
    assert_eq!(a.mm, b.mm, "the mm fields changed");
    assert!(a.memory.stats.pages_stored >= (32 << 20) / 4096);
    let guarded: Vec<_> = a.vmas.iter().filter(|v| !v.guards.is_empty()).collect();
    assert!(
        guarded.len() == 1 && guarded[0].guards.len() == 1,
        "one guard region saved: {guarded:x?}"
    );
    assert!(a.vmas.iter().any(|v| v.has_flag("dp")), "droppable saved");
}

/// A process that unmapped its [vdso], [vvar] and [vvar_vclock] (as on a
/// kernel booted with vdso=0) comes back without them, and runs on.
#[test]
fn unmapped_vdso_round_trip() {
    let rt = round_trip(
        "memory-no-vdso",
        r#"
SPECIAL = ("[vdso]", "[vvar]", "[vvar_vclock]")
def specials(pid):
    return [l.split()[-1] for l in open("/proc/%d/maps" % pid) if l.split()[-1] in SPECIAL]
r, w = os.pipe()
child = os.fork()
if child == 0:
    # No vDSO call from here on: only plain system calls.
    for l in open("/proc/self/maps").read().splitlines():
        if l.split()[-1] in SPECIAL:
            a, b = (int(x, 16) for x in l.split()[0].split("-"))
            libc.munmap(ctypes.c_void_p(a), ctypes.c_size_t(b - a))
    os.write(w, b"x")
    while True:
        libc.pause()
os.read(r, 1)
expect(specials(child) == [], "the child unmapped them: %r" % specials(child))
"#,
        r#"
expect(specials(child) == [], "the child is restored without them: %r" % specials(child))
expect(os.waitpid(child, os.WNOHANG) == (0, 0), "the child runs on")
os.kill(child, signal.SIGKILL)
os.waitpid(child, 0)
expect(len(specials(os.getpid())) >= 2, "the parent keeps its own: %r" % specials(os.getpid()))
"#,
    );
    let child = &rt.after.processes[1];
    assert!(
        child
            .vmas
            .iter()
            .all(|v| !v.kind.is_special() || v.kind == cr_image::model::VmaKind::Vsyscall),
        "the restored child has no vDSO"
    );
}

/// One shared anonymous object mapped three times in one process: two
/// shared windows at different offsets and a private (copy-on-write)
/// mapping of it, part of the first mapping unmapped. After the restore
/// the three map one object again: its pages, the private copy, and the
/// sharing both ways.
#[test]
fn shared_anonymous_windows_round_trip() {
    let rt = round_trip(
        "memory-shm-windows",
        r#"
import mmap
P = 4096
shm = mmap.mmap(-1, 8 * P)    # MAP_SHARED | MAP_ANONYMOUS
for i in range(8):
    shm[i * P:i * P + 4] = b"obj%d" % i
a = ctypes.addressof(ctypes.c_char.from_buffer(shm))
fd = os.open("/proc/self/map_files/%x-%x" % (a, a + 8 * P), os.O_RDWR)
win = mmap.mmap(fd, 4 * P, flags=mmap.MAP_SHARED, offset=4 * P)
priv = mmap.mmap(fd, 4 * P, flags=mmap.MAP_PRIVATE, offset=0)
os.close(fd)
priv[P:P + 4] = b"mine"
# Pages 6 and 7 of the object: now only in the second window.
if libc.munmap(ctypes.c_void_p(a + 6 * P), ctypes.c_size_t(2 * P)) != 0:
    raise OSError(ctypes.get_errno(), "munmap")
"#,
        r#"
expect([shm[i * P:i * P + 4] for i in range(6)] == [b"obj%d" % i for i in range(6)], "the first mapping's pages")
expect([win[i * P:i * P + 4] for i in range(4)] == [b"obj%d" % i for i in range(4, 8)], "the second window's pages")
expect(priv[0:4] == b"obj0" and priv[P:P + 4] == b"mine", "the private mapping: %r %r" % (priv[0:4], priv[P:P + 4]))
win[0:4] = b"new4"
expect(shm[4 * P:4 * P + 4] == b"new4", "the windows share one object")
shm[2 * P:2 * P + 4] = b"late"
expect(priv[2 * P:2 * P + 4] == b"late", "the private mapping still reads the object where it has no copy")
"#,
    );
    let (a, _) = rt.roots();
    let shmem: Vec<_> = a.vmas.iter().filter(|v| v.is_shmem()).collect();
    assert_eq!(shmem.len(), 3, "three mappings of the object: {shmem:x?}");
    assert_eq!(
        shmem.iter().filter(|v| v.shm_owner.is_none()).count(),
        1,
        "one stands for the object"
    );
}

/// A deleted file mapped through two of its names (linked under the
/// second before both went): each mapping shows its own name again.
#[test]
fn deleted_file_mapped_under_two_names_round_trip() {
    round_trip(
        "memory-two-names",
        r#"
import mmap
first = os.path.join(DIR, "first")
with open(first, "wb") as f: f.write(b"a" * 4096)
fd = os.open(first, os.O_RDONLY)
ma = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
os.close(fd)
os.link(first, first + ".lnk")
os.unlink(first)
fd = os.open(first + ".lnk", os.O_RDONLY)
mb = mmap.mmap(fd, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
os.close(fd)
os.unlink(first + ".lnk")
def shown(m):
    at = "%x-" % ctypes.addressof(ctypes.c_char.from_buffer(m))
    return [l.split(None, 5)[5].strip() for l in open("/proc/self/maps") if l.startswith(at)][0]
names = (shown(ma), shown(mb))
expect(names == (first + " (deleted)", first + ".lnk (deleted)"), "the names before: %r" % (names,))
"#,
        r#"
expect((shown(ma), shown(mb)) == names, "the names: %r" % ((shown(ma), shown(mb)),))
expect(ma[0:1] == b"a" and mb[4095:4096] == b"a", "the content")
"#,
    );
}

/// Huge pages this machine has free for a test, raised for its length
/// (`/proc/sys/vm/nr_hugepages`, put back when dropped).
struct HugePages(Option<String>);

impl HugePages {
    const NR: &'static str = "/proc/sys/vm/nr_hugepages";
    const FREE: &'static str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";

    fn at_least(free: u64) -> HugePages {
        let read = |p: &str| -> u64 {
            std::fs::read_to_string(p)
                .unwrap_or_else(|e| panic!("{p}: {e}"))
                .trim()
                .parse()
                .unwrap()
        };
        let (nr, have) = (read(Self::NR), read(Self::FREE));
        if have >= free {
            return HugePages(None);
        }
        std::fs::write(Self::NR, (nr + free - have).to_string()).unwrap();
        assert!(
            read(Self::FREE) >= free,
            "{free} free huge pages of 2 MiB (memory too fragmented?)"
        );
        HugePages(Some(nr.to_string()))
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Some(nr) = &self.0 {
            let _ = std::fs::write(Self::NR, nr);
        }
    }
}

/// hugetlb memory of 2 MiB pages: private and shared anonymous mappings
/// (MAP_HUGETLB) and a memfd made with MFD_HUGETLB, mapped shared. After
/// the restore each holds its bytes and is hugetlb memory again (smaps'
/// KernelPageSize), the shared ones still shared with their objects.
#[test]
fn hugetlb_mappings_round_trip() {
    let _pages = HugePages::at_least(6);
    let rt = round_trip(
        "memory-hugetlb",
        r#"
import mmap
H = 2 << 20
MAP_HUGETLB = 0x40000
priv = mmap.mmap(-1, H, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
shared = mmap.mmap(-1, H, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
mfd = os.memfd_create("cr-huge", os.MFD_HUGETLB)
os.ftruncate(mfd, 2 * H)
mem = mmap.mmap(mfd, 2 * H, flags=mmap.MAP_SHARED)
for m, tag in ((priv, b"priv"), (shared, b"shrd"), (mem, b"mfd_")):
    for off in range(0, len(m), 64 << 10):
        m[off:off + 8] = tag + struct.pack("<I", off)
def page_size(m):
    a = ctypes.addressof(ctypes.c_char.from_buffer(m))
    inside = False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            inside = lo <= a < hi
        elif inside and line.startswith("KernelPageSize:"):
            return int(line.split()[1])
"#,
        r#"
for m, tag in ((priv, b"priv"), (shared, b"shrd"), (mem, b"mfd_")):
    bad = [off for off in range(0, len(m), 64 << 10) if m[off:off + 8] != tag + struct.pack("<I", off)]
    expect(not bad, "%r: %d places lost their bytes, first at %s" % (tag, len(bad), bad[:1]))
    expect(page_size(m) == 2048, "%r: pages of %s kB, not 2048" % (tag, page_size(m)))
mem[H:H + 4] = b"late"
expect(os.pread(mfd, 4, H) == b"late", "the memfd's mapping writes its file")
expect(os.fstat(mfd).st_size == 2 * H, "the memfd's size")
"#,
    );
    let (a, _) = rt.roots();
    let huge: Vec<_> = a.vmas.iter().filter(|v| v.huge_page_size != 0).collect();
    assert_eq!(huge.len(), 3, "three hugetlb mappings saved: {huge:x?}");
    assert!(huge.iter().all(|v| v.huge_page_size == 2 << 20));
}
