//! VM shells: what a fork child needs before any of its state goes in,
//! made ahead of a fork. A shell is a KVM VM with its irqchip and PIT,
//! memslots over reserved (still empty) address space, its vCPUs created
//! with their CPUID set, and its vCPU threads spawned and confined (with
//! their control block, named when the shell becomes a VM). On this host
//! making one costs 1.5–2 ms, most of a child's build (`KVM_CREATE_VM`
//! alone ~0.4 ms, the memslots ~0.3 ms, irqchip + PIT ~0.3 ms, a vCPU and
//! its CPUID ~0.3 ms, a confined thread ~0.1 ms); a child built in a shell
//! only maps its parent's base over the reservation (KVM's MMU notifier
//! drops whatever the slot showed before), restores the capture's state
//! and wires its devices (`Vm::fork_from_shell`).
//!
//! A shell holds nothing of any guest: no RAM content, no device, no state.
//! It fits every fork child of its [`Shape`]. A [`ShellPool`] keeps shells
//! by shape; the daemon fills one in the background for the VMs that ask
//! (`VmConfig.fork.shells`, `vmm/src/daemon/shells.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvm_bindings::kvm_cpuid_entry2;
use kvm_ioctls::{VcpuFd, VmFd};

use super::control::VmControl;
use super::error::{VmError, io};
use super::kvm::{create_irqchip_and_pit, create_vcpu, create_vm};
use super::memory::{self, GuestMemoryMmap};
use super::standby::Standby;
use super::vcpu::{self, VcpuSetupError};

/// What a shell fits: children with this many vCPUs and this much RAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// vCPUs.
    pub vcpus: u8,
    /// Guest RAM in bytes.
    pub ram: u64,
}

/// A KVM VM ready for a fork child's state (see the module docs).
pub struct Shell {
    // Drop order: the threads (they end unused), the vCPU fds, then the VM
    // fd, then the address space the memslots point at.
    pub(super) standby: Standby,
    pub(super) control: Arc<VmControl>,
    pub(super) vcpus: Vec<(VcpuFd, Vec<kvm_cpuid_entry2>)>,
    pub(super) vm_fd: Arc<VmFd>,
    pub(super) ram: GuestMemoryMmap,
    shape: Shape,
}

impl Shell {
    /// Makes a shell of `shape`: KVM VM, memslots with the dirty log on over
    /// reserved address space, irqchip and PIT, vCPUs with the CPUID a new
    /// VM gets.
    pub fn new(shape: Shape) -> Result<Self, VmError> {
        check_host()?;
        // The reservation first: on an error below, the VM fd (and the
        // memslots over it) closes before the address space is unmapped.
        let ram = memory::reserve(shape.ram)?;
        let control = Arc::new(VmControl::unnamed());
        let standby = Standby::spawn(u32::from(shape.vcpus), &control).map_err(io("cannot spawn the vCPU threads"))?;
        let kvm = super::kvm::open().map_err(VmError::OpenKvm)?;
        let vm_fd = create_vm(&kvm)?;
        // Memslots before the irqchip, as in `Vm::build`.
        memory::register(&ram, &vm_fd, true)?;
        create_irqchip_and_pit(&vm_fd)?;
        let mut vcpus = Vec::with_capacity(shape.vcpus.into());
        for i in 0..u32::from(shape.vcpus) {
            let v = create_vcpu(&vm_fd, i)?;
            vcpu::set_default_cpuid(&kvm, &v, i)?;
            // What KVM holds now (it adjusts some leaves as it takes them),
            // which is what a capture of a VM that has not run reads.
            let held = v
                .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
                .map_err(|source| VcpuSetupError {
                    index: i,
                    what: "KVM_GET_CPUID2",
                    source,
                })?;
            vcpus.push((v, held.as_slice().to_vec()));
        }
        // Ready means no work left: the threads have confined themselves.
        if !standby.wait_confined(std::time::Duration::from_secs(5)) {
            return Err(VmError::Refused(
                "a shell's vCPU threads did not confine themselves within 5 s".into(),
            ));
        }
        Ok(Self {
            standby,
            control,
            vcpus,
            vm_fd,
            ram,
            shape,
        })
    }

    /// The children this shell fits.
    pub fn shape(&self) -> Shape {
        self.shape
    }
}

