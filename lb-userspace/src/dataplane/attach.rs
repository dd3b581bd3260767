//! Attaching the program to the interfaces (each in the XDP mode its
//! devices allow, or adopting a pinned link), keeping the NETDEVS map and
//! the path report in step with the devices, detaching and the clean stop.
use std::{
    collections::BTreeMap,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use aya::programs::{
    LinkOrder, ProgramError, SchedClassifier, TcAttachType, Xdp, XdpMode as AyaXdpMode,
    links::{FdLink, PinnedLink},
    tc::{SchedClassifierLinkId, TcAttachOptions},
    xdp::{XdpLink, XdpLinkId},
};
use lb_common::maps as names;
use tracing::{info, warn};

use super::{
    Attachment, Dataplane, DataplaneError, PROGRAM, TcLink, map_err,
    pin::{pinned_mode, pinned_program, severed},
};
use crate::{
    config::XdpMode,
    netdev,
    paths::{self, Mode, PathReport},
};

pub(super) enum AttachedLink {
    /// Pinned in bpffs: survives us. `adopted`: the link was pinned by a
    /// previous lbd, and this one swapped its program in; `previous` holds
    /// the program it had, until the whole attach succeeded (to put it
    /// back if it does not).
    /// `switched`: this lbd replaced a pinned link that ran `previous` in
    /// another mode on device `ifindex`, to be made again if the attach
    /// fails.
    Pinned { fd: FdLink, path: PathBuf, adopted: bool, previous: Option<OwnedFd>, switched: Option<(Mode, u32)> },
    /// Owned by the program object (unpinned data planes, for tests).
    Owned(XdpLinkId),
    /// None: the interface was replaced and attaching to the new device
    /// failed (tried again by `reattach`).
    Detached,
}

pub(super) struct Attached {
    pub(super) attachment: Attachment,
    link: AttachedLink,
}

/// What an attach error adds when the device refused native mode, which
/// only a forced mode reports (`auto` falls back to generic and logs the
/// error): the way out. EOPNOTSUPP: the device has no driver XDP. ERANGE:
/// a veth whose MTU is above what native XDP takes in one page (about
/// 3,500 bytes) from a program without multi-buffer support, as ours is;
/// the kernel's own words ("Numerical result out of range") say nothing
/// of the MTU.
pub(super) fn hint(mode: Mode, e: &ProgramError) -> &'static str {
    let ProgramError::SyscallError(s) = e else { return "" };
    match s.io_error.raw_os_error() {
        Some(libc::EOPNOTSUPP) if mode == Mode::Native => {
            ", which this device does not offer (xdp_mode: auto falls back to generic mode)"
        }
        Some(libc::ERANGE) if mode == Mode::Native => {
            ", which refuses this device's MTU: native XDP on a veth takes frames of at most about 3,500 bytes \
             from this program (it is not multi-buffer); lower the MTU, or use xdp_mode: generic (auto falls \
             back to it)"
        }
        _ => "",
    }
}

/// Swap the program an adopted link ran before back into it (`previous`,
/// held since before the swap); whether it is back.
fn restore_previous(iface: &str, path: &Path, previous: Option<&OwnedFd>) -> bool {
    let Some(prog) = previous else {
        warn!(interface = %iface, "the program this link ran before is gone: this build's stays in it");
        return false;
    };
    match super::sys::relink_pinned(path, prog) {
        Ok(()) => {
            info!(interface = %iface, "the program the link ran before is back in it");
            true
        }
        Err(e) => {
            warn!(interface = %iface, error = %e, "putting the previous program back into the link");
            false
        }
    }
}

/// How [`Dataplane::attach`] brings an interface to the mode `xdp_mode`
/// gives it, in the order the steps are taken.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// No pinned link: attached anew. First: an interface that cannot be
    /// attached fails the start before anything running is touched.
    New,
    /// A pinned link in another mode (the one held here): replaced by a
    /// new link. The kernel runs one mode per device at a time, so the
    /// old link is detached first, and for the moment between the two the
    /// device's packets meet no XDP program.
    Switch(Mode),
    /// A pinned link in the mode `xdp_mode` gives: this build's program
    /// swapped in, atomically. Last.
    Swap,
}

impl Step {
    fn order(self) -> u8 {
        match self {
            Self::New => 0,
            Self::Switch(_) => 1,
            Self::Swap => 2,
        }
    }
}

/// Which step brings `iface`, whose pinned link (if any) runs in `pinned`,
/// to `chosen`, the mode `xdp_mode` gives it. `auto` leaves a pinned
/// generic link generic: generic mode redirects into every device, and
/// auto may have fallen back to it when native mode would not attach.
fn step(requested: XdpMode, pinned: Option<Mode>, chosen: Mode) -> Step {
    match pinned {
        None => Step::New,
        Some(m) if m == chosen => Step::Swap,
        Some(Mode::Generic) if requested == XdpMode::Auto => Step::Swap,
        Some(m) => Step::Switch(m),
    }
}

