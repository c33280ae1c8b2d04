//! The bytes queued in a pseudo-terminal pair, taken out and put back.
//!
//! A terminal's queues cannot be peeked: they are read out (from the slave
//! for its input, from the master for the slave's output) and written back
//! in the same order, while whoever else holds the pair is frozen.
//!
//! What the kernel does here (n_tty):
//! - The slave's input is kept as its line discipline made it: echoed,
//!   translated (ICRNL...), edited (ERASE, KILL). Written to the master
//!   again it would go through all of that once more; TIOCSTI puts bytes
//!   straight into the line discipline instead, synchronously (a write to
//!   the master is processed later, by a work item, with whatever settings
//!   the terminal has by then). It needs CAP_SYS_ADMIN for a terminal that
//!   is not the caller's own (dev.tty.legacy_tiocsti only matters without
//!   it). While the bytes go in, the terminal is set to process nothing:
//!   no echo, no signals, no input translation, and every special
//!   character moved to a byte that is not in the data.
//! - A canonical read returns one line, so the lines are read one by one
//!   (an EOF-ended line reads without its ^D, one of EOF alone as 0
//!   bytes); the line being typed is readable only once ICANON is off.
//!   Switching ICANON with input queued turns all of it into one line
//!   (n_tty_set_termios): it is switched only with the queue empty.
//! - The line discipline holds at most 4095 bytes; what the writer sent
//!   beyond that waited unprocessed (flip buffers) and is written to the
//!   master again, to be processed then, as it would have been.
//! - A master in packet mode (TIOCPKT) may have a status byte pending
//!   (the slave's flushes, output stops and starts, flow-control and
//!   EXTPROC changes), which its next read returns alone, and which poll
//!   reports as POLLPRI. Turning packet mode on clears it, and while packet
//!   mode is on every termios change of the slave touching flow control
//!   (IXON with ^S/^Q) or EXTPROC sets bits of it: the queues are taken
//!   out and put back with packet mode off, and the status is taken before
//!   and made again after ([`take_status`], [`put_status`]).
//! - The slave's output waits in the master's line discipline, which is
//!   always raw (the master's termios cannot be changed: termios ioctls on
//!   a master act on the slave): put back with TIOCSTI on the master; more
//!   than it holds is written to the slave with OPOST off (processed
//!   already), in order after it.

use crate::error::{Errno, NixResult, Result, SysError};
use crate::fdio::{self, cvt};
use nix::errno::Errno as NixErrno;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

/// What a pty pair holds in its queues.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Queued {
    /// Complete lines waiting on a canonical slave, each as one read
    /// returns it.
    pub lines: Vec<Vec<u8>>,
    /// The rest of the slave's input (the line being typed; all of a
    /// non-canonical terminal's input).
    pub input: Vec<u8>,
    /// The slave's output not yet read on the master.
    pub output: Vec<u8>,
}

impl Queued {
    pub fn is_empty(&self) -> bool {
        self.lines.is_empty() && self.input.is_empty() && self.output.is_empty()
    }
}

/// Room of an empty line discipline (N_TTY_BUF_SIZE - 1).
const LDISC_ROOM: usize = 4095;

// Offsets in the kernel's struct termios, as TCGETS writes it.
const IFLAG: usize = 0;
const OFLAG: usize = 4;
const LFLAG: usize = 12;
const CC: usize = 17;

fn flag(t: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([t[at], t[at + 1], t[at + 2], t[at + 3]])
}

