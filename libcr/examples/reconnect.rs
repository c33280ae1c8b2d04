//! `reconnect HOST:PORT COUNT`: the Rust twin of `reconnect.c`. It keeps a
//! connection to a server outside its job, closes it before every
//! checkpoint and opens it again afterwards (after a continue or a
//! restart, maybe on another node), and sends COUNT numbered lines, each
//! answered by one line, one every 50 ms, never between a question and its
//! answer (a critical section).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Conn = Arc<Mutex<Option<BufReader<TcpStream>>>>;

fn connect(addr: &str) -> std::io::Result<BufReader<TcpStream>> {
    TcpStream::connect(addr).map(BufReader::new)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, addr, count] = &args[..] else {
        eprintln!("usage: reconnect HOST:PORT COUNT");
        std::process::exit(2);
    };
    let count: u32 = count.parse().unwrap_or_else(|_| {
        eprintln!("reconnect: COUNT must be a number, not {count:?}");
        std::process::exit(2);
    });
    let conn: Conn = Arc::new(Mutex::new(Some(connect(addr).unwrap_or_else(|e| {
        eprintln!("reconnect: cannot connect to {addr}: {e}");
        std::process::exit(1);
    }))));
    println!("connected");
    let (c, a) = (conn.clone(), addr.clone());
    cr::on_checkpoint(cr::Context::Thread, "reconnect", move || {
        // Nothing of the outside connection goes into the image.
        c.lock().unwrap().take();
        let how = match cr::checkpoint() {
            Ok(cr::Resumed::Continued) => "continue".to_string(),
            Ok(cr::Resumed::Restarted(info)) => format!(
                "restart from {}{}",
                info.src,
                if info.node_changed() {
                    " on another node"
                } else {
                    ""
                }
            ),
            Err(e) => format!("cancelled: {e}"),
        };
        let s = connect(&a).map_err(|e| cr::Error::Cancelled(format!("cannot reconnect: {e}")))?;
        *c.lock().unwrap() = Some(s);
        println!("reconnected ({how})");
        Ok(())
    })
    .unwrap_or_else(|e| {
        eprintln!("reconnect: {e}");
        std::process::exit(1);
    });
    for i in 1..=count {
        {
            let _cs = cr::critical_section();
            let mut g = conn.lock().unwrap();
            let s = g.as_mut().expect("connected outside checkpoints");
            let mut answer = String::new();
            let ok = writeln!(s.get_mut(), "{i}").is_ok()
                && s.read_line(&mut answer).map(|n| n > 0).unwrap_or(false);
            if !ok {
                println!("line {i}: no answer");
                std::process::exit(1);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("sent {count} lines");
}
