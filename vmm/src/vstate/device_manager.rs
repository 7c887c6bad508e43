//! The device manager: the legacy devices every VM has (serial, i8042, the
//! PIO/MMIO buses) and the PCI platform with one function per virtio device
//! kind, the NIC's data-plane plan, restoring the functions' states, and
//! the MACs a restored or forked guest keeps.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use k7d_devices::bus::{BusDevice, SharedDevice};
use k7d_devices::irq::IrqLine;
use k7d_devices::legacy::{I8042, Serial, SerialOutput};
use k7d_devices::virtio::block::DiskImage;
use k7d_devices::virtio::transport::VirtioPciState;
use k7d_devices::virtio::{ForkBackend, RamWriteLog};
use kvm_ioctls::VmFd;
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::control::{StopReason, VmControl};
use super::error::{VmError, io};
use super::handed::{FileRole, HostFiles};
use super::irq::{DeviceMsiRouter, GsiRouting};
use super::memory::GuestRam;
use super::options::VmOptions;
use super::persist::PersistError;
use super::vcpu::Buses;
use crate::arch::x86_64 as arch;
use crate::config::VmConfig;
use crate::lock;
use k7d_api::state::DeviceInfo;

/// COM1.
const SERIAL_PORT: u64 = 0x3f8;
const SERIAL_IRQ: u32 = 4;
const I8042_PORT: u64 = 0x60;

pub(super) fn shared<D: BusDevice + 'static>(d: D) -> SharedDevice {
    Arc::new(Mutex::new(d))
}

/// Raises COM1's line again when a restored UART says the guest has an
/// interrupt to take (`SerialSnapshot::interrupt_pending`: its edge may
/// have been in KVM's irqfd workqueue when the source's irqchip was read).
/// Called after the irqchip and the LAPICs are restored and before any
/// vCPU runs: an edge raised earlier (vm-superio's `from_state` raises
/// one, `build_devices` takes it back) lands in a vCPU's LAPIC before
/// `KVM_SET_LAPIC` overwrites it, and is lost. `KVM_IRQ_LINE` lands the
/// edge at once, not from a workqueue. An edge the saved state already
/// held comes twice: the guest's second IIR read says "none" (a spurious
/// interrupt, which drivers expect).
pub(super) fn resend_serial_interrupt(vm_fd: &VmFd, st: &k7d_devices::legacy::SerialSnapshot) -> Result<(), VmError> {
    if !st.interrupt_pending() {
        return Ok(());
    }
    vm_fd
        .set_irq_line(SERIAL_IRQ, true)
        .and_then(|()| vm_fd.set_irq_line(SERIAL_IRQ, false))
        .map_err(|e| VmError::Kvm("KVM_IRQ_LINE (serial)", e))
}

/// The buses, the device list for `info`, and the serial port (for snapshots).
pub(super) type BuiltDevices = (Buses, Vec<DeviceInfo>, Arc<Mutex<Serial>>);

pub(super) fn build_devices(
    id: &str,
    vm_fd: &Arc<VmFd>,
    control: &Arc<VmControl>,
    opts: &VmOptions,
    console: bool,
    serial_state: Option<&k7d_devices::legacy::SerialSnapshot>,
) -> Result<BuiltDevices, VmError> {
    let mut buses = Buses::default();
    let mut info = Vec::new();

    let log = match (&opts.serial_log, opts.files.take(FileRole::SerialLog)) {
        (_, Ok(Some(f))) => Some(f),
        (Some(p), Ok(None)) => Some(open_log(p)?),
        (None, _) => None,
        (Some(_), Err(e)) => return Err(VmError::Guest(e)),
    };
    let evt = EventFd::new(EFD_NONBLOCK).map_err(io("cannot create the serial interrupt eventfd"))?;
    let line = evt
        .try_clone()
        .map_err(io("cannot clone the serial interrupt eventfd"))?;
    let out = SerialOutput::new(log, console);
    let serial = match serial_state {
        Some(st) => Serial::from_snapshot(st, IrqLine::new(line), out)
            .map_err(|msg| VmError::Persist(PersistError::Mismatch(msg)))?,
        None => Serial::new(IrqLine::new(line), out),
    };
    // vm-superio's `from_state` raises a pending cause's interrupt at once,
    // before the vCPUs' LAPICs are restored (which would drop it): take
    // that edge back before KVM sees the eventfd, and let
    // `resend_serial_interrupt` raise it once the LAPICs are in place.
    // (Nothing else writes the eventfd yet: EAGAIN is the usual answer.)
    let _ = evt.read();
    vm_fd
        .register_irqfd(&evt, SERIAL_IRQ)
        .map_err(|e| VmError::Kvm("KVM_IRQFD (serial)", e))?;
    let serial = Arc::new(Mutex::new(serial));
    let serial_dev: SharedDevice = serial.clone();
    buses
        .pio
        .insert(SERIAL_PORT, 8, serial_dev)
        .map_err(|e| VmError::Guest(e.to_string()))?;
    let mut sinks: Vec<String> = opts.serial_log.iter().map(|p| p.display().to_string()).collect();
    if console {
        sinks.push("stdout".into());
    }
    info.push(DeviceInfo {
        kind: "serial".into(),
        location: format!("ttyS0 port {SERIAL_PORT:#x} irq {SERIAL_IRQ}"),
        detail: if sinks.is_empty() {
            "discarded".into()
        } else {
            sinks.join(", ")
        },
    });

    let ctl = Arc::downgrade(control);
    let vm_id = id.to_string();
    let i8042 = I8042::new(Arc::new(move || {
        tracing::info!(vm = %vm_id, "guest requested a reset through the i8042");
        if let Some(c) = ctl.upgrade() {
            c.request_stop(StopReason::GuestReset);
        }
    }));
    buses
        .pio
        .insert(I8042_PORT, 5, shared(i8042))
        .map_err(|e| VmError::Guest(e.to_string()))?;
    info.push(DeviceInfo {
        kind: "i8042".into(),
        location: format!("ports {I8042_PORT:#x}-{:#x}", I8042_PORT + 4),
        detail: "reset stops the VM".into(),
    });
    #[cfg(feature = "escape-drill")]
    {
        let (base, len) = crate::drill::PORTS;
        buses
            .pio
            .insert(base, len, shared(crate::drill::Drill::default()))
            .map_err(|e| VmError::Guest(e.to_string()))?;
        info.push(DeviceInfo {
            kind: "escape-drill".into(),
            location: format!("ports {base:#x}-{:#x}", base + len - 1),
            detail: "test-only: arbitrary reads of the VMM process".into(),
        });
    }
    Ok((buses, info, serial))
}

