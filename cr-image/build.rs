//! Compiles proto/image.proto with protox (pure Rust, no system `protoc`)
//! into prost types that stay private to this crate (see `model`).

fn main() {
    let file = "image.proto";
    println!("cargo:rerun-if-changed=../proto/{file}");
    let fds = protox::compile([file], ["../proto"]).expect("compile proto/image.proto");
    prost_build::Config::new()
        .compile_fds(fds)
        .expect("generate Rust code from proto/image.proto");
}
