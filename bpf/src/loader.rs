use std::{
    borrow::Cow,
    io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, MapData},
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::FdLink,
        tc::{NlOptions, TcAttachOptions, qdisc_add_clsact, qdisc_detach_program},
    },
};
use tracing::{debug, warn};

use crate::BpfError;

static EMBEDDED: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/k7d_tc.o"));
/// Why `build.rs` embedded no object (empty when it did).
const MISSING_REASON: &str = env!("K7D_BPF_MISSING_REASON");

/// Whether this build embeds the tc object (clang was found and compiled it).
pub fn tc_object_embedded() -> bool {
    !EMBEDDED.is_empty()
}

/// Why this build embeds no tc object (one sentence, recorded by `build.rs`:
/// clang not found, clang failed, `K7D_BPF_SKIP_BUILD`), or `None` when the
/// object is embedded.
pub fn tc_object_missing_reason() -> Option<&'static str> {
    if tc_object_embedded() {
        None
    } else if MISSING_REASON.is_empty() {
        Some("build.rs produced an empty object")
    } else {
        Some(MISSING_REASON)
    }
}

/// Kernel names of the two programs (also the netlink filter names).
pub const PROG_NAMES: [&str; 2] = ["k7d_tap_in", "k7d_pod_in"];
/// Pin names of the maps inside a NIC directory.
pub const MAP_PINS: [&str; 5] = ["k7d_cfg", "k7d_ipcache", "k7d_peer_verdict", "k7d_drops", "k7d_fwd"];
/// Pin names of the TCX links. Netlink attachments pin the program as
/// `<name>_prog` instead (netlink filters are not bpf links; bpffs refuses
/// dots in names).
pub const LINK_PINS: [&str; 2] = ["tap_in", "pod_in"];

/// Where the object comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ObjectSource {
    /// The object compiled by `build.rs` and embedded in the crate.
    #[default]
    Embedded,
    /// An object file installed next to the binary (or anywhere).
    File(PathBuf),
    /// No object (as if clang was missing at build time).
    Missing,
}

/// Returns the object bytes, or [`BpfError::ObjectMissing`].
pub fn load_object(src: &ObjectSource) -> Result<Cow<'static, [u8]>, BpfError> {
    match src {
        ObjectSource::Embedded if !tc_object_embedded() => Err(BpfError::ObjectMissing(format!(
            "no tc object is embedded in this build ({}); install clang and rebuild k7d",
            tc_object_missing_reason().unwrap_or("unknown reason")
        ))),
        ObjectSource::Embedded => Ok(Cow::Borrowed(EMBEDDED)),
        ObjectSource::File(p) => match std::fs::read(p) {
            Ok(b) if !b.is_empty() => Ok(Cow::Owned(b)),
            Ok(_) => Err(BpfError::ObjectMissing(format!("{} is empty", p.display()))),
            Err(e) => Err(BpfError::ObjectMissing(format!("{} cannot be read ({e})", p.display()))),
        },
        ObjectSource::Missing => Err(BpfError::ObjectMissing("no object is configured".into())),
    }
}

/// How programs are attached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttachMethod {
    /// TCX links when the kernel has them (≥ 6.6), else clsact + netlink.
    #[default]
    Auto,
    /// TCX links, pinned.
    Tcx,
    /// clsact qdisc + cls_bpf filters (direct-action), programs pinned.
    Netlink,
}

/// What the programs do after the policy check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgMode {
    /// Direct datapath: redirect tap ↔ pod device.
    Redirect = 0,
    /// Bridge chain: police, then let the frame continue (TC_ACT_OK).
    PolicyOnly = 1,
}

/// One NIC's attachment request. Names and ifindexes are those of the
/// calling thread's network namespace.
#[derive(Clone, Debug)]
pub struct NicPrograms<'a> {
    pub tap_if: &'a str,
    pub tap_ifindex: u32,
    pub pod_if: &'a str,
    pub pod_ifindex: u32,
    /// Use `bpf_redirect_peer` towards the pod device (veth/netkit whose peer
    /// is in another netns).
    pub use_peer: bool,
    pub mode: ProgMode,
    pub pod_id: u32,
}

