//! BPF maps (bpf(2)): reading a map another process holds (its fd taken
//! with pidfd_getfd) and making one again.
//!
//! Thin wrappers of the `bpf` system call for the commands a checkpoint
//! and a restore of a map need: BPF_OBJ_GET_INFO_BY_FD (its attributes),
//! BPF_MAP_GET_NEXT_KEY and BPF_MAP_LOOKUP_ELEM (every entry),
//! BPF_MAP_CREATE, BPF_MAP_UPDATE_ELEM, BPF_MAP_FREEZE and
//! BPF_MAP_GET_FD_BY_ID (another description of a map, with an access
//! mode). The attribute layouts are those of `include/uapi/linux/bpf.h`
//! (checked against the kernel headers: `union bpf_attr` members and
//! `struct bpf_map_info`, 88 bytes); the kernel takes a shorter attribute
//! and zeroes the rest.

use crate::error::{Errno, Result, SysError};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// bpf(2) commands.
const BPF_MAP_CREATE: i64 = 0;
const BPF_MAP_LOOKUP_ELEM: i64 = 1;
const BPF_MAP_UPDATE_ELEM: i64 = 2;
const BPF_MAP_GET_NEXT_KEY: i64 = 4;
const BPF_MAP_GET_FD_BY_ID: i64 = 14;
const BPF_OBJ_GET_INFO_BY_FD: i64 = 15;
const BPF_MAP_FREEZE: i64 = 22;

/// BPF_OBJ_NAME_LEN.
pub const NAME_LEN: usize = 16;

/// Map types (enum bpf_map_type).
pub mod map_type {
    pub const HASH: u32 = 1;
    pub const ARRAY: u32 = 2;
    pub const PROG_ARRAY: u32 = 3;
    pub const PERF_EVENT_ARRAY: u32 = 4;
    pub const PERCPU_HASH: u32 = 5;
    pub const PERCPU_ARRAY: u32 = 6;
    pub const LRU_HASH: u32 = 9;
    pub const LRU_PERCPU_HASH: u32 = 10;
    pub const LPM_TRIE: u32 = 11;
    pub const RINGBUF: u32 = 27;
}

/// Map flags (BPF_F_*) that matter here.
pub mod map_flags {
    pub const NO_PREALLOC: u32 = 1 << 0;
    pub const NUMA_NODE: u32 = 1 << 2;
    /// Of an fd: syscall side read-only / write-only (BPF_F_RDONLY,
    /// BPF_F_WRONLY); not kept in the map's flags.
    pub const RDONLY: u32 = 1 << 3;
    pub const WRONLY: u32 = 1 << 4;
    pub const MMAPABLE: u32 = 1 << 10;
}

/// The name of map type `t` (as bpftool says it), "type N" if unknown.
pub fn type_name(t: u32) -> String {
    const NAMES: &[&str] = &[
        "unspec",
        "hash",
        "array",
        "prog_array",
        "perf_event_array",
        "percpu_hash",
        "percpu_array",
        "stack_trace",
        "cgroup_array",
        "lru_hash",
        "lru_percpu_hash",
        "lpm_trie",
        "array_of_maps",
        "hash_of_maps",
        "devmap",
        "sockmap",
        "cpumap",
        "xskmap",
        "sockhash",
        "cgroup_storage",
        "reuseport_sockarray",
        "percpu_cgroup_storage",
        "queue",
        "stack",
        "sk_storage",
        "devmap_hash",
        "struct_ops",
        "ringbuf",
        "inode_storage",
        "task_storage",
        "bloom_filter",
        "user_ringbuf",
        "cgrp_storage",
        "arena",
    ];
    NAMES
        .get(t as usize)
        .map_or_else(|| format!("type {t}"), |n| n.to_string())
}

/// Whether values of map type `t` are one per possible CPU.
pub fn per_cpu(t: u32) -> bool {
    matches!(
        t,
        map_type::PERCPU_HASH | map_type::PERCPU_ARRAY | map_type::LRU_PERCPU_HASH
    )
}

/// struct bpf_map_info (uapi), 88 bytes.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
struct RawMapInfo {
    map_type: u32,
    id: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    name: [u8; NAME_LEN],
    ifindex: u32,
    btf_vmlinux_value_type_id: u32,
    netns_dev: u64,
    netns_ino: u64,
    btf_id: u32,
    btf_key_type_id: u32,
    btf_value_type_id: u32,
    btf_vmlinux_id: u32,
    map_extra: u64,
}