/// `what`'s error as a device error.
fn dev_err(what: &'static str) -> impl Fn(&dyn std::fmt::Display) -> VmError {
    move |e| VmError::Device {
        what,
        msg: e.to_string(),
    }
}

/// The platform a Linux guest needs besides the legacy devices: the ACPI PM
/// block (poweroff), the PCI devices in a fixed order (rng, disks, NICs,
/// vsock: the order a fork's backends travel in) and the PCI root (CF8/CFC
/// and ECAM).
pub(super) fn add_linux_platform(
    vm_fd: &Arc<VmFd>,
    ram: &GuestRam,
    control: &Arc<VmControl>,
    config: &VmConfig,
    opts: &VmOptions,
    out: Wiring<'_>,
    fork_backends: Option<VecDeque<ForkBackend>>,
) -> Result<(), VmError> {
    use k7d_devices::pci::{BarAllocator, PciRoot};
    let Wiring {
        buses,
        devices,
        net_cleanups,
        virtio,
        disks,
    } = out;
    add_acpi_pm(buses, devices, control)?;
    let alloc = BarAllocator::new(arch::layout::PCI_MMIO32_START, arch::layout::PCI_MMIO32_SIZE)
        .map_err(|e| dev_err("PCI root")(&e))?;
    let mut pci = PciCtx {
        vm_fd,
        root: PciRoot::new(alloc, None),
        routing: Arc::new(GsiRouting::new(vm_fd.clone())),
        buses,
        devices,
        virtio,
        mem: Arc::new(ram.memory().clone()),
        id: control.vm_id().to_string(),
        fork_backends,
        files: &opts.files,
    };
    if config.devices.rng {
        pci.add_rng()?;
    }
    for (i, d) in config.devices.disks.iter().enumerate() {
        disks.push(pci.add_blk(i, d)?);
    }
    if !config.devices.nics.is_empty() {
        let node = opts.node.net().map_err(|e| dev_err("virtio-net")(&e))?;
        // A VM process is handed its taps: it makes none (and may not).
        let mut nl = match opts.files.handed() {
            true => None,
            false => Some(k7d_net::netlink::Netlink::open().map_err(|e| dev_err("virtio-net")(&e))?),
        };
        let datapath = opts.node.datapath();
        for (i, n) in config.devices.nics.iter().enumerate() {
            net_cleanups.extend(pci.add_nic(&node, &datapath, nl.as_mut(), i, n, config.vcpus)?);
        }
    }
    if let Some(v) = &config.devices.vsock {
        pci.add_vsock(v)?;
    }
    let PciCtx {
        buses, devices, root, ..
    } = pci;
    add_pci_root(buses, devices, root)
}

/// The ACPI PM block: S5 (poweroff) stops the VM.
fn add_acpi_pm(buses: &mut Buses, devices: &mut Vec<DeviceInfo>, control: &Arc<VmControl>) -> Result<(), VmError> {
    let ctl = Arc::downgrade(control);
    let pm = arch::AcpiPmDevice::new(Arc::new(move || {
        if let Some(c) = ctl.upgrade() {
            c.request_stop(StopReason::GuestPoweroff);
        }
    }));
    let (base, len) = arch::AcpiPmDevice::RANGE;
    buses
        .pio
        .insert(base, len, shared(pm))
        .map_err(|e| dev_err("ACPI PM")(&e))?;
    devices.push(DeviceInfo {
        kind: "acpi-pm".into(),
        location: format!("ports {base:#x}-{:#x}", base + len - 1),
        detail: "S5 (poweroff) stops the VM".into(),
    });
    Ok(())
}

/// The PCI root's configuration access: ports CF8/CFC and the ECAM window.
fn add_pci_root(
    buses: &mut Buses,
    devices: &mut Vec<DeviceInfo>,
    root: k7d_devices::pci::PciRoot,
) -> Result<(), VmError> {
    use k7d_devices::pci::{ECAM_BUS_SIZE, PCI_CONFIG_IO_LEN, PCI_CONFIG_IO_PORT, PciConfigIo, PciConfigMmio};
    let root = Arc::new(Mutex::new(root));
    buses
        .pio
        .insert(
            PCI_CONFIG_IO_PORT,
            PCI_CONFIG_IO_LEN,
            shared(PciConfigIo::new(root.clone())),
        )
        .map_err(|e| dev_err("PCI config")(&e))?;
    buses
        .mmio
        .insert(
            arch::layout::PCIE_ECAM_START,
            ECAM_BUS_SIZE,
            shared(PciConfigMmio::new(root)),
        )
        .map_err(|e| dev_err("PCI ECAM")(&e))?;
    devices.push(DeviceInfo {
        kind: "pci-root".into(),
        location: format!("00:00.0, config 0xcf8 and ECAM {:#x}", arch::layout::PCIE_ECAM_START),
        detail: format!(
            "BAR window {:#x}+{:#x}",
            arch::layout::PCI_MMIO32_START,
            arch::layout::PCI_MMIO32_SIZE
        ),
    });
    Ok(())
}

