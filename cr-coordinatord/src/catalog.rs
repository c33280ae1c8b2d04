//! The persistent catalog: nodes, jobs (settings and members), checkpoints
//! (state, images, phase times) and the per-job sequence of checkpoint ids,
//! in a redb file. Values are protobuf (the records below, which embed the
//! cluster messages).
//!
//! The whole catalog is also kept in memory; every change goes through
//! [`Catalog::update`], which writes it as ONE durable write transaction
//! and applies it to memory only once that committed. Reads are served
//! from memory.
//!
//! When opened, checkpoints left `preparing` or `dumping` by a coordinator
//! that stopped are marked `aborted`; committed ones whose FINISH was not
//! acknowledged by every node stay `finished = false` and are listed by
//! [`Catalog::unfinished`] so that FINISH is sent again.

use cr_rpc::pb;
use prost::Message;
use redb::{ReadableDatabase, ReadableTable, TableDefinition};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const NODES: TableDefinition<&str, &[u8]> = TableDefinition::new("nodes");
const JOBS: TableDefinition<&str, &[u8]> = TableDefinition::new("jobs");
const CHECKPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("checkpoints");
const SEQUENCES: TableDefinition<&str, u64> = TableDefinition::new("sequences");

/// Checkpoint states.
pub mod state {
    pub const PREPARING: &str = "preparing";
    pub const DUMPING: &str = "dumping";
    pub const COMMITTED: &str = "committed";
    pub const ABORTED: &str = "aborted";
    pub const REMOVED: &str = "removed";
}

/// Why a checkpoint found in progress at start was aborted.
pub const RESTARTED_ERROR: &str = "the coordinator restarted during the checkpoint";

/// The catalog failed.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("catalog {path}: another process holds it open (is another cr-coordinatord running?)")]
    Locked { path: PathBuf },
    #[error("catalog {path}: cannot create its directory: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("catalog {path}: {what}")]
    Db { path: PathBuf, what: String },
    /// A write of a batch of changes failed (its message, for every change
    /// of the batch).
    #[error("{0}")]
    Batch(String),
    #[error("catalog {path}: record {key:?} of table {table} is corrupt: {source}")]
    Decode {
        path: PathBuf,
        table: &'static str,
        key: String,
        source: prost::DecodeError,
    },
}

/// A node as registered.
#[derive(Clone, PartialEq, Message)]
pub struct NodeRecord {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub agent_addr: String,
    #[prost(string, repeated, tag = "3")]
    pub addresses: Vec<String>,
    #[prost(string, tag = "4")]
    pub version: String,
    /// When it last registered.
    #[prost(uint64, tag = "5")]
    pub registered_unix_ms: u64,
    /// Drained (crctl drain): no new member is placed or accepted there.
    #[prost(bool, tag = "6")]
    pub drained: bool,
}

/// A member of a job: a process tree on a node.
#[derive(Clone, PartialEq, Message)]
pub struct MemberRecord {
    #[prost(string, tag = "1")]
    pub node: String,
    #[prost(int32, tag = "2")]
    pub pid: i32,
    #[prost(uint32, tag = "3")]
    pub uid: u32,
    #[prost(string, tag = "4")]
    pub command: String,
    #[prost(uint64, tag = "5")]
    pub start_time: u64,
    #[prost(bool, tag = "6")]
    pub alive: bool,
}

impl MemberRecord {
    /// Whether `m` (reported by `node`) is this process: same node and PID,
    /// and the same start time when both know it.
    pub fn is(&self, node: &str, m: &pb::Member) -> bool {
        self.node == node
            && self.pid == m.pid
            && (self.start_time == 0 || m.start_time == 0 || self.start_time == m.start_time)
    }

    pub fn from_member(node: &str, m: &pb::Member) -> MemberRecord {
        MemberRecord {
            node: node.to_string(),
            pid: m.pid,
            uid: m.uid,
            command: m.command.clone(),
            start_time: m.start_time,
            alive: true,
        }
    }
}

/// External connection policies.
pub const EXTERNAL_ABORT: &str = "abort";
pub const EXTERNAL_ALLOW: &str = "allow";

