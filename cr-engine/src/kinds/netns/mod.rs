//! Kind "netns": the network namespace of a tree that has one of its own
//! (`unshare -n`, a sandbox), recorded by its devices.
//!
//! Every process of the tree must share the root's namespace. A namespace
//! holding the loopback device alone (the usual sandbox) is made again by
//! `cr_restart`, which unshares a new one and brings `lo` up as it was
//! before anything of the image is made, so the tree's sockets are born
//! there ([`restorable`]). Devices other than loopback (veth pairs, ...)
//! cannot be made from user space without their peers: such a tree is
//! restored into the restorer's namespace (or `cr_restart --netns`), as
//! before.
//!
//! `--verify` compares the devices of a namespace made this way.

use crate::error::CheckpointError;
use cr_image::model::{Checkpoint, NetDevice, NetNs, Process};
use cr_sys::ns;
use tracing::debug;

/// The devices of the frozen tree's network namespace, when it has one of
/// its own.
pub fn capture(images: &[Process]) -> Result<Option<NetNs>, CheckpointError> {
    let Some(root) = images.first().map(|p| p.pid as i32) else {
        return Ok(None);
    };
    let sys = |e| CheckpointError::from_sys(root, e);
    if !ns::differs(root, "net").map_err(sys)? {
        return Ok(None);
    }
    crate::kinds::tree::same_namespace(images, "net", "a network")?;
    let devices = devices(root).map_err(sys)?;
    debug!(root, ?devices, "network namespace saved");
    Ok(Some(NetNs { devices }))
}

fn devices(pid: i32) -> cr_sys::error::Result<Vec<NetDevice>> {
    Ok(ns::net_devices(pid)?
        .into_iter()
        .map(|(name, up)| NetDevice { name, up })
        .collect())
}

/// The namespace a restore of `ck` makes again: one with the loopback
/// device alone.
pub fn restorable(ck: &Checkpoint) -> Option<&NetNs> {
    ck.netns.as_ref().filter(|n| n.loopback_only())
}

/// Make the calling thread's network namespace a new one like `n`: the
/// loopback device, up if it was. Threads and processes it starts later
/// are born there.
pub fn make(n: &NetNs) -> cr_sys::error::Result<()> {
    ns::unshare_net()?;
    if n.loopback_up() {
        ns::loopback_up()?;
    }
    debug!("network namespace made");
    Ok(())
}

/// `--verify`: a namespace this restore made has the image's devices now
/// (a difference named, or None).
pub fn verify(ck: &Checkpoint, pid: i32) -> Option<String> {
    let saved = restorable(ck)?;
    match devices(pid) {
        Ok(now) if now == saved.devices => None,
        Ok(now) => Some(format!(
            "network namespace: devices {:?} in the image, {now:?} now",
            saved.devices
        )),
        Err(e) => Some(format!(
            "network namespace: {}",
            cr_sys::error::one_line(&e)
        )),
    }
}
