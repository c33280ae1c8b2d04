//! Section of kind "memory": the mm fields and auxiliary vector, every
//! mapping (VMA), and where each saved page is (this image's page store,
//! the parent image, or zero); the page store itself and the content files
//! of file objects.

use super::{known, pb, ser, Bad, Checkpoint, ObjectTag, Process};
use serde::Serialize;
use std::collections::HashMap;

pub const PAGE: u64 = 4096;
/// Pages per block of the page store.
pub const BLOCK_PAGES: u32 = 64;
/// The top of user space on x86_64 (4-level paging; 5-level goes higher).
pub const TASK_TOP: u64 = 0x00ff_ffff_ffff_f000;
/// Where the kernel puts [vsyscall].
pub const VSYSCALL: u64 = 0xffff_ffff_ff60_0000;
/// The largest auxiliary vector accepted.
const MAX_AUXV: usize = 4096;

/// The mm fields PR_SET_MM_MAP restores, and the auxiliary vector.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Mm {
    pub start_code: u64,
    pub end_code: u64,
    pub start_data: u64,
    pub end_data: u64,
    pub start_brk: u64,
    pub brk: u64,
    pub start_stack: u64,
    pub arg_start: u64,
    pub arg_end: u64,
    pub env_start: u64,
    pub env_end: u64,
    /// Raw /proc/PID/auxv.
    #[serde(rename = "auxv_bytes", serialize_with = "ser::len")]
    pub auxv: Vec<u8>,
}

impl Mm {
    /// The bounds in the order of prctl(PR_SET_MM_MAP)'s struct prctl_mm_map
    /// (code, data, brk, stack, arguments, environment).
    pub fn bounds(&self) -> [u64; 11] {
        [
            self.start_code,
            self.end_code,
            self.start_data,
            self.end_data,
            self.start_brk,
            self.brk,
            self.start_stack,
            self.arg_start,
            self.arg_end,
            self.env_start,
            self.env_end,
        ]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum VmaKind {
    AnonPrivate,
    AnonShared,
    FilePrivate,
    FileShared,
    Heap,
    Stack,
    Vdso,
    Vvar,
    VvarVclock,
    Vsyscall,
    /// An attach of a System V shared memory segment (`inode`: its id).
    SysvShm,
    /// The completion ring of an AIO context (`aio`: its state).
    Aio,
    /// The rings of a packet socket mapped from it (`inode`: the socket's,
    /// its object in the image); mapped again from the restored socket.
    PacketRing,
}

impl VmaKind {
    /// The kernel's special mappings, moved (or left) rather than mapped.
    pub fn is_special(self) -> bool {
        matches!(
            self,
            VmaKind::Vdso | VmaKind::Vvar | VmaKind::VvarVclock | VmaKind::Vsyscall
        )
    }

    /// Private anonymous memory (its pages are the process's own).
    pub fn is_anon_private(self) -> bool {
        matches!(self, VmaKind::AnonPrivate | VmaKind::Heap | VmaKind::Stack)
    }

    pub fn is_file(self) -> bool {
        matches!(self, VmaKind::FilePrivate | VmaKind::FileShared)
    }

    /// How /proc shows a special mapping.
    pub fn special_name(self) -> Option<&'static str> {
        match self {
            VmaKind::Vdso => Some("[vdso]"),
            VmaKind::Vvar => Some("[vvar]"),
            VmaKind::VvarVclock => Some("[vvar_vclock]"),
            VmaKind::Vsyscall => Some("[vsyscall]"),
            _ => None,
        }
    }

    fn from_pb(k: pb::VmaKind) -> Result<VmaKind, Bad> {
        use pb::VmaKind as P;
        Ok(match k {
            P::Unspecified => return Err("a mapping of unknown kind".into()),
            P::AnonPrivate => VmaKind::AnonPrivate,
            P::AnonShared => VmaKind::AnonShared,
            P::FilePrivate => VmaKind::FilePrivate,
            P::FileShared => VmaKind::FileShared,
            P::Heap => VmaKind::Heap,
            P::Stack => VmaKind::Stack,
            P::Vdso => VmaKind::Vdso,
            P::Vvar => VmaKind::Vvar,
            P::VvarVclock => VmaKind::VvarVclock,
            P::Vsyscall => VmaKind::Vsyscall,
            P::SysvShm => VmaKind::SysvShm,
            P::Aio => VmaKind::Aio,
            P::PacketRing => VmaKind::PacketRing,
        })
    }

    fn to_pb(self) -> pb::VmaKind {
        use pb::VmaKind as P;
        match self {
            VmaKind::AnonPrivate => P::AnonPrivate,
            VmaKind::AnonShared => P::AnonShared,
            VmaKind::FilePrivate => P::FilePrivate,
            VmaKind::FileShared => P::FileShared,
            VmaKind::Heap => P::Heap,
            VmaKind::Stack => P::Stack,
            VmaKind::Vdso => P::Vdso,
            VmaKind::Vvar => P::Vvar,
            VmaKind::VvarVclock => P::VvarVclock,
            VmaKind::Vsyscall => P::Vsyscall,
            VmaKind::SysvShm => P::SysvShm,
            VmaKind::Aio => P::Aio,
            VmaKind::PacketRing => P::PacketRing,
        }
    }
}

/// How /proc shows a shared anonymous memory object mapped from a file.
pub const SHMEM_PATH: &str = "/dev/zero (deleted)";

/// One mapping of a process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Vma {
    #[serde(serialize_with = "ser::hex")]
    pub start: u64,
    #[serde(serialize_with = "ser::hex")]
    pub end: u64,
    /// PROT_READ/WRITE/EXEC bits.
    pub prot: u32,
    pub shared: bool,
    pub kind: VmaKind,
    /// File offset in bytes (file mappings).
    pub pgoff: u64,
    pub path: String,
    pub dev: u64,
    pub inode: u64,
    /// Two-letter VmFlags of /proc/PID/smaps.
    pub vm_flags: Vec<String>,
    pub anon_name: String,
    /// Shared anonymous memory an earlier process of the image holds.
    pub shm_owner: Option<ShmOwner>,
    /// A mapping of a memfd or deleted file: its content object.
    pub object: Option<u64>,
    /// An AIO ring: the state of its context.
    pub aio: Option<AioRing>,
    /// Guard regions (MADV_GUARD_INSTALL): sorted, disjoint `[start, end)`
    /// ranges within the mapping, where any access faults.
    #[serde(serialize_with = "ser::hex_ranges")]
    pub guards: Vec<(u64, u64)>,
    /// A hugetlb mapping (VmFlag `ht`): the size of its pages in bytes;
    /// 0 for base pages.
    pub huge_page_size: u64,
    /// A file mapped by a name removed while it kept others: the
    /// checkpoint's link to it (see `FdKind::Regular`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub relink: Option<String>,
}

