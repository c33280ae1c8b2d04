//! Slurm integration (docs/SLURM.md): a real Slurm 22.05 (munged,
//! slurmctld, one slurmd per node; tests/src/slurm.rs) on 3 test nodes with
//! the cluster's coordinator and agents, and the SPANK plugin
//! (libcr_spank.so) in plugstack.conf. One set-up is shared by every cell:
//!
//! 1. the set-up itself: a batch job on all 3 nodes whose `srun` step runs
//!    one task on each, each seeing its node's host name;
//! 2. `sbatch --checkpoint`: the batch script of a self-checking
//!    multi-process job (wl_progress) runs as a member of cluster job
//!    `slurm-JOBID` on its node; `crctl checkpoint slurm-JOBID` checkpoints
//!    it while it runs, and it finishes OK with every round done once;
//!    the tasks of its srun steps are members too (the option is inherited);
//!    2c: a job on n1,n2 whose batch script starts a self-checking task on
//!    each node with cr_rsh, stopped on its signal and resumed by `sbatch
//!    --restart-from=slurm-N -N2 -w n2,n3`, resumes spread over them (n1's members on n2, n2's on n3), each task
//!    going on from its round; 2e: the same with a batch script that
//!    runs `srun -n2 -N2` of that task (srun: the stand-in cr_srun, the
//!    tasks relayed to it as members); 2d: the same with an Open MPI job
//!    (mpirun in the batch script, its daemon on n2 started with cr_rsh;
//!    2f: with srun, `plm slurm`), checkpointed on request first, ending
//!    with its own `RESULT OK`;
//! 3. the node's agent is down: the same job still runs (and finishes OK),
//!    and its output says it is not checkpointable;
//! 4. time limit: a job with `--checkpoint-dir` and `--time=1
//!    --signal=B:USR1@50` is checkpointed and stopped by Slurm's signal
//!    before its limit; `sbatch --restart-from=DIR` on another node
//!    resumes it from there (its rounds go on, no second start) and it
//!    finishes OK; beside it (4b), a job with `--checkpoint` stopped by
//!    the same signal is checkpointed as cluster job `slurm-N`; `sbatch
//!    --checkpoint --restart-from=slurm-N` resumes it on another node from
//!    that checkpoint and it finishes OK; `--restart-from=slurm-N-999`
//!    fails with one line;
//! 5. preemption: a job of partition `low` submitted with
//!    `--checkpoint=2` (periodic checkpoints every 2 s) and
//!    `--signal=B:USR1@600` is preempted by a job of partition `high` on
//!    its node: at the start of its GraceTime the coordinated checkpoint
//!    stops it, Slurm requeues it at the end, and when it starts again on
//!    another node it resumes from that checkpoint (its rounds go on, no
//!    second start) and finishes OK;
//! 6. drain: with cr-slurm-drain running, a checkpointable job on a node
//!    drained by `scontrol update State=DRAIN` and one on a node drained
//!    by `crctl drain` are each checkpointed, requeued, and resumed on the
//!    undrained node, finishing OK.

use cr_tests::cluster::{jlist, jstr, node_name, poll_until, Cluster, POLL_PERIOD};
use cr_tests::slurm::{Slurm, SlurmOpts, SLURM_TIMEOUT};
use cr_tests::{bin_dir, read_text, workload_path, Harness};
use std::path::Path;
use std::time::Duration;

/// Rounds of the checkpointed job (50 ms each: long enough to act on it).
const ROUNDS: u64 = 200;

/// What a wl_progress job printed: the number of `start` lines and the
/// last round; checks that rounds go 1, 2, 3, ... without a gap or a
/// repeat and that it ended with `OK`. Lines of the plugin (`cr_spank: `),
/// of a checkpoint on signal (`cr_run: signal `), of a resume (`cr_run: job
/// `) and slurmstepd's notice of a preemption (`slurmstepd-n1: error: ***
/// JOB 7 ON n1 CANCELLED ... DUE TO PREEMPTION ***`, also after OK: the
/// time limit of a job stopped on its signal ends it while the job it
/// resumed runs on) are allowed anywhere.
fn check_progress(text: &str) -> Result<(usize, u64), String> {
    let (mut starts, mut last, mut ok) = (0, 0u64, false);
    for line in text.lines() {
        if line.contains(": error: *** JOB ") {
            continue;
        }
        if ok {
            return Err(format!("a line after OK: {line:?}"));
        }
        if line.starts_with("start ") {
            starts += 1;
        } else if let Some(n) = line.strip_prefix("progress ") {
            let n: u64 = n.parse().map_err(|_| format!("bad line {line:?}"))?;
            if n != last + 1 {
                return Err(format!("round {n} after round {last}"));
            }
            last = n;
        } else if line == "OK" {
            ok = true;
        } else if !line.starts_with("cr_spank: ")
            && !line.starts_with("cr_run: signal ")
            && !line.starts_with("cr_run: job ")
        {
            return Err(format!("unexpected line {line:?}"));
        }
    }
    if !ok {
        return Err("no OK at the end".into());
    }
    Ok((starts, last))
}