/// Whether this host can use shells: KVM before Linux 6.7 takes a VM's
/// first TSC write from user space that lands within a second of what the
/// vCPU's own clock reads since its creation as a request to stay in sync
/// and ignores its value. A shell's vCPU is created long before the child's
/// TSC is written, so a source about as old as the shell would give its
/// child a TSC that went back in time. Since 6.7 (`user_set_tsc`) the first
/// write always holds.
pub fn check_host() -> Result<(), VmError> {
    supported(crate::sys::kernel_version())
}

/// [`check_host`] for a kernel release read as (major, minor).
fn supported(version: Option<(u32, u32)>) -> Result<(), VmError> {
    match version {
        Some(v) if v >= (6, 7) => Ok(()),
        Some((major, minor)) => Err(VmError::Refused(format!(
            "VM shells need Linux 6.7 or later on the host (older KVM can drop a restored TSC written long after its vCPU was created); this host runs {major}.{minor}"
        ))),
        None => Err(VmError::Refused(
            "VM shells need Linux 6.7 or later on the host, and this host's kernel release cannot be read".into(),
        )),
    }
}

/// Shells by shape, taken by fork children and put in by whoever fills it.
#[derive(Default)]
pub struct ShellPool {
    shells: Mutex<HashMap<Shape, Vec<Shell>>>,
}

impl ShellPool {
    /// An empty pool.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A shell of `shape`, if one is ready.
    pub fn take(&self, shape: Shape) -> Option<Shell> {
        self.lock().get_mut(&shape).and_then(Vec::pop)
    }

    /// Adds a shell.
    pub fn put(&self, shell: Shell) {
        self.lock().entry(shell.shape).or_default().push(shell);
    }

    /// Makes shells of `shape` until the pool holds `n` of them. Returns how
    /// many it made; on an error the ones made so far stay.
    pub fn fill(&self, shape: Shape, n: usize) -> Result<usize, VmError> {
        let mut made = 0;
        while self.count(shape) < n {
            // Made outside the lock: taking a shell never waits for one.
            self.put(Shell::new(shape)?);
            made += 1;
        }
        Ok(made)
    }

    /// Shells of `shape` ready.
    pub fn count(&self, shape: Shape) -> usize {
        self.lock().get(&shape).map_or(0, Vec::len)
    }

    /// Shells ready, all shapes.
    pub fn total(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    /// Shells ready by shape, sorted by shape (only shapes with one).
    pub fn by_shape(&self) -> Vec<(Shape, usize)> {
        let mut v: Vec<(Shape, usize)> = self
            .lock()
            .iter()
            .filter(|(_, list)| !list.is_empty())
            .map(|(shape, list)| (*shape, list.len()))
            .collect();
        v.sort_by_key(|(s, _)| (s.vcpus, s.ram));
        v
    }

    /// vCPUs of the shells ready (each holds a vCPU fd and a parked thread).
    pub fn total_vcpus(&self) -> usize {
        self.lock()
            .iter()
            .map(|(shape, list)| usize::from(shape.vcpus) * list.len())
            .sum()
    }

    /// Drops shells until at most `keep(shape)` of each shape are left.
    /// Returns how many went.
    pub fn trim(&self, keep: impl Fn(Shape) -> usize) -> usize {
        // Dropped outside the lock (closing a KVM VM takes a while).
        let mut gone = Vec::new();
        {
            let mut shells = self.lock();
            for (shape, list) in shells.iter_mut() {
                let k = keep(*shape);
                if list.len() > k {
                    gone.extend(list.drain(k..));
                }
            }
            shells.retain(|_, list| !list.is_empty());
        }
        gone.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Shape, Vec<Shell>>> {
        self.shells.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::supported;

    #[test]
    fn shells_need_linux_6_7_or_later() {
        for ok in [(6, 7), (6, 18), (7, 0)] {
            assert!(supported(Some(ok)).is_ok(), "{ok:?}");
        }
        let e = supported(Some((6, 1))).unwrap_err().to_string();
        assert!(
            e.contains("need Linux 6.7 or later") && e.ends_with("this host runs 6.1"),
            "{e}"
        );
        assert!(supported(Some((5, 15))).is_err());
        assert!(supported(None).is_err());
    }
}