/// The result of a successful [`NicPrograms::attach`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachedPrograms {
    /// The method actually used (never `Auto`).
    pub method: AttachMethod,
    /// The NIC's pin directory.
    pub dir: PathBuf,
}

pub(crate) fn attach_err(prog: &'static str, iface: &str, e: impl std::error::Error) -> BpfError {
    BpfError::Attach {
        prog,
        iface: iface.to_string(),
        reason: error_chain(&e),
    }
}

/// Renders an error with its sources, in one line.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

pub(crate) fn pin_err(path: &Path, op: &'static str, e: impl std::error::Error) -> BpfError {
    BpfError::Pin {
        path: path.to_path_buf(),
        op,
        reason: error_chain(&e),
    }
}

impl NicPrograms<'_> {
    /// Loads `object`, writes the NIC config, attaches both programs and pins
    /// maps and links under `dir` (created; it must be on bpffs). On error,
    /// everything this call created is removed again.
    pub fn attach(&self, object: &[u8], dir: &Path, method: AttachMethod) -> Result<AttachedPrograms, BpfError> {
        if dir.exists() {
            return Err(pin_err(
                dir,
                "created",
                std::io::Error::other("it already exists (stale state: detach or reconcile first)"),
            ));
        }
        std::fs::create_dir_all(dir).map_err(|e| pin_err(dir, "created", e))?;
        match self.attach_inner(object, dir, method) {
            Ok(m) => Ok(AttachedPrograms {
                method: m,
                dir: dir.to_path_buf(),
            }),
            Err(e) => {
                if let Err(e2) = detach_nic(dir, Some(self.tap_if), Some(self.pod_if)) {
                    warn!(error = %e2, "rollback of a failed bpf attach was incomplete");
                }
                Err(e)
            }
        }
    }

    fn attach_inner(&self, object: &[u8], dir: &Path, method: AttachMethod) -> Result<AttachMethod, BpfError> {
        let mut bpf: Ebpf = EbpfLoader::new()
            .load(object)
            .map_err(|e| BpfError::Load(e.to_string()))?;
        {
            let map = bpf
                .map_mut("k7d_cfg")
                .ok_or_else(|| BpfError::Load("the object has no k7d_cfg map".into()))?;
            let mut cfg: Array<&mut MapData, [u32; 6]> =
                Array::try_from(map).map_err(|e| map_err("k7d_cfg", "opened", e))?;
            let v = [
                self.tap_ifindex,
                self.pod_ifindex,
                u32::from(self.use_peer),
                self.mode as u32,
                self.pod_id,
                0,
            ];
            cfg.set(0, v, 0).map_err(|e| map_err("k7d_cfg", "written", e))?;
        }
        for name in MAP_PINS {
            let map = bpf
                .map(name)
                .ok_or_else(|| BpfError::Load(format!("the object has no {name} map")))?;
            let path = dir.join(name);
            map.pin(&path).map_err(|e| pin_err(&path, "created", e))?;
        }
        let mut used = method;
        for (prog_name, (iface, pin)) in PROG_NAMES
            .into_iter()
            .zip([(self.tap_if, LINK_PINS[0]), (self.pod_if, LINK_PINS[1])])
        {
            let prog: &mut SchedClassifier = bpf
                .program_mut(prog_name)
                .ok_or_else(|| BpfError::Load(format!("the object has no {prog_name} program")))?
                .try_into()
                .map_err(|e| BpfError::Load(format!("{prog_name} is not a classifier: {e}")))?;
            if prog.fd().is_err() {
                prog.load()
                    .map_err(|e| BpfError::Load(format!("{prog_name} was refused: {e}")))?;
            }
            used = attach_one(prog, prog_name, iface, &dir.join(pin), used)?;
        }
        debug!(dir = %dir.display(), method = ?used, "bpf programs attached");
        Ok(used)
    }
}

fn map_err(map: &str, op: &'static str, e: impl std::error::Error) -> BpfError {
    BpfError::Map {
        map: map.to_string(),
        op,
        reason: error_chain(&e),
    }
}

