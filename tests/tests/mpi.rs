//! Jobs started across nodes by `cr_rsh`, and real MPI jobs (Open MPI,
//! MPICH, mpi4py) on 3 nodes x 2 ranks (docs/MPI.md), checkpointed while
//! they run and checked from the inside: the programs
//! (tests/workloads/mpi_check.c, mpi_check.py, rsh_echo.py) check every
//! message and compare their final state with a serial recomputation,
//! printing `RESULT OK ...` / `OK` or `FAIL ...`.
//!
//! * `cr_rsh_relays_and_survives_restart`: a client on n1 talks to a server
//!   it started on n2 through cr_rsh (stdin, stdout, stderr, exit status),
//!   across a checkpoint that continues and a --kill / restart that moves
//!   both to other nodes.
//! * `open_mpi_c_programs` (and mpi4py), `mpich_c_programs`: the MPI
//!   programs (ring, allreduce, halo) under `cr_run --job` on n1, their
//!   remote daemons started through cr_rsh, 2 ranks on each of 3 nodes;
//!   checkpointed while they run, killed by a checkpoint and restarted on
//!   the same nodes, killed again and restarted on other nodes; they finish
//!   with the result of a run without checkpoints, every rank with the host
//!   name it started with, and run after the move at about the pace they
//!   had before it. One cluster per test, the programs one after the other
//!   as jobs of their own.
//! * `mpi4py_checkpoints_itself_through_libcr`: an mpi4py program
//!   (libcr/examples/mpi_selfckpt.py) that asks for a checkpoint of its
//!   whole job every N iterations through libcr, killed and restarted from
//!   one of its own checkpoints.
//! * `lammps_on_3_nodes_moved_prints_the_same_thermo`: LAMMPS (Debian's
//!   lammps, unmodified) as 6 Open MPI ranks on 3 nodes, killed by a
//!   checkpoint and restarted on other nodes: its thermo table equals a
//!   run without checkpoints.

use cr_tests::cluster::{jlist, jstr, node_name, Cluster, Spawned, POLL_PERIOD};
use cr_tests::{bin_dir, mpi, read_text, script_path, tail, wait_until, Harness};
use std::ffi::OsString;
use std::time::Duration;

/// Deadline for a job to make progress or to finish.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// A cluster of 3 nodes with its coordinator and agents up.
fn cluster(h: &Harness) -> Cluster<'_> {
    let c = Cluster::new(h, 3);
    c.start_coordinator();
    c.start_agents(&[1, 2, 3]);
    c
}

/// A job whose root (on n1) writes what it has to say to its stdout file.
struct Job<'c> {
    c: &'c Cluster<'c>,
    name: String,
    runner: Spawned,
}