/// Submits wl_progress as a batch job on node `k` with `extra` sbatch
/// options; returns its id and output file.
fn submit_progress(s: &Slurm, k: usize, label: &str, extra: &[&str]) -> (u32, String) {
    submit_rounds(s, Some(k), label, ROUNDS, extra)
}

/// [`submit_progress`] of `rounds` rounds, on node `k` or (None) where
/// Slurm puts it.
fn submit_rounds(
    s: &Slurm,
    k: Option<usize>,
    label: &str,
    rounds: u64,
    extra: &[&str],
) -> (u32, String) {
    let out =
        s.c.dir
            .join(format!("{label}.out"))
            .to_string_lossy()
            .into_owned();
    let wl = workload_path("wl_progress");
    let cmd = format!("{} {rounds} 2 50", wl.display());
    let node = k.map(node_name);
    let mut args = vec!["-N1", "-o", &out, "--open-mode=append"];
    if let Some(n) = &node {
        args.extend(["-w", n.as_str()]);
    }
    args.extend_from_slice(extra);
    args.extend(["--wrap", &cmd]);
    (s.sbatch(&args), out)
}

/// `sbatch -N1 -w NODE -o DIR/LABEL.out EXTRA... --wrap true`: a job that
/// resumes another (`--restart-from` in `extra`); its id and output file.
fn submit_resume(s: &Slurm, node: &str, label: &str, extra: &[&str]) -> (u32, String) {
    let out =
        s.c.dir
            .join(format!("{label}.out"))
            .to_string_lossy()
            .into_owned();
    let mut args = vec!["-N1", "-w", node, "-o", &out];
    args.extend_from_slice(extra);
    args.extend(["--wrap", "true"]);
    (s.sbatch(&args), out)
}

/// Waits up to `timeout` until job `id` completed, then checks that the
/// wl_progress output `out` (of `id` or of the job it resumed) went
/// through `rounds` rounds, each once, after one start, and ended OK;
/// `what` names the cell. Returns the output.
fn completed_ok(
    s: &Slurm,
    id: u32,
    out: &str,
    rounds: u64,
    timeout: Duration,
    what: &str,
) -> String {
    s.wait_job(id, &["COMPLETED"], timeout);
    let text = read_text(Path::new(out));
    assert_eq!(
        check_progress(&text),
        Ok((1, rounds)),
        "{what}: the job's output\n{}",
        s.diag_job(id)
    );
    text
}

/// The last round job output `text` shows.
fn last_round(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.strip_prefix("progress "))
        .filter_map(|n| n.parse::<u64>().ok())
        .max()
        .unwrap_or(0)
}

/// The committed checkpoints of cluster job `job` (none while the
/// coordinator does not know the job yet).
fn committed(c: &Cluster, job: &str) -> Vec<String> {
    let out = c.crctl(&["--json", "checkpoints", job]);
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&out.stdout) else {
        return Vec::new();
    };
    jlist(&v, "checkpoints")
        .into_iter()
        .filter(|ck| jstr(ck, "state") == "committed")
        .map(|ck| jstr(ck, "id"))
        .collect()
}

/// Waits until job `id`'s output `out` has a line for which `pred` holds.
fn wait_line(s: &Slurm, id: u32, out: &str, what: &str, pred: impl Fn(&str) -> bool) {
    poll_until(
        &format!("job {id} to print {what}"),
        SLURM_TIMEOUT,
        POLL_PERIOD,
        || read_text(Path::new(out)).lines().any(&pred),
        || s.diag_job(id),
    );
}

/// Waits until job `id` printed round `n`.
fn wait_round(s: &Slurm, id: u32, out: &str, n: u64) {
    poll_until(
        &format!("job {id} to reach round {n}"),
        SLURM_TIMEOUT,
        POLL_PERIOD,
        || {
            read_text(Path::new(out))
                .lines()
                .any(|l| l == format!("progress {n}"))
        },
        || s.diag_job(id),
    );
}

