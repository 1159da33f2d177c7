//! The bytes the host fills memory with, so that a value read from memory nobody
//! stored to is seen as such: and named wherever it shows up as an address, where the
//! fill is the cause and the address only its symptom.

/// What fresh host memory holds in checked mode ([`crate::HandlerBuilder::checked`]):
/// a byte the contract checker's block pattern never holds, so a block that should hold
/// a client's bytes and holds fresh memory instead differs at its first byte, whatever
/// the memory held before.
pub const FRESH_MEMORY: u8 = 0x5A;

/// Every byte of quarantined memory (see [`crate::HandlerBuilder::quarantine`]).
pub const QUARANTINE_POISON: u8 = 0xDD;

/// What an address made of a fill byte means, when `addr` is one (its top six bytes
/// the fill, the rest an offset a policy added): the cause to name beside it.
pub(crate) fn named_in(addr: u64) -> Option<&'static str> {
    let filled = |fill: u8| (addr >> 16) == u64::from_ne_bytes([fill; 8]) >> 16;
    if filled(FRESH_MEMORY) {
        return Some(
            "an address of 0x5A bytes is the checker's fill for memory no one wrote since \
             its upstream gave it: the policy used a value it read from memory it never \
             stored to (a link or header it forgot to write)",
        );
    }
    if filled(QUARANTINE_POISON) {
        return Some(
            "an address of 0xDD bytes is the quarantine's poison for memory given back: the \
             policy used a value it read from memory after freeing it",
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::named_in;

    /// Issue 73: `bytes.write at 0x5a5a5a5a5a5a5a6a` did not say that 0x5A is the
    /// checker's fill for fresh memory.
    #[test]
    fn an_address_of_fill_bytes_names_the_fill_and_others_name_nothing() {
        assert!(
            named_in(0x5a5a_5a5a_5a5a_5a6a)
                .unwrap()
                .contains("0x5A bytes")
        );
        assert!(
            named_in(0xdddd_dddd_dddd_0010)
                .unwrap()
                .contains("after freeing it")
        );
        assert_eq!(named_in(0x7f00_1234_5678), None);
        assert_eq!(named_in(0x5a5a_5a5a_5a00_0000), None);
    }
}
