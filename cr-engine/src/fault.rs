//! Fault injection for tests: `CR_FAULT_INJECT=<stage>` makes a checkpoint
//! fail at that stage, so tests can prove a failed checkpoint never harms
//! the application. Stages: after-seize, after-registers, mid-memory,
//! pre-dump-frozen, before-commit; of a restore ([`check_restore`]):
//! restore-rebuilt (every process rebuilt, nothing released) and
//! restore-mid-tree (pages of some processes still being written, others
//! not rebuilt yet), to prove a failed restore leaves nothing behind.

use crate::{CheckpointError, RestoreError};

pub const ENV: &str = "CR_FAULT_INJECT";

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
