//! The typed image: round trips, the checks of [`Checkpoint::decode`], and a
//! fixed-seed fuzz pass over the whole read path.

use super::fds::{EpollItem, FanotifyMark, FanotifyMarkOn, InotifyWatch, TimerFd};
use super::objects::{FileContent, Pipe, Pty, SockOpt, TcpConnection, UnixSocket};
use super::*;
use crate::dir::ImageDir;
use crate::fuzz::{mutate, read_image, Rng};
use crate::store::StoreWriter;
use crate::PageWriter;
use std::path::Path;

fn thread(tid: u32) -> Thread {
    Thread {
        tid,
        ns_tid: tid,
        regs: GpRegs {
            rip: 0x40_1000,
            rsp: 0x7ffd_0000_1000,
            orig_rax: u64::MAX,
            ..Default::default()
        },
        xstate: vec![0; 1088],
        rseq: Some(Rseq {
            addr: 0x7f00_0000_0020,
            len: 32,
            signature: 0x5305_3053,
        }),
        clear_child_tid: 0x7f00_0000_1000,
        pdeathsig: 0,
        robust_list: 0x7f00_0000_2000,
        robust_list_len: 24,
        affinity: vec![0, 2, 3],
        sigmask: 1 << 9,
        pending: vec![SigInfo::new({
            let mut s = [0u8; 128];
            s[0] = 10;
            s
        })],
        sigaltstack: AltStack::default(),
        comm: "worker".into(),
        timer_slack_ns: 50_000,
        ioprio: Some(2 << 13 | 4),
        sched: Some(Sched {
            policy: 5 | crate::model::task::SCHED_RESET_ON_FORK,
            priority: 0,
            nice: 7,
        }),
        cgroups: vec![Cgroup {
            controllers: "name=work".into(),
            path: "/job/thread".into(),
        }],
        seccomp: ThreadSeccomp {
            mode: SeccompMode::Filter,
            chain: vec![0, 1, 0],
        },
    }
}

/// An AIO ring of two pages with two completed events not yet reaped.
fn aio_ring() -> AioRing {
    AioRing {
        nr: 255,
        head: 254,
        tail: 1,
        events: (0..64).collect(),
    }
}

fn vma(start: u64, end: u64, kind: VmaKind) -> Vma {
    Vma {
        start,
        end,
        prot: 3,
        shared: matches!(kind, VmaKind::AnonShared | VmaKind::SysvShm),
        kind,
        pgoff: 0,
        path: if kind.is_file() {
            "/usr/bin/x".into()
        } else {
            String::new()
        },
        dev: 0,
        inode: 0,
        vm_flags: vec!["rd".into(), "wr".into()],
        anon_name: String::new(),
        shm_owner: None,
        object: None,
        aio: None,
        guards: Vec::new(),
        huge_page_size: 0,
        relink: None,
    }
}

fn fd(n: i32, kind: FdKind) -> Fd {
    Fd {
        fd: n,
        flags: 2,
        pos: 0,
        path: format!("fd{n}"),
        shared: None,
        locks: Vec::new(),
        owner: None,
        signal: 0,
        kind,
    }
}

