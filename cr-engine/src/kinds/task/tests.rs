//! Round trip of kind "task": working directory, umask, name, personality.

use crate::kinds::testkit::round_trip;

#[test]
fn task_attributes_round_trip() {
    let rt = round_trip(
        "task",
        r#"
os.mkdir(os.path.join(DIR, "work dir"))
os.chdir(os.path.join(DIR, "work dir"))
os.umask(0o027)
libc.prctl(15, b"cr-task-test", 0, 0, 0)          # PR_SET_NAME
libc.personality(0x0040000)                        # ADDR_NO_RANDOMIZE
"#,
        r#"
expect(os.getcwd() == os.path.join(DIR, "work dir"), "cwd " + os.getcwd())
u = os.umask(0); os.umask(u)
expect(u == 0o027, "umask %o" % u)
expect(open("/proc/self/comm").read().strip() == "cr-task-test", "comm")
expect(libc.personality(0xffffffff) & 0x0040000, "personality")
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(
        a.task, b.task,
        "the task section changed across the round trip"
    );
}

/// Scheduling (a policy with SCHED_RESET_ON_FORK, a nice value),
/// oom_score_adj, child-subreaper and THP-disable: what real programs set
/// (batch jobs renice themselves, daemons raise their OOM score or become
/// subreapers, JVMs and databases turn THP off).
#[test]
fn scheduling_and_prctl_switches_round_trip() {
    let rt = round_trip(
        "task-sched",
        r#"
SCHED_BATCH, RESET_ON_FORK = 3, 0x40000000
os.sched_setscheduler(0, SCHED_BATCH | RESET_ON_FORK, os.sched_param(0))
os.setpriority(os.PRIO_PROCESS, 0, 7)
open("/proc/self/oom_score_adj", "w").write("523")
libc.prctl(36, 1, 0, 0, 0)                         # PR_SET_CHILD_SUBREAPER
libc.prctl(41, 1, 0, 0, 0)                         # PR_SET_THP_DISABLE
libc.prctl(29, 61000, 0, 0, 0)                     # PR_SET_TIMERSLACK
libc.syscall(251, 1, 0, 2 << 13 | 6)               # ioprio_set(self, best-effort 6)
"#,
        r#"
pol = libc.syscall(145, 0)                         # sched_getscheduler
expect(pol == 3 | 0x40000000, "policy %#x" % pol)
expect(os.getpriority(os.PRIO_PROCESS, 0) == 7, "nice %d" % os.getpriority(os.PRIO_PROCESS, 0))
adj = open("/proc/self/oom_score_adj").read().strip()
expect(adj == "523", "oom_score_adj " + adj)
v = ctypes.c_int(0)
libc.prctl(37, ctypes.byref(v), 0, 0, 0)           # PR_GET_CHILD_SUBREAPER
expect(v.value == 1, "child subreaper %d" % v.value)
expect(libc.prctl(42, 0, 0, 0, 0) == 1, "THP disabled")
expect(libc.prctl(30, 0, 0, 0, 0) == 61000, "timer slack %d" % libc.prctl(30, 0, 0, 0, 0))
prio = libc.syscall(252, 1, 0)                     # ioprio_get(self)
expect(prio == 2 << 13 | 6, "I/O priority %#x" % prio)
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.task, b.task);
    assert_eq!((a.task.nice, a.task.oom_score_adj), (7, 523));
    assert_eq!((a.task.timer_slack_ns, a.task.ioprio), (61000, 2 << 13 | 6));
}

/// A real-time policy with its priority.
#[test]
fn real_time_policy_round_trip() {
    let rt = round_trip(
        "task-rt",
        r#"
os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(7))
"#,
        r#"
expect(os.sched_getscheduler(0) == os.SCHED_RR, "policy %d" % os.sched_getscheduler(0))
expect(os.sched_getparam(0).sched_priority == 7, "priority %d" % os.sched_getparam(0).sched_priority)
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!((b.task.sched_policy, b.task.sched_priority), (2, 7));
    assert_eq!(a.task, b.task);
}

/// A chrooted process (a jail with a file of its own), its working
/// directory inside the jail: after the restore "/" is the jail again.
#[test]
fn chroot_round_trip() {
    let rt = round_trip(
        "task-chroot",
        r#"
jail = os.path.join(DIR, "jail")
os.makedirs(os.path.join(jail, "inside"))
open(os.path.join(jail, "marker"), "w").write("jail")
jail_id = (os.stat(jail).st_dev, os.stat(jail).st_ino)
os.chroot(jail)
os.chdir("/inside")
"#,
        r#"
st = os.stat("/")
expect((st.st_dev, st.st_ino) == jail_id, "/ is not the jail")
expect(open("/marker").read() == "jail", "the jail's file")
expect(os.getcwd() == "/inside", "cwd " + os.getcwd())
"#,
    );
    let (a, b) = rt.roots();
    assert!(a.task.root.ends_with("/jail"), "root {}", a.task.root);
    assert_eq!(a.task, b.task);
}

/// membarrier registrations of the memory (private expedited, its
/// sync-core flavour, global expedited): without them after a restore,
/// MEMBARRIER_CMD_PRIVATE_EXPEDITED fails with EPERM (a JIT or an RCU
/// library would abort).
#[test]
fn membarrier_registrations_round_trip() {
    let rt = round_trip(
        "task-membarrier",
        r#"
libc.syscall.restype = ctypes.c_long
def mb(cmd):
    return libc.syscall(324, cmd, 0, 0)            # membarrier(cmd, 0, 0)
REG_GLOBAL_EXP, PRIV_EXP, REG_PRIV_EXP, PRIV_SYNC, REG_PRIV_SYNC, GET_REG = 4, 8, 16, 32, 64, 512
expect(mb(PRIV_EXP) == -1 and ctypes.get_errno() == errno.EPERM, "expedited before registering")
for cmd in (REG_GLOBAL_EXP, REG_PRIV_EXP, REG_PRIV_SYNC):
    expect(mb(cmd) == 0, "register %d: errno %d" % (cmd, ctypes.get_errno()))
expect(mb(GET_REG) == REG_GLOBAL_EXP | REG_PRIV_EXP | REG_PRIV_SYNC, "registrations %d" % mb(GET_REG))
"#,
        r#"
reg = mb(GET_REG)
expect(reg == REG_GLOBAL_EXP | REG_PRIV_EXP | REG_PRIV_SYNC, "registrations after restore %d" % reg)
expect(mb(PRIV_EXP) == 0, "private expedited: errno %d" % ctypes.get_errno())
expect(mb(PRIV_SYNC) == 0, "private expedited sync-core: errno %d" % ctypes.get_errno())
"#,
    );
    let (a, b) = rt.roots();
    assert_eq!(a.task.membarrier, 4 | 16 | 64);
    assert_eq!(a.task, b.task);
}