/// Why a NIC attached through the datapath does not get vhost-net yet.
const DATAPATH_NO_VHOST: &str = "NICs attached through the datapath use the userspace data plane for now";

/// A NIC's data plane, settled by one pure function of the node's policy,
/// the NIC's request, the VM's vCPUs and what a vhost attempt can count on
/// (`vhost`: probed `/dev/vhost-net`, or why not). A NIC attached through
/// the datapath is settled as if vhost were unavailable (the datapath owns
/// its tap; vhost there is not wired yet): an explicit request fails with
/// that reason. Errors are the sentence the policy gives.
pub fn nic_plan(
    node: &k7d_net::policy::NodeNetConfig,
    nic: &crate::config::NicConfig,
    vcpus: u8,
    vhost: k7d_net::policy::VhostAvailability,
) -> Result<k7d_net::policy::EffectiveDataPlane, String> {
    let req = k7d_net::policy::NicNetRequest {
        vhost: nic.vhost,
        queues: nic.queues,
    };
    let vhost = if nic.datapath.is_some() {
        k7d_net::policy::VhostAvailability::Unavailable(DATAPATH_NO_VHOST.into())
    } else {
        vhost
    };
    k7d_net::policy::effective_data_plane(node, &req, u16::from(vcpus), &vhost).map_err(|e| e.to_string())
}

/// What a vhost attempt for `nic` can count on on this host, for
/// [`nic_plan`]: `/dev/vhost-net` probed when the NIC would take vhost
/// (asked for, or the node's default) and is not a datapath NIC; otherwise
/// not probed. What the daemon plans a NIC with, for a VM built in it or
/// in a VM process.
pub fn probe_vhost(
    node: &k7d_net::policy::NodeNetConfig,
    nic: &crate::config::NicConfig,
) -> k7d_net::policy::VhostAvailability {
    use k7d_net::policy::{VHOST_NET_PATH, VhostAvailability};
    if nic.vhost.unwrap_or(node.vhost_default()) && nic.datapath.is_none() {
        VhostAvailability::probe(Path::new(VHOST_NET_PATH))
    } else {
        VhostAvailability::Unavailable("not probed".into())
    }
}

/// Where `add_linux_platform` puts what it builds.
pub(super) struct Wiring<'a> {
    pub(super) buses: &'a mut Buses,
    pub(super) devices: &'a mut Vec<DeviceInfo>,
    pub(super) net_cleanups: &'a mut Vec<NetCleanup>,
    pub(super) virtio: &'a mut Vec<VirtioHandle>,
    pub(super) disks: &'a mut Vec<Arc<k7d_devices::virtio::block::DiskImage>>,
}

/// Puts the saved virtio states into a restored VM's functions, in bus order.
pub(super) fn restore_virtio(
    id: &str,
    virtio: &[VirtioHandle],
    states: &[k7d_devices::virtio::transport::VirtioPciState],
) -> Result<(), VmError> {
    if states.len() != virtio.len() {
        return Err(VmError::Persist(PersistError::Mismatch(format!(
            "the state has {} virtio devices, vm {id}'s config {}",
            states.len(),
            virtio.len()
        ))));
    }
    for (d, st) in virtio.iter().zip(states) {
        let mut dev = d.lock().unwrap_or_else(|p| p.into_inner());
        dev.restore_state(st)
            .map_err(|e| VmError::DeviceState(format!("vm {id} cannot be restored: {e}")))?;
    }
    Ok(())
}

/// A drive's medium: the image at `path`, or an empty medium.
pub(super) fn open_medium(
    path: Option<&std::path::Path>,
    read_only: bool,
) -> Result<k7d_devices::virtio::block::DiskImage, VmError> {
    match path {
        Some(p) => k7d_devices::virtio::block::DiskImage::open(p, read_only),
        None => k7d_devices::virtio::block::DiskImage::empty(),
    }
    .map_err(|e| dev_err("virtio-blk")(&e))
}

/// A virtio-pci function the VM pauses and resumes with its vCPUs.
pub(super) type VirtioHandle = Arc<Mutex<k7d_devices::virtio::transport::VirtioPciDevice>>;

/// Attaches NIC `idx` of VM `id` to the pod network `d` through `dp`: a
/// tap made in the pod netns with `queues` queues, or with `adopt` the
/// VM's own bare tap moved in (`vstate/attach.rs`). Returns the attachment
/// and what the NIC's `info` line adds (", datapath: MODE[ (why)]").
pub(crate) fn attach_to_pod(
    dp: &k7d_net::Datapath,
    id: &str,
    idx: u16,
    d: &crate::config::DatapathNicConfig,
    queues: usize,
    adopt: bool,
) -> Result<(k7d_net::Attached, String), VmError> {
    let mode: k7d_net::Mode = d.mode.parse().map_err(|e| dev_err("virtio-net")(&e))?;
    let att = dp
        .attach(&k7d_net::NicRequest {
            vm_id: id,
            nic_idx: idx,
            mode,
            pod_netns: &d.netns,
            pod_if: &d.pod_if,
            queues,
            vnet_hdr: true,
            pod_uid: d.pod_uid.as_deref(),
            unsupported: None,
            adopt,
        })
        .map_err(|e| VmError::Device {
            what: "datapath",
            msg: format!("nic {idx}: {e}"),
        })?;
    let note = format!(
        ", datapath: {}{}",
        att.effective_mode,
        att.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
    );
    Ok((att, note))
}

