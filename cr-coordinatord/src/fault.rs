//! Fault points for the tests (docs/CLUSTER.md, "Test hooks"):
//! `CR_COORD_FAULT=STEP` (prepare, dump, commit, finish, restore; or
//! `@FILE`: the step written in FILE, read at each point) makes the
//! coordinator stop after that step of the protocol (PREPARE and DUMP:
//! every reply in; COMMIT: recorded in the catalog, not yet told to the
//! agents; FINISH: before it is sent; RESTORE: every tree rebuilt, before
//! RELEASE; MIGRATE: the migration's checkpoint committed and its members
//! killed, before the restart on the targets), write the step's name to `$CR_COORD_FAULT_FILE` and wait until
//! that file is removed (at most 10 minutes), so that a test can kill the
//! coordinator right there.

use std::time::{Duration, Instant};

/// The longest a fault point holds an operation.
const HOLD: Duration = Duration::from_secs(600);

/// Stop at `step` if the fault hook names it.
pub async fn point(step: &str) {
    if cr_rpc::fault::wanted("CR_COORD_FAULT") != step {
        return;
    }
    tracing::warn!(step, "fault injected: holding the operation here");
    let Some(f) = std::env::var_os("CR_COORD_FAULT_FILE") else {
        tokio::time::sleep(HOLD).await;
        return;
    };
    let f = std::path::PathBuf::from(f);
    let _ = std::fs::write(&f, step);
    let t0 = Instant::now();
    while f.exists() && t0.elapsed() < HOLD {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tracing::warn!(step, "fault released: going on");
}