/// A process with `blocks` store blocks to refer to.
fn process(pid: u32, ppid: u32, parent: bool) -> Process {
    let mut runs = vec![PageRun {
        vaddr: 0x1000_0000,
        pages: 4,
        at: PageAt::Store { block: 0, page: 0 },
    }];
    runs.push(PageRun {
        vaddr: 0x1000_4000,
        pages: 2,
        at: if parent {
            PageAt::Parent
        } else {
            PageAt::Store { block: 0, page: 1 }
        },
    });
    runs.push(PageRun {
        vaddr: 0x2000_0000,
        pages: 1,
        at: PageAt::Zero,
    });
    let hashed: u64 = runs
        .iter()
        .filter(|r| r.at != PageAt::Zero)
        .map(|r| r.pages as u64)
        .sum();
    Process {
        pid,
        ppid,
        pgid: pid,
        sid: pid,
        ns_pid: 0,
        ns_pgid: 0,
        ns_sid: 0,
        state: ProcState::Running,
        exit_signal: 17,
        fd_table_of: None,
        fs_of: None,
        cgroups: vec![
            Cgroup {
                controllers: String::new(),
                path: "/job/rank".into(),
            },
            Cgroup {
                controllers: "cpu,cpuacct".into(),
                path: "/".into(),
            },
        ],
        task: Task {
            comm: "x".into(),
            exe: "/usr/bin/x".into(),
            cwd: "/".into(),
            umask: 0o22,
            personality: 0,
            cmdline: b"x\0-v\0".to_vec(),
            exe_build_id: vec![1, 2, 3],
            sched_policy: 3,
            sched_priority: 0,
            nice: 5,
            oom_score_adj: 300,
            child_subreaper: true,
            thp_disable: true,
            root: "/".into(),
            timer_slack_ns: 60_000,
            ioprio: 2 << 13 | 6,
            membarrier: 1 << 4,
        },
        mm: Mm {
            auxv: vec![0; 64],
            ..Default::default()
        },
        vmas: vec![
            vma(0x1000_0000, 0x1001_0000, VmaKind::AnonPrivate),
            Vma {
                path: "/d/sub/f (deleted)".into(),
                relink: Some("/d/.cr-relink.fd00.12".into()),
                ..vma(0x2000_0000, 0x2000_1000, VmaKind::FilePrivate)
            },
            vma(0x3000_0000, 0x3000_2000, VmaKind::AnonShared),
            Vma {
                inode: 5,
                pgoff: 4096,
                ..vma(0x4000_0000, 0x4000_1000, VmaKind::SysvShm)
            },
            Vma {
                aio: Some(aio_ring()),
                ..vma(0x5000_0000, 0x5000_2000, VmaKind::Aio)
            },
            Vma {
                inode: 44,
                path: "socket:[44]".into(),
                shared: true,
                ..vma(0x5100_0000, 0x5100_2000, VmaKind::PacketRing)
            },
            Vma {
                huge_page_size: 2 << 20,
                vm_flags: vec!["rd".into(), "wr".into(), "ht".into()],
                ..vma(0x6000_0000, 0x6040_0000, VmaKind::AnonPrivate)
            },
            vma(0x7fff_0000_0000, 0x7fff_0000_2000, VmaKind::Vdso),
        ],
        memory: Memory {
            runs,
            hashes: (0..hashed).collect(),
            parent_hashes_omitted: false,
            dirty: if parent {
                DirtyMethod::UffdWp
            } else {
                DirtyMethod::Full
            },
            tracking: Some(DirtyMethod::UffdWp),
            stats: MemStats::default(),
        },
        threads: vec![thread(pid), thread(pid + 1)],
        signals: Signals {
            actions: vec![SigAction {
                signo: 2,
                handler: 0x40_2000,
                flags: 0x0400_0000,
                restorer: 0x40_3000,
                mask: 0,
            }],
            shared_pending: Vec::new(),
        },
        timers: Timers {
            itimers: vec![ITimer {
                which: 0,
                interval_us: 0,
                value_us: 5000,
            }],
            posix: vec![
                PosixTimer {
                    id: 0,
                    clockid: 1,
                    notify: Notify::Signal,
                    signo: 14,
                    sigval: 7,
                    value_ns: 1_000_000,
                    interval_ns: 0,
                    overrun: 0,
                },
                PosixTimer {
                    id: 3,
                    clockid: 0,
                    notify: Notify::Thread(pid as i32 + 1),
                    signo: 34,
                    sigval: 0,
                    value_ns: 0,
                    interval_ns: 5,
                    overrun: 2,
                },
            ],
        },
        identity: Identity {
            creds: Creds {
                cap_bnd: u64::MAX >> 23,
                dumpable: 1,
                ..Default::default()
            },
            rlimits: vec![
                RLimit {
                    soft: 8 << 20,
                    hard: u64::MAX
                };
                16
            ],
            loginuid: Some(1000),
        },
        fds: vec![
            fd(
                0,
                FdKind::Inherited {
                    termios: vec![0; 60],
                    winsize: vec![0; 8],
                    outside: "a terminal".into(),
                },
            ),
            fd(1, FdKind::Pipe { object: 11 }),
            fd(
                2,
                FdKind::Regular {
                    size: 10,
                    relink: Some("/d/.cr-relink-1-2".into()),
                },
            ),
            fd(3, FdKind::Directory),
            fd(
                4,
                FdKind::CharDevice {
                    rdev: 0x103,
                    mode: 0o666,
                    uid: 1234,
                    gid: 2345,
                },
            ),
            fd(5, FdKind::Memfd { object: 21 }),
            fd(6, FdKind::UnixSocket { object: 31 }),
            fd(7, FdKind::UnixSocket { object: 32 }),
            fd(8, FdKind::InetSocket { object: 41 }),
            fd(
                9,
                FdKind::Eventfd {
                    count: 3,
                    semaphore: true,
                },
            ),
            fd(10, FdKind::Signalfd { mask: 1 << 1 }),
            fd(
                11,
                FdKind::Timerfd(TimerFd {
                    clockid: 1,
                    ticks: 2,
                    settime_flags: 0,
                    value_ns: 5,
                    interval_ns: 6,
                }),
            ),
            fd(
                12,
                FdKind::Epoll {
                    items: vec![EpollItem {
                        tfd: 9,
                        events: 1,
                        data: 9,
                        open_as: None,
                    }],
                },
            ),
            fd(
                13,
                FdKind::Inotify {
                    watches: vec![
                        InotifyWatch {
                            wd: 1,
                            mask: 2,
                            path: "/tmp".into(),
                            deleted_file: None,
                        },
                        InotifyWatch {
                            wd: 3,
                            mask: 6,
                            path: "/tmp/x (deleted)".into(),
                            deleted_file: Some(77),
                        },
                    ],
                },
            ),
            fd(
                14,
                FdKind::Pty {
                    object: 3,
                    master: true,
                },
            ),
            Fd {
                shared: Some(SharedFd { pid, fd: 2 }),
                locks: vec![
                    FileLock {
                        kind: LockKind::Posix,
                        write: true,
                        start: 0,
                        len: 0,
                        breaking: None,
                    },
                    FileLock {
                        kind: LockKind::Lease,
                        write: false,
                        start: 0,
                        len: 0,
                        breaking: None,
                    },
                    FileLock {
                        kind: LockKind::Lease,
                        write: true,
                        start: 0,
                        len: 0,
                        breaking: Some(LeaseBreak::ToRead),
                    },
                ],
                owner: Some(FdOwner {
                    kind: 1,
                    pid: pid as i32,
                }),
                signal: 10,
                ..fd(
                    15,
                    FdKind::Regular {
                        size: 10,
                        relink: None,
                    },
                )
            },
            fd(16, FdKind::InetSocket { object: 42 }),
            fd(17, FdKind::NetlinkSocket { object: 43 }),
            fd(18, FdKind::PacketSocket { object: 44 }),
            fd(
                20,
                FdKind::Fanotify {
                    flags: 0xc02,
                    event_flags: 0x8000,
                    marks: vec![
                        FanotifyMark {
                            on: FanotifyMarkOn::Inode,
                            path: "/tmp/w".into(),
                            mflags: 0x200,
                            mask: 0x4000_0100,
                            ignored_mask: 1,
                        },
                        FanotifyMark {
                            on: FanotifyMarkOn::Filesystem,
                            path: "/".into(),
                            mflags: 0,
                            mask: 8,
                            ignored_mask: 0,
                        },
                    ],
                },
            ),
            fd(
                21,
                FdKind::BlockDevice {
                    rdev: 0x700,
                    mode: 0o600,
                    uid: 0,
                    gid: 6,
                },
            ),
        ],
        ctty_pty: Some(3),
        ctty_device: 0x405,
        seccomp_filters: vec![
            SeccompFilter {
                program: vec![6, 0, 0, 0, 0, 0, 0xff, 0x7f],
                flags: 0,
            },
            SeccompFilter {
                program: vec![0; 16],
                flags: 2,
            },
        ],
    }
}

