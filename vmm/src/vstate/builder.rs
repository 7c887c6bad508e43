//! Building a VM, the Firecracker way: one function takes a [`BuildPlan`]
//! (boot from the config, restore a saved machine state over filled RAM, or
//! a fork child over its parent's frozen RAM with the source devices'
//! backends) and builds, in order: the vCPU threads (confining themselves
//! meanwhile), the KVM VM and guest RAM, memslots (before the irqchip), the
//! guest image or Linux, the irqchip and PIT, the devices
//! (`device_manager`), the vCPUs, restored device states. Nothing runs until
//! `Vm::start`.

use std::collections::VecDeque;
use std::fs::File;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k7d_devices::virtio::ForkBackend;
use vm_memory::{Bytes, GuestAddress};

use super::control::VmControl;
use super::device_manager::{
    DeviceManager, Wiring, add_linux_platform, build_devices, resend_serial_interrupt, restore_virtio,
};
use super::error::{io, snapshot_io};
use super::handed::{FileRole, HostFiles};
use super::kvm::{create_irqchip_and_pit, create_vcpu, create_vm};
use super::memory::{GuestMemoryMmap, GuestRam};
use super::persist::{self, MachineState};
use super::shell::Shell;
use super::snapshot;
use super::vcpu;
use super::vm::{BuildSteps, Parts, Vm, VmError, VmOptions};
use crate::arch::x86_64 as arch;
use crate::config::{GuestSpec, VmConfig};

const BSP_STACK: u64 = 0x7000;

/// What a build starts from.
pub(super) enum BuildPlan<'a> {
    /// A new VM from its config.
    Boot,
    /// A saved machine state over RAM already filled with the guest's bytes.
    Restore {
        /// The machine state.
        state: &'a MachineState,
        /// The guest's RAM.
        ram: GuestRam,
    },
    /// A fork child: the source's state, RAM copy-on-write over the source's
    /// frozen base, and each source device's backend in bus order.
    Fork {
        /// The source's machine state at the fork instant.
        state: &'a MachineState,
        /// The source's (frozen) RAM.
        parent: &'a GuestRam,
        /// What each device's twin takes (`VirtioDevice::fork_backend`).
        backends: VecDeque<ForkBackend>,
        /// KVM objects made ahead for the child (`vstate/shell.rs`), of
        /// the child's shape.
        shell: Option<Shell>,
    },
}

/// Where a restored VM's RAM comes from.
pub(super) enum RamSource<'a> {
    /// Already filled (from a file holding guest RAM byte for byte).
    Ready(GuestRam),
    /// A fork child of this frozen RAM (plus the pages that diverged from it).
    ChildOf(&'a GuestRam),
}