impl<'c> Job<'c> {
    fn start(c: &'c Cluster<'c>, name: &str, argv: &[&str], env: &[(&str, &str)]) -> Job<'c> {
        let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.push(mpi::path_env());
        let runner = c.run_member_env(name, 1, name, &argv, &env);
        Job {
            c,
            name: name.to_string(),
            runner,
        }
    }

    fn output(&self) -> String {
        read_text(&self.runner.stdout)
    }

    fn diag(&self) -> String {
        format!(
            "=== job {}: stdout {}:\n{}\n--- stderr:\n{}\n{}",
            self.name,
            self.runner.stdout.display(),
            tail(&self.output(), 30),
            tail(&read_text(&self.runner.stderr), 30),
            self.c.diag()
        )
    }

    /// Panics if the job reported a failure.
    fn assert_no_fail(&self) {
        if self.output().lines().any(|l| l.contains("FAIL")) {
            panic!("job {} reported a failure\n{}", self.name, self.diag());
        }
    }

    /// The `progress N [T]` lines it printed: (N, T), T (the program's
    /// wall clock, seconds) 0 when the line has none.
    fn progress_lines(&self) -> Vec<(u64, f64)> {
        mpi::progress_lines(&self.output())
    }

    /// The last `progress N` it printed.
    fn progress(&self) -> u64 {
        self.progress_lines()
            .into_iter()
            .map(|(n, _)| n)
            .max()
            .unwrap_or(0)
    }

    /// Its pace, iterations per second of its own clock, from the first
    /// progress line past iteration `after` to the last one (so that the
    /// time of a restart before `after` does not count); panics without
    /// two such lines.
    fn rate_after(&self, after: u64) -> f64 {
        let lines: Vec<(u64, f64)> = self
            .progress_lines()
            .into_iter()
            .filter(|&(n, _)| n > after)
            .collect();
        let (Some(&(n0, t0)), Some(&(n1, t1))) = (lines.first(), lines.last()) else {
            panic!(
                "job {} printed no progress past {after}\n{}",
                self.name,
                self.diag()
            );
        };
        assert!(
            n1 > n0 && t1 > t0,
            "job {} printed fewer than two timed progress lines past {after}: {lines:?}\n{}",
            self.name,
            self.diag()
        );
        (n1 - n0) as f64 / (t1 - t0)
    }

    /// Waits until it printed `progress` past `from + delta`.
    fn wait_progress(&self, from: u64, delta: u64, what: &str) -> u64 {
        wait_until(
            &format!("job {} to progress past {} {what}", self.name, from + delta),
            RUN_TIMEOUT,
            || {
                self.assert_no_fail();
                self.progress() >= from + delta
            },
            || self.diag(),
        );
        self.progress()
    }

    /// `crctl checkpoint JOB EXTRA...`, which must commit.
    fn checkpoint(&self, extra: &[&str]) {
        let mut args = vec!["checkpoint", self.name.as_str()];
        args.extend_from_slice(extra);
        let out = self.c.crctl(&args);
        if !out.status.success() {
            panic!("crctl {args:?} failed\n{}\n{}", out.show(), self.diag());
        }
        eprintln!("{}", out.stdout.lines().next().unwrap_or(""));
    }

    /// Checkpoint --kill: waits until no process of the job is left.
    fn checkpoint_kill(&mut self) {
        self.checkpoint(&["--kill", "--freeze-timeout", "60"]);
        let out = self.runner.wait(RUN_TIMEOUT, || self.c.diag());
        eprintln!("the job's cr_run on n1 ended: {}", out.status);
        let c = self.c;
        let name = self.name.clone();
        cr_tests::cluster::poll_until(
            &format!("every member of job {name} to be gone"),
            RUN_TIMEOUT,
            POLL_PERIOD,
            || c.job_procs(&name).iter().all(|(_, _, alive)| !alive),
            || c.diag(),
        );
    }

    /// `crctl restart JOB --on ...`.
    fn restart(&self, on: &[usize]) {
        let mut args = vec!["restart".to_string(), self.name.clone()];
        for &k in on {
            args.push("--on".into());
            args.push(node_name(k));
        }
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.c.crctl(&a);
        if !out.status.success() {
            panic!("crctl {a:?} failed\n{}\n{}", out.show(), self.diag());
        }
    }

    /// Waits up to `timeout` for its final line (`ok_prefix`...), which
    /// must say OK.
    fn wait_result(&self, ok_prefix: &str, timeout: Duration) -> String {
        wait_until(
            &format!("job {} to finish", self.name),
            timeout,
            || {
                self.assert_no_fail();
                self.output().lines().any(|l| l.starts_with(ok_prefix))
            },
            || self.diag(),
        );
        self.output()
            .lines()
            .find(|l| l.starts_with(ok_prefix))
            .unwrap_or_default()
            .to_string()
    }
}

/// The checkpoint's nodes n1, n2, n3 go to n2, n3, n1.
const MOVED: [usize; 3] = [2, 3, 1];