#[test]
fn slurm_scenarios() {
    let h = Harness::new("slurm");
    let c = Cluster::new(&h, 3);
    c.start_coordinator();
    c.start_agents(&[1, 2, 3]);
    let bin = bin_dir();
    // The batch scripts' srun: a directory whose `srun` is cr_srun.
    let stand_in = c.dir.join("srun-stand-in");
    std::fs::create_dir_all(&stand_in).expect("mkdir srun-stand-in");
    std::os::unix::fs::symlink(bin.join("cr_srun"), stand_in.join("srun"))
        .expect("symlink srun-stand-in/srun");
    let plugin = format!(
        "required {} cr_run={} cr_restart={} cr_rsh={} srun_dir={} socket={}",
        bin.join("libcr_spank.so").display(),
        bin.join("cr_run").display(),
        bin.join("cr_restart").display(),
        bin.join("cr_rsh").display(),
        stand_in.display(),
        c.dir.join("%n.sock").display()
    );
    let s = Slurm::start(
        &c,
        &SlurmOpts {
            plugstack: vec![plugin],
            // Time for the checkpoint on preemption (cell 5).
            grace_time: 10,
        },
    );

    // Cell 1: a job on every node.
    let out = c.dir.join("hostnames.out");
    let id = s.sbatch(&[
        "-N3",
        "-o",
        &out.to_string_lossy(),
        "--wrap",
        "echo batch on $(hostname); srun -N3 --ntasks-per-node=1 hostname | sort",
    ]);
    s.wait_job(id, &["COMPLETED"], SLURM_TIMEOUT);
    let text = read_text(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        ["batch on n1", "n1", "n2", "n3"],
        "cell 1: the job's output\n{}",
        s.diag_job(id)
    );

    // Cell 2: a checkpointable job, checkpointed on request while it runs.
    let (id, out) = submit_progress(&s, 2, "checkpointed", &["--checkpoint"]);
    let job = format!("slurm-{id}");
    poll_until(
        &format!("job {id} to be a member of cluster job {job} on n2"),
        SLURM_TIMEOUT,
        POLL_PERIOD,
        || {
            c.job_procs(&job)
                .iter()
                .any(|(n, _, alive)| n == "n2" && *alive)
        },
        || s.diag_job(id),
    );
    wait_round(&s, id, &out, 10);
    let ck = c.crctl(&["checkpoint", &job]);
    assert!(
        ck.status.success(),
        "cell 2: crctl checkpoint {job}\n{}\n{}",
        ck.show(),
        s.diag_job(id)
    );
    println!("MEASURED: {}", ck.stdout.lines().next().unwrap_or(""));
    // The same from the job's node, as its user: cr_checkpoint --slurm.
    let socket = (
        "CR_AGENT_SOCKET".to_string(),
        c.socket(2).to_string_lossy().into_owned(),
    );
    let ck = c.run_env(
        Some(c.ns(2)),
        "cr_checkpoint-slurm",
        &bin.join("cr_checkpoint"),
        &["--slurm".into(), id.to_string().into()],
        &[socket],
    );
    assert!(
        ck.status.success()
            && ck
                .stdout
                .starts_with(&format!("checkpoint {job}-2 committed: ")),
        "cell 2: cr_checkpoint --slurm {id}\n{}\n{}",
        ck.show(),
        s.diag_job(id)
    );
    println!(
        "MEASURED: cr_checkpoint --slurm: {}",
        ck.stdout.lines().next().unwrap_or("")
    );
    completed_ok(&s, id, &out, ROUNDS, SLURM_TIMEOUT, "cell 2");

    // Cell 2b: the srun steps of a checkpointable batch job inherit
    // --checkpoint (through the job's environment): each task is wrapped.
    let out = c.dir.join("steps.out");
    let id = s.sbatch(&[
        "--checkpoint",
        "-N2",
        "-w",
        "n1,n2",
        "-o",
        &out.to_string_lossy(),
        "--wrap",
        "echo batch $CR_SLURM_JOB; srun -N2 --ntasks-per-node=1 sh -c 'echo step $CR_SLURM_JOB on $(hostname)' | sort",
    ]);
    s.wait_job(id, &["COMPLETED"], SLURM_TIMEOUT);
    let text = read_text(&out);
    let want = [
        format!("batch slurm-{id}"),
        format!("step slurm-{id} on n1"),
        format!("step slurm-{id} on n2"),
    ];
    assert_eq!(
        text.lines().collect::<Vec<_>>(),
        want,
        "cell 2b: every task runs under cr_run as a member of slurm-{id}\n{}",
        s.diag_job(id)
    );

    // Cell 2c: a multi-node job, stopped by its signal and requeued onto
    // another pair of nodes, resumes spread over them.
    spread_over_new_allocation(&s, &c);
    // Cell 2e: a job whose batch script runs an srun step, stopped and
    // resumed onto other nodes.
    srun_step_job(&s, &c);
    // Cell 2d: an Open MPI job, checkpointed, requeued onto other nodes.
    let prog = cr_tests::mpi::build_check(&h.dir, "mpicc.openmpi", "mpi_check_ompi");
    mpi_job(&s, &c, &prog, "rsh");
    // Cell 2f: the same with mpirun's daemons started by srun (plm slurm).
    mpi_job(&s, &c, &prog, "slurm");

    // Cell 3: no agent on n3: the job runs without checkpoints and says so.
    c.kill_agent(3);
    let (id, out) = submit_progress(&s, 3, "no-agent", &["--checkpoint"]);
    let wait = SLURM_TIMEOUT + Duration::from_secs(ROUNDS / 10);
    let text = completed_ok(&s, id, &out, ROUNDS, wait, "cell 3");
    assert!(
        text.lines().any(|l| l.starts_with("cr_spank: ")
            && l.contains(&format!("job {id} is NOT checkpointable"))
            && l.contains("cannot reach the cr agent of n3")),
        "cell 3: the output should say the job is not checkpointable\n{text}"
    );
    c.start_agent(3);

    // Cell 4: checkpointed before the time limit, resumed elsewhere: into
    // a directory on n1 (--checkpoint-dir, resumed with --restart-from=DIR)
    // and as cluster job slurm-N on n2 (--checkpoint, resumed with
    // --restart-from=slurm-N), side by side (one wait for the signal).
    const LONG: u64 = 1000;
    let ck = c.dir.join("ck-timelimit").to_string_lossy().into_owned();
    let dir_opt = format!("--checkpoint-dir={ck}");
    let limit = ["--time=1", "--signal=B:USR1@50"];
    let (id, out) = submit_rounds(
        &s,
        Some(1),
        "timelimit",
        LONG,
        &[&dir_opt, limit[0], limit[1]],
    );
    let (idj, outj) = submit_rounds(
        &s,
        Some(2),
        "timelimit-job",
        LONG,
        &["--checkpoint", limit[0], limit[1]],
    );
    s.wait_job(id, &["FAILED"], SLURM_TIMEOUT + Duration::from_secs(30));
    let before = read_text(Path::new(&out));
    let stopped_at = last_round(&before);
    assert!(
        before
            .lines()
            .any(|l| l.starts_with("cr_run: signal 10: job checkpointed into"))
            && !before.lines().any(|l| l == "OK")
            && stopped_at > 0,
        "cell 4: the job should be checkpointed and stopped on SIGUSR1\n{}",
        s.diag_job(id)
    );
    let from = format!("--restart-from={ck}");
    let (id2, out2) = submit_resume(&s, "n3", "resumed", &[&from]);
    let wait = SLURM_TIMEOUT + Duration::from_secs(LONG / 20);

    // Cell 4b: the job of n2 checkpointed as cluster job slurm-N with
    // --kill on the signal, and held its place (until its limit).
    let jobj = format!("slurm-{idj}");
    wait_line(
        &s,
        idj,
        &outj,
        "its checkpoint before the time limit",
        |l| {
            l.starts_with(&format!(
                "cr_run: signal 10: job checkpointed (cluster job {jobj})"
            ))
        },
    );
    let stopped_j = last_round(&read_text(Path::new(&outj)));
    let lastj = committed(&c, &jobj).last().cloned().unwrap_or_default();
    // A checkpoint id that does not exist: the job fails, saying so.
    let bad = format!("{jobj}-999");
    let from_bad = format!("--restart-from={bad}");
    let (id_bad, out_bad) = submit_resume(&s, "n1", "restart-bad", &["--checkpoint", &from_bad]);
    s.wait_job(id_bad, &["FAILED"], SLURM_TIMEOUT);
    let text = read_text(Path::new(&out_bad));
    assert!(
        text.lines().any(|l| l.starts_with(&format!(
            "cr_run: error: cannot resume job {jobj} from {bad}: "
        )) && l.ends_with(&format!("no checkpoint {bad}"))),
        "cell 4b: --restart-from={bad} should fail with one line\n{}",
        s.diag_job(id_bad)
    );
    // Resumed on n1 from its last committed checkpoint.
    let from_j = format!("--restart-from={jobj}");
    let (idr, out_r) = submit_resume(&s, "n1", "resumed-job", &["--checkpoint", &from_j]);
    let what = format!("cell 4b (stopped at round {stopped_j}, resumed from {lastj})");
    completed_ok(&s, idr, &outj, LONG, wait, &what);
    let text = read_text(Path::new(&out_r));
    assert!(
        stopped_j > 0
            && text.contains(&format!("cr_spank: job {idr} resumes from {jobj}\n"))
            && text
                .lines()
                .any(|l| l.starts_with(&format!("cr_run: job {jobj} resumed from {lastj} ("))),
        "cell 4b: the resuming job says so\n{text}\n{}",
        s.diag_job(idr)
    );
    println!(
        "MEASURED: time-limit job {jobj} stopped at round {stopped_j} of {LONG}, resumed on n1 with --restart-from={jobj} (from {lastj})"
    );

    let what = format!("cell 4 (stopped at round {stopped_at})");
    completed_ok(&s, id2, &out, LONG, wait, &what);
    assert!(
        read_text(Path::new(&out2)).contains(&format!("cr_spank: job {id2} resumes from {ck}")),
        "cell 4: the resuming job says so\n{}",
        s.diag_job(id2)
    );
    println!("MEASURED: time-limit job stopped at round {stopped_at} of {LONG}, resumed on n3");
    // The job stopped on its signal held its place until its limit.
    s.wait_job(idj, &["TIMEOUT"], SLURM_TIMEOUT);

    // Cell 5: preempted, checkpointed, requeued, resumed on another node.
    const PRE: u64 = 300;
    let (id, out) = submit_rounds(
        &s,
        None,
        "preempted",
        PRE,
        &["--checkpoint=2", "--signal=B:USR1@600"],
    );
    let job = format!("slurm-{id}");
    s.wait_job(id, &["RUNNING"], SLURM_TIMEOUT);
    let first = s.job_field(id, "NodeList");
    // --checkpoint=2: the coordinator checkpoints it every 2 s.
    poll_until(
        &format!("a periodic checkpoint of {job}"),
        SLURM_TIMEOUT,
        POLL_PERIOD,
        || !committed(&c, &job).is_empty(),
        || s.diag_job(id),
    );
    wait_round(&s, id, &out, 40);
    let high_out = c.dir.join("high.out").to_string_lossy().into_owned();
    let high = s.sbatch(&[
        "-p",
        "high",
        "-N1",
        "-w",
        &first,
        "-o",
        &high_out,
        "--wrap",
        "echo high on $(hostname); sleep 12",
    ]);
    let t0 = std::time::Instant::now();
    wait_line(&s, id, &out, "its checkpoint on preemption", |l| {
        l.starts_with("cr_run: signal 10: job checkpointed (cluster job ")
    });
    let notice_ms = t0.elapsed().as_millis();
    let stopped_at = last_round(&read_text(Path::new(&out)));
    let last = committed(&c, &job).last().cloned().unwrap_or_default();
    // Slurm requeues it at the end of the grace time; a requeued job waits
    // for its BeginTime, brought forward here.
    poll_until(
        &format!("job {id} to be requeued"),
        SLURM_TIMEOUT,
        POLL_PERIOD,
        || s.job_field(id, "JobState") == "PENDING" && s.job_field(id, "Restarts") == "1",
        || s.diag_job(id),
    );
    let requeue_ms = t0.elapsed().as_millis();
    let up = s.cmd(&[
        "scontrol",
        "update",
        &format!("JobId={id}"),
        "StartTime=now",
    ]);
    assert!(
        up.status.success(),
        "scontrol update StartTime\n{}",
        up.show()
    );
    s.wait_job(id, &["RUNNING", "COMPLETED"], SLURM_TIMEOUT);
    let second = s.job_field(id, "NodeList");
    let wait = SLURM_TIMEOUT + Duration::from_secs(PRE / 20);
    let what = format!("cell 5 (stopped at round {stopped_at}, resumed from {last})");
    let text = completed_ok(&s, id, &out, PRE, wait, &what);
    assert!(
        stopped_at >= 40
            && text
                .lines()
                .any(|l| l.starts_with(&format!("cr_run: job {job} resumed from {last} ("))),
        "cell 5: the job resumed from its checkpoint on preemption {last}\n{text}\n{}",
        s.diag_job(id)
    );
    assert_ne!(
        first, second,
        "cell 5: the requeued job should run elsewhere"
    );
    s.wait_job(high, &["COMPLETED"], SLURM_TIMEOUT);
    println!(
        "MEASURED: preempted on {first} at round {stopped_at} of {PRE} (checkpoint {last} {notice_ms} ms after the preemptor's submission), requeued after {requeue_ms} ms, resumed on {second}"
    );

    // Cell 6: drain. cr-slurm-drain moves the checkpointable jobs off a
    // node drained in Slurm (scontrol) and off one drained by crctl: each
    // is checkpointed, requeued and resumed on the one undrained node.
    s.start_drain_watcher();
    const DRAINED: u64 = 300;
    let mut moved = Vec::new();
    for label in ["drain-scontrol", "drain-crctl"] {
        let (id, out) = submit_rounds(&s, None, label, DRAINED, &["--checkpoint"]);
        s.wait_job(id, &["RUNNING"], SLURM_TIMEOUT);
        wait_round(&s, id, &out, 10);
        moved.push((id, out, s.job_field(id, "NodeList")));
    }
    let t0 = std::time::Instant::now();
    let by_scontrol = &moved[0].2;
    let up = s.cmd(&[
        "scontrol",
        "update",
        &format!("NodeName={by_scontrol}"),
        "State=DRAIN",
        "Reason=cell 6",
    ]);
    assert!(
        up.status.success(),
        "scontrol update State=DRAIN\n{}",
        up.show()
    );
    let by_crctl = &moved[1].2;
    let dr = c.crctl(&["drain", by_crctl]);
    let left = format!("  left: slurm-{}: a Slurm job", moved[1].0);
    assert!(
        dr.status.success() && dr.stdout.lines().any(|l| l.starts_with(&left)),
        "cell 6: crctl drain {by_crctl} leaves the Slurm job to Slurm\n{}\n{}",
        dr.show(),
        s.diag()
    );
    for (id, out, node) in &moved {
        let job = format!("slurm-{id}");
        let wait = SLURM_TIMEOUT + Duration::from_secs(2 * DRAINED / 20);
        let text = completed_ok(&s, *id, out, DRAINED, wait, &format!("cell 6 ({job})"));
        let now = s.job_field(*id, "NodeList");
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("cr_run: job {job} resumed from {job}-")))
                && now != *node
                && s.job_field(*id, "Restarts") == "1",
            "cell 6: {job} should be checkpointed on {node}, requeued and resumed elsewhere (ran on {now})\n{text}\n{}",
            s.diag_job(*id)
        );
        println!(
            "MEASURED: drained {node}: {job} resumed on {now}, done {} ms after the drains",
            t0.elapsed().as_millis()
        );
    }
    // crctl's drain is Slurm's too.
    assert_eq!(s.node_state_of(by_crctl), "drained", "cell 6\n{}", s.diag());
}

