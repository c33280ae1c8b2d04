//! System V IPC: shared memory segments (attached by two processes, one
//! attach split in two mappings, one segment removed while attached, one
//! nobody attaches), a semaphore set and a message queue survive a
//! checkpoint that lets the processes run on and a checkpoint --kill and
//! restore, with their ids; the workload (`wl_sysv`) checks itself. In the
//! host's IPC namespace an id taken by another object in use is refused in
//! one line naming it, and a restore that fails leaves neither processes
//! nor objects. Under `cr_run`, the job's own IPC namespace, /proc and
//! /dev/shm are saved and restored with it.

mod common;

use cr_tests::*;
use std::ffi::OsStr;
use std::path::Path;
use std::time::Duration;

/// The ids `wl_sysv` printed: a, b, c, sem, msg.
fn ids(wl: &Workload) -> [i32; 5] {
    let line = wl
        .lines()
        .into_iter()
        .find(|l| l.starts_with("IDS "))
        .unwrap_or_else(|| panic!("no IDS line\n{}", wl.diag()));
    let v: Vec<i32> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('=')?.1.parse().ok())
        .collect();
    v.try_into()
        .unwrap_or_else(|_| panic!("bad IDS line {line:?}"))
}

/// (kind, id) of every object the image holds.
fn image_objects(h: &Harness, img: &Path) -> Vec<(String, i64)> {
    let v = common::show_json(h, img);
    let mut out = Vec::new();
    for kind in ["shm", "sem", "msg"] {
        for o in v["sysv"][kind].as_array().into_iter().flatten() {
            out.push((kind.to_string(), o["id"].as_i64().unwrap_or(-1)));
        }
    }
    out.sort();
    out
}

fn expected_objects(ids: [i32; 5]) -> Vec<(String, i64)> {
    let [a, b, c, sem, msg] = ids.map(i64::from);
    let mut v = vec![
        ("shm".to_string(), a),
        ("shm".to_string(), b),
        ("shm".to_string(), c),
        ("sem".to_string(), sem),
        ("msg".to_string(), msg),
    ];
    v.sort();
    v
}

/// Lines of /proc/sysvipc/KIND (without the header).
fn sysvipc(kind: &str) -> Vec<Vec<i64>> {
    read_text(Path::new(&format!("/proc/sysvipc/{kind}")))
        .lines()
        .skip(1)
        .map(|l| {
            l.split_whitespace()
                .map(|x| x.parse().unwrap_or(-1))
                .collect()
        })
        .collect()
}

/// Whether an object of the image is in the host's namespace: a segment
/// (id and size), or a set or queue (by key).
fn left_behind(ids: [i32; 5], key: i64) -> Vec<String> {
    let mut out = Vec::new();
    for (id, size) in [(ids[0], 8 * 4096 + 123), (ids[2], 3 * 4096)] {
        if sysvipc("shm")
            .iter()
            .any(|r| r[1] == id as i64 && r[3] == size)
        {
            out.push(format!("segment {id}"));
        }
    }
    for kind in ["sem", "msg"] {
        if sysvipc(kind).iter().any(|r| r[0] == key) {
            out.push(format!("{kind} with key {key:#x}"));
        }
    }
    out
}

/// Removes the host-namespace objects of a `wl_sysv` whose test failed
/// (the workload removes them itself when it finishes).
struct Leftovers([i32; 5]);

impl Drop for Leftovers {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let [a, b, c, sem, msg] = self.0;
        // SAFETY: IPC_RMID of the objects the test's own workload made.
        unsafe {
            for id in [a, b, c] {
                libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut());
            }
            libc::semctl(sem, 0, libc::IPC_RMID);
            libc::msgctl(msg, libc::IPC_RMID, std::ptr::null_mut());
        }
    }
}

/// The key wl_sysv gives its set and queue (from its pid).
fn key_of(pid: i32) -> i64 {
    (0x5300_0000 | (pid & 0xff_ffff)) as i64
}

