//! Round trip of kind "tree": a child in its own process group, a zombie
//! with its exit status, parent links.

use crate::kinds::testkit::round_trip;
use cr_image::model::ProcState;

#[test]
fn children_groups_and_a_zombie_round_trip() {
    let rt = round_trip(
        "tree",
        r#"
z = os.fork()
if z == 0:
    os._exit(7)
kid = os.fork()
if kid == 0:
    os.setpgid(0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    while True:
        time.sleep(1)
while open("/proc/%d/stat" % z).read().split(") ")[1][0] != "Z":
    time.sleep(0.01)
while os.getpgid(kid) != kid:
    time.sleep(0.01)
"#,
        r#"
expect(os.getpgid(kid) == kid, "the child's group")
expect(int(open("/proc/%d/stat" % kid).read().split(") ")[1].split()[1]) == os.getpid(), "the child's parent")
pid, status = os.waitpid(z, 0)
expect(pid == z and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 7, "the zombie's status %r" % (status,))
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
"#,
    );
    let (a, b) = (&rt.before, &rt.after);
    assert_eq!(a.processes.len(), 3);
    assert_eq!(b.processes.len(), 3);
    for (x, y) in a.processes.iter().zip(&b.processes) {
        assert_eq!(
            (x.pid, x.ppid, x.pgid, x.sid, x.state),
            (y.pid, y.ppid, y.pgid, y.sid, y.state)
        );
    }
    assert!(a.processes.iter().any(|p| p.state
        == ProcState::Zombie {
            exit_status: 7 << 8
        }));
}

/// A zombie that led its own process group and exits with a signal other
/// than SIGCHLD (a "clone" child: only waitpid with __WCLONE sees it), and
/// a child stopped by SIGTSTP (job control): after the restore the zombie
/// is in its group with its exit signal, and the child is stopped again by
/// SIGTSTP, which its parent's waitpid(WUNTRACED) reports.
#[test]
fn zombie_group_exit_signal_and_tstp_stop_round_trip() {
    let rt = round_trip(
        "tree-stops",
        r#"
WCLONE = -0x80000000                               # __WCLONE as a C int
signal.signal(signal.SIGUSR2, signal.SIG_IGN)
libc.syscall.restype = ctypes.c_long
z = libc.syscall(56, signal.SIGUSR2, 0, 0, 0, 0)   # clone: exit signal SIGUSR2
if z == 0:
    libc.setpgid(0, 0)
    libc._exit(5)
stopped = os.fork()
if stopped == 0:
    os.setpgid(0, 0)
    os.kill(os.getpid(), signal.SIGTSTP)
    os._exit(0)
def state(pid):
    return open("/proc/%d/stat" % pid).read().split(") ")[1][0]
# Wait (without reaping: WNOWAIT) for the clone to exit and the child to stop.
os.waitid(os.P_PID, z, os.WEXITED | os.WNOWAIT | WCLONE)
os.waitid(os.P_PID, stopped, os.WSTOPPED | os.WNOWAIT)
expect(state(z) == "Z" and os.getpgid(z) == z, "the zombie is not ready")
expect(state(stopped) == "T", "the child did not stop")
"#,
        r#"
expect(os.getpgid(z) == z, "the zombie's group %d" % os.getpgid(z))
try:
    r = os.waitpid(z, os.WNOHANG)
    expect(False, "waitpid without __WCLONE saw the clone child: %r" % (r,))
except ChildProcessError:
    pass
pid, status = os.waitpid(z, WCLONE)
expect(pid == z and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 5, "the zombie's status %r" % (status,))
expect(state(stopped) == "T", "the stopped child runs: %s" % state(stopped))
pid, status = os.waitpid(stopped, os.WUNTRACED)
expect(pid == stopped and os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGTSTP,
       "the stopped child's status %r" % (status,))
os.kill(stopped, signal.SIGCONT)
pid, status = os.waitpid(stopped, 0)
expect(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child after SIGCONT %r" % (status,))
"#,
    );
    let states = |c: &cr_image::model::Checkpoint| {
        c.processes
            .iter()
            .map(|p| (p.state, p.exit_signal, p.pgid == p.pid))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        states(&rt.before),
        vec![
            (ProcState::Running, libc::SIGCHLD, false),
            (
                ProcState::Zombie {
                    exit_status: 5 << 8
                },
                libc::SIGUSR2,
                true
            ),
            (
                ProcState::Stopped {
                    signal: libc::SIGTSTP
                },
                libc::SIGCHLD,
                true
            ),
        ]
    );
    assert_eq!(states(&rt.before), states(&rt.after));
}

/// Children made with raw clone() (no CLONE_VM) that serve commands of
/// the parent over pipes: `spawn(flags)` returns (command fd, answer fd,
/// pid); `ask(child, line)` its answer. A child ends when its parent is
/// gone.
const SERVING: &str = r#"
import select
libc.syscall.restype = ctypes.c_long
D = os.path.realpath(DIR)
def serve(cmd_r, ans_w):
    libc.prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG: SIGKILL
    parent = os.getppid()
    while True:
        if not select.select([cmd_r], [], [], 0.5)[0]:
            if os.getppid() != parent:
                os._exit(0)
            continue
        line = b""
        while not line.endswith(b"\n"):
            line += os.read(cmd_r, 1)
        op, _, arg = line.decode().strip().partition(" ")
        try:
            if op == "link":
                r = os.readlink("/proc/self/fd/" + arg)
            elif op == "open":
                r = str(os.open(os.path.join(D, arg), os.O_CREAT | os.O_RDWR, 0o644))
            elif op == "read":
                fd, n = arg.split()
                r = os.read(int(fd), int(n)).decode()
            elif op == "cwd":
                r = os.getcwd()
            elif op == "umask":
                m = os.umask(0)
                os.umask(m)
                r = oct(m)
            elif op == "chdir":
                os.chdir(arg)
                r = "ok"
            elif op == "setumask":
                os.umask(int(arg, 8))
                r = "ok"
            elif op == "spawn":
                c = spawn(int(arg))
                r = "%d %d %d" % c
            elif op == "chroot":
                os.chroot(arg)
                r = "ok"
            elif op == "unshare":
                r = str(libc.unshare(int(arg)))
            else:
                r = "error: no such command " + op
        except Exception as e:
            r = "error " + repr(e)
        os.write(ans_w, (r + "\n").encode())
def spawn(flags):
    cmd = os.pipe()
    ans = os.pipe()
    pid = libc.syscall(56, flags | 17, 0, 0, 0, 0)   # clone(flags | SIGCHLD)
    if pid == 0:
        serve(cmd[0], ans[1])
    expect(pid > 0, "clone: %d" % ctypes.get_errno())
    return (cmd[1], ans[0], pid)
def ask(c, line):
    os.write(c[0], (line + "\n").encode())
    out = b""
    while not out.endswith(b"\n"):
        out += os.read(c[1], 1)
    return out.decode().strip()
def umask():
    m = os.umask(0)
    os.umask(m)
    return m
"#;

/// A child sharing the parent's fd table (CLONE_FILES), a grandchild it
/// made with CLONE_FILES too (the same table), and a child sharing the
/// parent's working directory and umask (CLONE_FS), each set up before
/// the checkpoint.
const SHARING_SETUP: &str = r#"
A = spawn(0x400)                  # CLONE_FILES
B = spawn(0x200)                  # CLONE_FS
G = tuple(int(x) for x in ask(A, "spawn %d" % 0x400).split())
ua = ask(A, "umask")
fa = int(ask(A, "open from-child"))
os.write(fa, b"0123456789")
os.lseek(fa, 2, os.SEEK_SET)
expect(ask(A, "read %d 3" % fa) == "234", "the child does not read at the shared offset")
os.mkdir(os.path.join(D, "sub"))
os.mkdir(os.path.join(D, "sub2"))
expect(ask(B, "chdir " + os.path.join(D, "sub")) == "ok", "the fs child's chdir")
expect(ask(B, "setumask 027") == "ok", "the fs child's umask")
expect(os.getcwd() == os.path.join(D, "sub"), "not in the fs child's directory: " + os.getcwd())
expect(umask() == 0o027, "not the fs child's umask")
"#;

/// After the restore: what one opens, closes, reads, the other sees; the
/// working directory and umask go on being shared with the fs child only.
const SHARING_CHECK: &str = r#"
expect(os.readlink("/proc/self/fd/%d" % fa).endswith("from-child"), "the child's fd in our table")
expect(os.lseek(fa, 0, os.SEEK_CUR) == 5, "offset %d, not the child's 5" % os.lseek(fa, 0, os.SEEK_CUR))
expect(ask(G, "read %d 2" % fa) == "56", "the grandchild does not read at the shared offset")
expect(os.lseek(fa, 0, os.SEEK_CUR) == 7, "the grandchild's read did not move our offset")
fp = os.open(os.path.join(D, "from-parent"), os.O_CREAT | os.O_RDWR, 0o644)
expect(ask(A, "link %d" % fp).endswith("from-parent"), "the child does not see our new fd")
expect(ask(G, "link %d" % fp).endswith("from-parent"), "the grandchild does not see our new fd")
expect(not ask(B, "link %d" % fp).endswith("from-parent"), "the fs child (a table of its own) sees our new fd")
fc = int(ask(G, "open from-grandchild"))
expect(os.readlink("/proc/self/fd/%d" % fc).endswith("from-grandchild"), "we do not see the grandchild's new fd")
os.close(fc)
expect(ask(A, "link %d" % fc).startswith("error"), "the child still sees the fd we closed")
expect(os.getcwd() == os.path.join(D, "sub"), "working directory " + os.getcwd())
expect(umask() == 0o027, "umask %o" % umask())
os.chdir(os.path.join(D, "sub2"))
os.umask(0o077)
expect(ask(B, "cwd") == os.path.join(D, "sub2"), "the fs child is not where we went: " + ask(B, "cwd"))
expect(ask(B, "umask") == oct(0o077), "the fs child's umask is not ours: " + ask(B, "umask"))
expect(ask(B, "chdir " + D) == "ok", "the fs child's chdir")
expect(os.getcwd() == D, "the fs child's chdir did not move us: " + os.getcwd())
expect(ask(A, "cwd") == D, "the fd child (its own fs) moved: " + ask(A, "cwd"))
expect(ask(A, "umask") == ua, "the fd child (its own fs) has umask " + ask(A, "umask"))
"#;

/// The sharing of `c` (root, fd child, fs child, grandchild): who shares
/// whose fd table and fs information, and who lists fds.
fn sharing(c: &cr_image::model::Checkpoint) -> Vec<(Option<u32>, Option<u32>, bool)> {
    let pids: Vec<u32> = c.processes.iter().map(|p| p.pid).collect();
    let at = |o: Option<u32>| o.and_then(|o| pids.iter().position(|&p| p == o).map(|i| i as u32));
    c.processes
        .iter()
        .map(|p| (at(p.fd_table_of), at(p.fs_of), !p.fds.is_empty()))
        .collect()
}

/// The image of the sharing tree: the root owns both, the fd child and
/// the grandchild share its fd table (and list no fd), the fs child its
/// working directory and umask.
fn assert_sharing(c: &cr_image::model::Checkpoint) {
    assert_eq!(
        sharing(c),
        vec![
            (None, None, true),
            (Some(0), None, false),
            (None, Some(0), true),
            (Some(0), None, false),
        ]
    );
}

/// A child sharing its parent's fd table (CLONE_FILES, no CLONE_VM), a
/// grandchild made by it with CLONE_FILES, and a child sharing the
/// parent's working directory and umask (CLONE_FS): checkpointed with
/// --kill and restored, they share them again — what one opens or
/// closes the other sees, the offsets are shared, a chdir or umask in one
/// is the other's — and the second checkpoint (of the restored tree, with
/// --verify) finds the same sharing. Before, they were refused.
#[test]
fn shared_fd_table_and_fs_round_trip() {
    let setup = format!("{SERVING}{SHARING_SETUP}");
    let rt = round_trip("shared-tables", &setup, SHARING_CHECK);
    assert_sharing(&rt.before);
    assert_sharing(&rt.after);
}

/// The same tree checkpointed and left running (with --verify): it goes on
/// sharing its tables.
#[test]
fn shared_fd_table_and_fs_continue() {
    let setup = format!("{SERVING}{SHARING_SETUP}");
    let ck = crate::kinds::testkit::continued("shared-tables-cont", &setup, SHARING_CHECK);
    assert_sharing(&ck);
}

/// A child sharing the root's working directory and root (CLONE_FS) that
/// changed root (chroot) into the program's directory: after the restore
/// both are in the chroot, in the same directory, and a chdir of one
/// moves the other.
#[test]
fn shared_fs_in_a_chroot_round_trip() {
    let rt = round_trip(
        "shared-fs-chroot",
        &format!(
            "{SERVING}{}",
            r#"
B = spawn(0x200)                  # CLONE_FS
os.mkdir(os.path.join(D, "sub"))
expect(ask(B, "chdir " + os.path.join(D, "sub")) == "ok", "the fs child's chdir")
expect(ask(B, "chroot " + D) == "ok", "the fs child's chroot")
expect(os.getcwd() == "/sub", "not in the fs child's chroot: " + os.getcwd())
"#
        ),
        r#"
expect(os.getcwd() == "/sub", "working directory " + os.getcwd())
expect(os.path.exists("/program.py"), "not in the chroot")
expect(ask(B, "cwd") == "/sub", "the fs child is in " + ask(B, "cwd"))
os.chdir("/")
expect(ask(B, "cwd") == "/", "the fs child did not follow our chdir: " + ask(B, "cwd"))
"#,
    );
    for c in [&rt.before, &rt.after] {
        let (root, child) = (&c.processes[0], &c.processes[1]);
        assert_eq!(child.fs_of, Some(root.pid));
        assert_eq!(child.task.root, root.task.root);
        assert!(
            root.task.root.contains("shared-fs-chroot"),
            "{}",
            root.task.root
        );
    }
}

/// A grandchild sharing the root's fd table that its parent no longer
/// shares (the parent made it with CLONE_FILES, then unshare(CLONE_FILES)):
/// a restore could not create it with that table; refused by name, and
/// the tree runs on sharing it.
#[test]
fn table_shared_past_the_parent_is_refused() {
    let err = crate::kinds::testkit::refused(
        "shared-past-parent",
        &format!(
            "{SERVING}{}",
            r#"
A = spawn(0x400)
G = tuple(int(x) for x in ask(A, "spawn %d" % 0x400).split())
expect(ask(A, "unshare %d" % 0x400) == "0", "unshare")
"#
        ),
        r#"
fp = os.open(os.path.join(D, "late"), os.O_CREAT | os.O_RDWR, 0o644)
expect(ask(G, "link %d" % fp).endswith("late"), "the grandchild does not see our fd")
expect(not ask(A, "link %d" % fp).endswith("late"), "the child (its own table now) sees our fd")
"#,
        "which its parent",
    );
    assert!(err.contains("file descriptor table (CLONE_FILES)"), "{err}");
}

/// A child stopped by SIGSTOP that was sent SIGSTOP again while stopped
/// (pending: SIGSTOP cannot be blocked, so the checkpoint's injected calls
/// meet it), and a grandchild stopped by SIGTSTP in the group its parent
/// leads (not orphaned: that parent's parent is in another group of the
/// session). Both stop again with their signal after the restore, which
/// their parents' waits report; SIGCONT lets them finish.
#[test]
fn pending_sigstop_and_tstp_in_parents_group_round_trip() {
    let rt = round_trip(
        "tree-pending-stop",
        r#"
r, w = os.pipe()
stopped = os.fork()
if stopped == 0:
    os.close(w)
    os._exit(0 if os.read(r, 1) == b"x" else 1)
os.close(r)
os.kill(stopped, signal.SIGSTOP)
os.waitid(os.P_PID, stopped, os.WSTOPPED | os.WNOWAIT)
os.kill(stopped, signal.SIGSTOP)                   # pending while stopped
os.write(w, b"x")
# A group leader whose child stops by SIGTSTP; it reports what it sees
# through a pipe.
rr, rw = os.pipe()
leader = os.fork()
if leader == 0:
    os.setpgid(0, 0)
    kid = os.fork()
    if kid == 0:
        os.kill(os.getpid(), signal.SIGTSTP)
        os._exit(0)
    os.waitid(os.P_PID, kid, os.WSTOPPED | os.WNOWAIT)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    os.write(rw, b"s")
    signal.sigwait({signal.SIGUSR2})
    st = os.waitid(os.P_PID, kid, os.WSTOPPED | os.WNOWAIT)
    os.write(rw, bytes([st.si_status]))
    os.kill(kid, signal.SIGCONT)
    os.waitpid(kid, 0)
    os._exit(0)
expect(os.read(rr, 1) == b"s", "the grandchild did not stop")
def state(pid):
    return open("/proc/%d/stat" % pid).read().split(") ")[1][0]
expect(state(stopped) == "T", "the child did not stop")
"#,
        r#"
expect(state(stopped) == "T", "the stopped child runs: %s" % state(stopped))
pid, status = os.waitpid(stopped, os.WUNTRACED)
expect(os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP, "the child's status %r" % (status,))
os.kill(stopped, signal.SIGCONT)
pid, status = os.waitpid(stopped, 0)
expect(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, "the child after SIGCONT %r" % (status,))
os.kill(leader, signal.SIGUSR2)
sig = os.read(rr, 1)
expect(sig == bytes([signal.SIGTSTP]), "the grandchild's stop signal %r" % (sig,))
os.waitpid(leader, 0)
"#,
    );
    let stops = |c: &cr_image::model::Checkpoint| {
        c.processes
            .iter()
            .filter_map(|p| match p.state {
                ProcState::Stopped { signal } => Some(signal),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(stops(&rt.before), vec![libc::SIGSTOP, libc::SIGTSTP]);
    assert_eq!(stops(&rt.before), stops(&rt.after));
}

/// A process group whose leader is gone: a child made it (setpgid), forked
/// two processes as its siblings (CLONE_PARENT: the root's children), one
/// of which exits (a zombie), and exited itself (reaped). Both stay in the
/// group, which a helper leads for the time they join it at the restore.
#[test]
fn group_whose_leader_is_gone_round_trip() {
    let rt = round_trip(
        "tree-leaderless-group",
        r#"
libc.syscall.restype = ctypes.c_long
r, w = os.pipe()
leader = os.fork()
if leader == 0:
    os.setpgid(0, 0)
    z = libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0)   # clone(CLONE_PARENT | SIGCHLD)
    if z == 0:
        libc._exit(3)
    live = libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0)
    if live == 0:
        libc.prctl(1, 9, 0, 0, 0)                   # PR_SET_PDEATHSIG: SIGKILL
        while True:
            libc.pause()
    os.write(w, struct.pack("ii", z, live))
    libc._exit(0)
z, live = struct.unpack("ii", os.read(r, 8))
os.waitpid(leader, 0)
os.waitid(os.P_PID, z, os.WEXITED | os.WNOWAIT)
expect(os.getpgid(z) == leader and os.getpgid(live) == leader, "setup: the groups")
"#,
        r#"
expect(os.getpgid(live) == leader, "the live one's group %d, was %d" % (os.getpgid(live), leader))
expect(os.getpgid(z) == leader, "the zombie's group %d, was %d" % (os.getpgid(z), leader))
pid, status = os.waitpid(z, 0)
expect(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3, "the zombie's status %r" % (status,))
try:
    os.waitpid(leader, os.WNOHANG)
    expect(False, "the helper is our child")
except ChildProcessError:
    pass
os.kill(live, signal.SIGKILL)
os.waitpid(live, 0)
"#,
    );
    let groups = |c: &cr_image::model::Checkpoint| {
        c.processes
            .iter()
            .map(|p| (p.pid, p.pgid, p.state))
            .collect::<Vec<_>>()
    };
    let before = groups(&rt.before);
    assert_eq!(before.len(), 3);
    assert!(before[1..]
        .iter()
        .all(|&(pid, pgid, _)| pgid != pid && pgid != before[0].1));
    assert_eq!(before, groups(&rt.after));
}

/// A child waiting in vfork() for its own child (which shares its memory
/// until it calls exec or exits) is refused at once, by name, before
/// anything is stopped (the kernel's vfork wait is woken by nothing but a
/// fatal signal: a freeze would wait for the stop in vain); the three run
/// on untraced, the vfork still pending.
#[test]
fn vfork_parent_is_refused_at_once() {
    crate::kinds::testkit::refused(
        "tree-vfork",
        r#"
libc.syscall.restype = ctypes.c_long
waiter = os.fork()
if waiter == 0:
    libc.prctl(1, 9, 0, 0, 0)                      # PR_SET_PDEATHSIG: SIGKILL
    if libc.syscall(58) == 0:                      # vfork: the child runs on our memory
        while True:
            libc.pause()
    libc._exit(0)
def children(pid):
    return open("/proc/%d/task/%d/children" % (pid, pid)).read().split()
while not children(waiter):
    time.sleep(0.01)
kid = int(children(waiter)[0])
def traced(pid):
    return "TracerPid:\t0\n" not in open("/proc/%d/status" % pid).read()
"#,
        r#"
expect(children(waiter) == [str(kid)], "the vfork child %r" % children(waiter))
expect(not traced(waiter) and not traced(kid), "left traced")
expect(open("/proc/%d/stat" % waiter).read().split(") ")[1][0] == "D", "the parent no longer waits in vfork")
os.kill(waiter, signal.SIGKILL)
os.waitpid(waiter, 0)
os.kill(kid, signal.SIGKILL)
"#,
        "waiting in vfork() for its child",
    );
}

/// A child whose main thread exited alone (the exit system call, as
/// pthread_exit in main does) while its other thread runs (zdtm pthread02)
/// is refused by name, before anything is stopped — not taken for a
/// zombie; the child runs on untraced, its thread alive.
#[test]
fn process_whose_main_thread_exited_is_refused() {
    crate::kinds::testkit::refused(
        "tree-dead-leader",
        r#"
import threading
kid = os.fork()
if kid == 0:
    libc.prctl(1, 9, 0, 0, 0)                      # PR_SET_PDEATHSIG: SIGKILL
    threading.Thread(target=lambda: time.sleep(3600), daemon=True).start()
    libc.syscall(60, 0)                            # exit: this thread only
def task_states(pid):
    out = []
    for t in os.listdir("/proc/%d/task" % pid):
        s = open("/proc/%d/task/%s/stat" % (pid, t)).read().split(") ")[1][0]
        out.append((int(t) == pid, s))
    return sorted(out, reverse=True)               # the main thread first
while len(task_states(kid)) != 2 or task_states(kid)[0] != (True, "Z"):
    time.sleep(0.01)
"#,
        r#"
states = task_states(kid)
expect(len(states) == 2 and (True, "Z") in states and any(not m and s != "Z" for m, s in states),
       "the child's threads %r" % states)
other = [t for t in os.listdir("/proc/%d/task" % kid) if int(t) != kid][0]
expect("TracerPid:\t0\n" in open("/proc/%d/task/%s/status" % (kid, other)).read(), "left traced")
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
"#,
        "main thread has exited (pthread_exit) while its other threads run",
    );
}

/// A child in a session whose leader is gone (zdtm session02): a process
/// made a session (setsid), forked a sibling into it (CLONE_PARENT: the
/// root's child), and exited. The restore has the session made again by a
/// helper with the leader's PID, which forks the child with CLONE_PARENT
/// and exits: the child is back in the session and its group, under the
/// root, and the root has no zombie left and got no SIGCHLD.
#[test]
fn child_in_a_session_whose_leader_exited_round_trip() {
    let rt = round_trip(
        "tree-foreign-session",
        r#"
libc.syscall.restype = ctypes.c_long
r, w = os.pipe()
maker = os.fork()
if maker == 0:
    os.setsid()
    kid = libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0)   # clone(CLONE_PARENT | SIGCHLD)
    if kid == 0:
        libc.prctl(1, 9, 0, 0, 0)                   # PR_SET_PDEATHSIG: SIGKILL
        while True:
            libc.pause()
    os.write(w, struct.pack("i", kid))
    libc._exit(0)
kid = struct.unpack("i", os.read(r, 4))[0]
os.waitpid(maker, 0)
chld = [0]
def on_chld(sig, frame):
    chld[0] += 1
signal.signal(signal.SIGCHLD, on_chld)
expect(os.getsid(kid) == maker and os.getsid(0) != maker, "setup: the sessions")
expect(os.getpgid(kid) == maker, "setup: the group")
"#,
        r#"
WALL = 0x40000000
def parent(p):
    return int(open("/proc/%d/stat" % p).read().split(") ")[1].split()[1])
expect(os.getsid(kid) == maker, "the child's session %d, was %d" % (os.getsid(kid), maker))
expect(os.getpgid(kid) == maker, "the child's group %d, was %d" % (os.getpgid(kid), maker))
expect(parent(kid) == os.getpid(), "the child's parent %d" % parent(kid))
kids = open("/proc/%d/task/%d/children" % (os.getpid(), os.getpid())).read().split()
expect(kids == [str(kid)], "the root's children %r" % kids)
expect(os.waitpid(-1, os.WNOHANG | WALL) == (0, 0), "a child of the root to reap")
expect(chld[0] == 0, "the root got %d SIGCHLD" % chld[0])
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
"#,
    );
    assert_eq!(rt.before.processes.len(), 2);
    assert_eq!(tree_ids(&rt.before), tree_ids(&rt.after));
}

/// A daemon's double fork under a subreaper: the root (a child
/// subreaper) forks `b`, which makes a session, forks `c` (which forks
/// `d`, the leader of a group of its own) and `e` (which makes a group,
/// forks `f` into it and exits), then exits: `c` and `f` are the root's
/// children in session `b`, `f` in group `e` whose leader is gone. After
/// the restore (with --verify) all are in session `b` with their groups
/// and parents, and the root has no zombie left.
#[test]
fn daemon_session_under_a_subreaper_round_trip() {
    let rt = round_trip(
        "tree-daemon-session",
        r#"
libc.prctl(36, 1, 0, 0, 0)                          # PR_SET_CHILD_SUBREAPER
r, w = os.pipe()
def hold():
    while True:
        libc.pause()
b = os.fork()
if b == 0:
    os.setsid()
    c = os.fork()
    if c == 0:
        d = os.fork()
        if d == 0:
            os.setpgid(0, 0)
            hold()
        os.write(w, struct.pack("iii", 0, os.getpid(), d))
        hold()
    e = os.fork()
    if e == 0:
        os.setpgid(0, 0)
        f = os.fork()
        if f == 0:
            hold()
        os.write(w, struct.pack("iii", 1, os.getpid(), f))
        os._exit(0)
    os.waitpid(e, 0)
    os._exit(0)
got = dict((t, (x, y)) for t, x, y in (struct.unpack("iii", os.read(r, 12)) for _ in range(2)))
(c, d), (e, f) = got[0], got[1]
os.waitpid(b, 0)
def parent(p):
    return int(open("/proc/%d/stat" % p).read().split(") ")[1].split()[1])
while parent(c) != os.getpid() or parent(f) != os.getpid() or os.getpgid(d) != d:
    time.sleep(0.01)
expect(os.getsid(c) == b and os.getsid(d) == b and os.getsid(f) == b, "setup: the session")
"#,
        r#"
WALL = 0x40000000
def parent(p):
    return int(open("/proc/%d/stat" % p).read().split(") ")[1].split()[1])
me = os.getpid()
for p, s, g, q in ((c, b, b, me), (d, b, d, c), (f, b, e, me)):
    expect(os.getsid(p) == s, "process %d's session %d, was %d" % (p, os.getsid(p), s))
    expect(os.getpgid(p) == g, "process %d's group %d, was %d" % (p, os.getpgid(p), g))
    expect(parent(p) == q, "process %d's parent %d, was %d" % (p, parent(p), q))
kids = sorted(open("/proc/%d/task/%d/children" % (me, me)).read().split())
expect(kids == sorted([str(c), str(f)]), "the root's children %r" % kids)
expect(os.waitpid(-1, os.WNOHANG | WALL) == (0, 0), "a child of the root to reap")
for p in (d, c, f):
    os.kill(p, signal.SIGKILL)
os.waitpid(c, 0)
os.waitpid(f, 0)
"#,
    );
    assert_eq!(rt.before.processes.len(), 4);
    assert_eq!(tree_ids(&rt.before), tree_ids(&rt.after));
}

/// A child that kept the session its parent, the root, left (the root
/// forked it, then made its own session): the session's leader is alive
/// outside the tree, so no helper could have its PID at a restore.
/// Refused by name before anything is stopped; both run on. The session
/// left is one the program makes (its first process leads it and waits
/// outside the tree): the test runner's own session may have no live
/// leader (CI), or one outside this PID namespace.
#[test]
fn child_in_a_live_session_outside_the_tree_is_refused() {
    crate::kinds::testkit::refused(
        "tree-outside-session",
        r#"
os.setsid()
root = os.fork()
if root != 0:
    os.waitpid(root, 0)
    os._exit(0)
outside = os.getsid(0)
expect(outside == os.getppid(), "setup: the outside session's leader is the parent")
kid = os.fork()
if kid == 0:
    libc.prctl(1, 9, 0, 0, 0)                       # PR_SET_PDEATHSIG: SIGKILL
    while True:
        libc.pause()
os.setsid()
expect(os.getsid(kid) == outside and os.getsid(0) == os.getpid(), "setup: the sessions")
"#,
        r#"
expect(os.getsid(kid) == outside, "the child's session %d, was %d" % (os.getsid(kid), outside))
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
"#,
        "whose leader is alive outside the tree",
    );
}

/// Children forked before their parent made its own session (zdtm
/// session00's CHANGESID and DOUBLE_CHANGESID): `a` forks `g`, then calls
/// setsid; `b` forks `b2`, which forks `g2` and calls setsid, then `b`
/// calls setsid too. `g` and `g2` stay in the root's session, under
/// parents that lead sessions of their own. The restore forks them before
/// their parents' setsid (and `b2` before `b`'s): every process has its
/// parent and session back.
#[test]
fn children_forked_before_their_parents_setsid_round_trip() {
    let rt = round_trip(
        "tree-sessions-after-fork",
        r#"
r, w = os.pipe()
def hold():
    while True:
        libc.pause()
a = os.fork()
if a == 0:
    g = os.fork()
    if g == 0:
        hold()
    os.setsid()
    os.write(w, struct.pack("i", g))
    hold()
b = os.fork()
if b == 0:
    b2 = os.fork()
    if b2 == 0:
        g2 = os.fork()
        if g2 == 0:
            hold()
        os.setsid()
        os.write(w, struct.pack("ii", os.getpid(), g2))
        hold()
    os.setsid()
    hold()
g = struct.unpack("i", os.read(r, 4))[0]
b2, g2 = struct.unpack("ii", os.read(r, 8))
while os.getsid(b) != b:
    time.sleep(0.01)
mine = os.getsid(0)
expect(os.getsid(a) == a and os.getsid(b2) == b2, "setup: the new sessions")
expect(os.getsid(g) == mine and os.getsid(g2) == mine, "setup: the old session kept")
"#,
        r#"
def parent(p):
    return int(open("/proc/%d/stat" % p).read().split(") ")[1].split()[1])
expect(os.getsid(0) == mine, "the root's session %d, was %d" % (os.getsid(0), mine))
for p, s in ((a, a), (b, b), (b2, b2), (g, mine), (g2, mine)):
    expect(os.getsid(p) == s, "process %d's session %d, was %d" % (p, os.getsid(p), s))
for p, q in ((a, os.getpid()), (b, os.getpid()), (g, a), (b2, b), (g2, b2)):
    expect(parent(p) == q, "process %d's parent %d, was %d" % (p, parent(p), q))
for p in (g, g2, b2, a, b):
    os.kill(p, signal.SIGKILL)
os.waitpid(a, 0)
os.waitpid(b, 0)
"#,
    );
    assert_eq!(rt.before.processes.len(), 6);
    assert_eq!(tree_ids(&rt.before), tree_ids(&rt.after));
}

/// [`super::early_children`] on shapes no workload makes easily: two
/// foreign sessions under one leader, a root leader whose child kept the
/// session it left, and a leader two levels up.
#[test]
fn early_children_plan() {
    use super::{early_children, InSession};
    let p = |pid, ppid, sid| InSession {
        pid,
        ppid,
        sid,
        zombie: false,
        exit_signal: libc::SIGCHLD,
    };
    // 10 (session 1) forks 11 and 12; 11 forks 13 in session 1, then
    // makes session 11; 12 is in session 1.
    let ok = [p(10, 1, 1), p(11, 10, 11), p(12, 10, 1), p(13, 11, 1)];
    assert_eq!(
        early_children(&ok)
            .unwrap()
            .early
            .into_iter()
            .collect::<Vec<_>>(),
        [13]
    );
    // 20 leads session 20; 21 (session 20) forked 22 and 23; 22 kept
    // session 20 under a leader 21 ... whose other child 23 is in session
    // 5, whose leader is gone: had from a helper.
    let two = [p(20, 1, 20), p(21, 20, 21), p(22, 21, 20), p(23, 21, 5)];
    let plan = early_children(&two).unwrap();
    assert_eq!(plan.early.into_iter().collect::<Vec<_>>(), [22]);
    assert_eq!(plan.helpers.len(), 1);
    // ... in the root's session 1 instead: 21 cannot be born in both.
    let two = [
        p(19, 1, 1),
        p(20, 19, 20),
        p(21, 20, 21),
        p(22, 21, 20),
        p(23, 21, 1),
    ];
    let (pid, why) = early_children(&two).unwrap_err();
    assert_eq!(pid, 21, "{why}");
    assert!(why.contains("two sessions"), "{why}");
    // The root made its own session after forking a child that kept the
    // old one, outside the tree: a helper's (whether that session's
    // leader is gone is the checkpoint's question, `capture`).
    let root = [p(30, 1, 30), p(31, 30, 7)];
    let helper = |sid, parent, children| super::SessionHelper {
        sid,
        parent,
        children,
    };
    assert_eq!(
        early_children(&root).unwrap().helpers,
        [helper(7, 30, vec![31])]
    );
    // A chain: 40 forks 41, 41 forks 42 (session 1), 41 then 40 make their own.
    let chain = [p(40, 1, 40), p(41, 40, 41), p(42, 41, 1)];
    assert_eq!(
        early_children(&chain).unwrap().helpers,
        [helper(1, 41, vec![42])]
    );
    // The root leads its session; its child is in the session of its
    // sibling, who leads it: refused at the root.
    let root = [p(30, 1, 30), p(31, 30, 32), p(32, 30, 32)];
    assert_eq!(early_children(&root).unwrap_err().0, 30);
    let chain = [p(39, 1, 1), p(40, 39, 40), p(41, 40, 41), p(42, 41, 1)];
    assert_eq!(
        early_children(&chain)
            .unwrap()
            .early
            .into_iter()
            .collect::<Vec<_>>(),
        [41, 42]
    );
    // A session whose leader (9) is gone: a helper forks 52 and 53 for 51.
    let gone = [
        p(50, 1, 1),
        p(51, 50, 1),
        p(52, 51, 9),
        p(53, 51, 9),
        p(54, 52, 9),
    ];
    let plan = early_children(&gone).unwrap();
    assert!(plan.early.is_empty());
    assert_eq!(
        plan.helpers,
        [super::SessionHelper {
            sid: 9,
            parent: 51,
            children: vec![52, 53]
        }]
    );
    // ... a process under one of them, forked before its parent made its
    // own session, is forked before that parent's setsid.
    let under = [
        p(50, 1, 1),
        p(51, 50, 1),
        p(52, 51, 9),
        p(53, 52, 53),
        p(54, 53, 9),
    ];
    let plan = early_children(&under).unwrap();
    assert_eq!(plan.early.into_iter().collect::<Vec<_>>(), [54]);
    assert_eq!(plan.helpers.len(), 1);
    // ... once only: children of two parents in it are refused.
    let two = [p(50, 1, 1), p(51, 50, 1), p(52, 51, 9), p(53, 50, 9)];
    let (pid, why) = early_children(&two).unwrap_err();
    assert_eq!(pid, 53);
    assert!(why.contains("another parent"), "{why}");
    // ... and a child with another exit signal than SIGCHLD.
    let mut odd = p(52, 51, 9);
    odd.exit_signal = libc::SIGUSR2;
    let (pid, why) = early_children(&[p(50, 1, 1), p(51, 50, 1), odd]).unwrap_err();
    assert_eq!(pid, 52);
    assert!(why.contains("exit signal"), "{why}");
    // A session whose leader is in the tree but no ancestor: refused.
    let (pid, why) = early_children(&[p(50, 1, 1), p(51, 50, 51), p(52, 50, 51)]).unwrap_err();
    assert_eq!(pid, 52);
    assert!(why.contains("other than its parent"), "{why}");
    assert!(why.contains("no ancestor"), "{why}");
}

/// A tree whose root leads its process group, of which a process outside
/// the tree is still a member (a daemon the root's child forked before it
/// exited, now a child of init): the kernel keeps the root's number taken
/// while that group lives, so no process can be made with it. The restore
/// is refused with one line naming that process, not "pid in use" by
/// nobody, and leaves nothing running.
#[test]
fn pid_kept_by_a_group_outside_the_tree_is_named() {
    let daemon = std::cell::Cell::new(0);
    let err = crate::kinds::testkit::restore_refused(
        "tree-group-kept-outside",
        r#"
os.setpgid(0, 0)
r, w = os.pipe()
c = os.fork()
if c == 0:
    d = os.fork()
    if d == 0:
        libc.prctl(1, 0, 0, 0, 0)
        while True:
            libc.pause()
    os.write(w, struct.pack("i", d))
    os._exit(0)
d = struct.unpack("i", os.read(r, 4))[0]
os.waitpid(c, 0)
write_in_dir("daemon", str(d))
expect(os.getpgid(d) == os.getpid(), "setup: the daemon in our group")
"#,
        "process group of process",
        |dir| {
            let d: i32 = std::fs::read_to_string(dir.join("daemon"))
                .expect("the daemon's pid")
                .trim()
                .parse()
                .expect("a pid");
            daemon.set(d);
            let _ = cr_sys::ptrace::kill(d, libc::SIGKILL);
        },
    );
    assert!(err.contains(&format!("process {}", daemon.get())), "{err}");
}

/// Each process's PID, parent, group, session and exit signal, sorted by
/// PID.
fn tree_ids(c: &cr_image::model::Checkpoint) -> Vec<(u32, u32, u32, u32, i32)> {
    let mut v: Vec<_> = c
        .processes
        .iter()
        .map(|p| (p.pid, p.ppid, p.pgid, p.sid, p.exit_signal))
        .collect();
    v.sort();
    v
}

/// A program started in the group of a process outside the tree (a
/// script's, a shell's), with a child in that group too, restored from
/// another group (a terminal, `timeout`, the agent): both come back in the
/// restorer's group and session, which `--verify` accepts, and run on.
#[test]
fn group_led_outside_restored_from_another_group_round_trip() {
    use std::os::unix::process::CommandExt;
    let mut leader = std::process::Command::new("sleep")
        .arg("600")
        .process_group(0)
        .spawn()
        .expect("sleep");
    let group = leader.id() as i32;
    let rt = crate::kinds::testkit::round_trip_spawned(
        "tree-group-led-outside",
        r#"
first_group = os.getpgid(0)
kid = os.fork()
if kid == 0:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
    while True:
        time.sleep(1)
expect(os.getpgid(kid) == first_group, "setup: the child in our group")
"#,
        r#"
g = os.getpgid(0)
expect(g == os.getpgid(os.getppid()), "not in the restorer's group: %d" % g)
expect(os.getsid(0) == os.getsid(os.getppid()), "not in the restorer's session")
expect(os.getpgid(kid) == g, "the child's group %d, ours %d" % (os.getpgid(kid), g))
expect(int(open("/proc/%d/stat" % kid).read().split(") ")[1].split()[1]) == os.getpid(), "the child's parent")
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
"#,
        |cmd| {
            cmd.process_group(group);
        },
    );
    let _ = leader.kill();
    let _ = leader.wait();
    assert_eq!(rt.before.processes[0].pgid, group as u32);
    assert_eq!(rt.before.processes.len(), 2);
    assert_eq!(rt.after.processes.len(), 2);
}
