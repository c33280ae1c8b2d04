//! Images copied between agents, over their gRPC/TLS channel.
//!
//! The node that holds an image serves it ([`manifest`], [`read_file`]:
//! the `ImageManifest` and `ReadImageFile` calls, open to every node
//! certificate of the cluster); the node that needs it pulls it when the
//! coordinator says so ([`fetch`], the `Fetch` call).
//!
//! * The manifest lists every file of the images asked for and of the
//!   parents they are incremental on (parents are named by relative paths,
//!   so the tree is rebuilt under the puller's own image root at the same
//!   relative place), each with its size and XXH3-64.
//! * Files come in chunks of [`CHUNK`] bytes, each with its XXH3-64,
//!   checked on arrival; a file is checked again as a whole once complete.
//! * A file already present with the same size and hash is not copied
//!   (shared storage, a copy made before); a copy is written under
//!   `<images>/.incoming/` and resumed from the last checked chunk after a
//!   failure (a cut link, a source agent restarted) until the request's
//!   timeout; only a complete, checked image directory is renamed into
//!   place, its `checkpoint.img` last. A fetch that gives up removes its
//!   partial copy; the agent's start removes any it finds ([`sweep`]).
//! * Progress (bytes, rate, time left) is logged every second, and goes
//!   to the coordinator with each heartbeat ([`Transfers`]): crctl watch
//!   and crctl status show a migration's copy as it goes.

use super::Shared;
use cr_rpc::pb;
use std::collections::{HashMap, HashSet};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Status;
use tracing::{info, warn};

/// Bytes per chunk of a streamed file.
pub const CHUNK: usize = 1 << 20;
/// Where partial copies are kept, under the image root.
pub const INCOMING: &str = ".incoming";
/// Chunks read ahead of the network on the serving side.
const READ_AHEAD: usize = 8;
/// Pause before a copy is resumed after a failure.
const RESUME_PAUSE: Duration = Duration::from_millis(300);
/// Keepalive of the channel to the source agent: a cut link fails the
/// stream within about three periods, and the copy is resumed.
const PEER_KEEPALIVE: Duration = Duration::from_secs(1);

pub fn root(shared: &Shared) -> PathBuf {
    let r = &shared.config.images;
    r.canonicalize().unwrap_or_else(|_| r.clone())
}

/// `rel` (as a manifest names it) under `root`, refused if it leaves it.
pub fn under(root: &Path, rel: &str) -> Result<PathBuf, String> {
    let p = Path::new(rel);
    if rel.is_empty() || p.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(format!("{rel:?} is not a path inside the image root"));
    }
    Ok(root.join(p))
}

/// Hashes already computed (or checked on arrival), by path, valid while
/// the file keeps its size and modification time: the parents of an
/// incremental image (a pre-copy's pre-dumps) are not read again at each
/// fetch.
static KNOWN: std::sync::OnceLock<std::sync::Mutex<Known>> = std::sync::OnceLock::new();

/// Path → (size, mtime in ns, XXH3-64).
type Known = HashMap<PathBuf, (u64, i128, u64)>;

fn stamp(path: &Path) -> std::io::Result<(u64, i128)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path)?;
    Ok((
        m.len(),
        i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
    ))
}

fn known() -> std::sync::MutexGuard<'static, Known> {
    KNOWN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

/// XXH3-64 and size of a file, from [`KNOWN`] when it has not changed.
fn file_hash(path: &Path) -> std::io::Result<(u64, u64)> {
    let (size, mtime) = stamp(path)?;
    if let Some(&(s, m, h)) = known().get(path) {
        if s == size && m == mtime {
            return Ok((h, size));
        }
    }
    let (h, n) = hash_file(path)?;
    remember(path, h);
    Ok((h, n))
}

/// `path` (as it is now) has hash `h`.
fn remember(path: &Path, h: u64) {
    if let Ok((size, mtime)) = stamp(path) {
        known().insert(path.to_path_buf(), (size, mtime, h));
    }
}

