//! Slurm integration (docs/SLURM.md): a real Slurm 22.05 (munged,
//! slurmctld, one slurmd per node; tests/src/slurm.rs) on 3 test nodes, one
//! set-up shared by every cell of the scenario:
//!
//! 1. the set-up itself: a batch job on all 3 nodes whose `srun` step runs
//!    one task on each, each seeing its node's host name.

use cr_tests::cluster::Cluster;
use cr_tests::read_text;
use cr_tests::slurm::{Slurm, SlurmOpts, SLURM_TIMEOUT};
use cr_tests::Harness;

#[test]
fn slurm_scenarios() {
    let h = Harness::new("slurm");
    let c = Cluster::new(&h, 3);
    let s = Slurm::start(&c, &SlurmOpts::default());

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
}
