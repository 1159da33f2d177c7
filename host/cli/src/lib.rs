//! The `allocbox` command's library part: what its integration tests reach without
//! running the binary.

pub mod report;
