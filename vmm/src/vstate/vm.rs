//! One VM: a KVM VM fd, its memfd RAM, vCPU threads and the device bus.
//!
//! Life: [`Vm::new`] builds everything (KVM VM, in-kernel irqchip + PIT2,
//! memory, vCPUs, devices, guest image) but runs nothing; [`Vm::start`]
//! spawns one thread per vCPU; [`Vm::pause`]/[`Vm::resume`] park and unpark
//! them; [`Vm::stop`] makes them leave and joins them. Dropping a `Vm` stops it
//! and releases every fd, mapping and thread it created.

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use k7d_devices::bus::{BusDevice, SharedDevice};
use k7d_devices::irq::IrqLine;
use k7d_devices::legacy::{I8042, Serial, SerialOutput};
use k7d_devices::virtio::{ForkBackend, RamWriteLog};
use kvm_bindings::{KVM_PIT_SPEAKER_DUMMY, kvm_pit_config};
use kvm_ioctls::{Kvm, VmFd};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use super::control::{ControlError, StopReason, VmControl};
use super::irq::{DeviceMsiRouter, GsiRouting};
use super::memory::{GuestMemoryMmap, GuestRam, MemoryError};
use super::persist::{self, MachineState, PersistError};
use super::snapshot;
use super::vcpu::{self, Buses, VcpuSetupError};
use crate::arch::x86_64 as arch;
use crate::config::{GuestSpec, VmConfig};

/// COM1.
const SERIAL_PORT: u64 = 0x3f8;
const SERIAL_IRQ: u32 = 4;
const I8042_PORT: u64 = 0x60;
const TSS_ADDR: usize = 0xfffb_d000;
const BSP_STACK: u64 = 0x7000;

/// Errors from building or driving a VM.
#[derive(Debug, Error)]
pub enum VmError {
    /// /dev/kvm could not be opened.
    #[error("cannot open /dev/kvm (run `k7d check`)")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// A VM-level KVM ioctl failed.
    #[error("{0} failed")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    /// Guest RAM.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// vCPU setup.
    #[error(transparent)]
    Vcpu(#[from] VcpuSetupError),
    /// The guest image.
    #[error("cannot load the guest: {0}")]
    Guest(String),
    /// A host resource (file, eventfd, thread).
    #[error("{what}")]
    Io {
        /// What failed.
        what: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Wrong state for the operation.
    #[error("vm {id} is {state}, cannot {op}")]
    State {
        /// VM id.
        id: String,
        /// Current state.
        state: String,
        /// The refused operation.
        op: &'static str,
    },
    /// The Linux kernel, initrd or command line was refused.
    #[error(transparent)]
    Boot(#[from] arch::BootError),
    /// A PCI or virtio device could not be set up.
    #[error("cannot set up the {what} device: {msg}")]
    Device {
        /// The device.
        what: &'static str,
        /// Why.
        msg: String,
    },
    /// What the VM holds cannot be carried into a fork or snapshot; the
    /// sentence names the VM and the device.
    #[error("{0}")]
    Refused(String),
    /// A device refused a lifecycle step (pause, resume); the sentence
    /// names the device, the VM and what state the VM was left in.
    #[error("{0}")]
    DeviceState(String),
    /// Saving or restoring machine state failed.
    #[error(transparent)]
    Persist(#[from] PersistError),
    /// The threads could not be confined (seccomp), so the VM does not start.
    #[error("vm {id} cannot start: {source}")]
    Confine {
        /// VM id.
        id: String,
        /// Cause.
        #[source]
        source: crate::seccomp::SeccompError,
    },
    /// Pause/resume control.
    #[error("vm {id}: {source}")]
    Control {
        /// VM id.
        id: String,
        /// Cause.
        #[source]
        source: ControlError,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
    let what = what.into();
    move |source| VmError::Io { what, source }
}

/// The states a VM moves through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum VmState {
    /// Built, not started.
    Created,
    /// vCPUs running.
    Running,
    /// vCPUs parked.
    Paused,
    /// vCPUs gone; why.
    Stopped {
        /// Why.
        reason: StopReason,
    },
}

impl std::fmt::Display for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Created => f.write_str("created"),
            Self::Running => f.write_str("running"),
            Self::Paused => f.write_str("paused"),
            Self::Stopped { reason } => write!(f, "stopped ({reason})"),
        }
    }
}

/// One device as wired in this VM (reported by `info`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Kind (`serial`, `i8042`, ...).
    pub kind: String,
    /// Where the guest finds it.
    pub location: String,
    /// Backend details.
    pub detail: String,
}

/// Where a restored VM's RAM comes from.
enum RamSource<'a> {
    /// Already filled (from a file holding guest RAM byte for byte).
    Ready(GuestRam),
    /// A fork child of this frozen RAM (plus the pages that diverged from it).
    ChildOf(&'a GuestRam),
}

/// Host-side options that are not part of the guest-visible config.
#[derive(Debug, Clone, Default)]
pub struct VmOptions {
    /// Append the guest's serial output to this file.
    pub serial_log: Option<PathBuf>,
    /// Node-wide settings (network queue/vhost policy).
    pub node: crate::config::NodeConfig,
}

/// A VM.
pub struct Vm {
    // Drop order matters: threads are joined in `Drop::drop`, then the VM
    // leaves the state dump, then the vCPU fds, the buses, the VM fd, and
    // only then the memory KVM maps.
    _diag: crate::diag::Registration,
    vcpu_diag: Arc<[vcpu::VcpuDiag]>,
    id: String,
    config: VmConfig,
    control: Arc<VmControl>,
    /// The vCPU threads until `start` hands them their vCPUs.
    standby: Option<super::standby::Standby>,
    threads: Vec<JoinHandle<()>>,
    vcpus: Vec<vcpu::SharedVcpu>,
    buses: Arc<Buses>,
    serial: Arc<Mutex<Serial>>,
    /// After the buses (the taps are closed first), before the VM fd.
    _net_cleanups: Vec<NetCleanup>,
    devices: Vec<DeviceInfo>,
    /// The virtio functions (also on the buses): paused with the vCPUs.
    virtio: Vec<VirtioHandle>,
    /// Writers of guest RAM the fork path must account for besides KVM's
    /// dirty log and the VM's own bitmap (see `docs/fork.md`); before `ram`.
    ram_writers: RamWriters,
    /// Every disk, in config order (a snapshot refuses copy-on-write ones).
    disks: Vec<Arc<k7d_devices::virtio::block::DiskImage>>,
    vm_fd: Arc<VmFd>,
    ram: GuestRam,
    created: Instant,
    /// How long each step of the build took (`build_steps`).
    build_steps: BuildSteps,
    started: Option<Instant>,
}

