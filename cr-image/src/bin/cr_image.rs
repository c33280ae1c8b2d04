//! `cr_image`: look inside checkpoint images.
//!
//! - `cr_image show [--json] DIR`: print the metadata.
//! - `cr_image verify DIR`: check every checksum of every file.
//! - `cr_image bookmarks [--json] DIR...`: the TCP bookmarks of images.
//! - `cr_image cut DIR...`: check that images form a consistent cut.
//! - `cr_image unlock DIR`: remove an image's network lock here.
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use cr_image::{ImageDir, PageReader};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "cr_image", version, about = "Inspect checkpoint images")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print an image's metadata.
    Show {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Image directory.
        dir: PathBuf,
    },
    /// Verify every checksum of an image.
    Verify {
        /// Image directory.
        dir: PathBuf,
    },
    /// Print the TCP bookmarks (addresses, snd_una, snd_nxt, rcv_nxt) of
    /// every established connection of the images.
    Bookmarks {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Image directories.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
    },
    /// Check that the images form a consistent cut: for every TCP
    /// connection with both ends among them, nothing received that was not
    /// sent and nothing lost. Exit 1 naming the first bad connection.
    Cut {
        /// Image directories.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
    },
    /// Remove the image's network lock from this network namespace (when
    /// the checkpointed processes were resumed instead of restored).
    Unlock {
        /// Image directory.
        dir: PathBuf,
    },
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.cmd {
        Cmd::Show { json, dir } => {
            let ck = ImageDir::open(&dir)?.read_checkpoint()?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&cr_image::show::to_json(&ck))?
                );
            } else {
                print!("{}", cr_image::show::to_text(&ck));
            }
        }
        Cmd::Bookmarks { json, dirs } => {
            let mut all = Vec::new();
            for dir in &dirs {
                let ck = ImageDir::open(dir)?.read_checkpoint()?;
                for b in cr_image::bookmarks::of(&ck) {
                    all.push((dir.clone(), b));
                }
            }
            if json {
                let v: Vec<_> = all
                    .iter()
                    .map(|(d, b)| {
                        let mut j = b.to_json();
                        j["image"] = serde_json::json!(d.display().to_string());
                        j
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for (d, b) in &all {
                    println!(
                        "{}: tcp {} -> {} snd_una={} snd_nxt={} rcv_nxt={}",
                        d.display(),
                        b.local,
                        b.remote,
                        b.snd_una,
                        b.snd_nxt,
                        b.rcv_nxt
                    );
                }
            }
        }
        Cmd::Cut { dirs } => {
            let mut all = Vec::new();
            for dir in &dirs {
                all.extend(cr_image::bookmarks::of(
                    &ImageDir::open(dir)?.read_checkpoint()?,
                ));
            }
            let n = cr_image::bookmarks::check_cut(&all)?;
            println!(
                "consistent: {n} connection(s) matched between the images, {} end(s) in all",
                all.len()
            );
        }
        Cmd::Unlock { dir } => {
            let ck = ImageDir::open(&dir)?.read_checkpoint()?;
            if ck.netlock.is_empty() {
                println!("{}: the image took no network lock", dir.display());
            } else if cr_sys::netlock::unlock(None, &ck.netlock)? {
                println!("network lock {} removed", ck.netlock);
            } else {
                println!(
                    "network lock {} is not in this network namespace",
                    ck.netlock
                );
            }
        }
        Cmd::Verify { dir } => {
            let d = ImageDir::open(&dir)?;
            let ck = d.read_checkpoint()?;
            let mut buf = Vec::new();
            let mut bytes = 0u64;
            for p in &ck.processes {
                if let Some(pf) = &p.pages {
                    let r = PageReader::open(&d, pf)?;
                    for e in &pf.extents {
                        r.read_extent(e, &mut buf)?;
                        bytes += buf.len() as u64;
                    }
                }
            }
            println!(
                "{}: intact ({} processes, {} page bytes)",
                dir.display(),
                ck.processes.len(),
                bytes
            );
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("CR_LOG"))
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cr_image: error: {}", cr_sys::error::one_line(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}
