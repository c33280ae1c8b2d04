//! Kind "mqueue": POSIX message queues (mq_open) the processes hold, with
//! their name (or none, when unlinked since), mode, owner, sizes and the
//! messages queued at checkpoint time.
//!
//! Capture: a queue is opened a second time through /proc/PID/fd/N
//! ([`cr_sys::mqueue`]). The kernel cannot show a message without taking
//! it, so while the tree is frozen every message is taken out and put back
//! at once, in the order they came out: the queue ends as it was, and a
//! checkpoint that continues loses nothing. (A process outside the tree
//! sending or receiving on the same queue at that moment would see the
//! queue change; its messages are saved too.) A queue with a notification
//! registered (mq_notify) is refused: the kernel does not show the
//! sigevent it would deliver.
//!
//! Restore: in the IPC namespace of the process being rebuilt, a queue
//! whose name still exists is opened as it is (like a file on disk, it
//! outlived the processes: a restore on the same node finds it with its
//! messages); one that does not is made with its mode, owner and sizes and
//! refilled. An unlinked queue is made under a temporary name, unlinked at
//! once, and refilled. Each fd is a description of its own (the saved
//! access mode and O_NONBLOCK).

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::{Described, FileKind, Opened};
use crate::restore::Rebuild;
use cr_image::model::objects::Mqueue;
use cr_image::model::{Fd, FdKind, Object, ObjectKind, ObjectTag, Process};
use cr_sys::mqueue::{Message, Queue};
use cr_sys::{ns, proc};
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;

pub struct Mqueues;

/// The restorer's queues, by object.
#[derive(Default)]
struct Made(HashMap<u64, Queue>);

impl FileKind for Mqueues {
    fn name(&self) -> &'static str {
        "mqueue"
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        let proc::FDTarget::Path(_) = f.target else {
            return None;
        };
        // An mqueue file: a regular file of an anonymous device; only then
        // is its file system asked.
        let md = f.md.as_ref()?;
        if !md.is_file() || libc::major(md.dev()) != 0 || !Queue::is_queue(f.pid, f.fd) {
            return None;
        }
        Some(describe(cx, f, md.ino()))
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let FdKind::Mqueue { object } = f.kind else {
            return None;
        };
        Some(open(cx, f, object))
    }
}

fn describe(cx: &mut FdScan<'_>, f: &OpenFd<'_>, ino: u64) -> Described {
    let (name, unlinked) = match f.link.strip_suffix(" (deleted)") {
        Some(n) => (n.to_string(), true),
        None => (f.link.clone(), false),
    };
    let err = |e: cr_sys::SysError| {
        format!(
            "the message queue {name}, which cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    };
    let q = Queue::of_fd(f.pid, f.fd).map_err(err)?;
    let a = q.attributes().map_err(err)?;
    if a.notify_pid != 0 {
        return Err(format!(
            "the message queue {name} with a notification registered by process {} (mq_notify; its sigevent cannot be read back): not supported",
            a.notify_pid
        ));
    }
    if let Some(objs) = cx.objects.as_deref_mut() {
        if !objs.contains(ObjectTag::Mqueue, ino) {
            let (uid, gid, mode) = q.stat().map_err(err)?;
            let messages = q.drain(a.msgsize).map_err(err)?;
            if let Err(e) = q.send_all(&messages) {
                // Only a sender outside the tree can have filled it meanwhile.
                tracing::error!(queue = %name, "messages taken out could not all be put back: {}", cr_sys::error::one_line(&e));
                return Err(err(e));
            }
            tracing::debug!(queue = %name, messages = messages.len(), "message queue read");
            objs.insert(Object {
                id: ino,
                kind: ObjectKind::Mqueue(Mqueue {
                    name,
                    unlinked,
                    mode,
                    uid,
                    gid,
                    maxmsg: a.maxmsg,
                    msgsize: a.msgsize,
                    messages: messages.into_iter().map(|m| (m.priority, m.data)).collect(),
                }),
            });
        }
    }
    Ok(Some(FdKind::Mqueue { object: ino }))
}

fn open(cx: &mut Rebuild<'_, '_, '_>, f: &Fd, object: u64) -> Result<Opened, RestoreError> {
    if !cx.r.stash.get::<Made>().0.contains_key(&object) {
        let Some(ObjectKind::Mqueue(m)) =
            cx.r.ck.object(ObjectTag::Mqueue, object).map(|o| &o.kind)
        else {
            return Err(RestoreError::Unsupported(format!(
                "fd {} refers to message queue {object}, missing from the image",
                f.fd
            )));
        };
        // The process's own IPC namespace: its queues are there.
        let pid = cx.stub.pid();
        let ipc = match ns::differs(pid, "ipc")? {
            true => Some(ns::open(pid, "ipc")?),
            false => None,
        };
        let q = ns::in_ipc_ns(ipc.as_ref(), || make(m, object))
            .step(|| format!("cannot make message queue {} again", m.name))?;
        cx.r.stash.get::<Made>().0.insert(object, q);
    }
    let q = &cx.r.stash.get::<Made>().0[&object];
    q.reopen(f.flags as i32)
        .map(Opened::Ours)
        .step(|| format!("cannot open {} again as fd {}", f.path, f.fd))
}

/// Open queue `m` as it is when its name still exists, else make it
/// again, filled. In the calling thread's IPC namespace.
fn make(m: &Mqueue, object: u64) -> Result<Queue, cr_sys::SysError> {
    let name = match m.unlinked {
        true => format!("/cr-restore-{}-{object}", std::process::id()),
        false => m.name.clone(),
    };
    let (q, made) = Queue::create(&name, m.mode, m.maxmsg, m.msgsize, m.unlinked)?;
    if m.unlinked {
        Queue::unlink(&name)?;
    }
    if made {
        let (uid, gid, _) = q.stat()?;
        if (uid, gid) != (m.uid, m.gid) {
            q.chown(m.uid, m.gid)?;
        }
        let messages: Vec<Message> = m
            .messages
            .iter()
            .map(|(priority, data)| Message {
                priority: *priority,
                data: data.clone(),
            })
            .collect();
        q.send_all(&messages)?;
    }
    tracing::debug!(queue = %m.name, made, messages = m.messages.len(), "message queue opened");
    Ok(q)
}