/// Size of struct io_event, and of the header of struct aio_ring.
pub const AIO_EVENT: usize = 32;

/// What a program sees of an AIO context: its completion ring.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AioRing {
    /// Events the ring holds.
    pub nr: u32,
    /// Next event to reap; next to complete.
    pub head: u32,
    pub tail: u32,
    /// The completed events not yet reaped (head to tail), 32 bytes each.
    #[serde(rename = "events_bytes", serialize_with = "ser::len")]
    pub events: Vec<u8>,
}

impl AioRing {
    /// Completed events not yet reaped.
    pub fn pending(&self) -> u32 {
        (self.tail + self.nr - self.head) % self.nr.max(1)
    }

    fn from_pb(a: pb::AioRing, len: u64) -> Result<AioRing, Bad> {
        let ring = AioRing {
            nr: a.nr,
            head: a.head,
            tail: a.tail,
            events: a.events,
        };
        let fits = (ring.nr as u64 + 1) * AIO_EVENT as u64 <= len;
        if ring.nr < 2 || !fits || ring.head >= ring.nr || ring.tail >= ring.nr {
            return Err(format!(
                "an AIO ring of {len} bytes with {} events, head {}, tail {}",
                ring.nr, ring.head, ring.tail
            ));
        }
        if ring.events.len() != ring.pending() as usize * AIO_EVENT {
            return Err(format!(
                "an AIO ring with {} pending events but {} bytes of them",
                ring.pending(),
                ring.events.len()
            ));
        }
        Ok(ring)
    }
}

impl Vma {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    pub fn has_flag(&self, f: &str) -> bool {
        self.vm_flags.iter().any(|x| x == f)
    }

