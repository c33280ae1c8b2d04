//! Tests of the protocol, the registry and the catalog against in-process
//! fake agents.

use crate::agents::{AgentApi, AgentResult};
use crate::catalog::{self, Catalog, Change, CheckpointRecord, JobRecord};
use crate::coordinator::{Coordinator, Settings};
use crate::error::Error;
use crate::migrate::Placement;
use crate::protocol::{CheckpointOpts, RestartOpts};
use cr_rpc::pb;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Agents that do nothing but remember what they were asked.
#[derive(Default)]
struct Fake {
    /// (node, method, session or first dir).
    calls: Mutex<Vec<(String, &'static str, String)>>,
    fail: Mutex<HashMap<(String, &'static str), String>>,
    hang: Mutex<HashSet<(String, &'static str)>>,
    /// Bookmarks returned by each node's PREPARE and DUMP.
    bookmarks: Mutex<HashMap<String, Vec<pb::Bookmark>>>,
    /// session → node → PrepareRequest.
    prepared: Mutex<HashMap<String, HashMap<String, pb::PrepareRequest>>>,
    restored: Mutex<HashMap<String, HashMap<String, pb::RestoreRequest>>>,
    removed: Mutex<Vec<(String, Vec<String>)>>,
    unlocked: Mutex<Vec<(String, Vec<String>)>>,
}

impl Fake {
    /// The bookmarks `node`'s PREPARE and DUMP return.
    fn node_bookmarks(&self, node: &str) -> Vec<pb::Bookmark> {
        self.bookmarks
            .lock()
            .unwrap()
            .get(node)
            .cloned()
            .unwrap_or_default()
    }

    /// What PREPARE (or FREEZE after callbacks_first) of `session` returns
    /// on `node`: every target frozen, the node's bookmarks.
    fn frozen_reply(&self, node: &str, session: &str) -> pb::PrepareReply {
        let bookmarks = self.node_bookmarks(node);
        let n = self.prepared.lock().unwrap()[session][node].targets.len() as u32;
        pb::PrepareReply {
            bookmarks,
            processes: n,
            threads: n,
            freeze_ms: 1,
            ..Default::default()
        }
    }

    async fn enter(&self, node: &str, method: &'static str, what: &str) -> AgentResult<()> {
        self.calls
            .lock()
            .unwrap()
            .push((node.into(), method, what.into()));
        if self
            .hang
            .lock()
            .unwrap()
            .contains(&(node.to_string(), method))
        {
            std::future::pending::<()>().await;
        }
        match self.fail.lock().unwrap().get(&(node.to_string(), method)) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn nodes_called(&self, method: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.1 == method)
            .map(|c| c.0.clone())
            .collect();
        v.sort();
        v
    }

    fn set_fail(&self, node: &str, method: &'static str, e: &str) {
        self.fail
            .lock()
            .unwrap()
            .insert((node.into(), method), e.into());
    }
}

#[crate::async_trait]
impl AgentApi for Fake {
    async fn prepare(&self, node: &str, req: pb::PrepareRequest) -> AgentResult<pb::PrepareReply> {
        self.enter(node, "prepare", &req.session).await?;
        let callbacks_only = req.callbacks_first;
        let session = req.session.clone();
        self.prepared
            .lock()
            .unwrap()
            .entry(session.clone())
            .or_default()
            .insert(node.into(), req);
        if callbacks_only {
            return Ok(pb::PrepareReply::default());
        }
        Ok(self.frozen_reply(node, &session))
    }
    async fn freeze(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::PrepareReply> {
        self.enter(node, "freeze", &req.session).await?;
        Ok(self.frozen_reply(node, &req.session))
    }
    async fn dump(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::DumpReply> {
        self.enter(node, "dump", &req.session).await?;
        let p = self.prepared.lock().unwrap()[&req.session][node].clone();
        let marks = self.node_bookmarks(node);
        Ok(pb::DumpReply {
            images: p
                .targets
                .iter()
                .map(|t| pb::ImageInfo {
                    node: node.into(),
                    pid: t.pid,
                    dir: format!("/img/{}/{node}-{}", p.subdir, t.pid),
                    processes: 2,
                    page_bytes: 4096,
                    store_bytes: 1000,
                    frozen_ms: 10 + t.pid as u64 % 7,
                    bookmarks: marks.iter().filter(|b| b.pid == t.pid).cloned().collect(),
                    command: "work".into(),
                    uid: 1000,
                    replicas: Vec::new(),
                })
                .collect(),
            gone: vec![],
        })
    }
    async fn abort(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::Empty> {
        self.enter(node, "abort", &req.session).await?;
        Ok(pb::Empty {})
    }
    async fn finish(&self, node: &str, req: pb::FinishRequest) -> AgentResult<pb::FinishReply> {
        self.enter(node, "finish", &req.session).await?;
        Ok(pb::FinishReply::default())
    }
    async fn restore(&self, node: &str, req: pb::RestoreRequest) -> AgentResult<pb::RestoreReply> {
        self.enter(node, "restore", &req.session).await?;
        let pids = (0..req.targets.len() as i32).map(|i| 7000 + i).collect();
        self.restored
            .lock()
            .unwrap()
            .entry(req.session.clone())
            .or_default()
            .insert(node.into(), req);
        Ok(pb::RestoreReply { pids })
    }
    async fn release(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::ReleaseReply> {
        self.enter(node, "release", &req.session).await?;
        let r = self.restored.lock().unwrap()[&req.session][node].clone();
        Ok(pb::ReleaseReply {
            members: (0..r.targets.len() as i32)
                .map(|i| pb::Member {
                    job: r.job.clone(),
                    pid: 7000 + i,
                    uid: 1000,
                    command: "work".into(),
                    start_time: 99,
                    ..Default::default()
                })
                .collect(),
            generation: 100,
        })
    }
    async fn job_back(&self, node: &str, req: pb::SessionRequest) -> AgentResult<pb::Empty> {
        self.enter(node, "job_back", &req.session).await?;
        Ok(pb::Empty {})
    }
    async fn remove(&self, node: &str, req: pb::RemoveRequest) -> AgentResult<pb::Empty> {
        self.enter(node, "remove", &req.dirs.join(",")).await?;
        self.removed.lock().unwrap().push((node.into(), req.dirs));
        Ok(pb::Empty {})
    }
    async fn unlock(&self, node: &str, req: pb::RemoveRequest) -> AgentResult<pb::Empty> {
        self.enter(node, "unlock", &req.dirs.join(",")).await?;
        self.unlocked.lock().unwrap().push((node.into(), req.dirs));
        Ok(pb::Empty {})
    }
}

struct Env {
    _dir: tempfile::TempDir,
    coord: Arc<Coordinator>,
    fake: Arc<Fake>,
}

fn member(job: &str, pid: i32) -> pb::Member {
    pb::Member {
        job: job.into(),
        pid,
        uid: 1000,
        command: "work".into(),
        start_time: pid as u64 * 10,
        ..Default::default()
    }
}

fn bm(local: &str, remote: &str, pid: i32, seq: u32) -> pb::Bookmark {
    pb::Bookmark {
        local: local.into(),
        remote: remote.into(),
        snd_una: seq,
        snd_nxt: seq,
        rcv_nxt: seq,
        write_seq: seq,
        pid,
    }
}

impl Env {
    /// Nodes n1..=n`nodes` (address 10.0.0.i), job J with member pid 100+i on each.
    async fn new(nodes: usize) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let cat = Arc::new(Catalog::open(&dir.path().join("cat.redb")).unwrap());
        let fake = Arc::new(Fake::default());
        let settings = Settings {
            heartbeat_ms: 100,
            node_timeout: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
            freeze_timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let coord = Arc::new(Coordinator::new(cat, fake.clone(), settings));
        let env = Env {
            _dir: dir,
            coord,
            fake,
        };
        for i in 1..=nodes {
            env.register(i, vec![member("J", 100 + i as i32)]).await;
        }
        env
    }

    async fn register(&self, i: usize, members: Vec<pb::Member>) {
        self.coord
            .register(pb::RegisterRequest {
                node: format!("n{i}"),
                agent_addr: format!("10.0.0.{i}:7171"),
                addresses: vec![format!("10.0.0.{i}")],
                version: "test".into(),
                members,
                generation: 1,
                ..Default::default()
            })
            .await
            .unwrap();
    }

    /// Heartbeats of n1, n2, ... with (free MiB, RSS MiB of its member)
    /// each ([`report`]).
    async fn report(&self, nodes: &[(u64, u64)]) {
        for (i, &(free, rss)) in nodes.iter().enumerate() {
            self.coord
                .heartbeat(report(i + 1, free, rss))
                .await
                .unwrap();
        }
    }

    /// A consistent connection between the members of n1 and n2.
    fn connect_n1_n2(&self) {
        let mut b = self.fake.bookmarks.lock().unwrap();
        b.insert(
            "n1".into(),
            vec![bm("10.0.0.1:40000", "10.0.0.2:5000", 101, 1000)],
        );
        b.insert(
            "n2".into(),
            vec![bm("10.0.0.2:5000", "10.0.0.1:40000", 102, 1000)],
        );
    }

    async fn ck(&self) -> Result<pb::CheckpointInfo, Error> {
        self.coord.checkpoint("J", pb::After::Continue, None).await
    }

    fn stored(&self, id: &str) -> CheckpointRecord {
        self.coord
            .catalog()
            .read(|s| s.checkpoint(id).cloned())
            .unwrap()
    }
}

#[tokio::test]
async fn checkpoint_commits_and_ids_increment() {
    let env = Env::new(2).await;
    env.connect_n1_n2();
    let c = env.ck().await.unwrap();
    assert_eq!(c.id, "J-1");
    assert_eq!(c.state, "committed");
    assert_eq!(c.images.len(), 2);
    assert_eq!(c.connections, 1);
    assert_eq!(c.external, 0);
    assert_eq!(c.pause_ms, 14); // max(10 + 101 % 7, 10 + 102 % 7)
    assert_eq!(c.images[0].dir, "/img/J/J-1/n1-101");
    let rec = env.stored("J-1");
    assert!(rec.finished);
    assert_eq!(rec.state(), "committed");
    for m in ["prepare", "dump", "finish"] {
        assert_eq!(env.fake.nodes_called(m), ["n1", "n2"], "{m}");
    }
    assert!(env.fake.nodes_called("abort").is_empty());
    let p = env.fake.prepared.lock().unwrap()["J-1"]["n1"].clone();
    assert_eq!(p.subdir, "J/J-1");
    assert_eq!(p.targets[0].pid, 101);
    assert!(p.timeout_ms > 10_000);

    let c2 = env.ck().await.unwrap();
    assert_eq!(c2.id, "J-2");
    let list = env.coord.checkpoints("J", false).unwrap().checkpoints;
    assert_eq!(
        list.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
        ["J-1", "J-2"]
    );
    let j = env.coord.job("J").unwrap();
    assert_eq!(j.state, "running");
    assert_eq!(j.last_checkpoint, "J-2");
    assert_eq!(j.checkpoints, 2);
}

#[tokio::test]
async fn failing_prepare_aborts_every_agent() {
    let env = Env::new(3).await;
    env.fake.set_fail("n2", "prepare", "cannot freeze pid 102");
    let e = env.ck().await.unwrap_err();
    assert!(matches!(e, Error::Aborted { .. }), "{e}");
    assert!(e.to_string().contains("node n2"), "{e}");
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2", "n3"]);
    assert!(env.fake.nodes_called("dump").is_empty());
    let rec = env.stored("J-1");
    assert_eq!(rec.state(), "aborted");
    assert!(
        rec.info().error.starts_with("node n2: "),
        "{}",
        rec.info().error
    );
    assert!(rec.info().error.contains("cannot freeze pid 102"));
    // Not committed: not listed, and the next one gets the next id.
    assert!(env
        .coord
        .checkpoints("J", false)
        .unwrap()
        .checkpoints
        .is_empty());
    assert_eq!(
        env.coord.checkpoints("J", true).unwrap().checkpoints.len(),
        1
    );
    env.fake.fail.lock().unwrap().clear();
    assert_eq!(env.ck().await.unwrap().id, "J-2");
}

#[tokio::test]
async fn failing_dump_aborts() {
    let env = Env::new(2).await;
    env.fake.set_fail("n1", "dump", "disk full");
    let e = env.ck().await.unwrap_err();
    assert!(e.to_string().contains("node n1: DUMP: disk full"), "{e}");
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2"]);
    assert_eq!(env.stored("J-1").state(), "aborted");
}

#[tokio::test]
async fn inconsistent_cut_aborts() {
    let env = Env::new(2).await;
    {
        let mut b = env.fake.bookmarks.lock().unwrap();
        // n2 received up to 1200, n1 wrote only up to 1000.
        b.insert(
            "n1".into(),
            vec![bm("10.0.0.1:40000", "10.0.0.2:5000", 101, 1000)],
        );
        b.insert(
            "n2".into(),
            vec![bm("10.0.0.2:5000", "10.0.0.1:40000", 102, 1200)],
        );
    }
    let e = env.ck().await.unwrap_err();
    assert!(e.to_string().contains("inconsistent cut"), "{e}");
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2"]);
    assert!(env.fake.nodes_called("dump").is_empty());
    assert_eq!(env.stored("J-1").state(), "aborted");
}

#[tokio::test]
async fn external_connection_aborts_unless_allowed() {
    let env = Env::new(2).await;
    env.connect_n1_n2();
    env.fake
        .bookmarks
        .lock()
        .unwrap()
        .get_mut("n2")
        .unwrap()
        .push(bm("10.0.0.2:41000", "192.0.2.9:80", 102, 5));
    let e = env.ck().await.unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(
            "connection 10.0.0.2:41000 -> 192.0.2.9:80 of pid 102 on node n2 leads outside the job"
        ),
        "{msg}"
    );
    assert!(msg.contains("crctl job J --external allow"), "{msg}");
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2"]);

    let bad = env.coord.configure(&pb::ConfigureRequest {
        job: "J".into(),
        external: Some("maybe".into()),
        ..Default::default()
    });
    assert!(bad.is_err());
    env.coord
        .configure(&pb::ConfigureRequest {
            job: "J".into(),
            external: Some("allow".into()),
            ..Default::default()
        })
        .unwrap();
    let c = env.ck().await.unwrap();
    assert_eq!(c.state, "committed");
    assert_eq!((c.connections, c.external), (1, 1));
}

#[tokio::test]
async fn loopback_addresses_count_per_node() {
    let env = Env::new(2).await;
    // The same loopback pair on both nodes: each matches on its own node.
    for (n, pid) in [("n1", 101), ("n2", 102)] {
        env.fake.bookmarks.lock().unwrap().insert(
            n.into(),
            vec![
                bm("127.0.0.1:5000", "127.0.0.1:40000", pid, 7),
                bm("127.0.0.1:40000", "127.0.0.1:5000", pid, 7),
            ],
        );
    }
    let c = env.ck().await.unwrap();
    assert_eq!((c.connections, c.external), (2, 0));
    // One loopback end without its peer on that node leads outside.
    env.fake
        .bookmarks
        .lock()
        .unwrap()
        .insert("n2".into(), vec![bm("[::1]:5000", "[::1]:40000", 102, 7)]);
    let e = env.ck().await.unwrap_err();
    assert!(e.to_string().contains("[::1]:5000 -> [::1]:40000"), "{e}");
    assert_eq!(
        crate::protocol::scoped_addr("n", "[::ffff:127.0.0.1]:1"),
        "n/[::ffff:127.0.0.1]:1"
    );
    assert_eq!(
        crate::protocol::scoped_addr("n", "10.1.1.1:1"),
        "10.1.1.1:1"
    );
}

#[tokio::test]
async fn timeout_aborts() {
    let env = Env::new(2).await;
    env.fake
        .hang
        .lock()
        .unwrap()
        .insert(("n2".into(), "prepare"));
    let t = std::time::Instant::now();
    let e = env
        .coord
        .checkpoint("J", pb::After::Continue, Some(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert!(
        e.to_string().contains("node n2: no reply to PREPARE"),
        "{e}"
    );
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2"]);
    assert_eq!(env.stored("J-1").state(), "aborted");
}

#[tokio::test]
async fn one_operation_at_a_time() {
    let env = Env::new(2).await;
    env.fake
        .hang
        .lock()
        .unwrap()
        .insert(("n1".into(), "prepare"));
    let c = env.coord.clone();
    let first = tokio::spawn(async move {
        c.checkpoint("J", pb::After::Continue, Some(Duration::from_millis(500)))
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let e = env.ck().await.unwrap_err();
    assert_eq!(e.to_string(), "job J is busy: checkpoint J-1 in progress");
    assert_eq!(env.coord.job("J").unwrap().state, "checkpointing");
    assert!(env.coord.status().active[0].contains("checkpoint J-1 of J: preparing"));
    assert!(first.await.unwrap().is_err());
    env.fake.hang.lock().unwrap().clear();
    assert_eq!(env.ck().await.unwrap().id, "J-2");
}

#[tokio::test]
async fn refusals() {
    let env = Env::new(2).await;
    let e = env
        .coord
        .checkpoint("nope", pb::After::Continue, None)
        .await
        .unwrap_err();
    assert_eq!(e.to_string(), "no job nope");
    // n2 reports no member any more: J has one live member left, on n1.
    env.coord
        .heartbeat(pb::HeartbeatRequest {
            node: "n2".into(),
            members: vec![],
            generation: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    let j = env.coord.job("J").unwrap();
    assert_eq!(j.state, "partial");
    let c = env.ck().await.unwrap();
    assert_eq!(c.images.len(), 1);
    env.coord
        .heartbeat(pb::HeartbeatRequest {
            node: "n1".into(),
            members: vec![],
            generation: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    let e = env.ck().await.unwrap_err();
    assert_eq!(e.to_string(), "job J has no live member");
}

#[tokio::test]
async fn retention_removes_the_oldest_beyond_keep() {
    let env = Env::new(2).await;
    env.coord
        .configure(&pb::ConfigureRequest {
            job: "J".into(),
            keep: Some(2),
            ..Default::default()
        })
        .unwrap();
    for _ in 0..4 {
        env.ck().await.unwrap();
    }
    let all = env.coord.checkpoints("J", true).unwrap().checkpoints;
    let states: Vec<(&str, &str)> = all
        .iter()
        .map(|c| (c.id.as_str(), c.state.as_str()))
        .collect();
    assert_eq!(
        states,
        [
            ("J-1", "removed"),
            ("J-2", "removed"),
            ("J-3", "committed"),
            ("J-4", "committed")
        ]
    );
    let mut removed = env.fake.removed.lock().unwrap().clone();
    removed.sort();
    assert_eq!(
        removed,
        [
            ("n1".to_string(), vec!["/img/J/J-1/n1-101".to_string()]),
            ("n1".to_string(), vec!["/img/J/J-2/n1-101".to_string()]),
            ("n2".to_string(), vec!["/img/J/J-1/n2-102".to_string()]),
            ("n2".to_string(), vec!["/img/J/J-2/n2-102".to_string()]),
        ]
    );
    assert_eq!(env.coord.job("J").unwrap().checkpoints, 2);
}

#[tokio::test]
async fn incremental_dumps_name_their_parent() {
    let env = Env::new(2).await;
    env.coord.set_incremental("J", true).unwrap();
    env.ck().await.unwrap();
    env.ck().await.unwrap();
    let p = env.fake.prepared.lock().unwrap();
    assert_eq!(p["J-1"]["n1"].targets[0].parent, "");
    assert_eq!(p["J-2"]["n1"].targets[0].parent, "/img/J/J-1/n1-101");
    assert_eq!(p["J-2"]["n2"].targets[0].parent, "/img/J/J-1/n2-102");
}

#[tokio::test]
async fn restart_refused_while_members_alive() {
    let env = Env::new(2).await;
    env.ck().await.unwrap();
    let e = env.coord.restart("J", None, &[], None).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "job J still runs 2 processes; checkpoint it with --kill or stop them first"
    );
    assert!(env.fake.nodes_called("restore").is_empty());
}

#[tokio::test]
async fn restart_with_placement_and_address_map() {
    let env = Env::new(3).await;
    // Only n1 and n2 host J; n3 is spare.
    env.coord
        .heartbeat(pb::HeartbeatRequest {
            node: "n3".into(),
            members: vec![],
            generation: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    env.connect_n1_n2();
    let c = env
        .coord
        .checkpoint("J", pb::After::Kill, None)
        .await
        .unwrap();
    assert_eq!(c.after, pb::After::Kill as i32);
    assert!(env.coord.job("J").unwrap().procs.iter().all(|p| !p.alive));
    assert_eq!(env.coord.job("J").unwrap().state, "stopped");

    // Not committed, unknown ids and nodes are refused.
    let e = env
        .coord
        .restart("J", Some("J-9"), &[], None)
        .await
        .unwrap_err();
    assert_eq!(e.to_string(), "no checkpoint J-9");
    let e = env
        .coord
        .restart("J", None, &["n7".into()], None)
        .await
        .unwrap_err();
    assert!(e.to_string().starts_with("no node n7"), "{e}");

    let r = env
        .coord
        .restart("J", None, &["n3".into()], None)
        .await
        .unwrap();
    assert_eq!(r.checkpoint, "J-1");
    assert_eq!(r.map_addr, ["10.0.0.1=10.0.0.3", "10.0.0.2=10.0.0.3"]);
    assert_eq!(env.fake.nodes_called("restore"), ["n3"]);
    assert_eq!(env.fake.nodes_called("release"), ["n3"]);
    let req = env.fake.restored.lock().unwrap()["J-restart-1"]["n3"].clone();
    assert_eq!(
        req.targets
            .iter()
            .map(|t| (t.dir.as_str(), t.old_pid))
            .collect::<Vec<_>>(),
        [("/img/J/J-1/n1-101", 101), ("/img/J/J-1/n2-102", 102)]
    );
    assert_eq!(req.map_addr, r.map_addr);
    let mut unlocked = env.fake.unlocked.lock().unwrap().clone();
    unlocked.sort();
    assert_eq!(
        unlocked,
        [
            ("n1".to_string(), vec!["/img/J/J-1/n1-101".to_string()]),
            ("n2".to_string(), vec!["/img/J/J-1/n2-102".to_string()]),
        ]
    );
    let j = env.coord.job("J").unwrap();
    assert_eq!(j.state, "running");
    assert_eq!(
        j.procs
            .iter()
            .map(|p| (p.node.as_str(), p.pid))
            .collect::<Vec<_>>(),
        [("n3", 7000), ("n3", 7001)]
    );
    // An older heartbeat of n3 (generation < the release's) is ignored...
    env.coord
        .heartbeat(pb::HeartbeatRequest {
            node: "n3".into(),
            members: vec![],
            generation: 50,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(env.coord.job("J").unwrap().state, "running");
    // ...a newer one is not.
    env.coord
        .heartbeat(pb::HeartbeatRequest {
            node: "n3".into(),
            members: vec![],
            generation: 101,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(env.coord.job("J").unwrap().state, "stopped");

    // Two nodes onto n2 and n1 (swapped): every address moves; the
    // operator's --allow-changed-files reaches every agent.
    let opts = RestartOpts {
        allow_changed_files: true,
        ..Default::default()
    };
    let r = env
        .coord
        .restart_placed(
            "J",
            Some("J-1"),
            &Placement::Nodes(vec!["n2".into(), "n1".into()]),
            &opts,
        )
        .await
        .unwrap();
    assert_eq!(r.map_addr, ["10.0.0.1=10.0.0.2", "10.0.0.2=10.0.0.1"]);
    assert_eq!(r.procs.len(), 2);
    let restored = env.fake.restored.lock().unwrap();
    assert!(!restored["J-restart-1"]["n3"].allow_changed_files);
    assert!(["n1", "n2"]
        .iter()
        .all(|n| restored["J-restart-2"][*n].allow_changed_files));
}

#[tokio::test]
async fn failing_restore_aborts_all() {
    let env = Env::new(2).await;
    env.coord
        .checkpoint("J", pb::After::Kill, None)
        .await
        .unwrap();
    env.fake.set_fail("n2", "restore", "no such image");
    let e = env.coord.restart("J", None, &[], None).await.unwrap_err();
    assert!(
        e.to_string().contains("node n2: RESTORE: no such image"),
        "{e}"
    );
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2"]);
    assert!(env.fake.nodes_called("release").is_empty());
}

#[tokio::test]
async fn registry_membership() {
    let env = Env::new(1).await;
    let hb = |node: &str, members, generation| {
        env.coord.heartbeat(pb::HeartbeatRequest {
            node: node.into(),
            members,
            generation,
            ..Default::default()
        })
    };
    assert!(hb("stranger", vec![], 1).await.unwrap().register_again);
    assert!(
        !hb("n1", vec![member("J", 101), member("K", 500)], 2)
            .await
            .unwrap()
            .register_again
    );
    let jobs = env.coord.jobs().jobs;
    assert_eq!(
        jobs.iter().map(|j| j.name.as_str()).collect::<Vec<_>>(),
        ["J", "K"]
    );
    assert_eq!(jobs[1].external, "abort");
    assert_eq!(jobs[1].interval_secs, 0);
    // Stale report ignored.
    hb("n1", vec![], 1).await.unwrap();
    assert_eq!(env.coord.job("K").unwrap().state, "running");
    hb("n1", vec![member("J", 101)], 3).await.unwrap();
    assert_eq!(env.coord.job("K").unwrap().state, "stopped");
    // A new member of a stopped job starts it afresh.
    hb("n1", vec![member("J", 101), member("K", 600)], 4)
        .await
        .unwrap();
    let k = env.coord.job("K").unwrap();
    assert_eq!(k.procs.len(), 1);
    assert_eq!(k.procs[0].pid, 600);
    assert_eq!(env.coord.nodes().nodes[0].members, 2);
    assert_eq!(env.coord.status().nodes_up, 1);
}

#[tokio::test]
async fn failed_finish_is_reported_and_never_sent_again() {
    let env = Env::new(2).await;
    env.fake
        .set_fail("n2", "finish", "unavailable: connection refused");
    let c = env.ck().await.unwrap();
    let rec = env.stored(&c.id);
    assert_eq!(c.state, "committed");
    // The agent of n2 lets its members run on: said, and final.
    assert_eq!(c.unfinished, ["n2"]);
    assert!(
        c.notes.iter().any(|n| n.starts_with("n2 could not finish")),
        "{:?}",
        c.notes
    );
    assert!(rec.finished, "nothing is left to send");
    assert_eq!(rec.finished_nodes, ["n1"]);
    env.fake.fail.lock().unwrap().clear();
    env.register(2, vec![member("J", 102)]).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(env.fake.nodes_called("finish"), ["n1", "n2"]);
}

#[tokio::test]
async fn past_the_freeze_bound_every_node_thaws() {
    let env = Env::new(3).await;
    env.fake.hang.lock().unwrap().insert(("n2".into(), "dump"));
    let t0 = std::time::Instant::now();
    let e = env
        .coord
        .checkpoint_with(
            "J",
            pb::After::Kill,
            None,
            Some(Duration::from_millis(300)),
            false,
        )
        .await
        .unwrap_err();
    let took = t0.elapsed();
    assert!(e.to_string().contains("freeze bound"), "{e}");
    assert!(took < Duration::from_secs(3), "aborted after {took:?}");
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2", "n3"]);
    // The bound was told to every agent.
    let p = env.fake.prepared.lock().unwrap();
    let reqs = p.values().next().unwrap();
    assert!(reqs.values().all(|r| r.freeze_timeout_ms == 300));
}

#[test]
fn default_freeze_bound_grows_with_the_last_dump() {
    use crate::protocol::default_freeze_bound;
    let ten = Duration::from_secs(10);
    assert_eq!(default_freeze_bound(ten, None), ten);
    let last = pb::CheckpointInfo {
        prepare_ms: 1000,
        check_ms: 0,
        dump_ms: 9000,
        ..Default::default()
    };
    assert_eq!(
        default_freeze_bound(ten, Some(&last)),
        Duration::from_secs(25)
    );
}

#[tokio::test]
async fn stop_aborts_the_checkpoint_in_progress() {
    let env = Env::new(2).await;
    env.fake.hang.lock().unwrap().insert(("n1".into(), "dump"));
    let c = env.coord.clone();
    let op = tokio::spawn(async move { c.checkpoint("J", pb::After::Continue, None).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    env.coord.shutdown(Duration::from_secs(5)).await;
    let e = op.await.unwrap().unwrap_err();
    assert!(e.to_string().contains("the coordinator is stopping"), "{e}");
    assert_eq!(env.stored("J-1").state(), "aborted");
    assert_eq!(env.fake.nodes_called("abort"), ["n1", "n2"]);
    assert!(matches!(env.ck().await, Err(Error::Stopping)));
}

#[test]
fn catalog_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/cat.redb");
    let ck = |id: &str, seq, st: &str, finished| CheckpointRecord {
        info: Some(pb::CheckpointInfo {
            id: id.into(),
            job: "J".into(),
            state: st.into(),
            images: vec![pb::ImageInfo {
                node: "n1".into(),
                pid: 5,
                dir: format!("/img/J/{id}/n1-5"),
                ..Default::default()
            }],
            ..Default::default()
        }),
        seq,
        finished,
        finished_nodes: vec![],
    };
    {
        let cat = Catalog::open(&path).unwrap();
        // Another open of the same file is refused while this one holds it.
        let e = Catalog::open(&path).unwrap_err();
        assert!(e.to_string().contains("another process"), "{e}");
        let mut job = JobRecord::new("J");
        job.keep = 3;
        job.members.push(catalog::MemberRecord {
            node: "n1".into(),
            pid: 5,
            alive: true,
            ..Default::default()
        });
        cat.update(|_| {
            Ok::<_, catalog::CatalogError>((
                vec![
                    Change::Job(job),
                    Change::Sequence("J".into(), 3),
                    Change::Checkpoint(ck("J-1", 1, "committed", true)),
                    Change::Checkpoint(ck("J-2", 2, "committed", false)),
                    Change::Checkpoint(ck("J-3", 3, "preparing", false)),
                ],
                (),
            ))
        })
        .unwrap();
    }
    let cat = Catalog::open(&path).unwrap();
    assert_eq!(cat.aborted_at_open(), ["J-3"]);
    cat.read(|s| {
        let j = &s.jobs["J"];
        assert_eq!(j.keep, 3);
        assert_eq!(j.external, "abort");
        assert_eq!(j.members.len(), 1);
        assert_eq!(s.sequence("J"), 3);
        assert_eq!(s.checkpoint("J-1").unwrap().state(), "committed");
        assert_eq!(
            s.checkpoint("J-1").unwrap().info().images[0].dir,
            "/img/J/J-1/n1-5"
        );
        let j3 = s.checkpoint("J-3").unwrap();
        assert_eq!(j3.state(), "aborted");
        assert_eq!(j3.info().error, catalog::RESTARTED_ERROR);
        assert_eq!(s.latest_committed("J").unwrap().id(), "J-2");
    });
    let unfinished: Vec<String> = cat
        .unfinished()
        .iter()
        .map(|c| c.id().to_string())
        .collect();
    assert_eq!(unfinished, ["J-2"]);
    drop(cat);
    // The abort was recorded: a third open finds nothing to do.
    let cat = Catalog::open(&path).unwrap();
    assert!(cat.aborted_at_open().is_empty());
}

#[tokio::test]
async fn coordinator_restart_keeps_the_catalog() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cat.redb");
    let fake = Arc::new(Fake::default());
    let mk = || {
        Arc::new(Coordinator::new(
            Arc::new(Catalog::open(&path).unwrap()),
            fake.clone(),
            Settings::default(),
        ))
    };
    let c = mk();
    for i in 1..=2 {
        c.register(pb::RegisterRequest {
            node: format!("n{i}"),
            agent_addr: format!("h{i}:7171"),
            members: vec![member("J", 100 + i)],
            generation: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    }
    c.checkpoint("J", pb::After::Continue, None).await.unwrap();
    drop(c);
    let c = mk();
    // Nodes are known but down until their agents register again.
    let nodes = c.nodes().nodes;
    assert_eq!(nodes.len(), 2);
    assert!(nodes.iter().all(|n| n.state == "down"));
    assert!(
        c.heartbeat(pb::HeartbeatRequest {
            node: "n1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .register_again
    );
    let e = c
        .checkpoint("J", pb::After::Continue, None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("is down"), "{e}");
    assert_eq!(c.checkpoints("J", false).unwrap().checkpoints[0].id, "J-1");
}

/// A checkpoint the coordinator lost in a crash (found `dumping` in the
/// catalog) is aborted on every agent as it registers again, so frozen
/// processes run on at once instead of after the agents' session timeout.
#[tokio::test]
async fn checkpoint_lost_in_a_crash_is_aborted_when_agents_register() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cat.redb");
    {
        let cat = Catalog::open(&path).unwrap();
        let rec = CheckpointRecord {
            info: Some(pb::CheckpointInfo {
                id: "J-1".into(),
                job: "J".into(),
                state: "dumping".into(),
                ..Default::default()
            }),
            seq: 1,
            finished: false,
            finished_nodes: vec![],
        };
        cat.update(|_| {
            Ok::<_, catalog::CatalogError>((
                vec![
                    Change::Job(JobRecord::new("J")),
                    Change::Sequence("J".into(), 1),
                    Change::Checkpoint(rec),
                ],
                (),
            ))
        })
        .unwrap();
    }
    let fake = Arc::new(Fake::default());
    let c = Arc::new(Coordinator::new(
        Arc::new(Catalog::open(&path).unwrap()),
        fake.clone(),
        Settings::default(),
    ));
    c.register(pb::RegisterRequest {
        node: "n1".into(),
        agent_addr: "h1:7171".into(),
        members: vec![member("J", 101)],
        generation: 1,
        ..Default::default()
    })
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let aborted = fake
            .calls
            .lock()
            .unwrap()
            .iter()
            .any(|(n, m, what)| n == "n1" && *m == "abort" && what == "J-1");
        if aborted {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no ABORT of J-1 sent to n1 after it registered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        c.checkpoints("J", true).unwrap().checkpoints[0].state,
        "aborted"
    );
}

/// A launch that arrives before the asking node's heartbeat naming the
/// caller (mpiexec starts its proxies right away) waits for it; without
/// one it is refused after a bound.
#[tokio::test]
async fn launch_waits_for_the_callers_membership() {
    let env = Env::new(2).await;
    let coord = env.coord.clone();
    let later = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        coord
            .heartbeat(pb::HeartbeatRequest {
                node: "n1".into(),
                members: vec![member("J", 101), member("K", 150)],
                generation: 2,
                ..Default::default()
            })
            .await
            .unwrap();
    });
    let req = |job: &str| pb::LaunchRequest {
        job: job.into(),
        host: "n2".into(),
        command: vec!["true".into()],
        ..Default::default()
    };
    // K reached the coordinator while the launch waited: forwarded to n2
    // (whose fake agent cannot start commands).
    let e = env.coord.launch("n1", req("K")).await.unwrap_err();
    assert!(e.to_string().contains("cannot start commands"), "{e}");
    later.await.unwrap();
    let t = std::time::Instant::now();
    let e = env.coord.launch("n1", req("nope")).await.unwrap_err();
    assert_eq!(e.to_string(), "no job nope");
    assert!(t.elapsed() >= Duration::from_secs(4), "{:?}", t.elapsed());
}

#[tokio::test]
async fn a_user_acts_only_on_own_jobs_and_pulls_restarts_to_its_node() {
    let env = Env::new(2).await;
    env.connect_n1_n2();
    // Members and images of J run as uid 1000.
    env.coord.check_user_job("J", "n1", 1000).await.unwrap();
    env.coord.check_user_job("J", "n3", 0).await.unwrap();
    let e = env.coord.check_user_job("J", "n1", 1001).await.unwrap_err();
    assert!(matches!(e, Error::NotOwner { owner: 1000, .. }), "{e}");
    assert_eq!(tonic::Status::from(e).code(), tonic::Code::PermissionDenied);
    assert!(matches!(
        env.coord.check_user_checkpoint("J", None, "n1", 1000),
        Err(Error::NoCheckpoint { .. })
    ));
    let c = env
        .coord
        .checkpoint("J", pb::After::Kill, None)
        .await
        .unwrap();
    assert_eq!(
        env.coord
            .check_user_checkpoint("J", None, "n3", 1000)
            .unwrap(),
        c.id
    );
    assert!(matches!(
        env.coord.check_user_checkpoint("J", None, "n3", 1001),
        Err(Error::NotOwner { .. })
    ));
    assert!(matches!(
        env.coord
            .check_user_checkpoint("J", Some("J-9"), "n3", 1000),
        Err(Error::UnknownCheckpoint { .. })
    ));
}

#[tokio::test]
async fn uncoordinated_members_form_a_recovery_line() {
    let env = Env::new(2).await;
    env.coord
        .configure(&pb::ConfigureRequest {
            job: "J".into(),
            mode: Some("uncoordinated".into()),
            ..Default::default()
        })
        .unwrap();
    let set = |n1: u32, n2: u32| {
        let mut b = env.fake.bookmarks.lock().unwrap();
        b.insert(
            "n1".into(),
            vec![bm("10.0.0.1:40000", "10.0.0.2:5000", 101, n1)],
        );
        b.insert(
            "n2".into(),
            vec![bm("10.0.0.2:5000", "10.0.0.1:40000", 102, n2)],
        );
    };
    // n1 alone at 1000; the other member runs on (only n1 is prepared).
    set(1000, 1000);
    let c = env.coord.checkpoint_member("J", "n1", 101).await.unwrap();
    assert_eq!((c.id.as_str(), c.scope.as_str()), ("J-1", "member"));
    assert_eq!(c.images.len(), 1);
    assert_eq!(env.fake.nodes_called("prepare"), ["n1"]);
    // n2 later, having received 1200 bytes n1's checkpoint never wrote:
    // no pair is consistent, every member rolls back to its start.
    set(1000, 1200);
    env.coord.checkpoint_member("J", "n2", 102).await.unwrap();
    let l = env.coord.recovery_line("J").unwrap();
    assert!(l.at_start, "{l:?}");
    assert!(l.members.iter().all(|m| m.checkpoint.is_empty()));
    let e = env
        .coord
        .restart_placed(
            "J",
            None,
            &Placement::Nodes(vec![]),
            &RestartOpts {
                line: true,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("member n1:101 (work) has no checkpoint on the recovery line"),
        "{e}"
    );
    // n1 again at 1200, incremental on its own last image (J-1): J-3 and
    // J-2 form the line; J-1 is garbage, and retention (after J-3)
    // removed it (its pages folded into J-3 by the agent's Remove).
    set(1200, 1200);
    env.coord.set_incremental("J", true).unwrap();
    env.coord.checkpoint_member("J", "n1", 101).await.unwrap();
    let parent = |id: &str| {
        let p = env.fake.prepared.lock().unwrap()[id].clone();
        p["n1"].targets[0].parent.clone()
    };
    assert_eq!(parent("J-3"), "/img/J/J-1/n1-101");
    let l = env.coord.recovery_line("J").unwrap();
    let on: Vec<(&str, u32)> = l
        .members
        .iter()
        .map(|m| (m.checkpoint.as_str(), m.rolled_back))
        .collect();
    assert_eq!(on, [("J-3", 0), ("J-2", 0)]);
    assert_eq!(env.stored("J-1").state(), "removed");
    assert!(env
        .stored("J-1")
        .info()
        .notes
        .iter()
        .any(|n| n.contains("garbage")));
    assert_eq!(env.stored("J-2").state(), "committed");
    let h = env
        .coord
        .catalog()
        .read(|s| crate::recovery::History::of(s, "J"))
        .unwrap();
    let ck = h.line_checkpoint(&h.line()).unwrap();
    let dirs: Vec<&str> = ck.info().images.iter().map(|i| i.dir.as_str()).collect();
    assert_eq!(dirs.len(), 2);
    assert!(
        dirs[0].contains("J-3") && dirs[1].contains("J-2"),
        "{dirs:?}"
    );
    // A whole-job checkpoint of a coordinated job is not a member's.
    assert_eq!(
        env.coord
            .catalog()
            .read(|s| s.latest_committed("J").map(|c| c.id().to_string())),
        None
    );
}

#[tokio::test]
async fn non_blocking_checkpoints_ask_the_agents_to_go_member_by_member() {
    let env = Env::new(2).await;
    // By the job's mode: every node's PREPARE asks for it, CONTINUE only.
    env.coord
        .configure(&pb::ConfigureRequest {
            job: "J".into(),
            mode: Some("non-blocking".into()),
            save_files: Some(65536),
            ..Default::default()
        })
        .unwrap();
    let c = env
        .coord
        .checkpoint("J", pb::After::Continue, None)
        .await
        .unwrap();
    assert!(c.non_blocking, "{c:?}");
    let prepared = env.fake.prepared.lock().unwrap()[&c.id].clone();
    assert_eq!(prepared.len(), 2);
    assert!(prepared
        .values()
        .all(|r| r.non_blocking && r.save_files == 65536));
    let e = env
        .coord
        .checkpoint("J", pb::After::Kill, None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("non-blocking"), "{e}");
    // By the request, on a coordinated job.
    env.coord
        .configure(&pb::ConfigureRequest {
            job: "J".into(),
            mode: Some("coordinated".into()),
            ..Default::default()
        })
        .unwrap();
    let c = env
        .coord
        .checkpoint("J", pb::After::Continue, None)
        .await
        .unwrap();
    assert!(!c.non_blocking);
    let opts = CheckpointOpts {
        non_blocking: true,
        ..Default::default()
    };
    let c = env
        .coord
        .checkpoint_on("J", pb::After::Continue, &opts)
        .await
        .unwrap();
    assert!(c.non_blocking);
    assert!(env.fake.prepared.lock().unwrap()[&c.id]
        .values()
        .all(|r| r.non_blocking));
}

/// A watcher of job J sees its checkpoint's phases in order; a watcher
/// that reads nothing never holds the coordinator up (it misses events and
/// is told how many, then gets the newest); the coordinator's stop ends
/// every watch with a `shutdown` event.
#[tokio::test]
async fn watchers_follow_phases_lag_alone_and_end_at_the_stop() {
    use tokio_stream::StreamExt;
    let env = Env::new(2).await;
    env.connect_n1_n2();
    let mut w = crate::events::watch(env.coord.clone(), "J".into());
    let mut slow = crate::events::watch(env.coord.clone(), String::new());
    assert_eq!(w.next().await.unwrap().unwrap().kind, "watching");
    env.ck().await.unwrap();
    let mut phases = Vec::new();
    loop {
        let e = w.next().await.unwrap().unwrap();
        assert_eq!((e.kind.as_str(), e.job.as_str()), ("checkpoint", "J"));
        phases.push(e.phase.clone());
        if e.phase == "committed" {
            assert_eq!(e.id, "J-1");
            break;
        }
    }
    assert_eq!(
        phases,
        [
            "preparing",
            "checking",
            "dumping",
            "committing",
            "finishing",
            "removing old checkpoints",
            "committed"
        ]
    );
    // Twice the buffer, sent while the slow watcher reads nothing: no send
    // waits for it.
    let n = 2 * crate::events::BUFFER;
    for _ in 0..n {
        env.coord.events.node("n9", "up", "");
    }
    env.coord.events.node("last", "up", "");
    let (mut lagged, mut got) = (0, 0);
    loop {
        let e = slow.next().await.unwrap().unwrap();
        match (e.kind.as_str(), e.node.as_str()) {
            ("lagged", _) => lagged += e.lagged,
            ("node", "n9") => got += 1,
            ("node", "last") => break,
            _ => {}
        }
    }
    assert!(lagged > 0, "the slow watcher should be told it lagged");
    assert!(
        got <= n as u64 - lagged && got >= crate::events::BUFFER as u64 / 2,
        "it gets the newest events: {got} of {n}, {lagged} missed"
    );
    // The job watcher saw none of them (not its job's).
    env.coord.shutdown(Duration::from_secs(1)).await;
    let mut last = None;
    while let Some(e) = w.next().await {
        last = Some(e.unwrap());
    }
    let last = last.expect("a last event");
    assert_eq!(last.kind, "shutdown", "{last:?}");
}

/// Heartbeat of node n`i` with its member of J (pid 100+i) at `rss` MiB
/// and `free` MiB free on 2 idle CPUs.
fn report(i: usize, free: u64, rss: u64) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest {
        node: format!("n{i}"),
        members: vec![pb::Member {
            rss: rss << 20,
            ..member("J", 100 + i as i32)
        }],
        generation: 2,
        capacity: Some(pb::NodeCapacity {
            mem_free: free << 20,
            mem_source: "meminfo".into(),
            cpus: 2.0,
            load: 0.0,
        }),
        ..Default::default()
    }
}

/// A drain whose member fits on no other node (their agents report less
/// free memory than its RSS) is refused by name: the node is not drained,
/// no agent is asked anything. With room on n3 only, the plan sends it there.
#[tokio::test]
async fn drain_places_by_free_memory_and_refuses_without_room() {
    let env = Env::new(3).await;
    env.report(&[(1000, 300), (200, 1), (250, 1)]).await;
    let calls = env.fake.calls.lock().unwrap().len();
    let e = env.coord.drain("n1", None, "").await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("member n1:101 of job J (300 MiB)") && text.contains("n3 with 250 MiB"),
        "{text}"
    );
    assert!(!env.coord.is_drained("n1"));
    assert_eq!(env.fake.calls.lock().unwrap().len(), calls);
    let nodes = env.coord.nodes().nodes;
    let n3 = nodes.iter().find(|n| n.name == "n3").unwrap();
    assert_eq!(n3.capacity.as_ref().unwrap().mem_free, 250 << 20);
    // Room on n3 only.
    env.coord.heartbeat(report(3, 400, 1)).await.unwrap();
    let jobs = vec![("J".to_string(), vec![101])];
    let plan = env.coord.drain_plan("n1", &jobs).unwrap();
    assert_eq!(
        plan.get(&("J".to_string(), 101)).map(String::as_str),
        Some("n3")
    );
}

/// Without --to a migration goes where placement says: not the member's
/// node, not one without room for it (refused by name while none has
/// room, no agent asked anything). A restart without --on restores the
/// images of a drained node, together, on the node with the most room,
/// and the others where they were.
#[tokio::test]
async fn migrate_and_restart_without_a_target_use_placement() {
    let env = Env::new(3).await;
    env.report(&[(1000, 30), (10, 1), (20, 1)]).await;
    let calls = env.fake.calls.lock().unwrap().len();
    let e = env
        .coord
        .migrate("J", "n1:101", "", None, false, false)
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "cannot migrate job J without --to: no node has room for member n1:101 (30 MiB; \
         most free: n3 with 20 MiB); name one with --to"
    );
    assert_eq!(env.fake.calls.lock().unwrap().len(), calls);
    // The whole job: no node it does not run on.
    let e = env.coord.migrate("J", "", "", None, false, false).await;
    assert!(
        e.as_ref().unwrap_err().to_string().contains(
            "no node has room for job J (3 members) (32 MiB; no other node is up and undrained)"
        ),
        "{e:?}"
    );
    // Room on n3 (n2 still has none).
    env.coord.heartbeat(report(3, 500, 1)).await.unwrap();
    let r = env
        .coord
        .migrate("J", "n1:101", "", None, false, false)
        .await
        .unwrap();
    assert_eq!(r.moved.len(), 1, "{r:?}");
    assert!(r.moved[0].starts_with("n1:101 -> n3:"), "{r:?}");

    // Stopped; n3 drained: its images go to n1 (room), n2's stay.
    env.coord
        .checkpoint("J", pb::After::Kill, None)
        .await
        .unwrap();
    env.coord.drain("n3", None, "").await.unwrap();
    let r = env
        .coord
        .restart_placed("J", None, &Placement::Auto, &RestartOpts::default())
        .await
        .unwrap();
    assert_eq!(r.map_addr, ["10.0.0.3=10.0.0.1"]);
    let mut on: Vec<&str> = r
        .placed
        .iter()
        .filter_map(|p| p.split_once('='))
        .map(|(_, new)| new.split_once(':').unwrap().0)
        .collect();
    on.sort();
    assert_eq!(on, ["n1", "n1", "n2"], "{r:?}");
}

#[test]
fn heartbeat_period_stretches_past_the_rate() {
    let s = Settings {
        heartbeat_ms: 1000,
        node_timeout: Duration::from_secs(5),
        max_heartbeats_per_s: 1000,
        ..Default::default()
    };
    let pace = crate::registry::pace;
    assert_eq!(pace(&s, 1), (1000, Duration::from_secs(5)));
    assert_eq!(pace(&s, 1000), (1000, Duration::from_secs(5)));
    assert_eq!(pace(&s, 1500), (1500, Duration::from_millis(7500)));
    assert_eq!(pace(&s, 10_000), (10_000, Duration::from_secs(50)));
}

#[tokio::test]
async fn agents_are_told_the_stretched_period() {
    let dir = tempfile::tempdir().unwrap();
    let cat = Arc::new(Catalog::open(&dir.path().join("cat.redb")).unwrap());
    let settings = Settings {
        heartbeat_ms: 100,
        node_timeout: Duration::from_secs(2),
        max_heartbeats_per_s: 10,
        ..Default::default()
    };
    let coord = Arc::new(Coordinator::new(cat, Arc::new(Fake::default()), settings));
    let mut told = Vec::new();
    for i in 1..=3 {
        let r = coord
            .register(pb::RegisterRequest {
                node: format!("n{i}"),
                agent_addr: format!("10.0.0.{i}:7171"),
                version: "test".into(),
                generation: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        told.push(r.heartbeat_ms);
    }
    // 10 a second at most: 1, 2, 3 nodes every 100, 200, 300 ms.
    assert_eq!(told, [100, 200, 300]);
    let r = coord
        .heartbeat(pb::HeartbeatRequest {
            node: "n1".into(),
            generation: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(r.heartbeat_ms, 300);
    // Each node's timeout grew with the period it was told (2 s at 100
    // ms): n2's to 4 s, n1's to 6 s (told 300 ms by its heartbeat).
    let t0 = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let live = coord.liveness();
    assert!(live.is_up("n1") && live.is_up("n2"), "both up past 2 s");
    tokio::time::sleep(Duration::from_secs(5).saturating_sub(t0.elapsed())).await;
    let live = coord.liveness();
    assert!(!live.is_up("n2"), "n2 down past 4 s");
    if t0.elapsed() < Duration::from_millis(5900) {
        assert!(live.is_up("n1"), "n1 up until 6 s");
    }
}

/// A heartbeat that changes nothing in the catalog is not queued for the
/// report writer (no transaction, no wait for its lock), yet its liveness,
/// capacity and members' RSS are taken; a changed one is written, and so is
/// an unchanged one once the catalog says otherwise of its members.
#[tokio::test]
async fn unchanged_heartbeat_writes_nothing() {
    let env = Env::new(2).await;
    let c = &env.coord;
    let queued = || c.registry.reports_queued("n1");
    let alive = |pid: i32| {
        c.job("J")
            .unwrap()
            .procs
            .iter()
            .any(|p| p.node == "n1" && p.pid == pid && p.alive)
    };
    assert_eq!(queued(), 1, "the Register");
    let seen = c.liveness().last_seen_unix_ms("n1").unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    // The same member (its RSS and the capacity may differ): nothing queued.
    c.heartbeat(report(1, 700, 5)).await.unwrap();
    assert_eq!(queued(), 1);
    let live = c.liveness();
    assert!(
        live.last_seen_unix_ms("n1").unwrap() > seen,
        "liveness advances"
    );
    assert!(live.is_up("n1"));
    assert_eq!(live.rss("n1", 101), 5 << 20);
    assert_eq!(live.capacity("n1").unwrap().mem_free, 700 << 20);
    // A new member: written.
    let mut hb = report(1, 700, 5);
    hb.members.push(member("J", 201));
    c.heartbeat(hb.clone()).await.unwrap();
    assert_eq!(queued(), 2);
    assert!(alive(101) && alive(201));
    // The same again: nothing.
    hb.generation = 3;
    c.heartbeat(hb.clone()).await.unwrap();
    assert_eq!(queued(), 2);
    // A member gone: written.
    let mut gone = report(1, 700, 5);
    gone.generation = 4;
    c.heartbeat(gone.clone()).await.unwrap();
    assert_eq!(queued(), 3);
    assert!(alive(101) && !alive(201));
    c.heartbeat(gone.clone()).await.unwrap();
    assert_eq!(queued(), 3);
    // The catalog changed by another way (member 101 marked gone): the
    // next heartbeat naming it is written again.
    c.catalog
        .update(|s| {
            let mut j = s.jobs["J"].clone();
            for m in j.members.iter_mut().filter(|m| m.node == "n1") {
                m.alive = false;
            }
            Ok::<_, Error>((vec![Change::Job(j)], ()))
        })
        .unwrap();
    assert!(!alive(101));
    c.heartbeat(gone).await.unwrap();
    assert_eq!(queued(), 4);
    assert!(alive(101));
    // n2 was not touched by any of it.
    assert_eq!(c.registry.reports_queued("n2"), 1);
}
