//! MPI jobs on a [`crate::cluster::Cluster`] (tests/tests/mpi.rs and
//! `cr-bench mpi`): the self-checking program tests/workloads/mpi_check.c
//! built with an MPI's `mpicc`, and the command lines of Open MPI's
//! `mpirun` and MPICH's `mpiexec` with `cr_rsh` as their ssh
//! (docs/MPI.md).

use crate::{bin_dir, script_path};
use std::path::{Path, PathBuf};
use std::process::Command;

/// PATH with our tools (cr_rsh) first, for the job's environment.
pub fn path_env() -> (String, String) {
    let old = std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into());
    (
        "PATH".into(),
        format!("{}:/usr/local/bin:/usr/bin:/bin:{old}", bin_dir().display()),
    )
}

/// The `progress N [T]` lines of mpi_check's output: (N, T), T (the
/// program's wall clock, seconds since the epoch) 0 when the line has none.
pub fn progress_lines(output: &str) -> Vec<(u64, f64)> {
    output
        .lines()
        .filter_map(|l| l.strip_prefix("progress "))
        .filter_map(|rest| {
            let mut w = rest.split_whitespace();
            let n = w.next()?.parse().ok()?;
            Some((n, w.next().and_then(|t| t.parse().ok()).unwrap_or(0.0)))
        })
        .collect()
}

/// Compiles tests/workloads/mpi_check.c with `mpicc` into `dir/name`.
pub fn build_check(dir: &Path, mpicc: &str, name: &str) -> PathBuf {
    let out = dir.join(name);
    let st = Command::new(mpicc)
        .args(["-O2", "-o"])
        .arg(&out)
        .arg(script_path("mpi_check.c"))
        .status()
        .unwrap_or_else(|e| panic!("run {mpicc} (install libopenmpi-dev / libmpich-dev): {e}"));
    assert!(st.success(), "{mpicc} mpi_check.c failed: {st}");
    out
}

/// `mpirun` of Open MPI running `prog` as `np` ranks placed by `hosts`
/// (`n1:2,n2:2,...`), its remote daemons started by cr_rsh, its session
/// directories under `tmp` (one per job: every mpirun is PID 1 of its
/// job's PID namespace, so jobs of one node get the same Open MPI job id,
/// and would share their session directories), with the MCA parameters
/// `mca` (name, value) besides ours.
pub fn open_mpi(
    tmp: &Path,
    np: usize,
    hosts: &str,
    mca: &[(&str, &str)],
    prog: &[&str],
) -> Vec<String> {
    std::fs::create_dir_all(tmp).expect("mkdir the job's session directory base");
    let np = np.to_string();
    let mut v: Vec<String> = [
        "mpirun.openmpi",
        "--allow-run-as-root",
        "-np",
        &np,
        "--host",
        hosts,
        "--mca",
        "plm_rsh_agent",
        "cr_rsh",
        "--mca",
        "btl_tcp_if_include",
        "eth0",
        "--mca",
        "oob_tcp_if_include",
        "eth0",
        "--mca",
        "orte_tmpdir_base",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(tmp.display().to_string());
    for (name, value) in mca {
        v.extend(["--mca".into(), name.to_string(), value.to_string()]);
    }
    v.extend(prog.iter().map(|s| s.to_string()));
    v
}

/// `mpiexec` of MPICH (hydra) with cr_rsh as its ssh: `prog` as `np` ranks
/// placed by `hosts`.
pub fn mpich(np: usize, hosts: &str, prog: &[&str]) -> Vec<String> {
    let np = np.to_string();
    let mut v: Vec<String> = [
        "mpiexec.mpich",
        "-launcher",
        "ssh",
        "-launcher-exec",
        "cr_rsh",
        "-hosts",
        hosts,
        "-n",
        &np,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(prog.iter().map(|s| s.to_string()));
    v
}

/// Input of a Lennard-Jones melt for LAMMPS (its `bench/in.lj`, smaller):
/// a box of `cells`³ fcc cells (4 atoms each), `steps` steps, a thermo
/// line every `thermo`; deterministic for a given number of ranks.
pub fn lammps_lj(cells: u32, steps: u32, thermo: u32) -> String {
    format!(
        "units lj
atom_style atomic
lattice fcc 0.8442
region box block 0 {cells} 0 {cells} 0 {cells}
create_box 1 box
create_atoms 1 box
mass 1 1.0
velocity all create 3.0 87287 loop geom
pair_style lj/cut 2.5
pair_coeff 1 1 1.0 1.0 2.5
neighbor 0.3 bin
neigh_modify every 20 delay 0 check no
fix 1 all nve
thermo {thermo}
run {steps}
"
    )
}

/// The thermo table of a LAMMPS run's output: every line between its
/// `Step ...` header and `Loop time`, blanks squeezed.
pub fn lammps_thermo(out: &str) -> Vec<String> {
    out.lines()
        .skip_while(|l| !l.trim_start().starts_with("Step "))
        .skip(1)
        .take_while(|l| !l.starts_with("Loop time"))
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect()
}
