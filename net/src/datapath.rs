//! Per-NIC datapath: `direct` (tc-eBPF tap ↔ pod veth), `bridge` (tap +
//! bridge + pod veth) or `auto` (direct, else bridge with one log line).
use std::path::{Path, PathBuf};

use k7d_bpf::{AttachMethod, NicPrograms, ObjectSource, PodUid, Policy, ProgMode, pod_identity};
use tracing::{debug, info, warn};

use crate::fallback::FallbackReason;
use crate::{
    NetError, Tap,
    names::{NicNames, nic_names, validate_vm_id, vm_tag},
    netlink::{CLSACT_EGRESS, CLSACT_INGRESS, Netlink},
    netns::in_netns,
    sys,
    tap::create_tap,
};

/// The requested datapath mode of a NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// tc-eBPF only; refuse when it cannot be used.
    Direct,
    /// tap + bridge + pod veth.
    Bridge,
    /// Direct when possible, else bridge (one log line with the reason).
    Auto,
}

impl std::str::FromStr for Mode {
    type Err = NetError;
    fn from_str(s: &str) -> Result<Self, NetError> {
        match s {
            "direct" => Ok(Mode::Direct),
            "bridge" => Ok(Mode::Bridge),
            "auto" => Ok(Mode::Auto),
            _ => Err(NetError::Invalid {
                what: format!("datapath mode {s:?}"),
                reason: "it must be direct, bridge or auto".into(),
            }),
        }
    }
}

/// The mode a NIC actually got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EffectiveMode {
    Direct,
    Bridge,
}

impl std::fmt::Display for EffectiveMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EffectiveMode::Direct => "direct",
            EffectiveMode::Bridge => "bridge",
        })
    }
}

/// Library-wide settings.
#[derive(Clone, Debug)]
pub struct DatapathConfig {
    /// Directory on bpffs under which every VM gets `<vm tag>/nic<idx>/`.
    pub bpffs_root: PathBuf,
    /// Where the tc object comes from.
    pub object: ObjectSource,
    /// TCX or clsact + netlink.
    pub attach_method: AttachMethod,
}

impl Default for DatapathConfig {
    fn default() -> Self {
        Self {
            bpffs_root: PathBuf::from("/sys/fs/bpf/k7d"),
            object: ObjectSource::Embedded,
            attach_method: AttachMethod::Auto,
        }
    }
}

/// One NIC to attach.
#[derive(Clone, Debug)]
pub struct NicRequest<'a> {
    pub vm_id: &'a str,
    pub nic_idx: u16,
    pub mode: Mode,
    /// The pod's network namespace (`/run/netns/..`, `/proc/<pid>/ns/net`).
    pub pod_netns: &'a Path,
    /// The CNI's interface in the pod netns (usually `eth0`).
    pub pod_if: &'a str,
    /// Tap queue pairs (fds).
    pub queues: usize,
    pub vnet_hdr: bool,
    /// The pod UID; its identity keys the policy. Validated before
    /// anything is created.
    pub pod_uid: Option<&'a str>,
    /// A shape the caller knows direct cannot serve (e.g. "1 Multus
    /// secondary NIC(s) are not supported with the direct datapath yet").
    pub unsupported: Option<String>,
    /// The NIC's tap (`nic_names(vm_id, nic_idx).tap`) already exists in
    /// the caller's netns, its queues held by a running VM (a warm pool
    /// member's bare tap): it is moved into the pod netns instead of made
    /// there, and moved back (down) when the attach fails. The returned
    /// `Attached::tap` then has no queue fds.
    pub adopt: bool,
}