#[test]
fn sysv_objects_survive_a_checkpoint_that_continues() {
    let h = Harness::new("sysv-continue");
    let mut wl = h.spawn_wl("wl_sysv", &[]);
    wl.wait_ready();
    let _leftovers = Leftovers(ids(&wl));
    let img = h.image_dir("img");
    h.checkpoint(&img, &[], wl.pid())
        .assert_success("cr_checkpoint (continue)");
    assert_running_untraced(wl.pid(), "after the checkpoint");
    assert_eq!(
        image_objects(&h, &img),
        expected_objects(ids(&wl)),
        "the image holds every object of the tree"
    );
    // The queue was read without taking anything: the workload finds its
    // four messages, and everything else, as it left them.
    wl.go_and_expect_ok();
}

#[test]
fn sysv_objects_survive_kill_and_restore_and_a_failed_restore_leaves_nothing() {
    let h = Harness::new("sysv-kill");
    let mut wl = h.spawn_wl("wl_sysv", &[]);
    wl.wait_ready();
    let ids = ids(&wl);
    let _leftovers = Leftovers(ids);
    let (pid, key) = (wl.pid(), key_of(wl.pid()));
    let img = h.image_dir("img");
    checkpoint_kill(&h, &mut wl, &img);
    assert_eq!(image_objects(&h, &img), expected_objects(ids));

    // 1. The queue's id taken by another queue in use: refused, naming it.
    let msg = ids[4];
    let other = TakenQueue::new(msg);
    let out = h.restore_sync(&img, pid);
    let line = out.assert_error(
        "restore while the queue's id is taken",
        "cr_restart: error: ",
        &[
            &format!("message queue {msg}"),
            "taken",
            &format!("ipcrm -q {msg}"),
        ],
    );
    assert!(
        line.contains(&format!("process {}", std::process::id())),
        "names who uses it: {line}"
    );
    assert_no_restored(pid, &wl.exe, "refused restore");
    drop(other);

    // 2. A restore failing after every object and process was made leaves
    // none of them.
    let mut r = h.restore_bg_env(&img, pid, &[("CR_FAULT_INJECT", "restore-rebuilt")]);
    let out = r.wait_plain(TOOL_TIMEOUT);
    out.assert_error(
        "injected restore failure",
        "cr_restart: error: ",
        &["restore-rebuilt"],
    );
    assert_no_restored(pid, &wl.exe, "failed restore");
    assert_eq!(
        left_behind(ids, key),
        Vec::<String>::new(),
        "objects left by a failed restore"
    );
    // Its killed stubs are ours to reap (we are a subreaper), then the
    // pids are free again.
    let pids: Vec<i32> = common::show_json(&h, &img)["processes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["pid"].as_i64().map(|x| x as i32))
        .collect();
    wait_until(
        "the failed restore's processes to be gone",
        Duration::from_secs(10),
        || {
            reap_orphans();
            pids.iter()
                .all(|p| !Path::new(&format!("/proc/{p}")).exists())
        },
        || {
            pids.iter()
                .map(|&p| describe(p))
                .collect::<Vec<_>>()
                .join("\n")
        },
    );

    // 3. Restored with the same ids; the workload checks the rest.
    let mut r = h.restore_bg(&img, pid);
    r.wait_blocked_in(&wl, POLL_SLEEP_SYSCALLS, LINE_TIMEOUT);
    wl.go();
    let out = r.wait(EXIT_TIMEOUT, &wl);
    assert_restored_ok(&out, &wl, "restored System V objects");
}

/// Another queue holding a queue's id, in use (we sent it a message);
/// removed when dropped.
struct TakenQueue(i32);

impl TakenQueue {
    /// Remove the leftover queue `id` and make another one with that id.
    fn new(id: i32) -> TakenQueue {
        // SAFETY: System V calls with integer arguments and a valid msgbuf.
        unsafe {
            libc::msgctl(id, libc::IPC_RMID, std::ptr::null_mut());
            std::fs::write("/proc/sys/kernel/msg_next_id", format!("{id}\n"))
                .expect("msg_next_id (CONFIG_CHECKPOINT_RESTORE)");
            let q = libc::msgget(libc::IPC_PRIVATE, libc::IPC_CREAT | 0o600);
            let taken = TakenQueue(q);
            assert_eq!(q, id, "the test could not make a queue with id {id}");
            let m = [1i64, 0];
            assert_eq!(libc::msgsnd(q, m.as_ptr().cast(), 8, 0), 0, "msgsnd");
            taken
        }
    }
}

impl Drop for TakenQueue {
    fn drop(&mut self) {
        // SAFETY: IPC_RMID of the queue this test made.
        unsafe { libc::msgctl(self.0, libc::IPC_RMID, std::ptr::null_mut()) };
    }
}

/// A job under cr_run whose environment is emptied (`env -i`), so that
/// nothing can come from it.
fn spawn_job(h: &Harness, img: &Path) -> Workload {
    let wl_sysv = workload_path("wl_sysv");
    let mut wl = h.spawn_job(
        "cr_run",
        img,
        &["/usr/bin/env".as_ref(), "-i".as_ref(), wl_sysv.as_os_str()],
        &["job"],
    );
    wl.wait_ready();
    let name = shm_file(&wl);
    assert!(
        !Path::new(&name).exists(),
        "{name} of the job is visible outside it: /dev/shm is not private"
    );
    wl
}

fn shm_file(wl: &Workload) -> String {
    wl.lines()
        .into_iter()
        .find_map(|l| l.strip_prefix("SHMFILE ").map(str::to_string))
        .unwrap_or_else(|| panic!("no SHMFILE line\n{}", wl.diag()))
}

#[test]
fn cr_run_job_namespaces_survive_a_checkpoint_that_continues() {
    let h = Harness::new("sysv-job-continue");
    let img = h.image_dir("img");
    let mut wl = spawn_job(&h, &img);
    // Through cr_run's pid, without --dir: into the job's directory.
    h.run_tool(
        "cr_checkpoint",
        &[OsStr::new(&wl.pid().to_string())],
        &RunOpts::default(),
    )
    .assert_success("cr_checkpoint of the job (continue)");
    let v = common::show_json(&h, &img);
    assert_eq!(v["sysv"]["own_namespace"], true, "the job's IPC namespace");
    assert_eq!(
        image_objects(&h, &img),
        expected_objects(ids(&wl)),
        "every object of the job's namespace"
    );
    assert_eq!(v["mounts"]["proc"], true, "the job's /proc");
    let files = v["mounts"]["dev_shm"]["entries"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(files.len(), 1, "the job's /dev/shm file: {files:?}");
    wl.go_and_expect_ok();
}

#[test]
fn cr_run_job_namespaces_survive_kill_and_restore() {
    let h = Harness::new("sysv-job-kill");
    let img = h.image_dir("img");
    let mut wl = spawn_job(&h, &img);
    checkpoint_kill_job(&h, &mut wl, TOOL_TIMEOUT, "cr_checkpoint --kill of the job");
    let first_id = common::show_json(&h, &img)["image_id"].clone();

    let mut r = h.restore_job(&img);
    r.wait_running(&workload_path("wl_sysv"), &|| wl.diag());
    // The restored job is checkpointed again through cr_restart's pid,
    // without --dir: into the job's directory, recorded by the restore.
    h.run_tool(
        "cr_checkpoint",
        &[OsStr::new(&r.cr.pid.to_string())],
        &RunOpts::default(),
    )
    .assert_success("cr_checkpoint of the restored job (continue)");
    assert_ne!(
        common::show_json(&h, &img)["image_id"],
        first_id,
        "a new image in the job's directory"
    );
    wl.go();
    let st = r.wait(EXIT_TIMEOUT, &|| wl.diag());
    let last = wl
        .output()
        .lines()
        .rfind(|l| !l.is_empty())
        .unwrap_or("")
        .to_string();
    assert!(
        st.code() == Some(0) && last == "OK",
        "the restored job's own checks ({st:?})\n{}\n{}",
        r.diag(),
        wl.diag()
    );
}
