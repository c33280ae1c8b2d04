//! Round trip of kind "tty": a pseudo-terminal pair with its settings and
//! window size, carrying data after the restore.

use crate::kinds::testkit::round_trip;
use cr_image::model::objects::Pty;
use cr_image::model::{Checkpoint, ObjectKind};

/// The pty objects of an image, with their ids.
fn pty_objects(c: &Checkpoint) -> Vec<(u64, &Pty)> {
    c.objects
        .iter()
        .filter_map(|o| match &o.kind {
            ObjectKind::Pty(p) => Some((o.id, p)),
            _ => None,
        })
        .collect()
}

#[test]
fn pty_round_trip() {
    let rt = round_trip(
        "tty",
        r#"
import termios, tty
m, s = os.openpty()
tty.setraw(s)
attrs = termios.tcgetattr(s)
fcntl.ioctl(s, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
"#,
        r#"
import termios
expect(termios.tcgetattr(s) == attrs, "terminal settings")
expect(struct.unpack("HHHH", fcntl.ioctl(s, termios.TIOCGWINSZ, b"\0" * 8))[:2] == (33, 101), "window size")
os.write(m, b"typed")
expect(os.read(s, 10) == b"typed", "the pair is connected")
"#,
    );
    let ptys = |c: &Checkpoint| {
        pty_objects(c)
            .into_iter()
            .map(|(_, p)| (p.index, p.termios.clone(), p.winsize.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(ptys(&rt.before).len(), 1);
    assert_eq!(ptys(&rt.before), ptys(&rt.after));
}

/// Unmounts a devpts the test mounted, however the test ends.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Two devpts instances (the host's /dev/pts and a `newinstance` mount)
/// each with a pty of the same index: two pairs, each made again in its
/// own instance with its own window size, not one pair for both.
#[test]
fn ptys_of_two_devpts_instances_round_trip() {
    let mnt = std::env::temp_dir()
        .join("cr-engine-tests")
        .join(format!("tty-instances-{}", std::process::id()))
        .join("pts2");
    let _unmount = Unmount(mnt.clone());
    let rt = round_trip(
        "tty-instances",
        r#"
import termios
TIOCGPTN, TIOCSPTLCK = 0x80045430, 0x40045431
PTS2 = os.path.join(DIR, "pts2")
os.mkdir(PTS2)
r = libc.mount(b"devpts", PTS2.encode(), b"devpts", 0, b"newinstance,ptmxmode=0666")
expect(r == 0, "mount devpts: errno %d" % ctypes.get_errno())
def index(m):
    return struct.unpack("I", fcntl.ioctl(m, TIOCGPTN, b"\0" * 4))[0]
m1, s1 = os.openpty()
k = index(m1)
spare = []
while True:
    m2 = os.open(os.path.join(PTS2, "ptmx"), os.O_RDWR | os.O_NOCTTY)
    fcntl.ioctl(m2, TIOCSPTLCK, struct.pack("i", 0))
    if index(m2) == k:
        break
    spare.append(m2)
for m in spare: os.close(m)
s2 = os.open(os.path.join(PTS2, str(k)), os.O_RDWR | os.O_NOCTTY)
fcntl.ioctl(s1, termios.TIOCSWINSZ, struct.pack("HHHH", 11, 12, 0, 0))
fcntl.ioctl(s2, termios.TIOCSWINSZ, struct.pack("HHHH", 21, 22, 0, 0))
"#,
        r#"
import termios
def size(s):
    return struct.unpack("HHHH", fcntl.ioctl(s, termios.TIOCGWINSZ, b"\0" * 8))[:2]
expect(size(s1) == (11, 12), "host pty size %r" % (size(s1),))
expect(size(s2) == (21, 22), "second instance's pty size %r" % (size(s2),))
expect(os.fstat(s2).st_dev == os.stat(PTS2).st_dev, "slave 2 is not in the second instance")
expect(os.fstat(s1).st_dev == os.stat("/dev/pts").st_dev, "slave 1 is not in /dev/pts")
expect(index(m1) == k and index(m2) == k, "indexes %d %d, were %d" % (index(m1), index(m2), k))
os.write(m1, b"one\n"); os.write(m2, b"two\n")
expect(os.read(s1, 10) == b"one\n", "pair 1 is connected")
expect(os.read(s2, 10) == b"two\n", "pair 2 is connected")
"#,
    );
    let ptys = |c: &Checkpoint| {
        pty_objects(c)
            .into_iter()
            .map(|(id, p)| (id >> 32, p.index, p.devpts.clone(), p.winsize.clone()))
            .collect::<Vec<_>>()
    };
    let before = ptys(&rt.before);
    assert_eq!(before.len(), 2, "{before:?}");
    assert_eq!(before[0].1, before[1].1, "the same index in both");
    assert_eq!(before[1].2, mnt.to_string_lossy());
    assert_eq!(before, ptys(&rt.after));
}
