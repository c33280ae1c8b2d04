//! Restart callbacks behind a job-wide barrier. A coordinated restart
//! (RESTORE with `job_barrier`) releases this node's members without
//! telling their libcr that they were restarted; the coordinator sends
//! JOBBACK once every node released its own, and only then do the
//! restored programs run the restart half of their callbacks
//! (`cr_checkpoint` returns > 0): a callback may then talk to any member
//! of the job, on any node, and get its answer. If JOBBACK never comes
//! (the coordinator died), the members are told after the restore's
//! timeout anyway, so that no callback waits forever.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{debug, info, warn};

/// Released trees waiting for JOBBACK, by restore session: (root PID,
/// image directory).
#[derive(Default)]
pub struct JobBack {
    waiting: Mutex<HashMap<String, Vec<(i32, PathBuf)>>>,
}

impl JobBack {
    /// The trees of `session` were released; tell them at JOBBACK, or on
    /// their own after `limit`.
    pub fn hold(self: &Arc<Self>, session: &str, trees: Vec<(i32, PathBuf)>, limit: Duration) {
        if trees.is_empty() {
            return;
        }
        info!(
            session,
            trees = trees.len(),
            "released trees wait for JOBBACK before their restart callbacks"
        );
        self.lock().insert(session.to_string(), trees);
        let (me, session) = (self.clone(), session.to_string());
        let spawned = std::thread::Builder::new()
            .name("jobback".into())
            .spawn(move || {
                std::thread::sleep(limit);
                if me.lock().contains_key(&session) {
                    warn!(
                        session,
                        "no JOBBACK from the coordinator: the restored members run their restart callbacks without it"
                    );
                    me.tell(&session);
                }
            });
        if let Err(e) = spawned {
            warn!("cannot start the JOBBACK timer ({e}): restart callbacks run at JOBBACK only");
        }
    }

    /// JOBBACK: every member of the job runs again. How many trees were
    /// told (0: unknown session, or already told).
    pub fn tell(&self, session: &str) -> usize {
        let Some(trees) = self.lock().remove(session) else {
            debug!(session, "JOBBACK of a session with no trees waiting");
            return 0;
        };
        for (pid, dir) in &trees {
            cr_engine::coop::restarted(*pid, dir);
        }
        info!(
            session,
            trees = trees.len(),
            "the job is back: restart callbacks run"
        );
        trees.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<(i32, PathBuf)>>> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }
}
