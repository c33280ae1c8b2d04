//! What fds (of one or several processes) and mappings share, saved once
//! per image: pipes and FIFOs with their buffered bytes (kind "pipes"),
//! unix sockets ("unix"), TCP/UDP sockets ("inet"), the content of memfds
//! and deleted files ("files"), pseudo-terminal pairs ("tty"), POSIX
//! message queues with their messages ("mqueue"), BPF maps with their
//! entries ("bpf").

use super::fds::{Fd, FdKind, TERMIOS_LEN, WINSIZE_LEN};
use super::memory::{PageFile, PAGE};
use super::{pb, ser, Bad, Checkpoint};
use serde::Serialize;
use std::net::SocketAddr;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Object {
    /// Unique within its kind (an inode number, or a pty index).
    pub id: u64,
    #[serde(flatten)]
    pub kind: ObjectKind,
}

/// Which kind an object is (fds and mappings refer to objects by kind and id).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum ObjectTag {
    Pipe,
    Fifo,
    UnixSocket,
    InetSocket,
    Memfd,
    DeletedFile,
    Pty,
    SavedFile,
    NetlinkSocket,
    PacketSocket,
    Mqueue,
    BpfMap,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ObjectKind {
    Pipe(Pipe),
    Fifo(Fifo),
    UnixSocket(UnixSocket),
    InetSocket(InetSocket),
    Memfd(FileContent),
    DeletedFile(FileContent),
    Pty(Pty),
    /// The content of an outside file (`--save-files`); `name` is its path.
    SavedFile(FileContent),
    NetlinkSocket(NetlinkSocket),
    PacketSocket(PacketSocket),
    Mqueue(Mqueue),
    BpfMap(BpfMap),
}