/// A NIC attached to the pod network.
#[derive(Debug)]
pub struct Attached {
    pub effective_mode: EffectiveMode,
    /// Why `auto` fell back to the bridge chain (None when direct or asked
    /// for bridge).
    pub reason: Option<String>,
    /// That reason's class (counted in [`crate::fallbacks`]).
    pub fallback: Option<FallbackReason>,
    /// The tap (in the pod netns) and its queue fds for the VMM (none
    /// for an adopted tap: the VM holds them).
    pub tap: Tap,
    /// The MAC the guest should use: the pod veth's in direct mode (what
    /// anti-spoofing CNIs expect), a derived locally administered one in
    /// bridge mode (a bridge drops frames to its port's own MAC).
    pub guest_mac: [u8; 6],
    /// The bridge (bridge mode).
    pub bridge: Option<String>,
    /// The NIC's bpffs directory, when programs are attached (always in
    /// direct mode; in bridge mode policy-only programs when the object is
    /// available).
    pub bpf_dir: Option<PathBuf>,
    /// Whether `bpf_redirect_peer` is used towards the pod device.
    pub redirect_peer: bool,
    /// The VM's pod identity.
    pub pod_id: Option<u32>,
    pub names: NicNames,
}

/// The datapath manager. Stateless: everything lives in the kernel (links,
/// pins), so a restarted daemon can detach, set policy or reconcile.
#[derive(Clone, Debug)]
pub struct Datapath {
    cfg: DatapathConfig,
}

impl Datapath {
    /// Checks that the bpffs root is on bpffs (mounting bpffs at
    /// `/sys/fs/bpf` when nothing is mounted there) and creates it.
    pub fn new(cfg: DatapathConfig) -> Result<Self, NetError> {
        let sysbpf = Path::new("/sys/fs/bpf");
        if cfg.bpffs_root.starts_with(sysbpf)
            && sysbpf.is_dir()
            && !sys::is_bpffs(sysbpf).map_err(|e| NetError::os("statfs /sys/fs/bpf", e))?
        {
            sys::mount_bpffs(sysbpf).map_err(|e| NetError::os("mount bpffs at /sys/fs/bpf", e))?;
            info!("mounted bpffs at /sys/fs/bpf");
        }
        std::fs::create_dir_all(&cfg.bpffs_root)
            .map_err(|e| NetError::os(format!("create bpffs dir {}", cfg.bpffs_root.display()), e))?;
        if !sys::is_bpffs(&cfg.bpffs_root)
            .map_err(|e| NetError::os(format!("statfs {}", cfg.bpffs_root.display()), e))?
        {
            return Err(NetError::Invalid {
                what: format!("bpffs root {}", cfg.bpffs_root.display()),
                reason: "it is not on a bpf filesystem".into(),
            });
        }
        Ok(Self { cfg })
    }

    pub fn config(&self) -> &DatapathConfig {
        &self.cfg
    }

    fn nic_dir(&self, names: &NicNames) -> PathBuf {
        self.cfg.bpffs_root.join(&names.bpf_subdir)
    }

    /// Attaches NIC `req.nic_idx` of `req.vm_id`. On any error nothing is
    /// left behind (no link, qdisc, filter or pin).
    pub fn attach(&self, req: &NicRequest<'_>) -> Result<Attached, NetError> {
        validate_vm_id(req.vm_id)?;
        let uid = req.pod_uid.map(PodUid::parse).transpose()?;
        let pod_id = uid.as_ref().map(pod_identity);
        if req.queues == 0 || req.queues > 256 {
            return Err(NetError::Invalid {
                what: format!("queue count {}", req.queues),
                reason: "it must be between 1 and 256".into(),
            });
        }
        let names = nic_names(req.vm_id, req.nic_idx);
        let dir = self.nic_dir(&names);
        // Re-attach after a crash: clear the NIC's stale state first.
        if dir.exists() {
            info!(
                vm = req.vm_id,
                nic = req.nic_idx,
                "stale datapath state removed before attach"
            );
        }
        self.detach(req.vm_id, req.nic_idx, Some(req.pod_netns), req.pod_if)?;

        let mut fallback_reason = None;
        if req.mode != Mode::Bridge {
            let direct = match &req.unsupported {
                Some(r) => Err((FallbackReason::Unsupported, r.clone())),
                None => self.try_direct(req, &names, &dir, pod_id),
            };
            match direct {
                Ok(a) => return Ok(a),
                Err((_, reason)) if req.mode == Mode::Direct => {
                    return Err(NetError::DirectRefused {
                        vm: req.vm_id.to_string(),
                        nic: req.nic_idx,
                        reason,
                    });
                }
                Err((class, reason)) => {
                    warn!(
                        vm = req.vm_id,
                        nic = req.nic_idx,
                        reason_class = class.name(),
                        "auto: falling back to the bridge chain: {reason}"
                    );
                    fallback_reason = Some((class, reason));
                }
            }
        }
        let mut a = self.attach_bridge(req, &names, &dir, pod_id)?;
        if let Some((class, reason)) = fallback_reason {
            crate::fallback::count(class);
            a.fallback = Some(class);
            a.reason = Some(reason);
        }
        Ok(a)
    }