/// A NIC attached through the datapath, detached when the VM is dropped.
pub(crate) struct NetCleanup {
    dp: k7d_net::Datapath,
    vm_id: String,
    idx: u16,
    netns: PathBuf,
    pod_if: String,
    /// Left attached when dropped ([`NetCleanup::keep`]).
    kept: bool,
}

impl NetCleanup {
    /// Detaches NIC `idx` of `vm_id` from the pod network `netns`/`pod_if`
    /// when dropped.
    pub(crate) fn new(dp: k7d_net::Datapath, vm_id: String, idx: u16, netns: PathBuf, pod_if: String) -> Self {
        Self {
            dp,
            vm_id,
            idx,
            netns,
            pod_if,
            kept: false,
        }
    }

    /// Leaves the NIC attached: a VM process's, whose attachment outlives
    /// this daemon and is detached by the delete of whichever daemon
    /// serves it then (from its record).
    pub(crate) fn keep(mut self) {
        self.kept = true;
    }
}

impl Drop for NetCleanup {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        if let Err(e) = self.dp.detach(&self.vm_id, self.idx, Some(&self.netns), &self.pod_if) {
            tracing::error!(vm = %self.vm_id, nic = self.idx, error = %e, "datapath detach failed");
        }
    }
}

/// What wiring a virtio-pci device needs.
pub(super) struct PciCtx<'a> {
    vm_fd: &'a Arc<VmFd>,
    root: k7d_devices::pci::PciRoot,
    routing: Arc<GsiRouting>,
    buses: &'a mut Buses,
    devices: &'a mut Vec<DeviceInfo>,
    virtio: &'a mut Vec<VirtioHandle>,
    /// The VM's memory handle (the devices' view unless they have their own).
    mem: k7d_devices::virtio::GuestMemoryHandle,
    id: String,
    /// A fork child's: the source devices' backends, in bus order.
    fork_backends: Option<VecDeque<ForkBackend>>,
    /// Where disk images and the entropy source come from.
    files: &'a HostFiles,
}

