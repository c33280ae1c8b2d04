//! Kind "bpf": BPF maps the processes hold (anon_inode:bpf-map), with
//! their attributes and every entry.
//!
//! Capture: the fd is taken with pidfd_getfd ([`cr_sys::fdio::steal_fd`]);
//! BPF_OBJ_GET_INFO_BY_FD gives the map's type, sizes, flags, name and
//! id, fdinfo whether it is frozen; its entries are read key after key
//! ([`cr_sys::bpf`]). A map is an object of the image, saved once by its
//! id: every fd of it (dup'ed, or another description of the same map,
//! as BPF_MAP_GET_FD_BY_ID or a pinned path gives) shares the map made
//! again. Its entries are stored inline in the image's metadata, at most
//! [`BPF_MAP_MAX_BYTES`] of keys and values (a bigger map is refused by
//! name); an array's all-zero values are left out.
//!
//! Supported: hash, array, per-CPU hash and array (every possible CPU's
//! value; a restore on a host with another number of possible CPUs is
//! refused), LRU hash (the LRU order is not kept: a full LRU map may drop
//! entries when refilled), LRU per-CPU hash and LPM trie maps, with any
//! map flags but BPF_F_MMAPABLE (its mappings are not saved). Refused by
//! name: other map types (program arrays, maps of maps, ring buffers,
//! socket maps, struct_ops...), maps with BTF, maps offloaded to a
//! device, and BPF programs, links, BTF objects and tokens.
//!
//! Restore: each map is made in the restorer with its attributes and name
//! (BPF_F_NUMA_NODE on node 0: the node cannot be read back), filled,
//! frozen if it was; then each fd is a description of its own of the map
//! (BPF_MAP_GET_FD_BY_ID) with the fd's access mode. BPF_F_RDONLY and
//! BPF_F_WRONLY are a description's, not the map's (the kernel keeps them
//! out of map_flags): the map is made and filled read-write, and a
//! read-only fd is opened read-only afterwards, so it can be filled
//! first. Entries written by BPF programs after the checkpoint are not
//! the image's concern: no program is attached to a restored map.

#[cfg(test)]
mod tests;

use crate::error::{RestoreError, StepContext};
use crate::kinds::fds::{FdScan, OpenFd};
use crate::kinds::{Described, FileKind, Opened};
use crate::restore::{Rebuild, Restorer};
use cr_image::model::objects::{BpfMap, BPF_MAP_MAX_BYTES};
use cr_image::model::{Fd, FdKind, Object, ObjectKind, ObjectTag, Process};
use cr_sys::bpf::{self, map_flags, map_type, Map, MapInfo};
use cr_sys::proc::FDTarget;
use std::collections::HashMap;

pub struct Bpf;

/// The map types whose whole state is their entries.
const SUPPORTED: &[u32] = &[
    map_type::HASH,
    map_type::ARRAY,
    map_type::PERCPU_HASH,
    map_type::PERCPU_ARRAY,
    map_type::LRU_HASH,
    map_type::LRU_PERCPU_HASH,
    map_type::LPM_TRIE,
];

/// The restorer's maps, by object (the map's id at checkpoint time).
#[derive(Default)]
struct Made(HashMap<u64, Map>);

impl FileKind for Bpf {
    fn name(&self) -> &'static str {
        "bpf"
    }

    fn describe(&self, cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Option<Described> {
        let FDTarget::AnonInode(kind) = f.target else {
            return None;
        };
        let what = match kind.as_str() {
            "bpf-map" => return Some(describe(cx, f)),
            "bpf-prog" => "a BPF program",
            "bpf-link" => "a BPF link",
            "btf" => "a BPF type format (BTF) object",
            "bpf-token" => "a BPF token",
            "bpf_iter" | "[bpf_iter]" => "a BPF iterator",
            _ => return None,
        };
        Some(Err(format!(
            "{what} (anon_inode:{kind}): only BPF maps are supported"
        )))
    }

    fn open(
        &self,
        cx: &mut Rebuild<'_, '_, '_>,
        _p: &Process,
        f: &Fd,
    ) -> Option<Result<Opened, RestoreError>> {
        let FdKind::BpfMap { object } = f.kind else {
            return None;
        };
        Some(open(cx.r, f, object))
    }

    /// The restorer's own fds of the maps are closed: the processes hold
    /// theirs.
    fn release(&self, r: &mut Restorer<'_>) -> Result<(), RestoreError> {
        r.stash.take::<Made>();
        Ok(())
    }
}

/// How errors name a map.
fn label(name: &str, id: u32) -> String {
    if name.is_empty() {
        format!("BPF map {id}")
    } else {
        format!("BPF map {name:?} (id {id})")
    }
}