/// What a manifest needs of an image's `checkpoint.img`: its id and its
/// parent, by path, valid while that file keeps its size and modification
/// time (a pre-copy's pre-dumps are decoded once, not at every fetch: each
/// holds the page map of the whole memory, 2 MB at 1 GiB).
static LINKS: std::sync::OnceLock<std::sync::Mutex<Links>> = std::sync::OnceLock::new();

/// `checkpoint.img` → (size, mtime in ns, image id and parent).
type Links = HashMap<PathBuf, (u64, i128, Link)>;

/// An image's id and the parent it is incremental on.
type Link = (String, Option<cr_image::model::ParentRef>);

/// The id and parent of the image in `dir`, from [`LINKS`] when its
/// `checkpoint.img` has not changed.
fn image_link(dir: &Path) -> cr_image::Result<Link> {
    cached_link(dir, &|dir| {
        let ck = cr_image::ImageDir::open(dir)?.read_checkpoint()?;
        Ok((ck.meta.image_id, ck.parent))
    })
}

/// The link of the image in `dir`: [`LINKS`]'s while its `checkpoint.img`
/// keeps its stamp, else `decode`'s (then remembered).
fn cached_link(
    dir: &Path,
    decode: &dyn Fn(&Path) -> cr_image::Result<Link>,
) -> cr_image::Result<Link> {
    let file = dir.join(cr_image::dir::CHECKPOINT_FILE);
    let (size, mtime) = stamp(&file).map_err(|source| cr_image::ImageError::Io {
        path: file.clone(),
        source,
    })?;
    let links = || {
        LINKS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    };
    if let Some((s, m, link)) = links().get(&file) {
        if *s == size && *m == mtime {
            return Ok(link.clone());
        }
    }
    let link = decode(dir)?;
    links().insert(file, (size, mtime, link.clone()));
    Ok(link)
}

/// The directories (canonical) of the image in `dir` and of every parent
/// it is incremental on, itself first: [`cr_image::chain::walk`] with
/// links from [`LINKS`].
fn chain_dirs(dir: &Path) -> Result<Vec<PathBuf>, String> {
    walk_chain(dir, &image_link)
}

/// [`chain_dirs`], each image's link given by `link`.
fn walk_chain(
    dir: &Path,
    link: &dyn Fn(&Path) -> cr_image::Result<Link>,
) -> Result<Vec<PathBuf>, String> {
    let msg = |e: cr_image::ImageError| cr_sys::error::one_line(&e);
    let dir = dir
        .canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let links = cr_image::chain::walk(&dir, |d| {
        let (id, parent) = link(d)?;
        Ok(((), id, parent))
    })
    .map_err(msg)?;
    links
        .into_iter()
        .map(|(d, ())| {
            d.canonicalize()
                .map_err(|e| format!("{}: {e}", d.display()))
        })
        .collect()
}

/// XXH3-64 and size of a file, read whole.
fn hash_file(path: &Path) -> std::io::Result<(u64, u64)> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let size = hash_into(std::fs::File::open(path)?, &mut h)?;
    Ok((h.digest(), size))
}

/// Feed everything `r` reads to `h`; how many bytes that was.
fn hash_into(mut r: impl Read, h: &mut xxhash_rust::xxh3::Xxh3) -> std::io::Result<u64> {
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            return Ok(size);
        }
        h.update(&buf[..n]);
        size += n as u64;
    }
}