impl ObjectKind {
    pub fn tag(&self) -> ObjectTag {
        match self {
            ObjectKind::Pipe(_) => ObjectTag::Pipe,
            ObjectKind::Fifo(_) => ObjectTag::Fifo,
            ObjectKind::UnixSocket(_) => ObjectTag::UnixSocket,
            ObjectKind::InetSocket(_) => ObjectTag::InetSocket,
            ObjectKind::Memfd(_) => ObjectTag::Memfd,
            ObjectKind::DeletedFile(_) => ObjectTag::DeletedFile,
            ObjectKind::Pty(_) => ObjectTag::Pty,
            ObjectKind::SavedFile(_) => ObjectTag::SavedFile,
            ObjectKind::NetlinkSocket(_) => ObjectTag::NetlinkSocket,
            ObjectKind::PacketSocket(_) => ObjectTag::PacketSocket,
            ObjectKind::Mqueue(_) => ObjectTag::Mqueue,
            ObjectKind::BpfMap(_) => ObjectTag::BpfMap,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pipe {
    /// Bytes buffered at checkpoint time.
    #[serde(rename = "buffered", serialize_with = "ser::len")]
    pub data: Vec<u8>,
    /// F_GETPIPE_SZ.
    pub capacity: u32,
}

/// A BPF map (kind "bpf"): the attributes it is made again with, and
/// its entries. The entries are stored inline, in the image's metadata,
/// bounded by [`BPF_MAP_MAX_BYTES`] (a bigger map is refused by name at
/// checkpoint); an array's all-zero values are left out (a new array is
/// zero-filled).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BpfMap {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// BPF_F_* the map keeps (BPF_F_NUMA_NODE is made again on node 0).
    pub map_flags: u32,
    pub name: String,
    pub map_extra: u64,
    /// BPF_MAP_FREEZE'd: frozen again once filled.
    pub frozen: bool,
    /// A per-CPU map: the number of possible CPUs at checkpoint time
    /// (each value holds one slot of `value_size` rounded up to 8 bytes
    /// per CPU); 0: not per-CPU.
    pub cpus: u32,
    /// (key, value) bytes.
    #[serde(serialize_with = "bpf_entries")]
    pub entries: Vec<(Vec<u8>, Vec<u8>)>,
}

/// Largest content of a BPF map saved (keys and values), stored inline.
pub const BPF_MAP_MAX_BYTES: usize = 64 << 20;

impl BpfMap {
    /// The length of one value as a lookup gives it (every CPU's slot for
    /// a per-CPU map).
    pub fn value_len(&self) -> usize {
        match self.cpus {
            0 => self.value_size as usize,
            n => (self.value_size as usize).div_ceil(8) * 8 * n as usize,
        }
    }
}

fn bpf_entries<S: serde::Serializer>(v: &[(Vec<u8>, Vec<u8>)], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(v.len() as u64)
}

/// A POSIX message queue (kind "mqueue").
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mqueue {
    /// Its name with the leading '/'.
    pub name: String,
    /// Unlinked while open: made again under no name.
    pub unlinked: bool,
    #[serde(serialize_with = "ser::octal")]
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub maxmsg: i64,
    pub msgsize: i64,
    /// In the order they are received: (priority, bytes).
    #[serde(serialize_with = "mq_messages")]
    pub messages: Vec<(u32, Vec<u8>)>,
}

fn mq_messages<S: serde::Serializer>(v: &[(u32, Vec<u8>)], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(v.len() as u64)
}

/// Largest message count and size accepted (the kernel's hard limits are
/// 65536 and 16 MiB).
const MQ_MAX_MSG: i64 = 65536;
const MQ_MAX_MSGSIZE: i64 = 16 << 20;

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Fifo {
    pub path: String,
    #[serde(rename = "buffered", serialize_with = "ser::len")]
    pub data: Vec<u8>,
    pub capacity: u32,
    /// Permission bits (0: not saved) and owner, for a FIFO removed while
    /// open (made again with them).
    #[serde(serialize_with = "ser::octal")]
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// The content of a file that exists nowhere else.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FileContent {
    /// memfd: its name without "memfd:"; deleted file: the path it had.
    pub name: String,
    pub size: u64,
    #[serde(serialize_with = "ser::octal")]
    pub mode: u32,
    /// F_SEAL_* (memfd).
    pub seals: u32,
    pub content: Option<PageFile>,
    /// Access and modification times, ns since the epoch (0: not saved).
    pub atime_ns: i64,
    pub mtime_ns: i64,
    /// Owner and group to give back (a deleted file), None: the restorer's.
    pub owner: Option<(u32, u32)>,
    /// A file of hugetlbfs (memfd_create with MFD_HUGETLB): the size of its
    /// pages; 0 for any other file system.
    pub huge_page_size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pty {
    /// /dev/pts/N.
    pub index: u32,
    /// Foreground process group of its terminal (an image pid, 0: none).
    pub fg_pgrp: u32,
    #[serde(skip)]
    pub termios: Vec<u8>,
    #[serde(skip)]
    pub winsize: Vec<u8>,
    /// Still locked (posix_openpt without unlockpt).
    pub locked: bool,
    /// Mount point of its devpts instance when not /dev/pts (empty:
    /// /dev/pts); the object id is then (K << 32) | index.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub devpts: String,
    /// Input waiting on the slave side, as its line discipline holds it:
    /// the complete lines of a canonical terminal (each as one read
    /// returns it; a line ended by EOF without the EOF character)...
    #[serde(serialize_with = "ser::total_len")]
    pub input_lines: Vec<Vec<u8>>,
    /// ...and the rest (the line being typed; all of a non-canonical
    /// terminal's input).
    #[serde(serialize_with = "ser::len")]
    pub input: Vec<u8>,
    /// Written on the slave side, not yet read on the master side.
    #[serde(serialize_with = "ser::len")]
    pub output: Vec<u8>,
    /// The master is in packet mode (TIOCPKT).
    pub packet: bool,
    /// The status byte pending for the master's next read in packet mode
    /// (TIOCPKT_* bits; 0: none).
    pub packet_status: u8,
    /// Permission bits (0: not saved) and owner of the slave's node.
    #[serde(serialize_with = "ser::octal")]
    pub slave_mode: u32,
    pub slave_uid: u32,
    pub slave_gid: u32,
    /// Its master was closed by every process that had it: the slave
    /// side is hung up and its node removed.
    pub hung_up: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct UnixSocket {
    /// SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET.
    #[serde(rename = "type")]
    pub sock_type: u32,
    /// As sock_diag reports it (TCP_ESTABLISHED, TCP_LISTEN, TCP_CLOSE...).
    pub state: u32,
    /// Empty: unbound; a leading NUL: abstract.
    #[serde(serialize_with = "ser::text")]
    pub name: Vec<u8>,
    /// The bound path no longer names it: bound again, then unlinked.
    pub name_unlinked: bool,
    /// Its file was renamed after the bind: the (absolute) path it has now;
    /// bound at `name` again, then renamed there. Empty: not moved.
    #[serde(serialize_with = "ser::text")]
    pub moved_to: Vec<u8>,
    /// Permission bits, owner and group of its file (0 bits: no file).
    pub file_mode: u32,
    pub file_uid: u32,
    pub file_gid: u32,
    /// Peer socket in the image (an object id), 0: none.
    pub peer: u64,
    /// Peer outside the image, reached again by name.
    #[serde(serialize_with = "ser::text")]
    pub peer_name: Vec<u8>,
    pub backlog: u32,
    /// Not yet accepted by this listener (an object id), 0: none.
    pub listener: u64,
    /// Receive queue: one entry per datagram, one for a stream.
    #[serde(rename = "queued_bytes", serialize_with = "ser::total_len")]
    pub queue: Vec<Vec<u8>>,
    /// Sender of each queued datagram (empty, or as long as `queue`).
    #[serde(skip)]
    pub queue_from: Vec<Vec<u8>>,
    /// 1: receive side shut, 2: send side.
    pub shutdown: u32,
    pub sndbuf: i32,
    pub rcvbuf: i32,
    pub passcred: bool,
    /// SO_PEEK_OFF (-1: off).
    pub peek_off: i32,
    /// Directory a relative name is bound or connected from.
    pub cwd: String,
    /// SOL_SOCKET options that differ from a fresh socket's.
    #[serde(rename = "options")]
    pub opts: Vec<SockOpt>,
    /// Files in flight (SCM_RIGHTS) with queued messages.
    pub in_flight: Vec<InFlight>,
    /// LISTEN: the connections not yet accepted, in their order, taken off
    /// the queue by a dump whose processes end (to read what their clients
    /// sent). Empty: those whose `listener` names this socket.
    pub pending: Vec<PendingConnection>,
    /// SO_PEERCRED (None: none).
    pub peer_cred: Option<PeerCred>,
}

/// A connected unix socket's SO_PEERCRED: the PID (in the tree's PID
/// namespace; that process may be gone), effective user and group the
/// kernel recorded for its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PeerCred {
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
}

/// A connection queued on a unix listener and not yet accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PendingConnection {
    /// The client socket (an object id); 0: the client had closed.
    pub client: u64,
    /// What the client had sent: one entry for a stream, one per message.
    #[serde(rename = "sent_bytes", serialize_with = "ser::total_len")]
    pub data: Vec<Vec<u8>>,
}

/// The files one queued unix message carries (SCM_RIGHTS), in their order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InFlight {
    /// The message (an index into [`UnixSocket::queue`]).
    pub message: u32,
    /// Each file as an fd of its own kind (`fd`: its place in the message;
    /// `shared`: the same open file description held by a process of the
    /// image, passed again).
    pub fds: Vec<Fd>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct InetSocket {
    pub family: u32,
    #[serde(rename = "type")]
    pub sock_type: u32,
    pub protocol: u32,
    /// TCP state (1 ESTABLISHED, 2 SYN-SENT, 4 FIN-WAIT-1, 5 FIN-WAIT-2,
    /// 7 CLOSE, 8 CLOSE-WAIT, 9 LAST-ACK, 10 LISTEN, 11 CLOSING); UDP: 1
    /// when connected.
    pub state: u32,
    pub local: Option<SocketAddr>,
    pub remote: Option<SocketAddr>,
    pub backlog: u32,
    /// A TCP connection (see [`TCP_CONNECTED`]), read in repair mode.
    pub tcp: Option<TcpConnection>,
    /// Options that differ from a fresh socket's, in order.
    #[serde(rename = "options")]
    pub opts: Vec<SockOpt>,
    /// shutdown(2) bits (1 receive side, 2 send side): of a UDP socket, of
    /// a TCP socket in state CLOSE (3 where a connection ended), or the
    /// receive side of an established TCP connection.
    pub shutdown: u32,
    /// UDP: the datagrams received and not read yet, oldest first.
    pub received: Vec<Datagram>,
}

/// A datagram waiting in a socket's receive queue, and who sent it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Datagram {
    pub from: SocketAddr,
    #[serde(rename = "bytes", serialize_with = "ser::len")]
    pub data: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct TcpConnection {
    pub snd_una: u32,
    pub snd_nxt: u32,
    /// After the last byte the program wrote.
    pub write_seq: u32,
    pub rcv_nxt: u32,
    /// Bytes snd_una..write_seq, of which the last `unsent` never left.
    #[serde(rename = "send_queue_bytes", serialize_with = "ser::len")]
    pub send_queue: Vec<u8>,
    #[serde(rename = "unsent_bytes")]
    pub unsent: u32,
    /// Received, not read yet.
    #[serde(rename = "recv_queue_bytes", serialize_with = "ser::len")]
    pub recv_queue: Vec<u8>,
    pub mss: u32,
    pub snd_wscale: u32,
    pub rcv_wscale: u32,
    /// tcpi_options bits (1 timestamps, 2 SACK, 4 window scaling).
    pub options: u32,
    pub timestamp: u32,
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
    /// The program's FIN never left (it waited behind data or a closed
    /// window).
    pub fin_unsent: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SockOpt {
    pub level: i32,
    pub name: i32,
    #[serde(serialize_with = "ser::hex_bytes")]
    pub value: Vec<u8>,
}

impl SockOpt {
    /// The value as an int (options of 4 bytes or more).
    pub fn int(&self) -> Option<i32> {
        self.value
            .get(..4)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// An AF_NETLINK socket (kind "netlink"); its queued messages are not
/// saved (a socket with unread ones is refused).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct NetlinkSocket {
    #[serde(rename = "type")]
    pub sock_type: u32,
    pub protocol: u32,
    /// Bound port id; 0: never bound.
    pub portid: u32,
    /// Multicast groups joined, numbered from 1.
    pub groups: Vec<u32>,
    /// connect(2)ed to this port id and group mask (0, 0: not connected).
    pub dst_portid: u32,
    pub dst_groups: u32,
    #[serde(rename = "options")]
    pub opts: Vec<SockOpt>,
}

/// An AF_PACKET socket (kind "packet"), with the geometry of its rings
/// and its fanout group.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct PacketSocket {
    #[serde(rename = "type")]
    pub sock_type: u32,
    /// Ethertype in network byte order, as socket(2) takes it.
    pub protocol: u32,
    /// Bound interface by name; empty: every interface.
    pub ifname: String,
    #[serde(rename = "options")]
    pub opts: Vec<SockOpt>,
    pub memberships: Vec<PacketMembership>,
    /// PACKET_RX_RING / PACKET_TX_RING; None: no such ring.
    pub rx_ring: Option<PacketRing>,
    pub tx_ring: Option<PacketRing>,
    /// PACKET_FANOUT as getsockopt reads it; 0: in no group.
    pub fanout: u32,
}

impl PacketSocket {
    /// Bytes its rings take mapped (the receive ring, then the transmit
    /// one): what an mmap of the socket must cover.
    pub fn rings_len(&self) -> u64 {
        [&self.rx_ring, &self.tx_ring]
            .into_iter()
            .flatten()
            .map(PacketRing::len)
            .sum()
    }
}

/// The geometry of a packet ring (struct tpacket_req3; a V1/V2 ring
/// uses the first four fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct PacketRing {
    pub block_size: u32,
    pub block_nr: u32,
    pub frame_size: u32,
    pub frame_nr: u32,
    pub retire_tmo: u32,
    pub sizeof_priv: u32,
    pub features: u32,
}

impl PacketRing {
    /// Bytes it takes mapped.
    pub fn len(&self) -> u64 {
        u64::from(self.block_size) * u64::from(self.block_nr)
    }

    /// Whether its blocks hold no byte (never the case of a ring the
    /// kernel made).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One PACKET_ADD_MEMBERSHIP entry, added `count` times.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct PacketMembership {
    pub ifname: String,
    /// PACKET_MR_* (0 multicast, 1 promiscuous, 2 all-multicast...).
    pub kind: u32,
    #[serde(serialize_with = "ser::hex_bytes")]
    pub address: Vec<u8>,
    pub count: u32,
}

/// How a socket of `family`, `ty` and `protocol` is named in messages and
/// `cr_image show`: "TCP", "UDP", "raw IPv4 (protocol 1)", "ping (ICMP)".
pub fn inet_proto_name(family: i32, ty: i32, protocol: i32) -> String {
    // <sys/socket.h> and <netinet/in.h> (this crate does not use libc).
    const SOCK_STREAM: i32 = 1;
    const SOCK_RAW: i32 = 3;
    const AF_INET6: i32 = 10;
    const IPPROTO_ICMP: i32 = 1;
    const IPPROTO_ICMPV6: i32 = 58;
    const IPPROTO_UDPLITE: i32 = 136;
    match (ty, protocol) {
        (SOCK_STREAM, _) => "TCP".into(),
        (SOCK_RAW, p) => {
            let v = if family == AF_INET6 { "IPv6" } else { "IPv4" };
            format!("raw {v} (protocol {p})")
        }
        (_, IPPROTO_ICMP) => "ping (ICMP)".into(),
        (_, IPPROTO_ICMPV6) => "ping (ICMPv6)".into(),
        (_, IPPROTO_UDPLITE) => "UDP-Lite".into(),
        _ => "UDP".into(),
    }
}

impl InetSocket {
    /// Its kind, as [`inet_proto_name`] names it.
    pub fn proto_name(&self) -> String {
        inet_proto_name(
            self.family as i32,
            self.sock_type as i32,
            self.protocol as i32,
        )
    }

    /// The saved int option `level`/`name`.
    pub fn int_opt(&self, level: i32, name: i32) -> Option<i32> {
        self.opts
            .iter()
            .find(|o| o.level == level && o.name == name)
            .and_then(SockOpt::int)
    }
}

/// Largest socket option value accepted.
const MAX_OPT: usize = 256;
/// The largest UDP payload (IPv4: 65535 minus the IP and UDP headers; a
/// GRO socket can hold more in one, up to 64 KiB of segments).
const MAX_DATAGRAM: usize = 65536;
/// TCP states as the kernel numbers them.
const TCP_ESTABLISHED: u32 = 1;
const TCP_CLOSE: u32 = 7;
const TCP_LISTEN: u32 = 10;
/// The TCP states of a connection, whose state the image holds:
/// ESTABLISHED, SYN-SENT, FIN-WAIT-1, FIN-WAIT-2, CLOSE-WAIT, LAST-ACK,
/// CLOSING.
pub const TCP_CONNECTED: [u32; 7] = [TCP_ESTABLISHED, 2, 4, 5, 8, 9, 11];

fn addr(s: &str, what: &str) -> Result<Option<SocketAddr>, Bad> {
    if s.is_empty() {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .map_err(|_| format!("a damaged {what} address {s:?}"))
}

fn show_addr(a: &Option<SocketAddr>) -> String {
    a.map(|a| a.to_string()).unwrap_or_default()
}

impl Object {
    pub(crate) fn from_pb(o: pb::Object) -> Result<Object, Bad> {
        use pb::object::Kind as K;
        let kind = match o.kind {
            None => return Err("of a kind this build does not know".into()),
            Some(K::Pipe(p)) => ObjectKind::Pipe(Pipe {
                data: p.data,
                capacity: p.capacity,
            }),
            Some(K::Fifo(f)) => ObjectKind::Fifo(Fifo {
                path: f.path,
                data: f.data,
                capacity: f.capacity,
                mode: f.mode & 0o7777,
                uid: f.uid,
                gid: f.gid,
            }),
            Some(K::UnixSocket(u)) => {
                if !u.queue_from.is_empty() && u.queue_from.len() != u.queue.len() {
                    return Err("damaged datagram senders".into());
                }
                if u.name.len() > 108 || u.peer_name.len() > 108 {
                    return Err("a socket name longer than 108 bytes".into());
                }
                if u.moved_to.len() > 4096 {
                    return Err("a socket file path longer than 4096 bytes".into());
                }
                ObjectKind::UnixSocket(UnixSocket {
                    sock_type: u.sock_type,
                    state: u.state,
                    name: u.name,
                    name_unlinked: u.name_unlinked,
                    moved_to: u.moved_to,
                    file_mode: u.file_mode,
                    file_uid: u.file_uid,
                    file_gid: u.file_gid,
                    peer: u.peer,
                    peer_name: u.peer_name,
                    backlog: u.backlog,
                    listener: u.listener,
                    queue: u.queue,
                    queue_from: u.queue_from,
                    shutdown: u.shutdown,
                    sndbuf: u.sndbuf,
                    rcvbuf: u.rcvbuf,
                    passcred: u.passcred,
                    peek_off: u.peek_off,
                    peer_cred: u.peer_cred.map(|c| PeerCred {
                        pid: c.pid,
                        uid: c.uid,
                        gid: c.gid,
                    }),
                    cwd: u.cwd,
                    opts: opts_from_pb(u.opts)?,
                    in_flight: u
                        .in_flight
                        .into_iter()
                        .map(|m| {
                            Ok(InFlight {
                                message: m.message,
                                fds: m
                                    .fds
                                    .into_iter()
                                    .map(Fd::from_pb)
                                    .collect::<Result<_, Bad>>()?,
                            })
                        })
                        .collect::<Result<_, Bad>>()?,
                    pending: u
                        .pending
                        .into_iter()
                        .map(|p| PendingConnection {
                            client: p.client,
                            data: p.data,
                        })
                        .collect(),
                })
            }
            Some(K::InetSocket(s)) => ObjectKind::InetSocket(inet_from_pb(s)?),
            Some(K::NetlinkSocket(s)) => ObjectKind::NetlinkSocket(NetlinkSocket {
                sock_type: s.sock_type,
                protocol: s.protocol,
                portid: s.portid,
                groups: s.groups,
                dst_portid: s.dst_portid,
                dst_groups: s.dst_groups,
                opts: opts_from_pb(s.opts)?,
            }),
            Some(K::PacketSocket(s)) => ObjectKind::PacketSocket(packet_from_pb(s)?),
            Some(K::Mqueue(q)) => {
                if !(1..=MQ_MAX_MSG).contains(&q.maxmsg)
                    || !(1..=MQ_MAX_MSGSIZE).contains(&q.msgsize)
                    || q.messages.len() as i64 > q.maxmsg
                    || q.messages.iter().any(|m| m.data.len() as i64 > q.msgsize)
                {
                    return Err(format!(
                        "message queue {}: {} messages of up to {} bytes in a queue of {} x {}",
                        q.name,
                        q.messages.len(),
                        q.messages.iter().map(|m| m.data.len()).max().unwrap_or(0),
                        q.maxmsg,
                        q.msgsize
                    ));
                }
                if !q.name.starts_with('/') || q.name[1..].contains('/') || q.name.len() > 255 {
                    return Err(format!("bad message queue name {:?}", q.name));
                }
                ObjectKind::Mqueue(Mqueue {
                    name: q.name,
                    unlinked: q.unlinked,
                    mode: q.mode,
                    uid: q.uid,
                    gid: q.gid,
                    maxmsg: q.maxmsg,
                    msgsize: q.msgsize,
                    messages: q
                        .messages
                        .into_iter()
                        .map(|m| (m.priority, m.data))
                        .collect(),
                })
            }
            Some(K::BpfMap(m)) => ObjectKind::BpfMap(bpf_from_pb(o.id, m)?),
            Some(K::Memfd(f)) => ObjectKind::Memfd(content_from_pb(f)?),
            Some(K::DeletedFile(f)) => ObjectKind::DeletedFile(content_from_pb(f)?),
            Some(K::SavedFile(f)) => ObjectKind::SavedFile(content_from_pb(f)?),
            Some(K::Pty(p)) => {
                let ok = (p.termios.is_empty() || p.termios.len() == TERMIOS_LEN)
                    && (p.winsize.is_empty() || p.winsize.len() == WINSIZE_LEN)
                    && p.index as u64 == o.id & 0xffff_ffff
                    && (o.id >> 32 == 0) == p.devpts.is_empty()
                    && (p.devpts.is_empty()
                        || (p.devpts.starts_with('/')
                            && p.devpts.len() < 4096
                            && !p.devpts.contains('\0')));
                if !ok {
                    return Err(format!("damaged pseudo-terminal {}", p.index));
                }
                ObjectKind::Pty(Pty {
                    index: p.index,
                    fg_pgrp: p.fg_pgrp,
                    termios: p.termios,
                    winsize: p.winsize,
                    locked: p.locked,
                    devpts: p.devpts,
                    input_lines: p.input_lines,
                    input: p.input,
                    output: p.output,
                    packet: p.packet,
                    packet_status: u8::try_from(p.packet_status)
                        .map_err(|_| format!("pty status byte {:#x}", p.packet_status))?,
                    slave_mode: p.slave_mode & 0o7777,
                    slave_uid: p.slave_uid,
                    slave_gid: p.slave_gid,
                    hung_up: p.hung_up,
                })
            }
        };
        Ok(Object { id: o.id, kind })
    }

    pub(crate) fn to_pb(&self) -> pb::Object {
        use pb::object::Kind as K;
        let kind = match &self.kind {
            ObjectKind::Pipe(p) => K::Pipe(pb::Pipe {
                data: p.data.clone(),
                capacity: p.capacity,
            }),
            ObjectKind::Fifo(f) => K::Fifo(pb::Fifo {
                path: f.path.clone(),
                data: f.data.clone(),
                capacity: f.capacity,
                mode: f.mode,
                uid: f.uid,
                gid: f.gid,
            }),
            ObjectKind::UnixSocket(u) => K::UnixSocket(pb::UnixSocket {
                sock_type: u.sock_type,
                state: u.state,
                name: u.name.clone(),
                name_unlinked: u.name_unlinked,
                moved_to: u.moved_to.clone(),
                file_mode: u.file_mode,
                file_uid: u.file_uid,
                file_gid: u.file_gid,
                peer: u.peer,
                peer_name: u.peer_name.clone(),
                backlog: u.backlog,
                listener: u.listener,
                queue: u.queue.clone(),
                queue_from: u.queue_from.clone(),
                shutdown: u.shutdown,
                sndbuf: u.sndbuf,
                rcvbuf: u.rcvbuf,
                passcred: u.passcred,
                peek_off: u.peek_off,
                peer_cred: u.peer_cred.map(|c| pb::PeerCred {
                    pid: c.pid,
                    uid: c.uid,
                    gid: c.gid,
                }),
                cwd: u.cwd.clone(),
                opts: opts_to_pb(&u.opts),
                in_flight: u
                    .in_flight
                    .iter()
                    .map(|m| pb::InFlight {
                        message: m.message,
                        fds: m.fds.iter().map(Fd::to_pb).collect(),
                    })
                    .collect(),
                pending: u
                    .pending
                    .iter()
                    .map(|p| pb::PendingConnection {
                        client: p.client,
                        data: p.data.clone(),
                    })
                    .collect(),
            }),
            ObjectKind::InetSocket(s) => K::InetSocket(inet_to_pb(s)),
            ObjectKind::NetlinkSocket(s) => K::NetlinkSocket(pb::NetlinkSocket {
                sock_type: s.sock_type,
                protocol: s.protocol,
                portid: s.portid,
                groups: s.groups.clone(),
                dst_portid: s.dst_portid,
                dst_groups: s.dst_groups,
                opts: opts_to_pb(&s.opts),
            }),
            ObjectKind::BpfMap(m) => K::BpfMap(pb::BpfMap {
                map_type: m.map_type,
                key_size: m.key_size,
                value_size: m.value_size,
                max_entries: m.max_entries,
                map_flags: m.map_flags,
                name: m.name.clone(),
                map_extra: m.map_extra,
                frozen: m.frozen,
                cpus: m.cpus,
                entries: m
                    .entries
                    .iter()
                    .map(|(key, value)| pb::BpfMapEntry {
                        key: key.clone(),
                        value: value.clone(),
                    })
                    .collect(),
            }),
            ObjectKind::Mqueue(q) => K::Mqueue(pb::Mqueue {
                name: q.name.clone(),
                unlinked: q.unlinked,
                mode: q.mode,
                uid: q.uid,
                gid: q.gid,
                maxmsg: q.maxmsg,
                msgsize: q.msgsize,
                messages: q
                    .messages
                    .iter()
                    .map(|(priority, data)| pb::MqMessage {
                        priority: *priority,
                        data: data.clone(),
                    })
                    .collect(),
            }),
            ObjectKind::PacketSocket(s) => K::PacketSocket(pb::PacketSocket {
                sock_type: s.sock_type,
                protocol: s.protocol,
                ifname: s.ifname.clone(),
                opts: opts_to_pb(&s.opts),
                memberships: s
                    .memberships
                    .iter()
                    .map(|m| pb::PacketMembership {
                        ifname: m.ifname.clone(),
                        kind: m.kind,
                        address: m.address.clone(),
                        count: m.count,
                    })
                    .collect(),
                rx_ring: s.rx_ring.map(ring_to_pb),
                tx_ring: s.tx_ring.map(ring_to_pb),
                fanout: s.fanout,
            }),
            ObjectKind::Memfd(f) => K::Memfd(content_to_pb(f)),
            ObjectKind::DeletedFile(f) => K::DeletedFile(content_to_pb(f)),
            ObjectKind::SavedFile(f) => K::SavedFile(content_to_pb(f)),
            ObjectKind::Pty(p) => K::Pty(pb::Pty {
                index: p.index,
                fg_pgrp: p.fg_pgrp,
                termios: p.termios.clone(),
                winsize: p.winsize.clone(),
                locked: p.locked,
                devpts: p.devpts.clone(),
                input_lines: p.input_lines.clone(),
                input: p.input.clone(),
                output: p.output.clone(),
                packet: p.packet,
                packet_status: p.packet_status.into(),
                slave_mode: p.slave_mode,
                slave_uid: p.slave_uid,
                slave_gid: p.slave_gid,
                hung_up: p.hung_up,
            }),
        };
        pb::Object {
            id: self.id,
            kind: Some(kind),
        }
    }

    /// References to other objects and to processes.
    pub(crate) fn validate(&self, ck: &Checkpoint) -> Result<(), Bad> {
        match &self.kind {
            ObjectKind::UnixSocket(u) => {
                let clients = u.pending.iter().map(|p| ("pending client", p.client));
                for (what, id) in [("peer", u.peer), ("listener", u.listener)]
                    .into_iter()
                    .chain(clients)
                {
                    if id != 0 && ck.object(ObjectTag::UnixSocket, id).is_none() {
                        return Err(format!(
                            "its {what} socket:[{id}] is missing from the image"
                        ));
                    }
                }
                for m in &u.in_flight {
                    if m.message as usize >= u.queue.len() || m.fds.is_empty() {
                        return Err(format!("damaged files in flight (message {})", m.message));
                    }
                    for f in &m.fds {
                        if let Some((tag, id)) = f.kind.object() {
                            if ck.object(tag, id).is_none() {
                                return Err(format!(
                                    "a file in flight refers to {tag:?} {id}, missing from the image"
                                ));
                            }
                        }
                        if let Some(s) = f.shared {
                            if ck.process(s.pid).and_then(|q| q.fd(s.fd)).is_none() {
                                return Err(format!(
                                    "a file in flight is fd {} of process {}, not in the image",
                                    s.fd, s.pid
                                ));
                            }
                        }
                        // Registered again in the root: its keys are
                        // the root's fd numbers.
                        if let FdKind::Epoll { items } = &f.kind {
                            let root = ck.process(ck.root_pid);
                            let held = |n: i32| root.and_then(|r| r.fd(n)).is_some();
                            if let Some(it) =
                                items.iter().find(|it| !held(it.open_as.unwrap_or(it.tfd)))
                            {
                                return Err(format!(
                                    "an epoll in flight watches fd {}, which the root does not hold",
                                    it.tfd
                                ));
                            }
                        }
                    }
                }
            }
            ObjectKind::SavedFile(f) if !f.name.starts_with('/') => {
                return Err(format!(
                    "a saved file without an absolute path ({:?})",
                    f.name
                ));
            }
            ObjectKind::Pty(p) if p.fg_pgrp != 0 && ck.process(p.fg_pgrp).is_none() => {
                return Err(format!(
                    "its foreground group {} is not in the image",
                    p.fg_pgrp
                ));
            }
            _ => {}
        }
        Ok(())
    }
}

/// The content files of the image: of its objects, System V shared
/// memory segments and a job's /dev/shm files.
pub fn content_files(ck: &Checkpoint) -> impl Iterator<Item = &PageFile> {
    ck.objects
        .iter()
        .filter_map(|o| match &o.kind {
            ObjectKind::Memfd(f) | ObjectKind::DeletedFile(f) | ObjectKind::SavedFile(f) => {
                f.content.as_ref()
            }
            _ => None,
        })
        .chain(ck.sysv.iter().flat_map(|s| s.content_files()))
        .chain(ck.mounts.iter().flat_map(|m| m.content_files()))
}

fn content_from_pb(f: pb::FileContent) -> Result<FileContent, Bad> {
    let content = f.content.map(PageFile::from_pb).transpose()?;
    if let Some(c) = &content {
        if c.extents.iter().any(|e| e.file_offset >= f.size) {
            return Err(format!("content of {} lies beyond its size", f.name));
        }
    }
    let huge = f.huge_page_size;
    if huge != 0 && (!huge.is_power_of_two() || huge <= PAGE || !f.size.is_multiple_of(huge)) {
        return Err(format!(
            "{} of {} bytes in huge pages of {huge} bytes",
            f.name, f.size
        ));
    }
    Ok(FileContent {
        name: f.name,
        size: f.size,
        mode: f.mode & 0o7777,
        seals: f.seals,
        content,
        atime_ns: f.atime_ns,
        mtime_ns: f.mtime_ns,
        owner: f.uid.zip(f.gid),
        huge_page_size: huge,
    })
}

fn content_to_pb(f: &FileContent) -> pb::FileContent {
    pb::FileContent {
        name: f.name.clone(),
        size: f.size,
        mode: f.mode,
        seals: f.seals,
        content: f.content.as_ref().map(PageFile::to_pb),
        atime_ns: f.atime_ns,
        mtime_ns: f.mtime_ns,
        uid: f.owner.map(|o| o.0),
        gid: f.owner.map(|o| o.1),
        huge_page_size: f.huge_page_size,
    }
}

fn inet_from_pb(s: pb::InetSocket) -> Result<InetSocket, Bad> {
    let tcp = s.protocol == 6 && s.sock_type == 1;
    // UDP, UDP-Lite and ping (ICMP, ICMPv6) datagrams, or a raw socket of
    // any protocol below IPPROTO_MAX (263: 256-262 exist too).
    let datagram = (s.sock_type == 2 && [17, 136, 1, 58].contains(&s.protocol))
        || (s.sock_type == 3 && s.protocol < 263);
    if !(s.family == 2 || s.family == 10) || !(tcp || datagram) {
        return Err(format!(
            "a socket of family {} and protocol {}",
            s.family, s.protocol
        ));
    }
    let local = addr(&s.local, "local")?;
    let remote = addr(&s.remote, "remote")?;
    let established = tcp && TCP_CONNECTED.contains(&s.state);
    if tcp && !established && ![TCP_CLOSE, TCP_LISTEN].contains(&s.state) {
        return Err(format!("a TCP socket in state {}", s.state));
    }
    if established != s.tcp.is_some() || (established && (local.is_none() || remote.is_none())) {
        return Err("an established connection without its state or addresses".into());
    }
    let tcp_state = match s.tcp {
        Some(c) => {
            if c.unsent as usize > c.send_queue.len() {
                return Err("more unsent bytes than queued".into());
            }
            Some(TcpConnection {
                snd_una: c.snd_una,
                snd_nxt: c.snd_nxt,
                write_seq: c.write_seq,
                rcv_nxt: c.rcv_nxt,
                send_queue: c.send_queue,
                unsent: c.unsent,
                recv_queue: c.recv_queue,
                mss: c.mss,
                snd_wscale: c.snd_wscale,
                rcv_wscale: c.rcv_wscale,
                options: c.options,
                timestamp: c.timestamp,
                snd_wl1: c.snd_wl1,
                snd_wnd: c.snd_wnd,
                max_window: c.max_window,
                rcv_wnd: c.rcv_wnd,
                rcv_wup: c.rcv_wup,
                fin_unsent: c.fin_unsent,
            })
        }
        None => None,
    };
    Ok(InetSocket {
        family: s.family,
        sock_type: s.sock_type,
        protocol: s.protocol,
        state: s.state,
        local,
        remote,
        backlog: s.backlog,
        tcp: tcp_state,
        opts: opts_from_pb(s.opts)?,
        shutdown: s.shutdown & 3,
        received: s
            .received
            .into_iter()
            .map(|d| {
                let from = addr(&d.from, "datagram sender")?
                    .ok_or_else(|| "a datagram without its sender".to_string())?;
                if d.data.len() > MAX_DATAGRAM {
                    return Err(format!("a datagram of {} bytes", d.data.len()));
                }
                Ok(Datagram { from, data: d.data })
            })
            .collect::<Result<_, Bad>>()?,
    })
}

/// Socket options, each at most [`MAX_OPT`] bytes.
fn opts_from_pb(opts: Vec<pb::SockOpt>) -> Result<Vec<SockOpt>, String> {
    opts.into_iter()
        .map(|o| {
            if o.value.len() > MAX_OPT {
                return Err(format!(
                    "option {}/{} of {} bytes",
                    o.level,
                    o.name,
                    o.value.len()
                ));
            }
            Ok(SockOpt {
                level: o.level,
                name: o.name,
                value: o.value,
            })
        })
        .collect()
}

/// Interface names are at most IFNAMSIZ - 1 bytes; a hardware address of
/// a membership at most 32 (struct packet_diag_mclist).
fn packet_from_pb(s: pb::PacketSocket) -> Result<PacketSocket, String> {
    let name_ok = |n: &str| n.len() < 16 && !n.contains(['\0', '/']);
    if !name_ok(&s.ifname) {
        return Err(format!(
            "packet socket bound to a bad interface name {:?}",
            s.ifname
        ));
    }
    let memberships = s
        .memberships
        .into_iter()
        .map(|m| {
            if !name_ok(&m.ifname) || m.address.len() > 32 {
                return Err(format!(
                    "damaged packet socket membership on {:?}",
                    m.ifname
                ));
            }
            Ok(PacketMembership {
                ifname: m.ifname,
                kind: m.kind,
                address: m.address,
                count: m.count,
            })
        })
        .collect::<Result<_, String>>()?;
    let ring = |r: Option<pb::PacketRing>, which: &str| {
        r.map(|r| {
            let ring = PacketRing {
                block_size: r.block_size,
                block_nr: r.block_nr,
                frame_size: r.frame_size,
                frame_nr: r.frame_nr,
                retire_tmo: r.retire_tmo,
                sizeof_priv: r.sizeof_priv,
                features: r.features,
            };
            // The kernel's own bounds: blocks of whole pages, frames that
            // fit them, at most 4 GiB mapped in all.
            let per_block = ring.block_size.checked_div(ring.frame_size).unwrap_or(0);
            if ring.block_size == 0
                || !ring.block_size.is_multiple_of(4096)
                || ring.block_nr == 0
                || per_block == 0
                || ring.frame_nr == 0
                || u64::from(ring.frame_nr) > u64::from(per_block) * u64::from(ring.block_nr)
                || ring.len() > u64::from(u32::MAX)
            {
                return Err(format!(
                    "packet socket with a damaged {which} ring ({} blocks of {} bytes, {} frames of {})",
                    ring.block_nr, ring.block_size, ring.frame_nr, ring.frame_size
                ));
            }
            Ok(ring)
        })
        .transpose()
    };
    Ok(PacketSocket {
        sock_type: s.sock_type,
        protocol: s.protocol,
        ifname: s.ifname,
        opts: opts_from_pb(s.opts)?,
        memberships,
        rx_ring: ring(s.rx_ring, "receive")?,
        tx_ring: ring(s.tx_ring, "transmit")?,
        fanout: s.fanout,
    })
}

fn ring_to_pb(r: PacketRing) -> pb::PacketRing {
    pb::PacketRing {
        block_size: r.block_size,
        block_nr: r.block_nr,
        frame_size: r.frame_size,
        frame_nr: r.frame_nr,
        retire_tmo: r.retire_tmo,
        sizeof_priv: r.sizeof_priv,
        features: r.features,
    }
}

fn opts_to_pb(opts: &[SockOpt]) -> Vec<pb::SockOpt> {
    opts.iter()
        .map(|o| pb::SockOpt {
            level: o.level,
            name: o.name,
            value: o.value.clone(),
        })
        .collect()
}

fn inet_to_pb(s: &InetSocket) -> pb::InetSocket {
    pb::InetSocket {
        family: s.family,
        sock_type: s.sock_type,
        protocol: s.protocol,
        state: s.state,
        local: show_addr(&s.local),
        remote: show_addr(&s.remote),
        backlog: s.backlog,
        shutdown: s.shutdown,
        tcp: s.tcp.as_ref().map(|c| pb::TcpConnection {
            snd_una: c.snd_una,
            snd_nxt: c.snd_nxt,
            write_seq: c.write_seq,
            rcv_nxt: c.rcv_nxt,
            send_queue: c.send_queue.clone(),
            unsent: c.unsent,
            recv_queue: c.recv_queue.clone(),
            mss: c.mss,
            snd_wscale: c.snd_wscale,
            rcv_wscale: c.rcv_wscale,
            options: c.options,
            timestamp: c.timestamp,
            snd_wl1: c.snd_wl1,
            snd_wnd: c.snd_wnd,
            max_window: c.max_window,
            rcv_wnd: c.rcv_wnd,
            rcv_wup: c.rcv_wup,
            fin_unsent: c.fin_unsent,
        }),
        opts: opts_to_pb(&s.opts),
        received: s
            .received
            .iter()
            .map(|d| pb::Datagram {
                from: show_addr(&Some(d.from)),
                data: d.data.clone(),
            })
            .collect(),
    }
}

/// A BPF map of the image, checked: names fit, every key and value has
/// the map's sizes, no more entries than the map holds, within
/// [`BPF_MAP_MAX_BYTES`].
fn bpf_from_pb(id: u64, m: pb::BpfMap) -> Result<BpfMap, Bad> {
    let map = BpfMap {
        map_type: m.map_type,
        key_size: m.key_size,
        value_size: m.value_size,
        max_entries: m.max_entries,
        map_flags: m.map_flags,
        name: m.name,
        map_extra: m.map_extra,
        frozen: m.frozen,
        cpus: m.cpus,
        entries: m.entries.into_iter().map(|e| (e.key, e.value)).collect(),
    };
    let vlen = map.value_len();
    let bytes: usize = map.entries.iter().map(|(k, v)| k.len() + v.len()).sum();
    let bad_entry = map
        .entries
        .iter()
        .any(|(k, v)| k.len() != map.key_size as usize || v.len() != vlen);
    if map.name.len() >= 16
        || map.name.contains('\0')
        || map.entries.len() > map.max_entries as usize
        || bad_entry
        || bytes > BPF_MAP_MAX_BYTES
        || map.cpus > 1 << 16
    {
        return Err(format!(
            "BPF map {id} ({:?}): {} entries of {} / {} bytes (key / value) in a map of {} x {} / {}",
            map.name,
            map.entries.len(),
            map.entries.first().map_or(0, |e| e.0.len()),
            map.entries.first().map_or(0, |e| e.1.len()),
            map.max_entries,
            map.key_size,
            vlen
        ));
    }
    Ok(map)
}