fn describe(cx: &mut FdScan<'_>, f: &OpenFd<'_>) -> Described {
    let fi = f
        .info
        .bpf_map()
        .ok_or("a BPF map (anon_inode:bpf-map) whose fdinfo cannot be read")?;
    let type_name = bpf::type_name(fi.map_type);
    if !SUPPORTED.contains(&fi.map_type) {
        return Err(format!(
            "a BPF map of type {type_name} (anon_inode:bpf-map, map id {}): only hash, array, percpu_hash, percpu_array, lru_hash, lru_percpu_hash and lpm_trie maps are supported",
            fi.map_id
        ));
    }
    let at = format!("fd {} of process {}", f.fd, f.pid);
    let fd = cr_sys::fdio::steal_fd(f.pid, f.fd).map_err(|e| {
        format!(
            "a BPF map that cannot be taken: {}",
            cr_sys::error::one_line(&e)
        )
    })?;
    let map = Map::of_fd(fd, format!("BPF map {} ({at})", fi.map_id));
    let err = |e: cr_sys::SysError| {
        format!(
            "a BPF map that cannot be read: {}",
            cr_sys::error::one_line(&e)
        )
    };
    let info = map.info().map_err(err)?;
    let who = label(&info.name, info.id);
    if info.ifindex != 0 {
        return Err(format!(
            "{who} offloaded to network device {} (not supported)",
            info.ifindex
        ));
    }
    if info.btf_id != 0 || info.btf_vmlinux_value_type_id != 0 {
        return Err(format!(
            "{who} of type {type_name} with BTF type information (BTF object {}; not supported)",
            info.btf_id
        ));
    }
    if info.map_flags & map_flags::MMAPABLE != 0 {
        return Err(format!(
            "{who} created mappable (BPF_F_MMAPABLE; its mappings are not saved): not supported"
        ));
    }
    if let Some(objs) = cx.objects.as_deref_mut() {
        if !objs.contains(ObjectTag::BpfMap, info.id as u64) {
            let cpus = match bpf::per_cpu(info.map_type) {
                true => bpf::possible_cpus().map_err(err)?,
                false => 0,
            };
            let value_len = bpf::value_len(info.map_type, info.value_size, cpus);
            // A new array holds zeroes: only the other values are saved.
            let skip_zero = matches!(info.map_type, map_type::ARRAY | map_type::PERCPU_ARRAY);
            let entries = map
                .entries(&info, value_len, skip_zero, BPF_MAP_MAX_BYTES)
                .map_err(err)?
                .ok_or_else(|| {
                    format!(
                        "{who} of type {type_name} holding more than {} MiB of keys and values (saved inline in the image: not supported)",
                        BPF_MAP_MAX_BYTES >> 20
                    )
                })?;
            tracing::debug!(map = %who, entries = entries.len(), frozen = fi.frozen, "BPF map read");
            objs.insert(Object {
                id: info.id as u64,
                kind: ObjectKind::BpfMap(BpfMap {
                    map_type: info.map_type,
                    key_size: info.key_size,
                    value_size: info.value_size,
                    max_entries: info.max_entries,
                    map_flags: info.map_flags,
                    name: info.name.clone(),
                    map_extra: info.map_extra,
                    frozen: fi.frozen,
                    cpus,
                    entries,
                }),
            });
        }
    }
    Ok(Some(FdKind::BpfMap {
        object: info.id as u64,
    }))
}

fn open(r: &mut Restorer<'_>, f: &Fd, object: u64) -> Result<Opened, RestoreError> {
    if !r.stash.get::<Made>().0.contains_key(&object) {
        let Some(ObjectKind::BpfMap(m)) = r.ck.object(ObjectTag::BpfMap, object).map(|o| &o.kind)
        else {
            return Err(RestoreError::Unsupported(format!(
                "fd {} refers to BPF map {object}, missing from the image",
                f.fd
            )));
        };
        let map = make(m, object)?;
        r.stash.get::<Made>().0.insert(object, map);
    }
    let map = &r.stash.get::<Made>().0[&object];
    map.reopen(f.flags as i32)
        .map(Opened::Ours)
        .step(|| format!("cannot open BPF map {object} again as fd {}", f.fd))
}

/// Make map `m` again, filled, frozen if it was.
fn make(m: &BpfMap, object: u64) -> Result<Map, RestoreError> {
    let who = label(&m.name, object as u32);
    if m.cpus != 0 {
        let here = bpf::possible_cpus().step(|| format!("cannot make {who} again"))?;
        if here != m.cpus {
            return Err(RestoreError::Unsupported(format!(
                "{who} is a per-CPU map saved with {} possible CPUs; this host has {here}",
                m.cpus
            )));
        }
    }
    let info = MapInfo {
        map_type: m.map_type,
        key_size: m.key_size,
        value_size: m.value_size,
        max_entries: m.max_entries,
        map_flags: m.map_flags,
        name: m.name.clone(),
        map_extra: m.map_extra,
        ..Default::default()
    };
    let what = || format!("cannot make {who} again");
    let map = Map::create(&info, 0, who.clone()).step(what)?;
    for (k, v) in &m.entries {
        map.update(k, v).step(what)?;
    }
    if m.frozen {
        map.freeze().step(what)?;
    }
    tracing::debug!(map = %who, entries = m.entries.len(), frozen = m.frozen, "BPF map made again");
    Ok(map)
}