const _: () = assert!(std::mem::size_of::<RawMapInfo>() == 88);

/// A map's attributes, as BPF_OBJ_GET_INFO_BY_FD gives them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MapInfo {
    pub map_type: u32,
    pub id: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
    /// Up to [`NAME_LEN`] - 1 bytes.
    pub name: String,
    /// A device the map is offloaded to (0: none).
    pub ifindex: u32,
    /// BTF: the object and the key and value types (0: none).
    pub btf_id: u32,
    pub btf_key_type_id: u32,
    pub btf_value_type_id: u32,
    pub btf_vmlinux_value_type_id: u32,
    pub map_extra: u64,
}

/// BPF_OBJ_GET_INFO_BY_FD attributes.
#[repr(C, align(8))]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// BPF_MAP_*_ELEM, BPF_MAP_GET_NEXT_KEY and BPF_MAP_FREEZE attributes.
#[repr(C, align(8))]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    /// `value` or `next_key`.
    value: u64,
    flags: u64,
}

/// BPF_MAP_CREATE attributes, up to `map_extra` (72 bytes).
#[repr(C, align(8))]
#[derive(Default)]
struct CreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; NAME_LEN],
    map_ifindex: u32,
    btf_fd: u32,
    btf_key_type_id: u32,
    btf_value_type_id: u32,
    btf_vmlinux_value_type_id: u32,
    map_extra: u64,
}

const _: () = assert!(std::mem::size_of::<CreateAttr>() == 72);

/// BPF_*_GET_FD_BY_ID attributes.
#[repr(C)]
struct GetIdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// bpf(`cmd`, `attr`): the result, or errno.
fn bpf<T>(cmd: i64, attr: &mut T) -> std::result::Result<i64, Errno> {
    // SAFETY: `attr` is a live, exclusively borrowed #[repr(C)] attribute
    // block of the layout the kernel expects for `cmd`, and its size is
    // passed; any pointers inside it point at buffers the caller keeps
    // alive and sized as the command needs for the duration of the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            std::mem::size_of::<T>(),
        )
    };
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r)
    }
}

/// Wrap the new fd bpf(2) returned.
fn own(r: i64) -> OwnedFd {
    // SAFETY: the kernel just returned this fd to us; nobody else owns it.
    unsafe { OwnedFd::from_raw_fd(r as i32) }
}

/// The entries of a map: key and value bytes (a per-CPU map's value is
/// every possible CPU's, each rounded up to 8 bytes).
pub type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// A BPF map we hold an fd of, and how errors name it.
pub struct Map {
    fd: OwnedFd,
    what: String,
}

impl AsFd for Map {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Map {
    /// A map held by `fd`, named `what` in errors ("map 'counts' (fd 5 of
    /// process 12)").
    pub fn of_fd(fd: OwnedFd, what: impl Into<String>) -> Map {
        Map {
            fd,
            what: what.into(),
        }
    }

    fn err(&self, op: &'static str, source: Errno) -> SysError {
        SysError::Bpf {
            op,
            map: self.what.clone(),
            source,
        }
    }

    /// Its attributes (BPF_OBJ_GET_INFO_BY_FD).
    pub fn info(&self) -> Result<MapInfo> {
        let mut raw = RawMapInfo::default();
        let mut attr = InfoAttr {
            bpf_fd: self.fd.as_raw_fd() as u32,
            info_len: std::mem::size_of::<RawMapInfo>() as u32,
            info: &mut raw as *mut RawMapInfo as u64,
        };
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map_err(|e| self.err("OBJ_GET_INFO_BY_FD", e))?;
        let end = raw.name.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
        Ok(MapInfo {
            map_type: raw.map_type,
            id: raw.id,
            key_size: raw.key_size,
            value_size: raw.value_size,
            max_entries: raw.max_entries,
            map_flags: raw.map_flags,
            name: String::from_utf8_lossy(&raw.name[..end]).into_owned(),
            ifindex: raw.ifindex,
            btf_id: raw.btf_id,
            btf_key_type_id: raw.btf_key_type_id,
            btf_value_type_id: raw.btf_value_type_id,
            btf_vmlinux_value_type_id: raw.btf_vmlinux_value_type_id,
            map_extra: raw.map_extra,
        })
    }