fn objects() -> Vec<Object> {
    let obj = |id, kind| Object { id, kind };
    vec![
        obj(
            11,
            ObjectKind::Pipe(Pipe {
                data: b"hello".to_vec(),
                capacity: 65536,
            }),
        ),
        obj(
            21,
            ObjectKind::Memfd(FileContent {
                name: "m".into(),
                size: 8192,
                mode: 0o600,
                seals: 0,
                atime_ns: 1_700_000_000_123_456_789,
                mtime_ns: 1_600_000_000_000_000_001,
                owner: Some((1000, 100)),
                huge_page_size: 0,
                content: Some(PageFile {
                    name: "file-21.img".into(),
                    size: 8192,
                    extents: vec![PageExtent {
                        file_offset: 0,
                        pages: 2,
                        offset: 0,
                        xxh3: crate::checksum(&[7u8; 8192]),
                    }],
                }),
            }),
        ),
        obj(
            31,
            ObjectKind::UnixSocket(UnixSocket {
                sock_type: 1,
                state: 1,
                peer: 32,
                queue: vec![b"q".to_vec()],
                peek_off: -1,
                ..Default::default()
            }),
        ),
        obj(
            32,
            ObjectKind::UnixSocket(UnixSocket {
                sock_type: 1,
                state: 1,
                peer: 31,
                peek_off: -1,
                ..Default::default()
            }),
        ),
        obj(
            41,
            ObjectKind::InetSocket(objects::InetSocket {
                family: 2,
                sock_type: 1,
                protocol: 6,
                state: 4, // FIN-WAIT-1
                local: "127.0.0.1:5000".parse().ok(),
                remote: "127.0.0.1:6000".parse().ok(),
                backlog: 0,
                tcp: Some(TcpConnection {
                    send_queue: b"abc".to_vec(),
                    unsent: 1,
                    fin_unsent: true,
                    ..Default::default()
                }),
                opts: vec![SockOpt {
                    level: 6,
                    name: 1,
                    value: vec![1, 0, 0, 0],
                }],
                shutdown: 1,
                received: vec![],
            }),
        ),
        obj(
            42,
            ObjectKind::InetSocket(objects::InetSocket {
                family: 2,
                sock_type: 3, // a raw ICMP socket
                protocol: 1,
                state: 7,
                local: "127.0.0.1:1".parse().ok(),
                ..Default::default()
            }),
        ),
        obj(
            43,
            ObjectKind::NetlinkSocket(objects::NetlinkSocket {
                sock_type: 3,
                protocol: 0,
                portid: 4242,
                groups: vec![1, 33],
                dst_portid: 0,
                dst_groups: 1,
                opts: vec![],
            }),
        ),
        obj(
            44,
            ObjectKind::PacketSocket(objects::PacketSocket {
                sock_type: 2,
                protocol: 0x0008,
                ifname: "lo".into(),
                opts: vec![],
                memberships: vec![objects::PacketMembership {
                    ifname: "lo".into(),
                    kind: 1,
                    address: vec![],
                    count: 2,
                }],
                rx_ring: Some(objects::PacketRing {
                    block_size: 4096,
                    block_nr: 1,
                    frame_size: 2048,
                    frame_nr: 2,
                    ..Default::default()
                }),
                tx_ring: Some(objects::PacketRing {
                    block_size: 4096,
                    block_nr: 1,
                    frame_size: 2048,
                    frame_nr: 2,
                    ..Default::default()
                }),
                fanout: 4242,
            }),
        ),
        obj(
            77,
            ObjectKind::BpfMap(objects::BpfMap {
                map_type: 6,
                key_size: 4,
                value_size: 5,
                max_entries: 8,
                map_flags: 4,
                name: "counts".into(),
                map_extra: 0,
                frozen: true,
                cpus: 2,
                entries: vec![(vec![1, 0, 0, 0], vec![7; 16])],
            }),
        ),
        obj(
            3,
            ObjectKind::Pty(Pty {
                index: 3,
                fg_pgrp: 100,
                termios: vec![0; 60],
                winsize: vec![0; 8],
                locked: false,
                devpts: String::new(),
                input_lines: vec![b"ls\n".to_vec(), Vec::new()],
                input: b"cd /".to_vec(),
                output: b"$ ".to_vec(),
                packet: true,
                packet_status: 0x21,
                slave_mode: 0o620,
                slave_uid: 1000,
                slave_gid: 5,
                hung_up: false,
            }),
        ),
    ]
}

