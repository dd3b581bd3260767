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
    let sum = u32::from(!check) + u32::from(!old) + u32::from(new);
    !fold(sum)
}

/// Checksum after one 32-bit word changed from `old` to `new`.
#[inline(always)]
pub fn replace4(check: u16, old: u32, new: u32) -> u16 {
    let sum =
        u32::from(!check) + u32::from(!(old as u16)) + u32::from(!((old >> 16) as u16)) + (new & 0xffff) + (new >> 16);
    !fold(sum)
}

/// Checksum after an address and a port changed (the L4 checksum covers the
/// pseudo-header address and the port).
#[inline(always)]
pub fn replace_addr_port(check: u16, old_addr: u32, new_addr: u32, old_port: u16, new_port: u16) -> u16 {
    let sum = u32::from(!check)
        + u32::from(!(old_addr as u16))
        + u32::from(!((old_addr >> 16) as u16))
        + (new_addr & 0xffff)
        + (new_addr >> 16)
        + u32::from(!old_port)
        + u32::from(new_port);
    !fold(sum)
}

/// The folded sum of the IPv4 pseudo-header (addresses, protocol, L4
/// length), in the same raw word order as the packet. A sender that leaves
/// the checksum to offload (CHECKSUM_PARTIAL) puts exactly this in the L4
/// checksum field, uncomplemented.
#[inline(always)]
pub fn pseudo_header(saddr: u32, daddr: u32, proto: u8, l4_len: u16) -> u16 {
    // Raw words: the protocol sits in the second byte of its word, and the
    // length in network order, as both are laid out in memory.
    let proto_word = u32::from(u16::from_ne_bytes([0, proto]));
    let sum =
        (saddr & 0xffff) + (saddr >> 16) + (daddr & 0xffff) + (daddr >> 16) + proto_word + u32::from(l4_len.to_be());
    fold(sum)
}

/// Ones' complement sum of two folded sums.
#[inline(always)]
pub fn add(a: u16, b: u16) -> u16 {
    fold(u32::from(a) + u32::from(b))
}

/// Fold a 32-bit partial sum (as `bpf_csum_diff` returns) to 16 bits.
#[inline(always)]
pub fn fold32(sum: u32) -> u16 {
    fold((sum & 0xffff) + (sum >> 16))
}

/// An unfinished (partial) checksum field after an address changed: it
/// holds the uncomplemented pseudo-header sum, so the address delta goes
/// in the other direction than for a finished checksum, and ports (which
/// the device sums itself when it finishes the checksum) do not enter.
#[inline(always)]
pub fn replace4_partial(seed: u16, old: u32, new: u32) -> u16 {
    !replace4(!seed, old, new)
}

/// Sum of the complements of `old`'s 16-bit words and of `new`'s words:
/// the delta an IPv6 address change makes to a checksum.
#[inline(always)]
fn delta6(old: &[u32; 4], new: &[u32; 4]) -> u32 {
    let mut sum = 0u32;
    for i in 0..4 {
        sum += u32::from(!(old[i] as u16)) + u32::from(!((old[i] >> 16) as u16));
        sum += (new[i] & 0xffff) + (new[i] >> 16);
    }
    sum
}

/// Checksum after an IPv6 address and a port changed (the L4 checksum
/// covers the pseudo-header addresses and the port).
#[inline(always)]
pub fn replace_addr6_port(check: u16, old: &[u32; 4], new: &[u32; 4], old_port: u16, new_port: u16) -> u16 {
    // At most 18 words of 16 bits: fold32 then fold is enough.
    let sum = u32::from(!check) + delta6(old, new) + u32::from(!old_port) + u32::from(new_port);
    !fold32(sum)
}

/// An unfinished (partial) checksum field after an IPv6 address changed
/// (see [`replace4_partial`]).
#[inline(always)]
pub fn replace6_partial(seed: u16, old: &[u32; 4], new: &[u32; 4]) -> u16 {
    fold32(u32::from(seed) + delta6(old, new))
}

/// The folded sum of the IPv6 pseudo-header (addresses, 32-bit upper-layer
/// length, next header), raw words as in the packet.
#[inline(always)]
pub fn pseudo_header6(saddr: &[u32; 4], daddr: &[u32; 4], proto: u8, l4_len: u32) -> u16 {
    let mut sum = 0u32;
    for i in 0..4 {
        sum += (saddr[i] & 0xffff) + (saddr[i] >> 16) + (daddr[i] & 0xffff) + (daddr[i] >> 16);
    }
    let len = l4_len.to_be();
    sum += (len & 0xffff) + (len >> 16);
    sum += u32::from(u16::from_ne_bytes([0, proto]));
    fold32(sum)
}