/// Rounds of each task of the multi-node job (cell 2c).
const SPREAD: u64 = 300;

/// The nodes of cluster job `job` with a live member, sorted.
fn member_nodes(c: &Cluster, job: &str) -> Vec<String> {
    let mut nodes: Vec<String> = c
        .job_procs(job)
        .into_iter()
        .filter(|(_, _, alive)| *alive)
        .map(|(n, _, _)| n)
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

/// Job `id` (cluster job `job`, batch output `out`) running on n1,n2:
/// stops it on its signal (`scancel --batch --signal=USR1`: its batch
/// step's cr_run checkpoints the whole job with --kill and holds its
/// place), ends it (`scancel`), and resumes it in a new job on n2,n3
/// (`sbatch --checkpoint --restart-from=slurm-ID -N2 -w n2,n3`, output
/// `label.out`; a requeue onto a node of the old allocation would be
/// refused by its slurmd until Slurm's credential of the old run expires,
/// 2 minutes), n1's members on n2 and n2's on n3. `before` runs once the
/// job is stopped. Returns the new job's id and its resume line.
fn resume_on_n2_n3(
    s: &Slurm,
    c: &Cluster,
    (id, job, out): (u32, &str, &str),
    label: &str,
    before: impl FnOnce(),
) -> (u32, String) {
    let what = format!("{label} ({job})");
    assert_eq!(
        member_nodes(c, job),
        ["n1", "n2"],
        "{what}: its members\n{}",
        s.diag_job(id)
    );
    let sig = s.cmd(&["scancel", "--batch", "--signal=USR1", &id.to_string()]);
    assert!(
        sig.status.success(),
        "{what}: scancel --signal\n{}",
        sig.show()
    );
    wait_line(s, id, out, "its checkpoint on the signal", |l| {
        l.starts_with(&format!(
            "cr_run: signal 10: job checkpointed (cluster job {job})"
        ))
    });
    before();
    let last = committed(c, job).last().cloned().unwrap_or_default();
    let end = s.cmd(&["scancel", &id.to_string()]);
    assert!(end.status.success(), "{what}: scancel\n{}", end.show());
    s.wait_job(id, &["CANCELLED"], SLURM_TIMEOUT);
    let from = format!("--restart-from={job}");
    let new_out =
        s.c.dir
            .join(format!("{label}.out"))
            .to_string_lossy()
            .into_owned();
    let id2 = s.sbatch(&[
        "--checkpoint",
        &from,
        "-N2",
        "-w",
        "n2,n3",
        "-o",
        &new_out,
        "--wrap",
        "true",
    ]);
    let resumed = format!("cr_run: job {job} resumed from {last} (");
    wait_line(s, id2, &new_out, "its resume", |l| l.starts_with(&resumed));
    let line = read_text(Path::new(&new_out))
        .lines()
        .find(|l| l.starts_with(&resumed))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.ends_with("; nodes n1->n2, n2->n3)"),
        "{what}: n1's members go to n2, n2's to n3: {line}\n{}",
        s.diag_job(id2)
    );
    assert_eq!(
        member_nodes(c, job),
        ["n2", "n3"],
        "{what}: its live members after the resume\n{}",
        s.diag_job(id2)
    );
    (id2, line)
}

