//! Round trip of kind "memory": anonymous memory with a pattern, a
//! read-only region, a private file mapping written to, madvise advice
//! (fork, read-ahead),
//! and the mm fields.

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
            .map(|v| (v.start, v.end, v.prot, v.kind, v.vm_flags.clone()))
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
}