/// "id N, name" of the loaded program `id`, for an error.
fn describe_program(id: u32) -> String {
    let name = aya::programs::loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == id)
        .and_then(|p| p.name_as_str().map(str::to_owned));
    match name {
        Some(n) if !n.is_empty() => format!("id {id}, \"{n}\""),
        _ => format!("id {id}"),
    }
}

/// Attach `previous`, the program a link replaced in another mode ran, to
/// `iface` (device `ifindex`) again in its mode `from`, pinned at `path`:
/// a failed start's undoing of a mode switch. Whether it is back.
fn relink_previous(iface: &str, ifindex: u32, from: Mode, path: &Path, previous: Option<&OwnedFd>) -> bool {
    let Some(prog) = previous else {
        warn!(interface = %iface, "the program the link ran before is gone: the interface has no XDP program");
        return false;
    };
    match super::sys::pin_xdp_link(prog, ifindex, from == Mode::Generic, path) {
        Ok(()) => {
            info!(interface = %iface, mode = from.name(), "the program the interface ran before is back on it, in its mode");
            true
        }
        Err(e) => {
            warn!(interface = %iface, mode = from.name(), error = %e, "attaching the previous program again: the interface has no XDP program");
            false
        }
    }
}

/// Detach every tc ingress link pinned in `dir` (see `attach_tc`) whose
/// interface `keep` does not name, and remove its pin.
fn unpin_tc_links(dir: &Path, keep: impl Fn(&str) -> bool) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !keep(&name) {
            unpin(TC_LINK, &name, &e.path());
        }
    }
}

/// Detach the link pinned at `path` for `iface` and remove its pin.
/// Detached now (see `sys`), not whenever the kernel drops the
/// link's last reference after the pin goes.
fn unpin_link(iface: &str, path: &Path) {
    unpin("XDP", iface, path);
}

/// The name [`unpin`] gives a tc ingress link in its warnings.
const TC_LINK: &str = "tc ingress";

/// [`unpin_link`] for a link of `kind` (`XDP`, [`TC_LINK`]).
fn unpin(kind: &str, iface: &str, path: &Path) {
    if let Err(e) = super::sys::detach_pinned(path) {
        warn!(interface = %iface, error = %e, "detaching the {kind} link; it goes with its pin");
    }
    if let Err(e) = std::fs::remove_file(path) {
        warn!(interface = %iface, error = %e, "unpinning the {kind} link");
    }
}

