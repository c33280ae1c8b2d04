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

/// What `f` takes from each pty object of an image.
fn of_ptys<T>(c: &Checkpoint, f: impl Fn(&Pty) -> T) -> Vec<T> {
    pty_objects(c).into_iter().map(|(_, p)| f(p)).collect()
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
    let ptys = |c: &Checkpoint| of_ptys(c, |p| (p.index, p.termios.clone(), p.winsize.clone()));
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

/// The queues of a pty pair as the image holds them: complete lines of
/// input, the rest of the input, output, packet mode.
type Queues = (Vec<Vec<u8>>, Vec<u8>, Vec<u8>, bool);

fn queues(c: &Checkpoint) -> Vec<Queues> {
    of_ptys(c, |p| {
        (
            p.input_lines.clone(),
            p.input.clone(),
            p.output.clone(),
            p.packet,
        )
    })
}

/// Reading helpers of the programs below: `read_exactly` waits (with a
/// deadline) for `n` bytes; `read_now` takes what a non-blocking read
/// gives (None: nothing to read).
const READERS: &str = r#"
import select
def read_exactly(fd, n, packet=False):
    out, end = b"", time.time() + 20
    while len(out) < n and time.time() < end:
        if select.select([fd], [], [], 0.5)[0]:
            b = os.read(fd, 65536)
            if packet:
                b = b[1:] if b[:1] == b"\0" else b""
            out += b
    return out
def read_now(fd):
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
def queued(fd):
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]
def wait_queued(fd, n):
    end = time.time() + 20
    while queued(fd) < n and time.time() < end:
        time.sleep(0.01)
    return queued(fd)
"#;

/// A canonical terminal with echo: lines typed on the master and not yet
/// read (one ended by a newline the line discipline made from a CR, one by
/// EOF, one of EOF alone), a line half typed (with an erase in it), and
/// output of the slave (with the echoes) the master has not read. After
/// the restore and a checkpoint that continues, each read gives what it
/// would have: the lines one by one, the half line only once completed,
/// nothing echoed or translated twice.
#[test]
fn pty_queued_canonical_input_and_output_round_trip() {
    let rt = round_trip(
        "tty-queued",
        &format!(
            "import termios\n{READERS}{}",
            r#"
m, s = os.openpty()
attrs = termios.tcgetattr(s)
expect(attrs[3] & termios.ICANON and attrs[3] & termios.ECHO, "a canonical terminal with echo")
os.write(m, b"first line\r" + b"eof-ended\x04" + b"\x04" + b"partial\x7fL")
ECHO = b"first line\r\neof-endedpartial\x08 \x08L"
expect(wait_queued(m, len(ECHO)) == len(ECHO), "echo of the typed input")
os.write(s, b"from the slave\n")
OUTPUT = ECHO + b"from the slave\r\n"
expect(wait_queued(m, len(OUTPUT)) == len(OUTPUT), "the slave's output")
if problems:
    raise SystemExit("setup: " + "; ".join(problems))
"#
        ),
        r#"
expect(termios.tcgetattr(s) == attrs, "terminal settings")
os.set_blocking(s, False)
os.set_blocking(m, False)
expect(read_now(m) == OUTPUT, "the master's queue")
expect(read_now(s) == b"first line\n", "first line")
expect(read_now(s) == b"eof-ended", "the line ended by EOF")
expect(read_now(s) == b"", "EOF alone")
expect(read_now(s) is None, "the half-typed line is not a line yet")
os.write(m, b"ine\r")
expect(read_exactly(s, 11) == b"partiaLine\n", "the half-typed line, completed")
expect(read_exactly(m, 5) == b"ine\r\n", "the echo of what completes it, once")
"#,
    );
    let q = queues(&rt.before);
    assert_eq!(
        q,
        vec![(
            vec![b"first line\n".to_vec(), b"eof-ended".to_vec(), Vec::new()],
            b"partiaL".to_vec(),
            b"first line\r\neof-endedpartial\x08 \x08Lfrom the slave\r\n".to_vec(),
            false
        )]
    );
    assert_eq!(q, queues(&rt.after));
}