    /// Direct attach; on failure everything is rolled back and the reason
    /// (its class and one sentence) is returned.
    fn try_direct(
        &self,
        req: &NicRequest<'_>,
        names: &NicNames,
        dir: &Path,
        pod_id: Option<u32>,
    ) -> Result<Attached, (FallbackReason, String)> {
        let object = k7d_bpf::load_object(&self.cfg.object).map_err(|e| (FallbackReason::NoObject, e.to_string()))?;
        let method = self.cfg.attach_method;
        let mut home = Home::for_request(req).map_err(|e| (FallbackReason::Tap, e.to_string()))?;
        let r = in_netns(Some(req.pod_netns), || {
            let mut nl = Netlink::open()?;
            let pod = nl.link(req.pod_if)?.ok_or_else(|| NetError::PodIfMissing {
                iface: req.pod_if.to_string(),
                netns: req.pod_netns.to_path_buf(),
            })?;
            if pod.master.is_some() {
                return Err(NetError::Invalid {
                    what: format!("pod interface {}", req.pod_if),
                    reason: "it is already a bridge port".into(),
                });
            }
            let use_peer = matches!(pod.kind.as_deref(), Some("veth") | Some("netkit")) && pod.link_netnsid.is_some();
            // Before the tap: nothing between taking it and the programs
            // can fail without giving it back.
            if !pod.up {
                nl.set_up(pod.index, true)?;
            }
            let tap = obtain_tap(&mut nl, home.as_mut(), &names.tap, req)?;
            let progs = NicPrograms {
                tap_if: &names.tap,
                tap_ifindex: tap.ifindex,
                pod_if: req.pod_if,
                pod_ifindex: pod.index,
                use_peer,
                mode: ProgMode::Redirect,
                pod_id: pod_id.unwrap_or(0),
            };
            if let Err(e) = progs.attach(&object, dir, method) {
                discard_tap(&mut nl, tap, home.as_mut());
                if method != AttachMethod::Tcx {
                    drop_empty_clsact(&mut nl, pod.index);
                }
                return Err(e.into());
            }
            Ok((tap, pod.mac.unwrap_or_default(), use_peer))
        });
        match r {
            Ok((tap, mac, use_peer)) => {
                debug!(vm = req.vm_id, nic = req.nic_idx, tap = %names.tap, use_peer, "direct datapath attached");
                Ok(Attached {
                    effective_mode: EffectiveMode::Direct,
                    reason: None,
                    fallback: None,
                    tap,
                    guest_mac: mac,
                    bridge: None,
                    bpf_dir: Some(dir.to_path_buf()),
                    redirect_peer: use_peer,
                    pod_id,
                    names: names.clone(),
                })
            }
            Err(e) => {
                // Belt and braces: the closure rolled back; make sure.
                self.roll_back(req, &names.tap);
                Err(match e {
                    NetError::Bpf(b) => (FallbackReason::Programs, b.to_string()),
                    e @ NetError::PodIfMissing { .. } => (FallbackReason::PodInterface, e.to_string()),
                    NetError::Invalid { what, reason } if what.starts_with("pod interface") => {
                        let e = NetError::Invalid { what, reason };
                        (FallbackReason::PodInterface, e.to_string())
                    }
                    other => (FallbackReason::Tap, other.to_string()),
                })
            }
        }
    }