impl Dataplane {
    /// Attach to every interface, each in the mode [`paths::choose_mode`]
    /// picks from what the devices can do (`auto`), or as forced. Where a
    /// pinned link from a previous lbd exists in that mode, the program is
    /// swapped in atomically (link update) instead; a pinned link in
    /// another mode is replaced by a new one (see [`Step`]). The NETDEVS
    /// map is filled first, so the first packet already knows its paths.
    ///
    /// Interfaces without a pinned link are attached first, mode switches
    /// come next and adopted links are swapped last, so that an interface
    /// that cannot be attached fails the call before the running program
    /// is replaced anywhere. On error, interfaces attached here are
    /// detached again, NETDEVS gets back what it held, adopted links
    /// already swapped get the program they ran before back, interfaces
    /// already switched get it back in their previous mode, and links of
    /// interfaces no longer configured stay.
    pub fn attach(&mut self, interfaces: &[String], requested: XdpMode) -> Result<(), DataplaneError> {
        let links_dir = self.pin.as_ref().map(|p| p.join("links"));
        // Links pinned for interfaces no longer configured: detached once
        // every configured one is attached.
        let mut unconfigured: Vec<(String, PathBuf)> = Vec::new();
        if let Some(d) = &links_dir {
            std::fs::create_dir_all(d).map_err(|source| DataplaneError::Pin { path: d.clone(), source })?;
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if !interfaces.contains(&name) {
                        unconfigured.push((name, e.path()));
                    }
                }
            }
        }
        let links = netdev::links()?;
        let find = |name: &str| {
            links.iter().find(|l| l.name == name).ok_or_else(|| DataplaneError::NoInterface(name.to_owned()))
        };
        // (interface, mode, why, step)
        let mut plan: Vec<(String, Mode, String, Step)> = Vec::new();
        for iface in interfaces {
            // A severed pinned link (`pin::severed`): nothing can be
            // swapped into it; the interface is attached as a new one (or,
            // with another program on the new device, refused below).
            let dev = find(iface)?;
            if let Some(path) = links_dir.as_ref().map(|d| d.join(iface)).filter(|p| p.exists())
                && severed(&path, dev)
            {
                info!(interface = %iface, "the pinned XDP link's device is gone (the interface was replaced): attaching anew");
                unpin_link(iface, &path);
            }
            let egresses: Vec<&netdev::Link> =
                paths::egresses_of(iface, interfaces).into_iter().map(find).collect::<Result<_, _>>()?;
            let (chosen, reason) = paths::choose_mode(requested, dev, &egresses);
            let pinned = pinned_mode(links_dir.as_deref(), iface, dev);
            // A program on the device that is not ours to swap: the kernel
            // would refuse a link beside it (EBUSY); say whose it may be.
            if pinned.is_none()
                && let Some(&id) = dev.xdp_progs.first()
            {
                return Err(DataplaneError::Taken {
                    iface: iface.clone(),
                    program: describe_program(id),
                    pin: self.pin.as_ref().map_or_else(|| "(none: unpinned)".into(), |p| p.display().to_string()),
                });
            }
            let step = step(requested, pinned, chosen);
            // A link kept in its mode: plan with that one.
            let mode = if step == Step::Swap { pinned.unwrap_or(chosen) } else { chosen };
            if step == Step::Swap && mode != chosen {
                info!(interface = %iface, mode = mode.name(), "the pinned link keeps generic mode, which redirects into every device; auto would choose native now ({reason}), which a clean stop and start, or xdp_mode: native, gives");
            }
            if requested == XdpMode::Native {
                for c in paths::native_caveats(&egresses) {
                    warn!(interface = %iface, "xdp_mode native: {c}");
                }
            }
            plan.push((iface.clone(), mode, reason, step));
        }
        // New attachments first, mode switches next, swaps last (a stable
        // sort keeps the configured order within each).
        plan.sort_by_key(|p| p.3.order());
        // An interface to be switched keeps the flags of the mode it runs
        // in until its switch (`switch_one`).
        let planned: BTreeMap<String, Mode> = plan
            .iter()
            .map(|(i, m, _, step)| (i.clone(), if let Step::Switch(from) = step { *from } else { *m }))
            .collect();
        let netdevs_before: BTreeMap<u32, u32> = self.maps.netdevs.iter().filter_map(Result::ok).collect();
        self.write_netdevs(&paths::netdev_flags(&links, &planned))?;
        let mut done: Vec<Attached> = Vec::new();
        for (iface, mode, reason, step) in plan {
            let attached = match step {
                Step::Switch(from) => self.switch_one(find(&iface)?, from, mode, requested, reason),
                _ => self.attach_one(&iface, mode, requested, reason, links_dir.as_deref()),
            };
            match attached {
                Ok(a) => {
                    self.swapped |= matches!(
                        a.link,
                        AttachedLink::Pinned { adopted: true, .. } | AttachedLink::Pinned { switched: Some(_), .. }
                    );
                    done.push(a);
                }
                Err(e) => {
                    // Undo what this call attached. A link adopted from
                    // the previous lbd stays pinned (unpinning it would
                    // stop the balancer that was running), with the
                    // program it had put back.
                    let mut restored = true;
                    for a in done {
                        match &a.link {
                            AttachedLink::Pinned { adopted: true, path, previous, .. } => {
                                restored &= restore_previous(&a.attachment.interface, path, previous.as_ref());
                            }
                            AttachedLink::Pinned { switched: Some((from, ifindex)), path, previous, .. } => {
                                let (from, ifindex) = (*from, *ifindex);
                                let (path, previous) =
                                    (path.clone(), previous.as_ref().and_then(|p| p.try_clone().ok()));
                                self.detach_one(a);
                                let link = links.iter().find(|l| l.ifindex == ifindex).expect("a device attached here");
                                restored &= self.put_back(link, from, &path, previous.as_ref());
                            }
                            _ => self.detach_one(a),
                        }
                    }
                    // Nothing runs this build's program any more.
                    self.swapped &= !restored;
                    if let Err(e) = self.write_netdevs(&netdevs_before) {
                        warn!(error = %e, "restoring the egress paths (NETDEVS) after a failed attach");
                    }
                    return Err(e);
                }
            }
        }
        // Every interface runs this program: during a migration, its SYNs
        // need wait no longer (`lb_common::HOLD_NEW`).
        if self.migration.is_some() && self.hold_until & lb_common::HOLD_NEW != 0 {
            self.hold_until &= !lb_common::HOLD_NEW;
            if let Err(e) = self.write_flood(self.new_flow_rate(), self.hold_until) {
                warn!(error = %e, "ending the hold of new connections; it lapses by itself within seconds");
            }
        }
        // Done: the previous programs may go.
        for a in &mut done {
            if let AttachedLink::Pinned { previous, .. } = &mut a.link {
                *previous = None;
            }
        }
        self.attached.extend(done);
        self.interfaces = interfaces.to_vec();
        self.requested = requested;
        for (iface, path) in unconfigured {
            unpin_link(&iface, &path);
            info!(interface = %iface, "detached (no longer configured)");
        }
        // So are the pinned tc links of interfaces no longer configured.
        if let Some(pin) = &self.pin {
            unpin_tc_links(&pin.join("tc"), |name| interfaces.iter().any(|i| i == name));
        }
        self.remove_stale_pins();
        self.refresh_paths().map(drop)
    }

    /// Unpin the maps an older build left that this one does not use
    /// (`lb_common::maps::STALE`): its program was attached until this
    /// build's replaced it everywhere, which has just happened, so nothing
    /// reads them any more.
    fn remove_stale_pins(&self) {
        let Some(pin) = &self.pin else { return };
        for name in names::STALE {
            let path = pin.join("maps").join(name);
            match std::fs::remove_file(&path) {
                Ok(()) => info!(map = name, "removed the map an older version pinned"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => warn!(path = %path.display(), error = %e, "removing an older version's map"),
            }
        }
    }

    fn attach_one(
        &mut self,
        iface: &str,
        mode: Mode,
        requested: XdpMode,
        reason: String,
        links_dir: Option<&Path>,
    ) -> Result<Attached, DataplaneError> {
        let prog: &mut Xdp = self.ebpf.program_mut(PROGRAM).ok_or(ProgramError::NotLoaded)?.try_into()?;
        let pin_path = links_dir.map(|d| d.join(iface));
        if let Some(path) = pin_path.as_ref().filter(|p| p.exists()) {
            // Adopt: replace the program behind the existing link.
            let link_err = |source| DataplaneError::Link { path: path.clone(), source };
            let pinned = FdLink::from(PinnedLink::from_pin(path).map_err(link_err)?);
            // The program it runs, held until the whole attach succeeded.
            let previous = pinned.info().ok().and_then(|i| super::sys::prog_by_id(i.program_id()).ok());
            let xdp = XdpLink::try_from(pinned).map_err(link_err)?;
            let id = prog.attach_to_link(xdp)?;
            let fd = FdLink::try_from(prog.take_link(id)?).map_err(link_err)?;
            // `mode` is the link's own, as the kernel said it when `attach`
            // planned (`pinned_mode`); why it was chosen went with the lbd
            // that attached it.
            let reason = String::new();
            info!(interface = %iface, mode = mode.name(), "XDP program replaced on the pinned link");
            return Ok(Attached {
                attachment: Attachment { interface: iface.to_owned(), mode, reason, missing: false, tc: None },
                link: AttachedLink::Pinned { fd, path: path.clone(), adopted: true, previous, switched: None },
            });
        }
        let try_mode = |prog: &mut Xdp, m: Mode| {
            let aya_mode = match m {
                Mode::Native => AyaXdpMode::Driver,
                Mode::Generic => AyaXdpMode::Skb,
            };
            prog.attach(iface, aya_mode).map_err(|source| DataplaneError::Attach {
                iface: iface.to_owned(),
                mode: m,
                source,
            })
        };
        let (id, mode, reason) = match (mode, requested) {
            (Mode::Native, XdpMode::Auto) => match try_mode(prog, Mode::Native) {
                Ok(id) => (id, Mode::Native, reason),
                Err(e) => {
                    warn!(interface = %iface, error = %e, "native XDP attach failed; falling back to generic mode");
                    (try_mode(prog, Mode::Generic)?, Mode::Generic, format!("auto: native attach failed ({e})"))
                }
            },
            (m, _) => (try_mode(prog, m)?, m, reason),
        };
        info!(interface = %iface, mode = mode.name(), reason = %reason, "XDP attached");
        let attachment =
            Attachment { interface: iface.to_owned(), mode, reason: reason.clone(), missing: false, tc: None };
        let Some(path) = pin_path else {
            return Ok(Attached { attachment, link: AttachedLink::Owned(id) });
        };
        let link_err = |source| DataplaneError::Link { path: path.clone(), source };
        let fd = FdLink::try_from(prog.take_link(id)?).map_err(link_err)?;
        let pinned = fd
            .pin(&path)
            .map_err(|e| DataplaneError::Pin { path: path.clone(), source: std::io::Error::other(e.to_string()) })?;
        Ok(Attached {
            attachment,
            link: AttachedLink::Pinned {
                fd: FdLink::from(pinned),
                path,
                adopted: false,
                previous: None,
                switched: None,
            },
        })
    }

    /// Replace the pinned link of the interface `link`, which runs in mode
    /// `from`, by one of this build's program in `mode`. The link is
    /// detached first (the kernel refuses a second mode beside it), and
    /// the time until the new one is attached is logged: meanwhile the
    /// device's packets go to the kernel's stack unbalanced. Its flags in
    /// NETDEVS change in that moment, when no program runs on it, so that
    /// neither program reads the other mode's (a native program given
    /// generic flags redirects where native redirects are lost; a generic
    /// one given native flags finishes checksums the kernel finishes
    /// again). If the new link cannot be made, the old program is attached
    /// again in `from`. A pinned link whose program cannot be held (to put
    /// back) is kept in its mode, with this build's program swapped in.
    fn switch_one(
        &mut self,
        link: &netdev::Link,
        from: Mode,
        mode: Mode,
        requested: XdpMode,
        reason: String,
    ) -> Result<Attached, DataplaneError> {
        let (iface, ifindex) = (link.name.as_str(), link.ifindex);
        let links_dir = self.pin.as_ref().map(|p| p.join("links")).expect("a pinned link has a pin directory");
        let path = links_dir.join(iface);
        let previous = pinned_program(&path).and_then(|id| super::sys::prog_by_id(id).ok());
        let Some(previous) = previous else {
            warn!(interface = %iface, from = from.name(), to = mode.name(), "the pinned link's program cannot be held (to put back should the new mode fail): the link keeps its mode");
            return self.attach_one(iface, from, requested, String::new(), Some(&links_dir));
        };
        let started = std::time::Instant::now();
        // Nothing has changed if the detach fails; after it, whatever fails
        // puts the previous program back.
        super::sys::detach_pinned(&path).map_err(|source| DataplaneError::Pin { path: path.clone(), source })?;
        let attached = std::fs::remove_file(&path)
            .map_err(|source| DataplaneError::Pin { path: path.clone(), source })
            .and_then(|()| self.write_mode_flags(link, mode))
            .and_then(|()| self.attach_one(iface, mode, requested, reason, Some(&links_dir)));
        match attached {
            Ok(mut a) => {
                // auto fell back to generic mode.
                if a.attachment.mode != mode
                    && let Err(e) = self.write_mode_flags(link, a.attachment.mode)
                {
                    warn!(interface = %iface, error = %e, "writing the flags of the mode attached (NETDEVS)");
                }
                let gap = started.elapsed();
                warn!(interface = %iface, from = from.name(), to = a.attachment.mode.name(), gap_us = gap.as_micros() as u64,
                      "XDP mode changed as xdp_mode gives: the pinned link was replaced; the device's packets met no XDP program for {gap:?}");
                if let AttachedLink::Pinned { previous: p, switched, .. } = &mut a.link {
                    *p = Some(previous);
                    *switched = Some((from, ifindex));
                }
                Ok(a)
            }
            Err(e) => {
                self.put_back(link, from, &path, Some(&previous));
                Err(e)
            }
        }
    }

    /// Undo a mode switch on `link` whose new link is gone: its flags for
    /// mode `from` first (no program runs on it), then `previous` attached
    /// again in `from`, pinned at `path`. Whether it is back.
    fn put_back(&mut self, link: &netdev::Link, from: Mode, path: &Path, previous: Option<&OwnedFd>) -> bool {
        if let Err(e) = self.write_mode_flags(link, from) {
            warn!(interface = %link.name, error = %e, "writing the previous mode's flags (NETDEVS)");
        }
        relink_previous(&link.name, link.ifindex, from, path, previous)
    }

    /// NETDEVS as last written, with the flags of `link` for a program on
    /// it in `mode`.
    fn write_mode_flags(&mut self, link: &netdev::Link, mode: Mode) -> Result<(), DataplaneError> {
        let mut flags = self.netdevs.clone();
        flags.extend(paths::netdev_flags(std::slice::from_ref(link), &BTreeMap::from([(link.name.clone(), mode)])));
        self.write_netdevs(&flags)
    }

    /// Re-read the network devices and bring NETDEVS (which egress takes
    /// which path) up to date: at attach, and periodically, since a
    /// device's abilities change at run time (a veth peer's GRO or XDP, a
    /// bridge port added, a link going down). Every path that changes is
    /// logged, one line per ingress and egress. Returns whether anything
    /// changed.
    pub fn refresh_paths(&mut self) -> Result<bool, DataplaneError> {
        let mut links = netdev::links()?;
        let reattached = self.reattach(&links);
        if reattached {
            links = netdev::links()?;
        }
        self.attach_tc(&links);
        let modes: BTreeMap<String, Mode> = self
            .attached
            .iter()
            .filter(|a| !a.attachment.missing)
            .map(|a| (a.attachment.interface.clone(), a.attachment.mode))
            .collect();
        self.write_netdevs(&paths::netdev_flags(&links, &modes))?;
        let rows = paths::report(&links, &modes);
        let mut changed = false;
        for r in &rows {
            if self.paths.iter().any(|old| old == r) {
                continue;
            }
            changed = true;
            let path = r.path.describe();
            match r.path {
                paths::Path::XdpRedirect => {
                    info!(ingress = %r.ingress, mode = r.mode.name(), egress = %r.egress, path, reason = %r.reason, "forwarding path");
                }
                paths::Path::Kernel => {
                    warn!(ingress = %r.ingress, mode = r.mode.name(), egress = %r.egress, path, reason = %r.reason, "forwarding path");
                }
            }
        }
        self.paths = rows;
        Ok(changed || reattached)
    }

    /// Check that the program is on every interface it was attached to,
    /// as the kernel reports it (`links`). A device deleted takes its XDP
    /// link with it (the link, pinned or not, stays, attached to nothing);
    /// one made again under the same name, or moved back from another
    /// namespace, is a new device without the program. Such an interface
    /// is reported missing while it is gone, and attached again, in the
    /// mode chosen anew, once it is there. Returns whether anything
    /// changed.
    fn reattach(&mut self, links: &[netdev::Link]) -> bool {
        let Some(prog) = self.program_id() else { return false };
        let mut changed = false;
        for i in 0..self.attached.len() {
            let iface = self.attached[i].attachment.interface.clone();
            let was_missing = self.attached[i].attachment.missing;
            let Some(link) = links.iter().find(|l| l.name == iface) else {
                if !was_missing {
                    warn!(interface = %iface, "the interface is gone (deleted, or moved to another namespace): XDP is not on it; attached again if it comes back without");
                    self.attached[i].attachment.missing = true;
                    changed = true;
                }
                continue;
            };
            if link.xdp_progs.contains(&prog) {
                // Back with the program (moved to another namespace and
                // back keeps it), or never gone.
                if was_missing {
                    info!(interface = %iface, "the interface is back, with XDP on it");
                    self.attached[i].attachment.missing = false;
                    changed = true;
                }
                continue;
            }
            match self.attach_again(i, link, links) {
                Ok(()) => {
                    let a = &self.attached[i].attachment;
                    info!(interface = %iface, ifindex = link.ifindex, mode = a.mode.name(),
                          "the interface was replaced: XDP attached again");
                    changed = true;
                }
                Err(e) => {
                    if !was_missing {
                        warn!(interface = %iface, error = %crate::error_text(&anyhow::Error::new(e)),
                              "the interface was replaced and XDP cannot be attached to it; trying again every second");
                        self.attached[i].attachment.missing = true;
                        changed = true;
                    }
                }
            }
        }
        changed
    }

    /// Attach to `link` again in place of `self.attached[i]`, whose link
    /// points at a device that is gone: the old link is detached and
    /// unpinned, and the mode chosen as at start.
    fn attach_again(&mut self, i: usize, link: &netdev::Link, links: &[netdev::Link]) -> Result<(), DataplaneError> {
        let iface = link.name.clone();
        let egresses: Vec<&netdev::Link> = paths::egresses_of(&iface, &self.interfaces)
            .into_iter()
            .filter_map(|e| links.iter().find(|l| l.name == e))
            .collect();
        let (mode, reason) = paths::choose_mode(self.requested, link, &egresses);
        match std::mem::replace(&mut self.attached[i].link, AttachedLink::Detached) {
            AttachedLink::Pinned { fd, path, .. } => {
                unpin_link(&iface, &path);
                drop(fd);
            }
            AttachedLink::Owned(id) => {
                if let Some(prog) = self.ebpf.program_mut(PROGRAM).and_then(|p| <&mut Xdp>::try_from(p).ok()) {
                    // Its device is gone: nothing is left to detach from.
                    let _ = prog.detach(id);
                }
            }
            AttachedLink::Detached => {}
        }
        let links_dir = self.pin.as_ref().map(|p| p.join("links"));
        let fresh = self.attach_one(&iface, mode, self.requested, reason, links_dir.as_deref())?;
        self.attached[i] = fresh;
        Ok(())
    }

    /// The current path report (see [`refresh_paths`](Self::refresh_paths)).
    pub fn paths(&self) -> &[PathReport] {
        &self.paths
    }

    /// Attach the tc program (`TC_PROGRAM`) to the ingress of every
    /// interface the XDP program runs on in generic mode that has not got
    /// it yet, or whose device was replaced since: there the XDP program
    /// hands it the GSO packets of DSR services (`lb_common::TcHandoff`);
    /// any other packet it passes untouched. Native mode never sees a GSO
    /// packet, so its interfaces' packets that go to the kernel do not
    /// meet the tc program (an interface switched from generic to native
    /// keeps it, idle). A TCX link (kernel 6.6 and later); no qdisc is
    /// made. With a pin directory it is pinned beside the XDP links
    /// (`tc/<interface>`), so that it outlives this process as the pinned
    /// XDP program does: while lbd is down (a restart, an upgrade, a
    /// crash) that program goes on handing it GSO packets, which would
    /// otherwise be dropped. The next start attaches its own and only then
    /// detaches the pinned one, so no packet finds none (for a moment both
    /// run; the first redirects, the other never sees the packet). The
    /// clean stop detaches it. Unpinned, it is this process's, and goes
    /// when lbd exits. Either way it goes with its device. Where it cannot
    /// be attached (an older kernel has no TCX; a netlink filter instead
    /// would need a clsact qdisc on the operator's device), lbd says so
    /// once per device and runs on: such packets are dropped, as the XDP
    /// redirect they would take otherwise does.
    fn attach_tc(&mut self, links: &[netdev::Link]) {
        let tc_dir = self.pin.as_ref().map(|p| p.join("tc"));
        let wanted: Vec<(String, u32)> = self
            .attached
            .iter()
            .filter(|a| !a.attachment.missing && a.attachment.mode == Mode::Generic)
            .filter_map(|a| links.iter().find(|l| l.name == a.attachment.interface))
            .filter(|l| self.tc.get(&l.name).map(|t| t.0) != Some(l.ifindex))
            .map(|l| (l.name.clone(), l.ifindex))
            .collect();
        for (iface, ifindex) in wanted {
            let attached = self
                .ebpf
                .program_mut(super::TC_PROGRAM)
                .ok_or(ProgramError::NotLoaded)
                .and_then(<&mut SchedClassifier>::try_from)
                .and_then(|p| {
                    // TCX only: aya's fallback on an older kernel (a netlink
                    // filter, needing a clsact qdisc) would outlive a killed lbd.
                    p.attach_with_options(
                        &iface,
                        TcAttachType::Ingress,
                        TcAttachOptions::TcxOrder(LinkOrder::default()),
                    )
                });
            let state = match attached {
                Ok(id) => {
                    info!(interface = %iface, "tc ingress program attached (DSR services' GSO packets in generic mode)");
                    match tc_dir.as_ref().map(|dir| self.pin_tc(dir, &iface, id)) {
                        Some(Ok(())) => TcLink::Pinned,
                        Some(Err(e)) => {
                            warn!(interface = %iface, error = %e,
                                "pinning the tc ingress link; it goes when lbd exits, and while lbd is down DSR services' GSO packets are dropped");
                            TcLink::Owned
                        }
                        None => TcLink::Owned,
                    }
                }
                Err(e) => {
                    warn!(interface = %iface, error = %e,
                        "the tc ingress program cannot be attached: in generic mode, GSO packets of DSR services (bulk uploads) are dropped");
                    TcLink::Failed
                }
            };
            self.tc.insert(iface, (ifindex, state));
        }
    }

    /// Pin the tc link `id` just attached to `iface` at `dir/<iface>`, in
    /// place of the link pinned there before (the previous process's, or
    /// one on a device since replaced), which is detached now: the new
    /// one already runs.
    fn pin_tc(&mut self, dir: &Path, iface: &str, id: SchedClassifierLinkId) -> Result<(), Box<dyn std::error::Error>> {
        std::fs::create_dir_all(dir)?;
        let prog: &mut SchedClassifier =
            self.ebpf.program_mut(super::TC_PROGRAM).ok_or(ProgramError::NotLoaded)?.try_into()?;
        let link: FdLink = prog.take_link(id)?.try_into()?;
        let path = dir.join(iface);
        if path.exists() {
            unpin(TC_LINK, iface, &path);
        }
        // The pin holds the link; the handle returned may go.
        drop(link.pin(&path)?);
        Ok(())
    }

    /// Make NETDEVS hold exactly `flags` (ifindex -> `NETDEV_F_*`).
    pub fn write_netdevs(&mut self, flags: &BTreeMap<u32, u32>) -> Result<(), DataplaneError> {
        if self.netdevs_written && &self.netdevs == flags {
            return Ok(());
        }
        let map = &mut self.maps.netdevs;
        let have: Vec<u32> = map.keys().filter_map(Result::ok).collect();
        for (&i, &f) in flags {
            map.insert(i, f, 0).map_err(map_err(names::NETDEVS))?;
        }
        for i in have {
            if !flags.contains_key(&i) {
                map.remove(&i).map_err(map_err(names::NETDEVS))?;
            }
        }
        // Every cached next hop was checked against the old contents.
        let generation = &mut self.maps.netdev_gen;
        let g = generation.get(&0, 0).map_err(map_err(names::NETDEV_GEN))?;
        generation.set(0, g.wrapping_add(1), 0).map_err(map_err(names::NETDEV_GEN))?;
        self.netdevs = flags.clone();
        self.netdevs_written = true;
        Ok(())
    }

    fn detach_one(&mut self, a: Attached) {
        match a.link {
            AttachedLink::Pinned { fd, path, .. } => {
                unpin_link(&a.attachment.interface, &path);
                drop(fd);
            }
            AttachedLink::Owned(id) => {
                if let Some(prog) = self.ebpf.program_mut(PROGRAM).and_then(|p| <&mut Xdp>::try_from(p).ok())
                    && let Err(e) = prog.detach(id)
                {
                    warn!(interface = %a.attachment.interface, error = %e, "XDP detach failed");
                }
            }
            AttachedLink::Detached => {}
        }
        info!(interface = %a.attachment.interface, "XDP detached");
    }

    /// Detach from every interface and unpin everything: the clean stop.
    /// The datapath is gone afterwards.
    pub fn shutdown(&mut self) {
        for a in std::mem::take(&mut self.attached) {
            self.detach_one(a);
        }
        if let Some(pin) = &self.pin {
            for name in names::ALL.iter().chain(&names::STALE) {
                let _ = std::fs::remove_file(pin.join("maps").join(name));
            }
            let tc = pin.join("tc");
            unpin_tc_links(&tc, |_| false);
            for d in [pin.join("maps"), pin.join("links"), tc, pin.clone()] {
                if let Err(e) = std::fs::remove_dir(&d)
                    && e.kind() != std::io::ErrorKind::NotFound
                {
                    warn!(path = %d.display(), error = %e, "removing pin directory");
                }
            }
            info!(path = %pin.display(), "unpinned the datapath");
        }
    }
}

