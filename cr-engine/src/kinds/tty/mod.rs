//! Kind "tty": terminals. Pseudo-terminal pairs whose master the tree
//! holds are saved whole (index, termios, window size, lock state,
//! foreground group) and made again at the same index (in the job's own
//! devpts instance when it has one, see kind "mounts"). A pty is known by
//! its devpts instance (st_dev) and index ([`Masters`]): two devpts mounts
//! (a container's, a `newinstance` mount) number their ptys from 0 each;
//! a pty of another instance than /dev/pts is made again through the
//! `ptmx` of that mount (still mounted at the restore). A session leader
//! gets its controlling terminal back, and /dev/tty fds are opened again
//! once it has. The bytes queued in a pair (input the slave has not read,
//! output the master has not) are taken out while the tree is frozen and
//! put back at once, and again at the restore, past the line discipline
//! (see `cr_sys::ptyq`). A slave whose master every process closed (hung
//! up, its node removed) is made again with a pair whose master the
//! restorer closes once the fds are open ([`hang_up`]). A terminal outside the tree (the one a job was started
//! from) leads outside: kind [`external`](crate::kinds::external).

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::{external, files, Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::objects::Pty;
use cr_image::model::{Checkpoint, Fd, FdKind, Object, ObjectKind, Process};
use cr_sys::fdio;
use cr_sys::proc::{self, dev_major as major, FDTarget};
use cr_sys::ptyq::{self, Queued};
use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use tracing::warn;

pub struct Tty;

/// Terminal devices: the console and virtual terminals (4), /dev/tty,
/// console and ptmx (5), pty slaves (136-143).
fn is_tty_dev(rdev: u64) -> bool {
    matches!(major(rdev), 4 | 5 | 136..=143)
}

/// /dev/tty (5:0): the caller's controlling terminal.
fn is_dev_tty(rdev: u64) -> bool {
    proc::is_dev(rdev, 5, 0)
}

/// The devpts instance (st_dev) of pty end `fd` of `pid` (`link`: what
/// its /proc link reads). A slave, or a master opened through a devpts's
/// own ptmx (or a bind mount of it, as a job's /dev/ptmx is), is of the
/// instance holding it; a master opened through a ptmx device node
/// elsewhere (/dev/ptmx on devtmpfs) is of the instance mounted at `pts`
/// next to that node, as the kernel finds it (devpts_mntget).
fn instance(pid: i32, fd: i32, link: &str) -> Option<u64> {
    let path = format!("/proc/{pid}/fd/{fd}");
    if fdio::fs_magic_at(Path::new(&path)).ok()? == crate::kinds::mounts::DEVPTS_MAGIC {
        return Some(std::fs::metadata(&path).ok()?.dev());
    }
    let dir = Path::new(link).parent()?.to_str()?;
    let pts = format!("{}/pts", dir.trim_end_matches('/'));
    Some(
        std::fs::metadata(format!("/proc/{pid}/root{pts}"))
            .ok()?
            .dev(),
    )
}

/// The pty pairs whose master the tree holds, by devpts instance (st_dev)
/// and index, and the object id of each: the index for the instance
/// mounted at /dev/pts, `(K << 32) | index` for the K-th other instance
/// (by mount point), so that a capture of the restored tree (`--verify`,
/// where the instances may have other st_dev) names them alike.
#[derive(Default)]
pub struct Masters {
    /// Instance -> its mount point (/dev/pts if it is one of them) and
    /// the indexes of the masters held, each with a (process, fd) holding
    /// it.
    instances: BTreeMap<u64, (String, BTreeMap<u32, FdOf>)>,
}

/// A process and one of its fds.
type FdOf = (i32, i32);

impl Masters {
    /// Master fd `fd` of `pid` (what its link reads: `link`) is pty `index`.
    pub fn add(&mut self, pid: i32, fd: i32, link: &str, index: u32) {
        let Some(dev) = instance(pid, fd, link) else {
            return;
        };
        let e = self.instances.entry(dev).or_insert_with(|| {
            // Where the process sees it mounted: /dev/pts if it is there.
            let points = proc::mount_points_of(pid, dev);
            let mount = points
                .iter()
                .find(|m| m.as_os_str() == cr_sys::ns::DEV_PTS)
                .or(points.first())
                .map(|m| m.to_string_lossy().into_owned())
                .unwrap_or_else(|| cr_sys::ns::DEV_PTS.into());
            (mount, BTreeMap::new())
        });
        e.1.entry(index).or_insert((pid, fd));
    }

    /// The object id of pty `index` of instance `dev`, if the tree holds
    /// its master, with the instance's mount point (empty: /dev/pts).
    fn id(&self, dev: u64, index: u32) -> Option<(u64, &str)> {
        let (mount, held) = self.instances.get(&dev)?;
        if !held.contains_key(&index) {
            return None;
        }
        if mount == cr_sys::ns::DEV_PTS {
            return Some((index as u64, ""));
        }
        let mut others: Vec<(&String, u64)> = self
            .instances
            .iter()
            .filter(|(_, (m, _))| m != cr_sys::ns::DEV_PTS)
            .map(|(d, (m, _))| (m, *d))
            .collect();
        others.sort();
        let k = others.iter().position(|&(_, d)| d == dev)? as u64;
        Some((((k + 1) << 32) | index as u64, mount))
    }

    /// A (process, fd) holding the master of pty `index` of instance
    /// `dev`.
    fn master(&self, dev: u64, index: u32) -> Option<FdOf> {
        self.instances.get(&dev)?.1.get(&index).copied()
    }

    /// The pty object that is the controlling terminal `tty_nr` (field 7
    /// of /proc/PID/stat) of a process with `fds`, if the tree holds it.
    /// The device number names no devpts instance: when several hold that
    /// index, the one a slave fd of the process is of, else /dev/pts's.
    pub fn ctty(&self, tty_nr: u64, fds: &[Fd]) -> Option<u64> {
        let index = proc::pty_slave_index(tty_nr)?;
        let ids: Vec<(u64, &str)> = self
            .instances
            .keys()
            .filter_map(|&d| self.id(d, index))
            .collect();
        if let [(id, _)] = ids[..] {
            return Some(id);
        }
        let of_slave = fds.iter().find_map(|f| match f.kind {
            FdKind::Pty {
                object,
                master: false,
            } if ids.iter().any(|&(i, _)| i == object) => Some(object),
            _ => None,
        });
        of_slave.or_else(|| ids.iter().find(|(_, m)| m.is_empty()).map(|&(i, _)| i))
    }
}

impl FileKind for Tty {
    fn name(&self) -> &'static str {
        "tty"
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        if !matches!(f.target, FDTarget::Path(_)) {
            return None;
        }
        let md = f.md.as_ref()?;
        let r = md.rdev();
        if !md.file_type().is_char_device() || !is_tty_dev(r) {
            return None;
        }
        // /dev/tty of a process whose controlling terminal is a pty of the
        // tree: opened again by path once that pty is its terminal.
        if is_dev_tty(r) {
            let ctty = proc::stat(f.pid).map(|s| s.tty_nr as u64).unwrap_or(0);
            if cx.tree.pty_masters.ctty(ctty, &[]).is_some() {
                return Some(Ok(Some(FdKind::CharDevice {
                    rdev: r,
                    mode: md.mode() & 0o7777,
                    uid: md.uid(),
                    gid: md.gid(),
                })));
            }
        }
        let master = proc::is_dev(r, 5, 2);
        let index = if master {
            f.info
                .get("tty-index")
                .and_then(|v| v.trim().parse::<u32>().ok())
        } else {
            proc::pty_slave_index(r)
        };
        let held = index.and_then(|index| {
            let dev = instance(f.pid, f.fd, &f.link)?;
            let (id, devpts) = cx.tree.pty_masters.id(dev, index)?;
            let at = cx.tree.pty_masters.master(dev, index)?;
            Some((index, id, devpts.to_string(), at))
        });
        if let Some((index, id, devpts, at)) = held {
            if !devpts.is_empty() && cr_sys::ns::differs(f.pid, "mnt").unwrap_or(true) {
                return Some(Err(format!(
                    "pseudo-terminal {index} of the devpts mounted at {devpts} in the job's own mount namespace (only its /dev/pts is made again)"
                )));
            }
            if let Some(objs) = cx.objects.as_deref_mut() {
                if !objs.contains(cr_image::model::ObjectTag::Pty, id) {
                    match pty_state(at, index) {
                        // A foreground group is named by its leader, which
                        // must be of the tree.
                        Ok(p) if p.fg_pgrp != 0 && !cx.tree.in_tree(p.fg_pgrp as i32) => objs
                            .insert(Object {
                                id,
                                kind: ObjectKind::Pty(Pty {
                                    devpts,
                                    fg_pgrp: 0,
                                    ..p
                                }),
                            }),
                        Ok(p) => objs.insert(Object {
                            id,
                            kind: ObjectKind::Pty(Pty { devpts, ..p }),
                        }),
                        Err(e) => return Some(Err(e)),
                    }
                }
            }
            return Some(Ok(Some(FdKind::Pty { object: id, master })));
        }
        if !master {
            if let Some(hung) = index.and_then(|i| hung_up(cx, f, i)) {
                return Some(hung);
            }
        }
        if master {
            return Some(Err(format!(
                "the master of pseudo-terminal {} (not supported)",
                f.info.get("tty-index").unwrap_or("?")
            )));
        }
        // A console, virtual or serial terminal (not a pty) opened by path:
        // the device stays on the host, opened again by that path, when it
        // is not what the job was started from (a process's standard fds
        // or controlling terminal, of a session led outside the tree),
        // which leads outside instead.
        if index.is_none() && !is_dev_tty(r) {
            let (ctty, session) = proc::stat(f.pid)
                .map(|s| (s.tty_nr as u64, s.session))
                .unwrap_or((0, 0));
            let started_from = ctty == r || f.fd <= 2;
            if !started_from || cx.tree.in_tree(session) {
                return Some(Ok(Some(FdKind::CharDevice {
                    rdev: r,
                    mode: md.mode() & 0o7777,
                    uid: md.uid(),
                    gid: md.gid(),
                })));
            }
        }
        Some(external::record(f, format!("the terminal {}", f.link)))
    }

    fn prepare(&self, r: &mut Restorer<'_>, ck: &Checkpoint) -> Result<(), RestoreError> {
        // A job's own devpts exists only once its mount namespace is made:
        // its ptys are made then (`kinds::mounts::prepare`).
        if ck.mounts.as_ref().is_some_and(|m| m.devpts) {
            return Ok(());
        }
        make_ptys(r, std::path::Path::new(cr_sys::ns::DEV_PTMX))
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        Some(match &f.kind {
            // /dev/tty waits until the controlling terminal is back.
            FdKind::CharDevice { rdev, .. } if is_dev_tty(*rdev) => Ok(Opened::Later),
            // Never made the controlling terminal of the process by the open.
            FdKind::CharDevice { rdev, .. } if is_tty_dev(*rdev) => {
                files::reopen(cx, f, libc::O_NOCTTY).map(|()| Opened::InStub)
            }
            FdKind::Pty { object, master } => pty_end(cx.r, f, *object, *master).map(Opened::Ours),
            _ => return None,
        })
    }
}