/// Times the steps of a build as they end.
pub(super) struct StepClock {
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
        Self::build(id, config, opts, BuildPlan::Boot)
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
        snapshot::copy_sparse(memory, &ram.memfd(), ram.size()).map_err(snapshot_io)?;
        Self::build(id, config, opts, BuildPlan::Restore { state, ram })
    }

    /// Builds a VM that resumes `state` over `ram`, a memfd another process
    /// filled with the guest RAM (a restore in a VM process: the daemon
    /// verified the snapshot and copied its memory), mapped shared as a
    /// VM's own RAM.
    pub fn restore_handed(
        id: &str,
        config: &VmConfig,
        opts: &VmOptions,
        state: &MachineState,
        ram: File,
    ) -> Result<Self, VmError> {
        persist::check_fits(config, state)?;
        let ram = GuestRam::from_memfd(ram, config.memory_bytes())?;
        Self::build(id, config, opts, BuildPlan::Restore { state, ram })
    }

    /// Builds the VM `plan` describes under `id` (the config already
    /// validated). A fork child's devices take the source devices' backends
    /// in bus order (a disk's copy-on-write view instead of opening the
    /// config's path).
    pub(super) fn build(id: &str, config: &VmConfig, opts: &VmOptions, plan: BuildPlan<'_>) -> Result<Self, VmError> {
        let created = Instant::now();
        let mut clock = StepClock::new();
        let (state, ram_source, fork_backends, shell) = match plan {
            BuildPlan::Boot => (None, None, None, None),
            BuildPlan::Restore { state, ram } => (Some(state), Some(RamSource::Ready(ram)), None, None),
            BuildPlan::Fork {
                state,
                parent,
                backends,
                shell,
            } => (Some(state), Some(RamSource::ChildOf(parent)), Some(backends), shell),
        };
        let (shell_threads, shell_vcpus, shell_parts) = match shell {
            Some(Shell {
                standby,
                control,
                vcpus,
                vm_fd,
                ram,
                ..
            }) => (Some((control, standby)), vcpus, Some((vm_fd, ram))),
            None => (None, Vec::new(), None),
        };
        let from_shell = shell_parts.is_some();
        // Every guest-file error comes before any KVM object exists. A
        // restored or forked guest's RAM already holds its image: the files
        // are not opened again (they may be gone or changed).
        let boot_files = match (&config.guest, &ram_source) {
            (GuestSpec::Linux { .. }, None) if opts.files.handed() => {
                let take = |r| opts.files.take(r).map_err(VmError::Guest);
                Some(arch::BootFiles {
                    kernel: take(FileRole::Kernel)?,
                    // Present only when the daemon had it unpacked.
                    unpacked_kernel: take(FileRole::UnpackedKernel).ok().flatten(),
                    initrd: match &config.guest {
                        GuestSpec::Linux { initrd: Some(_), .. } => take(FileRole::Initrd)?,
                        _ => None,
                    },
                })
            }
            _ => None,
        };
        let image = match (&config.guest, &ram_source) {
            (_, Some(_)) => None,
            (GuestSpec::Linux { kernel, .. }, None) => {
                match boot_files.as_ref().and_then(|b| b.kernel.as_ref()) {
                    Some(f) => arch::probe_kernel_file(kernel, f)?,
                    None => arch::probe_kernel(kernel)?,
                };
                None
            }
            (other, None) => Some(load_image(other, &opts.files)?),
        };
        clock.done("guest files checked");
        // The vCPU threads confine themselves while the machine is built.
        let (control, standby) = match shell_threads {
            Some((control, standby)) => {
                control.name(id);
                (control, standby)
            }
            None => {
                let control = Arc::new(VmControl::new(id));
                let standby = super::standby::Standby::spawn(u32::from(config.vcpus), &control)
                    .map_err(io("cannot spawn the vCPU threads"))?;
                (control, standby)
            }
        };
        clock.done("vCPU threads spawned");
        let kvm = super::kvm::open().map_err(VmError::OpenKvm)?;
        let (vm_fd, reserved) = match shell_parts {
            Some((vm_fd, ram)) => (vm_fd, Some(ram)),
            None => (create_vm(&kvm)?, None),
        };
        // Memslots before the irqchip: once KVM has a memslot of its own (the
        // irqchip adds one), every new slot waits for an SRCU grace period,
        // ~7 ms on these hosts (see CHALLENGES.md).
        let (ram, dirty_log) = match ram_source {
            None => (GuestRam::new(id, config.memory_bytes())?, false),
            Some(RamSource::Ready(ram)) => (ram, false),
            Some(RamSource::ChildOf(parent)) => {
                let ram = match reserved {
                    // The shell's memslots already point at the reservation.
                    Some(reserved) => GuestRam::new_child_in(parent, reserved)?,
                    None => GuestRam::new_child(parent)?,
                };
                ram.copy_diverged_from(parent, &parent.diverged_pages())?;
                // A child can be forked in turn: it tracks its own writes.
                (ram, true)
            }
        };
        clock.done("KVM VM and guest RAM");
        if !from_shell {
            ram.register(&vm_fd, dirty_log)?;
            clock.done("memslot");
        }
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
                        vmgenid: config.vmgenid(),
                        kernel_cache: opts.kernel_cache.as_deref(),
                        files: boot_files.as_ref(),
                    },
                )?)
            }
            _ => None,
        };
        match linux.as_ref().map(|e| e.kind) {
            Some(arch::KernelKind::Elf) => {
                clock.done("Linux loaded (ELF kernel, initrd, boot params, e820, ACPI, page tables)")
            }
            Some(arch::KernelKind::BzImage) => {
                clock.done("Linux loaded (bzImage, initrd, boot params, e820, ACPI, page tables)")
            }
            None => {}
        }
        if !from_shell {
            create_irqchip_and_pit(&vm_fd)?;
        }
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
            // One disk budget for all this VM's children, over its disks.
            if let Some(cap) = config.fork.max_children_disk_mib {
                let budget = Arc::new(k7d_devices::virtio::block::DiskBudget::new(cap.saturating_mul(1 << 20)));
                for d in &disks {
                    d.set_children_budget(budget.clone());
                }
            }
        }
        clock.done("devices");

        let n = u32::from(config.vcpus);
        let mut pending = Vec::with_capacity(config.vcpus.into());
        let mut shell_vcpus = shell_vcpus.into_iter();
        for i in 0..n {
            // A shell's vCPU comes with the CPUID a new VM gets already set.
            let (v, cpuid_set) = match shell_vcpus.next() {
                Some((v, cpuid)) => (v, Some(cpuid)),
                None => (create_vcpu(&vm_fd, i)?, None),
            };
            match (&linux, state) {
                (_, Some(st)) => persist::restore_vcpu(&v, i, &st.vcpus[i as usize], cpuid_set.as_deref())?,
                (Some(entry), None) => arch::setup_linux_vcpu(&kvm, &v, i, n, entry)?,
                (None, None) => {
                    vcpu::set_default_cpuid(&kvm, &v, i)?;
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
            resend_serial_interrupt(&vm_fd, &st.serial)?;
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
        // The VM Generation ID (`arch/x86_64/vmgenid.rs`): a boot's first,
        // or a fresh one for a fork child or restored VM, announced while
        // no vCPU runs (after the restored irqchip and LAPICs, so the edge
        // is pending when the guest resumes). In a fork child the page is
        // its own write: recorded as diverged, as a device's would be.
        let generation_id = if config.vmgenid() {
            use arch::vmgenid;
            let gen_id = vmgenid::fresh_id().map_err(io("cannot draw a VM Generation ID"))?;
            vmgenid::write_id(ram.memory(), &gen_id)
                .map_err(|e| VmError::Guest(format!("writing the VM Generation ID into guest RAM failed: {e}")))?;
            if state.is_some() {
                if dirty_log {
                    ram.add_diverged_gpas(std::iter::once(vmgenid::VMGENID_ADDR));
                }
                vmgenid::notify(&vm_fd).map_err(|e| VmError::Kvm("KVM_IRQ_LINE", e))?;
            }
            clock.done("VM Generation ID");
            Some(gen_id)
        } else {
            None
        };
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
        Ok(Self::assemble(Parts {
            diag,
            vcpu_diag,
            id: id.to_string(),
            config: config.clone(),
            control,
            standby,
            vcpus: pending,
            devices: DeviceManager::new(buses, serial, devices, virtio, disks, net_cleanups),
            vm_fd,
            ram,
            created,
            build_steps: clock.steps,
            in_shell: from_shell,
            generation_id,
        }))
    }
}

pub(super) fn load_image(spec: &GuestSpec, files: &HostFiles) -> Result<Vec<u8>, VmError> {
    match spec {
        GuestSpec::Builtin { name, .. } => k7d_guest::Builtin::from_name(name)
            .map(|b| b.image().to_vec())
            .map_err(|e| VmError::Guest(e.to_string())),
        GuestSpec::Raw { path, .. } => {
            let max = crate::config::MAX_RAW_IMAGE;
            let img = match files.take(FileRole::RawImage).map_err(VmError::Guest)? {
                Some(f) => k7d_sys::file::read_open_regular_file(f, max),
                None => k7d_sys::file::read_regular_file(path, max),
            }
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

pub(super) fn write_guest(mem: &GuestMemoryMmap, image: &[u8], tsc_khz: u32, args: &[u32]) -> Result<(), VmError> {
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
