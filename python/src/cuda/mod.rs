//! `allocbox.cuda`'s half in Rust: `device` (device handlers for GPU programs, and the
//! owner of a block CuPy's and Numba's pointers keep alive) and `torch` (the C functions
//! PyTorch's pluggable allocator calls), which uses `device`.

pub(crate) mod device;
pub(crate) mod torch;