fn checkpoint(id: &str, parent: Option<&str>, store: PageStore) -> Checkpoint {
    let mut child = process(102, 100, parent.is_some());
    child.vmas[2].shm_owner = Some(ShmOwner {
        pid: 100,
        start: 0x3000_0000,
        end: 0x3000_2000,
    });
    child.fds[15].shared = Some(SharedFd { pid: 100, fd: 2 });
    child.ctty_pty = None;
    child.fs_of = Some(100);
    Checkpoint {
        meta: Meta {
            image_id: id.into(),
            ..Default::default()
        },
        root_pid: 100,
        pidns: false,
        processes: vec![
            process(100, 1, parent.is_some()),
            child,
            Process {
                pid: 105,
                ppid: 100,
                state: ProcState::Zombie { exit_status: 3 },
                ..Default::default()
            },
        ],
        objects: objects(),
        netlock: Some("cr_lock_100_1".into()),
        parent: parent.map(|p| ParentRef {
            path: "../parent".into(),
            image_id: p.into(),
        }),
        store: Some(store),
        pre_dump: false,
        sysv: Some(sysv()),
        mounts: Some(MountNs {
            proc: true,
            dev_shm: Some(Tmpfs {
                mode: 0o1777,
                entries: vec![
                    tmpfs_entry("d", TmpfsKind::Dir),
                    tmpfs_entry(
                        "d/f",
                        TmpfsKind::File {
                            size: 5000,
                            content: Some(PageFile {
                                name: "shm-file-1.img".into(),
                                size: 8192,
                                extents: Vec::new(),
                            }),
                        },
                    ),
                    tmpfs_entry(
                        "l",
                        TmpfsKind::Symlink {
                            target: "d/f".into(),
                        },
                    ),
                ],
            }),
            devpts: true,
            others: vec![
                Mount {
                    mount_point: "/mnt/b".into(),
                    kind: MountKind::Bind("/srv/data".into()),
                    flags: 1 | 2,
                    data: String::new(),
                    propagation: Propagation::Slave,
                },
                Mount {
                    mount_point: "/mnt/t".into(),
                    kind: MountKind::Tmpfs(Tmpfs {
                        mode: 0o755,
                        entries: vec![tmpfs_entry("x", TmpfsKind::Dir)],
                    }),
                    flags: 0,
                    data: "size=1m".into(),
                    propagation: Propagation::Private,
                },
                Mount {
                    mount_point: "/mnt/t/x".into(),
                    kind: MountKind::Fs("mqueue".into()),
                    flags: 8,
                    data: String::new(),
                    propagation: Propagation::Shared,
                },
            ],
        }),
        job_dir: Some("/var/tmp/job".into()),
        uts: Some(UtsNs {
            hostname: "n1".into(),
            domainname: "(none)".into(),
        }),
        cgroupns: Some(vec![Cgroup {
            controllers: String::new(),
            path: "/job".into(),
        }]),
        netns: Some(NetNs {
            devices: vec![NetDevice {
                name: "lo".into(),
                up: true,
            }],
        }),
        outside_files: vec![OutsideFile {
            path: "/usr/bin/python3".into(),
            used_by: "the executable of process 100".into(),
            mode: 0o100755,
            size: 1000,
            mtime_ns: 1_700_000_000_000_000_000,
            dev: 0x803,
            ino: 42,
            build_id: vec![0xab; 20],
            saved: None,
            write_only: false,
            listed: false,
        }],
        cgroup_dirs: vec![CgroupDir {
            controllers: "name=work".into(),
            path: "/job/empty".into(),
            uid: 1000,
            gid: 1000,
            mode: 0o755,
            settings: vec![("notify_on_release".into(), "1".into())],
            files: vec![("cgroup.procs".into(), 1000, 1000, 0o644)],
        }],
        cgroup_frames: vec![Cgroup {
            controllers: "name=work".into(),
            path: "/job".into(),
        }],
    }
}

