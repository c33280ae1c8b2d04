//! Fault injection for tests: `CR_FAULT_INJECT=<stage>` makes a checkpoint
//! fail at that stage, so tests can prove a failed checkpoint never harms
//! the application. Stages: after-seize, after-registers, mid-memory,
//! pre-dump-frozen, before-commit; of a restore ([`check_restore`]):
//! restore-rebuilt (every process rebuilt, nothing released) and
//! restore-mid-tree (pages of some processes still being written, others
//! not rebuilt yet), to prove a failed restore leaves nothing behind.
//!
//! `CR_FAULT_HOLD=<stage>:<dir>` makes a checkpoint wait at that stage
//! ([`hold`]), so that a test can change the process at a precise moment.
//! Stage: before-freeze (its mappings read, nothing frozen yet).

use crate::{CheckpointError, RestoreError};

pub const ENV: &str = "CR_FAULT_INJECT";
pub const HOLD_ENV: &str = "CR_FAULT_HOLD";

/// How long [`hold`] waits for its release.
const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Fail if the environment asks for a fault at `stage`, or if a signal
/// asked the checkpoint to stop (see [`crate::interrupt`]).
pub fn check(stage: &str) -> Result<(), CheckpointError> {
    crate::interrupt::check().map_err(CheckpointError::Interrupted)?;
    match std::env::var(ENV) {
        Ok(s) if s == stage => Err(CheckpointError::Injected(stage.to_string())),
        _ => Ok(()),
    }
}

/// Whether the environment asks for a fault at `stage`.
pub fn armed(stage: &str) -> bool {
    std::env::var(ENV).is_ok_and(|s| s == stage)
}

/// Fail a restore if the environment asks for a fault at `stage`.
pub fn check_restore(stage: &str) -> Result<(), RestoreError> {
    match std::env::var(ENV) {
        Ok(s) if s == stage => Err(RestoreError::Injected(stage.to_string())),
        _ => Ok(()),
    }
}

/// If the environment asks for a hold at `stage` (`<stage>:<dir>`): create
/// `<dir>/held`, then wait until `<dir>/release` exists (a minute at most:
/// then the checkpoint fails).
pub fn hold(stage: &str) -> Result<(), CheckpointError> {
    let Ok(v) = std::env::var(HOLD_ENV) else {
        return Ok(());
    };
    let Some(dir) = v.strip_prefix(stage).and_then(|r| r.strip_prefix(':')) else {
        return Ok(());
    };
    let dir = std::path::Path::new(dir);
    let held = dir.join("held");
    std::fs::write(&held, b"")
        .map_err(|e| CheckpointError::Invalid(format!("{HOLD_ENV}: {}: {e}", held.display())))?;
    let release = dir.join("release");
    let t0 = std::time::Instant::now();
    while !release.exists() {
        if t0.elapsed() > HOLD_LIMIT {
            return Err(CheckpointError::Injected(format!(
                "{stage} (held, never released)"
            )));
        }
        crate::interrupt::check().map_err(CheckpointError::Interrupted)?;
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    Ok(())
}