    /// The key after `key` (the first with None); None at the end.
    pub fn next_key(&self, key: Option<&[u8]>, key_size: usize) -> Result<Option<Vec<u8>>> {
        let key = key.map_or(0, |k| k.as_ptr() as u64);
        self.elem_out(BPF_MAP_GET_NEXT_KEY, "MAP_GET_NEXT_KEY", key, key_size)
    }

    /// The value of `key` in a buffer of `value_len` bytes (None: no such
    /// key, deleted meanwhile).
    pub fn lookup(&self, key: &[u8], value_len: usize) -> Result<Option<Vec<u8>>> {
        self.elem_out(
            BPF_MAP_LOOKUP_ELEM,
            "MAP_LOOKUP_ELEM",
            key.as_ptr() as u64,
            value_len,
        )
    }

    /// An element command `cmd` on the key at `key` (0: none) that answers
    /// in a buffer of `len` bytes; None when the kernel says ENOENT.
    fn elem_out(
        &self,
        cmd: i64,
        name: &'static str,
        key: u64,
        len: usize,
    ) -> Result<Option<Vec<u8>>> {
        let mut out = vec![0u8; len];
        let mut attr = ElemAttr {
            map_fd: self.fd.as_raw_fd() as u32,
            _pad: 0,
            key,
            value: out.as_mut_ptr() as u64,
            flags: 0,
        };
        match bpf(cmd, &mut attr) {
            Ok(_) => Ok(Some(out)),
            Err(Errno(libc::ENOENT)) => Ok(None),
            Err(e) => Err(self.err(name, e)),
        }
    }

    /// Every entry, in the kernel's iteration order, values `value_len`
    /// bytes long; with `skip_zero` (an array: a new one is all zeroes)
    /// values all zero are left out. None once the keys and values read
    /// exceed `limit` bytes. The map is read key after key: a map changed
    /// meanwhile (by a BPF program) is refused when iteration does not end
    /// within `max_entries` keys.
    pub fn entries(
        &self,
        info: &MapInfo,
        value_len: usize,
        skip_zero: bool,
        limit: usize,
    ) -> Result<Option<Entries>> {
        let ks = info.key_size as usize;
        let mut out = Vec::new();
        let mut bytes = 0usize;
        let mut key: Option<Vec<u8>> = None;
        let mut seen = 0u64;
        while let Some(next) = self.next_key(key.as_deref(), ks)? {
            seen += 1;
            if seen > info.max_entries as u64 + 1 {
                return Err(self.err("MAP_GET_NEXT_KEY", Errno(libc::EAGAIN)));
            }
            if let Some(v) = self.lookup(&next, value_len)? {
                if !(skip_zero && v.iter().all(|&b| b == 0)) {
                    bytes += next.len() + v.len();
                    if bytes > limit {
                        return Ok(None);
                    }
                    out.push((next.clone(), v));
                }
            }
            key = Some(next);
        }
        Ok(Some(out))
    }

    /// Make a map with these attributes (BPF_MAP_CREATE; no BTF, no
    /// device; `numa_node` taken with BPF_F_NUMA_NODE), named `what` in
    /// errors.
    pub fn create(info: &MapInfo, numa_node: u32, what: impl Into<String>) -> Result<Map> {
        let what = what.into();
        let mut name = [0u8; NAME_LEN];
        let n = info.name.len().min(NAME_LEN - 1);
        name[..n].copy_from_slice(&info.name.as_bytes()[..n]);
        let mut attr = CreateAttr {
            map_type: info.map_type,
            key_size: info.key_size,
            value_size: info.value_size,
            max_entries: info.max_entries,
            map_flags: info.map_flags,
            numa_node: if info.map_flags & map_flags::NUMA_NODE != 0 {
                numa_node
            } else {
                0
            },
            map_name: name,
            map_extra: info.map_extra,
            ..Default::default()
        };
        let r = bpf(BPF_MAP_CREATE, &mut attr).map_err(|source| SysError::Bpf {
            op: "MAP_CREATE",
            map: what.clone(),
            source,
        })?;
        Ok(Map { fd: own(r), what })
    }

    /// Set `key` to `value` (BPF_ANY).
    pub fn update(&self, key: &[u8], value: &[u8]) -> Result<()> {
        let mut attr = ElemAttr {
            map_fd: self.fd.as_raw_fd() as u32,
            _pad: 0,
            key: key.as_ptr() as u64,
            value: value.as_ptr() as u64,
            flags: 0,
        };
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr)
            .map(|_| ())
            .map_err(|e| self.err("MAP_UPDATE_ELEM", e))
    }

