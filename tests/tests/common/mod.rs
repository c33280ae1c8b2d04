//! Helpers shared by several end-to-end test files (`mod common;`).

use cr_tests::Harness;
use std::ffi::OsStr;
use std::path::Path;

/// The image as `cr_image show --json` prints it.
#[allow(dead_code)] // not every test file uses every helper
pub fn show_json(h: &Harness, img: &Path) -> serde_json::Value {
    let out = h.cr_image(&[OsStr::new("show"), OsStr::new("--json"), img.as_os_str()]);
    out.assert_success("cr_image show --json");
    serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("cr_image show --json: bad JSON ({e})\n{}", out.show()))
}

/// The summaries of the image's objects (`cr_image show --json`).
#[allow(dead_code)]
pub fn object_summaries(h: &Harness, img: &Path) -> Vec<String> {
    let v = show_json(h, img);
    let mut found = Vec::new();
    collect_summaries(&v, &mut found);
    found
}

fn collect_summaries(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            if let Some(objs) = m.get("objects").and_then(|o| o.as_array()) {
                for o in objs {
                    if let Some(s) = o.get("summary").and_then(|s| s.as_str()) {
                        out.push(s.to_string());
                    }
                }
            }
            for (k, x) in m {
                if k != "objects" {
                    collect_summaries(x, out);
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_summaries(x, out)),
        _ => {}
    }
}