/// The manifest of images `dirs` (absolute, under the image root) and of
/// their parents. With `lazy`, the page stores of `dirs` themselves are
/// listed unhashed: the puller gets them block by block (post-copy), each
/// block checked by its own hash, and hashing a store of 1 GiB whole here
/// would delay the migration's restore by as long as that read takes.
pub fn manifest(shared: &Shared, dirs: &[String], lazy: bool) -> Result<pb::Manifest, String> {
    let root = root(shared);
    let rel = |p: &Path| -> Result<String, String> {
        let c = p
            .canonicalize()
            .map_err(|e| format!("{}: {e}", p.display()))?;
        c.strip_prefix(&root)
            .ok()
            .filter(|r| !r.as_os_str().is_empty())
            .map(|r| r.to_string_lossy().into_owned())
            .ok_or_else(|| format!("{} is not an image under {}", p.display(), root.display()))
    };
    let mut out = pb::Manifest::default();
    let mut seen = HashSet::new();
    for d in dirs {
        let links = chain_dirs(Path::new(d))?;
        out.dirs.push(rel(Path::new(d))?);
        // Parents first: a child is never in place before its parent.
        for link in links.iter().rev() {
            let r = rel(link)?;
            if seen.insert(r.clone()) {
                out.all_dirs.push(r);
            }
        }
    }
    for d in &out.all_dirs {
        let dir = root.join(d);
        let rd = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut names: Vec<_> = rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        for n in names {
            let p = dir.join(&n);
            let path = format!("{d}/{n}");
            let io = |e: std::io::Error| format!("{}: {e}", p.display());
            if lazy && is_top_store(&out.dirs, &path) {
                let size = std::fs::metadata(&p).map_err(io)?.len();
                out.files.push(pb::ImageFile {
                    path,
                    size,
                    xxh3: 0,
                    unhashed: true,
                });
                continue;
            }
            let (xxh3, size) = file_hash(&p).map_err(io)?;
            out.files.push(pb::ImageFile {
                path,
                size,
                xxh3,
                unhashed: false,
            });
        }
    }
    Ok(out)
}

/// The chunks of file `rel` from `offset`, read on a blocking thread.
pub fn read_file(
    shared: &Shared,
    rel: &str,
    offset: u64,
) -> Result<tokio::sync::mpsc::Receiver<Result<pb::FileChunk, Status>>, Status> {
    let root = root(shared);
    let path = under(&root, rel).map_err(Status::invalid_argument)?;
    let mut f = std::fs::File::open(&path)
        .map_err(|e| Status::not_found(format!("{}: {e}", path.display())))?;
    f.seek(SeekFrom::Start(offset)).map_err(|e| {
        Status::invalid_argument(format!("{}: offset {offset}: {e}", path.display()))
    })?;
    let (tx, rx) = tokio::sync::mpsc::channel(READ_AHEAD);
    std::thread::Builder::new()
        .name("image-read".into())
        .spawn(move || {
            let mut off = offset;
            loop {
                let mut buf = vec![0u8; CHUNK];
                let mut n = 0;
                while n < CHUNK {
                    match f.read(&mut buf[n..]) {
                        Ok(0) => break,
                        Ok(k) => n += k,
                        Err(e) => {
                            let _ = tx.blocking_send(Err(Status::internal(format!(
                                "{}: {e}",
                                path.display()
                            ))));
                            return;
                        }
                    }
                }
                if n == 0 {
                    return;
                }
                buf.truncate(n);
                let chunk = pb::FileChunk {
                    offset: off,
                    xxh3: cr_image::checksum(&buf),
                    data: buf.into(),
                };
                off += n as u64;
                if tx.blocking_send(Ok(chunk)).is_err() {
                    return; // the puller went away
                }
            }
        })
        .map_err(|e| Status::internal(format!("cannot start a reader: {e}")))?;
    Ok(rx)
}

/// Remove partial copies an earlier run left.
pub fn sweep(images: &Path) {
    let d = images.join(INCOMING);
    if d.exists() {
        match std::fs::remove_dir_all(&d) {
            Ok(()) => info!(dir = %d.display(), "removed partial image copies"),
            Err(e) => warn!(dir = %d.display(), error = %e, "cannot remove partial image copies"),
        }
    }
}

/// The copies to this node in progress, by a number of their own.
#[derive(Default)]
pub struct Transfers {
    next: std::sync::atomic::AtomicU64,
    now: std::sync::Mutex<HashMap<u64, pb::TransferProgress>>,
}

impl Transfers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, pb::TransferProgress>> {
        self.now.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every copy in progress, as far as it got (for the heartbeat).
    pub fn snapshot(&self) -> Vec<pb::TransferProgress> {
        self.lock().values().cloned().collect()
    }
}

/// Channels to other agents, by address and node name, kept open from one
/// fetch to the next: the fetch of a migration's final image (the job
/// frozen) reuses the connection (TCP, TLS, HTTP/2) its pre-copy rounds
/// opened. A channel whose connection failed (a cut link, a restarted
/// agent: the keepalive notices) connects again at its next call.
#[derive(Default)]
pub struct Peers {
    channels: std::sync::Mutex<HashMap<(String, String), tonic::transport::Channel>>,
}

