//! Compiles `proto/reelay/v1/*.proto` with protox (no system `protoc` needed) and writes one
//! descriptor set for gRPC reflection.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not baked in when it is compiled: a build script compiled for
    // one checkout may be run for another sharing the target dir.
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let dir = root.join("reelay/v1");
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(&dir)?.map(|entry| entry.map(|e| e.path())).collect::<Result<_, _>>()?;
    files.retain(|p| p.extension().is_some_and(|ext| ext == "proto"));
    files.sort();
    for file in &files {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    println!("cargo:rerun-if-changed={}", dir.display());

    let descriptors = protox::compile(&files, [&root])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("reelay_descriptor.bin"), descriptors.encode_to_vec())?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