/// Cell 2c: `sbatch --checkpoint -N2 -w n1,n2` whose batch script starts
/// a self-checking task (wl_progress, its own output file) on each of
/// its nodes with cr_rsh; stopped on its signal, resumed on n2,n3
/// ([`resume_on_n2_n3`]): each task goes on from its round on its new
/// node and the resuming job ends COMPLETED.
fn spread_over_new_allocation(s: &Slurm, c: &Cluster) {
    let (rsh, wl) = (bin_dir().join("cr_rsh"), workload_path("wl_progress"));
    let path = |name: &str| c.dir.join(name).to_string_lossy().into_owned();
    let outs = [path("spread-n1.out"), path("spread-n2.out")];
    let task = |node: &str, out: &str| {
        format!(
            "{} {node} '{} {SPREAD} 2 50 >>{out} 2>&1 </dev/null'",
            rsh.display(),
            wl.display()
        )
    };
    let script = format!(
        "{} & a=$!; {} & b=$!; wait $a && wait $b",
        task("n1", &outs[0]),
        task("n2", &outs[1])
    );
    let batch_out = path("spread.out");
    let id = s.sbatch(&[
        "--checkpoint",
        "-N2",
        "-w",
        "n1,n2",
        "-o",
        &batch_out,
        "--open-mode=append",
        "--wrap",
        &script,
    ]);
    let job = format!("slurm-{id}");
    for out in &outs {
        wait_round(s, id, out, 20);
    }
    let mut stopped = Vec::new();
    let (id2, line) = resume_on_n2_n3(s, c, (id, &job, &batch_out), "spread-resumed", || {
        stopped = outs
            .iter()
            .map(|o| last_round(&read_text(Path::new(o))))
            .collect();
    });
    let wait = SLURM_TIMEOUT + Duration::from_secs(SPREAD / 20);
    s.wait_job(id2, &["COMPLETED"], wait);
    for (out, at) in outs.iter().zip(&stopped) {
        let text = read_text(Path::new(out));
        assert_eq!(
            check_progress(&text),
            Ok((1, SPREAD)),
            "cell 2c: task output {out} (stopped at round {at})\n{}",
            s.diag_job(id2)
        );
        assert!(*at >= 20, "cell 2c: {out} stopped at round {at}");
    }
    println!(
        "MEASURED: multi-node job {job} stopped at rounds {stopped:?} of {SPREAD} on n1,n2, resumed on n2,n3 by job {id2}: {line}"
    );
}

