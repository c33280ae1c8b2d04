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

/// A child cloned with CLONE_FILES (no CLONE_VM) shares its parent's fd
/// table: refused by name (a restore would give each its own table), and
/// the two run on sharing it. Before, the restore gave them two tables
/// and what one opened the other no longer saw.
#[test]
fn child_sharing_the_fd_table_is_refused() {
    let err = crate::kinds::testkit::refused(
        "shared-fdtable",
        r#"
r, w = os.pipe()
child = libc.syscall(56, 0x400 | 17, 0, 0, 0, 0)   # clone(CLONE_FILES | SIGCHLD)
if child == 0:
    libc.prctl(1, 9, 0, 0, 0)   # PR_SET_PDEATHSIG: SIGKILL
    fd = os.open(os.path.join(DIR, "from-child"), os.O_CREAT | os.O_WRONLY)
    os.write(w, struct.pack("i", fd))
    while True: time.sleep(1)
expect(child > 0, "clone: %d" % ctypes.get_errno())
fd = struct.unpack("i", os.read(r, 4))[0]
"#,
        r#"
expect(os.readlink("/proc/self/fd/%d" % fd).endswith("from-child"), "the child's fd in our table")
"#,
        "sharing its file descriptor table (CLONE_FILES) with its parent",
    );
    assert!(err.contains("not supported"), "{err}");
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

/// A child in a session its parent is not in (zdtm session02): a process
/// made a session (setsid), forked a sibling into it (CLONE_PARENT: the
/// root's child), and exited. A restore forks each process from its
/// parent's stub: refused by name before anything is stopped, and the
/// two run on in their sessions.
#[test]
fn child_in_a_session_other_than_its_parents_is_refused() {
    crate::kinds::testkit::refused(
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
expect(os.getsid(kid) == maker and os.getsid(0) != maker, "setup: the sessions")
"#,
        r#"
expect(os.getsid(kid) == maker, "the child's session %d, was %d" % (os.getsid(kid), maker))
os.kill(kid, signal.SIGKILL)
os.waitpid(kid, 0)
"#,
        "other than its parent",
    );
}