/// A job: its settings and members.
#[derive(Clone, PartialEq, Message)]
pub struct JobRecord {
    #[prost(string, tag = "1")]
    pub name: String,
    /// Periodic checkpoints every this many seconds (0: none).
    #[prost(uint32, tag = "2")]
    pub interval_secs: u32,
    /// Keep the last this many committed checkpoints (0: all).
    #[prost(uint32, tag = "3")]
    pub keep: u32,
    /// "abort" or "allow".
    #[prost(string, tag = "4")]
    pub external: String,
    /// Dump each member against its image in the previous checkpoint.
    #[prost(bool, tag = "5")]
    pub incremental: bool,
    #[prost(message, repeated, tag = "6")]
    pub members: Vec<MemberRecord>,
    /// Restarts so far (restart session names).
    #[prost(uint64, tag = "7")]
    pub restarts: u64,
    /// Freeze bound of its checkpoints (0: the coordinator's default).
    #[prost(uint64, tag = "8")]
    pub freeze_timeout_ms: u64,
    /// The restart session in progress (empty: none); one found at open
    /// was lost with the coordinator: its agents are told to abort it.
    #[prost(string, tag = "9")]
    pub restarting: String,
    /// The migration in progress, recorded before its checkpoint: one found
    /// at open was cut short by a restart of the coordinator and is
    /// finished or rolled back ([`crate::migrate`]).
    #[prost(message, optional, tag = "10")]
    pub migration: Option<MigrationRecord>,
    /// Each committed checkpoint is kept on this many nodes (0 or 1: only
    /// the nodes that wrote it).
    #[prost(uint32, tag = "11")]
    pub replicas: u32,
    /// Its checkpoints pre-copy memory while it runs ([`crate::precopy`]).
    #[prost(bool, tag = "12")]
    pub pre_copy: bool,
    /// [`MODE_COORDINATED`] (also when empty), [`MODE_NON_BLOCKING`] or
    /// [`MODE_UNCOORDINATED`].
    #[prost(string, tag = "14")]
    pub mode: String,
    /// When its last restart began (0: never restarted): the recovery
    /// line looks only at checkpoints taken since.
    #[prost(uint64, tag = "15")]
    pub restarted_unix_ms: u64,
    /// Open regular files up to this size are saved in its images (0:
    /// none).
    #[prost(uint64, tag = "16")]
    pub save_files: u64,
}

/// Job modes (docs/PROTOCOLS.md).
pub const MODE_COORDINATED: &str = "coordinated";
pub const MODE_UNCOORDINATED: &str = "uncoordinated";
pub const MODE_NON_BLOCKING: &str = "non-blocking";
/// The scope of one member's own checkpoint (CheckpointInfo.scope).
pub const SCOPE_MEMBER: &str = "member";

impl JobRecord {
    /// Each member is checkpointed on its own schedule.
    pub fn uncoordinated(&self) -> bool {
        self.mode == MODE_UNCOORDINATED
    }

    /// Its checkpoints are coordinated but non-blocking.
    pub fn non_blocking(&self) -> bool {
        self.mode == MODE_NON_BLOCKING
    }
}

/// A migration of some members of a job.
#[derive(Clone, PartialEq, Message)]
pub struct MigrationRecord {
    /// `NODE:PID=TARGET` per member moved.
    #[prost(string, repeated, tag = "1")]
    pub moves: Vec<String>,
    /// The checkpoint the members are moved with, once committed.
    #[prost(string, tag = "2")]
    pub checkpoint: String,
    #[prost(uint64, tag = "3")]
    pub started_unix_ms: u64,
}

impl JobRecord {
    /// A job with the default settings and no member.
    pub fn new(name: &str) -> JobRecord {
        JobRecord {
            name: name.to_string(),
            external: EXTERNAL_ABORT.to_string(),
            ..JobRecord::default()
        }
    }
}

/// A checkpoint: what crctl shows, plus whether FINISH was acknowledged.
#[derive(Clone, PartialEq, Message)]
pub struct CheckpointRecord {
    #[prost(message, optional, tag = "1")]
    pub info: Option<pb::CheckpointInfo>,
    /// N of the id JOB-N.
    #[prost(uint64, tag = "2")]
    pub seq: u64,
    /// Every node acknowledged FINISH (CONTINUE / STOP / KILL).
    #[prost(bool, tag = "3")]
    pub finished: bool,
    /// The nodes that acknowledged FINISH so far.
    #[prost(string, repeated, tag = "4")]
    pub finished_nodes: Vec<String>,
}