impl PciCtx<'_> {
    /// The next source device's backend when this VM is a fork child.
    fn source_backend(&mut self, what: &'static str) -> Result<Option<ForkBackend>, VmError> {
        match self.fork_backends.as_mut() {
            None => Ok(None),
            Some(b) => b.pop_front().map(Some).ok_or_else(|| VmError::Device {
                what,
                msg: "the fork source has fewer devices than the child".into(),
            }),
        }
    }

    /// virtio-rng (a fork child's reads its own entropy source).
    fn add_rng(&mut self) -> Result<(), VmError> {
        self.source_backend("virtio-rng")?;
        let rng = match self.files.take(FileRole::Entropy).map_err(|msg| VmError::Device {
            what: "virtio-rng",
            msg,
        })? {
            Some(f) => k7d_devices::virtio::rng::Rng::with_source(f),
            None => k7d_devices::virtio::rng::Rng::new().map_err(|e| dev_err("virtio-rng")(&e))?,
        };
        let mem = self.mem.clone();
        self.add("virtio-rng", Box::new(rng), mem, String::new())
    }

    /// virtio-blk on disk `i` (a fork child's on its source's copy-on-write
    /// view), with its own view of guest memory; returns the disk.
    fn add_blk(
        &mut self,
        i: usize,
        d: &crate::config::DiskConfig,
    ) -> Result<Arc<k7d_devices::virtio::block::DiskImage>, VmError> {
        let disk = match self.source_backend("virtio-blk")? {
            Some(b) => b
                .take::<k7d_devices::virtio::block::DiskImage>()
                .ok_or_else(|| VmError::Device {
                    what: "virtio-blk",
                    msg: format!("disk {i} has no copy-on-write view from the fork source"),
                })?,
            None => {
                // An empty drive has no file to hand over.
                let handed = match &d.path {
                    Some(_) => self
                        .files
                        .take(FileRole::Disk { index: i as u16 })
                        .map_err(|msg| VmError::Device {
                            what: "virtio-blk",
                            msg,
                        })?,
                    None => None,
                };
                match (handed, &d.path) {
                    (Some(f), Some(p)) => {
                        k7d_devices::virtio::block::DiskImage::from_file(f, d.read_only, p.display().to_string())
                            .map_err(|e| dev_err("virtio-blk")(&e))?
                    }
                    _ => open_medium(d.path.as_deref(), d.read_only)?,
                }
            }
        };
        let serial = format!("k7d-disk{i}");
        let mut blk = k7d_devices::virtio::block::Block::new(disk, &serial).map_err(|e| dev_err("virtio-blk")(&e))?;
        let image = blk.disk().clone();
        // SAFETY: the view maps the VM's own RAM; the device (inside the
        // buses) is dropped before `ram` (see `Vm`'s field order), and no
        // device outlives its VM.
        let view = unsafe { k7d_devices::virtio::block::DeviceMemory::new(&self.mem) }
            .map_err(|e| dev_err("virtio-blk")(&e))?;
        blk.track_writes(view.clone());
        let detail = format!(
            "{} ({}), serial {serial}, own dirty bitmap",
            d.path.as_deref().map_or_else(
                || k7d_devices::virtio::block::EMPTY_MEDIUM.to_string(),
                |p| p.display().to_string()
            ),
            if d.read_only { "read-only" } else { "read-write" }
        );
        self.add("virtio-blk", Box::new(blk), view.handle(), detail)?;
        Ok(image)
    }

    /// virtio-net for NIC `i`: its plan ([`nic_plan`]), its tap (its own,
    /// or the datapath's, whose cleanup is returned), vhost-net or the
    /// userspace data plane (a failed vhost attempt settles the plan again
    /// with vhost unavailable: an explicit request fails with the reason, a
    /// defaulted NIC falls back with one warning).
    fn add_nic(
        &mut self,
        node: &k7d_net::policy::NodeNetConfig,
        datapath: &k7d_net::DatapathConfig,
        mut nl: Option<&mut k7d_net::netlink::Netlink>,
        i: usize,
        n: &crate::config::NicConfig,
        vcpus: u8,
    ) -> Result<Option<NetCleanup>, VmError> {
        use k7d_net::policy::VhostAvailability;
        let idx = i as u16;
        let id = self.id.clone();
        let plan_err = |e: String| VmError::Device {
            what: "virtio-net",
            msg: format!("nic {i}: {e}"),
        };
        let handed = self.files.handed();
        // A VM process opens no path: the daemon planned the NIC, and
        // handed it one /dev/vhost-net per pair when it planned vhost.
        let avail = if handed {
            if self.files.has(FileRole::VhostNet { nic: idx, pair: 0 }) {
                VhostAvailability::Available
            } else {
                VhostAvailability::Unavailable(super::handed::NO_VHOST_HANDED.into())
            }
        } else {
            probe_vhost(node, n)
        };
        let mut plane = nic_plan(node, n, vcpus, avail).map_err(plan_err)?;
        if let Some(w) = &plane.warning {
            tracing::warn!(vm = %id, nic = i, "{w}");
        }
        let mut path_note = String::new();
        let mut cleanup = None;
        let no_netlink = || VmError::Device {
            what: "virtio-net",
            msg: format!("nic {i}: no netlink socket to make its tap with"),
        };
        let (tap_name, tap) = match &n.datapath {
            _ if handed => {
                // The daemon made the tap (in the pod netns, with the
                // datapath around it, for a datapath NIC); its queues were
                // handed over, and the datapath is the daemon's to detach.
                let name = match &n.datapath {
                    None => n.tap.clone().unwrap_or_else(|| k7d_net::nic_names(&id, idx).tap),
                    Some(_) => k7d_net::nic_names(&id, idx).tap,
                };
                let queues = (0..plane.queue_pairs)
                    .map(|queue| {
                        let role = FileRole::TapQueue { nic: idx, queue };
                        match self.files.take(role) {
                            Ok(Some(f)) => Ok(std::os::fd::OwnedFd::from(f)),
                            Ok(None) => Err(format!("{role} was not handed to this VM process")),
                            Err(e) => Err(e),
                        }
                    })
                    .collect::<Result<Vec<_>, String>>()
                    .map_err(|msg| VmError::Device {
                        what: "virtio-net",
                        msg,
                    })?;
                let tap = k7d_net::Tap {
                    name: name.clone(),
                    ifindex: 0,
                    queues,
                    vnet_hdr: true,
                };
                (name, tap)
            }
            None => {
                let name = n.tap.clone().unwrap_or_else(|| k7d_net::nic_names(&id, idx).tap);
                let nl = nl.as_deref_mut().ok_or_else(no_netlink)?;
                let tap = k7d_net::create_tap(nl, &name, plane.queue_pairs.into(), true)
                    .map_err(|e| dev_err("virtio-net")(&e))?;
                (name, tap)
            }
            Some(d) => {
                let dp = k7d_net::Datapath::new(datapath.clone()).map_err(|e| dev_err("datapath")(&e))?;
                let (att, note) = attach_to_pod(&dp, &id, idx, d, plane.queue_pairs.into(), false)?;
                path_note = note;
                // Detached (filters, pins, bridge) when the VM goes away.
                cleanup = Some(NetCleanup::new(dp, id.clone(), idx, d.netns.clone(), d.pod_if.clone()));
                (att.tap.name.clone(), att.tap)
            }
        };
        let mac = n
            .mac
            .as_deref()
            .and_then(crate::config::parse_mac)
            .unwrap_or_else(|| derived_mac(&id, idx));
        let cfg = |pairs: u16| k7d_devices::virtio::net::NetConfig {
            mac,
            queue_pairs: pairs,
        };
        let net = if plane.vhost && handed {
            let opts = k7d_devices::virtio::net::VhostOptions {
                dirty_log: self.fork_backends.is_some(),
            };
            let devices = (0..plane.queue_pairs)
                .map(|pair| {
                    let role = FileRole::VhostNet { nic: idx, pair };
                    self.files
                        .take(role)
                        .and_then(|f| f.ok_or_else(|| format!("{role} was not handed to this VM process")))
                })
                .collect::<Result<Vec<_>, String>>()
                .map_err(|msg| VmError::Device {
                    what: "virtio-net",
                    msg,
                })?;
            k7d_devices::virtio::net::Net::new_vhost_with(tap, cfg(plane.queue_pairs), self.mem.clone(), opts, devices)
                .map_err(|e| dev_err("virtio-net")(&e))?
        } else if plane.vhost {
            // The dirty log is switched on by the first fork (logging costs
            // the kernel a bit set per page it writes); a fork child's is on
            // from its start, as its KVM dirty log is: it can be forked in
            // turn, and its first fork must see every page vhost wrote.
            let opts = k7d_devices::virtio::net::VhostOptions {
                dirty_log: self.fork_backends.is_some(),
            };
            match k7d_devices::virtio::net::Net::new_vhost(tap, cfg(plane.queue_pairs), self.mem.clone(), opts) {
                Ok(net) => net,
                Err(e) => {
                    // The failed attempt dropped (and so removed) the tap.
                    plane =
                        nic_plan(node, n, vcpus, VhostAvailability::Unavailable(e.to_string())).map_err(plan_err)?;
                    if let Some(w) = &plane.warning {
                        tracing::warn!(vm = %id, nic = i, "{w}");
                    }
                    let nl = nl.ok_or_else(no_netlink)?;
                    let tap = k7d_net::create_tap(nl, &tap_name, plane.queue_pairs.into(), true)
                        .map_err(|e| dev_err("virtio-net")(&e))?;
                    k7d_devices::virtio::net::Net::new(tap, cfg(plane.queue_pairs))
                        .map_err(|e| dev_err("virtio-net")(&e))?
                }
            }
        } else {
            k7d_devices::virtio::net::Net::new(tap, cfg(plane.queue_pairs)).map_err(|e| dev_err("virtio-net")(&e))?
        };
        let mac_s = mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
        // A child's NIC is built from its config (its own tap).
        self.source_backend("virtio-net")?;
        let mem = self.mem.clone();
        self.add(
            "virtio-net",
            Box::new(net),
            mem,
            format!("tap {tap_name}, {plane}, mac {mac_s}{path_note}"),
        )?;
        Ok(cleanup)
    }

    /// virtio-vsock with its hybrid host socket (a fork child's its own,
    /// named by its config): bound here, or in a VM process handed over
    /// bound (the daemon's to remove).
    fn add_vsock(&mut self, v: &crate::config::VsockConfig) -> Result<(), VmError> {
        use k7d_devices::virtio::vsock::Vsock;
        let dev = match self.files.take(FileRole::VsockListener) {
            Ok(Some(f)) => {
                let listener = std::os::unix::net::UnixListener::from(std::os::fd::OwnedFd::from(f));
                Vsock::with_listener(v.cid, &v.uds, listener)
            }
            Ok(None) => Vsock::new(v.cid, &v.uds),
            Err(msg) => {
                return Err(VmError::Device {
                    what: "virtio-vsock",
                    msg,
                });
            }
        }
        .map_err(|e| dev_err("virtio-vsock")(&e))?;
        let detail = format!("cid {}, hybrid host socket {}", v.cid, v.uds.display());
        self.source_backend("virtio-vsock")?;
        let mem = self.mem.clone();
        self.add("virtio-vsock", Box::new(dev), mem, detail)
    }

    /// Puts `dev` on the PCI bus: MSI-X vectors routed through KVM (one GSI
    /// each, irqfds registered), queue notifications as ioeventfds, BARs on
    /// the MMIO bus, and a line for `info`.
    fn add(
        &mut self,
        what: &'static str,
        dev: Box<dyn k7d_devices::virtio::VirtioDevice>,
        mem: k7d_devices::virtio::GuestMemoryHandle,
        detail: String,
    ) -> Result<(), VmError> {
        use k7d_devices::virtio::transport::VirtioPciDevice;
        let err = |e: &dyn std::fmt::Display| VmError::Device {
            what,
            msg: e.to_string(),
        };
        let vectors = dev.queue_max_sizes().len() as u32 + 1;
        let gsi_base = self.routing.allocate(vectors);
        let router = Arc::new(DeviceMsiRouter::new(self.routing.clone(), gsi_base));
        let dev = Arc::new(Mutex::new(VirtioPciDevice::new(dev, mem, router).map_err(|e| err(&e))?));
        let att = self.root.add_device(dev.clone()).map_err(|e| err(&e))?;
        for bar in &att.bars {
            self.buses
                .mmio
                .insert(bar.addr, bar.len, dev.clone())
                .map_err(|e| err(&e))?;
        }
        {
            let d = dev.lock().unwrap_or_else(|p| p.into_inner());
            for (v, fd) in d.msix().irqfds().iter().enumerate() {
                self.vm_fd
                    .register_irqfd(fd, gsi_base + v as u32)
                    .map_err(|e| VmError::Kvm("KVM_IRQFD (virtio)", e))?;
            }
            for n in d.ioeventfds().map_err(|e| err(&e))? {
                self.vm_fd
                    .register_ioevent(
                        &n.eventfd,
                        &kvm_ioctls::IoEventAddress::Mmio(n.addr),
                        kvm_ioctls::NoDatamatch,
                    )
                    .map_err(|e| VmError::Kvm("KVM_IOEVENTFD (virtio)", e))?;
            }
        }
        self.virtio.push(dev.clone());
        let mut d = format!("MSI-X vectors at GSI {gsi_base}..{}", gsi_base + vectors - 1);
        if !detail.is_empty() {
            d = format!("{detail}; {d}");
        }
        self.devices.push(DeviceInfo {
            kind: what.into(),
            location: format!(
                "pci {} bar0 {:#x}",
                att.bdf,
                att.bars.first().map(|b| b.addr).unwrap_or(0)
            ),
            detail: d,
        });
        Ok(())
    }
}