#[test]
fn cr_rsh_relays_and_survives_restart() {
    let h = Harness::new("rsh");
    let c = cluster(&h);
    let py = cr_tests::python3();
    let script = script_path("rsh_echo.py");
    let rsh = bin_dir().join("cr_rsh");
    let mut job = Job::start(
        &c,
        "rsh",
        &[
            &py.to_string_lossy(),
            &script.to_string_lossy(),
            "client",
            &rsh.to_string_lossy(),
            "n2",
            "400",
            "20",
        ],
        &[],
    );
    let p = job.wait_progress(0, 30, "through cr_rsh");
    let members: Vec<String> = c.job_procs("rsh").into_iter().map(|(n, _, _)| n).collect();
    assert!(
        members.contains(&"n1".to_string()) && members.contains(&"n2".to_string()),
        "the job has a member on n1 and one started by cr_rsh on n2: {members:?}\n{}",
        job.diag()
    );
    job.checkpoint(&[]);
    let p = job.wait_progress(p, 30, "after a checkpoint that continues");
    job.checkpoint_kill();
    // n1 -> n2, n2 -> n3.
    job.restart(&MOVED[..2]);
    job.wait_progress(p, 30, "after the restart on other nodes");
    job.wait_result("OK", RUN_TIMEOUT);
}

// ---------------------------------------------------------------- MPI

/// Debian's python3, for which python3-mpi4py is built (for Open MPI).
const MPI4PY_PYTHON: &str = "/usr/bin/python3";

/// The ranks' placement: 2 per node.
const HOSTS: &str = "n1:2,n2:2,n3:2";

/// Ranks of every job.
const NP: usize = 6;

/// Open MPI's mpirun of `prog` on [`HOSTS`], session directories under `tmp`.
fn open_mpi(tmp: &std::path::Path, prog: &[&str]) -> Vec<String> {
    mpi::open_mpi(tmp, NP, HOSTS, &[], prog)
}

/// MPICH's mpiexec of `prog` on [`HOSTS`].
fn mpich(prog: &[&str]) -> Vec<String> {
    mpi::mpich(NP, HOSTS, prog)
}

/// Iterations and pace of the programs: at least 2 s of run (ranks poll
/// for messages: on a loaded machine they take much longer), enough for a
/// checkpoint, two restarts and a pace measured before and after the move.
const ITERS: &str = "400";
const PACE_US: &str = "5000";

/// Deadline for a job, moved to other nodes, to finish.
const MOVED_TIMEOUT: Duration = Duration::from_secs(300);

/// The least a job's pace after the move to other nodes may be, as a part
/// of its pace after the restart on the same nodes (generous: a loaded
/// machine makes the pace vary by itself; a move once cost Open MPI jobs
/// 10 times their pace).
const MOVED_PACE_MIN: f64 = 0.3;

/// Runs each program as a job of its own, one after the other (MPI ranks
/// wait for messages by polling: jobs side by side would starve each
/// other's checkpoints of CPU): checkpointed while it runs (the job runs
/// on), then killed by a checkpoint and restarted on the same nodes, then,
/// halfway, killed again and restarted on other nodes (n1, n2, n3 to n2,
/// n3, n1). Its result must be the program's own OK: every rank's state
/// equals a serial recomputation (the result of a run without
/// checkpoints), no message was lost or duplicated, and every rank still
/// has the host name it started with. Its pace after the move (iterations
/// per second, from the times in its progress lines) must not be far
/// below its pace after the restart on the same nodes.
fn run_jobs(c: &Cluster, jobs: &[(&str, Vec<String>)]) {
    for (name, argv) in jobs {
        let a: Vec<&str> = argv.iter().map(String::as_str).collect();
        let mut j = Job::start(c, name, &a, &[]);
        let m = j.wait_progress(0, 50, "on 3 nodes");
        let nodes: Vec<String> = c.job_procs(name).into_iter().map(|(n, _, _)| n).collect();
        assert!(
            nodes.len() == 3,
            "job {name} has a member on each node: {nodes:?}\n{}",
            j.diag()
        );
        j.checkpoint(&["--freeze-timeout", "60"]);
        j.wait_progress(m, 50, "after a checkpoint that continues");
        j.checkpoint_kill();
        let restarted_at = j.progress();
        j.restart(&[1, 2, 3]);
        // Two progress lines after the restart: the pace on the same nodes.
        j.wait_progress(restarted_at, 100, "after a restart on the same nodes");
        j.checkpoint_kill();
        let moved_at = j.progress();
        let before = j.rate_after(restarted_at);
        j.restart(&MOVED);
        let line = j.wait_result("RESULT OK", MOVED_TIMEOUT);
        let after = j.rate_after(moved_at);
        eprintln!(
            "job {name}: {line}; {before:.1} iterations/s after the restart on the same nodes \
             (from {restarted_at}), {after:.1} after the move to other nodes (from {moved_at})"
        );
        assert!(
            after >= before * MOVED_PACE_MIN,
            "job {name} runs much slower after the move to other nodes: {after:.1} \
             iterations/s, {before:.1} before\n{}",
            j.diag()
        );
    }
}