fn set_flag(t: &mut [u8], at: usize, v: u32) {
    t[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

/// Whether termios `t` is canonical (line by line, edited by the kernel).
fn canonical(t: &[u8]) -> bool {
    let l = flag(t, LFLAG);
    l & libc::ICANON != 0 && l & libc::EXTPROC == 0
}

/// Take everything queued in the pair: `slave` is a non-blocking
/// description of our own of its slave, `master` its master (the
/// program's description may block: it is polled before each read). On
/// an error, what was taken is put back. The caller checks first that it
/// can put bytes back ([`may_put_back`]).
pub fn take(master: &OwnedFd, slave: &OwnedFd) -> Result<Queued> {
    let mut q = Queued::default();
    match take_into(master, slave, &mut q) {
        Ok(()) => Ok(q),
        Err(e) => {
            let _ = put(master, slave, &q);
            Err(e)
        }
    }
}

fn take_into(master: &OwnedFd, slave: &OwnedFd, q: &mut Queued) -> Result<()> {
    let t0 = fdio::tcgets(slave)?;
    if canonical(&t0) {
        let mut buf = vec![0u8; LDISC_ROOM + 1];
        // (At most one line per byte held: a hung-up terminal reads 0 for
        // ever.)
        while q.lines.len() <= LDISC_ROOM {
            match read_some(slave, &mut buf)? {
                Some(n) => q.lines.push(buf[..n].to_vec()),
                None => break,
            }
        }
    }
    // The rest, raw (the queue holds no complete line any more).
    let mut raw = t0.clone();
    set_flag(&mut raw, LFLAG, flag(&t0, LFLAG) & !libc::ICANON);
    raw[CC + libc::VMIN] = 0;
    raw[CC + libc::VTIME] = 0;
    fdio::tcsets(slave.as_fd(), &raw)?;
    let input = drain(slave, &mut q.input);
    fdio::tcsets(slave.as_fd(), &t0)?;
    input?;
    take_output(master, &mut q.output)
}

/// One read of a non-blocking fd: None when nothing is left (EAGAIN).
fn read_some(fd: &OwnedFd, buf: &mut [u8]) -> Result<Option<usize>> {
    match nix::unistd::read(fd, buf) {
        Ok(n) => Ok(Some(n)),
        Err(NixErrno::EAGAIN) => Ok(None),
        Err(e) => Err(SysError::Syscall {
            what: "read of a terminal's queue".into(),
            source: Errno(e as i32),
        }),
    }
}

/// Everything a non-blocking, non-canonical slave has to read, into `out`.
fn drain(slave: &OwnedFd, out: &mut Vec<u8>) -> Result<()> {
    let mut buf = vec![0u8; 8192];
    while let Some(n) = read_some(slave, &mut buf)? {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    Ok(())
}

/// Everything the master has to read, into `out` (packet mode off
/// meanwhile, or each read would start with a status byte).
fn take_output(master: &OwnedFd, out: &mut Vec<u8>) -> Result<()> {
    let packet = packet_mode(master)?;
    if packet {
        set_packet_mode(master, false)?;
    }
    let mut buf = vec![0u8; 8192];
    let mut res = Ok(());
    loop {
        match readable(master) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                res = Err(e);
                break;
            }
        }
        match nix::unistd::read(master, &mut buf) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
            // The slave side is closed and nothing is left.
            Err(NixErrno::EIO) => break,
            Err(e) => {
                res = Err(e).or_sys(|| "read of a pseudo-terminal master".into());
                break;
            }
        }
    }
    if packet {
        set_packet_mode(master, true)?;
    }
    res
}

/// Whether `fd` has something to read now (poll also runs the terminal's
/// pending input processing first when nothing is ready).
fn readable(fd: &OwnedFd) -> Result<bool> {
    polled(fd, libc::POLLIN)
}

/// Whether poll says `events` of `fd` now (without waiting).
fn polled(fd: &OwnedFd, events: libc::c_short) -> Result<bool> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events,
        revents: 0,
    };
    // SAFETY: one pollfd, which we own, for the duration of the call.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    cvt(r as i64, || "poll of a pseudo-terminal".into())?;
    Ok(p.revents & events != 0)
}

/// Put `q` back into the pair (empty queues): `slave` is a non-blocking
/// description of our own of its slave, its settings those the program
/// will have.
pub fn put(master: &OwnedFd, slave: &OwnedFd, q: &Queued) -> Result<()> {
    if q.is_empty() {
        return Ok(());
    }
    let t0 = fdio::tcgets(slave)?;
    let quiet = quiet_termios(&t0, q)?;
    fdio::tcsets(slave.as_fd(), &quiet)?;
    let res = put_input(master, slave, q, quiet[CC + libc::VEOF])
        .and_then(|()| put_output(master, slave, &q.output));
    fdio::tcsets(slave.as_fd(), &t0)?;
    res
}

