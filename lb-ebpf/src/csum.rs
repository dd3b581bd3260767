//! Incremental Internet checksum updates (RFC 1624: HC' = ~(~HC + ~m + m')).
//!
//! Values are the raw 16/32-bit words as they sit in the packet (network byte
//! order loaded natively). Ones' complement addition commutes with byte
//! swapping, so no conversion is needed as long as every operand is taken
//! from the packet the same way.

#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    // Two folds are always enough for a sum of a handful of 16-bit words.
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// Checksum after one 16-bit word changed from `old` to `new`.
#[inline(always)]
pub fn replace2(check: u16, old: u16, new: u16) -> u16 {
    let sum = (!check as u32) + (!old as u32) + new as u32;
    !fold(sum)
}

/// Checksum after one 32-bit word changed from `old` to `new`.
#[inline(always)]
pub fn replace4(check: u16, old: u32, new: u32) -> u16 {
    let sum = (!check as u32) + (!(old as u16) as u32) + (!((old >> 16) as u16) as u32) + (new & 0xffff) + (new >> 16);
    !fold(sum)
}

/// Checksum after an address and a port changed (the L4 checksum covers the
/// pseudo-header address and the port).
#[inline(always)]
pub fn replace_addr_port(check: u16, old_addr: u32, new_addr: u32, old_port: u16, new_port: u16) -> u16 {
    let sum = (!check as u32)
        + (!(old_addr as u16) as u32)
        + (!((old_addr >> 16) as u16) as u32)
        + (new_addr & 0xffff)
        + (new_addr >> 16)
        + (!old_port as u32)
        + new_port as u32;
    !fold(sum)
}
