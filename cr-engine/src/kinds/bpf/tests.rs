use crate::kinds::testkit::{continued, objects_of, refused, round_trip};
use cr_image::model::{FdKind, ObjectKind};

/// bpf(2) from python (ctypes, syscall 321 on x86_64): make maps, read
/// and write entries, attributes (BPF_OBJ_GET_INFO_BY_FD) and fdinfo.
const BPF_PY: &str = r#"
L = ctypes.c_long
def bpf(cmd, attr):
    buf = ctypes.create_string_buffer(attr, len(attr))
    r = libc.syscall(L(321), L(cmd), buf, L(len(attr)))
    return r, ctypes.get_errno()
def map_create(mtype, ks, vs, n, flags=0, name=b""):
    a = struct.pack("=7I16s5IQ", mtype, ks, vs, n, flags, 0, 0, name, 0, 0, 0, 0, 0, 0)
    r, e = bpf(0, a)
    assert r >= 0, "BPF_MAP_CREATE: " + os.strerror(e)
    return r
def elem(cmd, fd, key, vbuf, flags=0):
    k = None if key is None else ctypes.create_string_buffer(key, len(key))
    a = struct.pack("=IIQQQ", fd, 0, 0 if k is None else ctypes.addressof(k), 0 if vbuf is None else ctypes.addressof(vbuf), flags)
    return bpf(cmd, a)
def update(fd, key, value):
    v = ctypes.create_string_buffer(value, len(value))
    return elem(2, fd, key, v)
def lookup(fd, key, vlen):
    v = ctypes.create_string_buffer(vlen)
    r, e = elem(1, fd, key, v)
    return v.raw if r == 0 else None
def dump(fd, ks, vlen):
    out, key = {}, None
    while True:
        nk = ctypes.create_string_buffer(ks)
        r, e = elem(4, fd, key, nk)
        if r != 0:
            assert e == errno.ENOENT, "GET_NEXT_KEY: " + os.strerror(e)
            return out
        key = nk.raw
        out[key] = lookup(fd, key, vlen)
def freeze(fd):
    r, e = bpf(22, struct.pack("=IIQQQ", fd, 0, 0, 0, 0))
    assert r == 0, "BPF_MAP_FREEZE: " + os.strerror(e)
def info(fd):
    buf = ctypes.create_string_buffer(88)
    r, e = bpf(15, struct.pack("=IIQ", fd, 88, ctypes.addressof(buf)))
    assert r == 0, "OBJ_GET_INFO_BY_FD: " + os.strerror(e)
    t, i, ks, vs, n, fl, name, ifi = struct.unpack_from("=6I16sI", buf.raw)
    return dict(type=t, id=i, key_size=ks, value_size=vs, max_entries=n, flags=fl, name=name.rstrip(b"\0"), ifindex=ifi)
def fd_by_id(i, open_flags):
    r, e = bpf(14, struct.pack("=III", i, 0, open_flags))
    assert r >= 0, "MAP_GET_FD_BY_ID: " + os.strerror(e)
    return r
def fdinfo(fd):
    d = dict(l.split(":", 1) for l in open("/proc/self/fdinfo/%d" % fd).read().splitlines())
    return {k: d[k].strip() for k in ("map_type", "key_size", "value_size", "max_entries", "map_flags", "memlock", "frozen")}
def cpus():
    n = 0
    for part in open("/sys/devices/system/cpu/possible").read().strip().split(","):
        a, _, b = part.partition("-")
        n += int(b or a) - int(a) + 1
    return n
"#;