/// Settings `t0` that process no input byte of `q` and no output: no echo,
/// signals, translation or output processing; on a canonical terminal EOF
/// on a byte absent from the input (it ends the lines that did not end
/// with a newline), and the special characters still active (ERASE, KILL,
/// EOL; START and STOP with IXON) on another absent byte.
fn quiet_termios(t0: &[u8], q: &Queued) -> Result<Vec<u8>> {
    let mut t = t0.to_vec();
    let i = flag(t0, IFLAG)
        & !(libc::ICRNL
            | libc::INLCR
            | libc::IGNCR
            | libc::ISTRIP
            | libc::IUCLC
            | libc::IXANY
            | libc::PARMRK
            | libc::IMAXBEL);
    // IXON stays: turning it off would restart output stopped by ^S.
    set_flag(&mut t, IFLAG, i);
    set_flag(&mut t, OFLAG, flag(t0, OFLAG) & !libc::OPOST);
    // ICANON and EXTPROC stay: switching either empties the line state.
    let l = flag(t0, LFLAG)
        & !(libc::ECHO
            | libc::ECHOE
            | libc::ECHOK
            | libc::ECHONL
            | libc::ECHOCTL
            | libc::ECHOPRT
            | libc::ECHOKE
            | libc::ISIG
            | libc::IEXTEN);
    set_flag(&mut t, LFLAG, l);
    let canon = canonical(t0);
    if !canon && i & libc::IXON == 0 {
        return Ok(t);
    }
    let mut present = [false; 256];
    present[b'\n' as usize] = true;
    present[0] = true;
    for b in q.lines.iter().flatten().chain(&q.input) {
        present[*b as usize] = true;
    }
    let mut free = (0..=255u8).filter(|&b| !present[b as usize]);
    let no_byte = || SysError::Syscall {
        what: "putting back a terminal's input, which holds nearly every byte value (none is \
               left to stand for its special characters)"
            .into(),
        source: Errno(libc::EINVAL),
    };
    if canon {
        t[CC + libc::VEOF] = free.next().ok_or_else(no_byte)?;
    }
    let other = free.next().ok_or_else(no_byte)?;
    for c in [
        libc::VEOL,
        libc::VERASE,
        libc::VKILL,
        libc::VSTART,
        libc::VSTOP,
    ] {
        t[CC + c] = other;
    }
    Ok(t)
}

/// The slave's input, through its (quiet) line discipline.
fn put_input(master: &OwnedFd, slave: &OwnedFd, q: &Queued, eof: u8) -> Result<()> {
    let mut bytes = Vec::new();
    for l in &q.lines {
        bytes.extend_from_slice(l);
        if l.last() != Some(&b'\n') {
            bytes.push(eof);
        }
    }
    bytes.extend_from_slice(&q.input);
    let now = bytes.len().min(LDISC_ROOM);
    inject(slave, &bytes[..now])?;
    // Beyond what the line discipline holds: written to the master, read
    // by the line discipline as room frees up.
    write_all_now(master, &bytes[now..], "the master")
}

/// The slave's output, into the master's (raw) line discipline.
fn put_output(master: &OwnedFd, slave: &OwnedFd, out: &[u8]) -> Result<()> {
    let now = out.len().min(LDISC_ROOM);
    inject(master, &out[..now])?;
    let held = fdio::bytes_queued(master)?;
    if held != now {
        return Err(SysError::Syscall {
            what: format!(
                "putting back a terminal's output: the master holds {held} of {now} bytes"
            ),
            source: Errno(libc::EIO),
        });
    }
    write_all_now(slave, &out[now..], "the slave")
}

/// Write all of `data` to terminal end `fd`, which has room for it (a
/// non-blocking description fails rather than wait for a stopped output).
fn write_all_now(fd: &OwnedFd, data: &[u8], end: &str) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    let mut done = 0;
    while done < data.len() {
        match nix::unistd::write(fd, &data[done..]) {
            Ok(n) if n > 0 => done += n,
            r => {
                let e = r.err().unwrap_or(NixErrno::EAGAIN);
                return Err(SysError::Syscall {
                    what: format!(
                        "write of {} queued bytes to {end} of a pseudo-terminal (its output stopped?)",
                        data.len() - done
                    ),
                    source: Errno(e as i32),
                });
            }
        }
    }
    Ok(())
}