fn tmpfs_entry(path: &str, kind: TmpfsKind) -> TmpfsEntry {
    TmpfsEntry {
        path: path.into(),
        mode: 0o640,
        uid: 1,
        gid: 2,
        mtime_ns: 1_700_000_000_000_000_000,
        kind,
    }
}

fn sysv() -> SysvIpc {
    let perm = |key| IpcPerm {
        key,
        uid: 1,
        gid: 2,
        cuid: 0,
        cgid: 0,
        mode: 0o600,
    };
    SysvIpc {
        own_namespace: true,
        sysctls: vec![("msgmnb".into(), "16384".into())],
        shm: vec![ShmSegment {
            id: 5,
            perm: perm(0x1234),
            size: 6000,
            removed: false,
            locked: false,
            hugetlb: false,
            cpid: 100,
            lpid: 102,
            nattch: 2,
            content: Some(PageFile {
                name: "sysv-shm-5.img".into(),
                size: 4096,
                extents: Vec::new(),
            }),
        }],
        sem: vec![SemSet {
            id: 32768,
            perm: perm(0x1234),
            values: vec![1, 0, 32767],
            pids: vec![100, 0, 102],
        }],
        msg: vec![MsgQueue {
            id: 0,
            perm: perm(0),
            qbytes: 16384,
            messages: vec![
                SysvMessage {
                    mtype: 3,
                    text: b"first".to_vec(),
                },
                SysvMessage {
                    mtype: 1,
                    text: Vec::new(),
                },
            ],
        }],
    }
}

const PARENT_ID: &str = "0123456789abcdef0123456789abcdef";
const CHILD_ID: &str = "fedcba9876543210fedcba9876543210";

