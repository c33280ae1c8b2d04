//! Kind "cgroups": where a restore puts each group ([`target`]), and a
//! round trip of a parent and child in groups of their own in every
//! hierarchy mounted here, the child's removed while they are away; the
//! groups a failed restore made are removed again.

use super::{ns_root, target, CgroupMode};
use crate::kinds::testkit::{restore_refused_with, round_trip_with};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[test]
fn auto_goes_back_when_the_roots_group_exists() {
    let exists = |g: &str| g == "/job" || g.starts_with("/job/");
    let t = |saved| target(CgroupMode::Auto, "/job", saved, "/restorer", None, exists);
    assert_eq!(t("/job"), "/job");
    assert_eq!(t("/job/rank1"), "/job/rank1");
    // Outside the root's subtree: back if it exists, else with the root.
    assert_eq!(t("/jobless"), "/job");
    assert_eq!(
        target(CgroupMode::Auto, "/job", "/other", "/r", None, |g| g
            == "/job"
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
            None,
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
    assert_eq!(
        target(CgroupMode::Here, "/a", "/a/b", "/r", None, all),
        "/r/b"
    );
    assert_eq!(target(CgroupMode::Here, "/", "/b", "/", None, all), "/b");
    assert_eq!(
        target(CgroupMode::Here, "/", "/b/c", "/r", None, all),
        "/r/b/c"
    );
    assert_eq!(target(CgroupMode::Off, "/a", "/a/b", "/r", None, all), "/r");
}

#[test]
fn cgroup_root_replaces_the_jobs_frame() {
    let none = |_: &str| false;
    // The frame (the root's group, or the checkpoint's --cgroup-root) is
    // replaced, whatever the mode but off; below it the paths stay.
    for mode in [CgroupMode::Auto, CgroupMode::Here] {
        let t = |saved| target(mode, "/prefix", saved, "/r", Some("/newroot"), none);
        assert_eq!(t("/prefix"), "/newroot");
        assert_eq!(t("/prefix/oldroot"), "/newroot/oldroot");
        // Outside the frame: where it was.
        assert_eq!(t("/other"), "/other");
    }
    assert_eq!(
        target(CgroupMode::Auto, "/", "/a", "/r", Some("/n"), none),
        "/n/a"
    );
    assert_eq!(
        target(CgroupMode::Off, "/p", "/p/a", "/r", Some("/n"), none),
        "/r"
    );
}

#[test]
fn a_namespace_root_is_the_group_less_what_the_namespace_shows() {
    assert_eq!(ns_root("/a/b", "/").as_deref(), Some("/a/b"));
    assert_eq!(ns_root("/a/b/sub", "/sub").as_deref(), Some("/a/b"));
    assert_eq!(ns_root("/sub", "/sub").as_deref(), Some("/"));
    // Moved out of its namespace, or a path that does not end the same.
    assert_eq!(ns_root("/x", "/../x"), None);
    assert_eq!(ns_root("/a/c", "/b"), None);
}

/// Python helpers of the programs: `mine()` yields (mount point, my group)
/// for each hierarchy (a v1 mount whose super options hold all of the
/// hierarchy's controllers, or the v2 mount); `make(d)` makes a group (a
/// v1 cpuset one with its parent's CPUs and memory nodes);
/// `enter_groups(tag)` makes TAG-PID and TAG-PID/sub under the process's
/// group in every hierarchy, lists them in the file "groups" (removed by
/// the test) and moves the process into the TAG-PID ones.
const GROUP_HELPERS: &str = r#"
def mine():
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
def enter_groups(tag):
    tops, subs = [], []
    for m, path in list(mine()):
        top = m + path + "/%s-%d" % (tag, os.getpid())
        make(top); make(top + "/sub")
        tops.append(top); subs.append(top + "/sub")
    write_in_dir("groups", "\n".join(subs + tops))
    for t in tops:
        open(t + "/cgroup.procs", "w").write(str(os.getpid()))
    return tops, subs
"#;

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

/// The `between` of a round trip: removes the groups named "sub" the
/// program listed in its file "groups" (the others stay), and has `made`
/// remove them all when the test ends.
fn remove_subs(made: &Groups) -> impl FnOnce(&Path) + '_ {
    move |dir: &Path| {
        let list = std::fs::read_to_string(dir.join("groups")).expect("the program's groups");
        let dirs: Vec<PathBuf> = list.lines().map(PathBuf::from).collect();
        let subs: Vec<PathBuf> = dirs
            .iter()
            .filter(|d| d.ends_with("sub"))
            .cloned()
            .collect();
        remove_groups(&subs);
        *made.0.borrow_mut() = dirs;
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
        &[
            GROUP_HELPERS,
            r#"
me = os.getpid()
tops, subs = enter_groups("crtest")
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
        ]
        .concat(),
        r#"
now = open("/proc/self/cgroup").read()
expect(now == before, "parent: cgroups %r, were %r" % (now, before))
child_now = open("/proc/%d/cgroup" % child).read()
expect(child_now == child_before, "child: cgroups %r, were %r" % (child_now, child_before))
expect("crtest-%d/sub" % me in child_now, "child not in its own group: %r" % child_now)
"#,
        remove_subs(&made),
    );
    drop(made);
    let (a, b) = rt.roots();
    assert!(!a.cgroups.is_empty(), "no cgroup saved");
    assert_eq!(a.cgroups, b.cgroups, "the root's groups changed");
    let child = &rt.after.processes[1];
    // In every hierarchy mounted here (one mounted nowhere is left alone).
    let mounted: Vec<String> = cr_sys::proc::cgroup_mounts()
        .expect("cgroup mounts")
        .into_iter()
        .map(|m| m.controllers)
        .collect();
    assert!(
        child
            .cgroups
            .iter()
            .filter(|c| mounted.contains(&c.controllers))
            .all(|c| c.path.ends_with("/sub")),
        "the child's groups after the restore: {:?}",
        child.cgroups
    );
}

/// A process that unshared a cgroup namespace in a group of its own, then
/// moved itself and its child into a group below: after the restore both
/// are in a new namespace with the same root, seeing the same paths.
#[test]
fn own_cgroup_namespace_round_trip() {
    let made = Groups::default();
    let rt = round_trip_with(
        "cgroupns",
        &[
            GROUP_HELPERS,
            r#"
me = os.getpid()
tops, subs = enter_groups("crns")
outer_ns = os.readlink("/proc/self/ns/cgroup")
expect(libc.unshare(0x02000000) == 0, "unshare(CLONE_NEWCGROUP)")
for s in subs:
    open(s + "/cgroup.procs", "w").write(str(me))
r, w = os.pipe()
child = os.fork()
if child == 0:
    libc.prctl(1, signal.SIGKILL)                  # PR_SET_PDEATHSIG
    os.write(w, b"x")
    while True:
        time.sleep(1000)
os.read(r, 1)
before = open("/proc/self/cgroup").read()
child_before = open("/proc/%d/cgroup" % child).read()
expect(len(tops) > 0, "no cgroup hierarchy mounted with its root")
# Every hierarchy mounted here (one mounted nowhere, left by another
# program, is not moved).
expect(sum(l.endswith(":/sub") for l in before.splitlines()) == len(tops), "before: %r" % before)
"#,
        ]
        .concat(),
        r#"
now = open("/proc/self/cgroup").read()
expect(now == before, "parent: cgroups %r, were %r" % (now, before))
child_now = open("/proc/%d/cgroup" % child).read()
expect(child_now == child_before, "child: cgroups %r, were %r" % (child_now, child_before))
ns = os.readlink("/proc/self/ns/cgroup")
expect(ns == os.readlink("/proc/%d/ns/cgroup" % child), "the child left its parent's namespace")
expect(ns != outer_ns, "back in the outer cgroup namespace %s" % ns)
"#,
        |dir: &Path| {
            let list = std::fs::read_to_string(dir.join("groups")).expect("the program's groups");
            *made.0.borrow_mut() = list.lines().map(PathBuf::from).collect();
        },
    );
    drop(made);
    let roots = rt
        .before
        .cgroupns
        .as_ref()
        .expect("the cgroup namespace saved");
    assert!(
        roots.iter().all(|c| c.path.contains("/crns-")),
        "namespace roots: {roots:?}"
    );
    assert_eq!(
        rt.before.cgroupns, rt.after.cgroupns,
        "namespace roots changed"
    );
}

/// A process in a group of its own, in every hierarchy mounted here, with
/// an empty group below it and one below that, settings changed (pids,
/// CPU shares, memory limit, notify_on_release: those each hierarchy has)
/// and its `cgroup.procs` and the empty group given to another owner.
/// While it is away every one of those groups is removed: the restore
/// makes them all again, with their settings, owners and modes, and puts
/// the process back (zdtm cgroup00, cgroup01, cgroup03).
#[test]
fn groups_empty_ones_settings_and_owners_come_back() {
    let made = Groups::default();
    let rt = round_trip_with(
        "cgroup-dirs",
        &[
            GROUP_HELPERS,
            r#"
me = os.getpid()
tops, subs = enter_groups("crdirs")
deeper = [s + "/deeper" for s in subs]
for d in deeper:
    make(d)
write_in_dir("groups", "\n".join(deeper + subs + tops))
settings = {}
for t in tops:
    for f, v in (("pids.max", "77"), ("notify_on_release", "1"), ("cpu.shares", "512"),
                 ("memory.limit_in_bytes", str(512 << 20)), ("memory.max", str(512 << 20))):
        p = t + "/" + f
        if os.path.exists(p):
            open(p, "w").write(v)
            settings[p] = open(p).read().strip()
    os.chown(t + "/cgroup.procs", 1000, 1001)
    os.chown(t + "/sub", 1000, 1001)
    os.chmod(t + "/sub", 0o750)
before = open("/proc/self/cgroup").read()
expect(len(tops) > 0, "no cgroup hierarchy mounted with its root")
expect(len(settings) > 0, "no setting to change in any hierarchy")
"#,
        ]
        .concat(),
        r#"
now = open("/proc/self/cgroup").read()
expect(now == before, "cgroups %r, were %r" % (now, before))
for d in deeper:
    expect(os.path.isdir(d), "empty group %s not made again" % d)
for p, v in settings.items():
    got = open(p).read().strip() if os.path.exists(p) else None
    expect(got == v, "%s: %r, was %r" % (p, got, v))
for t in tops:
    st = os.stat(t + "/cgroup.procs")
    expect((st.st_uid, st.st_gid) == (1000, 1001), "%s/cgroup.procs owned by %d:%d" % (t, st.st_uid, st.st_gid))
    st = os.stat(t + "/sub")
    expect((st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1001, 0o750),
           "%s/sub: %d:%d %o" % (t, st.st_uid, st.st_gid, st.st_mode & 0o7777))
"#,
        |dir: &Path| {
            let list = std::fs::read_to_string(dir.join("groups")).expect("the program's groups");
            let dirs: Vec<PathBuf> = list.lines().map(PathBuf::from).collect();
            remove_groups(&dirs);
            for d in &dirs {
                assert!(!d.exists(), "{} still there", d.display());
            }
            *made.0.borrow_mut() = dirs;
        },
    );
    drop(made);
    let (a, b) = rt.roots();
    assert_eq!(a.cgroups, b.cgroups, "the root's groups changed");
    let saved = &rt.before.cgroup_dirs;
    assert!(
        saved.iter().any(|d| d.path.ends_with("/sub/deeper")),
        "the empty groups are not in the image: {saved:?}"
    );
}

/// A process in a group of its own whose second thread moved itself into
/// a group below it, in every v1 hierarchy mounted here (v1 moves threads
/// one by one). The thread's groups are removed while the process is
/// away: the restore makes them again and moves the thread back, the
/// process staying in its own (zdtm cgroup_threads).
#[test]
fn a_thread_in_groups_of_its_own_round_trip() {
    let made = Groups::default();
    let rt = round_trip_with(
        "cgroup-thread",
        &[
            GROUP_HELPERS,
            r#"
import threading
tops, subs = enter_groups("crthr")
ready = threading.Event()
info = {}
def worker():
    t = threading.get_native_id()
    info["moved"] = [s for s in subs if os.path.exists(s + "/tasks")]
    for s in info["moved"]:
        open(s + "/tasks", "w").write(str(t))
    info["tid"] = t
    info["before"] = open("/proc/self/task/%d/cgroup" % t).read()
    ready.set()
    while True:
        time.sleep(1)
threading.Thread(target=worker, daemon=True).start()
ready.wait()
before = open("/proc/self/cgroup").read()
expect(len(info["moved"]) > 0, "no cgroup v1 hierarchy mounted to move a thread in")
expect(info["before"] != before, "setup: the thread is in its process's groups")
"#,
        ]
        .concat(),
        r#"
now = open("/proc/self/cgroup").read()
expect(now == before, "process: cgroups %r, were %r" % (now, before))
got = open("/proc/self/task/%d/cgroup" % info["tid"]).read()
expect(got == info["before"], "thread: cgroups %r, were %r" % (got, info["before"]))
"#,
        remove_subs(&made),
    );
    drop(made);
    let (a, b) = rt.roots();
    assert!(
        !a.threads[1].cgroups.is_empty(),
        "the thread's own groups are not in the image"
    );
    assert_eq!(a.threads[1].cgroups.len(), b.threads[1].cgroups.len());
}

/// A process in a group of its own with an empty group below it, in every
/// hierarchy mounted here; all of them removed while it is away. The
/// restore makes them again, puts the process in, then fails late (a
/// fault injected once every process is rebuilt): nothing of the tree is
/// left, and neither is any group it made.
#[test]
fn a_failed_restore_removes_the_groups_it_made() {
    let made = Groups::default();
    let setup = [
        GROUP_HELPERS,
        r#"
tops, subs = enter_groups("crfail")
expect(len(tops) > 0, "no cgroup hierarchy mounted with its root")
"#,
    ]
    .concat();
    let mut dirs: Vec<PathBuf> = Vec::new();
    restore_refused_with(
        "cgroup-failed",
        &setup,
        "fault injected at stage restore-rebuilt",
        |dir: &Path| {
            let list = std::fs::read_to_string(dir.join("groups")).expect("the program's groups");
            dirs = list.lines().map(PathBuf::from).collect();
            remove_groups(&dirs);
            for d in &dirs {
                assert!(!d.exists(), "{} still there", d.display());
            }
            *made.0.borrow_mut() = dirs.clone();
            std::env::set_var(crate::fault::ENV, "restore-rebuilt");
        },
        |_| std::env::remove_var(crate::fault::ENV),
    );
    let left: Vec<_> = dirs.iter().filter(|d| d.exists()).collect();
    assert!(
        left.is_empty(),
        "groups left by the failed restore: {left:?}"
    );
}

/// `--cgroup-root`: a process in group TAG/sub below the test's own group
/// in every hierarchy, checkpointed with TAG as the job's frame, the
/// groups removed, restored with TAG-new replacing the frame: it comes
/// back in TAG-new/sub, and TAG is not made again (zdtm cgroup02).
#[test]
fn cgroup_root_moves_the_job_to_a_new_frame() {
    let tag = format!("crframe-{}", std::process::id());
    let made = Groups::default();
    // The argument naming TAG (with `suffix`) in every hierarchy the
    // program made it in: read once the program is ready.
    let roots = |suffix: &str| -> Vec<super::frames::CgroupRoot> {
        let mounts = cr_sys::proc::cgroup_mounts().expect("cgroup mounts");
        let mine = cr_sys::proc::cgroups(std::process::id() as i32).expect("my groups");
        let mut out = Vec::new();
        for (controllers, own) in mine {
            let Some(m) = mounts.iter().find(|m| m.controllers == controllers) else {
                continue;
            };
            let frame = format!("{}/{tag}", own.trim_end_matches('/'));
            let Some(dir) = super::dir_of(m, &frame) else {
                continue;
            };
            if !dir.is_dir() && suffix.is_empty() {
                continue;
            }
            let spec = if controllers.is_empty() {
                format!("{frame}{suffix}")
            } else {
                format!("{controllers}:{frame}{suffix}")
            };
            out.push(spec.parse().expect("a --cgroup-root"));
        }
        out
    };
    let frames = std::cell::RefCell::new(Vec::new());
    let rt = crate::kinds::testkit::round_trip_restoring(
        "cgroup-frame",
        &[
            GROUP_HELPERS,
            &format!(
                r#"
TAG = "{tag}"
tops, subs = [], []
for m, path in list(mine()):
    top = m + path + "/" + TAG
    make(top); make(top + "/sub")
    tops.append(top); subs.append(top + "/sub")
    open(top + "/sub/cgroup.procs", "w").write(str(os.getpid()))
new = [t + "-new" for t in tops]
write_in_dir("groups", "\n".join([n + "/sub" for n in new] + new + subs + tops))
before = open("/proc/self/cgroup").read()
expect(len(tops) > 0, "no cgroup hierarchy mounted with its root")
"#
            ),
        ]
        .concat(),
        r#"
now = open("/proc/self/cgroup").read()
want = before.replace("/" + TAG + "/sub", "/" + TAG + "-new/sub")
expect(now == want, "cgroups %r, want %r" % (now, want))
for t in tops:
    expect(not os.path.exists(t), "the old frame %s made again" % t)
"#,
        |o| {
            let r = roots("");
            assert!(!r.is_empty(), "no hierarchy with the program's groups");
            *frames.borrow_mut() = r.clone();
            o.cgroup_root = r;
        },
        |dir: &Path| {
            let list = std::fs::read_to_string(dir.join("groups")).expect("the program's groups");
            let dirs: Vec<PathBuf> = list.lines().map(PathBuf::from).collect();
            let old: Vec<PathBuf> = dirs
                .iter()
                .filter(|d| !d.to_string_lossy().contains("-new"))
                .cloned()
                .collect();
            remove_groups(&old);
            *made.0.borrow_mut() = dirs;
        },
        |o| o.cgroup_root = roots("-new"),
    );
    drop(made);
    let frames = frames.into_inner();
    assert_eq!(
        rt.before.cgroup_frames.len(),
        frames.len(),
        "frames saved: {:?}",
        rt.before.cgroup_frames
    );
}
