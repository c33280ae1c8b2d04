//! The coordinator over real gRPC and mutual TLS: fake Agent servers (one
//! per node, each with its node's certificate), the Coordinator service,
//! and a client in the role of crctl and of the agents' registration.

use cr_coordinatord::service::Service;
use cr_coordinatord::{pb, Catalog, Coordinator, GrpcAgents, Settings};
use cr_rpc::tls::{Security, TlsFiles};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// A fake agent: every call succeeds at once (but DUMP of session
/// "hang", which never answers).
#[derive(Clone)]
struct FakeAgent {
    node: String,
    /// It serves the Commands stream (else Unimplemented, as an older
    /// agent).
    stream: bool,
    /// Commands received on it.
    streamed: Arc<AtomicUsize>,
}

impl FakeAgent {
    fn new(node: &str, stream: bool) -> FakeAgent {
        FakeAgent {
            node: node.into(),
            stream,
            streamed: Arc::default(),
        }
    }
}

#[tonic::async_trait]
impl pb::agent_server::Agent for FakeAgent {
    type ReadImageFileStream =
        tokio_stream::wrappers::ReceiverStream<Result<pb::FileChunk, Status>>;
    type ServePagesStream = tokio_stream::wrappers::ReceiverStream<Result<pb::PageBlock, Status>>;
    type CommandsStream = cr_rpc::commands::ReplyStream;

    async fn commands(
        &self,
        r: Request<tonic::Streaming<pb::Command>>,
    ) -> Result<Response<Self::CommandsStream>, Status> {
        if !self.stream {
            return Err(Status::unimplemented("an older agent"));
        }
        let me = self.clone();
        Ok(Response::new(cr_rpc::commands::serve(
            r.into_inner(),
            move |call| {
                use cr_rpc::commands::{Call, Reply};
                let me = me.clone();
                me.streamed.fetch_add(1, Ordering::SeqCst);
                async move {
                    Ok(match call {
                        Call::Prepare(r) => {
                            Reply::Prepare(me.prepare(Request::new(r)).await?.into_inner())
                        }
                        Call::Freeze(r) => {
                            Reply::Freeze(me.freeze(Request::new(r)).await?.into_inner())
                        }
                        Call::Dump(r) => Reply::Dump(me.dump(Request::new(r)).await?.into_inner()),
                        Call::Abort(r) => {
                            Reply::Abort(me.abort(Request::new(r)).await?.into_inner())
                        }
                        Call::Finish(r) => {
                            Reply::Finish(me.finish(Request::new(r)).await?.into_inner())
                        }
                    })
                }
            },
        )))
    }

