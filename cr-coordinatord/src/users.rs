//! Job requests an agent makes on behalf of one of its node's users
//! (Local.CheckpointJob, RestartJob, ConfigureJob: `cr_checkpoint --job`,
//! `cr_run --resume`, `cr_run --interval`; the Slurm plugin uses them).
//! The agent names its node (`from_node`, which its certificate must
//! name) and the user's uid (its Unix socket's SO_PEERCRED). The rules:
//!
//! * checkpoint and configure job J: every member of J runs as that uid
//!   (uid 0: any job);
//! * restart job J: nothing of J runs, every image of the checkpoint is
//!   that uid's (uid 0: any), and the asking node is a target (a job is
//!   pulled onto the node that asks; a job that ran on several nodes may
//!   be spread over other nodes named with it, e.g. a requeued Slurm
//!   job's new allocation: no more than the user reaches with cr_rsh,
//!   which starts members of a job anywhere).

use crate::catalog::JobRecord;
use crate::coordinator::Coordinator;
use crate::error::Error;
use std::time::Duration;

/// How long a request waits for the first report of a job's members (the
/// agent reports a new member on its own stream, which may reach the
/// coordinator after a request of the member's own cr_run).
pub const JOIN_WAIT: Duration = Duration::from_secs(5);

impl Coordinator {
    /// The record of `job` once `ready` holds for it, waiting up to `wait`
    /// for the agents' reports; the last record seen (None: no such job).
    pub async fn job_when(
        &self,
        job: &str,
        wait: Duration,
        ready: impl Fn(&JobRecord) -> bool,
    ) -> Option<JobRecord> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let rec = self.catalog.read(|s| s.jobs.get(job).cloned());
            if rec.as_ref().is_some_and(&ready) || tokio::time::Instant::now() >= deadline {
                return rec;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether user `uid` (asking through node `node`) may checkpoint or
    /// configure `job`: every member runs as `uid`.
    pub async fn check_user_job(&self, job: &str, node: &str, uid: u32) -> Result<(), Error> {
        let rec = self
            .job_when(job, JOIN_WAIT, |j| j.members.iter().any(|m| m.alive))
            .await
            .ok_or_else(|| Error::UnknownJob { job: job.into() })?;
        owned_by(job, node, uid, rec.members.iter().map(|m| m.uid))
    }

    /// The checkpoint of `job` (`checkpoint`, else its latest committed
    /// one) that user `uid` on `node` may restart there: every image is
    /// `uid`'s.
    pub fn check_user_checkpoint(
        &self,
        job: &str,
        checkpoint: Option<&str>,
        node: &str,
        uid: u32,
    ) -> Result<String, Error> {
        let ck = self.catalog.read(|s| {
            match checkpoint {
                Some(id) => s.checkpoint(id),
                None => s.latest_committed(job),
            }
            .map(|c| c.info().clone())
        });
        let ck = match (ck, checkpoint) {
            (Some(c), _) => c,
            (None, Some(id)) => return Err(Error::UnknownCheckpoint { id: id.into() }),
            (None, None) => return Err(Error::NoCheckpoint { job: job.into() }),
        };
        owned_by(job, node, uid, ck.images.iter().map(|i| i.uid))?;
        Ok(ck.id)
    }
}

/// Whether every uid of `owners` is `uid` (uid 0 owns everything).
fn owned_by(
    job: &str,
    node: &str,
    uid: u32,
    mut owners: impl Iterator<Item = u32>,
) -> Result<(), Error> {
    match owners.find(|&o| uid != 0 && o != uid) {
        None => Ok(()),
        Some(owner) => Err(Error::NotOwner {
            job: job.into(),
            uid,
            node: node.into(),
            owner,
        }),
    }
}