/// The steps of a VM's build, in order, with how long each took: what the
/// VMM does before the guest runs (issue 13; `benches/benches/vm_build.rs`).
pub type BuildSteps = Vec<(&'static str, Duration)>;

/// Times the steps of a build as they end.
struct StepClock {
    last: Instant,
    steps: BuildSteps,
}

impl StepClock {
    fn new() -> Self {
        Self {
            last: Instant::now(),
            steps: Vec::with_capacity(10),
        }
    }

    /// Ends step `name` (begun when the previous one ended).
    fn done(&mut self, name: &'static str) {
        let now = Instant::now();
        self.steps.push((name, now - self.last));
        self.last = now;
    }
}

impl Vm {
    /// Builds the VM described by `config` (already validated) under `id`.
    pub fn new(id: &str, config: &VmConfig, opts: &VmOptions) -> Result<Self, VmError> {
        Self::build(id, config, opts, None)
    }

    /// Builds a VM that resumes `state`, with guest RAM copied from `memory`
    /// (a file holding the source's RAM, e.g. its memfd or a snapshot file).
    /// Its disks are opened from the config's paths as they are now: keeping
    /// them as they were at the snapshot is the caller's business (as with
    /// Firecracker); a fork gives its children copy-on-write disks instead.
    pub fn restore(
        id: &str,
        config: &VmConfig,
        opts: &VmOptions,
        state: &MachineState,
        memory: &File,
    ) -> Result<Self, VmError> {
        persist::check_fits(config, state)?;
        let ram = GuestRam::new(id, config.memory_bytes())?;
        snapshot::copy_sparse(memory, ram.memfd(), ram.size()).map_err(snapshot_io)?;
        Self::build(id, config, opts, Some((state, RamSource::Ready(ram))))
    }

    /// Forks this paused VM: a new VM `child_id` whose RAM is copy-on-write
    /// over this VM's frozen base plus the pages that diverged since the
    /// freeze, and whose machine state is this VM's at this instant. The first
    /// fork freezes the base and switches KVM's dirty log on; neither VM sees
    /// the other's later writes. The child is built, not started.
    pub fn fork(&self, child_id: &str, opts: &VmOptions) -> Result<Self, VmError> {
        if !matches!(self.state(), VmState::Paused | VmState::Created) {
            return Err(self.state_error("fork"));
        }
        // Refusals first, before the first fork freezes anything: the
        // config's, then each device's own.
        if let Some(i) = self.config.devices.nics.iter().position(|n| n.datapath.is_some()) {
            return Err(VmError::Refused(format!(
                "vm {} cannot be forked: its nic {i} is attached through the datapath, and a child would need its own pod network",
                self.id
            )));
        }
        for d in &self.virtio {
            let dev = d.lock().unwrap_or_else(|p| p.into_inner());
            dev.can_fork()
                .map_err(|e| VmError::Refused(format!("vm {} cannot be forked: {e}", self.id)))?;
        }
        if self.ram.is_frozen() {
            self.ram_writers.harvest_into(&self.ram);
            self.ram.harvest(&self.vm_fd)?;
        } else {
            // Dirty log on before the freeze, both while nothing runs: no
            // write can fall between them. What the devices wrote before the
            // freeze is in the base: their bitmaps start empty.
            self.ram_writers.start(&self.id, &self.virtio)?;
            self.ram.set_dirty_log(&self.vm_fd, true)?;
            self.ram.freeze()?;
            self.ram_writers.clear();
            self.ram.harvest(&self.vm_fd)?;
        }
        let state = self.save_state()?;
        // Each device hands over what its twin in the child takes (blk: a
        // copy-on-write view of its disk as of now), in bus order.
        let mut backends = VecDeque::with_capacity(self.virtio.len());
        for d in &self.virtio {
            let mut dev = d.lock().unwrap_or_else(|p| p.into_inner());
            backends.push_back(
                dev.fork_backend()
                    .map_err(|e| VmError::DeviceState(format!("vm {} could not be forked: {e}", self.id)))?,
            );
        }
        let mut config = self.config.clone();
        config.id = Some(child_id.to_string());
        // Own taps (named after the child), same MACs: the guest's driver
        // already holds the MAC.
        pin_macs(&mut config, &self.id);
        for n in &mut config.devices.nics {
            n.tap = None;
        }
        Self::build_with_disks(
            child_id,
            &config,
            opts,
            Some((&state, RamSource::ChildOf(&self.ram))),
            Some(backends),
        )
    }

    /// This VM's RAM (fork tests compare children with their source).
    pub fn ram(&self) -> &GuestRam {
        &self.ram
    }

    fn build(
        id: &str,
        config: &VmConfig,
        opts: &VmOptions,
        restore: Option<(&MachineState, RamSource<'_>)>,
    ) -> Result<Self, VmError> {
        Self::build_with_disks(id, config, opts, restore, None)
    }

    /// As `build`; `fork_backends` (a fork child) are the source devices'
    /// backends, in bus order (a disk's copy-on-write view instead of
    /// opening the config's path).
    fn build_with_disks(
        id: &str,
        config: &VmConfig,
        opts: &VmOptions,
        restore: Option<(&MachineState, RamSource<'_>)>,
        fork_backends: Option<VecDeque<ForkBackend>>,
    ) -> Result<Self, VmError> {
        let created = Instant::now();
        let mut clock = StepClock::new();
        let (state, ram_source) = match restore {
            Some((st, src)) => (Some(st), Some(src)),
            None => (None, None),
        };
        // Every guest-file error comes before any KVM object exists. A
        // restored or forked guest's RAM already holds its image: the files
        // are not opened again (they may be gone or changed).
        let image = match (&config.guest, &ram_source) {
            (_, Some(_)) => None,
            (GuestSpec::Linux { kernel, .. }, None) => {
                arch::probe_kernel(kernel)?;
                None
            }
            (other, None) => Some(load_image(other)?),
        };
        clock.done("guest files checked");
        // The vCPU threads confine themselves while the machine is built.
        let control = Arc::new(VmControl::new(id));
        let standby = super::standby::Standby::spawn(u32::from(config.vcpus), &control)
            .map_err(io("cannot spawn the vCPU threads"))?;
        clock.done("vCPU threads spawned");
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let vm_fd = Arc::new(kvm.create_vm().map_err(|e| VmError::Kvm("KVM_CREATE_VM", e))?);
        if let Err(e) = vm_fd.set_tss_address(TSS_ADDR) {
            tracing::debug!(error = %e, "KVM_SET_TSS_ADDR refused (not needed on this host)");
        }
        // Memslots before the irqchip: once KVM has a memslot of its own (the
        // irqchip adds one), every new slot waits for an SRCU grace period,
        // ~7 ms on these hosts (see CHALLENGES.md).
        let (ram, dirty_log) = match ram_source {
            None => (GuestRam::new(id, config.memory_bytes())?, false),
            Some(RamSource::Ready(ram)) => (ram, false),
            Some(RamSource::ChildOf(parent)) => {
                let ram = GuestRam::new_child(parent)?;
                ram.copy_diverged_from(parent, &parent.diverged_pages())?;
                // A child can be forked in turn: it tracks its own writes.
                (ram, true)
            }
        };
        clock.done("KVM VM and guest RAM");
        ram.register(&vm_fd, dirty_log)?;
        clock.done("memslot");
        let is_linux = matches!(config.guest, GuestSpec::Linux { .. });
        // A restored guest's RAM already holds its kernel, tables and state.
        let linux = match (&config.guest, state) {
            (
                GuestSpec::Linux {
                    kernel,
                    initrd,
                    cmdline,
                },
                None,
            ) => {
                let cmdline = cmdline.clone().unwrap_or_else(|| arch::default_cmdline(true));
                Some(arch::configure_linux(
                    ram.memory(),
                    &arch::LinuxBootConfig {
                        kernel,
                        initrd: initrd.as_deref(),
                        cmdline: &cmdline,
                        vcpus: u32::from(config.vcpus),
                        pci: Some(arch::PciConfig {
                            ecam: true,
                            mmio64: None,
                        }),
                        irq0_override: false,
                    },
                )?)
            }
            _ => None,
        };
        if linux.is_some() {
            clock.done("Linux loaded (kernel, initrd, boot params, e820, ACPI, page tables)");
        }
        vm_fd
            .create_irq_chip()
            .map_err(|e| VmError::Kvm("KVM_CREATE_IRQCHIP", e))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm_fd.create_pit2(pit).map_err(|e| VmError::Kvm("KVM_CREATE_PIT2", e))?;
        if let Some(st) = state {
            persist::restore_vm(&vm_fd, &st.vm)?;
        }
        clock.done("irqchip and PIT");

        let serial_state = state.map(|st| &st.serial);
        let mut net_cleanups = Vec::new();
        let mut virtio = Vec::new();
        let mut disks = Vec::new();
        let (mut buses, mut devices, serial) =
            build_devices(id, &vm_fd, &control, opts, config.serial.console, serial_state)?;
        // The real-mode test guests get the PCI platform only when a host
        // test attaches devices to play their driver (the config refuses
        // devices on them for users).
        if is_linux || config.devices.any() {
            let out = Wiring {
                buses: &mut buses,
                devices: &mut devices,
                net_cleanups: &mut net_cleanups,
                virtio: &mut virtio,
                disks: &mut disks,
            };
            add_linux_platform(&vm_fd, &ram, &control, config, opts, out, fork_backends)?;
        }
        clock.done("devices");

        let n = u32::from(config.vcpus);
        let mut pending = Vec::with_capacity(config.vcpus.into());
        for i in 0..n {
            let v = vm_fd.create_vcpu(i.into()).map_err(|source| VcpuSetupError {
                index: i,
                what: "KVM_CREATE_VCPU",
                source,
            })?;
            match (&linux, state) {
                (_, Some(st)) => persist::restore_vcpu(&v, i, &st.vcpus[i as usize])?,
                (Some(entry), None) => arch::setup_linux_vcpu(&kvm, &v, i, n, entry)?,
                (None, None) => {
                    let cpuid = vcpu::cpuid_for(&kvm, i)?;
                    v.set_cpuid2(&cpuid).map_err(|source| VcpuSetupError {
                        index: i,
                        what: "KVM_SET_CPUID2",
                        source,
                    })?;
                    if i == 0 {
                        vcpu::setup_real_mode(&v, i, k7d_guest::LOAD_ADDR, BSP_STACK)?;
                    } else {
                        // APs wait in KVM for INIT/SIPI from the guest's BSP.
                        vcpu::setup_lint(&v, i)?;
                    }
                }
            }
            pending.push(Arc::new(Mutex::new(v)));
        }
        clock.done("vCPUs");
        if let Some(st) = state {
            // After the vCPUs: a restored device may signal at once, and an
            // interrupt needs the restored LAPICs to land in.
            restore_virtio(id, &virtio, &st.virtio)?;
            clock.done("devices restored");
        }
        if let (Some(image), None) = (image, state) {
            let tsc_khz = vcpu::lock_vcpu(&pending[0]).get_tsc_khz().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "KVM_GET_TSC_KHZ failed; assuming 1 GHz for the guest parameter block");
                1_000_000
            });
            write_guest(ram.memory(), &image, tsc_khz, config.guest.args())?;
            clock.done("guest image");
        }
        tracing::debug!(vm = id, elapsed_us = created.elapsed().as_micros() as u64, "vm built");
        let vcpu_diag: Arc<[vcpu::VcpuDiag]> = (0..config.vcpus).map(|_| vcpu::VcpuDiag::default()).collect();
        let serial_probe = serial.lock().unwrap_or_else(|p| p.into_inner()).probe();
        let diag = crate::diag::register(crate::diag::VmProbe {
            id: id.to_string(),
            control: control.clone(),
            vcpus: vcpu_diag.clone(),
            serial: Arc::downgrade(&serial),
            serial_probe,
            virtio: virtio.iter().map(Arc::downgrade).collect(),
        });
        Ok(Self {
            _diag: diag,
            vcpu_diag,
            id: id.to_string(),
            config: config.clone(),
            control,
            standby: Some(standby),
            threads: Vec::new(),
            vcpus: pending,
            buses: Arc::new(buses),
            serial,
            _net_cleanups: net_cleanups,
            devices,
            virtio,
            ram_writers: RamWriters::default(),
            disks,
            vm_fd,
            ram,
            created,
            build_steps: clock.steps,
            started: None,
        })
    }

    /// The VM's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The config it was built from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The devices as wired.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// The control block (stop callback, first-exit time).
    pub fn control(&self) -> &Arc<VmControl> {
        &self.control
    }

    /// Guest memory (reads and writes through vm-memory).
    pub fn memory(&self) -> &GuestMemoryMmap {
        self.ram.memory()
    }

    /// The memfd holding guest RAM.
    pub fn memfd(&self) -> &File {
        self.ram.memfd()
    }

    /// A guest MMIO write, as a vCPU's MMIO exit makes it (host tests play
    /// guest drivers with it). Returns whether a device took it.
    pub fn mmio_write(&self, addr: u64, data: &[u8]) -> bool {
        self.buses.mmio.write(addr, data)
    }

    /// A guest MMIO read, as a vCPU's MMIO exit makes it.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) -> bool {
        self.buses.mmio.read(addr, data)
    }

    /// The virtio functions in bus order: device name and BAR 0 address.
    pub fn virtio_functions(&self) -> Vec<(&'static str, u64)> {
        self.virtio
            .iter()
            .map(|d| {
                let d = d.lock().unwrap_or_else(|p| p.into_inner());
                (d.device_name(), d.config().bar_address(0))
            })
            .collect()
    }

    /// The KVM VM fd.
    pub fn vm_fd(&self) -> &VmFd {
        &self.vm_fd
    }

    /// When `new` began.
    pub fn created_at(&self) -> Instant {
        self.created
    }

    /// The steps of this VM's build and how long each took.
    pub fn build_steps(&self) -> &[(&'static str, Duration)] {
        &self.build_steps
    }

    /// When `start` ran.
    pub fn started_at(&self) -> Option<Instant> {
        self.started
    }

    /// The current state.
    pub fn state(&self) -> VmState {
        if let Some(reason) = self.control.stopped() {
            return VmState::Stopped { reason };
        }
        if self.started.is_none() {
            VmState::Created
        } else if self.control.is_paused() {
            VmState::Paused
        } else {
            VmState::Running
        }
    }

    /// Spawns one thread per vCPU.
    pub fn start(&mut self) -> Result<(), VmError> {
        if self.started.is_some() {
            return Err(self.state_error("start"));
        }
        crate::sys::install_kick_handler().map_err(io("cannot install the vCPU kick signal handler"))?;
        // No guest code before every seccomp filter is in place.
        crate::seccomp::ready().map_err(|source| VmError::Confine {
            id: self.id.clone(),
            source,
        })?;
        // Device workers spawned from here on work for this VM (their
        // seccomp reports name it).
        let _scope = crate::seccomp::vm_scope(&self.control);
        // Restored devices go live first: the vCPUs find them as they were.
        // If one cannot, the ones already started are stopped again and the
        // VM is done for (its devices no longer match its RAM).
        for (i, d) in self.virtio.iter().enumerate() {
            let mut dev = d.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = dev.start_restored() {
                drop(dev);
                for done in &self.virtio[..i] {
                    done.lock().unwrap_or_else(|p| p.into_inner()).reset_device();
                }
                self.started = Some(Instant::now());
                self.control.set_threads(0);
                self.control.request_stop(StopReason::Requested);
                return Err(VmError::DeviceState(format!("vm {} cannot start: {e}", self.id)));
            }
        }
        let Some(standby) = self.standby.take() else {
            return Err(self.state_error("start"));
        };
        let n = self.vcpus.len();
        self.control.set_threads(n);
        self.started = Some(Instant::now());
        let jobs = self
            .vcpus
            .iter()
            .map(|v| super::standby::Job {
                vcpu: v.clone(),
                control: self.control.clone(),
                buses: self.buses.clone(),
                diags: self.vcpu_diag.clone(),
            })
            .collect();
        let (handles, failed) = standby.start(jobs);
        for h in handles {
            use std::os::unix::thread::JoinHandleExt;
            self.control.add_thread(h.as_pthread_t());
            self.threads.push(h);
        }
        if let Some(i) = failed {
            // Roll back: the threads already running leave, and the ones
            // that never ran count as gone.
            for _ in i..n {
                self.control.vcpu_exited();
            }
            self.control.request_stop(StopReason::Requested);
            self.join();
            return Err(VmError::Io {
                what: format!("cannot start the thread of vCPU {i}"),
                source: std::io::Error::other("it ended before it was handed its vCPU"),
            });
        }
        Ok(())
    }

    fn state_error(&self, op: &'static str) -> VmError {
        VmError::State {
            id: self.id.clone(),
            state: self.state().to_string(),
            op,
        }
    }

    /// Parks every vCPU; returns when none runs guest code.
    pub fn pause(&self, timeout: Duration) -> Result<(), VmError> {
        if self.started.is_none() || self.control.stopped().is_some() {
            return Err(self.state_error("pause"));
        }
        self.control.pause(timeout).map_err(|source| VmError::Control {
            id: self.id.clone(),
            source,
        })?;
        // vCPUs parked: no guest access can race the devices' pause. Each
        // device drains what it is serving and parks; then nothing writes
        // guest RAM. A device that cannot pause undoes the whole pause.
        for (i, d) in self.virtio.iter().enumerate() {
            let mut dev = d.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = dev.pause() {
                let name = dev.device_name();
                drop(dev);
                for done in self.virtio[..i].iter().rev() {
                    if let Err(e) = done.lock().unwrap_or_else(|p| p.into_inner()).resume() {
                        tracing::error!(vm = %self.id, error = %e, "resuming a device after a failed pause failed");
                    }
                }
                let _ = self.control.resume();
                return Err(VmError::DeviceState(format!(
                    "the {name} device could not pause, so vm {} keeps running: {e}",
                    self.id
                )));
            }
        }
        Ok(())
    }

    /// Restarts the devices, then unparks the vCPUs.
    pub fn resume(&self) -> Result<(), VmError> {
        if self.started.is_none() || self.control.stopped().is_some() {
            return Err(self.state_error("resume"));
        }
        let _scope = crate::seccomp::vm_scope(&self.control);
        for d in &self.virtio {
            let mut dev = d.lock().unwrap_or_else(|p| p.into_inner());
            dev.resume().map_err(|e| {
                VmError::DeviceState(format!(
                    "the {} device of vm {} could not resume, so it stays paused: {e}",
                    dev.device_name(),
                    self.id
                ))
            })?;
        }
        self.control.resume().map_err(|source| VmError::Control {
            id: self.id.clone(),
            source,
        })
    }

    /// The complete machine state; the VM must be paused (or never started).
    pub fn save_state(&self) -> Result<MachineState, VmError> {
        if !matches!(self.state(), VmState::Paused | VmState::Created) {
            return Err(self.state_error("save its state"));
        }
        let kvm = Kvm::new().map_err(VmError::OpenKvm)?;
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        for (i, v) in self.vcpus.iter().enumerate() {
            vcpus.push(persist::save_vcpu(&kvm, &vcpu::lock_vcpu(v), i as u32)?);
        }
        Ok(MachineState {
            version: persist::STATE_VERSION,
            vcpus,
            vm: persist::save_vm(&self.vm_fd)?,
            serial: self.serial.lock().unwrap_or_else(|p| p.into_inner()).snapshot(),
            virtio: self.save_virtio()?,
        })
    }

    /// Every virtio function's state, in bus order (the VM is paused, so
    /// every device is parked).
    fn save_virtio(&self) -> Result<Vec<k7d_devices::virtio::transport::VirtioPciState>, VmError> {
        self.virtio
            .iter()
            .map(|d| {
                let mut dev = d.lock().unwrap_or_else(|p| p.into_inner());
                dev.save_state().map_err(|e| {
                    VmError::DeviceState(format!(
                        "the state of vm {}'s {} device cannot be saved: {e}",
                        self.id,
                        dev.device_name()
                    ))
                })
            })
            .collect()
    }

    /// Writes a cold snapshot into `dir`, which must not exist: as
    /// [`Vm::snapshot`] without replacing.
    pub fn snapshot_to(&self, dir: &Path) -> Result<(), VmError> {
        self.snapshot(dir, false)
    }

    /// Writes a cold snapshot of this paused VM into the directory `dir` (an
    /// absolute path whose parent exists; see `docs/snapshots.md`):
    /// `manifest.json` (format version, config, each file's size and
    /// checksums), `state.json` (machine state) and `memory` (guest RAM,
    /// sparse: only the pages the guest populated are read and written). It
    /// is written beside `dir` and renamed into place, so `dir` is at every
    /// instant absent, the old snapshot or the new one. An existing `dir` is
    /// refused and left untouched unless `replace` is set and it is a
    /// snapshot: then it is exchanged atomically with the new one and
    /// removed.
    pub fn snapshot(&self, dir: &Path, replace: bool) -> Result<(), VmError> {
        if let Some(i) = self.disks.iter().position(|d| d.is_frozen()) {
            return Err(VmError::Refused(format!(
                "vm {} cannot be snapshotted: its disk {i} is a copy-on-write view since a fork, and a snapshot would not carry what it wrote",
                self.id
            )));
        }
        let state = self.save_state()?;
        if self.ram.is_frozen() {
            // Since a fork this VM's own pages are private copies over the
            // frozen base; the writer reads them from the diverged set, so
            // bring it up to date (the VM is paused: nothing writes).
            self.ram_writers.harvest_into(&self.ram);
            self.ram.harvest(&self.vm_fd)?;
        }
        let mut config = self.config.clone();
        pin_macs(&mut config, &self.id);
        snapshot::write(dir, replace, &config, &state, &self.ram).map_err(|e| match e {
            snapshot::SnapshotError::Refused(msg) => VmError::Refused(msg),
            io => snapshot_io(io),
        })
    }

    /// Builds a VM from a snapshot directory written by [`Vm::snapshot`]
    /// (an absolute path), with the config it was saved with (its id
    /// replaced by `id`). Everything is verified before any KVM object
    /// exists: the format version, the manifest's checksum, the config
    /// (create's validation), each file's kind and size, and every chunk's
    /// checksum, the memory file's as it is copied into the new memfd.
    pub fn restore_from(id: &str, dir: &Path, opts: &VmOptions) -> Result<Self, VmError> {
        let snap = snapshot::open(dir, id).map_err(PersistError::from)?;
        let ram = GuestRam::new(id, snap.config.memory_bytes())?;
        snap.copy_memory_into(&ram).map_err(PersistError::from)?;
        Self::build(id, &snap.config, opts, Some((&snap.state, RamSource::Ready(ram))))
    }

    /// Stops the vCPUs (if running) and joins their threads.
    pub fn stop(&mut self) -> StopReason {
        if self.started.is_none() {
            // Never ran: there is nothing to stop, but the VM is done for.
            self.started = Some(Instant::now());
            self.control.set_threads(0);
            return StopReason::Requested;
        }
        self.control.request_stop(StopReason::Requested);
        self.join();
        self.control.stopped().unwrap_or(StopReason::Requested)
    }

    /// Waits up to `timeout` for the guest to stop on its own.
    pub fn wait(&self, timeout: Duration) -> Option<StopReason> {
        self.started?;
        self.control.wait_stopped(timeout)
    }

    fn join(&mut self) {
        // Keep kicking: a thread may not have registered its kick target yet
        // when the first signal came.
        while self.control.wait_stopped(Duration::from_millis(20)).is_none() {
            if self.threads.iter().all(|t| t.is_finished()) {
                break;
            }
            self.control.request_stop(StopReason::Requested);
        }
        self.control.clear_threads();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                tracing::error!(vm = %self.id, "a vCPU thread panicked");
            }
        }
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if !self.threads.is_empty() {
            self.control.request_stop(StopReason::Requested);
            self.join();
        }
    }
}