#[test]
fn open_mpi_c_programs() {
    let h = Harness::new("ompi");
    let prog = mpi::build_check(&h.dir, "mpicc.openmpi", "mpi_check_ompi");
    let p = prog.to_string_lossy().into_owned();
    let py = script_path("mpi_check.py").to_string_lossy().into_owned();
    let c = cluster(&h);
    run_jobs(
        &c,
        &[
            (
                "ompi-ring",
                open_mpi(&h.dir.join("tmp-ring"), &[&p, "ring", ITERS, PACE_US]),
            ),
            (
                "ompi-allreduce",
                open_mpi(
                    &h.dir.join("tmp-allreduce"),
                    &[&p, "allreduce", ITERS, PACE_US],
                ),
            ),
            (
                "ompi-halo",
                open_mpi(&h.dir.join("tmp-halo"), &[&p, "halo", ITERS, PACE_US]),
            ),
            (
                "ompi-py-ring",
                open_mpi(
                    &h.dir.join("tmp-py-ring"),
                    &[MPI4PY_PYTHON, &py, "ring", ITERS, PACE_US],
                ),
            ),
        ],
    );
}

#[test]
fn mpich_c_programs() {
    let h = Harness::new("mpich");
    let prog = mpi::build_check(&h.dir, "mpicc.mpich", "mpi_check_mpich");
    let p = prog.to_string_lossy().into_owned();
    let c = cluster(&h);
    run_jobs(
        &c,
        &[
            ("mpich-ring", mpich(&[&p, "ring", ITERS, PACE_US])),
            ("mpich-allreduce", mpich(&[&p, "allreduce", ITERS, PACE_US])),
            ("mpich-halo", mpich(&[&p, "halo", ITERS, PACE_US])),
        ],
    );
}

/// An mpi4py program under Open MPI (6 ranks on 3 nodes) that checkpoints
/// itself through libcr (Python ctypes binding libcr/python/libcr.py):
/// every 100 iterations rank 0 asks for a checkpoint of the whole job
/// (CR_SCOPE_JOB) and its callback sees it continue. After the first, the
/// job is killed (a checkpoint with --kill) and restarted from that first,
/// self-requested checkpoint: rank 0 comes back inside its request
/// ("restarted from the self checkpoint at iteration 100", its callback
/// sees a restart), the job runs to its end, checkpointing itself twice more (the
/// count it prints: its state is the one of the first checkpoint), and
/// compares every rank's state with a serial recomputation (RESULT OK).
#[test]
fn mpi4py_checkpoints_itself_through_libcr() {
    let h = Harness::new("ompi-selfckpt");
    let c = cluster(&h);
    let script = cr_tests::libcr::repo_dir().join("libcr/examples/mpi_selfckpt.py");
    let argv = open_mpi(
        &h.dir.join("tmp-self"),
        &[
            MPI4PY_PYTHON,
            &script.to_string_lossy(),
            "300",
            "100",
            "20000",
        ],
    );
    let a: Vec<&str> = argv.iter().map(String::as_str).collect();
    let libcr = bin_dir().join("libcr.so").display().to_string();
    let name = "ompi-self";
    let mut j = Job::start(&c, name, &a, &[("CR_LIBCR", libcr.as_str())]);
    wait_until(
        "the job's first self-requested checkpoint",
        RUN_TIMEOUT,
        || {
            j.assert_no_fail();
            j.output()
                .lines()
                .any(|l| l == "self checkpoint 1 at iteration 100 continued")
        },
        || j.diag(),
    );
    let listed = c.crctl_json(&["checkpoints", name]);
    let committed: Vec<String> = jlist(&listed, "checkpoints")
        .iter()
        .filter(|k| jstr(k, "state") == "committed")
        .map(|k| jstr(k, "id").to_string())
        .collect();
    assert_eq!(
        committed.len(),
        1,
        "one checkpoint, the one the job asked for: {listed:#}\n{}",
        j.diag()
    );
    j.checkpoint_kill();
    let out = c.crctl(&["restart", name, "--checkpoint", &committed[0]]);
    if !out.status.success() {
        panic!(
            "crctl restart from the self-requested checkpoint failed\n{}\n{}",
            out.show(),
            j.diag()
        );
    }
    let line = j.wait_result("RESULT OK", RUN_TIMEOUT);
    let text = j.output();
    assert!(
        text.lines()
            .any(|l| l.starts_with("restarted from the self checkpoint at iteration 100 ")),
        "rank 0 did not come back inside its request\n{}",
        j.diag()
    );
    assert!(
        line.ends_with("self_checkpoints=2 restarts=1"),
        "{line}\n{}",
        j.diag()
    );
}