    fn attach_bridge(
        &self,
        req: &NicRequest<'_>,
        names: &NicNames,
        dir: &Path,
        pod_id: Option<u32>,
    ) -> Result<Attached, NetError> {
        // Policy-only programs when the object is there; silently none if not.
        let object = k7d_bpf::load_object(&self.cfg.object).ok();
        let method = self.cfg.attach_method;
        let mut home = Home::for_request(req)?;
        let r = in_netns(Some(req.pod_netns), || {
            let mut nl = Netlink::open()?;
            let pod = nl.link(req.pod_if)?.ok_or_else(|| NetError::PodIfMissing {
                iface: req.pod_if.to_string(),
                netns: req.pod_netns.to_path_buf(),
            })?;
            let tap = obtain_tap(&mut nl, home.as_mut(), &names.tap, req)?;
            let built = (|| {
                nl.add_bridge(&names.bridge)?;
                let br = nl.link(&names.bridge)?.ok_or_else(|| NetError::Invalid {
                    what: format!("bridge {}", names.bridge),
                    reason: "it vanished right after creation".into(),
                })?;
                nl.set_master(tap.ifindex, Some(br.index))?;
                nl.set_master(pod.index, Some(br.index))?;
                nl.set_up(br.index, true)?;
                nl.set_up(pod.index, true)?;
                let mut bpf = false;
                if let Some(obj) = &object {
                    let progs = NicPrograms {
                        tap_if: &names.tap,
                        tap_ifindex: tap.ifindex,
                        pod_if: req.pod_if,
                        pod_ifindex: pod.index,
                        use_peer: false,
                        mode: ProgMode::PolicyOnly,
                        pod_id: pod_id.unwrap_or(0),
                    };
                    match progs.attach(obj, dir, method) {
                        Ok(_) => bpf = true,
                        Err(e) => debug!(error = %e, "bridge chain runs without policy programs"),
                    }
                }
                Ok::<_, NetError>(bpf)
            })();
            match built {
                Ok(bpf) => Ok((tap, pod.mac.unwrap_or_default(), bpf)),
                Err(e) => {
                    // The tap leaves the bridge before it goes home.
                    let _ = nl.del_link_by_name(&names.bridge);
                    discard_tap(&mut nl, tap, home.as_mut());
                    if method != AttachMethod::Tcx {
                        drop_empty_clsact(&mut nl, pod.index);
                    }
                    Err(e)
                }
            }
        });
        match r {
            Ok((tap, pod_mac, bpf)) => Ok(Attached {
                effective_mode: EffectiveMode::Bridge,
                reason: None,
                fallback: None,
                tap,
                guest_mac: bridge_guest_mac(names, pod_mac),
                bridge: Some(names.bridge.clone()),
                bpf_dir: bpf.then(|| dir.to_path_buf()),
                redirect_peer: false,
                pod_id,
                names: names.clone(),
            }),
            Err(e) => {
                self.roll_back(req, &names.tap);
                Err(e)
            }
        }
    }

    /// Detaches NIC `nic_idx` of `vm_id`: unpins (detaching TCX links),
    /// removes k7d netlink filters, deletes the tap and bridge. Idempotent;
    /// a vanished pod netns only leaves the pins to remove. The caller drops
    /// its tap fds.
    pub fn detach(&self, vm_id: &str, nic_idx: u16, pod_netns: Option<&Path>, pod_if: &str) -> Result<(), NetError> {
        validate_vm_id(vm_id)?;
        let names = nic_names(vm_id, nic_idx);
        let dir = self.nic_dir(&names);
        let ns_alive = pod_netns.is_some_and(|p| p.exists());
        if ns_alive {
            // Only netlink attachments create a clsact qdisc.
            let netlink = k7d_bpf::LINK_PINS
                .iter()
                .any(|p| dir.join(format!("{p}_prog")).exists());
            in_netns(pod_netns, || {
                k7d_bpf::detach_nic(&dir, Some(&names.tap), Some(pod_if))?;
                let mut nl = Netlink::open()?;
                nl.del_link_by_name(&names.bridge)?;
                nl.del_link_by_name(&names.tap)?;
                if netlink && let Some(pod) = nl.link(pod_if)? {
                    drop_empty_clsact(&mut nl, pod.index);
                }
                Ok(())
            })
        } else {
            k7d_bpf::detach_nic(&dir, None, None).map_err(NetError::from)
        }
    }

