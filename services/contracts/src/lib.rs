//! Reelay's wire contracts, generated from `proto/` at build time.
//!
//! The module tree mirrors the protobuf packages. Every other crate uses these types; nobody
//! regenerates them.

pub mod reelay {
    pub mod v1 {
        tonic::include_proto!("reelay.v1");
    }
}

pub use reelay::v1;

/// The encoded descriptor set of every Reelay proto, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/reelay_descriptor.bin"));