/// The last step of a thermo table.
fn lammps_step(table: &[String]) -> u64 {
    table
        .last()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// An unmodified MPI application from a Debian package: LAMMPS as 6 Open
/// MPI ranks on 3 nodes (its remote daemons started by cr_rsh), killed by
/// a checkpoint a quarter of the way through and restarted on other nodes
/// (n1, n2, n3 to n2, n3, n1): its thermo table (temperature, energies,
/// pressure every 500 steps, to 8 digits) equals the one of the same 6
/// ranks run on one host without checkpoints.
#[test]
fn lammps_on_3_nodes_moved_prints_the_same_thermo() {
    let h = Harness::new("ompi-lammps");
    let input = h.dir.join("in.lj");
    std::fs::write(&input, cr_tests::mpi::lammps_lj(6, 8000, 500)).expect("write in.lj");
    let inp = input.to_string_lossy().into_owned();
    let lammps = ["lmp", "-in", inp.as_str(), "-log", "none"];
    let yield_idle = [("mpi_yield_when_idle", "1")];

    let ref_tmp = h.dir.join("tmp-ref");
    std::fs::create_dir_all(&ref_tmp).expect("mkdir");
    let out = std::process::Command::new("mpirun.openmpi")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "6"])
        .args(["--mca", "mpi_yield_when_idle", "1"])
        .args(["--mca", "orte_tmpdir_base"])
        .arg(&ref_tmp)
        .args(lammps)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run mpirun.openmpi (tests/run.sh installs openmpi-bin and lammps)");
    let ref_out = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "LAMMPS without checkpoints: {}\n{ref_out}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = cr_tests::mpi::lammps_thermo(&ref_out);
    assert_eq!(
        reference.len(),
        17,
        "the reference run's thermo:\n{ref_out}"
    );

    let c = cluster(&h);
    let argv = mpi::open_mpi(&h.dir.join("tmp-lammps"), NP, HOSTS, &yield_idle, &lammps);
    let a: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut j = Job::start(&c, "lammps", &a, &[]);
    wait_until(
        "LAMMPS to reach step 2000 on 3 nodes",
        RUN_TIMEOUT,
        || lammps_step(&cr_tests::mpi::lammps_thermo(&j.output())) >= 2000,
        || j.diag(),
    );
    j.checkpoint_kill();
    let at = lammps_step(&cr_tests::mpi::lammps_thermo(&j.output()));
    assert!(
        at < 8000,
        "LAMMPS finished before the checkpoint\n{}",
        j.diag()
    );
    j.restart(&MOVED);
    wait_until(
        "the restarted LAMMPS to finish",
        MOVED_TIMEOUT,
        || j.output().contains("Total wall time"),
        || j.diag(),
    );
    assert_eq!(
        cr_tests::mpi::lammps_thermo(&j.output()),
        reference,
        "the thermo table after a checkpoint at step {at}, restarted on other nodes\n{}",
        j.diag()
    );
}
