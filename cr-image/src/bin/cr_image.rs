//! `cr_image`: look inside checkpoint images.
//!
//! - `cr_image show [--json] DIR`: print the metadata.
//! - `cr_image verify DIR`: check every checksum of every file.
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