/// Rounds of each task of the srun step (cell 2e).
const STEP: u64 = 300;

/// The lines of task `tag` in a shared output (`TAG line`), untagged.
fn tagged(text: &str, tag: &str) -> String {
    let pre = format!("{tag} ");
    text.lines()
        .filter_map(|l| l.strip_prefix(&pre))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Cell 2e: `sbatch --checkpoint -N2 -w n1,n2` whose batch script runs
/// `srun -n2 -N2` of a self-checking multi-process program (wl_progress,
/// one task per node, each tagging its lines `tRANK`): srun is the
/// stand-in (cr_srun), each task a member on its node whose output comes
/// to the batch script over a TCP connection between members. Stopped on
/// its signal while the step runs (the whole job checkpointed with
/// --kill), resumed on n2,n3 ([`resume_on_n2_n3`]): each task goes on
/// from its round (one start, no round repeated or skipped), the step
/// ends with status 0 and the batch script after it.
fn srun_step_job(s: &Slurm, c: &Cluster) {
    let wl = workload_path("wl_progress");
    let out = c.dir.join("srun-step.out").to_string_lossy().into_owned();
    let script = format!(
        "srun -n2 -N2 sh -c 'WL_TAG=t$SLURM_PROCID exec {} {STEP} 2 50'; echo step ended $?",
        wl.display()
    );
    let id = s.sbatch(&[
        "--checkpoint",
        "-N2",
        "-w",
        "n1,n2",
        "-o",
        &out,
        "--open-mode=append",
        "--wrap",
        &script,
    ]);
    let job = format!("slurm-{id}");
    for t in ["t0", "t1"] {
        let line = format!("{t} progress 20");
        wait_line(s, id, &out, &line, |l| l == line);
    }
    let mut stopped = Vec::new();
    let (id2, line) = resume_on_n2_n3(s, c, (id, &job, &out), "srun-resumed", || {
        let text = read_text(Path::new(&out));
        stopped = ["t0", "t1"]
            .iter()
            .map(|t| last_round(&tagged(&text, t)))
            .collect();
    });
    let wait = SLURM_TIMEOUT + Duration::from_secs(STEP / 20);
    s.wait_job(id2, &["COMPLETED"], wait);
    let text = read_text(Path::new(&out));
    for (t, at) in ["t0", "t1"].iter().zip(&stopped) {
        assert_eq!(
            check_progress(&tagged(&text, t)),
            Ok((1, STEP)),
            "cell 2e: task {t} (stopped at round {at})\n{text}\n{}",
            s.diag_job(id2)
        );
        assert!(*at >= 20, "cell 2e: task {t} stopped at round {at}");
    }
    assert!(
        text.lines().any(|l| l == "step ended 0"),
        "cell 2e: the batch script goes on after the step with its status 0\n{text}"
    );
    println!(
        "MEASURED: srun step of job {job} (2 tasks on n1,n2) stopped at rounds {stopped:?} of {STEP}, resumed on n2,n3 by job {id2}: {line}"
    );
}

/// Iterations of the MPI job (cell 2d), 5 ms each at least.
const MPI_ITERS: u64 = 1500;

/// Cell 2d: an Open MPI job (tests/workloads/mpi_check.c, ring, 4 ranks)
/// submitted with `sbatch --checkpoint -N2 -w n1,n2`: mpirun in the batch
/// script starts its daemon on n2 with `plm` (`rsh`: cr_rsh; `slurm`:
/// srun, which is the batch script's stand-in); checkpointed on request
/// while it runs (`crctl checkpoint slurm-JOBID`), stopped on its signal,
/// resumed on n2,n3 ([`resume_on_n2_n3`]); it ends with the program's own
/// `RESULT OK` (every rank's state equals a serial recomputation: the
/// result of a run without checkpoints) and the job COMPLETED.
fn mpi_job(s: &Slurm, c: &Cluster, prog: &Path, plm: &str) {
    let label = format!("mpi-{plm}");
    let out = c
        .dir
        .join(format!("{label}.out"))
        .to_string_lossy()
        .into_owned();
    let iters = MPI_ITERS.to_string();
    let argv = cr_tests::mpi::open_mpi(
        &c.dir.join(format!("tmp-{label}")),
        4,
        "n1:2,n2:2",
        &[
            ("plm", plm),
            // The allocation's slots (plm slurm: 2 tasks per node), or
            // --host alone (rsh).
            ("ras", if plm == "slurm" { "slurm" } else { "^slurm" }),
            ("mpi_yield_when_idle", "1"),
        ],
        &[&prog.to_string_lossy(), "ring", &iters, "5000"],
    );
    let (k, v) = cr_tests::mpi::path_env();
    let export = format!("--export=ALL,{k}={v}");
    let id = s.sbatch(&[
        "--checkpoint",
        "-N2",
        "-w",
        "n1,n2",
        "--ntasks-per-node=2",
        "-o",
        &out,
        "--open-mode=append",
        &export,
        "--wrap",
        &argv.join(" "),
    ]);
    let job = format!("slurm-{id}");
    let progress = |text: &str| {
        text.lines()
            .filter_map(|l| l.strip_prefix("progress "))
            .filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
    };
    let past = |n: u64| {
        poll_until(
            &format!("MPI job {id} past iteration {n}"),
            SLURM_TIMEOUT,
            POLL_PERIOD,
            || progress(&read_text(Path::new(&out))) >= n,
            || s.diag_job(id),
        )
    };
    past(100);
    let ck = c.crctl(&["checkpoint", &job, "--freeze-timeout", "60"]);
    assert!(
        ck.status.success(),
        "cell 2d ({plm}): crctl checkpoint {job}\n{}\n{}",
        ck.show(),
        s.diag_job(id)
    );
    let first = progress(&read_text(Path::new(&out)));
    past(first + 50);
    let mut stopped = 0;
    let resumed = format!("{label}-resumed");
    let (id2, line) = resume_on_n2_n3(s, c, (id, &job, &out), &resumed, || {
        stopped = progress(&read_text(Path::new(&out)));
    });
    s.wait_job(id2, &["COMPLETED"], SLURM_TIMEOUT * 3);
    let text = read_text(Path::new(&out));
    // Its progress never went back (resumed, not started over).
    let steps: Vec<u64> = text
        .lines()
        .filter_map(|l| l.strip_prefix("progress "))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(
        text.lines().any(|l| l.starts_with("RESULT OK ring"))
            && !text.contains("FAIL")
            && steps.windows(2).all(|w| w[0] < w[1])
            && steps.last() == Some(&MPI_ITERS)
            && stopped > first,
        "cell 2d ({plm}): the MPI job ends with its own RESULT OK after the resume (stopped at {stopped})\n{text}\n{}",
        s.diag_job(id2)
    );
    println!(
        "MEASURED: MPI job {job} (4 ranks, plm {plm}) checkpointed at iteration {first}, stopped at {stopped} of {MPI_ITERS} on n1,n2, resumed on n2,n3 by job {id2}: {line}; {}",
        text.lines().find(|l| l.starts_with("RESULT ")).unwrap_or("")
    );
}