impl CheckpointRecord {
    pub fn info(&self) -> &pb::CheckpointInfo {
        static EMPTY: std::sync::OnceLock<pb::CheckpointInfo> = std::sync::OnceLock::new();
        self.info
            .as_ref()
            .unwrap_or_else(|| EMPTY.get_or_init(pb::CheckpointInfo::default))
    }

    pub fn info_mut(&mut self) -> &mut pb::CheckpointInfo {
        self.info.get_or_insert_with(pb::CheckpointInfo::default)
    }

    pub fn id(&self) -> &str {
        &self.info().id
    }

    pub fn state(&self) -> &str {
        &self.info().state
    }

    /// The nodes of its images, in order of first appearance (see
    /// [`CheckpointRecord::sorted_nodes`] for the placement order).
    pub fn nodes(&self) -> Vec<String> {
        let mut seen = std::collections::HashSet::new();
        self.info()
            .images
            .iter()
            .filter(|i| seen.insert(i.node.as_str()))
            .map(|i| i.node.clone())
            .collect()
    }

    /// The nodes of its images in host-list order ([`node_order`]): node
    /// i goes to `--on[i]`.
    pub fn sorted_nodes(&self) -> Vec<String> {
        let mut n = self.nodes();
        n.sort_by(|a, b| node_order(a, b));
        n
    }
}

/// The order of node names in which old nodes are mapped onto new ones
/// (`--on`): Slurm's host-list order, which is the order of a job's
/// allocation (`SLURM_JOB_NODELIST`, the batch node first) for the usual
/// names: by the name without its trailing number, then by that number
/// (`n9` before `n10`, `gpu2` before `n1`), then by its width (`n01`
/// before `n1`).
pub fn node_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn split(n: &str) -> (&str, &str) {
        let cut = n.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        n.split_at(cut)
    }
    let ((pa, da), (pb, db)) = (split(a), split(b));
    let num = |d: &str| d.trim_start_matches('0').to_string();
    let (na, nb) = (num(da), num(db));
    pa.cmp(pb)
        .then(na.len().cmp(&nb.len()))
        .then(na.cmp(&nb))
        .then(db.len().cmp(&da.len()))
        .then(a.cmp(b))
}

/// One change of the catalog; a batch of them is one transaction.
#[derive(Debug, Clone)]
pub enum Change {
    Node(NodeRecord),
    Job(JobRecord),
    Checkpoint(CheckpointRecord),
    /// The last checkpoint number used for a job.
    Sequence(String, u64),
}

/// The catalog's content.
#[derive(Debug, Default)]
pub struct State {
    pub nodes: BTreeMap<String, NodeRecord>,
    /// Change them only through [`Change::Job`]: [`State::on_node`] follows.
    pub jobs: BTreeMap<String, JobRecord>,
    /// Per node, the jobs with members there and their positions in the
    /// job's `members`: a node's report touches only its own members, not
    /// every member of every job (10,000 agents heartbeating).
    by_node: HashMap<String, BTreeMap<String, Vec<usize>>>,
    /// Per job, its checkpoints by number.
    pub checkpoints: BTreeMap<String, BTreeMap<u64, CheckpointRecord>>,
    pub sequences: BTreeMap<String, u64>,
}

impl State {
    /// The checkpoint with this id (`JOB-N`).
    pub fn checkpoint(&self, id: &str) -> Option<&CheckpointRecord> {
        let (job, n) = id.rsplit_once('-')?;
        let rec = self.checkpoints.get(job)?.get(&n.parse().ok()?)?;
        (rec.id() == id).then_some(rec)
    }

    /// The checkpoints of `job`, oldest first.
    pub fn job_checkpoints(&self, job: &str) -> impl DoubleEndedIterator<Item = &CheckpointRecord> {
        self.checkpoints
            .get(job)
            .into_iter()
            .flat_map(|m| m.values())
    }

    /// The newest committed checkpoint of the whole of `job` (members'
    /// own checkpoints are restarted from through the recovery line).
    pub fn latest_committed(&self, job: &str) -> Option<&CheckpointRecord> {
        self.job_checkpoints(job)
            .rev()
            .find(|c| c.state() == state::COMMITTED && c.info().scope != SCOPE_MEMBER)
    }

    /// The last checkpoint number used for `job`.
    pub fn sequence(&self, job: &str) -> u64 {
        self.sequences.get(job).copied().unwrap_or(0)
    }

