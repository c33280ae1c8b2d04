//! The relay of a remote command's stdio and exit status over one TCP
//! connection between two members of a job: `cr_rsh` and its serving side
//! (`cr_rsh --cr-serve`), `cr_srun` (the stand-in of `srun` in a
//! checkpointable Slurm job) and the serving side of each of its tasks
//! (`cr_rsh --cr-serve-task`). A checkpoint captures the connection like
//! any other, and a restart, on the same or other nodes, carries it over.
//!
//! On the wire, frames `[kind u8][length u32 BE][payload]`: stdin data and
//! its end towards the command; stdout and stderr data and the exit status
//! (i32 BE) from it; [`TASK`] (a task of a step saying who it is) and
//! [`SRUN_EXIT`] (the real srun of a step ended) for cr_srun.

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::BorrowedFd;

/// The environment variable that carries the one-time token the serving
/// side proves itself with (removed before the command runs).
pub const TOKEN_ENV: &str = "CR_RSH_TOKEN";

/// Stdin data, towards the command.
pub const STDIN: u8 = 0;
/// The end of stdin.
pub const STDIN_EOF: u8 = 1;
/// Stdout data of the command.
pub const STDOUT: u8 = 2;
/// Stderr data of the command.
pub const STDERR: u8 = 3;
/// The command's exit status (i32 BE: its code, or 128 + its signal).
pub const EXIT: u8 = 4;
/// First frame of a task of an srun step: its rank and the step's number
/// of tasks (`SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`; u32 BE each).
pub const TASK: u8 = 5;
/// From the launcher of a step's real srun: it ended before every task
/// connected (i32 BE: its status).
pub const SRUN_EXIT: u8 = 6;

/// Writes one frame.
pub fn send(s: &mut TcpStream, kind: u8, data: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(5 + data.len());
    buf.push(kind);
    buf.extend_from_slice(&(data.len() as u32).to_be_bytes());
    buf.extend_from_slice(data);
    s.write_all(&buf)
}

/// Frames as they arrive from a stream.
#[derive(Default)]
pub struct Frames {
    buf: Vec<u8>,
}

impl Frames {
    /// Appends what was read; returns the complete frames.
    pub fn push(&mut self, data: &[u8]) -> Vec<(u8, Vec<u8>)> {
        self.buf.extend_from_slice(data);
        let mut out = Vec::new();
        loop {
            if self.buf.len() < 5 {
                break;
            }
            let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]);
            let end = 5 + len as usize;
            if self.buf.len() < end {
                break;
            }
            out.push((self.buf[0], self.buf[5..end].to_vec()));
            self.buf.drain(..end);
        }
        out
    }
}

/// Reads what is there (Ok(empty): end of file); retries EINTR.
pub fn read_some(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; 65536];
    loop {
        match r.read(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Polls `fds` for input (a checkpoint or restore may interrupt: EINTR is
/// an empty answer). Readable or hung up, per fd.
pub fn wait_input(fds: &[BorrowedFd<'_>], timeout: PollTimeout) -> Result<Vec<bool>, String> {
    let mut pfds: Vec<PollFd<'_>> = fds
        .iter()
        .map(|f| PollFd::new(*f, PollFlags::POLLIN))
        .collect();
    match poll(&mut pfds, timeout) {
        Ok(_) => Ok(pfds
            .iter()
            .map(|p| p.revents().is_some_and(|r| !r.is_empty()))
            .collect()),
        Err(nix::errno::Errno::EINTR) => Ok(vec![false; fds.len()]),
        Err(e) => Err(format!("poll: {e}")),
    }
}

/// A one-time token (hex of 16 random bytes).
pub fn token() -> Result<String, String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| format!("cannot read /dev/urandom: {e}"))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// This node's addresses a peer may connect to: the IPv4 ones (else the
/// IPv6 ones) of the interfaces that are up, loopback left out.
pub fn own_addresses() -> Result<Vec<IpAddr>, String> {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for ifa in nix::ifaddrs::getifaddrs().map_err(|e| format!("getifaddrs: {e}"))? {
        use nix::net::if_::InterfaceFlags as F;
        if !ifa.flags.contains(F::IFF_UP) || ifa.flags.contains(F::IFF_LOOPBACK) {
            continue;
        }
        let Some(a) = ifa.address else { continue };
        if let Some(s) = a.as_sockaddr_in() {
            v4.push(IpAddr::V4(s.ip()));
        } else if let Some(s) = a.as_sockaddr_in6() {
            let ip = s.ip();
            // Link-local addresses need a scope: not usable here.
            if ip.segments()[0] & 0xffc0 != 0xfe80 {
                v6.push(IpAddr::V6(ip));
            }
        }
    }
    let all = if v4.is_empty() { v6 } else { v4 };
    if all.is_empty() {
        return Err("this node has no network address other than loopback".into());
    }
    Ok(all)
}

/// A listening TCP socket on every address of this node (a port of its
/// own), for the serving sides to connect back to: this node's addresses
/// ([`own_addresses`]), the listener and its port.
pub fn listen() -> Result<(Vec<IpAddr>, TcpListener, u16), String> {
    let addrs = own_addresses()?;
    let any: IpAddr = if addrs[0].is_ipv4() {
        "0.0.0.0".parse().expect("an address")
    } else {
        "::".parse().expect("an address")
    };
    let listener =
        TcpListener::bind(SocketAddr::new(any, 0)).map_err(|e| format!("cannot listen: {e}"))?;
    let port = listener
        .local_addr()
        .map_err(|e| format!("listening socket: {e}"))?
        .port();
    Ok((addrs, listener, port))
}