/// A raw terminal holding more than its line discipline does in both
/// directions (the rest waits in the kernel's flip buffers), every byte
/// value but two in its input (^C, ^D, ^S, CR: none acts), the master in
/// packet mode: all of it comes back, in order, once.
#[test]
fn pty_queued_raw_bytes_and_packet_mode_round_trip() {
    let rt = round_trip(
        "tty-queued-raw",
        &format!(
            "import termios, tty\n{READERS}{}",
            r#"
TIOCPKT, TIOCGPKT = 0x5420, 0x80045438
m, s = os.openpty()
tty.setraw(s)
attrs = termios.tcgetattr(s)
fcntl.ioctl(m, TIOCPKT, struct.pack("i", 1))
IN = bytes(b for b in range(256) if b not in (0xfe, 0xff)) * 24
OUT = b"".join(b"output line %05d\n" % i for i in range(600))
os.write(m, IN)
os.write(s, OUT)
wait_queued(s, 4095)
"#
        ),
        r#"
expect(termios.tcgetattr(s) == attrs, "terminal settings")
expect(struct.unpack("i", fcntl.ioctl(m, TIOCGPKT, b"\0" * 4))[0] == 1, "packet mode")
expect(read_exactly(s, len(IN)) == IN, "the slave's input")
expect(read_exactly(m, len(OUT), packet=True) == OUT, "the slave's output")
os.set_blocking(s, False)
expect(read_now(s) is None, "nothing more on the slave")
"#,
    );
    let q = queues(&rt.before);
    assert_eq!(q.len(), 1);
    let (lines, input, output, packet) = &q[0];
    assert!(lines.is_empty() && *packet);
    assert_eq!(input.len(), 254 * 24);
    assert_eq!(output.len(), 18 * 600);
    assert_eq!(q, queues(&rt.after));
}

/// A session whose controlling terminal is a pty of the tree, with a job
/// of its own (another process group) in the foreground: the terminal's
/// foreground group is that job again, not the session leader's.
#[test]
fn pty_foreground_job_round_trip() {
    let rt = round_trip(
        "tty-foreground",
        r#"
import termios
m, s = os.openpty()
r, w = os.pipe()
leader = os.fork()
if leader == 0:
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)         # PR_SET_PDEATHSIG
    os.setsid()
    fcntl.ioctl(s, termios.TIOCSCTTY, 0)
    job = os.fork()
    if job == 0:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
        os.setpgid(0, 0)
        while True:
            signal.pause()
    os.setpgid(job, job)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    os.tcsetpgrp(s, job)
    os.write(w, struct.pack("i", job))
    while True:
        signal.pause()
job = struct.unpack("i", os.read(r, 4))[0]
def fg():
    return struct.unpack("i", fcntl.ioctl(m, termios.TIOCGPGRP, b"\0" * 4))[0]
expect(fg() == job, "setup: foreground group %d, not the job %d" % (fg(), job))
if problems:
    raise SystemExit("; ".join(problems))
"#,
        r#"
expect(fg() == job, "foreground group %d, was the job %d" % (fg(), job))
expect(os.getsid(leader) == leader and os.getpgid(job) == job, "session and job")
"#,
    );
    let fg = |c: &Checkpoint| of_ptys(c, |p| p.fg_pgrp);
    assert_eq!(fg(&rt.before).len(), 1);
    assert_ne!(fg(&rt.before), vec![0]);
    assert_eq!(fg(&rt.before), fg(&rt.after));
}

/// A session leader whose controlling terminal is a pty it has no fd of
/// any more (it closed the slave once the terminal was its; the master is
/// its parent's), with a job of its own in the foreground: after the
/// restore the terminal is the session's again (TIOCGSID on the master,
/// /dev/tty opens in the leader) with the same foreground group.
#[test]
fn controlling_pty_without_an_open_slave_round_trip() {
    let rt = round_trip(
        "tty-ctty-closed",
        r#"
import termios
m, s = os.openpty()
name = os.ttyname(s)
os.close(s)
r, w = os.pipe()
qr, qw = os.pipe()
leader = os.fork()
if leader == 0:
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)         # PR_SET_PDEATHSIG
    os.close(m)
    os.setsid()
    t = os.open(name, os.O_RDWR)                   # the session's terminal now
    job = os.fork()
    if job == 0:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
        os.close(t)
        os.setpgid(0, 0)
        while True:
            signal.pause()
    os.setpgid(job, job)
    signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    os.tcsetpgrp(t, job)
    os.close(t)
    os.write(w, struct.pack("i", job))
    # Asked (a byte on qr) to open /dev/tty: answers 1 if it could.
    while True:
        os.read(qr, 1)
        try:
            os.close(os.open("/dev/tty", os.O_RDWR))
            os.write(w, b"\1")
        except OSError:
            os.write(w, b"\0")
job = struct.unpack("i", os.read(r, 4))[0]
def sid():
    return struct.unpack("i", fcntl.ioctl(m, 0x5429, b"\0" * 4))[0]   # TIOCGSID
def fg():
    return struct.unpack("i", fcntl.ioctl(m, termios.TIOCGPGRP, b"\0" * 4))[0]
expect(sid() == leader, "setup: the terminal's session %d, not %d" % (sid(), leader))
expect(fg() == job, "setup: foreground group %d, not the job %d" % (fg(), job))
if problems:
    raise SystemExit("; ".join(problems))
"#,
        r#"
try:
    expect(sid() == leader, "the terminal's session %d, was %d" % (sid(), leader))
except OSError as e:
    expect(False, "the terminal is no controlling terminal: %r" % e)
expect(fg() == job, "foreground group %d, was the job %d" % (fg(), job))
os.write(qw, b"?")
expect(os.read(r, 1) == b"\1", "the leader cannot open /dev/tty")
"#,
    );
    let fg = |c: &Checkpoint| of_ptys(c, |p| p.fg_pgrp);
    assert_eq!(fg(&rt.before).len(), 1);
    assert_eq!(fg(&rt.before), fg(&rt.after));
    let ctty = |c: &Checkpoint| {
        c.processes
            .iter()
            .map(|p| p.ctty_pty.is_some())
            .collect::<Vec<_>>()
    };
    // The leader's (processes: root, leader, job). Known gap: the job,
    // forked at the restore before its leader took the terminal again,
    // has none (TIOCSCTTY sets the caller's only).
    assert!(ctty(&rt.before)[1]);
    assert_eq!(ctty(&rt.before)[1], ctty(&rt.after)[1]);
}

