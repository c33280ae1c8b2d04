//! Checkpoints asked for without an agent (`cr_request_checkpoint` of
//! one's own tree on a node where no cr-agent runs): the library runs the
//! standalone `cr_checkpoint` on its own process, as BLCR's library did
//! without a daemon. `cr_checkpoint --libcr-request N PID` detaches
//! itself at once (so that it is no part of the tree it checkpoints), and
//! tells the process how the checkpoint ended on its libcr socket (DONE,
//! see `cr_proto::coop`), as the agent would.
//!
//! The program is, first found: `$CR_CHECKPOINT_PROGRAM`; `cr_checkpoint`
//! in the directory libcr.so was loaded from (a build tree, or an
//! installation's lib/ next to bin/... as `../bin/cr_checkpoint`); else
//! `cr_checkpoint` on `PATH`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The variable naming the cr_checkpoint program to run.
pub const PROGRAM_ENV: &str = "CR_CHECKPOINT_PROGRAM";

/// Why the fallback could not start.
#[derive(Debug, Clone, thiserror::Error)]
#[error("libcr: no cr-agent answers and {program} could not be run: {reason}")]
pub struct FallbackError {
    pub program: String,
    pub reason: String,
}

/// The directory of the libcr.so this process mapped (from /proc/self/maps;
/// None when libcr is linked statically, as the Rust crate is).
fn library_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libcr.so") || p.contains("/libcr.so."))
        .and_then(|p| Path::new(p).parent().map(Path::to_path_buf))
}

/// The cr_checkpoint program to run.
pub fn program() -> PathBuf {
    if let Some(p) = std::env::var_os(PROGRAM_ENV).filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    if let Some(dir) = library_dir() {
        for candidate in [dir.join("cr_checkpoint"), dir.join("../bin/cr_checkpoint")] {
            if candidate.is_file() {
                return candidate;
            }
        }
    }
    PathBuf::from("cr_checkpoint")
}

/// Start a checkpoint of this process's tree into `dir` (None: the
/// default), reported as request `id`; returns once the detached
/// cr_checkpoint runs.
pub fn start(id: u64, dir: Option<&str>) -> Result<(), FallbackError> {
    let program = program();
    let fail = |reason: String| FallbackError {
        program: program.display().to_string(),
        reason,
    };
    let mut cmd = Command::new(&program);
    cmd.arg("--standalone")
        .arg("--quiet")
        .arg("--libcr-request")
        .arg(id.to_string());
    if let Some(d) = dir {
        cmd.arg("--dir").arg(d);
    }
    cmd.arg(std::process::id().to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    // The first cr_checkpoint only starts the detached one and exits:
    // reaped here, nothing of it is left in the tree.
    let st = cmd
        .status()
        .map_err(|e| fail(format!("cannot start it: {e}")))?;
    if !st.success() {
        return Err(fail(format!("it failed to start ({st})")));
    }
    Ok(())
}
