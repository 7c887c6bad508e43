//! One VM: a KVM VM fd, its memfd RAM, vCPU threads and the device bus.
//!
//! Life: [`Vm::new`] builds everything (KVM VM, in-kernel irqchip + PIT2,
//! memory, vCPUs, devices, guest image) but runs nothing; [`Vm::start`]
//! spawns one thread per vCPU; [`Vm::pause`]/[`Vm::resume`] park and unpark
//! them; [`Vm::stop`] makes them leave and joins them. Dropping a `Vm` stops it
//! and releases every fd, mapping and thread it created.

use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use k7d_devices::legacy::Serial;
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use super::builder::BuildSteps;
use super::control::{ControlError, StopReason, VmControl};
use super::device_manager::{NetCleanup, VirtioHandle};
use super::fork::RamWriters;
use super::memory::{GuestMemoryMmap, GuestRam, MemoryError};
use super::persist::{self, MachineState, PersistError};
use super::vcpu::{self, Buses, VcpuSetupError};
use crate::arch::x86_64 as arch;
use crate::config::VmConfig;

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

pub(super) fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmError {
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

/// Host-side options that are not part of the guest-visible config.
#[derive(Debug, Clone, Default)]
pub struct VmOptions {
    /// Append the guest's serial output to this file.
    pub serial_log: Option<PathBuf>,
    /// Node-wide settings (network queue/vhost policy).
    pub node: crate::config::NodeConfig,
    /// Where LZ4 bzImages are unpacked once and cached
    /// (`arch::x86_64::unpack`); `None` boots them through their own
    /// decompressor.
    pub kernel_cache: Option<PathBuf>,
    /// Where the VM's host files come from: opened by path, or handed over
    /// to a VM process ([`super::handed`]).
    pub files: super::handed::HostFiles,
}

/// A VM.
pub struct Vm {
    // Drop order matters: threads are joined in `Drop::drop`, then the VM
    // leaves the state dump, then the vCPU fds, the buses, the VM fd, and
    // only then the memory KVM maps.
    pub(super) _diag: crate::diag::Registration,
    pub(super) vcpu_diag: Arc<[vcpu::VcpuDiag]>,
    pub(super) id: String,
    pub(super) config: VmConfig,
    pub(super) control: Arc<VmControl>,
    /// The vCPU threads until `start` hands them their vCPUs.
    pub(super) standby: Option<super::standby::Standby>,
    pub(super) threads: Vec<JoinHandle<()>>,
    pub(super) vcpus: Vec<vcpu::SharedVcpu>,
    pub(super) buses: Arc<Buses>,
    pub(super) serial: Arc<Mutex<Serial>>,
    /// After the buses (the taps are closed first), before the VM fd.
    pub(super) net_cleanups: Vec<NetCleanup>,
    pub(super) devices: Vec<DeviceInfo>,
    /// The virtio functions (also on the buses): paused with the vCPUs.
    pub(super) virtio: Vec<VirtioHandle>,
    /// Writers of guest RAM the fork path must account for besides KVM's
    /// dirty log and the VM's own bitmap (see `docs/fork.md`); before `ram`.
    pub(super) ram_writers: RamWriters,
    /// Every disk, in config order (a snapshot refuses copy-on-write ones).
    pub(super) disks: Vec<Arc<k7d_devices::virtio::block::DiskImage>>,
    pub(super) vm_fd: Arc<VmFd>,
    pub(super) ram: GuestRam,
    pub(super) created: Instant,
    /// How long each step of the build took (`build_steps`).
    pub(super) build_steps: BuildSteps,
    /// Built in a shell made ahead.
    pub(super) in_shell: bool,
    pub(super) started: Option<Instant>,
    /// Successful pauses so far (a cluster fork pauses each member once).
    pub(super) pauses: std::sync::atomic::AtomicU64,
    /// Re-bases so far (`Vm::rebase`).
    pub(super) rebases: std::sync::atomic::AtomicU64,
    /// Whether this VM has been a fork source (captured: `Vm::capture`).
    pub(super) forked: std::sync::atomic::AtomicBool,
    /// The VM Generation ID k7d gave it last (`None`: no such device).
    pub(super) generation_id: Option<crate::arch::x86_64::vmgenid::GenerationId>,
    /// Whether a fork of it was already warned that its children's kernel
    /// RNGs are not reseeded (once per source).
    pub(super) rng_warned: std::sync::atomic::AtomicBool,
}

/// How a VM's fork children (and its restores) come to draw random numbers
/// of their own (`docs/fork.md`, "What a child shares").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RngReseed {
    /// The guest's vmgenid driver reads the VM Generation ID: its kernel
    /// reseeds its RNG as a child or a restored VM first runs.
    Vmgenid,
    /// The VM has the device, but its guest has not bound a driver for it
    /// (not yet, or its kernel has none: Debian's cloud kernel).
    NoDriver,
    /// The VM has no VM Generation ID device.
    Off,
    /// Its guest has no vmgenid driver but k7d-agent answers in it: the
    /// daemon reseeds a fork child's or a restored VM's kernel RNG through
    /// the agent before it answers (the daemon's word, never a VM's own).
    Agent,
}