/// Make every pty pair of the image at its index through the multiplexer
/// `ptmx` (of the devpts the tree will see), with its settings; the
/// restorer holds the masters until the fds are opened.
pub fn make_ptys(r: &mut Restorer<'_>, ptmx: &std::path::Path) -> Result<(), RestoreError> {
    let ptmx = ptmx.to_string_lossy();
    let ck = r.ck;
    for o in &ck.objects {
        let ObjectKind::Pty(p) = &o.kind else {
            continue;
        };
        let what = || format!("cannot recreate pseudo-terminal {}", p.index);
        let own;
        let ptmx = if p.devpts.is_empty() {
            &*ptmx
        } else {
            own = format!("{}/ptmx", p.devpts);
            &own
        };
        let m =
            fdio::open_pty_index(ptmx, p.index).step(|| format!("{} (through {ptmx})", what()))?;
        let slave = fdio::pty_peer(&m, libc::O_RDWR | libc::O_NONBLOCK).step(what)?;
        if !p.termios.is_empty() {
            fdio::tcsets(slave.as_fd(), &p.termios).step(what)?;
        }
        if !p.winsize.is_empty() {
            fdio::set_winsize(&slave, &p.winsize).step(what)?;
        }
        // Its node as grantpt (or the program) left it, not the
        // restorer's.
        if p.slave_mode != 0 {
            fdio::set_owner_and_mode(&slave, p.slave_uid, p.slave_gid, p.slave_mode).step(what)?;
        }
        let q = queued(p);
        ptyq::put(&m, &slave, &q).step(|| {
            format!(
                "cannot put back the bytes queued in pseudo-terminal {}",
                p.index
            )
        })?;
        if p.packet {
            ptyq::set_packet_mode(&m, true).step(what)?;
            put_status(&slave, p.index, p.packet_status, Some(&q)).step(what)?;
        }
        if p.locked {
            fdio::set_pty_locked(&m, true).step(what)?;
        }
        r.stash.get::<Held>().0.insert(o.id, m);
    }
    Ok(())
}

