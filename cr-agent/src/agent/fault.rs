//! Fault points for the tests (docs/CLUSTER.md, "Test hooks"):
//! `CR_AGENT_FAULT=STEP` (prepare, dump, commit, finish, restore, release,
//! fetch, postcopy; or
//! `@FILE`: the step written in FILE, read at each point) makes the
//! session stop at that step (PREPARE: frozen and locked, before its reply;
//! DUMP: before the dump; COMMIT: recorded, before its reply; FINISH:
//! before the processes are let go; RESTORE: rebuilt, before its reply;
//! RELEASE: a restore's, before the processes are let go;
//! FETCH: an image copy to this node, after its first chunk; POSTCOPY:
//! this node serving a post-copy, its push held after the first block
//! while the blocks asked for still go),
//! write the step's name to `$CR_AGENT_FAULT_FILE` and wait until that
//! file is removed (at most 10 minutes), so that a test can kill the agent
//! or cut its link right there, then let it go on.

use super::Shared;
use std::time::{Duration, Instant};
use tracing::warn;

/// The longest a fault point holds a session.
const HOLD: Duration = Duration::from_secs(600);

/// Stop at `step` if the fault hook names it.
pub fn point(step: &str, _shared: &Shared) {
    let want = cr_rpc::fault::wanted("CR_AGENT_FAULT");
    if want != step && want != format!("{step}-hang") {
        return;
    }
    warn!(step, "fault injected: holding the session here");
    let Some(f) = std::env::var_os("CR_AGENT_FAULT_FILE") else {
        std::thread::sleep(HOLD);
        return;
    };
    let f = std::path::PathBuf::from(f);
    let _ = std::fs::write(&f, step);
    let t0 = Instant::now();
    while f.exists() && t0.elapsed() < HOLD {
        std::thread::sleep(Duration::from_millis(10));
    }
    warn!(step, "fault released: going on");
}
