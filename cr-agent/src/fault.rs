//! Fault injection for tests: `CR_FAULT_INJECT=<stage>` makes a checkpoint
//! fail at that stage, so tests can prove a failed checkpoint never harms
//! the application. Stages: after-seize, after-registers, mid-memory,
//! before-commit.

use crate::CheckpointError;

pub const ENV: &str = "CR_FAULT_INJECT";

/// Fail if the environment asks for a fault at `stage`.
pub fn check(stage: &str) -> Result<(), CheckpointError> {
    match std::env::var(ENV) {
        Ok(s) if s == stage => Err(CheckpointError::Injected(stage.to_string())),
        _ => Ok(()),
    }
}