impl Peers {
    /// The channel to `node`'s agent at `addr`, made at the first call.
    pub fn channel(
        &self,
        security: &cr_rpc::tls::Security,
        addr: &str,
        node: &str,
    ) -> Result<tonic::transport::Channel, String> {
        let mut m = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let key = (addr.to_string(), node.to_string());
        if let Some(ch) = m.get(&key) {
            return Ok(ch.clone());
        }
        let ch = cr_rpc::channel::lazy_bulk(
            addr,
            security,
            node,
            Duration::from_secs(3),
            PEER_KEEPALIVE,
        )
        .map_err(|e| e.to_string())?;
        m.insert(key, ch.clone());
        Ok(ch)
    }
}

/// Progress of a fetch, logged at most once a second, and kept in
/// [`Transfers`] until it ends.
struct Progress<'a> {
    shared: &'a Shared,
    /// Its number in `shared.transfers`.
    id: u64,
    /// The test hook "fetch" is still to be passed (after the first chunk).
    fault_pending: bool,
    what: String,
    total: u64,
    done: u64,
    t0: Instant,
    last: Instant,
}

impl Drop for Progress<'_> {
    fn drop(&mut self) {
        self.shared.transfers.lock().remove(&self.id);
    }
}

impl Progress<'_> {
    fn add(&mut self, n: u64) {
        self.done += n;
        if let Some(t) = self.shared.transfers.lock().get_mut(&self.id) {
            t.bytes = self.done;
            t.elapsed_ms = self.t0.elapsed().as_millis() as u64;
        }
        if std::mem::take(&mut self.fault_pending) {
            // A test cuts the link or kills an agent with a copy half done.
            tokio::task::block_in_place(|| super::fault::point("fetch", self.shared));
        }
        if self.last.elapsed() >= Duration::from_secs(1) {
            self.last = Instant::now();
            let secs = self.t0.elapsed().as_secs_f64().max(1e-3);
            let rate = self.done as f64 / secs;
            let left = (self.total.saturating_sub(self.done)) as f64 / rate.max(1.0);
            info!(
                what = self.what,
                bytes = self.done,
                total = self.total,
                mib_per_s = format!("{:.1}", rate / (1 << 20) as f64),
                left_s = format!("{left:.1}"),
                "copying images"
            );
        }
    }
}

/// Copy one file from the source into `part` (resumed from its length),
/// every chunk checked. `Err((msg, retry))`: retry when the transport failed.
async fn copy_file(
    client: &mut pb::agent_client::AgentClient<tonic::transport::Channel>,
    f: &pb::ImageFile,
    part: &Path,
    progress: &mut Progress<'_>,
) -> Result<(), (String, bool)> {
    let fail = |m: String| (m, false);
    if let Some(p) = part.parent() {
        std::fs::create_dir_all(p).map_err(|e| fail(format!("{}: {e}", p.display())))?;
    }
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .map_err(|e| fail(format!("{}: {e}", part.display())))?;
    let mut have = out
        .metadata()
        .map_err(|e| fail(format!("{}: {e}", part.display())))?
        .len();
    if have > f.size {
        out.set_len(0)
            .map_err(|e| fail(format!("{}: {e}", part.display())))?;
        have = 0;
    }
    // The whole file's hash, computed as it is written (a resumed copy
    // reads back what it already has), so the copy is not read again.
    let mut whole = xxhash_rust::xxh3::Xxh3::new();
    if have > 0 {
        std::fs::File::open(part)
            .and_then(|p| hash_into(p.take(have), &mut whole))
            .map_err(|e| fail(format!("{}: {e}", part.display())))?;
    }
    if have < f.size {
        let mut stream = client
            .read_image_file(pb::ReadFileRequest {
                path: f.path.clone(),
                offset: have,
            })
            .await
            .map_err(|s| (cr_rpc::status_line(&s), true))?
            .into_inner();
        loop {
            let chunk = match stream.message().await {
                Ok(Some(c)) => c,
                Ok(None) => break,
                Err(s) => return Err((cr_rpc::status_line(&s), true)),
            };
            if chunk.offset != have || cr_image::checksum(&chunk.data) != chunk.xxh3 {
                // A damaged chunk is fetched again from where we are.
                return Err((
                    format!("{}: a chunk at {} failed its check", f.path, chunk.offset),
                    true,
                ));
            }
            out.write_all(&chunk.data)
                .map_err(|e| fail(format!("{}: {e}", part.display())))?;
            whole.update(&chunk.data);
            have += chunk.data.len() as u64;
            progress.add(chunk.data.len() as u64);
        }
    }
    out.sync_all()
        .map_err(|e| fail(format!("{}: {e}", part.display())))?;
    drop(out);
    if have != f.size || whole.digest() != f.xxh3 {
        // Start the file over (the source changed it, or the copy is bad).
        let _ = std::fs::remove_file(part);
        return Err((
            format!("{}: the copy does not match the source's hash", f.path),
            true,
        ));
    }
    Ok(())
}