#[cfg(test)]
mod tests {
    use aya::programs::ProgramError;

    use super::{DataplaneError, Mode, Step, XdpMode, step};

    /// A refused native attach says why and what to do, in the error lbd
    /// exits with.
    #[test]
    fn a_refused_native_attach_names_the_way_out() {
        let error = |errno: i32, mode: Mode| {
            let source = ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_link_create",
                io_error: std::io::Error::from_raw_os_error(errno),
            });
            DataplaneError::Attach { iface: "eth0".into(), mode, source }.to_string()
        };
        let mtu = error(libc::ERANGE, Mode::Native);
        assert!(
            mtu.starts_with("attaching XDP to eth0 in native mode, which refuses this device's MTU: ")
                && mtu.contains("; lower the MTU, or use xdp_mode: generic (auto falls back to it): "),
            "{mtu}"
        );
        assert!(error(libc::EOPNOTSUPP, Mode::Native).contains(", which this device does not offer (xdp_mode: auto"));
        assert!(error(libc::ERANGE, Mode::Generic).starts_with("attaching XDP to eth0 in generic mode: "));
        assert!(error(libc::EPERM, Mode::Native).starts_with("attaching XDP to eth0 in native mode: "));
    }

    #[test]
    fn a_pinned_link_is_kept_or_switched_as_xdp_mode_says() {
        let (n, g) = (Mode::Native, Mode::Generic);
        // No pinned link: attached anew, whatever is asked.
        for (req, chosen) in [(XdpMode::Auto, n), (XdpMode::Native, n), (XdpMode::Generic, g)] {
            assert!(step(req, None, chosen) == Step::New);
        }
        // The mode it has: swapped.
        assert!(step(XdpMode::Native, Some(n), n) == Step::Swap);
        assert!(step(XdpMode::Generic, Some(g), g) == Step::Swap);
        assert!(step(XdpMode::Auto, Some(g), g) == Step::Swap);
        // A forced mode it does not have: switched, from the mode it has.
        assert!(step(XdpMode::Native, Some(g), n) == Step::Switch(g));
        assert!(step(XdpMode::Generic, Some(n), g) == Step::Switch(n));
        // auto: native where generic is chosen now is switched; generic
        // stays generic (auto's own fallback when native would not attach).
        assert!(step(XdpMode::Auto, Some(n), g) == Step::Switch(n));
        assert!(step(XdpMode::Auto, Some(g), n) == Step::Swap);
        // Switches come after new attachments and before swaps.
        assert!(Step::New.order() < Step::Switch(n).order() && Step::Switch(g).order() < Step::Swap.order());
    }
}
