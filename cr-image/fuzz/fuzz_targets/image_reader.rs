//! Any bytes as the metadata of an image: the reader returns an error or an
//! image, and never panics, whatever the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

fn dir() -> &'static std::path::Path {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("cr-image-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("fuzz directory");
        d
    })
}

fuzz_target!(|data: &[u8]| {
    if cr_image::Checkpoint::decode(data).is_ok() {
        let _ = cr_image::fuzz::read_image(dir(), data);
    }
});