    /// Freeze it: no more writes from system calls (BPF_MAP_FREEZE).
    pub fn freeze(&self) -> Result<()> {
        let mut attr = ElemAttr {
            map_fd: self.fd.as_raw_fd() as u32,
            _pad: 0,
            key: 0,
            value: 0,
            flags: 0,
        };
        bpf(BPF_MAP_FREEZE, &mut attr)
            .map(|_| ())
            .map_err(|e| self.err("MAP_FREEZE", e))
    }

    /// Another open file description of this map (BPF_MAP_GET_FD_BY_ID),
    /// with access mode `accmode` (O_RDONLY, O_WRONLY, O_RDWR: the
    /// syscall side's BPF_F_RDONLY / BPF_F_WRONLY), close-on-exec.
    pub fn reopen(&self, accmode: i32) -> Result<OwnedFd> {
        let id = self.info()?.id;
        let open_flags = match accmode & libc::O_ACCMODE {
            libc::O_RDONLY => map_flags::RDONLY,
            libc::O_WRONLY => map_flags::WRONLY,
            _ => 0,
        };
        let mut attr = GetIdAttr {
            id,
            next_id: 0,
            open_flags,
        };
        bpf(BPF_MAP_GET_FD_BY_ID, &mut attr)
            .map(own)
            .map_err(|e| self.err("MAP_GET_FD_BY_ID", e))
    }
}

/// How many CPUs are possible (/sys/devices/system/cpu/possible): a
/// per-CPU map's value holds one slot for each.
pub fn possible_cpus() -> Result<u32> {
    let path = "/sys/devices/system/cpu/possible";
    let text = std::fs::read_to_string(path).map_err(crate::error::io_err(path))?;
    parse_cpu_list(text.trim()).ok_or_else(|| SysError::Parse {
        path: path.into(),
        what: format!("a CPU list {text:?}"),
    })
}

/// The number of CPUs of a list such as "0-3,5,7-8".
fn parse_cpu_list(s: &str) -> Option<u32> {
    let mut n = 0u32;
    for part in s.split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<u32>().ok()? - a.parse::<u32>().ok()? + 1,
            None => {
                part.parse::<u32>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

/// The length of the value buffer of a lookup or update in a map of type
/// `map_type` with values of `value_size` bytes, with `cpus` possible CPUs.
pub fn value_len(map_type: u32, value_size: u32, cpus: u32) -> usize {
    if per_cpu(map_type) {
        (value_size as usize).div_ceil(8) * 8 * cpus as usize
    } else {
        value_size as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-3,5,7-8"), Some(7));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn value_lengths() {
        assert_eq!(value_len(map_type::HASH, 5, 4), 5);
        assert_eq!(value_len(map_type::PERCPU_ARRAY, 5, 4), 32);
        assert_eq!(type_name(map_type::RINGBUF), "ringbuf");
        assert_eq!(type_name(999), "type 999");
    }

    /// Needs root (CAP_BPF): make a hash map, fill, read back, freeze.
    #[test]
    fn hash_round_trip() {
        let info = MapInfo {
            map_type: map_type::HASH,
            key_size: 4,
            value_size: 8,
            max_entries: 16,
            name: "cr_sys_test".into(),
            ..Default::default()
        };
        let m = match Map::create(&info, 0, "test map") {
            Ok(m) => m,
            Err(e) if matches!(e.errno(), Some(libc::EPERM)) => return,
            Err(e) => panic!("{e}"),
        };
        for i in 0u32..5 {
            m.update(&i.to_ne_bytes(), &(i as u64 * 7).to_ne_bytes())
                .unwrap();
        }
        let got = m.info().unwrap();
        assert_eq!(
            (got.map_type, got.key_size, got.value_size, got.max_entries),
            (map_type::HASH, 4, 8, 16)
        );
        assert_eq!(got.name, "cr_sys_test");
        let mut e = m.entries(&got, 8, false, 1 << 20).unwrap().unwrap();
        e.sort();
        assert_eq!(e.len(), 5);
        assert!(m.entries(&got, 8, false, 10).unwrap().is_none());
        m.freeze().unwrap();
        let err = m.update(&1u32.to_ne_bytes(), &[0; 8]).unwrap_err();
        assert_eq!(err.errno(), Some(libc::EPERM));
        let ro = Map::of_fd(m.reopen(libc::O_RDONLY).unwrap(), "ro");
        assert_eq!(ro.info().unwrap().id, got.id);
    }
}
