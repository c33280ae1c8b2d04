//! Compiles the .proto files with protox (pure Rust), so no system `protoc` is needed.

fn main() {
    let files = ["image.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."]).expect("compile .proto files");
    prost_build::Config::new()
        .compile_fds(fds)
        .expect("generate Rust code from .proto files");
}