    /// After a failed attach: an adopted tap still in the pod netns goes
    /// home first (the detach deletes the tap by name there), then
    /// whatever the attempt left is detached.
    fn roll_back(&self, req: &NicRequest<'_>, tap: &str) {
        if req.adopt {
            let sent = Home::for_request(req).and_then(|h| {
                let Some(h) = h else { return Ok(()) };
                in_netns(Some(req.pod_netns), || {
                    let mut nl = Netlink::open()?;
                    if let Some(l) = nl.link(tap)? {
                        nl.set_netns(l.index, &h.ns)?;
                        warn!(tap, "an adopted tap left in the pod netns was sent home");
                    }
                    Ok(())
                })
            });
            if let Err(e) = sent {
                warn!(tap, error = %e, "an adopted tap could not be sent home; the detach removes it");
            }
        }
        let _ = self.detach(req.vm_id, req.nic_idx, Some(req.pod_netns), req.pod_if);
    }

    fn vm_nic_dirs(&self, vm_id: &str) -> Result<Vec<PathBuf>, NetError> {
        validate_vm_id(vm_id)?;
        let vm_dir = self.cfg.bpffs_root.join(vm_tag(vm_id));
        let mut dirs = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&vm_dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("nic") {
                    dirs.push(e.path());
                }
            }
        }
        dirs.sort();
        if dirs.is_empty() {
            return Err(NetError::NoPrograms(vm_id.to_string()));
        }
        Ok(dirs)
    }

    /// Replaces the pod policy of every NIC of `vm_id`.
    pub fn set_policy(&self, vm_id: &str, policy: &Policy) -> Result<(), NetError> {
        for d in self.vm_nic_dirs(vm_id)? {
            k7d_bpf::set_policy(&d, policy)?;
        }
        info!(
            vm = vm_id,
            default_deny = policy.default_deny,
            allow = policy.allow.len(),
            deny = policy.deny.len(),
            "pod policy set"
        );
        Ok(())
    }

    /// Clears the pod policy of every NIC of `vm_id` (all traffic passes).
    pub fn clear_policy(&self, vm_id: &str) -> Result<(), NetError> {
        for d in self.vm_nic_dirs(vm_id)? {
            k7d_bpf::clear_policy(&d)?;
        }
        info!(vm = vm_id, "pod policy cleared");
        Ok(())
    }

    /// The VM's non-zero drop counters, summed over its NICs.
    pub fn drops(&self, vm_id: &str) -> Result<Vec<k7d_bpf::DropCount>, NetError> {
        let mut out: Vec<k7d_bpf::DropCount> = Vec::new();
        for d in self.vm_nic_dirs(vm_id)? {
            for c in k7d_bpf::drops(&d)? {
                match out
                    .iter_mut()
                    .find(|o| o.reason == c.reason && o.direction == c.direction)
                {
                    Some(o) => o.packets += c.packets,
                    None => out.push(c),
                }
            }
        }
        Ok(out)
    }

    /// What the datapath passed on for `vm_id`, summed over its NICs,
    /// egress (guest to pod network) then ingress.
    pub fn forwarded(&self, vm_id: &str) -> Result<[k7d_bpf::Forwarded; 2], NetError> {
        let mut out: Option<[k7d_bpf::Forwarded; 2]> = None;
        for d in self.vm_nic_dirs(vm_id)? {
            let nic = k7d_bpf::forwarded(&d)?;
            match &mut out {
                None => out = Some(nic),
                Some(sum) => {
                    for (s, n) in sum.iter_mut().zip(nic) {
                        s.packets = s.packets.saturating_add(n.packets);
                        s.bytes = s.bytes.saturating_add(n.bytes);
                    }
                }
            }
        }
        out.ok_or_else(|| NetError::NoPrograms(vm_id.to_string()))
    }
}

