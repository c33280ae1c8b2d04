//! Round trip of kind "mounts": a program in a mount namespace of its own
//! with a tmpfs and a read-only bind mount of a directory of the host,
//! files open in both and its working directory in the tmpfs; and the
//! refusal of an overlay mount, by name.
//!
//! The mounts live only in the program's namespace: they go with it.

use crate::kinds::testkit::{refused, round_trip};
use cr_image::model::{MountKind, Propagation};

/// Python: a mount namespace of its own, private, and `mount()`.
const NEW_NS: &str = r#"
MS_NOEXEC_ = 8
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
def mount(src, tgt, fs, flags, data):
    if libc.mount(src.encode(), tgt.encode(), fs.encode() if fs else None,
                  ctypes.c_ulong(flags), data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), tgt)
if libc.unshare(0x20000) != 0:
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
mount("none", "/", None, MS_REC | MS_PRIVATE, None)
"#;

#[test]
fn mounts_tmpfs_and_ro_bind_round_trip() {
    let setup = format!(
        "{NEW_NS}{}",
        r#"
T, H, B = DIR + "/t", DIR + "/host", DIR + "/b"
for p in (T, H, B):
    os.mkdir(p)
with open(H + "/data", "w") as f:
    f.write("host data here")
mount("tmpfs", T, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=750")
os.mkdir(T + "/sub")
with open(T + "/sub/f", "w") as f:
    f.write("tmpfs content 0123456789")
os.mkdir(T + "/in")
mount("tmpfs", T + "/in", "tmpfs", 0, "size=1m")
with open(T + "/in/g", "w") as f:
    f.write("inner")
os.mkdir(DIR + "/mq")
mount("mqueue", DIR + "/mq", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC_, None)
mount(H, B, None, MS_BIND, None)
mount("none", B, None, MS_BIND | MS_REMOUNT | MS_RDONLY, None)
ft = os.open(T + "/sub/f", os.O_RDWR)
os.lseek(ft, 6, os.SEEK_SET)
fb = os.open(B + "/data", os.O_RDONLY)
os.lseek(fb, 5, os.SEEK_SET)
os.chdir(T + "/sub")
"#
    );
    let rt = round_trip(
        "mounts-tmpfs-bind",
        &setup,
        r#"
expect(os.lseek(ft, 0, os.SEEK_CUR) == 6, "tmpfs fd offset")
expect(os.pread(ft, 100, 0) == b"tmpfs content 0123456789", "tmpfs file content")
expect(os.fstat(ft).st_dev == os.stat(T).st_dev, "tmpfs fd on the tmpfs")
expect(os.lseek(fb, 0, os.SEEK_CUR) == 5, "bind fd offset")
expect(os.read(fb, 4) == b"data", "bind file content")
expect(os.getcwd() == T + "/sub", "cwd " + os.getcwd())
expect(open("f").read() == "tmpfs content 0123456789", "cwd in the tmpfs")
expect(open(T + "/in/g").read() == "inner", "the tmpfs inside the tmpfs")
expect(os.stat(T).st_mode & 0o7777 == 0o750, "tmpfs root mode")
st = os.statvfs(T)
expect(st.f_blocks * st.f_frsize == 4 << 20, "tmpfs size")
try:
    os.close(os.open(B + "/new", os.O_CREAT | os.O_WRONLY, 0o644))
    problems.append("the bind mount is writable")
except OSError as e:
    expect(e.errno == errno.EROFS, "write in the bind mount: " + repr(e))
mi = [l.split() for l in open("/proc/self/mountinfo")]
tm = [l for l in mi if l[4] == T]
expect(len(tm) == 1 and tm[0][tm[0].index("-") + 1] == "tmpfs" and "nosuid" in tm[0][5].split(",")
       and "nodev" in tm[0][5].split(","), "tmpfs in mountinfo: %r" % tm)
mq = [l for l in mi if l[4] == DIR + "/mq"]
expect(len(mq) == 1 and mq[0][mq[0].index("-") + 1] == "mqueue" and "noexec" in mq[0][5].split(","),
       "mqueue in mountinfo: %r" % mq)
bm = [l for l in mi if l[4] == B]
expect(len(bm) == 1 and "ro" in bm[0][5].split(","), "ro bind in mountinfo: %r" % bm)
"#,
    );
    for ck in [&rt.before, &rt.after] {
        let m = ck.mounts.as_ref().expect("a mount namespace saved");
        let kinds: Vec<_> = m
            .others
            .iter()
            .map(|o| match &o.kind {
                MountKind::Bind(src) => format!("bind {src} on {}", o.mount_point),
                MountKind::Tmpfs(t) => {
                    format!("tmpfs {} on {}", t.entries.len(), o.mount_point)
                }
                MountKind::Fs(f) => format!("{f} on {}", o.mount_point),
            })
            .collect();
        assert_eq!(kinds.len(), 4, "{kinds:?}");
        assert!(kinds[0].starts_with("tmpfs 3 on /"), "{kinds:?}");
        assert!(
            kinds[1].starts_with("tmpfs 1 on /") && kinds[1].ends_with("/t/in"),
            "{kinds:?}"
        );
        assert!(kinds[2].starts_with("mqueue on /"), "{kinds:?}");
        assert!(
            kinds[3].starts_with("bind /") && kinds[3].contains("/host on /"),
            "{kinds:?}"
        );
        assert!(m.others[3].flags & libc::MS_RDONLY != 0);
        assert!(m
            .others
            .iter()
            .all(|o| o.propagation == Propagation::Private));
    }
}

#[test]
fn mounts_overlay_refused() {
    let setup = format!(
        "{NEW_NS}{}",
        r#"
for p in ("lo", "up", "wk", "ov"):
    os.mkdir(DIR + "/" + p)
with open(DIR + "/lo/f", "w") as f:
    f.write("lower")
mount("overlay", DIR + "/ov", "overlay", 0,
      "lowerdir=%s/lo,upperdir=%s/up,workdir=%s/wk" % (DIR, DIR, DIR))
fo = os.open(DIR + "/ov/f", os.O_RDONLY)
"#
    );
    let err = refused(
        "mounts-overlay",
        &setup,
        r#"
expect(os.pread(fo, 10, 0) == b"lower", "the overlay file")
"#,
        "overlay",
    );
    assert!(err.contains("/ov (overlay"), "{err}");
}