    /// The jobs with members on `node`, each with their positions in its
    /// `members`.
    pub fn on_node(&self, node: &str) -> impl Iterator<Item = (&JobRecord, &[usize])> {
        self.by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|(job, ks)| Some((self.jobs.get(job)?, ks.as_slice())))
    }

    fn apply(&mut self, change: Change) {
        match change {
            Change::Node(n) => {
                self.nodes.insert(n.name.clone(), n);
            }
            Change::Job(j) => {
                if let Some(old) = self.jobs.get(&j.name) {
                    for m in &old.members {
                        if let Some(jobs) = self.by_node.get_mut(&m.node) {
                            jobs.remove(&j.name);
                            if jobs.is_empty() {
                                self.by_node.remove(&m.node);
                            }
                        }
                    }
                }
                for (k, m) in j.members.iter().enumerate() {
                    self.by_node
                        .entry(m.node.clone())
                        .or_default()
                        .entry(j.name.clone())
                        .or_default()
                        .push(k);
                }
                self.jobs.insert(j.name.clone(), j);
            }
            Change::Checkpoint(c) => {
                let job = c.info().job.clone();
                self.checkpoints.entry(job).or_default().insert(c.seq, c);
            }
            Change::Sequence(job, n) => {
                self.sequences.insert(job, n);
            }
        }
    }
}

/// The catalog: a redb file and its content in memory.
pub struct Catalog {
    db: redb::Database,
    path: PathBuf,
    state: Mutex<State>,
    aborted_at_open: Vec<String>,
}

impl std::fmt::Debug for Catalog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Catalog").field("path", &self.path).finish()
    }
}

fn decode<M: Message + Default>(
    path: &Path,
    table: &'static str,
    key: &str,
    bytes: &[u8],
) -> Result<M, CatalogError> {
    M::decode(bytes).map_err(|source| CatalogError::Decode {
        path: path.to_path_buf(),
        table,
        key: key.to_string(),
        source,
    })
}

