//! Kind "cgroups": where a restore puts each group ([`target`]), and a
//! round trip of a parent and child in groups of their own in every
//! hierarchy mounted here, the child's removed while they are away.

use super::{target, CgroupMode};
use crate::kinds::testkit::round_trip_with;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[test]
fn auto_goes_back_when_the_roots_group_exists() {
    let exists = |g: &str| g == "/job" || g.starts_with("/job/");
    let t = |saved| target(CgroupMode::Auto, "/job", saved, "/restorer", exists);
    assert_eq!(t("/job"), "/job");
    assert_eq!(t("/job/rank1"), "/job/rank1");
    // Outside the root's subtree: back if it exists, else with the root.
    assert_eq!(t("/jobless"), "/job");
    assert_eq!(
        target(CgroupMode::Auto, "/job", "/other", "/r", |g| g == "/job"
            || g == "/other"),
        "/other"
    );
}

#[test]
fn auto_follows_the_restorer_when_the_roots_group_is_gone() {
    let none = |_: &str| false;
    let t = |saved| {
        target(
            CgroupMode::Auto,
            "/slurm/job_5",
            saved,
            "/slurm/job_9",
            none,
        )
    };
    assert_eq!(t("/slurm/job_5"), "/slurm/job_9");
    assert_eq!(t("/slurm/job_5/step_0/task"), "/slurm/job_9/step_0/task");
    assert_eq!(t("/elsewhere"), "/slurm/job_9");
}

#[test]
fn here_and_off_ignore_the_saved_root_group() {
    let all = |_: &str| true;
    assert_eq!(target(CgroupMode::Here, "/a", "/a/b", "/r", all), "/r/b");
    assert_eq!(target(CgroupMode::Here, "/", "/b", "/", all), "/b");
    assert_eq!(target(CgroupMode::Here, "/", "/b/c", "/r", all), "/r/b/c");
    assert_eq!(target(CgroupMode::Off, "/a", "/a/b", "/r", all), "/r");
}

/// The groups the program made, deepest first: removed when the test
/// ends, passed or not.
#[derive(Default)]
struct Groups(std::cell::RefCell<Vec<PathBuf>>);

impl Drop for Groups {
    fn drop(&mut self) {
        remove_groups(&self.0.borrow());
    }
}

/// Remove groups whose processes are gone (a group is removable once its
/// last process is reaped; the kernel may take a moment to see it empty).
fn remove_groups(dirs: &[PathBuf]) {
    for d in dirs {
        let t0 = Instant::now();
        while d.exists() {
            match std::fs::remove_dir(d) {
                Ok(()) => break,
                Err(e) if t0.elapsed() > Duration::from_secs(10) => {
                    eprintln!("cannot remove cgroup {}: {e}", d.display());
                    break;
                }
                Err(_) => std::thread::yield_now(),
            }
        }
    }
}

/// A parent in a group of its own and its child in a group below it, in
/// every hierarchy mounted here. While they are away the child's groups
/// are removed: the restore makes them again and puts each process back.
#[test]
fn parent_and_child_come_back_into_their_groups() {
    let made = Groups::default();
    let rt = round_trip_with(
        "cgroups",
        r#"
me = os.getpid()
def mine():
    # (mount point, my group) for each hierarchy: a v1 mount whose super
    # options hold all of the hierarchy's controllers, or the v2 mount.
    mounts = []
    for line in open("/proc/self/mountinfo"):
        a, b = line.split(" - ")
        fs, opts = b.split()[0], set(b.split()[2].split(","))
        if a.split()[3] == "/" and fs in ("cgroup", "cgroup2"):
            mounts.append((fs, opts, a.split()[4]))
    for line in open("/proc/self/cgroup"):
        _, ctrl, path = line.rstrip("\n").split(":", 2)
        for fs, opts, point in mounts:
            ok = fs == "cgroup2" if not ctrl else fs == "cgroup" and set(ctrl.split(",")) <= opts
            if ok:
                yield point, path.rstrip("/")
                break
def make(d):
    os.mkdir(d)
    for f in ("cpuset.cpus", "cpuset.mems"):
        if os.path.exists(d + "/" + f):
            open(d + "/" + f, "w").write(open(os.path.dirname(d) + "/" + f).read().strip())
tops, subs = [], []
for m, path in list(mine()):
    top = m + path + "/crtest-%d" % me
    make(top); make(top + "/sub")
    tops.append(top); subs.append(top + "/sub")
write_in_dir("groups", "\n".join(subs + tops))
for t in tops:
    open(t + "/cgroup.procs", "w").write(str(me))
r, w = os.pipe()
child = os.fork()
if child == 0:
    libc.prctl(1, signal.SIGKILL)                  # PR_SET_PDEATHSIG
    for s in subs:
        open(s + "/cgroup.procs", "w").write(str(os.getpid()))
    os.write(w, b"x")
    while True:
        time.sleep(1000)
os.read(r, 1)
before = open("/proc/self/cgroup").read()
child_before = open("/proc/%d/cgroup" % child).read()
expect(len(tops) > 0, "no cgroup hierarchy mounted with its root")
"#,
        r#"
now = open("/proc/self/cgroup").read()
expect(now == before, "parent: cgroups %r, were %r" % (now, before))
child_now = open("/proc/%d/cgroup" % child).read()
expect(child_now == child_before, "child: cgroups %r, were %r" % (child_now, child_before))
expect("crtest-%d/sub" % me in child_now, "child not in its own group: %r" % child_now)
"#,
        |dir: &Path| {
            let list = std::fs::read_to_string(dir.join("groups")).expect("the program's groups");
            let dirs: Vec<PathBuf> = list.lines().map(PathBuf::from).collect();
            // The child's groups only: its parent's stay.
            let subs: Vec<PathBuf> = dirs
                .iter()
                .filter(|d| d.ends_with("sub"))
                .cloned()
                .collect();
            remove_groups(&subs);
            *made.0.borrow_mut() = dirs;
        },
    );
    drop(made);
    let (a, b) = rt.roots();
    assert!(!a.cgroups.is_empty(), "no cgroup saved");
    assert_eq!(a.cgroups, b.cgroups, "the root's groups changed");
    let child = &rt.after.processes[1];
    assert!(
        child.cgroups.iter().all(|c| c.path.ends_with("/sub")),
        "the child's groups after the restore: {:?}",
        child.cgroups
    );
}
