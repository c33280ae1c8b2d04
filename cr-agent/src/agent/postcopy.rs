//! Post-copy between nodes (`crctl migrate --lazy`): page stores that
//! arrive while the processes restored from them run.
//!
//! A lazy FETCH ([`super::transfer::fetch`] with `lazy`) copies an image
//! without its page store: the store file is made at its full size, empty,
//! and registered here ([`start`]). Two `ServePages` streams to the source
//! agent then fill it: one on which the source pushes every block in order
//! (`all`), and one on which this agent asks for the blocks a restore
//! needs at once ([`PostCopies::wait`], called by the restore engine
//! through [`cr_engine::kinds::memory::remote::RemoteStores`] before it
//! reads a block): a process faulting on a page waits for one block, not
//! for the whole store. HTTP/2 interleaves the two streams, so a wanted
//! block passes the bulk of the push.
//!
//! Every block comes with the XXH3-64 of its bytes, checked on arrival,
//! and is checked again against the image's own block hash when the
//! restore reads it; once every block is in, the file is checked again,
//! every block against the image's own block hashes (the source lists
//! such a store unhashed in its manifest: hashing it whole there would
//! hold the restore back by a read of the whole store; a store the
//! manifest does hash is checked against that hash instead): the copy is
//! then an ordinary, complete image (the replica the coordinator
//! recorded).
//!
//! The source ([`serve`]) reads the blocks with the image format's own
//! store reader and keeps serving until the target has every block
//! (its image stays: it is the committed checkpoint's). If the source dies
//! or the link is cut (the channel's keepalive notices within ~3 s), the
//! store fails: every wait returns the error, the restore's page server
//! kills the processes still missing pages (the member is lost; the job
//! restarts from its checkpoint, whose image the source still has), and
//! the incomplete copy is removed.

use super::transfer;
use super::Shared;
use cr_rpc::pb;
use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tonic::Status;
use tracing::{debug, info, warn};

/// Blocks the source reads ahead of the network, per stream.
const READ_AHEAD: usize = 4;
/// Longest wait for one wanted block (a stuck stream without a transport
/// error; a cut link fails sooner, through the keepalive).
const WANT_TIMEOUT: Duration = Duration::from_secs(30);

/// One store being filled.
struct Store {
    /// Relative to the image root, as the source names it.
    rel: String,
    path: PathBuf,
    file: std::fs::File,
    /// Offset and length of each block in the file.
    blocks: Vec<(u64, u32)>,
    size: u64,
    /// The whole file's hash, when the source's manifest gave it.
    xxh3: Option<u64>,
}

#[derive(Default)]
struct State {
    present: Vec<Vec<bool>>,
    left: usize,
    asked: HashSet<(u32, u32)>,
    failed: Option<String>,
}

/// The stores one lazy fetch gets from one source.
struct Arrival {
    from: String,
    stores: Vec<Store>,
    state: Mutex<State>,
    cond: Condvar,
    want: tokio::sync::mpsc::UnboundedSender<pb::PageRef>,
}

impl Arrival {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The stores this agent is filling, by canonical path.
#[derive(Default)]
pub struct PostCopies {
    by_path: Mutex<HashMap<PathBuf, (Arc<Arrival>, u32)>>,
}

impl std::fmt::Debug for PostCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostCopies")
            .field("stores", &self.map().len())
            .finish()
    }
}

impl PostCopies {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<PathBuf, (Arc<Arrival>, u32)>> {
        self.by_path.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn find(&self, store: &Path) -> Option<(Arc<Arrival>, u32)> {
        self.map().get(store).cloned()
    }
}

impl Arrival {
    /// Ask for block `block` of store `s` unless it is in or asked for.
    fn ask(&self, st: &mut State, s: u32, block: u32) {
        let missing = st.present[s as usize]
            .get(block as usize)
            .is_some_and(|b| !*b);
        if missing && st.failed.is_none() && st.asked.insert((s, block)) {
            let _ = self.want.send(pb::PageRef { store: s, block });
        }
    }
}

impl cr_engine::kinds::memory::remote::RemoteStores for PostCopies {
    fn want(&self, store: &Path, blocks: &[u32]) {
        let Some((a, s)) = self.find(store) else {
            return;
        };
        let mut st = a.lock();
        for &b in blocks {
            a.ask(&mut st, s, b);
        }
    }

    fn has(&self, store: &Path, block: u32) -> Result<bool, String> {
        let Some((a, s)) = self.find(store) else {
            return Ok(true);
        };
        let st = a.lock();
        if st.present[s as usize]
            .get(block as usize)
            .is_none_or(|b| *b)
        {
            return Ok(true);
        }
        st.failed.clone().map_or(Ok(false), Err)
    }