fn attach_one(
    prog: &mut SchedClassifier,
    name: &'static str,
    iface: &str,
    pin: &Path,
    method: AttachMethod,
) -> Result<AttachMethod, BpfError> {
    if method != AttachMethod::Netlink {
        let tcx = prog.attach_with_options(
            iface,
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        );
        match tcx {
            Ok(id) => {
                let link = prog.take_link(id).map_err(|e| attach_err(name, iface, e))?;
                let fd: FdLink = link.try_into().map_err(|e| attach_err(name, iface, e))?;
                fd.pin(pin).map_err(|e| pin_err(pin, "created", e))?;
                return Ok(AttachMethod::Tcx);
            }
            Err(e) if method == AttachMethod::Tcx => return Err(attach_err(name, iface, e)),
            Err(e) => debug!(iface, error = %e, "TCX attach failed, trying clsact + netlink"),
        }
    }
    // clsact may already exist (a CNI's, or ours from the first program).
    if let Err(e) = qdisc_add_clsact(iface) {
        debug!(iface, error = %e, "clsact not added (may exist already)");
    }
    let prog_pin = PathBuf::from(format!("{}_prog", pin.display()));
    prog.pin(&prog_pin).map_err(|e| pin_err(&prog_pin, "created", e))?;
    let id = prog
        .attach_with_options(
            iface,
            TcAttachType::Ingress,
            TcAttachOptions::Netlink(NlOptions::default()),
        )
        .map_err(|e| attach_err(name, iface, e))?;
    let link = prog.take_link(id).map_err(|e| attach_err(name, iface, e))?;
    // A netlink filter outlives the process; keep it attached (detach_nic
    // removes it by name).
    std::mem::forget(link);
    Ok(AttachMethod::Netlink)
}

/// Detaches a NIC's programs and removes its pins and directory (and the
/// VM directory above it when it becomes empty). Idempotent: a missing
/// directory or interface is not an error. Must run in the interfaces'
/// network namespace when netlink filters were used.
pub fn detach_nic(dir: &Path, tap_if: Option<&str>, pod_if: Option<&str>) -> Result<(), BpfError> {
    let netlink = LINK_PINS.iter().any(|p| dir.join(format!("{p}_prog")).exists());
    if netlink || !dir.exists() {
        for (iface, prog) in [(tap_if, PROG_NAMES[0]), (pod_if, PROG_NAMES[1])] {
            let Some(iface) = iface else { continue };
            match qdisc_detach_program(iface, TcAttachType::Ingress, prog) {
                Ok(()) => debug!(iface, prog, "netlink filter removed"),
                Err(e) => debug!(iface, prog, error = %e, "no netlink filter removed"),
            }
        }
    }
    remove_dir_pins(dir)?;
    if let Some(parent) = dir.parent() {
        // Only succeeds when empty; other NICs of the VM keep it alive.
        let _ = std::fs::remove_dir(parent);
    }
    Ok(())
}

/// Removes every pin in `dir` (unpinning TCX links detaches them) and `dir`.
pub(crate) fn remove_dir_pins(dir: &Path) -> Result<(), BpfError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(pin_err(dir, "listed", e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| pin_err(dir, "listed", e))?;
        let path = entry.path();
        let r = if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            remove_dir_pins(&path)
        } else {
            std::fs::remove_file(&path).map_err(|e| pin_err(&path, "removed", e))
        };
        match r {
            Err(BpfError::Pin { .. }) if !path.exists() => {}
            r => r?,
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(pin_err(dir, "removed", e)),
    }
}

/// Number of TCX programs attached at `iface`'s ingress and egress (in the
/// calling thread's netns); used by teardown checks.
pub fn tcx_program_count(iface: &str) -> Result<usize, BpfError> {
    let mut n = 0;
    for t in [TcAttachType::Ingress, TcAttachType::Egress] {
        let (_, progs) = SchedClassifier::query_tcx(iface, t).map_err(|e| attach_err("query", iface, e))?;
        n += progs.len();
    }
    Ok(n)
}

/// Opens a pinned map of a NIC directory.
pub(crate) fn open_pinned(dir: &Path, name: &str) -> Result<MapData, BpfError> {
    let path = dir.join(name);
    if !dir.exists() {
        return Err(BpfError::NotAttached(dir.to_path_buf()));
    }
    MapData::from_pin(&path).map_err(|e| pin_err(&path, "opened", e))
}

pub(crate) fn map_error(map: &str, op: &'static str, e: impl std::error::Error) -> BpfError {
    map_err(map, op, e)
}
