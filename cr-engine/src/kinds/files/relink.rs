//! Regular files open by a name that was removed while the file kept other
//! names (a hard link made before the removal): /proc shows the fd as
//! "PATH (deleted)", yet the file's link count is not 0.
//!
//! Neither the removed name nor a copy of the content will do: the file is
//! shared with its other names, and the kernel tells no one what they are.
//! So the checkpoint makes one more hard link to it, through
//! /proc/PID/fd/N, in the nearest directory of the removed name that still
//! exists (it must be on the same mount: links never cross one), named
//! `.cr-relink.DEV.INO`, and the image records that name (CRIU calls this a
//! "link remap"). A later checkpoint of the same file reuses the link.
//!
//! A restore makes the removed name again while it rebuilds the tree (a
//! link of that one, with any missing directories), opens the file (fds,
//! mappings) through it, and removes what it made before `--verify`
//! looks, so /proc shows "PATH (deleted)" as before. Once
//! the restored tree is released the checkpoint's link is removed too: the
//! file has its link count back, and the image cannot be restored again
//! (said by name if tried). A restore that fails keeps it.

use super::MadeDirs;
use crate::error::RestoreError;
use crate::restore::Restorer;
use cr_sys::fdio;
use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use tracing::{debug, warn};

const SUFFIX: &str = " (deleted)";

/// Whether an fd that /proc shows as `shown`, of a file with metadata
/// `md`, is one of these: removed under that name, linked under others.
pub fn wanted(shown: &str, md: &std::fs::Metadata) -> bool {
    md.is_file() && md.nlink() > 0 && super::ghost::removed(shown).is_some()
}

/// Make (or find, from an earlier checkpoint) the link to the file that
/// `open` (/proc/PID/fd/N) leads to, shown as `shown`; its path.
pub fn make(open: &str, shown: &str, md: &std::fs::Metadata) -> Result<String, String> {
    let removed = Path::new(shown.strip_suffix(SUFFIX).unwrap_or(shown));
    let what = format!("{shown} (a file removed under that name that keeps other names)");
    let dir = removed
        .ancestors()
        .skip(1)
        .find(|d| std::fs::symlink_metadata(d).is_ok_and(|m| m.is_dir()))
        .ok_or_else(|| format!("{what}, no directory of whose path is left"))?;
    let on = std::fs::metadata(dir).map_err(|e| format!("{what}: {}: {e}", dir.display()))?;
    if on.dev() != md.dev() {
        return Err(format!(
            "{what}, whose nearest directory left, {}, is on another filesystem: no link to it can be made there",
            dir.display()
        ));
    }
    let link = dir.join(format!(".cr-relink.{:x}.{}", md.dev(), md.ino()));
    let shown_link = link.to_string_lossy().into_owned();
    match std::fs::symlink_metadata(&link) {
        Ok(m) if m.dev() == md.dev() && m.ino() == md.ino() => return Ok(shown_link),
        Ok(_) => return Err(format!("{what}: {shown_link} is taken by another file")),
        Err(_) => {}
    }
    fdio::link_following(open, &shown_link).map_err(|e| {
        format!(
            "{what}: cannot link it as {shown_link}: {}",
            cr_sys::error::one_line(&e)
        )
    })?;
    debug!(
        file = shown,
        link = shown_link,
        "file linked for its removed name"
    );
    Ok(shown_link)
}

/// A removed name made again for the restore, removed (with the
/// directories made for it) when dropped.
struct Named {
    made: Option<PathBuf>,
    _dirs: MadeDirs,
}

impl Drop for Named {
    fn drop(&mut self) {
        if let Some(p) = &self.made {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// What this restore made: the checkpoint's links it opened files
/// through, and the removed names made again (by the name /proc shows,
/// with the path to open).
#[derive(Default)]
struct Made {
    links: Vec<String>,
    names: HashMap<String, (String, Named)>,
}

/// The path through which to open again (an fd or a mapping) the file
/// shown as `shown`, linked by the checkpoint as `link`: its removed name,
/// made again until the tree is rebuilt ([`end_names`]; else the link
/// itself when that name is taken now). The link is removed when the tree
/// is released ([`release`]).
pub fn open_path(r: &mut Restorer<'_>, shown: &str, link: &str) -> Result<String, RestoreError> {
    let made = r.stash.get::<Made>();
    if let Some((path, _)) = made.names.get(shown) {
        return Ok(path.clone());
    }
    if std::fs::symlink_metadata(link).is_err() {
        return Err(RestoreError::Unsupported(format!(
            "{link}, the link the checkpoint made to {shown} (removed under that name while it kept others), is gone: a restore of the image removes it, so the image was restored already or the link was removed"
        )));
    }
    made.links.push(link.to_string());
    let removed = Path::new(shown.strip_suffix(SUFFIX).unwrap_or(shown));
    let dirs = match removed.parent() {
        Some(d) => MadeDirs::make(d),
        None => MadeDirs(Vec::new()),
    };
    let (path, made_name) = if std::fs::hard_link(link, removed).is_ok() {
        (
            removed.to_string_lossy().into_owned(),
            Some(removed.to_path_buf()),
        )
    } else {
        warn!(
            file = shown,
            link, "the removed name cannot be made again: opened by the checkpoint's link"
        );
        (link.to_string(), None)
    };
    let named = Named {
        made: made_name,
        _dirs: dirs,
    };
    made.names.insert(shown.to_string(), (path.clone(), named));
    Ok(path)
}

/// Remove the names made again: every process of the tree holds its files
/// (before `--verify` looks: /proc shows "NAME (deleted)" again).
pub fn end_names(r: &mut Restorer<'_>) {
    r.stash.get::<Made>().names.clear();
}

/// Remove the checkpoint's links of the files opened again: the tree is
/// released.
pub fn release(r: &mut Restorer<'_>) {
    let Some(Made { mut links, .. }) = r.stash.take::<Made>() else {
        return;
    };
    links.sort();
    links.dedup();
    for l in links {
        if let Err(e) = std::fs::remove_file(&l) {
            warn!(link = l, error = %e, "cannot remove the checkpoint's link");
        }
    }
}
