//! `libcr_spank.so`: a Slurm SPANK plugin that puts batch jobs under
//! checkpoint control (docs/SLURM.md).
//!
//! Loaded through plugstack.conf (`required /usr/local/lib/libcr_spank.so
//! [ARG=VALUE]...`, see [`config`]), it adds to sbatch, srun and salloc:
//!
//! * `--checkpoint[=INTERVAL]`: the job is checkpointable: every task
//!   (the batch script, the tasks of every srun step) runs under `cr_run
//!   --job slurm-JOBID` as a member of that cluster job on its node's
//!   agent, so that `crctl checkpoint slurm-JOBID` checkpoints it as one.
//! * `--checkpoint-dir=DIR`: the `cr_run --dir` of every task (where a
//!   `cr_checkpoint PID` of a task writes by default); the batch script's
//!   cr_run also checkpoints its job there with `--kill` on the configured
//!   signal (USR1: `sbatch --signal=B:USR1@SECS` before the time limit).
//! * `--restart-from=CHECKPOINT`: the batch step resumes the job from
//!   CHECKPOINT instead of running the script: `slurm-N` (the last
//!   committed checkpoint of cluster job slurm-N) or `slurm-N-K` (that
//!   checkpoint) through `cr_run --job slurm-N --resume-from`, a directory
//!   through `cr_restart DIR`.
//!
//! When the node's agent cannot be reached the task runs as it would
//! without the plugin, and says so on its stderr (the job's output).
//!
//! All `unsafe` (the C ABI, Slurm's functions) is in `cr_sys::spank`.

pub mod config;
pub mod hostlist;
pub mod task;

use cr_sys::spank::{HasArg, OptionSpec, Plugin, Spank};

/// `--checkpoint[=INTERVAL]`.
pub static OPT_CHECKPOINT: OptionSpec = OptionSpec {
    name: "checkpoint",
    arginfo: "INTERVAL",
    usage: "Make the job checkpointable (cr): its tasks run under cr_run as members of job \
            slurm-JOBID. INTERVAL (seconds, or 10m, 2h): also checkpoint it that often.",
    has_arg: HasArg::Optional,
};

/// `--checkpoint-dir=DIR`.
pub static OPT_CHECKPOINT_DIR: OptionSpec = OptionSpec {
    name: "checkpoint-dir",
    arginfo: "DIR",
    usage: "Image directory of the job's tasks (cr_run --dir); implies --checkpoint.",
    has_arg: HasArg::Required,
};

/// `--restart-from=CHECKPOINT`.
pub static OPT_RESTART_FROM: OptionSpec = OptionSpec {
    name: "restart-from",
    arginfo: "CHECKPOINT",
    usage: "Resume the batch job from this checkpoint instead of running the script: slurm-JOBID \
            (that job's last committed checkpoint), a checkpoint id slurm-JOBID-N (crctl \
            checkpoints), or a directory written by a job made with --checkpoint-dir.",
    has_arg: HasArg::Required,
};

/// The plugin (see the crate docs).
pub struct CrSpank;

impl Plugin for CrSpank {
    const OPTIONS: &'static [OptionSpec] = &[];

    fn init(sp: &Spank, _args: &[String]) -> Result<(), String> {
        for o in [&OPT_CHECKPOINT, &OPT_CHECKPOINT_DIR, &OPT_RESTART_FROM] {
            sp.register(o).map_err(|e| format!("cr_spank: {e}"))?;
        }
        Ok(())
    }

    fn init_post_opt(sp: &Spank, _args: &[String]) -> Result<(), String> {
        // Checked where the user typed it (sbatch, srun, salloc), so that a
        // bad value is refused before the job is queued.
        if let Some(v) = sp.getopt(&OPT_CHECKPOINT).map_err(|e| e.to_string())? {
            task::parse_interval(&v).map_err(|e| format!("cr_spank: --checkpoint={v}: {e}"))?;
        }
        if let Some(v) = sp.getopt(&OPT_RESTART_FROM).map_err(|e| e.to_string())? {
            task::parse_restart_from(&v)
                .map_err(|e| format!("cr_spank: --restart-from={v}: {e}"))?;
        }
        Ok(())
    }

    fn task_init(sp: &Spank, args: &[String]) -> Result<(), String> {
        let cfg = config::Config::parse(args).map_err(|e| format!("cr_spank: {e}"))?;
        task::wrap(sp, &cfg)
    }
}

cr_sys::spank_plugin!("cr_spank", CrSpank);