    // This fake models shared storage: every image is on every node.
    async fn pre_dump(
        &self,
        _: Request<pb::PreDumpRequest>,
    ) -> Result<Response<pb::PreDumpReply>, Status> {
        Err(Status::unimplemented("no images here"))
    }
    async fn fetch(
        &self,
        r: Request<pb::FetchRequest>,
    ) -> Result<Response<pb::FetchReply>, Status> {
        Ok(Response::new(pb::FetchReply {
            dirs: r.into_inner().dirs,
            ..Default::default()
        }))
    }
    async fn image_manifest(
        &self,
        _: Request<pb::ManifestRequest>,
    ) -> Result<Response<pb::Manifest>, Status> {
        Err(Status::unimplemented("no images here"))
    }
    async fn read_image_file(
        &self,
        _: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadImageFileStream>, Status> {
        Err(Status::unimplemented("no images here"))
    }
    async fn serve_pages(
        &self,
        _: Request<tonic::Streaming<pb::PageWant>>,
    ) -> Result<Response<Self::ServePagesStream>, Status> {
        Err(Status::unimplemented("no images here"))
    }
    async fn prepare(
        &self,
        r: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        let r = r.into_inner();
        Ok(Response::new(pb::PrepareReply {
            processes: r.targets.len() as u32,
            ..Default::default()
        }))
    }
    async fn freeze(
        &self,
        _: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::PrepareReply>, Status> {
        // One member per node (see dump).
        Ok(Response::new(pb::PrepareReply {
            processes: 1,
            ..Default::default()
        }))
    }
    async fn dump(
        &self,
        r: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::DumpReply>, Status> {
        // The session is JOB-N; pid 100 + node number.
        let session = r.into_inner().session;
        if session == "hang" {
            std::future::pending::<()>().await;
        }
        let pid = 100 + self.node[1..].parse::<i32>().unwrap();
        let job = session.rsplit_once('-').unwrap().0;
        Ok(Response::new(pb::DumpReply {
            images: vec![pb::ImageInfo {
                node: self.node.clone(),
                pid,
                dir: format!("/img/{job}/{session}/{}-{pid}", self.node),
                processes: 1,
                store_bytes: 10,
                frozen_ms: 3,
                ..Default::default()
            }],
            gone: vec![],
        }))
    }
    async fn abort(&self, _: Request<pb::SessionRequest>) -> Result<Response<pb::Empty>, Status> {
        Ok(Response::new(pb::Empty {}))
    }
    async fn finish(
        &self,
        _: Request<pb::FinishRequest>,
    ) -> Result<Response<pb::FinishReply>, Status> {
        Ok(Response::new(pb::FinishReply::default()))
    }
    async fn restore(
        &self,
        r: Request<pb::RestoreRequest>,
    ) -> Result<Response<pb::RestoreReply>, Status> {
        let n = r.into_inner().targets.len() as i32;
        Ok(Response::new(pb::RestoreReply {
            pids: (0..n).map(|i| 900 + i).collect(),
        }))
    }
    async fn release(
        &self,
        _: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::ReleaseReply>, Status> {
        Ok(Response::new(pb::ReleaseReply {
            members: vec![pb::Member {
                job: "J".into(),
                pid: 900,
                ..Default::default()
            }],
            generation: 10,
        }))
    }
    async fn job_back(
        &self,
        _: Request<pb::SessionRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        Ok(Response::new(pb::Empty {}))
    }
    async fn remove(&self, _: Request<pb::RemoveRequest>) -> Result<Response<pb::Empty>, Status> {
        Ok(Response::new(pb::Empty {}))
    }
    async fn unlock(&self, _: Request<pb::RemoveRequest>) -> Result<Response<pb::Empty>, Status> {
        Ok(Response::new(pb::Empty {}))
    }
    async fn launch(
        &self,
        _: Request<pb::LaunchRequest>,
    ) -> Result<Response<pb::LaunchReply>, Status> {
        Err(Status::unimplemented("a fake agent starts nothing"))
    }
}

fn security(dir: &Path, name: &str) -> Security {
    Security::load(&TlsFiles {
        ca: Some(dir.join("ca.crt")),
        cert: Some(dir.join(format!("{name}.crt"))),
        key: Some(dir.join(format!("{name}.key"))),
        insecure: false,
    })
    .unwrap()
}

async fn listener() -> (tokio::net::TcpListener, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap().to_string();
    (l, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_and_restart_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let pki = dir.path().join("pki");
    cr_rpc::pki::init_ca(&pki).unwrap();
    let lo = ["127.0.0.1".parse().unwrap()];
    for n in ["cr-coordinatord", "n1", "n2"] {
        cr_rpc::pki::issue(&pki, n, &lo).unwrap();
    }
    cr_rpc::pki::issue_with_role(&pki, "admin", &lo, Some("admin")).unwrap();

    // Agents.
    let mut agent_addrs = Vec::new();
    for node in ["n1", "n2"] {
        let (l, addr) = listener().await;
        let sec = security(&pki, node);
        // n2 as an older agent: unary calls only.
        let svc = pb::agent_server::AgentServer::new(FakeAgent::new(node, node == "n1"));
        tokio::spawn(
            tonic::transport::Server::builder()
                .tls_config(sec.server().unwrap())
                .unwrap()
                .add_service(svc)
                .serve_with_incoming(TcpListenerStream::new(l)),
        );
        agent_addrs.push(addr);
    }

    // Coordinator.
    let csec = security(&pki, "cr-coordinatord");
    let catalog = Arc::new(Catalog::open(&dir.path().join("c.redb")).unwrap());
    let agents = Arc::new(GrpcAgents::new(
        catalog.clone(),
        csec.clone(),
        Duration::from_secs(5),
        Duration::from_secs(30),
    ));
    let coord = Arc::new(Coordinator::new(catalog, agents, Settings::default()));
    let (l, caddr) = listener().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .tls_config(csec.server().unwrap())
            .unwrap()
            .add_service(Service::server(coord.clone()))
            .serve_with_incoming(TcpListenerStream::new(l)),
    );

    // A client without a certificate of the CA is refused.
    let other = dir.path().join("other");
    cr_rpc::pki::init_ca(&other).unwrap();
    cr_rpc::pki::issue(&other, "admin", &lo).unwrap();
    let bad = Security::load(&TlsFiles {
        ca: Some(pki.join("ca.crt")),
        cert: Some(other.join("admin.crt")),
        key: Some(other.join("admin.key")),
        insecure: false,
    })
    .unwrap();
    let refused = match cr_rpc::channel::connect(
        &caddr,
        &bad,
        cr_rpc::COORDINATOR_NAME,
        Duration::from_secs(5),
    )
    .await
    {
        Err(_) => true,
        Ok(ch) => pb::coordinator_client::CoordinatorClient::new(ch)
            .status(pb::Empty {})
            .await
            .is_err(),
    };
    assert!(refused);

    let ch = cr_rpc::channel::connect(
        &caddr,
        &security(&pki, "admin"),
        cr_rpc::COORDINATOR_NAME,
        Duration::from_secs(5),
    )
    .await
    .unwrap();
    let mut c = pb::coordinator_client::CoordinatorClient::new(ch);
    // Each node registers with its own certificate; the administrator's
    // cannot register one, nor can a node's act for another node.
    let as_node = |name: &str| {
        let sec = security(&pki, name);
        let addr = caddr.clone();
        async move {
            let ch = cr_rpc::channel::connect(
                &addr,
                &sec,
                cr_rpc::COORDINATOR_NAME,
                Duration::from_secs(5),
            )
            .await
            .unwrap();
            pb::coordinator_client::CoordinatorClient::new(ch)
        }
    };
    let reg = |node: &str, addr: &str| pb::RegisterRequest {
        node: node.into(),
        agent_addr: addr.into(),
        ..Default::default()
    };
    let e = c.register(reg("n1", &agent_addrs[0])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    let e = as_node("n2")
        .await
        .register(reg("n1", &agent_addrs[0]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    let e = as_node("n1").await.jobs(pb::Empty {}).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");
    assert!(e.message().contains("administrator"), "{e}");
    for (i, addr) in agent_addrs.iter().enumerate() {
        let mut c = as_node(&format!("n{}", i + 1)).await;
        let r = c
            .register(pb::RegisterRequest {
                node: format!("n{}", i + 1),
                agent_addr: addr.clone(),
                addresses: vec![format!("10.0.0.{}", i + 1)],
                version: "0".into(),
                members: vec![pb::Member {
                    job: "J".into(),
                    pid: 101 + i as i32,
                    ..Default::default()
                }],
                generation: 1,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.heartbeat_ms, 1000);
    }
    let ck = c
        .checkpoint(pb::CheckpointRequest {
            job: "J".into(),
            after: pb::After::Kill as i32,
            timeout_secs: 20,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ck.id, "J-1");
    assert_eq!(ck.state, "committed");
    assert_eq!(ck.images.len(), 2);

    let r = c
        .restart(pb::RestartRequest {
            job: "J".into(),
            on: vec!["n2".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.checkpoint, "J-1");
    assert_eq!(r.map_addr, ["10.0.0.1=10.0.0.2"]);
    assert_eq!(r.procs.len(), 1);

    let e = c
        .restart(pb::RestartRequest {
            job: "J".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    assert!(e.message().contains("job J still runs 1 processes"), "{e}");

    let e = c
        .checkpoints(pb::CheckpointsRequest {
            job: "K".into(),
            all: true,
        })
        .await
        .unwrap_err();
    assert_eq!(e.message(), "no job K");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_is_prompt_with_idle_clients_connected() {
    let dir = tempfile::tempdir().unwrap();
    let catalog = Arc::new(Catalog::open(&dir.path().join("c.redb")).unwrap());
    let agents = Arc::new(GrpcAgents::new(
        catalog.clone(),
        Security::Insecure,
        Duration::from_secs(1),
        Duration::from_secs(1),
    ));
    let coord = Arc::new(Coordinator::new(catalog, agents, Settings::default()));
    let (l, addr) = listener().await;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let stop = coord.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(Service::server(coord.clone()))
            .serve_with_incoming_shutdown(TcpListenerStream::new(l), async move {
                let _ = rx.await;
                stop.shutdown(Duration::from_secs(5)).await;
            }),
    );
    let ch = cr_rpc::channel::connect(&addr, &Security::Insecure, "x", Duration::from_secs(5))
        .await
        .unwrap();
    let mut c = pb::coordinator_client::CoordinatorClient::new(ch);
    c.status(pb::Empty {}).await.unwrap();
    tx.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(3), server)
        .await
        .expect("the server stops while a client holds its connection")
        .unwrap()
        .unwrap();
    drop(c);
}

/// A TCP relay to `to` whose connections [`Relay::cut`] drops (a link cut).
struct Relay {
    addr: String,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Relay {
    async fn start(to: String) -> Relay {
        let (l, addr) = listener().await;
        let conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let c = conns.clone();
        tokio::spawn(async move {
            while let Ok((mut a, _)) = l.accept().await {
                let to = to.clone();
                c.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut b) = tokio::net::TcpStream::connect(to).await {
                        let _ = tokio::io::copy_bidirectional(&mut a, &mut b).await;
                    }
                }));
            }
        });
        Relay { addr, conns }
    }

    fn cut(&self) {
        for h in self.conns.lock().unwrap().drain(..) {
            h.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_calls_go_on_a_stream_that_times_out_and_reopens() {
    let dir = tempfile::tempdir().unwrap();
    let (l, addr) = listener().await;
    let fake = FakeAgent::new("n1", true);
    let streamed = fake.streamed.clone();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::agent_server::AgentServer::new(fake))
            .serve_with_incoming(TcpListenerStream::new(l)),
    );
    let relay = Relay::start(addr).await;
    let catalog = Arc::new(Catalog::open(&dir.path().join("c.redb")).unwrap());
    let agents = Arc::new(GrpcAgents::new(
        catalog.clone(),
        Security::Insecure,
        Duration::from_secs(5),
        Duration::from_millis(1500),
    ));
    let coord = Arc::new(Coordinator::new(
        catalog,
        agents.clone(),
        Settings::default(),
    ));
    coord
        .register(pb::RegisterRequest {
            node: "n1".into(),
            agent_addr: relay.addr.clone(),
            version: "test".into(),
            generation: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    use cr_coordinatord::AgentApi;
    let session = |s: &str| pb::SessionRequest { session: s.into() };

    // On the stream (opened by the first call).
    assert_eq!(agents.in_flight("n1"), None);
    agents.abort("n1", session("J-1")).await.unwrap();
    let r = agents.dump("n1", session("J-1")).await.unwrap();
    assert_eq!(r.images.len(), 1);
    assert_eq!(streamed.load(Ordering::SeqCst), 2);
    assert_eq!(agents.in_flight("n1"), Some(0));

    // A call without a reply times out as a unary one does, and leaves
    // nothing pending; the stream serves on.
    let e = agents.dump("n1", session("hang")).await.unwrap_err();
    assert_eq!(e, "no reply within 1500 ms");
    assert_eq!(agents.in_flight("n1"), Some(0));
    agents.abort("n1", session("J-1")).await.unwrap();
    assert_eq!(streamed.load(Ordering::SeqCst), 4);

    // The link is cut with a call in flight: it fails at once, not at its
    // timeout; the next call opens another stream.
    let a = agents.clone();
    let hung = tokio::spawn(async move { a.dump("n1", session("hang")).await });
    while agents.in_flight("n1") != Some(1) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t = std::time::Instant::now();
    relay.cut();
    let e = hung.await.unwrap().unwrap_err();
    assert!(e.starts_with("unreachable"), "{e}");
    assert!(
        t.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t.elapsed()
    );
    agents.abort("n1", session("J-1")).await.unwrap();
    assert_eq!(streamed.load(Ordering::SeqCst), 6);
    assert_eq!(agents.in_flight("n1"), Some(0));

    // reset (the agent registered again) drops the stream.
    agents.reset("n1");
    assert_eq!(agents.in_flight("n1"), None);
    agents.abort("n1", session("J-1")).await.unwrap();
    assert_eq!(streamed.load(Ordering::SeqCst), 7);
}