fn load_image(spec: &GuestSpec) -> Result<Vec<u8>, VmError> {
    match spec {
        GuestSpec::Builtin { name, .. } => k7d_guest::Builtin::from_name(name)
            .map(|b| b.image().to_vec())
            .map_err(|e| VmError::Guest(e.to_string())),
        GuestSpec::Raw { path, .. } => {
            let img = read_regular_file(path, crate::config::MAX_RAW_IMAGE)
                .map_err(io(format!("cannot read guest image {}", path.display())))?;
            if img.is_empty() || img.len() as u64 > crate::config::MAX_RAW_IMAGE {
                return Err(VmError::Guest(format!(
                    "{} is {} bytes, a real-mode image must be 1 to {} bytes",
                    path.display(),
                    img.len(),
                    crate::config::MAX_RAW_IMAGE
                )));
            }
            Ok(img)
        }
        GuestSpec::Linux { kernel, .. } => Err(VmError::Guest(format!(
            "{} is a Linux kernel, not a real-mode image",
            kernel.display()
        ))),
    }
}

fn write_guest(mem: &GuestMemoryMmap, image: &[u8], tsc_khz: u32, args: &[u32]) -> Result<(), VmError> {
    let w = |what: &str, r: Result<(), vm_memory::GuestMemoryError>| {
        r.map_err(|e| VmError::Guest(format!("writing the {what} into guest RAM failed: {e}")))
    };
    w("image", mem.write_slice(image, GuestAddress(k7d_guest::LOAD_ADDR)))?;
    let p = k7d_guest::PARAMS_ADDR;
    w(
        "parameters",
        mem.write_obj(tsc_khz, GuestAddress(p + k7d_guest::param::TSC_PER_MS)),
    )?;
    let slots = [k7d_guest::param::ARG0, k7d_guest::param::ARG1, k7d_guest::param::ARG2];
    for (slot, a) in slots.iter().zip(args) {
        w("arguments", mem.write_obj(*a, GuestAddress(p + slot)))?;
    }
    Ok(())
}

