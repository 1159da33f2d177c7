//! What the thread caches need from the platform, each behind one function with a
//! stand-in where the platform (or Miri) lacks it: asymmetric memory barriers, the
//! calling thread's thread pointer, and taking part in `fork`.

pub mod barrier;
#[cfg(not(allocbox_loom))]
pub mod fork;

/// Names the calling thread among the live ones: its thread pointer, which the
/// platform's ABI keeps in a register for thread-local storage. Reading it costs one
/// instruction, where a thread-local variable in a shared library (the NumPy bridge)
/// costs a call into the dynamic linker. A thread's pointer is reused only once that
/// thread has exited, as its thread id is. (x86-64 only: other targets are not built
/// and tested here.)
#[cfg(all(
    target_arch = "x86_64",
    any(target_os = "linux", target_os = "android"),
    not(miri)
))]
#[inline(always)]
pub fn thread_pointer() -> Option<usize> {
    let tp: usize;
    // SAFETY: the x86-64 ELF TLS ABI keeps the thread control block at the %fs base, and
    // its first word points to the block itself; every thread has one, so the load is
    // always valid, and it writes nothing.
    unsafe {
        std::arch::asm!(
            "mov {}, qword ptr fs:[0]",
            out(reg) tp,
            options(nostack, readonly, preserves_flags, pure)
        );
    }
    Some(tp)
}

/// Elsewhere (and under Miri, which runs no inline assembly) every thread's slot is
/// found through a thread-local lookup.
#[cfg(not(all(
    target_arch = "x86_64",
    any(target_os = "linux", target_os = "android"),
    not(miri)
)))]
#[inline(always)]
pub fn thread_pointer() -> Option<usize> {
    None
}
