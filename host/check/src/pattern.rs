//! The byte pattern every live block holds: each block's bytes are a window of one
//! long template, so a byte out of place names its offset.

/// The period of the byte pattern written into every block: prime, so that a copy from
/// a wrong offset is seen unless the offset is a multiple of it.
pub(super) const PERIOD: usize = 251;

/// Blocks are filled and compared in chunks of this many bytes (a multiple of PERIOD).
pub(super) const CHUNK: usize = PERIOD * 64;

/// `PERIOD + CHUNK` bytes of the pattern; a block with phase `p` holds, from every chunk
/// boundary on, `template()[p..p + CHUNK]` — so fill and compare run at memcpy speed.
pub(super) fn template() -> &'static [u8] {
    static TEMPLATE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TEMPLATE.get_or_init(|| {
        (0..PERIOD + CHUNK)
            .map(|i| (i % PERIOD) as u8 ^ 0xA5)
            .collect()
    })
}

/// The pattern as it runs from offset `from` (mod PERIOD) of a block on: `CHUNK` bytes.
pub(super) fn expected_at(expected: &'static [u8], from: usize) -> &'static [u8] {
    // `expected` starts at the block's phase; the template is PERIOD + CHUNK long and
    // periodic, so starting `from` further in is another window of it.
    let base = expected.as_ptr() as usize - template().as_ptr() as usize;
    &template()[(base + from) % PERIOD..][..CHUNK]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pattern's bytes are `i ^ 0xA5` for `i < PERIOD`; fresh memory is `255 ^ 0xA5`,
    /// so a block that should hold a client's bytes and holds fresh memory instead
    /// differs at its first byte, whatever memory held before.
    #[test]
    fn fresh_memory_never_looks_like_a_client_s_bytes() {
        assert!(!template().contains(&allocbox::FRESH_MEMORY));
    }
}