/// The slave's node keeps the owner and mode the program gave it
/// (grantpt's work), not the restorer's.
#[test]
fn pty_slave_owner_and_mode_round_trip() {
    let rt = round_trip(
        "tty-owner",
        r#"
m, s = os.openpty()
os.fchown(s, 1234, 5)
os.fchmod(s, 0o600)
"#,
        r#"
st = os.fstat(s)
expect((st.st_uid, st.st_gid) == (1234, 5), "owner %d:%d" % (st.st_uid, st.st_gid))
expect(st.st_mode & 0o7777 == 0o600, "mode %o" % (st.st_mode & 0o7777))
st = os.stat(os.ttyname(s))
expect((st.st_uid, st.st_mode & 0o7777) == (1234, 0o600), "the node by its path")
"#,
    );
    let owners = |c: &Checkpoint| of_ptys(c, |p| (p.slave_mode, p.slave_uid, p.slave_gid));
    assert_eq!(owners(&rt.before), vec![(0o600, 1234, 5)]);
    assert_eq!(owners(&rt.before), owners(&rt.after));
}

/// A master in packet mode with a status byte pending, in two pairs: the
/// slave's input flushed and its flow control turned off (FLUSHREAD |
/// NOSTOP) with output queued behind the status; output stopped by ^S
/// (STOP). After the restore, and a checkpoint that continues, each read
/// gives the status byte alone first, then the data; ^Q restarts the
/// stopped one (START).
#[test]
fn pty_packet_mode_status_byte_round_trip() {
    let rt = round_trip(
        "tty-packet-status",
        &format!(
            "import termios\n{READERS}{}",
            r#"
TIOCPKT = 0x5420
FLUSHREAD, FLUSHWRITE, STOP, START, NOSTOP = 0x01, 0x02, 0x04, 0x08, 0x10
def packet_pty():
    m, s = os.openpty()
    fcntl.ioctl(m, TIOCPKT, struct.pack("i", 1))
    return m, s
m1, s1 = packet_pty()
termios.tcflush(s1, termios.TCIFLUSH)
attrs = termios.tcgetattr(s1)
attrs[0] &= ~termios.IXON
termios.tcsetattr(s1, termios.TCSANOW, attrs)
os.write(s1, b"behind the status")
m2, s2 = packet_pty()
attrs2 = termios.tcgetattr(s2)
expect(attrs2[0] & termios.IXON, "IXON on the second pair")
os.write(m2, b"\x13")                              # ^S typed: output stops
def status(m):
    # Waiting for POLLPRI alone may not wake: the kernel wakes the master's
    # readers of a new status with POLLIN only (pty_start).
    expect(select.select([m], [], [m], 10)[2] == [m], "no status pending (POLLPRI)")
    return os.read(m, 100)
wait_queued(m1, 17)
expect(select.select([m2], [], [m2], 10)[2] == [m2], "setup: output not stopped")
"#
        ),
        r#"
expect(status(m1) == bytes([FLUSHREAD | NOSTOP]), "status of pair 1")
expect(read_exactly(m1, 17, packet=True) == b"behind the status", "the data after the status")
expect(termios.tcgetattr(s1) == attrs, "pair 1's settings")
expect(status(m2) == bytes([STOP]), "status of pair 2")
os.set_blocking(s2, False)
try:
    n = os.write(s2, b"x")
except BlockingIOError:
    n = 0
expect(n == 0, "pair 2's output is not stopped")
os.write(m2, b"\x11")                              # ^Q: output starts
expect(status(m2) == bytes([START]), "pair 2 started")
"#,
    );
    let st = |c: &Checkpoint| of_ptys(c, |p| (p.packet, p.packet_status));
    assert_eq!(st(&rt.before), vec![(true, 0x11), (true, 0x04)]);
    assert_eq!(st(&rt.before), st(&rt.after));
}