fn shared<D: BusDevice + 'static>(d: D) -> SharedDevice {
    Arc::new(Mutex::new(d))
}

/// The buses, the device list for `info`, and the serial port (for snapshots).
type BuiltDevices = (Buses, Vec<DeviceInfo>, Arc<Mutex<Serial>>);

fn build_devices(
    id: &str,
    vm_fd: &Arc<VmFd>,
    control: &Arc<VmControl>,
    opts: &VmOptions,
    console: bool,
    serial_state: Option<&k7d_devices::legacy::SerialSnapshot>,
) -> Result<BuiltDevices, VmError> {
    let mut buses = Buses::default();
    let mut info = Vec::new();

    let log = match &opts.serial_log {
        Some(p) => Some(open_log(p)?),
        None => None,
    };
    let evt = EventFd::new(EFD_NONBLOCK).map_err(io("cannot create the serial interrupt eventfd"))?;
    vm_fd
        .register_irqfd(&evt, SERIAL_IRQ)
        .map_err(|e| VmError::Kvm("KVM_IRQFD (serial)", e))?;
    let out = SerialOutput::new(log, console);
    let serial = match serial_state {
        Some(st) => Serial::from_snapshot(st, IrqLine::new(evt), out)
            .map_err(|msg| VmError::Persist(PersistError::Mismatch(msg)))?,
        None => Serial::new(IrqLine::new(evt), out),
    };
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
    Ok((buses, info, serial))
}