impl RngReseed {
    /// What it means for the VM's fork children, in one sentence.
    pub fn describe(self) -> &'static str {
        match self {
            RngReseed::Vmgenid => {
                "vmgenid: a fork child's or a restored guest's kernel reseeds its RNG before it runs on"
            }
            RngReseed::NoDriver => {
                "none: the guest has no vmgenid driver bound, so fork children draw the same random numbers until their kernels reseed on their own"
            }
            RngReseed::Off => {
                "none: the VM has no VM Generation ID device, so fork children draw the same random numbers until their kernels reseed on their own"
            }
            RngReseed::Agent => {
                "agent: k7d-agent in the guest reseeds a fork child's or a restored VM's kernel RNG with host entropy before the fork or restore answers"
            }
        }
    }
}

impl Vm {
    /// How many times this VM was paused (successfully) since it was built.
    pub fn pauses(&self) -> u64 {
        self.pauses.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether this VM has been a fork source (a fork child has not, until
    /// it is forked in turn).
    pub fn has_been_forked(&self) -> bool {
        self.forked.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What the copy-on-write disk overlays of this VM's live fork children
    /// hold now (their disk budget's use; 0 without a budget).
    pub fn children_disk_bytes(&self) -> u64 {
        self.disks.iter().find_map(|d| d.children_budget_used()).unwrap_or(0)
    }

    /// Each virtio device's counters (`VirtioDevice::counters`), named by
    /// kind and index among its kind (`net0`, `net1`, ...); devices with
    /// none left out.
    pub fn device_counters(&self) -> Vec<(String, Vec<(String, u64)>)> {
        let mut seen: Vec<&'static str> = Vec::new();
        let mut out = Vec::new();
        for d in &self.virtio {
            let d = d.lock().unwrap_or_else(|p| p.into_inner());
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

    /// vCPU exits to the VMM so far, all vCPUs, by kind (`ExitKind::words`'
    /// name); kinds with none left out.
    pub fn exits_by_reason(&self) -> Vec<(String, u64)> {
        let mut sum = [0u64; vcpu::ExitKind::COUNT];
        for d in self.vcpu_diag.iter() {
            for (s, n) in sum.iter_mut().zip(d.exits_by_kind()) {
                *s += n;
            }
        }
        vcpu::ExitKind::ALL
            .iter()
            .zip(sum)
            .filter(|(_, n)| *n > 0)
            .map(|(k, n)| (k.words().0.to_string(), n))
            .collect()
    }

    /// Re-bases so far (on request or by the daemon's threshold).
    pub fn rebases(&self) -> u64 {
        self.rebases.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The VM Generation ID k7d gave this VM last (at boot, or fresh for a
    /// fork child or a restore); `None` without the device.
    pub fn generation_id(&self) -> Option<crate::arch::x86_64::vmgenid::GenerationId> {
        self.generation_id
    }

    /// How this VM's fork children come to draw their own random numbers.
    pub fn rng_reseed(&self) -> RngReseed {
        match self.generation_id {
            None => RngReseed::Off,
            Some(_) if crate::arch::x86_64::vmgenid::driver_bound(self.ram.memory()) => RngReseed::Vmgenid,
            Some(_) => RngReseed::NoDriver,
        }
    }

    /// True the first time it is asked for a VM whose children are not
    /// reseeded ([`Vm::rng_reseed`] other than `Vmgenid`): the fork that
    /// asks warns once per source.
    pub fn first_unreseeded_fork(&self) -> bool {
        self.rng_reseed() != RngReseed::Vmgenid && !self.rng_warned.swap(true, std::sync::atomic::Ordering::Relaxed)
    }

    /// This VM's RAM (fork tests compare children with their source).
    pub fn ram(&self) -> &GuestRam {
        &self.ram
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

    /// The memfd holding guest RAM (after a fork: the base this VM's
    /// private mapping is over).
    pub fn memfd(&self) -> Arc<File> {
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

    /// Whether this VM was built in a shell made ahead (`vstate/shell.rs`).
    pub fn built_in_shell(&self) -> bool {
        self.in_shell
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

    pub(super) fn state_error(&self, op: &'static str) -> VmError {
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
        if let Err(source) = self.control.pause(timeout) {
            // A pause that timed out leaves no vCPU parking behind it: the
            // VM runs on, as it did before the pause was asked for.
            if !matches!(source, super::control::ControlError::Stopped) {
                let _ = self.control.resume();
            }
            return Err(VmError::Control {
                id: self.id.clone(),
                source,
            });
        }
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
        self.pauses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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

    /// Puts the read-only image at `path` (or, with `None`, no medium) into
    /// drive `index` of a running VM, as a disc into a drive: the
    /// guest's driver gets a configuration-change interrupt and re-reads the
    /// capacity. The config records it, so a snapshot reopens it and a fork
    /// child shares it. A refusal leaves the drive as it was; a worker that
    /// cannot restart after the swap is an error with the change recorded.
    pub fn change_medium(&mut self, index: usize, path: Option<&std::path::Path>) -> Result<(), VmError> {
        self.change_medium_to(index, path, None)
    }

    /// [`Vm::change_medium`] with `path` opened (read-only) by the caller
    /// and handed over as `opened` (a VM process's daemon opens it: the
    /// process may open nothing).
    pub fn change_medium_to(
        &mut self,
        index: usize,
        path: Option<&std::path::Path>,
        opened: Option<std::fs::File>,
    ) -> Result<(), VmError> {
        let id = self.id.clone();
        let Some(disk) = self.config.devices.disks.get(index) else {
            return Err(VmError::Refused(format!(
                "vm {id} has {} disks, so it has no disk {index}",
                self.config.devices.disks.len()
            )));
        };
        if !disk.read_only {
            return Err(VmError::Refused(format!(
                "disk {index} of vm {id} is read-write; only a read-only drive takes another medium"
            )));
        }
        // Running only: a restored or forked VM that has not started has a
        // live driver but no worker to raise the change's interrupt.
        if !matches!(self.state(), VmState::Running) {
            return Err(self.state_error("change a medium"));
        }
        // A file handed over was checked where it was opened (a VM process
        // has no path to check it by).
        if let (Some(p), None) = (path, &opened) {
            crate::config::check_disk_path(p).map_err(|e| VmError::Refused(e.to_string()))?;
        }
        let medium = Arc::new(match (opened, path) {
            (Some(f), Some(p)) => k7d_devices::virtio::block::DiskImage::from_file(f, true, p.display().to_string())
                .map_err(|e| VmError::Refused(format!("disk {index} of vm {id}: {e}")))?,
            (Some(_), None) => {
                return Err(VmError::Refused(format!(
                    "disk {index} of vm {id}: a file came with no path for it"
                )));
            }
            (None, _) => super::device_manager::open_medium(path, true)?,
        });
        let Some(handle) = self
            .virtio
            .iter()
            .filter(|h| h.lock().unwrap_or_else(|p| p.into_inner()).device_name() == "blk")
            .nth(index)
        else {
            return Err(VmError::DeviceState(format!(
                "vm {id} has no virtio-blk function for disk {index}"
            )));
        };
        // The worker thread restarted after the swap is the VM's.
        let _scope = crate::seccomp::vm_scope(&self.control);
        let r = handle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .change_medium(medium.clone());
        if let Err(k7d_devices::virtio::VirtioError::MediumRefused(m)) = r {
            return Err(VmError::Refused(format!("disk {index} of vm {id}: {m}")));
        }
        // Any other outcome: the drive holds the new medium, and the
        // config (what a snapshot reopens) must say so.
        if let Some(d) = self.disks.get_mut(index) {
            *d = medium;
        }
        self.config.devices.disks[index].path = path.map(std::path::Path::to_path_buf);
        r.map_err(|e| {
            VmError::DeviceState(format!(
                "disk {index} of vm {id} took its new medium, but its worker could not restart: {e}"
            ))
        })?;
        tracing::info!(vm = %id, disk = index, path = ?path, "medium changed");
        Ok(())
    }

    /// The complete machine state; the VM must be paused (or never started).
    pub fn save_state(&self) -> Result<MachineState, VmError> {
        if !matches!(self.state(), VmState::Paused | VmState::Created) {
            return Err(self.state_error("save its state"));
        }
        let kvm = super::kvm::open().map_err(VmError::OpenKvm)?;
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
