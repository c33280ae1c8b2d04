//! `cr_image`: look inside checkpoint images.
//!
//! - `cr_image show [--json] DIR`: print the metadata.
//! - `cr_image verify DIR`: check every checksum of every file.
//! - `cr_image bookmarks [--json] DIR...`: the TCP bookmarks of images.
//! - `cr_image cut DIR...`: check that images form a consistent cut.
//! - `cr_image unlock DIR`: remove an image's network lock here.
//! - `cr_image stats [--json] DIR`: page statistics of an image.
//! - `cr_image compact DIR [--out NEW]`: make an image self-contained.
//! - `cr_image rm [--rebase] DIR`: delete an image (refused while others
//!   depend on it, unless it is folded into them).
#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};
use cr_image::chain::{self, Chain};
use cr_image::store::StoreReader;
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
    /// Verify every checksum of an image and of the parents it needs.
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
    /// Page statistics: pages stored, taken from the parent, zero,
    /// duplicates; store size and compression.
    Stats {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
        /// Image directory.
        dir: PathBuf,
    },
    /// Write a self-contained copy of an image (its pages merged with all
    /// the parents it refers to), in place or into a new directory.
    Compact {
        /// New image directory [default: rewrite DIR in place].
        #[arg(long)]
        out: Option<PathBuf>,
        /// Compression of the new store [default: the image's].
        #[arg(long, value_parser = ["none", "lz4", "zstd"])]
        compress: Option<String>,
        /// Image directory.
        dir: PathBuf,
    },
    /// Delete an image. Refused while other images have it as their parent,
    /// unless --rebase.
    Rm {
        /// Fold the image's pages into each image that depends on it (they
        /// then refer to its parent), then delete it.
        #[arg(long)]
        rebase: bool,
        /// Image directory.
        dir: PathBuf,
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
                    serde_json::to_string_pretty(&cr_image::show::view(&ck))?
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
                #[derive(serde::Serialize)]
                struct Mark<'a> {
                    image: String,
                    state: &'static str,
                    #[serde(flatten)]
                    mark: &'a cr_image::bookmarks::Bookmark,
                }
                let v: Vec<_> = all
                    .iter()
                    .map(|(d, b)| Mark {
                        image: d.display().to_string(),
                        state: "ESTABLISHED",
                        mark: b,
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
            match &ck.netlock {
                None => println!("{}: the image took no network lock", dir.display()),
                Some(lock) if cr_sys::netlock::unlock(None, lock)? => {
                    println!("network lock {lock} removed")
                }
                Some(lock) => println!("network lock {lock} is not in this network namespace"),
            }
        }
        Cmd::Verify { dir } => {
            let chain = Chain::open(&dir)?;
            let mut buf = Vec::new();
            let mut bytes = 0u64;
            for link in &chain.links {
                if let Some(s) = &link.ck.store {
                    let r = StoreReader::open(&link.dir, s)?;
                    for b in 0..r.nr_blocks() {
                        bytes += r.block(b as u32, &mut buf)?.len() as u64;
                    }
                }
            }
            let top = chain.top();
            for pf in cr_image::model::objects::content_files(&top.ck) {
                let r = PageReader::open(&top.dir, pf)?;
                for e in &pf.extents {
                    r.read_extent(e, &mut buf)?;
                }
            }
            for p in &top.ck.processes {
                chain.resolve(p.pid, usize::MAX)?;
            }
            println!(
                "{}: intact ({} processes, {} image(s) in its chain, {} page bytes)",
                dir.display(),
                top.ck.processes.len(),
                chain.links.len(),
                bytes
            );
        }
        Cmd::Stats { json, dir } => {
            let ck = ImageDir::open(&dir)?.read_checkpoint()?;
            let parent = ck
                .parent
                .as_ref()
                .map(|p| chain::parent_dir(&dir, p).display().to_string());
            let v = cr_image::show::stats(&ck, parent);
            if json {
                println!("{}", serde_json::to_string(&v)?);
            } else {
                println!("{}", serde_json::to_string_pretty(&v)?);
            }
        }
        Cmd::Compact { out, compress, dir } => {
            let compression = compress.map(|c| c.parse()).transpose()?;
            let ck = chain::compact(&dir, out.as_deref(), compression, true)?;
            let size = ck.store.as_ref().map_or(0, |s| s.size);
            println!(
                "{} is self-contained: {} bytes of pages",
                out.as_deref().unwrap_or(&dir).display(),
                size
            );
        }
        Cmd::Rm { rebase, dir } => {
            let rewritten = chain::remove(&dir, rebase, true)?;
            for d in &rewritten {
                println!("{}: pages of {} folded in", d.display(), dir.display());
            }
            println!("{} removed", dir.display());
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