/// A copied file, checked whole against the source's size and hash (and
/// remembered as such when it matches).
pub fn check_whole(path: &Path, size: u64, xxh3: u64) -> Result<(), String> {
    let (h, n) = hash_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if n != size || h != xxh3 {
        return Err("the copy does not match the source's hash".into());
    }
    remember(path, h);
    Ok(())
}

/// Move the checked copy of image directory `rel` into place: files
/// renamed one by one, `checkpoint.img` last (an image is only ever seen
/// whole).
fn put_in_place(root: &Path, rel: &str) -> Result<(), String> {
    let from = root.join(INCOMING).join(rel);
    let to = root.join(rel);
    std::fs::create_dir_all(&to).map_err(|e| format!("{}: {e}", to.display()))?;
    let Ok(rd) = std::fs::read_dir(&from) else {
        return Ok(()); // every file was present already
    };
    let mut names: Vec<_> = rd.flatten().map(|e| e.file_name()).collect();
    names.sort_by_key(|n| n == cr_image::dir::CHECKPOINT_FILE);
    for n in names {
        std::fs::rename(from.join(&n), to.join(&n))
            .map_err(|e| format!("{}: {e}", to.join(&n).display()))?;
    }
    prune(root, &from);
    Ok(())
}

/// Remove `dir` and its ancestors under the image root while they are
/// empty (`.incoming` itself once no copy is left in it).
pub fn prune(root: &Path, dir: &Path) {
    let mut d = Some(dir);
    while let Some(p) = d.filter(|p| p.starts_with(root) && *p != root) {
        if std::fs::remove_dir(p).is_err() {
            return;
        }
        d = p.parent();
    }
}