    fn wait(&self, store: &Path, block: u32) -> Result<(), String> {
        let Some((a, s)) = self.find(store) else {
            return Ok(());
        };
        let until = Instant::now() + WANT_TIMEOUT;
        let mut st = a.lock();
        loop {
            if st.present[s as usize]
                .get(block as usize)
                .is_none_or(|b| *b)
            {
                return Ok(());
            }
            if let Some(e) = &st.failed {
                return Err(e.clone());
            }
            a.ask(&mut st, s, block);
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "{} sent nothing for {} s",
                    a.from,
                    WANT_TIMEOUT.as_secs()
                ));
            }
            st = a
                .cond
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// A page store left out of a lazy fetch: `rel` (relative to the image
/// root, as the source's manifest named it, with its size and hash if the
/// manifest gave one).
pub struct Lazy {
    pub rel: String,
    pub size: u64,
    pub xxh3: Option<u64>,
}

/// Make the stores `lazy` (their images in place under `root` but for
/// them) empty at their size, and start filling them from `from`'s agent
/// through `client`. Returns once they are registered: the restore may
/// read them from now on.
pub fn start(
    shared: &Arc<Shared>,
    root: &Path,
    from: &str,
    client: pb::agent_client::AgentClient<tonic::transport::Channel>,
    lazy: Vec<Lazy>,
) -> Result<(), String> {
    if lazy.is_empty() {
        return Ok(());
    }
    let mut stores = Vec::new();
    for l in lazy {
        let path = transfer::under(root, &l.rel)?;
        let (_, store) = image_store(&path)?;
        if store.size != l.size {
            return Err(format!("{}: not the size of its image's page store", l.rel));
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        file.set_len(l.size)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let path = path.canonicalize().unwrap_or(path);
        stores.push(Store {
            rel: l.rel,
            path,
            file,
            blocks: store
                .blocks
                .iter()
                .map(|b| (b.offset, b.stored_len))
                .collect(),
            size: l.size,
            xxh3: l.xxh3,
        });
    }
    let (want, wants) = tokio::sync::mpsc::unbounded_channel();
    let state = State {
        present: stores.iter().map(|s| vec![false; s.blocks.len()]).collect(),
        left: stores.iter().map(|s| s.blocks.len()).sum(),
        ..Default::default()
    };
    let a = Arc::new(Arrival {
        from: from.to_string(),
        stores,
        state: Mutex::new(state),
        cond: Condvar::new(),
        want,
    });
    {
        let mut m = shared.postcopies.map();
        for (k, s) in a.stores.iter().enumerate() {
            m.insert(s.path.clone(), (a.clone(), k as u32));
        }
    }
    info!(
        from,
        stores = a.stores.len(),
        bytes = a.stores.iter().map(|s| s.size).sum::<u64>(),
        "post-copy: page stores to come while the processes run"
    );
    let sh = shared.clone();
    tokio::spawn(async move {
        let t0 = Instant::now();
        match fill(&a, client, wants).await {
            Ok(bytes) => {
                let mut m = sh.postcopies.map();
                for s in &a.stores {
                    m.remove(&s.path);
                }
                drop(m);
                info!(
                    from = a.from,
                    bytes,
                    ms = t0.elapsed().as_millis() as u64,
                    "post-copy: every page block is in, stores checked"
                );
            }
            Err(e) => {
                // Left registered, failed: every later look at them says so.
                a.lock().failed = Some(e.clone());
                a.cond.notify_all();
                for s in &a.stores {
                    if let Some(d) = s.path.parent() {
                        let _ = std::fs::remove_dir_all(d);
                    }
                }
                // Said once it is true: the processes were told, the copy is gone.
                warn!(from = a.from, error = e, "post-copy from the source failed: the processes still missing pages are killed, the incomplete copy is removed");
            }
        }
    });
    Ok(())
}

/// The blocks wanted, as messages to the source: every block asked for
/// since the last message goes in the next one (a restore asks for all the
/// blocks it must write before the release at once: one message, not one
/// per block).
struct Batches(tokio::sync::mpsc::UnboundedReceiver<pb::PageRef>);

impl tokio_stream::Stream for Batches {
    type Item = pb::PageWant;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<pb::PageWant>> {
        let Some(first) = std::task::ready!(self.0.poll_recv(cx)) else {
            return std::task::Poll::Ready(None);
        };
        let mut want = vec![first];
        while let Ok(w) = self.0.try_recv() {
            want.push(w);
        }
        debug!(blocks = want.len(), "post-copy: blocks wanted");
        std::task::Poll::Ready(Some(pb::PageWant {
            want,
            ..Default::default()
        }))
    }
}

/// Receive every block of `a`'s stores (the push, and the blocks asked
/// for through `wants`); then check each file whole. The bytes received.
async fn fill(
    a: &Arc<Arrival>,
    mut client: pb::agent_client::AgentClient<tonic::transport::Channel>,
    wants: tokio::sync::mpsc::UnboundedReceiver<pb::PageRef>,
) -> Result<u64, String> {
    use tokio_stream::StreamExt;
    let rels: Vec<String> = a.stores.iter().map(|s| s.rel.clone()).collect();
    let first = |all| pb::PageWant {
        stores: rels.clone(),
        all,
        want: Vec::new(),
    };
    let from = a.from.clone();
    let lost = |s: Status| format!("{from}: {}", cr_rpc::status_line(&s));
    let mut push = client
        .serve_pages(tokio_stream::once(first(true)))
        .await
        .map_err(lost)?
        .into_inner();
    let asks = tokio_stream::once(first(false)).chain(Batches(wants));
    let mut asked = client.serve_pages(asks).await.map_err(lost)?.into_inner();
    let mut bytes = 0u64;
    let mut push_open = true;
    loop {
        if a.lock().left == 0 {
            break;
        }
        let b = tokio::select! {
            m = asked.message() => m,
            m = push.message(), if push_open => m,
        };
        let b = match b.map_err(lost)? {
            Some(b) => b,
            None if push_open => {
                push_open = false;
                continue;
            }
            None => return Err(format!("{from} ended the stream with blocks missing")),
        };
        bytes += b.data.len() as u64;
        put(a, &b)?;
    }
    // Whole files, checked against the source's manifest, or block by
    // block against the image's own hashes.
    let a2 = a.clone();
    tokio::task::spawn_blocking(move || {
        for s in &a2.stores {
            s.file
                .sync_all()
                .map_err(|e| format!("{}: {e}", s.path.display()))?;
            match s.xxh3 {
                Some(h) => transfer::check_whole(&s.path, s.size, h),
                None => check_blocks(&s.path).map(|n| {
                    info!(
                        store = s.rel,
                        blocks = n,
                        "post-copy: store checked block by block against its image's hashes"
                    )
                }),
            }
            .map_err(|e| format!("{}: {e}", s.rel))?;
        }
        Ok::<_, String>(())
    })
    .await
    .map_err(|e| e.to_string())??;
    Ok(bytes)
}

/// Every block of the complete page store file `path`, checked against
/// the block hashes of the image it lies in; how many there are.
fn check_blocks(path: &Path) -> Result<usize, String> {
    let r = open_store(path)?;
    let mut buf = Vec::new();
    for id in 0..r.nr_blocks() {
        let id = id as u32;
        r.block(id, &mut buf)
            .map_err(|e| cr_sys::error::one_line(&e))?;
        r.release(id);
    }
    Ok(r.nr_blocks())
}

/// Write block `b` into its store (checked first) and wake its waiters.
fn put(a: &Arrival, b: &pb::PageBlock) -> Result<(), String> {
    let s = a
        .stores
        .get(b.store as usize)
        .ok_or_else(|| format!("{} sent a block of store {}", a.from, b.store))?;
    let &(off, len) = s
        .blocks
        .get(b.block as usize)
        .ok_or_else(|| format!("{} sent block {} of {}", a.from, b.block, s.rel))?;
    if b.data.len() != len as usize || cr_image::checksum(&b.data) != b.xxh3 {
        return Err(format!(
            "block {} of {} from {} failed its check",
            b.block, s.rel, a.from
        ));
    }
    if a.lock().present[b.store as usize][b.block as usize] {
        return Ok(()); // asked for and pushed: here already
    }
    s.file
        .write_all_at(&b.data, off)
        .map_err(|e| format!("{}: {e}", s.path.display()))?;
    let mut st = a.lock();
    let p = &mut st.present[b.store as usize][b.block as usize];
    if !*p {
        *p = true;
        st.left -= 1;
    }
    drop(st);
    a.cond.notify_all();
    Ok(())
}

/// SERVEPAGES on the source: the stores named by the first message, the
/// blocks wanted first, then (with `all`) every other one in order.
pub async fn serve(
    shared: Arc<Shared>,
    mut inbound: tonic::Streaming<pb::PageWant>,
) -> Result<tokio::sync::mpsc::Receiver<Result<pb::PageBlock, Status>>, Status> {
    let first = inbound
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument("no store named"))?;
    let root = transfer::root(&shared);
    let paths = first
        .stores
        .iter()
        .map(|r| transfer::under(&root, r))
        .collect::<Result<Vec<_>, _>>()
        .map_err(Status::invalid_argument)?;
    let readers = tokio::task::spawn_blocking(move || {
        paths
            .iter()
            .map(|p| open_store(p))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| Status::internal(e.to_string()))?
    .map_err(Status::not_found)?;
    let all = first.all;
    let (wtx, wrx) = std::sync::mpsc::channel::<pb::PageRef>();
    for w in first.want {
        let _ = wtx.send(w);
    }
    tokio::spawn(async move {
        while let Ok(Some(m)) = inbound.message().await {
            for w in m.want {
                if wtx.send(w).is_err() {
                    return;
                }
            }
        }
    });
    let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
    std::thread::Builder::new()
        .name("page-serve".into())
        .spawn(move || {
            serve_blocks(&readers, all, &wrx, &tx, &|| {
                // A test cuts the link or kills this agent mid-way.
                super::fault::point("postcopy", &shared)
            })
        })
        .map_err(|e| Status::internal(format!("cannot start a page server: {e}")))?;
    Ok(rx)
}

/// The image that page store file `path` lies in, and its entry there.
/// Only that image is read, not its parents: a store holds the blocks of
/// its own image, and the parents' metadata (2 MB each at 1 GiB, five or
/// more of them after pre-copy rounds) would be decoded for nothing while
/// a restore waits for its first block.
fn image_store(path: &Path) -> Result<(cr_image::ImageDir, cr_image::model::PageStore), String> {
    let dir = path
        .parent()
        .ok_or_else(|| format!("{}: not in an image directory", path.display()))?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let image = cr_image::ImageDir::open(dir)
        .map_err(|e| format!("{}: {}", dir.display(), cr_sys::error::one_line(&e)))?;
    let ck = image
        .read_checkpoint()
        .map_err(|e| format!("{}: {}", dir.display(), cr_sys::error::one_line(&e)))?;
    let store = ck
        .store
        .filter(|s| s.name == name)
        .ok_or_else(|| format!("{} is not the page store of its image", path.display()))?;
    Ok((image, store))
}

/// The store reader of page store file `path` (of the image it lies in).
fn open_store(path: &Path) -> Result<cr_image::store::StoreReader, String> {
    let (image, store) = image_store(path)?;
    cr_image::store::StoreReader::open(&image, &store)
        .map_err(|e| format!("{}: {}", path.display(), cr_sys::error::one_line(&e)))
}

fn serve_blocks(
    readers: &[cr_image::store::StoreReader],
    all: bool,
    wants: &std::sync::mpsc::Receiver<pb::PageRef>,
    tx: &tokio::sync::mpsc::Sender<Result<pb::PageBlock, Status>>,
    halfway: &dyn Fn(),
) {
    let mut sent: Vec<Vec<bool>> = readers.iter().map(|r| vec![false; r.nr_blocks()]).collect();
    let send = |store: u32, block: u32, sent: &mut Vec<Vec<bool>>| -> bool {
        let Some(r) = readers.get(store as usize) else {
            let _ = tx.blocking_send(Err(Status::invalid_argument(format!("no store {store}"))));
            return false;
        };
        match sent[store as usize].get(block as usize) {
            Some(true) => return true,
            Some(false) => {}
            None => {
                let _ = tx.blocking_send(Err(Status::invalid_argument(format!(
                    "{} has no block {block}",
                    r.path().display()
                ))));
                return false;
            }
        }
        let msg = match r.stored(block) {
            Ok(data) => Ok(pb::PageBlock {
                store,
                block,
                xxh3: cr_image::checksum(data),
                data: data.to_vec(),
            }),
            Err(e) => Err(Status::internal(cr_sys::error::one_line(&e))),
        };
        let ok = msg.is_ok();
        sent[store as usize][block as usize] = true;
        tx.blocking_send(msg).is_ok() && ok
    };
    let mut next = (0usize, 0u32);
    loop {
        // What a process waits for goes first.
        loop {
            match wants.try_recv() {
                Ok(w) => {
                    if !send(w.store, w.block, &mut sent) {
                        return;
                    }
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) if all => break,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
            }
        }
        if !all {
            match wants.recv() {
                Ok(w) => {
                    if !send(w.store, w.block, &mut sent) {
                        return;
                    }
                }
                Err(_) => return,
            }
            continue;
        }
        // The push, in file order.
        while next.0 < readers.len() && next.1 as usize >= readers[next.0].nr_blocks() {
            next = (next.0 + 1, 0);
        }
        if next.0 >= readers.len() {
            return; // every block sent
        }
        if !send(next.0 as u32, next.1, &mut sent) {
            return;
        }
        if next == (0, 0) {
            halfway();
        }
        next.1 += 1;
    }
}