/// An array map (BPF_F_NUMA_NODE, some entries, frozen) with a second,
/// read-only description of it; a hash map (BPF_F_NO_PREALLOC, an
/// entry deleted) dup'ed; a per-CPU hash map with a value per CPU; an
/// LRU hash map; an LPM trie. After the restore: every entry, the attributes (obj
/// info and fdinfo but the id) as they were, the frozen array refuses an
/// update (EPERM), the read-only fd too and names the array's id, the
/// dup'ed fds name one map, and the hash map takes updates.
#[test]
fn bpf_maps_round_trip() {
    let setup = format!(
        "{BPF_PY}{}",
        r#"
NCPU = cpus()
arr = map_create(2, 4, 8, 16, 4, b"cr_arr")
for i in range(10):
    assert update(arr, struct.pack("I", i), struct.pack("Q", i * 1000 + 7))[0] == 0
freeze(arr)
arr_ro = fd_by_id(info(arr)["id"], 1 << 3)
h = map_create(1, 8, 16, 32, 1, b"cr_hash")
for i in range(20):
    assert update(h, struct.pack("Q", i * i + 3), bytes([i]) * 16)[0] == 0
r = elem(3, h, struct.pack("Q", 3), None)
assert r[0] == 0, "delete"
h2 = os.dup(h)
pc = map_create(5, 4, 4, 4, 0, b"cr_percpu")
VLEN = 8 * NCPU
for i in range(3):
    assert update(pc, struct.pack("I", i), b"".join(struct.pack("Q", i * 100 + c) for c in range(NCPU)))[0] == 0
lru = map_create(9, 4, 4, 64, 0, b"")
for i in range(5):
    assert update(lru, struct.pack("I", i), struct.pack("I", ~i & 0xffffffff))[0] == 0
lpm = map_create(11, 8, 4, 16, 1, b"cr_lpm")
for plen, ip, v in [(8, "10.0.0.0", 1), (16, "10.1.0.0", 2), (24, "10.1.2.0", 3), (32, "10.1.2.3", 4)]:
    assert update(lpm, struct.pack("=I", plen) + socket.inet_aton(ip), struct.pack("I", v))[0] == 0
maps = [(arr, 4, 8), (h, 8, 16), (pc, 4, VLEN), (lru, 4, 4), (lpm, 8, 4)]
before = [(info(fd), fdinfo(fd), dump(fd, ks, vl)) for fd, ks, vl in maps]
assert len(before[0][2]) == 16 and len(before[1][2]) == 19 and len(before[2][2]) == 3
"#
    );
    let check = r#"
for (fd, ks, vl), (i0, f0, d0) in zip(maps, before):
    i1 = info(fd)
    expect({k: v for k, v in i1.items() if k != "id"} == {k: v for k, v in i0.items() if k != "id"}, "obj info of fd %d: %r, was %r" % (fd, i1, i0))
    expect(fdinfo(fd) == f0, "fdinfo of fd %d: %r, was %r" % (fd, fdinfo(fd), f0))
    d1 = dump(fd, ks, vl)
    expect(d1 == d0, "entries of fd %d (%s): %d, was %d; differ: %r" % (fd, i0["name"], len(d1), len(d0), [k for k in d0 if d1.get(k) != d0[k]][:4]))
expect(fdinfo(arr)["frozen"] == "1", "array frozen")
r, e = update(arr, struct.pack("I", 1), struct.pack("Q", 1))
expect(r != 0 and e == errno.EPERM, "update of the frozen array: %d %s" % (r, os.strerror(e)))
expect(info(arr_ro)["id"] == info(arr)["id"], "read-only fd names the array")
expect(fcntl.fcntl(arr_ro, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY, "read-only fd's access mode")
r, e = update(arr_ro, struct.pack("I", 1), struct.pack("Q", 1))
expect(r != 0 and e == errno.EPERM, "update through the read-only fd: %d %s" % (r, os.strerror(e)))
expect(info(h)["id"] == info(h2)["id"], "dup'ed fds name one map")
r, e = update(h, struct.pack("Q", 999), b"z" * 16)
expect(r == 0, "update of the hash map: " + os.strerror(e))
expect(lookup(h2, struct.pack("Q", 999), 16) == b"z" * 16, "the update seen through the dup'ed fd")
expect(fdinfo(h)["frozen"] == "0", "hash map not frozen")
expect(lookup(lpm, struct.pack("=I", 32) + socket.inet_aton("10.1.2.77"), 4) == struct.pack("I", 3), "longest prefix match")
"#;
    let rt = round_trip("bpf-maps", &setup, check);
    let maps = |ck: &cr_image::model::Checkpoint| {
        let mut m: Vec<_> = objects_of(ck, |k| match k {
            ObjectKind::BpfMap(m) => Some(m),
            _ => None,
        })
        .into_iter()
        .map(|m| (m.name, m.map_type, m.frozen, m.entries.len()))
        .collect();
        m.sort();
        m
    };
    assert_eq!(
        maps(&rt.before),
        vec![
            ("".into(), 9, false, 5),
            ("cr_arr".into(), 2, true, 10),
            ("cr_hash".into(), 1, false, 19),
            ("cr_lpm".into(), 11, false, 4),
            ("cr_percpu".into(), 5, false, 3),
        ]
    );
    let (a, _) = rt.roots();
    let fds = a
        .fds
        .iter()
        .filter(|f| matches!(f.kind, FdKind::BpfMap { .. }))
        .count();
    assert_eq!(fds, 7, "seven fds of five maps");
}

/// A ring buffer map is refused by its type; the program runs on with
/// its maps as they were.
#[test]
fn bpf_ringbuf_refused() {
    let setup = format!(
        "{BPF_PY}{}",
        r#"
h = map_create(1, 4, 4, 8, 0, b"cr_kept")
assert update(h, struct.pack("I", 5), struct.pack("I", 55))[0] == 0
rb = map_create(27, 0, 0, 4096, 0, b"cr_ring")
"#
    );
    refused(
        "bpf-ringbuf",
        &setup,
        r#"
expect(lookup(h, struct.pack("I", 5), 4) == struct.pack("I", 55), "hash map entry")
expect(info(rb)["type"] == 27, "ring buffer still there")
"#,
        "a BPF map of type ringbuf",
    );
}

/// BPF programs stay refused by name.
#[test]
fn bpf_program_refused() {
    let setup = format!(
        "{BPF_PY}{}",
        r#"
# BPF_PROG_TYPE_SOCKET_FILTER: r0 = 0; exit
insns = struct.pack("=BBhi", 0xb7, 0, 0, 0) + struct.pack("=BBhi", 0x95, 0, 0, 0)
ib = ctypes.create_string_buffer(insns, len(insns))
lic = ctypes.create_string_buffer(b"GPL")
prog, e = bpf(5, struct.pack("=IIQQ", 1, 2, ctypes.addressof(ib), ctypes.addressof(lic)) + bytes(88))
assert prog >= 0, "BPF_PROG_LOAD: " + os.strerror(e)
"#
    );
    refused(
        "bpf-prog",
        &setup,
        r#"expect(os.readlink("/proc/self/fd/%d" % prog) == "anon_inode:bpf-prog", "program fd")"#,
        "a BPF program (anon_inode:bpf-prog)",
    );
}

/// A checkpoint that continues leaves the maps as they were (nothing is
/// written to them) and the program goes on using them.
#[test]
fn bpf_maps_continued() {
    let setup = format!(
        "{BPF_PY}{}",
        r#"
h = map_create(1, 4, 4, 8, 0, b"cr_cont")
for i in range(4):
    assert update(h, struct.pack("I", i), struct.pack("I", i + 40))[0] == 0
before = dump(h, 4, 4)
"#
    );
    let ck = continued(
        "bpf-continued",
        &setup,
        r#"
expect(dump(h, 4, 4) == before, "entries")
expect(update(h, struct.pack("I", 7), struct.pack("I", 7))[0] == 0, "update")
"#,
    );
    let n = objects_of(&ck, |k| match k {
        ObjectKind::BpfMap(m) => Some(m),
        _ => None,
    });
    assert_eq!(n.len(), 1);
    assert_eq!(n[0].entries.len(), 4);
}