/// A pty pair whose master the program closed, keeping two fds of its
/// slave (zdtm pty04): the kernel hung the slave up and removed its node.
/// After the restore both fds are of one slave, hung up again (a read
/// ends at once, a write fails with EIO), its node removed, with the mode
/// it had.
#[test]
fn hung_up_pty_slave_round_trip() {
    let rt = round_trip(
        "tty-hung-up",
        r#"
m, s1 = os.openpty()
name = os.ttyname(s1)
s2 = os.open(name, os.O_RDWR | os.O_NOCTTY)
os.chmod(name, 0o600)
os.close(m)
def hung(fd):
    try:
        os.write(fd, b"x")
        return False
    except OSError as e:
        return e.errno == errno.EIO and os.read(fd, 10) == b""
assert hung(s1) and hung(s2)
link = os.readlink("/proc/self/fd/%d" % s1)
assert link.startswith("/dev/pts/") and link.endswith(" (deleted)"), link
"#,
        r#"
for fd in (s1, s2):
    now = os.readlink("/proc/self/fd/%d" % fd)
    expect(now.startswith("/dev/pts/") and now.endswith(" (deleted)"), "fd %d is %s" % (fd, now))
    expect(hung(fd), "fd %d is not hung up" % fd)
    expect(os.fstat(fd).st_mode & 0o7777 == 0o600, "mode %o" % os.fstat(fd).st_mode)
expect(os.fstat(s1).st_rdev == os.fstat(s2).st_rdev, "one slave")
expect(os.fstat(s1).st_ino == os.fstat(s2).st_ino, "one node")
"#,
    );
    let hung = |c: &Checkpoint| of_ptys(c, |p| (p.hung_up, p.slave_mode));
    assert_eq!(hung(&rt.before), vec![(true, 0o600)]);
    assert_eq!(hung(&rt.before), hung(&rt.after));
}

/// A virtual terminal and the console, each opened through a device node
/// of its own (as a daemon opens /dev/tty5 or /dev/console): the same
/// devices after the restore, opened again by path, neither made the
/// process's controlling terminal by that open; and a daemon that leads
/// its session and took a virtual terminal as its controlling terminal
/// has it again.
#[test]
fn console_and_virtual_terminal_opened_by_path_round_trip() {
    let rt = round_trip(
        "tty-vt",
        r#"
import stat
nodes = {}
for name, dev in (("vt5", os.makedev(4, 5)), ("console", os.makedev(5, 1))):
    p = os.path.join(DIR, name)
    os.mknod(p, stat.S_IFCHR | 0o600, dev)
    nodes[name] = (os.open(p, os.O_RDONLY | os.O_NOCTTY), dev)
ctty = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[4]
# A daemon that leads its own session and took a virtual terminal as its
# controlling terminal by opening it.
# (A high number: a host's gettys hold the first ones as their terminals.)
vt6 = os.path.join(DIR, "vt46")
os.mknod(vt6, stat.S_IFCHR | 0o600, os.makedev(4, 46))
r, w = os.pipe()
leader = os.fork()
if leader == 0:
    os.setsid()
    t = os.open(vt6, os.O_RDWR)
    os.write(w, b"x")
    parent = os.getppid()
    while os.getppid() == parent:  # ends with the program
        time.sleep(0.05)
    os._exit(0)
os.read(r, 1)
def tty_nr(pid):
    return int(open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[4])
expect(tty_nr(leader) == os.makedev(4, 46), "the daemon's terminal before")
"#,
        r#"
for name, (fd, dev) in nodes.items():
    expect(os.fstat(fd).st_rdev == dev, name + " is the same device")
expect(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[4] == ctty, "the controlling terminal is as it was")
expect(tty_nr(leader) == os.makedev(4, 46), "the daemon has its virtual terminal again")
os.kill(leader, signal.SIGKILL)
"#,
    );
    let kinds = |c: &Checkpoint| {
        c.processes[0]
            .fds
            .iter()
            .filter(|f| f.path.ends_with("/vt5") || f.path.ends_with("/console"))
            .map(|f| f.kind.name())
            .collect::<Vec<_>>()
    };
    assert_eq!(kinds(&rt.before), ["char_device", "char_device"]);
    let leader = rt.before.processes.iter().find(|p| p.ctty_device != 0);
    assert_eq!(leader.map(|p| p.ctty_device), Some(0x42e));
}