/// A real store of one block of 4 pages, and the memfd's content file.
fn write_files(dir: &ImageDir, tag: &str) -> PageStore {
    let w = StoreWriter::create(dir, tag, Compression::None).unwrap();
    let mut cur = None;
    for i in 0..4u8 {
        let page = [i + 1; 4096];
        w.add(&mut cur, crate::store::page_hash(&page), &page)
            .unwrap();
    }
    w.close(cur).unwrap();
    let store = w.finish(false).unwrap();
    let pw = PageWriter::create_named(dir, "file-21.img").unwrap();
    pw.write_at(0, &[7u8; 8192]).unwrap();
    pw.finish(8192, Vec::new(), false).unwrap();
    for (name, size) in [("sysv-shm-5.img", 4096), ("shm-file-1.img", 8192)] {
        let pw = PageWriter::create_named(dir, name).unwrap();
        pw.write_at(0, &vec![9u8; size]).unwrap();
        pw.finish(size as u64, Vec::new(), false).unwrap();
    }
    store
}

/// A parent image and a child of it, committed in `root`.
fn images(root: &Path) -> (Checkpoint, std::path::PathBuf) {
    let pdir = ImageDir::create(&root.join("parent")).unwrap();
    let store = write_files(&pdir, "p");
    pdir.commit(&mut checkpoint(PARENT_ID, None, store), false)
        .unwrap();
    let cdir = ImageDir::create(&root.join("child")).unwrap();
    let store = write_files(&cdir, "c");
    let mut ck = checkpoint(CHILD_ID, Some(PARENT_ID), store);
    cdir.commit(&mut ck, false).unwrap();
    (ck, cdir.path().to_path_buf())
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cr-image-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn every_section_round_trips() {
    let root = tmp("roundtrip");
    let (ck, dir) = images(&root);
    // Read by itself, the child lacks its parent pages' hashes: the
    // parent's fill them in.
    let chain = crate::chain::Chain::open(&dir).unwrap();
    let filled = |mut c: Checkpoint| {
        for p in &mut c.processes {
            p.memory
                .fill_parent_hashes(chain.links[1].memory(p.pid))
                .unwrap();
        }
        c
    };
    let back = Checkpoint::decode(&ck.encode()).unwrap();
    assert_eq!(filled(back), ck);
    let read = read_image(&dir, &ck.encode()).unwrap();
    assert_eq!(filled(read), ck);
    let json = serde_json::to_value(crate::show::view(&ck)).unwrap();
    assert_eq!(json["processes"][0]["fds"][1]["kind"], "pipe");
    assert_eq!(
        json["objects"][0]["summary"],
        "pipe:[11] 5 bytes buffered, capacity 65536"
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// The encoder borrows the page hashes: the same bytes as a copy gives,
/// and the hashes are back in place after.
#[test]
fn encode_lending_is_encode_and_gives_the_hashes_back() {
    let root = tmp("lending");
    let (mut ck, _) = images(&root);
    let before = ck.clone();
    assert!(before.processes.iter().any(|p| !p.memory.hashes.is_empty()));
    assert_eq!(ck.encode_lending(), before.encode());
    assert_eq!(ck, before);
    std::fs::remove_dir_all(root).unwrap();
}

/// An image with parent pages writes only its stored pages' hashes; read
/// by itself it says so, and opened as a chain it has them all again,
/// taken from its parent.
#[test]
fn parent_pages_hashes_are_left_to_the_parent() {
    let root = tmp("omitted");
    let (ck, dir) = images(&root);
    let full = &ck.processes[0].memory;
    assert!(full.has_parent_pages() && !full.parent_hashes_omitted);
    let alone = Checkpoint::decode(&ck.encode()).unwrap();
    let mem = &alone.processes[0].memory;
    assert!(mem.parent_hashes_omitted);
    assert_eq!(mem.hashes, [0, 1, 2, 3], "the stored pages' hashes only");
    assert_eq!(mem.hashed_pages(), 4);
    // An index of it knows no hash of a parent page, and the stored ones'.
    let ix = crate::chain::MemIndex::new(mem);
    assert_eq!(ix.hash_of(0x1000_0000 + 3 * 4096), Some(3));
    assert_eq!(ix.hash_of(0x1000_4000), None);
    assert_eq!(ix.cursor().hashes_from(0x1000_4000), Err(0x1000_6000));
    let chain = crate::chain::Chain::open(&dir).unwrap();
    assert_eq!(chain.top().ck, ck, "the chain has every hash again");
    // Without the parent's pages there is nothing to fill them from.
    let mut lost = mem.clone();
    let e = lost.fill_parent_hashes(None).unwrap_err();
    assert!(e.contains("holds no page at 0x10004000"), "{e}");
    // Images written before format 3.1 hold every hash: read as they are.
    let mut old = ck.to_pb();
    for p in &mut old.processes {
        let m = p.memory.as_mut().unwrap();
        m.parent_hashes_omitted = false;
    }
    let mut old_full = ck.clone();
    for (p, q) in old.processes.iter_mut().zip(&mut old_full.processes) {
        p.memory.as_mut().unwrap().hashes = q.memory.hashes.clone();
        q.memory.parent_hashes_omitted = false;
    }
    use prost::Message;
    assert_eq!(Checkpoint::decode(&old.encode_to_vec()).unwrap(), old_full);
    std::fs::remove_dir_all(root).unwrap();
}

/// Each of these is refused by name (and none panics).
#[test]
fn crafted_images_are_refused() {
    type Edit = fn(&mut Checkpoint);
    let cases: &[(&str, Edit)] = &[
        ("missing from the image", |c| {
            c.processes[0].fds[1].kind = FdKind::Pipe { object: 99 }
        }),
        ("overlap", |c| c.processes[0].vmas[1].start = 0x1000_f000),
        ("outside the process's mappings", |c| {
            c.processes[0].memory.runs[2].vaddr = 0x5000_0000
        }),
        ("page hashes", |c| {
            // One of the stored pages' (the last two are the parent's).
            c.processes[0].memory.hashes.truncate(3);
        }),
        ("block 7", |c| {
            c.processes[0].memory.runs[0].at = PageAt::Store { block: 7, page: 0 }
        }),
        ("not the main thread", |c| c.processes[0].threads.swap(0, 1)),
        ("not listed before it", |c| c.processes[1].ppid = 4242),
        ("not restored before it", |c| {
            c.processes[0].fds[15].shared = Some(SharedFd { pid: 102, fd: 2 })
        }),
        ("which is not open", |c| {
            if let FdKind::Epoll { items } = &mut c.processes[0].fds[12].kind {
                items[0].tfd = 77;
            }
        }),
        ("shares memory of process", |c| {
            c.processes[1].vmas[2].shm_owner.as_mut().unwrap().start = 0x3100_0000
        }),
        ("bad image id", |c| c.meta.image_id = "../../etc".into()),
        ("XSAVE area", |c| {
            c.processes[0].threads[0].xstate.truncate(10)
        }),
        ("peer socket", |c| {
            if let ObjectKind::UnixSocket(u) = &mut c.objects[2].kind {
                u.peer = 5;
            }
        }),
        ("bad file name", |c| {
            c.store.as_mut().unwrap().name = "../x".into()
        }),
        ("attaches System V shared memory 6", |c| {
            c.processes[0].vmas[3].inode = 6
        }),
        ("attaches System V shared memory 5", |c| {
            c.processes[0].vmas[3].pgoff = 8192
        }),
        ("semaphore set 7 is listed twice", |c| {
            let s = c.sysv.as_mut().unwrap();
            s.sem[0].id = 7;
            let mut again = s.sem[0].clone();
            again.perm.key = 0;
            s.sem.push(again);
        }),
        ("a semaphore value of 40000", |c| {
            c.sysv.as_mut().unwrap().sem[0].values[1] = 40000
        }),
        ("refers to process 77", |c| {
            c.sysv.as_mut().unwrap().sem[0].pids[1] = 77
        }),
        ("message 1: type 0", |c| {
            c.sysv.as_mut().unwrap().msg[0].messages[1].mtype = 0
        }),
        ("bad IPC limit", |c| {
            c.sysv.as_mut().unwrap().sysctls[0].0 = "core_pattern".into()
        }),
        ("not listed before it", |c| {
            c.mounts
                .as_mut()
                .unwrap()
                .dev_shm
                .as_mut()
                .unwrap()
                .entries
                .swap(0, 1)
        }),
        ("bad path", |c| {
            c.mounts.as_mut().unwrap().dev_shm.as_mut().unwrap().entries[2].path = "../l".into()
        }),
        ("bad job directory", |c| c.job_dir = Some("rel".into())),
        ("damaged pseudo-terminal 3", |c| {
            for o in &mut c.objects {
                if let ObjectKind::Pty(p) = &mut o.kind {
                    p.devpts = "/mnt/pts".into();
                }
            }
        }),
        ("exit signal 99", |c| c.processes[1].exit_signal = 99),
        ("shares the fd table of 100 and lists fds of its own", |c| {
            c.processes[1].fd_table_of = Some(100)
        }),
        (
            "shares the working directory and umask of 105, not a live",
            |c| c.processes[1].fs_of = Some(105),
        ),
        ("shares the fd table of 102, not a live", |c| {
            c.processes[0].fd_table_of = Some(102)
        }),
        ("bad cgroup path", |c| {
            c.processes[1].cgroups[0].path = "/job/../escape".into()
        }),
        ("cgroup hierarchy \"\" twice", |c| {
            let again = c.processes[1].cgroups[0].clone();
            c.processes[1].cgroups.push(again)
        }),
        ("not a job-control stop", |c| {
            c.processes[1].state = ProcState::Stopped { signal: 9 }
        }),
        ("a CPU affinity not ascending", |c| {
            c.processes[0].threads[0].affinity = vec![3, 1]
        }),
        (
            "rings of packet socket:[99], which the process does not hold",
            |c| c.processes[0].vmas[5].inode = 99,
        ),
        ("beyond the 8192 bytes of the rings", |c| {
            c.processes[0].vmas[5].pgoff = 4096
        }),
        ("damaged transmit ring", |c| {
            for o in &mut c.objects {
                if let ObjectKind::PacketSocket(p) = &mut o.kind {
                    p.tx_ring.as_mut().unwrap().frame_nr = 3;
                }
            }
        }),
        ("BPF map 77", |c| {
            for o in &mut c.objects {
                if let ObjectKind::BpfMap(m) = &mut o.kind {
                    m.cpus = 3;
                }
            }
        }),
        ("bad host name", |c| {
            c.uts.as_mut().unwrap().hostname = "x".repeat(65)
        }),
    ];
    for (want, edit) in cases {
        let mut ck = checkpoint(
            CHILD_ID,
            Some(PARENT_ID),
            PageStore {
                name: "pages-c.img".into(),
                size: 16384,
                compression: Compression::None,
                blocks: vec![StoreBlock {
                    offset: 0,
                    stored_len: 16384,
                    pages: 4,
                    xxh3: 0,
                    raw: true,
                }],
            },
        );
        Checkpoint::decode(&ck.encode()).expect("the unedited image is valid");
        edit(&mut ck);
        let err = Checkpoint::decode(&ck.encode()).expect_err(want);
        assert!(err.contains(want), "{want:?} not in {err:?}");
    }
}

/// Unions and enums this build does not know are refused, never defaulted.
#[test]
fn unknown_cases_are_refused() {
    let root = tmp("unknown");
    let (ck, _) = images(&root);
    let mut p = ck.to_pb();
    p.processes[0].fds[3].kind = None;
    let e = Checkpoint::decode(&prost::Message::encode_to_vec(&p)).unwrap_err();
    assert!(
        e.contains("fd 3: of a kind this build does not know"),
        "{e}"
    );
    let mut p = ck.to_pb();
    p.processes[0].vmas[0].kind = 99;
    let e = Checkpoint::decode(&prost::Message::encode_to_vec(&p)).unwrap_err();
    assert!(e.contains("unknown value 99"), "{e}");
    std::fs::remove_dir_all(root).unwrap();
}

/// The fixed-seed fuzz pass of the suite: thousands of images damaged deep
/// inside their protobuf go through the whole read path; none may panic.
#[test]
fn fuzz_pass_finds_no_panic() {
    let root = tmp("fuzz");
    let (ck, dir) = images(&root);
    let good = ck.encode();
    let iterations: u64 = std::env::var("CR_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000);
    let mut rng = Rng::new(0x5eed_cafe);
    let (mut ok, mut refused) = (0u64, 0u64);
    for i in 0..iterations {
        let mut bytes = good.clone();
        for _ in 0..=rng.below(3) {
            bytes = mutate(&mut rng, &bytes);
        }
        let r = std::panic::catch_unwind(|| {
            // Decode alone is fast; the whole path (files) every 8th time.
            if i % 8 == 0 {
                read_image(&dir, &bytes).map(|_| ())
            } else {
                Checkpoint::decode(&bytes)
                    .map(|_| ())
                    .map_err(|what| crate::ImageError::Invalid {
                        path: dir.clone(),
                        what,
                    })
            }
        });
        match r {
            Ok(Ok(())) => ok += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!(
                "iteration {i}: the image reader panicked on {} bytes: {:02x?}",
                bytes.len(),
                bytes
            ),
        }
    }
    eprintln!("fuzz pass: {iterations} images, {ok} read, {refused} refused");
    assert!(
        refused > iterations / 4,
        "the mutator hardly damages anything"
    );
    std::fs::remove_dir_all(root).unwrap();
}