/// Slave fd `f` of pty `index` of a pair whose master every process
/// closed: the kernel hung the slave up (reads end, writes fail; it is
/// nobody's controlling terminal any more) and removed its node
/// ("/dev/pts/N (deleted)"), so nothing outside the tree holds the master
/// either. Saved as a pty of the instance at /dev/pts (its object id its
/// index), with its node's mode and owner; None for another instance
/// (led outside, as before) or a slave whose node is still there.
fn hung_up(cx: &mut FdScan<'_>, f: &OpenFd<'_>, index: u32) -> Option<Described> {
    if !f.link.ends_with(" (deleted)") {
        return None;
    }
    let md = f.md.as_ref()?;
    let at_dev_pts = proc::mount_points_of(f.pid, md.dev())
        .iter()
        .any(|m| m.as_os_str() == cr_sys::ns::DEV_PTS);
    if !at_dev_pts {
        return None;
    }
    let id = index as u64;
    if let Some(objs) = cx.objects.as_deref_mut() {
        if !objs.contains(cr_image::model::ObjectTag::Pty, id) {
            objs.insert(Object {
                id,
                kind: ObjectKind::Pty(Pty {
                    locked: false,
                    slave_mode: md.mode() & 0o7777,
                    slave_uid: md.uid(),
                    slave_gid: md.gid(),
                    hung_up: true,
                    ..blank(index)
                }),
            });
        }
    }
    Some(Ok(Some(FdKind::Pty {
        object: id,
        master: false,
    })))
}