    /// Whether this maps a shared anonymous memory object: shared
    /// (`AnonShared`), or private (copy-on-write) over one opened through
    /// /proc/PID/map_files. The first such mapping of an object in the
    /// image stands for it; the others name it in `shm_owner`.
    pub fn is_shmem(&self) -> bool {
        self.kind == VmaKind::AnonShared
            || (self.kind == VmaKind::FilePrivate
                && self.object.is_none()
                && self.path == SHMEM_PATH)
    }

    pub(crate) fn from_pb(v: pb::Vma) -> Result<Vma, Bad> {
        let kind = VmaKind::from_pb(known(v.kind, "its kind")?)?;
        if v.start >= v.end || !v.start.is_multiple_of(PAGE) || !v.end.is_multiple_of(PAGE) {
            return Err(format!("bad range {:#x}-{:#x}", v.start, v.end));
        }
        let top = if kind == VmaKind::Vsyscall {
            u64::MAX
        } else {
            TASK_TOP
        };
        if v.end > top || v.prot > 7 || !v.pgoff.is_multiple_of(PAGE) {
            return Err(format!(
                "bad range {:#x}-{:#x}, protection {:#x} or offset {:#x}",
                v.start, v.end, v.prot, v.pgoff
            ));
        }
        if kind.is_file() && v.path.is_empty() && v.object == 0 {
            return Err("a file mapping without a file".into());
        }
        if let Some(f) = v
            .vm_flags
            .iter()
            .find(|f| f.len() != 2 || !f.bytes().all(|b| b.is_ascii_lowercase()))
        {
            return Err(format!("bad VmFlag {f:?}"));
        }
        let aio = match (kind, v.aio) {
            (VmaKind::Aio, Some(a)) => Some(AioRing::from_pb(a, v.end - v.start)?),
            (VmaKind::Aio, None) => return Err("an AIO ring without its state".into()),
            (_, Some(_)) => return Err("AIO ring state on another mapping".into()),
            (_, None) => None,
        };
        if !v.guards.len().is_multiple_of(2) {
            return Err("guard regions without their end".into());
        }
        let guards: Vec<(u64, u64)> = v.guards.chunks_exact(2).map(|g| (g[0], g[1])).collect();
        let mut at = v.start;
        for &(a, b) in &guards {
            if a < at || b <= a || b > v.end || !a.is_multiple_of(PAGE) || !b.is_multiple_of(PAGE) {
                return Err(format!(
                    "guard region {a:#x}-{b:#x} out of order or outside {:#x}-{:#x}",
                    v.start, v.end
                ));
            }
            at = b;
        }
        let huge = v.huge_page_size;
        if huge != 0
            && (!huge.is_power_of_two()
                || huge <= PAGE
                || !v.start.is_multiple_of(huge)
                || !v.end.is_multiple_of(huge))
        {
            return Err(format!(
                "huge pages of {huge} bytes for {:#x}-{:#x}",
                v.start, v.end
            ));
        }
        Ok(Vma {
            start: v.start,
            end: v.end,
            prot: v.prot,
            shared: v.shared,
            kind,
            pgoff: v.pgoff,
            path: v.path,
            dev: v.dev,
            inode: v.inode,
            vm_flags: v.vm_flags,
            anon_name: v.anon_name,
            shm_owner: v.shm_owner.map(|o| ShmOwner {
                pid: o.pid,
                start: o.start,
                end: o.end,
            }),
            object: Some(v.object).filter(|&o| o != 0),
            aio,
            guards,
            huge_page_size: huge,
            relink: (!v.relink.is_empty()).then_some(v.relink),
        })
    }

    pub(crate) fn to_pb(&self) -> pb::Vma {
        pb::Vma {
            start: self.start,
            end: self.end,
            prot: self.prot,
            shared: self.shared,
            kind: self.kind.to_pb() as i32,
            pgoff: self.pgoff,
            path: self.path.clone(),
            dev: self.dev,
            inode: self.inode,
            vm_flags: self.vm_flags.clone(),
            anon_name: self.anon_name.clone(),
            shm_owner: self.shm_owner.map(|o| pb::ShmOwner {
                pid: o.pid,
                start: o.start,
                end: o.end,
            }),
            object: self.object.unwrap_or(0),
            aio: self.aio.as_ref().map(|a| pb::AioRing {
                nr: a.nr,
                head: a.head,
                tail: a.tail,
                events: a.events.clone(),
            }),
            guards: self.guards.iter().flat_map(|&(a, b)| [a, b]).collect(),
            huge_page_size: self.huge_page_size,
            relink: self.relink.clone().unwrap_or_default(),
        }
    }
}