/// Deletes the clsact qdisc of `ifindex` when it holds no filter any more
/// (a CNI's clsact with filters is left alone).
pub(crate) fn drop_empty_clsact(nl: &mut Netlink, ifindex: u32) {
    let has_clsact = nl
        .qdiscs()
        .map(|q| q.iter().any(|q| q.ifindex == ifindex && q.kind == "clsact"))
        .unwrap_or(false);
    if !has_clsact {
        return;
    }
    let empty = [CLSACT_INGRESS, CLSACT_EGRESS]
        .iter()
        .all(|p| nl.filters(ifindex, *p).map(|f| f.is_empty()).unwrap_or(false));
    if empty && let Err(e) = nl.del_clsact(ifindex) {
        warn!(ifindex, error = %e, "empty clsact qdisc not removed");
    }
}

pub(crate) fn bridge_guest_mac(names: &NicNames, pod_mac: [u8; 6]) -> [u8; 6] {
    let hex = &names.tap[4..];
    let mut mac = [0x02, 0x6b, 0, 0, 0, 0];
    for i in 0..4 {
        mac[2 + i] = u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).unwrap_or(0);
    }
    if mac == pod_mac {
        mac[5] ^= 1;
    }
    mac
}

/// The caller's netns, where an adopted tap lives before the attach and
/// goes back to when the attach fails: a netlink socket and a handle on it,
/// both opened before the attach enters the pod netns.
struct Home {
    nl: Netlink,
    ns: std::fs::File,
}

impl Home {
    /// The caller's netns when `req` adopts a tap; none otherwise.
    fn for_request(req: &NicRequest<'_>) -> Result<Option<Self>, NetError> {
        if !req.adopt {
            return Ok(None);
        }
        let ns = std::fs::File::open("/proc/thread-self/ns/net")
            .map_err(|e| NetError::os("open the daemon's own netns", e))?;
        Ok(Some(Self {
            nl: Netlink::open()?,
            ns,
        }))
    }
}

/// The NIC's tap in the pod netns (the calling thread's): made there, or,
/// adopted, moved in from `home` and brought up (a move takes a link down).
fn obtain_tap(nl: &mut Netlink, home: Option<&mut Home>, name: &str, req: &NicRequest<'_>) -> Result<Tap, NetError> {
    let Some(home) = home else {
        return create_tap(nl, name, req.queues, req.vnet_hdr);
    };
    let link = home.nl.link(name)?.ok_or_else(|| NetError::Invalid {
        what: format!("tap {name}"),
        reason: "the VM's tap to attach is not in the daemon's netns".into(),
    })?;
    if link.kind.as_deref() != Some("tun") {
        return Err(NetError::Invalid {
            what: format!("link {name}"),
            reason: "it is not a tap, so it is not a VM's to adopt".into(),
        });
    }
    let here = std::fs::File::open("/proc/thread-self/ns/net")
        .map_err(|e| NetError::os("open the pod netns of the attaching thread", e))?;
    home.nl.set_netns(link.index, &here)?;
    let moved = nl.link(name)?.ok_or_else(|| NetError::Invalid {
        what: format!("tap {name}"),
        reason: "it did not arrive in the pod netns".into(),
    })?;
    let tap = Tap {
        name: name.to_string(),
        ifindex: moved.index,
        queues: Vec::new(),
        vnet_hdr: req.vnet_hdr,
    };
    if let Err(e) = nl.set_up(moved.index, true) {
        discard_tap(nl, tap, Some(home));
        return Err(e);
    }
    Ok(tap)
}

/// Undoes [`obtain_tap`] after a failed attach: a made tap is deleted, an
/// adopted one goes back to `home` (down, as a move leaves it; its VM
/// keeps its queues).
fn discard_tap(nl: &mut Netlink, tap: Tap, home: Option<&mut Home>) {
    let Some(home) = home else {
        let name = tap.name.clone();
        drop(tap);
        let _ = nl.del_link_by_name(&name);
        return;
    };
    if let Err(e) = nl.set_netns(tap.ifindex, &home.ns) {
        warn!(tap = %tap.name, error = %e, "an adopted tap could not go back to the daemon's netns");
        return;
    }
    // Home, and left down: a bare tap that is up in the daemon's netns
    // would let its guest talk to the host's own addresses.
    if !matches!(home.nl.link(&tap.name), Ok(Some(_))) {
        warn!(tap = %tap.name, "an adopted tap did not arrive back in the daemon's netns");
    }
}