/// FETCH: copy `req.dirs` from the source agent; where they are here.
pub async fn fetch(shared: Arc<Shared>, req: pb::FetchRequest) -> Result<pb::FetchReply, String> {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_millis(u64::from(req.timeout_ms.max(1000)));
    let root = root(&shared);
    let channel = shared
        .peers
        .channel(&shared.security, &req.from_addr, &req.from_node)?;
    let mut client =
        pb::agent_client::AgentClient::new(channel).max_decoding_message_size(4 * CHUNK);
    let from = &req.from_node;
    let mut resumes = 0u32;
    // With `lazy`, the source does not hash the page stores it will serve
    // block by block; but a store already here (shared storage, a copy
    // made before) can only be recognised by its hash: then the manifest is
    // asked for again, hashed whole.
    let mut lazy_manifest = req.lazy;
    let manifest = loop {
        // Retried while the deadline allows: a failure of the transport.
        let m = match client
            .image_manifest(pb::ManifestRequest {
                dirs: req.dirs.clone(),
                lazy: lazy_manifest,
            })
            .await
        {
            Ok(m) => m.into_inner(),
            Err(s) if is_transport(&s) && Instant::now() + RESUME_PAUSE < deadline => {
                resumes += 1;
                tokio::time::sleep(RESUME_PAUSE).await;
                continue;
            }
            Err(s) => return Err(format!("{from}: {}", cr_rpc::status_line(&s))),
        };
        for d in m.dirs.iter().chain(&m.all_dirs) {
            under(&root, d)?;
        }
        let mut here = false;
        for f in m.files.iter().filter(|f| f.unhashed) {
            if !(req.lazy && is_top_store(&m.dirs, &f.path)) {
                return Err(format!("{from} listed {} unhashed", f.path));
            }
            here |= under(&root, &f.path)?.exists();
        }
        if !here {
            break m;
        }
        lazy_manifest = false;
    };
    // Files already here (same size and hash) are not copied; with `lazy`,
    // neither are the page stores of the images asked for (post-copy).
    let mut todo = Vec::new();
    let mut lazy = Vec::new();
    let mut present = 0u64;
    for f in &manifest.files {
        let dst = under(&root, &f.path)?;
        if f.unhashed {
            // Not here (checked above): to come block by block.
            lazy.push(super::postcopy::Lazy {
                rel: f.path.clone(),
                size: f.size,
                xxh3: None,
            });
            continue;
        }
        let same = tokio::task::spawn_blocking({
            let dst = dst.clone();
            move || file_hash(&dst).ok()
        })
        .await
        .ok()
        .flatten()
            == Some((f.xxh3, f.size));
        if same {
            present += f.size;
        } else if req.lazy && is_top_store(&manifest.dirs, &f.path) {
            lazy.push(super::postcopy::Lazy {
                rel: f.path.clone(),
                size: f.size,
                xxh3: Some(f.xxh3),
            });
        } else {
            todo.push(f.clone());
        }
    }
    let total: u64 = todo.iter().map(|f| f.size).sum();
    info!(
        what = req.what,
        from = %from,
        images = manifest.dirs.len(),
        files = todo.len(),
        bytes = total,
        present_bytes = present,
        manifest_ms = t0.elapsed().as_millis() as u64,
        "fetching images"
    );
    let id = shared
        .transfers
        .next
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    shared.transfers.lock().insert(
        id,
        pb::TransferProgress {
            job: req.job.clone(),
            what: req.what.clone(),
            from_node: from.clone(),
            bytes: 0,
            total,
            elapsed_ms: 0,
        },
    );
    let mut progress = Progress {
        shared: &shared,
        id,
        fault_pending: true,
        what: req.what.clone(),
        total,
        done: 0,
        t0,
        last: Instant::now(),
    };
    let incoming = root.join(INCOMING);
    // Whatever ends the fetch before its copies are in place (a failure,
    // or the coordinator's call dropped) removes them.
    let mut staging = Staging {
        root: root.clone(),
        dirs: manifest.all_dirs.iter().map(|d| incoming.join(d)).collect(),
        armed: true,
    };
    let give_up = |msg: String| {
        warn!(what = req.what, from = %from, error = msg, "fetch failed: partial copies removed");
        msg
    };
    for f in &todo {
        let part = incoming.join(&f.path);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let r =
                match tokio::time::timeout(left, copy_file(&mut client, f, &part, &mut progress))
                    .await
                {
                    Ok(r) => r,
                    Err(_) => Err(("no progress before the deadline".to_string(), false)),
                };
            match r {
                Ok(()) => break,
                Err((msg, true)) if Instant::now() + RESUME_PAUSE < deadline => {
                    resumes += 1;
                    warn!(
                        what = req.what,
                        file = f.path,
                        error = msg,
                        "copy interrupted: resuming"
                    );
                    tokio::time::sleep(RESUME_PAUSE).await;
                }
                Err((msg, _)) => {
                    return Err(give_up(format!(
                        "copy of {} from {from} failed: {msg}",
                        f.path
                    )))
                }
            }
        }
    }
    for d in &manifest.all_dirs {
        put_in_place(&root, d).map_err(give_up)?;
    }
    staging.armed = false;
    let lazy_bytes: u64 = lazy.iter().map(|l| l.size).sum();
    super::postcopy::start(&shared, &root, from, client, lazy).map_err(give_up)?;
    // Checked on arrival: known from now on.
    for f in &todo {
        if let Ok(p) = under(&root, &f.path) {
            remember(&p, f.xxh3);
        }
    }
    let ms = t0.elapsed().as_millis() as u64;
    info!(
        what = req.what,
        from = %from,
        bytes = total,
        ms,
        resumes,
        lazy_bytes,
        mib_per_s = format!("{:.1}", total as f64 / (1 << 20) as f64 / (ms.max(1) as f64 / 1000.0)),
        "images fetched"
    );
    Ok(pb::FetchReply {
        dirs: manifest
            .dirs
            .iter()
            .map(|d| root.join(d).display().to_string())
            .collect(),
        bytes: total,
        present_bytes: present,
        ms,
        resumes,
    })
}