/// The process and VMA holding the pages of shared anonymous memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ShmOwner {
    pub pid: u32,
    #[serde(serialize_with = "ser::hex")]
    pub start: u64,
    #[serde(serialize_with = "ser::hex")]
    pub end: u64,
}

/// How pages unchanged since the parent were told apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DirtyMethod {
    /// No parent: everything stored.
    #[default]
    Full,
    /// userfaultfd write-protect (WP_ASYNC) read with PAGEMAP_SCAN.
    UffdWp,
    /// The kernel's soft-dirty bits.
    SoftDirty,
    /// Every page read and its hash compared with the parent's.
    Hash,
}

impl DirtyMethod {
    /// As users type it.
    pub fn name(self) -> &'static str {
        match self {
            DirtyMethod::Full => "full",
            DirtyMethod::UffdWp => "uffd-wp",
            DirtyMethod::SoftDirty => "soft-dirty",
            DirtyMethod::Hash => "hash",
        }
    }

    /// The method called `s` by [`DirtyMethod::name`].
    pub fn from_name(s: &str) -> Option<DirtyMethod> {
        [
            DirtyMethod::Full,
            DirtyMethod::UffdWp,
            DirtyMethod::SoftDirty,
            DirtyMethod::Hash,
        ]
        .into_iter()
        .find(|m| m.name() == s)
    }

    fn from_pb(v: i32, what: &str) -> Result<Option<DirtyMethod>, Bad> {
        use pb::DirtyMethod as P;
        Ok(match known(v, what)? {
            P::DirtyUnspecified => None,
            P::DirtyFull => Some(DirtyMethod::Full),
            P::DirtyUffdWp => Some(DirtyMethod::UffdWp),
            P::DirtySoftDirty => Some(DirtyMethod::SoftDirty),
            P::DirtyHash => Some(DirtyMethod::Hash),
        })
    }

    fn to_pb(m: Option<DirtyMethod>) -> i32 {
        use pb::DirtyMethod as P;
        (match m {
            None => P::DirtyUnspecified,
            Some(DirtyMethod::Full) => P::DirtyFull,
            Some(DirtyMethod::UffdWp) => P::DirtyUffdWp,
            Some(DirtyMethod::SoftDirty) => P::DirtySoftDirty,
            Some(DirtyMethod::Hash) => P::DirtyHash,
        }) as i32
    }
}

/// Where each saved page of a process is.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Memory {
    /// Sorted by address, not overlapping.
    #[serde(rename = "runs", serialize_with = "runs_len")]
    pub runs: Vec<PageRun>,
    /// XXH3-64 of every page in the store or the parent, in run order;
    /// with `parent_hashes_omitted`, of the pages in the store only (an
    /// image read by itself: [`crate::chain::Chain::open`] fills the
    /// parent's in).
    #[serde(skip)]
    pub hashes: Vec<u64>,
    /// `hashes` lacks the PARENT pages' hashes (see `hashes`).
    #[serde(skip)]
    pub parent_hashes_omitted: bool,
    pub dirty: DirtyMethod,
    /// Dirty tracking left running in the process (None: none).
    #[serde(serialize_with = "tracking_name")]
    pub tracking: Option<DirtyMethod>,
    #[serde(flatten)]
    pub stats: MemStats,
}

fn tracking_name<S: serde::Serializer>(v: &Option<DirtyMethod>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.map_or("none", DirtyMethod::name))
}

fn runs_len<S: serde::Serializer>(v: &[PageRun], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(v.len() as u64)
}

/// Consecutive pages kept in the same place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PageRun {
    pub vaddr: u64,
    pub pages: u32,
    pub at: PageAt,
}