/// The platform a Linux guest needs besides the legacy devices: the ACPI PM
/// block (poweroff), the PCI root (CF8/CFC and ECAM) and the PCI devices.
fn add_linux_platform(
    vm_fd: &Arc<VmFd>,
    ram: &GuestRam,
    control: &Arc<VmControl>,
    config: &VmConfig,
    opts: &VmOptions,
    out: Wiring<'_>,
    fork_backends: Option<VecDeque<ForkBackend>>,
) -> Result<(), VmError> {
    let Wiring {
        buses,
        devices,
        net_cleanups,
        virtio,
        disks,
    } = out;
    use k7d_devices::pci::{
        BarAllocator, ECAM_BUS_SIZE, PCI_CONFIG_IO_LEN, PCI_CONFIG_IO_PORT, PciConfigIo, PciConfigMmio, PciRoot,
    };
    let dev_err = |what: &'static str| {
        move |e: &dyn std::fmt::Display| VmError::Device {
            what,
            msg: e.to_string(),
        }
    };

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

    let alloc = BarAllocator::new(arch::layout::PCI_MMIO32_START, arch::layout::PCI_MMIO32_SIZE)
        .map_err(|e| dev_err("PCI root")(&e))?;
    let mut root = PciRoot::new(alloc, None);
    let routing = Arc::new(GsiRouting::new(vm_fd.clone()));
    let mem = Arc::new(ram.memory().clone());
    let id = control.vm_id().to_string();
    let mut pci = PciCtx {
        vm_fd,
        root: &mut root,
        routing: &routing,
        buses,
        devices,
        virtio,
    };
    // A fork child's devices take their source's backends in bus order
    // (the order of the `pci.add` calls below).
    let mut fork_backends = fork_backends;
    let mut from_source = |what: &'static str| -> Result<Option<ForkBackend>, VmError> {
        match fork_backends.as_mut() {
            None => Ok(None),
            Some(b) => b.pop_front().map(Some).ok_or_else(|| VmError::Device {
                what,
                msg: "the fork source has fewer devices than the child".into(),
            }),
        }
    };
    if config.devices.rng {
        from_source("virtio-rng")?;
        let rng = k7d_devices::virtio::rng::Rng::new().map_err(|e| dev_err("virtio-rng")(&e))?;
        pci.add("virtio-rng", Box::new(rng), mem.clone(), String::new())?;
    }
    for (i, d) in config.devices.disks.iter().enumerate() {
        let disk = match from_source("virtio-blk")? {
            Some(b) => b
                .take::<k7d_devices::virtio::block::DiskImage>()
                .ok_or_else(|| VmError::Device {
                    what: "virtio-blk",
                    msg: format!("disk {i} has no copy-on-write view from the fork source"),
                })?,
            None => k7d_devices::virtio::block::DiskImage::open(&d.path, d.read_only)
                .map_err(|e| dev_err("virtio-blk")(&e))?,
        };
        let serial = format!("k7d-disk{i}");
        let mut blk = k7d_devices::virtio::block::Block::new(disk, &serial).map_err(|e| dev_err("virtio-blk")(&e))?;
        disks.push(blk.disk().clone());
        // SAFETY: the view maps the VM's own RAM; the device (inside the
        // buses) is dropped before `ram` (see `Vm`'s field order), and no
        // device outlives its VM.
        let view =
            unsafe { k7d_devices::virtio::block::DeviceMemory::new(&mem) }.map_err(|e| dev_err("virtio-blk")(&e))?;
        blk.track_writes(view.clone());
        let detail = format!(
            "{} ({}), serial {serial}, own dirty bitmap",
            d.path.display(),
            if d.read_only { "read-only" } else { "read-write" }
        );
        pci.add("virtio-blk", Box::new(blk), view.handle(), detail)?;
    }
    if !config.devices.nics.is_empty() {
        let node = opts.node.net().map_err(|e| dev_err("virtio-net")(&e))?;
        let mut nl = k7d_net::netlink::Netlink::open().map_err(|e| dev_err("virtio-net")(&e))?;
        for (i, n) in config.devices.nics.iter().enumerate() {
            let idx = i as u16;
            let req = k7d_net::policy::NicNetRequest {
                vhost: n.vhost,
                queues: n.queues,
            };
            let would_vhost = n.vhost.unwrap_or(node.vhost_default());
            let avail = if would_vhost {
                k7d_net::policy::VhostAvailability::probe(Path::new(k7d_net::policy::VHOST_NET_PATH))
            } else {
                k7d_net::policy::VhostAvailability::Unavailable("not probed".into())
            };
            let mut plane = k7d_net::policy::effective_data_plane(&node, &req, u16::from(config.vcpus), &avail)
                .map_err(|e| VmError::Device {
                    what: "virtio-net",
                    msg: format!("nic {i}: {e}"),
                })?;
            if let Some(w) = &plane.warning {
                tracing::warn!(vm = %id, nic = i, "{w}");
            }
            if plane.vhost && n.datapath.is_some() {
                // The datapath owns the tap's creation; vhost on such a NIC is
                // not wired yet: settle the plane as if vhost were unavailable
                // (an explicit request fails with that reason).
                let why = k7d_net::policy::VhostAvailability::Unavailable(
                    "NICs attached through the datapath use the userspace data plane for now".into(),
                );
                plane =
                    k7d_net::policy::effective_data_plane(&node, &req, u16::from(config.vcpus), &why).map_err(|e| {
                        VmError::Device {
                            what: "virtio-net",
                            msg: format!("nic {i}: {e}"),
                        }
                    })?;
                if let Some(w) = &plane.warning {
                    tracing::warn!(vm = %id, nic = i, "{w}");
                }
            }
            let mut path_note = String::new();
            let (tap_name, tap) = match &n.datapath {
                None => {
                    let name = n.tap.clone().unwrap_or_else(|| k7d_net::nic_names(&id, idx).tap);
                    let tap = k7d_net::create_tap(&mut nl, &name, plane.queue_pairs.into(), true)
                        .map_err(|e| dev_err("virtio-net")(&e))?;
                    (name, tap)
                }
                Some(d) => {
                    let mode: k7d_net::Mode = d.mode.parse().map_err(|e| dev_err("virtio-net")(&e))?;
                    let dp = k7d_net::Datapath::new(k7d_net::DatapathConfig::default())
                        .map_err(|e| dev_err("datapath")(&e))?;
                    let att = dp
                        .attach(&k7d_net::NicRequest {
                            vm_id: &id,
                            nic_idx: idx,
                            mode,
                            pod_netns: &d.netns,
                            pod_if: &d.pod_if,
                            queues: plane.queue_pairs.into(),
                            vnet_hdr: true,
                            pod_uid: d.pod_uid.as_deref(),
                            unsupported: None,
                        })
                        .map_err(|e| VmError::Device {
                            what: "datapath",
                            msg: format!("nic {i}: {e}"),
                        })?;
                    path_note = format!(
                        ", datapath: {}{}",
                        att.effective_mode,
                        att.reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default()
                    );
                    // Detached (filters, pins, bridge) when the VM goes away.
                    net_cleanups.push(NetCleanup {
                        dp,
                        vm_id: id.clone(),
                        idx,
                        netns: d.netns.clone(),
                        pod_if: d.pod_if.clone(),
                    });
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
            let net = if plane.vhost {
                // The dirty log is switched on by the first fork (logging
                // costs the kernel a bit set per page it writes).
                let opts = k7d_devices::virtio::net::VhostOptions { dirty_log: false };
                match k7d_devices::virtio::net::Net::new_vhost(tap, cfg(plane.queue_pairs), mem.clone(), opts) {
                    Ok(net) => net,
                    Err(e) => {
                        // The failed attempt dropped (and so removed) the tap.
                        // Settle the plane again with vhost unavailable: an
                        // explicit request fails with the reason, a defaulted
                        // NIC falls back to userspace with one warning.
                        let why = k7d_net::policy::VhostAvailability::Unavailable(e.to_string());
                        plane = k7d_net::policy::effective_data_plane(&node, &req, u16::from(config.vcpus), &why)
                            .map_err(|pe| VmError::Device {
                                what: "virtio-net",
                                msg: format!("nic {i}: {pe}"),
                            })?;
                        if let Some(w) = &plane.warning {
                            tracing::warn!(vm = %id, nic = i, "{w}");
                        }
                        let tap = k7d_net::create_tap(&mut nl, &tap_name, plane.queue_pairs.into(), true)
                            .map_err(|e| dev_err("virtio-net")(&e))?;
                        k7d_devices::virtio::net::Net::new(tap, cfg(plane.queue_pairs))
                            .map_err(|e| dev_err("virtio-net")(&e))?
                    }
                }
            } else {
                k7d_devices::virtio::net::Net::new(tap, cfg(plane.queue_pairs))
                    .map_err(|e| dev_err("virtio-net")(&e))?
            };
            let mac_s = mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
            // A child's NIC is built from its config (its own tap).
            from_source("virtio-net")?;
            pci.add(
                "virtio-net",
                Box::new(net),
                mem.clone(),
                format!("tap {tap_name}, {plane}, mac {mac_s}{path_note}"),
            )?;
        }
    }
    if let Some(v) = &config.devices.vsock {
        let dev = k7d_devices::virtio::vsock::Vsock::new(v.cid, &v.uds).map_err(|e| dev_err("virtio-vsock")(&e))?;
        let detail = format!("cid {}, hybrid host socket {}", v.cid, v.uds.display());
        from_source("virtio-vsock")?;
        pci.add("virtio-vsock", Box::new(dev), mem.clone(), detail)?;
    }
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

/// A snapshot file operation's failure as a VM error.
fn snapshot_io(e: snapshot::SnapshotError) -> VmError {
    match e {
        snapshot::SnapshotError::Io { what, source } => VmError::Io { what, source },
        other => VmError::Persist(PersistError::Snapshot(other)),
    }
}

/// Where `add_linux_platform` puts what it builds.
struct Wiring<'a> {
    buses: &'a mut Buses,
    devices: &'a mut Vec<DeviceInfo>,
    net_cleanups: &'a mut Vec<NetCleanup>,
    virtio: &'a mut Vec<VirtioHandle>,
    disks: &'a mut Vec<Arc<k7d_devices::virtio::block::DiskImage>>,
}

/// The records the devices keep of the guest RAM they write beside the VM's
/// own bitmap and KVM's dirty log (`VirtioDevice::ram_write_logs`: blk's
/// own view, vhost's kernel log), collected from every device at the first
/// fork: the one seam through which the fork path learns every writer.
#[derive(Default)]
struct RamWriters {
    logs: Mutex<Vec<Arc<dyn RamWriteLog>>>,
}

impl RamWriters {
    /// Folds what the devices wrote since the last call into `ram`'s
    /// diverged set. Every device is paused.
    fn harvest_into(&self, ram: &GuestRam) {
        let mut pages = Vec::new();
        for log in self.logs.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            log.drain(&mut |gpa| pages.push(gpa.0));
        }
        ram.add_diverged_gpas(pages.into_iter());
    }

    /// Asks every device for its records (first fork, devices paused: a
    /// kernel backend's log starts at resume).
    fn start(&self, id: &str, virtio: &[VirtioHandle]) -> Result<(), VmError> {
        let mut logs = self.logs.lock().unwrap_or_else(|p| p.into_inner());
        for d in virtio {
            let mut dev = d.lock().unwrap_or_else(|p| p.into_inner());
            let more = dev.ram_write_logs().map_err(|e| {
                VmError::Refused(format!(
                    "vm {id} cannot be forked: its {} device cannot record the guest pages it writes: {e}",
                    dev.device_name()
                ))
            })?;
            logs.extend(more);
        }
        Ok(())
    }

    /// Forgets what the devices wrote so far (it is in the frozen base).
    fn clear(&self) {
        for log in self.logs.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            log.drain(&mut |_| {});
        }
    }
}