/// Whether `path` (of a manifest) is the page store of one of the images
/// `dirs` asked for (not of a parent): `pages-*.img` right in it.
fn is_top_store(dirs: &[String], path: &str) -> bool {
    path.rsplit_once('/').is_some_and(|(d, name)| {
        dirs.iter().any(|x| x == d) && name.starts_with("pages-") && name.ends_with(".img")
    })
}

/// The partial copies of a fetch, removed when it ends before they are in
/// place.
struct Staging {
    root: PathBuf,
    dirs: Vec<PathBuf>,
    armed: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for d in &self.dirs {
            if std::fs::remove_dir_all(d).is_ok() {
                info!(dir = %d.display(), "partial image copy removed");
            }
            if let Some(p) = d.parent() {
                prune(&self.root, p);
            }
        }
    }
}

/// A failure of the link or of the peer's process, worth retrying.
fn is_transport(s: &Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use cr_image::model::ParentRef;
    use std::cell::Cell;

    /// A fresh directory of its own under the system's temporary one.
    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("cr-agent-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d.canonicalize().unwrap()
    }

    fn parent(path: &str, id: &str) -> Option<ParentRef> {
        Some(ParentRef {
            path: path.into(),
            image_id: id.into(),
        })
    }

    #[test]
    fn chain_walked_with_parent_checks() {
        let root = scratch("chain");
        for d in ["a", "b", "c"] {
            std::fs::create_dir(root.join(d)).unwrap();
        }
        let links = |a_parent: Option<ParentRef>, b_id: &str| {
            let mut m: HashMap<PathBuf, Link> = HashMap::new();
            m.insert(root.join("a"), ("A".into(), a_parent));
            m.insert(root.join("b"), (b_id.into(), parent("../a", "A")));
            m.insert(root.join("c"), ("C".into(), parent("../b", "B")));
            m
        };
        let walk = |m: &HashMap<PathBuf, Link>| {
            walk_chain(&root.join("c"), &|d| {
                m.get(&d.canonicalize().unwrap_or_else(|_| d.to_path_buf()))
                    .cloned()
                    .ok_or_else(|| cr_image::ImageError::MissingDir(d.to_path_buf()))
            })
        };
        let dirs = walk(&links(None, "B")).unwrap();
        assert_eq!(dirs, [root.join("c"), root.join("b"), root.join("a")]);
        // A parent that now holds another image, a loop, a missing parent.
        let e = walk(&links(None, "X")).unwrap_err();
        assert!(e.contains("now holds another image"), "{e}");
        let e = walk(&links(parent("../c", "C"), "B")).unwrap_err();
        assert!(e.contains("loops"), "{e}");
        let e = walk(&links(parent("../gone", "G"), "B")).unwrap_err();
        assert!(e.contains("gone"), "{e}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn link_decoded_again_once_its_file_changes() {
        let dir = scratch("link");
        let file = dir.join(cr_image::dir::CHECKPOINT_FILE);
        std::fs::write(&file, b"first").unwrap();
        let decoded = Cell::new(0);
        let decode = |_: &Path| {
            decoded.set(decoded.get() + 1);
            Ok((format!("id{}", decoded.get()), None))
        };
        assert_eq!(cached_link(&dir, &decode).unwrap().0, "id1");
        assert_eq!(cached_link(&dir, &decode).unwrap().0, "id1");
        assert_eq!(decoded.get(), 1);
        // Another image written in its place (another size).
        std::fs::write(&file, b"the second image").unwrap();
        assert_eq!(cached_link(&dir, &decode).unwrap().0, "id2");
        assert_eq!(decoded.get(), 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
