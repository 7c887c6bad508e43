//! One VM: a KVM VM fd, its memfd RAM, vCPU threads and the device bus.
//!
//! Life: [`Vm::new`] builds everything (KVM VM, in-kernel irqchip + PIT2,
//! memory, vCPUs, devices, guest image) but runs nothing; [`Vm::start`]
//! spawns one thread per vCPU; [`Vm::pause`]/[`Vm::resume`] park and unpark
//! them; [`Vm::stop`] makes them leave and joins them. Dropping a `Vm` stops it
//! and releases every fd, mapping and thread it created.

use std::fs::File;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::VmFd;

use super::control::{StopReason, VmControl};
use super::device_manager::DeviceManager;
pub use super::error::VmError;
use super::error::io;
use super::memory::{GuestMemoryMmap, GuestRam};
pub use super::options::VmOptions;
use super::persist::{self, MachineState};
use super::vcpu;
use crate::config::VmConfig;
pub use k7d_api::state::{DeviceInfo, RngReseed, VmState};

/// The steps of a VM's build, in order, with how long each took: what the
/// VMM does before the guest runs (issue 13; `benches/benches/vm_build.rs`).
pub type BuildSteps = Vec<(&'static str, Duration)>;

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
    /// Before the VM fd and the RAM the devices write.
    devices: DeviceManager,
    vm_fd: Arc<VmFd>,
    ram: GuestRam,
    created: Instant,
    /// How long each step of the build took (`build_steps`).
    build_steps: BuildSteps,
    /// Built in a shell made ahead.
    in_shell: bool,
    started: Option<Instant>,
    /// Successful pauses so far (a cluster fork pauses each member once).
    pauses: std::sync::atomic::AtomicU64,
    /// Re-bases so far (`Vm::rebase`).
    rebases: std::sync::atomic::AtomicU64,
    /// Whether this VM has been a fork source (captured: `Vm::capture`).
    forked: std::sync::atomic::AtomicBool,
    /// The VM Generation ID k7d gave it last (`None`: no such device).
    generation_id: Option<crate::arch::x86_64::vmgenid::GenerationId>,
    /// Whether a fork of it was already warned that its children's kernel
    /// RNGs are not reseeded (once per source).
    rng_warned: std::sync::atomic::AtomicBool,
}

/// What a build hands [`Vm::assemble`]: everything a VM is made of but
/// its run-time counters.
pub(super) struct Parts {
    pub(super) diag: crate::diag::Registration,
    pub(super) vcpu_diag: Arc<[vcpu::VcpuDiag]>,
    pub(super) id: String,
    pub(super) config: VmConfig,
    pub(super) control: Arc<VmControl>,
    pub(super) standby: super::standby::Standby,
    pub(super) vcpus: Vec<vcpu::SharedVcpu>,
    pub(super) devices: DeviceManager,
    pub(super) vm_fd: Arc<VmFd>,
    pub(super) ram: GuestRam,
    pub(super) created: Instant,
    pub(super) build_steps: BuildSteps,
    pub(super) in_shell: bool,
    pub(super) generation_id: Option<crate::arch::x86_64::vmgenid::GenerationId>,
}

impl Vm {
    /// The VM a build made, not started.
    pub(super) fn assemble(p: Parts) -> Self {
        Vm {
            _diag: p.diag,
            vcpu_diag: p.vcpu_diag,
            id: p.id,
            config: p.config,
            control: p.control,
            standby: Some(p.standby),
            threads: Vec::new(),
            vcpus: p.vcpus,
            devices: p.devices,
            vm_fd: p.vm_fd,
            ram: p.ram,
            created: p.created,
            build_steps: p.build_steps,
            in_shell: p.in_shell,
            started: None,
            pauses: Default::default(),
            rebases: Default::default(),
            forked: Default::default(),
            generation_id: p.generation_id,
            rng_warned: Default::default(),
        }
    }

    /// Its devices (the modules that fork, snapshot and re-base it).
    pub(super) fn device_manager(&self) -> &DeviceManager {
        &self.devices
    }

    /// Its devices, to change (a NIC attached live).
    pub(super) fn device_manager_mut(&mut self) -> &mut DeviceManager {
        &mut self.devices
    }

    /// Its config, to record a change made live (a NIC attached).
    pub(super) fn config_mut(&mut self) -> &mut VmConfig {
        &mut self.config
    }

    /// Counts a re-base.
    pub(super) fn count_rebase(&self) {
        self.rebases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Marks it a fork source (captured).
    pub(super) fn mark_forked(&self) {
        self.forked.store(true, std::sync::atomic::Ordering::Relaxed);
    }

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
        self.devices
            .disks()
            .iter()
            .find_map(|d| d.children_budget_used())
            .unwrap_or(0)
    }

    /// Each virtio device's counters (`VirtioDevice::counters`), named by
    /// kind and index among its kind (`net0`, `net1`, ...); devices with
    /// none left out.
    pub fn device_counters(&self) -> Vec<(String, Vec<(String, u64)>)> {
        self.devices.counters()
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
        self.devices.info()
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
        self.devices.buses().mmio.write(addr, data)
    }

    /// A guest MMIO read, as a vCPU's MMIO exit makes it.
    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) -> bool {
        self.devices.buses().mmio.read(addr, data)
    }

    /// The virtio functions in bus order: device name and BAR 0 address.
    pub fn virtio_functions(&self) -> Vec<(&'static str, u64)> {
        self.devices.functions()
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
        if let Err(e) = self.devices.start_restored() {
            self.started = Some(Instant::now());
            self.control.set_threads(0);
            self.control.request_stop(StopReason::Requested);
            return Err(VmError::DeviceState(format!("vm {} cannot start: {e}", self.id)));
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
                buses: self.devices.buses().clone(),
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
        // vCPUs parked: no guest access can race the devices' pause. A
        // device that cannot pause undoes the whole pause.
        if let Err(e) = self.devices.pause(&self.id) {
            let _ = self.control.resume();
            return Err(e);
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
        self.devices.resume(&self.id)?;
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
        let Some(handle) = self.devices.blk(index) else {
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
        self.devices.set_disk(index, medium);
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
            serial: self.devices.serial_state(),
            virtio: self.devices.save_states(&self.id)?,
        })
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