impl Catalog {
    /// Open (or create) the catalog at `path`.
    pub fn open(path: &Path) -> Result<Catalog, CatalogError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| CatalogError::Dir {
                path: path.to_path_buf(),
                source,
            })?;
        }
        let db = redb::Database::create(path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => CatalogError::Locked {
                path: path.to_path_buf(),
            },
            e => CatalogError::Db {
                path: path.to_path_buf(),
                what: e.to_string(),
            },
        })?;
        let mut cat = Catalog {
            db,
            path: path.to_path_buf(),
            state: Mutex::new(State::default()),
            aborted_at_open: Vec::new(),
        };
        // Make every table exist, so that reads never miss one.
        cat.write(&[])?;
        let state = cat.load()?;
        let stale: Vec<Change> = state
            .checkpoints
            .values()
            .flat_map(|m| m.values())
            .filter(|c| matches!(c.state(), state::PREPARING | state::DUMPING))
            .map(|c| {
                let mut c = c.clone();
                let info = c.info_mut();
                info.state = state::ABORTED.to_string();
                info.error = RESTARTED_ERROR.to_string();
                Change::Checkpoint(c)
            })
            .collect();
        let mut stale = stale;
        let lost_restarts: Vec<String> = state
            .jobs
            .values()
            .filter(|j| !j.restarting.is_empty())
            .map(|j| j.restarting.clone())
            .collect();
        stale.extend(
            state
                .jobs
                .values()
                .filter(|j| !j.restarting.is_empty())
                .map(|j| {
                    let mut j = j.clone();
                    j.restarting.clear();
                    Change::Job(j)
                }),
        );
        *cat.state.get_mut().unwrap_or_else(|p| p.into_inner()) = state;
        cat.aborted_at_open.extend(lost_restarts);
        if !stale.is_empty() {
            cat.aborted_at_open
                .extend(stale.iter().filter_map(|c| match c {
                    Change::Checkpoint(c) => Some(c.id().to_string()),
                    _ => None,
                }));
            cat.update(|_| Ok::<_, CatalogError>((stale, ())))?;
        }
        Ok(cat)
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checkpoints that were in progress when the catalog was opened
    /// (now aborted).
    pub fn aborted_at_open(&self) -> &[String] {
        &self.aborted_at_open
    }

    fn db_err(&self, e: impl Into<redb::Error>) -> CatalogError {
        CatalogError::Db {
            path: self.path.clone(),
            what: e.into().to_string(),
        }
    }

    fn load(&self) -> Result<State, CatalogError> {
        let mut s = State::default();
        let tx = self.db.begin_read().map_err(|e| self.db_err(e))?;
        let t = tx.open_table(NODES).map_err(|e| self.db_err(e))?;
        for row in t.iter().map_err(|e| self.db_err(e))? {
            let (k, v) = row.map_err(|e| self.db_err(e))?;
            let n: NodeRecord = decode(&self.path, "nodes", k.value(), v.value())?;
            s.nodes.insert(k.value().to_string(), n);
        }
        let t = tx.open_table(JOBS).map_err(|e| self.db_err(e))?;
        for row in t.iter().map_err(|e| self.db_err(e))? {
            let (k, v) = row.map_err(|e| self.db_err(e))?;
            let j: JobRecord = decode(&self.path, "jobs", k.value(), v.value())?;
            s.apply(Change::Job(j));
        }
        let t = tx.open_table(CHECKPOINTS).map_err(|e| self.db_err(e))?;
        for row in t.iter().map_err(|e| self.db_err(e))? {
            let (k, v) = row.map_err(|e| self.db_err(e))?;
            let c: CheckpointRecord = decode(&self.path, "checkpoints", k.value(), v.value())?;
            s.apply(Change::Checkpoint(c));
        }
        let t = tx.open_table(SEQUENCES).map_err(|e| self.db_err(e))?;
        for row in t.iter().map_err(|e| self.db_err(e))? {
            let (k, v) = row.map_err(|e| self.db_err(e))?;
            s.sequences.insert(k.value().to_string(), v.value());
        }
        Ok(s)
    }

    /// One durable write transaction with `changes`.
    fn write(&self, changes: &[Change]) -> Result<(), CatalogError> {
        let tx = self.db.begin_write().map_err(|e| self.db_err(e))?;
        {
            let mut nodes = tx.open_table(NODES).map_err(|e| self.db_err(e))?;
            let mut jobs = tx.open_table(JOBS).map_err(|e| self.db_err(e))?;
            let mut cks = tx.open_table(CHECKPOINTS).map_err(|e| self.db_err(e))?;
            let mut seqs = tx.open_table(SEQUENCES).map_err(|e| self.db_err(e))?;
            for c in changes {
                match c {
                    Change::Node(n) => nodes
                        .insert(n.name.as_str(), n.encode_to_vec().as_slice())
                        .map(drop),
                    Change::Job(j) => jobs
                        .insert(j.name.as_str(), j.encode_to_vec().as_slice())
                        .map(drop),
                    Change::Checkpoint(k) => {
                        cks.insert(k.id(), k.encode_to_vec().as_slice()).map(drop)
                    }
                    Change::Sequence(job, n) => seqs.insert(job.as_str(), n).map(drop),
                }
                .map_err(|e| self.db_err(e))?;
            }
        }
        tx.commit().map_err(|e| self.db_err(e))
    }

    /// Read-modify-write: `f` looks at the current state and returns the
    /// changes to make (and a result). The changes are written as one
    /// durable transaction, then applied in memory. No other update runs
    /// meanwhile. No transaction when there is nothing to change.
    pub fn update<T, E: From<CatalogError>>(
        &self,
        f: impl FnOnce(&State) -> Result<(Vec<Change>, T), E>,
    ) -> Result<T, E> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (changes, out) = f(&st)?;
        if !changes.is_empty() {
            self.write(&changes)?;
            for c in changes {
                st.apply(c);
            }
        }
        Ok(out)
    }

    /// Look at the state (under the catalog's lock: keep it short).
    pub fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.state.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Committed checkpoints whose FINISH some node has not acknowledged.
    pub fn unfinished(&self) -> Vec<CheckpointRecord> {
        self.read(|s| {
            s.checkpoints
                .values()
                .flat_map(|m| m.values())
                .filter(|c| !c.finished && c.state() == state::COMMITTED)
                .cloned()
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::node_order;

    #[test]
    fn node_names_in_host_list_order() {
        let mut n = vec!["n10", "n9", "gpu2", "n1", "n01", "gpu10", "login"];
        n.sort_by(|a, b| node_order(a, b));
        assert_eq!(n, ["gpu2", "gpu10", "login", "n01", "n1", "n9", "n10"]);
    }
}
