//! Compiles cluster.proto with protox (pure Rust), so no system `protoc` is
//! needed. (image.proto is compiled by cr-image, which keeps its types
//! private.)

fn main() {
    let files = ["cluster.proto"];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    // Without the gRPC services (libcr): nothing to generate.
    if std::env::var_os("CARGO_FEATURE_GRPC").is_none() {
        return;
    }
    let fds = protox::compile(files, ["."]).expect("compile .proto files");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // Image chunks are sliced out of the received buffer, not copied.
        .bytes(".cr.cluster.v1.FileChunk.data")
        .compile_fds(fds)
        .expect("generate Rust code from .proto files");
}
