//! A minimal client of redis's protocol (RESP2) over a TcpStream, for the
//! tests that check a real redis-server from the outside.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Minimal RESP client over a TcpStream.
pub struct Resp {
    r: BufReader<TcpStream>,
    w: TcpStream,
}

#[derive(Debug, PartialEq)]
pub enum Reply {
    Simple(String),
    Error(String),
    Int(i64),
    Bulk(Option<Vec<u8>>),
    Array(Vec<Reply>),
}

impl Resp {
    pub fn new(st: TcpStream) -> Resp {
        st.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("set_read_timeout");
        let w = st.try_clone().expect("clone stream");
        Resp {
            r: BufReader::new(st),
            w,
        }
    }

    pub fn encode(args: &[&[u8]]) -> Vec<u8> {
        let mut b = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            b.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            b.extend_from_slice(a);
            b.extend_from_slice(b"\r\n");
        }
        b
    }

    pub fn send(&mut self, cmds: &[Vec<u8>]) -> std::io::Result<()> {
        let all: Vec<u8> = cmds.concat();
        self.w.write_all(&all)
    }

    pub fn line(&mut self) -> std::io::Result<String> {
        let mut l = String::new();
        self.r.read_line(&mut l)?;
        if !l.ends_with("\r\n") {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("incomplete reply line {l:?}"),
            ));
        }
        l.truncate(l.len() - 2);
        Ok(l)
    }

    pub fn reply(&mut self) -> std::io::Result<Reply> {
        let l = self.line()?;
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let (t, rest) = l.split_at(1.min(l.len()));
        Ok(match t {
            "+" => Reply::Simple(rest.to_string()),
            "-" => Reply::Error(rest.to_string()),
            ":" => Reply::Int(rest.parse().map_err(|_| bad(&l))?),
            "$" => {
                let n: i64 = rest.parse().map_err(|_| bad(&l))?;
                if n < 0 {
                    Reply::Bulk(None)
                } else {
                    let mut b = vec![0u8; n as usize + 2];
                    self.r.read_exact(&mut b)?;
                    b.truncate(n as usize);
                    Reply::Bulk(Some(b))
                }
            }
            "*" => {
                let n: i64 = rest.parse().map_err(|_| bad(&l))?;
                let mut v = Vec::new();
                for _ in 0..n.max(0) {
                    v.push(self.reply()?);
                }
                Reply::Array(v)
            }
            _ => return Err(bad(&format!("unexpected reply line {l:?}"))),
        })
    }

    pub fn call(&mut self, args: &[&[u8]]) -> std::io::Result<Reply> {
        self.send(&[Resp::encode(args)])?;
        self.reply()
    }
}