const TIOCSTI: libc::c_ulong = 0x5412;
const TIOCPKT: libc::c_ulong = 0x5420;
const TIOCGPKT: u64 = 0x8004_5438;

/// Hand `bytes` to the line discipline of terminal `fd` as if received
/// (TIOCSTI, one byte per call).
fn inject(fd: &OwnedFd, bytes: &[u8]) -> Result<()> {
    for b in bytes {
        // SAFETY: TIOCSTI reads one byte from the pointer.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), TIOCSTI, b as *const u8) };
        cvt(r as i64, || {
            "ioctl(TIOCSTI) (putting back a terminal's queued bytes needs CAP_SYS_ADMIN)".into()
        })?;
    }
    Ok(())
}

/// Whether we may hand bytes to terminal `fd`'s line discipline (see
/// [`inject`]): TIOCSTI checks the caller's rights before it reads its
/// byte, so one given no byte (a null pointer) fails with EFAULT when it
/// would have worked, and puts nothing in.
pub fn may_put_back(fd: &OwnedFd) -> bool {
    // SAFETY: a null pointer, which the kernel checks (EFAULT) and never
    // writes through.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), TIOCSTI, std::ptr::null::<u8>()) };
    r < 0 && Errno::last().0 == libc::EFAULT
}

/// Whether the pty master `fd` is in packet mode (TIOCGPKT).
pub fn packet_mode(master: &OwnedFd) -> Result<bool> {
    fdio::ioctl_get_int(master, TIOCGPKT, || "ioctl(TIOCGPKT)".into()).map(|v| v != 0)
}

/// Set or clear packet mode on the pty master `fd` (TIOCPKT).
pub fn set_packet_mode(master: &OwnedFd, on: bool) -> Result<()> {
    let v: libc::c_int = on as libc::c_int;
    // SAFETY: TIOCPKT reads one int.
    let r = unsafe { libc::ioctl(master.as_raw_fd(), TIOCPKT, &v) };
    cvt(r as i64, || "ioctl(TIOCPKT)".into()).map(drop)
}

/// Bits of a packet-mode status byte (TIOCPKT_*).
pub const PKT_FLUSHREAD: u8 = 0x01;
pub const PKT_FLUSHWRITE: u8 = 0x02;
pub const PKT_STOP: u8 = 0x04;
pub const PKT_START: u8 = 0x08;
pub const PKT_NOSTOP: u8 = 0x10;
pub const PKT_DOSTOP: u8 = 0x20;
pub const PKT_IOCTL: u8 = 0x40;

/// Whether master `fd` in packet mode has a status byte pending (POLLPRI,
/// which n_tty reports exactly then), without taking it.
pub fn status_pending(master: &OwnedFd) -> Result<bool> {
    polled(master, libc::POLLPRI)
}

/// Take the status byte pending on master `fd` in packet mode (0: none):
/// a read then returns it alone, whatever else is queued.
pub fn take_status(master: &OwnedFd) -> Result<u8> {
    if !status_pending(master)? {
        return Ok(0);
    }
    let mut b = [0u8; 1];
    match nix::unistd::read(master, &mut b) {
        Ok(1) => Ok(b[0]),
        Ok(n) => Err(SysError::Syscall {
            what: format!("read of a pseudo-terminal's status byte gave {n} bytes"),
            source: Errno(libc::EIO),
        }),
        Err(e) => Err(e).or_sys(|| "read of a pseudo-terminal's status byte".into()),
    }
}

const TCFLSH: libc::c_ulong = 0x540B;
const TCXONC: libc::c_ulong = 0x540A;

fn ioctl_arg(fd: &OwnedFd, req: libc::c_ulong, arg: libc::c_int, what: &str) -> Result<()> {
    // SAFETY: these requests take an integer argument, no pointer.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), req, arg as libc::c_ulong) };
    cvt(r as i64, || format!("ioctl({what})")).map(drop)
}