impl PageRun {
    pub fn end(&self) -> u64 {
        self.vaddr + self.pages as u64 * PAGE
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PageAt {
    /// In this image's store, from page `page` of block `block` on.
    Store { block: u32, page: u32 },
    /// Unchanged since the parent image (same addresses there).
    Parent,
    /// All zero, over a file page.
    Zero,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MemStats {
    pub pages_stored: u64,
    pub pages_parent: u64,
    pub pages_zero: u64,
    /// Identical to a page stored earlier in this image.
    pub pages_dup: u64,
    /// Read from the process (the others were known clean).
    pub pages_read: u64,
}

impl Memory {
    /// Pages with a hash (in the store or the parent; in the store only
    /// when the parent's are omitted).
    pub fn hashed_pages(&self) -> u64 {
        self.runs
            .iter()
            .filter(|r| self.has_hashes(r))
            .map(|r| r.pages as u64)
            .sum()
    }

    /// Whether `hashes` holds the hashes of run `r`'s pages: a stored run's,
    /// and a parent run's unless they are omitted.
    pub fn has_hashes(&self, r: &PageRun) -> bool {
        match r.at {
            PageAt::Zero => false,
            PageAt::Parent => !self.parent_hashes_omitted,
            PageAt::Store { .. } => true,
        }
    }

    /// Whether some pages are the parent image's.
    pub fn has_parent_pages(&self) -> bool {
        self.runs.iter().any(|r| r.at == PageAt::Parent)
    }

    /// The STORE pages' hashes of complete `hashes`, in run order: what an
    /// image with parent pages writes.
    fn store_hashes(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.stats.pages_stored as usize);
        let mut i = 0;
        for r in &self.runs {
            let n = r.pages as usize;
            match r.at {
                PageAt::Zero => continue,
                PageAt::Parent => {}
                PageAt::Store { .. } => {
                    // A list too short stays short: its reader refuses it.
                    let end = (i + n).min(self.hashes.len());
                    out.extend_from_slice(self.hashes.get(i..end).unwrap_or_default())
                }
            }
            i += n;
        }
        out
    }

    /// Whether writing this memory omits its parent pages' hashes (it has
    /// some, and `hashes` holds them).
    pub(crate) fn omits_on_write(&self) -> bool {
        !self.parent_hashes_omitted && self.has_parent_pages()
    }

    /// Put back the PARENT pages' hashes omitted in the image, taken from
    /// `parent` (the same process in the parent image, its own hashes
    /// complete). Err: what is missing there.
    pub fn fill_parent_hashes(&mut self, parent: Option<&Memory>) -> Result<(), Bad> {
        if !self.parent_hashes_omitted {
            return Ok(());
        }
        let mut full = Vec::with_capacity(
            self.runs
                .iter()
                .filter(|r| r.at != PageAt::Zero)
                .map(|r| r.pages as usize)
                .sum(),
        );
        let ix = parent.map(crate::chain::MemIndex::new);
        let mut cursor = ix.as_ref().map(|ix| ix.cursor());
        let mut own = self.hashes.iter().copied();
        for r in &self.runs {
            match r.at {
                PageAt::Zero => {}
                PageAt::Store { .. } => full.extend(own.by_ref().take(r.pages as usize)),
                PageAt::Parent => cursor
                    .as_mut()
                    .ok_or(r.vaddr)
                    .and_then(|c| c.extend_hashes(r.vaddr, r.pages as u64, &mut full))
                    .map_err(|at| format!("the parent image holds no page at {at:#x}"))?,
            }
        }
        self.hashes = full;
        self.parent_hashes_omitted = false;
        Ok(())
    }

    pub(crate) fn from_pb(m: pb::Memory) -> Result<Memory, Bad> {
        let mut runs = Vec::with_capacity(m.runs.len());
        let mut end = 0u64;
        for r in m.runs {
            use pb::page_run::At;
            let at = match r.at {
                Some(At::Store(l)) => PageAt::Store {
                    block: l.block,
                    page: l.page,
                },
                Some(At::Parent(_)) => PageAt::Parent,
                Some(At::Zero(_)) => PageAt::Zero,
                None => return Err(format!("pages at {:#x} are of an unknown kind", r.vaddr)),
            };
            let run_end = (r.nr_pages as u64)
                .checked_mul(PAGE)
                .and_then(|l| r.vaddr.checked_add(l));
            match run_end {
                Some(e)
                    if r.nr_pages > 0 && r.vaddr % PAGE == 0 && r.vaddr >= end && e <= TASK_TOP =>
                {
                    end = e
                }
                _ => {
                    return Err(format!(
                        "pages at {:#x} ({} pages) are out of order or out of range",
                        r.vaddr, r.nr_pages
                    ))
                }
            }
            if let PageAt::Store { block, page } = at {
                if page.checked_add(r.nr_pages).is_none_or(|e| e > BLOCK_PAGES) {
                    return Err(format!("pages at {:#x} overrun block {block}", r.vaddr));
                }
            }
            runs.push(PageRun {
                vaddr: r.vaddr,
                pages: r.nr_pages,
                at,
            });
        }
        let st = m.stats.unwrap_or_default();
        let mem = Memory {
            runs,
            hashes: m.hashes,
            parent_hashes_omitted: m.parent_hashes_omitted,
            dirty: DirtyMethod::from_pb(m.dirty, "its dirty method")?.unwrap_or_default(),
            tracking: DirtyMethod::from_pb(m.tracking, "its tracking")?,
            stats: MemStats {
                pages_stored: st.pages_stored,
                pages_parent: st.pages_parent,
                pages_zero: st.pages_zero,
                pages_dup: st.pages_dup,
                pages_read: st.pages_read,
            },
        };
        if mem.hashes.len() as u64 != mem.hashed_pages() {
            return Err(format!(
                "{} page hashes for {} pages",
                mem.hashes.len(),
                mem.hashed_pages()
            ));
        }
        Ok(mem)
    }

    pub(crate) fn to_pb(&self) -> pb::Memory {
        use pb::page_run::At;
        let s = &self.stats;
        pb::Memory {
            runs: self
                .runs
                .iter()
                .map(|r| pb::PageRun {
                    vaddr: r.vaddr,
                    nr_pages: r.pages,
                    at: Some(match r.at {
                        PageAt::Store { block, page } => At::Store(pb::StoreLoc { block, page }),
                        PageAt::Parent => At::Parent(pb::Empty {}),
                        PageAt::Zero => At::Zero(pb::Empty {}),
                    }),
                })
                .collect(),
            hashes: if self.omits_on_write() {
                self.store_hashes()
            } else {
                self.hashes.clone()
            },
            parent_hashes_omitted: self.parent_hashes_omitted || self.omits_on_write(),
            dirty: DirtyMethod::to_pb(Some(self.dirty)),
            tracking: DirtyMethod::to_pb(self.tracking),
            stats: Some(pb::MemStats {
                pages_stored: s.pages_stored,
                pages_parent: s.pages_parent,
                pages_zero: s.pages_zero,
                pages_dup: s.pages_dup,
                pages_read: s.pages_read,
            }),
        }
    }
}

impl Mm {
    pub(crate) fn from_pb(m: pb::Mm) -> Result<Mm, Bad> {
        if !m.auxv.len().is_multiple_of(16) || m.auxv.len() > MAX_AUXV {
            return Err(format!("an auxiliary vector of {} bytes", m.auxv.len()));
        }
        Ok(Mm {
            start_code: m.start_code,
            end_code: m.end_code,
            start_data: m.start_data,
            end_data: m.end_data,
            start_brk: m.start_brk,
            brk: m.brk,
            start_stack: m.start_stack,
            arg_start: m.arg_start,
            arg_end: m.arg_end,
            env_start: m.env_start,
            env_end: m.env_end,
            auxv: m.auxv,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::Mm {
        pb::Mm {
            start_code: self.start_code,
            end_code: self.end_code,
            start_data: self.start_data,
            end_data: self.end_data,
            start_brk: self.start_brk,
            brk: self.brk,
            start_stack: self.start_stack,
            arg_start: self.arg_start,
            arg_end: self.arg_end,
            env_start: self.env_start,
            env_end: self.env_end,
            auxv: self.auxv.clone(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    #[default]
    None,
    Lz4,
    Zstd,
}

impl Compression {
    /// As users type it.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Compression::None),
            "lz4" => Ok(Compression::Lz4),
            "zstd" => Ok(Compression::Zstd),
            _ => Err(format!("unknown compression {s:?} (none, lz4 or zstd)")),
        }
    }
}

/// The file of unique pages of an image, in blocks.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct PageStore {
    pub name: String,
    pub size: u64,
    pub compression: Compression,
    #[serde(skip)]
    pub blocks: Vec<StoreBlock>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreBlock {
    /// Byte offset and length in the store file.
    pub offset: u64,
    pub stored_len: u32,
    pub pages: u32,
    /// XXH3-64 of the uncompressed pages.
    pub xxh3: u64,
    /// Stored as is (restore copies it straight from the file).
    pub raw: bool,
}

/// A file name inside an image directory.
pub(crate) fn check_file_name(name: &str) -> Result<(), Bad> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') || name.contains('\0') {
        return Err(format!("bad file name {name:?}"));
    }
    Ok(())
}

impl PageStore {
    pub(crate) fn from_pb(s: pb::PageStore) -> Result<PageStore, Bad> {
        check_file_name(&s.name)?;
        let compression = match known(s.compression, "its compression")? {
            pb::Compression::Unspecified => return Err("unknown compression".into()),
            pb::Compression::None => Compression::None,
            pb::Compression::Lz4 => Compression::Lz4,
            pb::Compression::Zstd => Compression::Zstd,
        };
        let mut blocks = Vec::with_capacity(s.blocks.len());
        for (i, b) in s.blocks.into_iter().enumerate() {
            let fits = b
                .offset
                .checked_add(b.stored_len as u64)
                .is_some_and(|e| e <= s.size);
            let sane = fits
                && b.nr_pages > 0
                && b.nr_pages <= BLOCK_PAGES
                && (!b.raw || b.stored_len as u64 == b.nr_pages as u64 * PAGE)
                && b.stored_len as u64 <= 2 * BLOCK_PAGES as u64 * PAGE;
            if !sane {
                return Err(format!("block {i} is out of bounds"));
            }
            if !b.raw && compression == Compression::None {
                return Err(format!("block {i} is compressed, the store is not"));
            }
            blocks.push(StoreBlock {
                offset: b.offset,
                stored_len: b.stored_len,
                pages: b.nr_pages,
                xxh3: b.xxh3,
                raw: b.raw,
            });
        }
        Ok(PageStore {
            name: s.name,
            size: s.size,
            compression,
            blocks,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::PageStore {
        pb::PageStore {
            name: self.name.clone(),
            size: self.size,
            compression: (match self.compression {
                Compression::None => pb::Compression::None,
                Compression::Lz4 => pb::Compression::Lz4,
                Compression::Zstd => pb::Compression::Zstd,
            }) as i32,
            blocks: self
                .blocks
                .iter()
                .map(|b| pb::StoreBlock {
                    offset: b.offset,
                    stored_len: b.stored_len,
                    nr_pages: b.pages,
                    xxh3: b.xxh3,
                    raw: b.raw,
                })
                .collect(),
        }
    }
}

/// A file of the image holding the content of a file object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PageFile {
    pub name: String,
    pub size: u64,
    #[serde(skip)]
    pub extents: Vec<PageExtent>,
}

/// A run of the saved file's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageExtent {
    /// Offset in the saved file.
    pub file_offset: u64,
    pub pages: u32,
    /// Byte offset in the image's file.
    pub offset: u64,
    pub xxh3: u64,
}

impl PageExtent {
    pub fn len(&self) -> u64 {
        self.pages as u64 * PAGE
    }

    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }
}

/// Largest extent accepted (the writer makes 1 MiB runs).
const MAX_EXTENT_PAGES: u32 = 1 << 16;

impl PageFile {
    pub(crate) fn from_pb(f: pb::PageFile) -> Result<PageFile, Bad> {
        check_file_name(&f.name)?;
        let mut extents = Vec::with_capacity(f.extents.len());
        let mut next = 0u64;
        for e in f.extents {
            let len = e.nr_pages as u64 * PAGE;
            let ok = e.nr_pages > 0
                && e.nr_pages <= MAX_EXTENT_PAGES
                && e.offset.is_multiple_of(PAGE)
                && e.vaddr.is_multiple_of(PAGE)
                && e.vaddr >= next
                && e.vaddr.checked_add(len).is_some()
                && e.offset.checked_add(len).is_some_and(|x| x <= f.size);
            if !ok {
                return Err(format!("{}: a run at {} is out of bounds", f.name, e.vaddr));
            }
            next = e.vaddr + len;
            extents.push(PageExtent {
                file_offset: e.vaddr,
                pages: e.nr_pages,
                offset: e.offset,
                xxh3: e.xxh3,
            });
        }
        Ok(PageFile {
            name: f.name,
            size: f.size,
            extents,
        })
    }

    pub(crate) fn to_pb(&self) -> pb::PageFile {
        pb::PageFile {
            name: self.name.clone(),
            size: self.size,
            extents: self
                .extents
                .iter()
                .map(|e| pb::PageExtent {
                    vaddr: e.file_offset,
                    nr_pages: e.pages,
                    offset: e.offset,
                    xxh3: e.xxh3,
                })
                .collect(),
        }
    }
}

/// A mapping of a packet socket's rings: of a packet socket the process
/// holds open in its fd table (`table`'s: it is mapped again from that
/// fd), within its rings.
fn packet_ring_ok(v: &Vma, table: &Process, ck: &Checkpoint) -> Result<(), Bad> {
    use super::{FdKind, ObjectKind};
    let held = table
        .fds
        .iter()
        .any(|f| matches!(f.kind, FdKind::PacketSocket { object } if object == v.inode));
    let ring = ck.object(ObjectTag::PacketSocket, v.inode);
    let Some(ObjectKind::PacketSocket(s)) = ring.map(|o| &o.kind).filter(|_| held) else {
        let ino = v.inode;
        return Err(format!(
            "mapping at {:#x} of the rings of packet socket:[{ino}], which the process does not hold",
            v.start
        ));
    };
    let len = s.rings_len();
    if v.pgoff + (v.end - v.start) > len {
        return Err(format!(
            "mapping at {:#x} reaches beyond the {len} bytes of the rings of socket:[{}]",
            v.start, v.inode
        ));
    }
    Ok(())
}

/// The mappings of process `p` (number `i`) and where its pages are:
/// sorted, not overlapping, every saved page inside a mapping, every
/// reference to another process's memory or to an object resolvable.
pub(crate) fn validate(
    p: &Process,
    i: usize,
    pids: &HashMap<u32, usize>,
    procs: &[Process],
    blocks: usize,
    ck: &Checkpoint,
) -> Result<(), Bad> {
    for w in p.vmas.windows(2) {
        if w[1].start < w[0].end {
            return Err(format!(
                "mappings {:#x}-{:#x} and {:#x}-{:#x} overlap or are out of order",
                w[0].start, w[0].end, w[1].start, w[1].end
            ));
        }
    }
    for v in &p.vmas {
        if let Some(o) = v.shm_owner {
            // An earlier process, or an earlier mapping of this one.
            let owner = pids
                .get(&o.pid)
                .filter(|&&j| j < i || (j == i && o.start < v.start))
                .map(|&j| if j == i { p } else { &procs[j] });
            let found = owner.is_some_and(|q| {
                q.vmas.iter().any(|w| {
                    w.start == o.start && w.end == o.end && w.is_shmem() && w.shm_owner.is_none()
                })
            });
            if !v.is_shmem() || !found {
                return Err(format!(
                    "mapping at {:#x} shares memory of process {} at {:#x}, which is not in the image",
                    v.start, o.pid, o.start
                ));
            }
        }
        if v.kind == VmaKind::PacketRing {
            let table = p
                .fd_table_of
                .and_then(|o| pids.get(&o))
                .map_or(p, |&j| &procs[j]);
            packet_ring_ok(v, table, ck)?;
        }
        if let Some(id) = v.object {
            let ok = ck.object(ObjectTag::Memfd, id).is_some()
                || ck.object(ObjectTag::DeletedFile, id).is_some();
            if !ok || !v.kind.is_file() {
                return Err(format!(
                    "mapping at {:#x} refers to file object {id}, missing from the image",
                    v.start
                ));
            }
        }
    }
    // Every page run lies in mappings (contiguous ones when it spans several).
    let mut vi = 0;
    for r in &p.memory.runs {
        let mut at = r.vaddr;
        while at < r.end() {
            while p.vmas.get(vi).is_some_and(|v| v.end <= at) {
                vi += 1;
            }
            match p.vmas.get(vi) {
                // A segment's memory is the segment's, not the process's;
                // an AIO ring's is its context's.
                Some(v)
                    if v.start <= at
                        && !v.kind.is_special()
                        && !matches!(
                            v.kind,
                            VmaKind::SysvShm | VmaKind::Aio | VmaKind::PacketRing
                        ) =>
                {
                    at = v.end
                }
                _ => {
                    return Err(format!(
                        "pages at {at:#x} lie outside the process's mappings"
                    ))
                }
            }
        }
        match r.at {
            PageAt::Store { block, .. } if block as usize >= blocks => {
                return Err(format!(
                    "pages at {:#x} refer to block {block} of a store of {blocks}",
                    r.vaddr
                ))
            }
            PageAt::Parent if ck.parent.is_none() => {
                return Err(format!(
                    "pages at {:#x} are in a parent image, and the image has none",
                    r.vaddr
                ))
            }
            _ => {}
        }
    }
    Ok(())
}