/// Once every process's fds are open: the restorer closes the masters of
/// the pty pairs whose master every process had closed, so the kernel
/// hangs their slaves up and removes their nodes, as they were.
pub fn hang_up(r: &mut Restorer<'_>) {
    let ck = r.ck;
    let held = &mut r.stash.get::<Held>().0;
    for o in &ck.objects {
        if matches!(&o.kind, ObjectKind::Pty(p) if p.hung_up) {
            held.remove(&o.id);
        }
    }
}

/// The restorer's pty masters, by index.
#[derive(Default)]
struct Held(HashMap<u64, OwnedFd>);

/// The pty pair `index`, whose master process `at.0` holds as fd `at.1`:
/// terminal settings, window size, foreground group, packet mode, and the
/// bytes queued in both directions (taken out and put back at once: the
/// processes may run on).
fn pty_state(at: FdOf, index: u32) -> Result<Pty, String> {
    let err = |e: cr_sys::SysError| {
        format!(
            "pseudo-terminal {index}, whose state cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    };
    let m = fdio::steal_fd(at.0, at.1).map_err(err)?;
    let mut p = blank(index);
    if fdio::pty_locked(&m).map_err(err)? {
        return Ok(p);
    }
    let slave = fdio::pty_peer(&m, libc::O_RDWR | libc::O_NONBLOCK).map_err(err)?;
    p.locked = false;
    // Read on the master: on a slave, TIOCGPGRP answers only the
    // terminal's own session (ENOTTY to us).
    p.fg_pgrp = fdio::foreground(&m).unwrap_or(0).max(0) as u32;
    p.termios = fdio::tcgets(&slave).map_err(err)?;
    p.winsize = fdio::get_winsize(&slave).unwrap_or_default();
    let node = slave
        .try_clone()
        .and_then(|f| std::fs::File::from(f).metadata())
        .map_err(|e| format!("pseudo-terminal {index}, whose slave cannot be read: {e}"))?;
    p.slave_mode = node.mode() & 0o7777;
    (p.slave_uid, p.slave_gid) = (node.uid(), node.gid());
    p.packet = ptyq::packet_mode(&m).map_err(err)?;
    if !ptyq::may_put_back(&slave) {
        // Taken out, they could not be put back: left alone, unsaved.
        warn!(
            pty = index,
            "the bytes queued in the pseudo-terminal and its packet-mode status are not saved (putting them back needs CAP_SYS_ADMIN)"
        );
        return Ok(p);
    }
    // The queues are taken and put back with packet mode off: our termios
    // changes would set status bits (see `cr_sys::ptyq`).
    if p.packet {
        p.packet_status = ptyq::take_status(&m).map_err(err)?;
        ptyq::set_packet_mode(&m, false).map_err(err)?;
    }
    let moved = ptyq::take(&m, &slave).and_then(|q| ptyq::put(&m, &slave, &q).map(|()| q));
    if p.packet {
        ptyq::set_packet_mode(&m, true).map_err(err)?;
        put_status(&slave, index, p.packet_status, moved.as_ref().ok()).map_err(err)?;
    }
    let q = moved.map_err(|e| {
        format!(
            "pseudo-terminal {index}, whose queued bytes cannot be put back: {}",
            cr_sys::error::one_line(&e)
        )
    })?;
    p.input_lines = q.lines;
    p.input = q.input;
    p.output = q.output;
    Ok(p)
}

/// Pty `index` of /dev/pts as far as nothing is known of it: locked, no
/// settings, nothing queued.
fn blank(index: u32) -> Pty {
    Pty {
        index,
        fg_pgrp: 0,
        termios: Vec::new(),
        winsize: Vec::new(),
        locked: true,
        devpts: String::new(),
        input_lines: Vec::new(),
        input: Vec::new(),
        output: Vec::new(),
        packet: false,
        packet_status: 0,
        slave_mode: 0,
        slave_uid: 0,
        slave_gid: 0,
        hung_up: false,
    }
}

/// Make packet-mode status byte `status` of pty `index` pending again
/// (its master in packet mode, `q` put back); the bits the kernel offers no
/// way to make again with those queues are named in a warning.
fn put_status(
    slave: &OwnedFd,
    index: u32,
    status: u8,
    q: Option<&Queued>,
) -> Result<(), cr_sys::SysError> {
    if status == 0 {
        return Ok(());
    }
    let lost = ptyq::put_status(slave, status, q)?;
    if !lost.is_empty() {
        warn!(
            pty = index,
            status,
            ?lost,
            "bits of the pseudo-terminal's packet-mode status byte cannot be made again with its queues as they are"
        );
    }
    Ok(())
}

/// `--verify`: each pty master the live process `pid` holds is in packet
/// mode as its image says, and has a status byte pending if the image had
/// one (POLLPRI: which bits is not seen without taking the byte).
pub fn verify(c: &mut crate::verify::Compare<'_>, ck: &Checkpoint, image: &Process, pid: i32) {
    let mut seen = std::collections::HashSet::new();
    for f in &image.fds {
        let FdKind::Pty {
            object,
            master: true,
        } = f.kind
        else {
            continue;
        };
        if !seen.insert(object) {
            continue;
        }
        let Some(p) = ck.objects.iter().find_map(|o| match &o.kind {
            ObjectKind::Pty(p) if o.id == object => Some(p),
            _ => None,
        }) else {
            continue;
        };
        let Ok(m) = fdio::steal_fd(pid, f.fd) else {
            continue; // the fd itself is compared by kind "fds"
        };
        let what = format!("fd {} (master of pseudo-terminal {})", f.fd, p.index);
        let now = ptyq::packet_mode(&m).and_then(|on| Ok((on, on && ptyq::status_pending(&m)?)));
        match now {
            Ok((packet, pending)) => {
                c.same(&what, "packet mode", &p.packet, &packet);
                c.same(
                    &what,
                    "packet-mode status byte pending",
                    &(p.packet && p.packet_status != 0),
                    &pending,
                );
            }
            Err(e) => c.differ(
                &what,
                format!("unreadable: {}", cr_sys::error::one_line(&e)),
            ),
        }
    }
}

/// The bytes an image's pty holds.
fn queued(p: &Pty) -> Queued {
    Queued {
        lines: p.input_lines.clone(),
        input: p.input.clone(),
        output: p.output.clone(),
    }
}

fn pty_end(
    r: &mut Restorer<'_>,
    f: &Fd,
    index: u64,
    master: bool,
) -> Result<OwnedFd, RestoreError> {
    let accmode = f.flags as i32 & libc::O_ACCMODE;
    let what = || format!("cannot open {} again as fd {}", f.path, f.fd);
    let m = r.stash.get::<Held>().0.get(&index).ok_or_else(|| {
        RestoreError::Unsupported(format!(
            "fd {} refers to pseudo-terminal {index}, missing from the image",
            f.fd
        ))
    })?;
    if master {
        m.try_clone()
            .map_err(|e| RestoreError::Unsupported(format!("{}: {e}", what())))
    } else {
        // A slave opened by path has O_LARGEFILE (open(2) adds it on
        // 64-bit; the kernel's value, libc's is 0 there); TIOCGPTPEER
        // keeps what it is given, F_SETFL cannot set it.
        const O_LARGEFILE: i32 = 0o100000;
        fdio::pty_peer(m, accmode | (f.flags as i32 & O_LARGEFILE)).step(what)
    }
}

/// The controlling terminal `tty_nr` of process `pid` when it leads its
/// session (`session`) and the terminal is a console, virtual or serial
/// one it holds open (an fd of the device, opened again by path): what it
/// takes again at the restore ([`controlling_tty`]); else 0.
pub fn ctty_device(tty_nr: u64, session: i32, fds: &[Fd], pid: u32) -> u64 {
    let terminal = tty_nr != 0
        && is_tty_dev(tty_nr)
        && !is_dev_tty(tty_nr)
        && !proc::is_dev(tty_nr, 5, 2)
        && proc::pty_slave_index(tty_nr).is_none();
    let held = fds
        .iter()
        .any(|f| matches!(f.kind, FdKind::CharDevice { rdev, .. } if rdev == tty_nr));
    if terminal && session == pid as i32 && held {
        tty_nr
    } else {
        0
    }
}

/// A session leader whose controlling terminal was a pty of the image takes
/// it again (TIOCSCTTY on one of its slave fds, or, when it kept none (it
/// closed the slave once the terminal was its), on a slave opened for it
/// from the restorer's master and closed after) and gives it its
/// foreground process group.
pub fn controlling_tty(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    if p.ctty_device != 0 {
        return device_ctty(cx, p);
    }
    let Some(index) = p.ctty_pty else {
        return Ok(());
    };
    if cx.r.ids.sid_pgid(p).0 != cx.r.ids.inner(p.pid) {
        return Ok(());
    }
    let slave = p
        .fds
        .iter()
        .find(|f| matches!(f.kind, FdKind::Pty { object, master: false } if object == index));
    let what = || {
        format!(
            "cannot make /dev/pts/{index} the controlling terminal of process {}",
            p.pid
        )
    };
    let (fd, temporary) = match slave {
        Some(s) => (s.fd as u64, false),
        None => {
            let m = cx.r.stash.get::<Held>().0.get(&index).ok_or_else(|| {
                RestoreError::Unsupported(format!(
                    "the controlling terminal of process {} is pseudo-terminal {index}, missing from the image",
                    p.pid
                ))
            })?;
            let ours = fdio::pty_peer(m, libc::O_RDWR).step(what)?;
            let Some(pidfd) = cx.stub.grab_pidfd else {
                return Err(RestoreError::Unsupported(format!(
                    "{}: the restorer's pidfd is gone",
                    what()
                )));
            };
            let got = cx
                .stub
                .call(
                    "pidfd_getfd",
                    libc::SYS_pidfd_getfd,
                    [
                        pidfd,
                        std::os::fd::AsRawFd::as_raw_fd(&ours) as u64,
                        0,
                        0,
                        0,
                        0,
                    ],
                )
                .step(what)?;
            (got, true)
        }
    };
    let made = set_ctty(cx, p, index, fd).step(what);
    if temporary {
        cx.stub
            .call("close", libc::SYS_close, [fd, 0, 0, 0, 0, 0])?;
    }
    made
}

/// A session leader whose controlling terminal was a console, virtual or
/// serial terminal it holds (`Process::ctty_device`) takes it again:
/// TIOCSCTTY on its fd of that device, opened again by path.
fn device_ctty(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    let dev = p.ctty_device;
    let what = || {
        format!(
            "cannot make the terminal {}:{} the controlling terminal of process {}",
            major(dev),
            proc::dev_minor(dev),
            p.pid
        )
    };
    if cx.r.ids.sid_pgid(p).0 != cx.r.ids.inner(p.pid) {
        return Ok(());
    }
    let fd = p
        .fds
        .iter()
        .find(|f| matches!(f.kind, FdKind::CharDevice { rdev, .. } if rdev == dev))
        .ok_or_else(|| {
            RestoreError::Unsupported(format!("{}: no fd of it in the image", what()))
        })?;
    cx.stub
        .call(
            "ioctl(TIOCSCTTY)",
            libc::SYS_ioctl,
            [fd.fd as u64, libc::TIOCSCTTY, 0, 0, 0, 0],
        )
        .step(what)?;
    Ok(())
}

/// TIOCSCTTY on the stub's slave fd `fd` of pty object `index`, then its
/// foreground group (TIOCSPGRP; a failure there is only warned about).
fn set_ctty(
    cx: &mut Rebuild<'_, '_, '_>,
    p: &Process,
    index: u64,
    fd: u64,
) -> cr_sys::error::Result<()> {
    cx.stub.call(
        "ioctl(TIOCSCTTY)",
        libc::SYS_ioctl,
        [fd, libc::TIOCSCTTY, 0, 0, 0, 0],
    )?;
    let fg =
        cx.r.ck
            .objects
            .iter()
            .find_map(|o| match &o.kind {
                ObjectKind::Pty(t) if o.id == index => Some(t.fg_pgrp),
                _ => None,
            })
            .unwrap_or(0);
    if fg != 0 {
        let pg = cx.r.ids.inner(fg);
        let addr = cx.stub.put(&pg.to_le_bytes())?;
        if let Err(e) = cx.stub.call(
            "ioctl(TIOCSPGRP)",
            libc::SYS_ioctl,
            [fd, libc::TIOCSPGRP, addr, 0, 0, 0],
        ) {
            warn!(pid = p.pid, pgrp = pg, error = %cr_sys::error::one_line(&e), "foreground group of the terminal not restored");
        }
    }
    Ok(())
}

/// Fd `fd` of `p` is a /dev/tty opened again only at the end.
pub fn deferred(p: &Process, fd: i32) -> bool {
    p.fd(fd).is_some_and(|f| {
        f.shared.is_none() && matches!(f.kind, FdKind::CharDevice { rdev, .. } if is_dev_tty(rdev))
    })
}

/// The /dev/tty fds, opened again now that the process's session has its
/// controlling terminal back (and the fds that share them).
pub fn reopen_dev_tty(cx: &mut Rebuild<'_, '_, '_>, p: &Process) -> Result<(), RestoreError> {
    for f in p.fds.iter().filter(|f| deferred(p, f.fd)) {
        files::reopen(cx, f, libc::O_NOCTTY)?;
        crate::kinds::fds::share_within(cx, p, f.fd)?;
    }
    Ok(())
}

/// Make the restored job (its process group) the foreground job of our
/// terminal, as the shell had made it before the checkpoint.
pub fn take_terminal(root: i32) {
    let Some(tty) = [0, 1, 2]
        .into_iter()
        .filter_map(|fd| fdio::dup_own(fd).ok())
        .find(|fd| fdio::is_tty(fd.as_fd()))
    else {
        warn!("--shell-job: cr_restart has no terminal to hand over");
        return;
    };
    let pgrp = proc::stat(root).map(|s| s.pgrp).unwrap_or(root);
    if let Err(e) = fdio::set_foreground(tty.as_fd(), pgrp) {
        warn!(error = %cr_sys::error::one_line(&e), "--shell-job: cannot make the job the foreground job");
    }
}