/// Puts the saved virtio states into a restored VM's functions, in bus order.
fn restore_virtio(
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

/// A virtio-pci function the VM pauses and resumes with its vCPUs.
type VirtioHandle = Arc<Mutex<k7d_devices::virtio::transport::VirtioPciDevice>>;

/// A NIC attached through the datapath, detached when the VM is dropped.
pub(crate) struct NetCleanup {
    dp: k7d_net::Datapath,
    vm_id: String,
    idx: u16,
    netns: PathBuf,
    pod_if: String,
}

impl Drop for NetCleanup {
    fn drop(&mut self) {
        if let Err(e) = self.dp.detach(&self.vm_id, self.idx, Some(&self.netns), &self.pod_if) {
            tracing::error!(vm = %self.vm_id, nic = self.idx, error = %e, "datapath detach failed");
        }
    }
}

/// What wiring a virtio-pci device needs.
struct PciCtx<'a> {
    vm_fd: &'a Arc<VmFd>,
    root: &'a mut k7d_devices::pci::PciRoot,
    routing: &'a Arc<GsiRouting>,
    buses: &'a mut Buses,
    devices: &'a mut Vec<DeviceInfo>,
    virtio: &'a mut Vec<VirtioHandle>,
}

impl PciCtx<'_> {
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
fn pin_macs(config: &mut VmConfig, vm_id: &str) {
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
fn derived_mac(vm_id: &str, idx: u16) -> [u8; 6] {
    let mut h: u32 = 0x811c_9dc5;
    for b in vm_id.bytes().chain(idx.to_le_bytes()) {
        h = (h ^ u32::from(b)).wrapping_mul(0x0100_0193);
    }
    let b = h.to_le_bytes();
    [0x52, 0x54, 0x00, b[0], b[1], b[2]]
}

/// Reads up to `max + 1` bytes of the regular file at `path`. Opened with
/// `O_NONBLOCK`, so a FIFO or a device in the file's place is refused at
/// once instead of blocking the caller (the flag changes nothing for a
/// regular file).
fn read_regular_file(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "it is not a regular file",
        ));
    }
    let mut data = Vec::new();
    f.take(max.saturating_add(1)).read_to_end(&mut data)?;
    Ok(data)
}

fn open_log(p: &Path) -> Result<File, VmError> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(p)
        .map_err(io(format!("cannot open the serial log {}", p.display())))
}