/// Make status byte `status` pending again on a pair whose master is in
/// packet mode (with no status pending), from the slave as the program
/// made each bit: a flush (TCFLSH) for FLUSHREAD and FLUSHWRITE, done only
/// with that queue empty (`q`, what was put back; None: not known); the flow control
/// changed away and back for DOSTOP and NOSTOP, termios set again for
/// IOCTL (EXTPROC); output stopped and started (TCXONC) for START; for
/// STOP the output is started and stopped again, as ^Q and ^S do with
/// IXON (the characters handed to the line discipline), else as TCXONC
/// does (a terminal stopped by TCXONC and one stopped by ^S then differ
/// only in what restarts it: ^Q does not restart the former). Returns the names
/// of the bits that could not be made again (the caller warns).
pub fn put_status(slave: &OwnedFd, status: u8, q: Option<&Queued>) -> Result<Vec<&'static str>> {
    let mut lost = Vec::new();
    let no_input = q.is_some_and(|q| q.lines.is_empty() && q.input.is_empty());
    let no_output = q.is_some_and(|q| q.output.is_empty());
    let t0 = fdio::tcgets(slave)?;
    let extproc = flag(&t0, LFLAG) & libc::EXTPROC != 0;
    let flow = |t: &[u8]| {
        flag(t, IFLAG) & libc::IXON != 0
            && t[CC + libc::VSTOP] == 0o23
            && t[CC + libc::VSTART] == 0o21
    };
    let mut flush = |bit: u8, empty: bool, how: libc::c_int, name: &'static str| -> Result<()> {
        if status & bit == 0 {
            return Ok(());
        }
        if !empty {
            lost.push(name);
            return Ok(());
        }
        ioctl_arg(slave, TCFLSH, how, "TCFLSH")
    };
    flush(PKT_FLUSHREAD, no_input, libc::TCIFLUSH, "FLUSHREAD")?;
    flush(PKT_FLUSHWRITE, no_output, libc::TCOFLUSH, "FLUSHWRITE")?;
    if status & (PKT_DOSTOP | PKT_NOSTOP) != 0 {
        // The bit set is the one of the flow control the change ends in.
        let want_on = status & PKT_DOSTOP != 0;
        if flow(&t0) == want_on && !(extproc && status & PKT_IOCTL == 0) {
            let mut other = t0.clone();
            if want_on {
                other[CC + libc::VSTART] = 0;
            } else {
                set_flag(&mut other, IFLAG, flag(&t0, IFLAG) | libc::IXON);
                other[CC + libc::VSTOP] = 0o23;
                other[CC + libc::VSTART] = 0o21;
            }
            fdio::tcsets(slave.as_fd(), &other)?;
            fdio::tcsets(slave.as_fd(), &t0)?;
        } else {
            lost.push(if want_on { "DOSTOP" } else { "NOSTOP" });
        }
    }
    if status & PKT_IOCTL != 0 && !(extproc && status & (PKT_DOSTOP | PKT_NOSTOP) != 0) {
        if extproc {
            fdio::tcsets(slave.as_fd(), &t0)?;
        } else if no_input {
            // Switching EXTPROC resets the line state: only with no input.
            let mut with = t0.clone();
            set_flag(&mut with, LFLAG, flag(&t0, LFLAG) | libc::EXTPROC);
            fdio::tcsets(slave.as_fd(), &with)?;
            fdio::tcsets(slave.as_fd(), &t0)?;
        } else {
            lost.push("IOCTL");
        }
    }
    if status & PKT_START != 0 {
        ioctl_arg(slave, TCXONC, libc::TCOOFF, "TCXONC")?;
        ioctl_arg(slave, TCXONC, libc::TCOON, "TCXONC")?;
    }
    if status & PKT_STOP != 0 {
        // A stopped terminal is stopped again only after a start (a dump
        // that lets it run on finds it stopped still): the kernel sets the
        // bit only when it stops a running one.
        ioctl_arg(slave, TCXONC, libc::TCOON, "TCXONC")?;
        let (start, stop) = (t0[CC + libc::VSTART], t0[CC + libc::VSTOP]);
        if flag(&t0, IFLAG) & libc::IXON != 0 && start != 0 && stop != 0 {
            inject(slave, &[start, stop])?;
        } else {
            ioctl_arg(slave, TCXONC, libc::TCOOFF, "TCXONC")?;
        }
    }
    Ok(lost)
}