/// Writes every NIC's effective MAC into `config` (a VM restored or forked
/// under another id must keep the MAC its guest's driver holds, not derive a
/// new one from the new id).
pub(crate) fn pin_macs(config: &mut VmConfig, vm_id: &str) {
    for (i, n) in config.devices.nics.iter_mut().enumerate() {
        let mac = n
            .mac
            .as_deref()
            .and_then(crate::config::parse_mac)
            .unwrap_or_else(|| derived_mac(vm_id, i as u16));
        n.mac = Some(mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":"));
    }
}

/// A locally administered MAC derived from the VM id and NIC index.
pub(super) fn derived_mac(vm_id: &str, idx: u16) -> [u8; 6] {
    let mut h: u32 = 0x811c_9dc5;
    for b in vm_id.bytes().chain(idx.to_le_bytes()) {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    let b = h.to_le_bytes();
    [0x52, 0x54, 0x00, b[0], b[1], b[2]]
}

pub(super) fn open_log(p: &Path) -> Result<File, VmError> {
    super::handed::open_log(p).map_err(io(format!("cannot open the serial log {}", p.display())))
}

/// A VM's devices once built: the buses its vCPUs dispatch to, the serial
/// port, the virtio functions and their disks, the records of the guest
/// RAM they write, what their NICs leave to undo, and what `info` reports
/// of them. The virtio functions pause, resume and save their states
/// together, here. Fields in drop order (the taps close with the buses,
/// before their cleanups); the `Vm` holds this before its VM fd and RAM.
pub(super) struct DeviceManager {
    buses: Arc<Buses>,
    serial: Arc<Mutex<Serial>>,
    net_cleanups: Vec<NetCleanup>,
    info: Vec<DeviceInfo>,
    /// The virtio functions (also on the buses): paused with the vCPUs.
    virtio: Vec<VirtioHandle>,
    /// The records the functions keep of the guest RAM they write beside
    /// the VM's own bitmap and KVM's dirty log (`VirtioDevice::ram_write_logs`:
    /// blk's own view, vhost's kernel log), collected once, at the VM's
    /// first fork (a fork child's: its first fork or snapshot): the one
    /// seam through which the fork path learns every writer
    /// (`docs/fork.md`). `None` until collected.
    ram_logs: Mutex<Option<Vec<Arc<dyn RamWriteLog>>>>,
    /// Every disk, in config order (a snapshot refuses copy-on-write ones).
    disks: Vec<Arc<DiskImage>>,
}

impl DeviceManager {
    /// What `build_devices` and `add_linux_platform` wired.
    pub(super) fn new(
        buses: Buses,
        serial: Arc<Mutex<Serial>>,
        info: Vec<DeviceInfo>,
        virtio: Vec<VirtioHandle>,
        disks: Vec<Arc<DiskImage>>,
        net_cleanups: Vec<NetCleanup>,
    ) -> Self {
        DeviceManager {
            buses: Arc::new(buses),
            serial,
            net_cleanups,
            info,
            virtio,
            ram_logs: Mutex::new(None),
            disks,
        }
    }

    /// The buses, which each vCPU thread holds.
    pub(super) fn buses(&self) -> &Arc<Buses> {
        &self.buses
    }

    /// The serial port's state (a snapshot or fork carries it).
    pub(super) fn serial_state(&self) -> k7d_devices::legacy::SerialSnapshot {
        lock(&self.serial).snapshot()
    }

    /// The devices as wired (`info`).
    pub(super) fn info(&self) -> &[DeviceInfo] {
        &self.info
    }

    /// NIC `index`'s report, and what undoes its place in a pod's network,
    /// after a live attach.
    pub(super) fn attached_nic(&mut self, index: usize, cleanup: Option<NetCleanup>) -> Option<&mut DeviceInfo> {
        self.net_cleanups.extend(cleanup);
        self.info.iter_mut().filter(|i| i.kind == "virtio-net").nth(index)
    }

    /// The virtio functions in bus order: device name and BAR 0 address.
    pub(super) fn functions(&self) -> Vec<(&'static str, u64)> {
        self.virtio
            .iter()
            .map(|d| {
                let d = lock(d);
                (d.device_name(), d.config().bar_address(0))
            })
            .collect()
    }

    /// The virtio-blk function of disk `index`.
    pub(super) fn blk(&self, index: usize) -> Option<&VirtioHandle> {
        self.virtio.iter().filter(|h| lock(h).device_name() == "blk").nth(index)
    }

    /// Whether every function can be carried into a fork child; the first
    /// refusal, worded for `vm`.
    pub(super) fn can_fork(&self, vm: &str) -> Result<(), VmError> {
        for d in &self.virtio {
            lock(d)
                .can_fork()
                .map_err(|e| VmError::Refused(format!("vm {vm} cannot be forked: {e}")))?;
        }
        Ok(())
    }

    /// What each function's twin in a fork child takes (blk: a
    /// copy-on-write view of its disk as of now), in bus order.
    pub(super) fn fork_backends(&self, vm: &str) -> Result<VecDeque<ForkBackend>, VmError> {
        let mut backends = VecDeque::with_capacity(self.virtio.len());
        for d in &self.virtio {
            backends.push_back(lock(d).fork_backend().map_err(|e| match e {
                // Over a budget its owner set: refused, like every budget.
                k7d_devices::virtio::VirtioError::OverBudget(_) => {
                    VmError::Refused(format!("vm {vm} could not be forked: {e}"))
                }
                e => VmError::DeviceState(format!("vm {vm} could not be forked: {e}")),
            })?);
        }
        Ok(backends)
    }

    /// Every disk, in config order.
    pub(super) fn disks(&self) -> &[Arc<DiskImage>] {
        &self.disks
    }

    /// Disk `index` now holds `medium` (a medium change).
    pub(super) fn set_disk(&mut self, index: usize, medium: Arc<DiskImage>) {
        if let Some(d) = self.disks.get_mut(index) {
            *d = medium;
        }
    }

    /// Restored functions go live, before any vCPU runs. If one cannot, the
    /// ones already started are reset, and its error comes back.
    pub(super) fn start_restored(&self) -> Result<(), k7d_devices::virtio::VirtioError> {
        for (i, d) in self.virtio.iter().enumerate() {
            let mut dev = lock(d);
            if let Err(e) = dev.start_restored() {
                drop(dev);
                for done in &self.virtio[..i] {
                    lock(done).reset_device();
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Pauses every function, the vCPUs parked: each drains what it is
    /// serving and parks, then nothing writes guest RAM. One that cannot
    /// pause resumes those before it, and the sentence names it (`vm`'s
    /// vCPUs are to run on).
    pub(super) fn pause(&self, vm: &str) -> Result<(), VmError> {
        for (i, d) in self.virtio.iter().enumerate() {
            let mut dev = lock(d);
            if let Err(e) = dev.pause() {
                let name = dev.device_name();
                drop(dev);
                for done in self.virtio[..i].iter().rev() {
                    if let Err(e) = lock(done).resume() {
                        tracing::error!(vm = %vm, error = %e, "resuming a device after a failed pause failed");
                    }
                }
                return Err(VmError::DeviceState(format!(
                    "the {name} device could not pause, so vm {vm} keeps running: {e}"
                )));
            }
        }
        Ok(())
    }

    /// Restarts every function.
    pub(super) fn resume(&self, vm: &str) -> Result<(), VmError> {
        for d in &self.virtio {
            let mut dev = lock(d);
            dev.resume().map_err(|e| {
                VmError::DeviceState(format!(
                    "the {} device of vm {vm} could not resume, so it stays paused: {e}",
                    dev.device_name()
                ))
            })?;
        }
        Ok(())
    }

    /// Every function's state, in bus order (every device parked).
    pub(super) fn save_states(&self, vm: &str) -> Result<Vec<VirtioPciState>, VmError> {
        self.virtio
            .iter()
            .map(|d| {
                let mut dev = lock(d);
                dev.save_state().map_err(|e| {
                    VmError::DeviceState(format!(
                        "the state of vm {vm}'s {} device cannot be saved: {e}",
                        dev.device_name()
                    ))
                })
            })
            .collect()
    }

    /// Each function's counters (`VirtioDevice::counters`), named by kind
    /// and index among its kind (`net0`, `net1`, ...); those with none left
    /// out.
    pub(super) fn counters(&self) -> Vec<(String, Vec<(String, u64)>)> {
        let mut seen: Vec<&'static str> = Vec::new();
        let mut out = Vec::new();
        for d in &self.virtio {
            let d = lock(d);
            let kind = d.device_name();
            let index = seen.iter().filter(|k| **k == kind).count();
            seen.push(kind);
            let counters = d.counters();
            if !counters.is_empty() {
                out.push((
                    format!("{kind}{index}"),
                    counters.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                ));
            }
        }
        out
    }

    /// Asks every function for the records of the guest RAM it writes,
    /// once (all paused: a kernel backend's log starts at resume); all of
    /// them or none. `op` ("forked", "snapshotted") words a refusal.
    pub(super) fn start_ram_logs(&self, vm: &str, op: &str) -> Result<(), VmError> {
        let mut logs = lock(&self.ram_logs);
        if logs.is_some() {
            return Ok(());
        }
        let mut all = Vec::new();
        for d in &self.virtio {
            let mut dev = lock(d);
            let more = dev.ram_write_logs().map_err(|e| {
                VmError::Refused(format!(
                    "vm {vm} cannot be {op}: its {} device cannot record the guest pages it writes: {e}",
                    dev.device_name()
                ))
            })?;
            all.extend(more);
        }
        *logs = Some(all);
        Ok(())
    }

    /// Folds what the functions wrote since the last call into `ram`'s
    /// diverged set (all paused).
    pub(super) fn harvest_ram_writes_into(&self, ram: &GuestRam) {
        ram.add_diverged_gpas(self.drain_ram_writes().into_iter());
    }

    /// The guest addresses the functions wrote since the last call (all
    /// paused).
    pub(super) fn drain_ram_writes(&self) -> Vec<u64> {
        let mut gpas = Vec::new();
        for log in lock(&self.ram_logs).iter().flatten() {
            log.drain(&mut |gpa| gpas.push(gpa.0));
        }
        gpas
    }

    /// Forgets what the functions wrote so far (it is in the frozen base).
    pub(super) fn clear_ram_writes(&self) {
        for log in lock(&self.ram_logs).iter().flatten() {
            log.drain(&mut |_| {});
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{DatapathNicConfig, NicConfig};
    use k7d_net::policy::{NodeNetConfig, VhostAvailability};

    fn datapath_nic(vhost: Option<bool>) -> NicConfig {
        NicConfig {
            vhost,
            datapath: Some(DatapathNicConfig {
                mode: "direct".into(),
                netns: "/run/netns/pod".into(),
                pod_if: "eth0".into(),
                pod_uid: None,
                pod_namespace: None,
                pod_name: None,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_nic_plan_is_settled_once_from_policy_request_and_vhost() {
        let node = NodeNetConfig::new(true, 16).unwrap();
        // vhost where it can be had, userspace where it cannot (one warning).
        let p = nic_plan(&node, &NicConfig::default(), 2, VhostAvailability::Available).unwrap();
        assert!(p.vhost);
        let p = nic_plan(
            &node,
            &NicConfig::default(),
            2,
            VhostAvailability::Unavailable("gone".into()),
        )
        .unwrap();
        assert!(!p.vhost && p.warning.is_some());
        // A datapath NIC never gets vhost, whatever the probe said; asking
        // for it explicitly fails with the reason.
        let p = nic_plan(&node, &datapath_nic(None), 2, VhostAvailability::Available).unwrap();
        assert!(!p.vhost);
        let e = nic_plan(&node, &datapath_nic(Some(true)), 2, VhostAvailability::Available).unwrap_err();
        assert!(e.contains(DATAPATH_NO_VHOST), "{e}");
    }
}
