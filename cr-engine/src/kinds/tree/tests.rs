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
