//! Forking a paused VM (`docs/fork.md` walks this file): refusals before
//! anything is frozen, the records of every writer of guest RAM (the fork
//! seam), the freeze on the first fork, the harvest of what diverged, the
//! machine state, each device's backend for the child, and the child's
//! build from a `BuildPlan::Fork`.

use std::collections::VecDeque;
use std::sync::Arc;

use k7d_devices::virtio::ForkBackend;

use super::builder::BuildPlan;
use super::device_manager::pin_macs;
use super::memory::GuestRam;
use super::shell::{Shape, Shell};
use super::vm::{Vm, VmError, VmOptions, VmState};

impl Vm {
    /// Forks this paused VM: a new VM `child_id` whose RAM is copy-on-write
    /// over this VM's frozen base plus the pages that diverged since the
    /// freeze, and whose machine state is this VM's at this instant. The first
    /// fork freezes the base and switches KVM's dirty log on; neither VM sees
    /// the other's later writes. The child is built, not started.
    pub fn fork(&self, child_id: &str, opts: &VmOptions) -> Result<Self, VmError> {
        let capture = self.capture()?;
        self.fork_from(&capture, child_id, opts)
    }

    /// The fork instant of this paused VM, from which any number of
    /// children are built ([`Vm::fork_from`]; a batch captures once):
    /// the refusals, the freeze on a first fork, the harvest of what
    /// diverged, and the machine state. Valid while the VM stays paused.
    pub fn capture(&self) -> Result<Capture, VmError> {
        self.check_forkable()?;
        // Every device's records of the guest pages it writes, asked for
        // once: at this VM's first fork (before the freeze), or for a fork
        // child, frozen from birth, at its own first fork (blk's own view
        // has recorded every write since the child was built).
        self.device_manager().start_ram_logs(self.id(), "forked")?;
        if self.ram().is_frozen() {
            self.device_manager().harvest_ram_writes_into(self.ram());
            self.ram().harvest(self.vm_fd())?;
        } else {
            // Dirty log on before the freeze, both while nothing runs: no
            // write can fall between them. What the devices wrote before the
            // freeze is in the base: their records start empty.
            self.ram().set_dirty_log(self.vm_fd(), true)?;
            self.ram().freeze()?;
            self.device_manager().clear_ram_writes();
            self.ram().harvest(self.vm_fd())?;
        }
        self.mark_forked();
        Ok(Capture {
            state: self.save_state()?,
            pauses: self.pauses(),
            rebases: self.rebases(),
        })
    }

    /// Whether this VM can be forked now, checked before anything is
    /// frozen: its state, the config's refusals, then each device's own.
    pub fn check_forkable(&self) -> Result<(), VmError> {
        if !matches!(self.state(), VmState::Paused | VmState::Created) {
            return Err(self.state_error("fork"));
        }
        if let Some(i) = self.config().devices.nics.iter().position(|n| n.datapath.is_some()) {
            return Err(VmError::Refused(format!(
                "vm {} cannot be forked: its nic {i} is attached through the datapath, and a child would need its own pod network",
                self.id()
            )));
        }
        self.device_manager().can_fork(self.id())
    }

    /// A child built from `capture`, this VM's fork instant: its RAM is
    /// copy-on-write over the frozen base plus the pages that diverged,
    /// its machine state the capture's. Built, not started.
    pub fn fork_from(&self, capture: &Capture, child_id: &str, opts: &VmOptions) -> Result<Self, VmError> {
        self.fork_from_shell(capture, child_id, opts, None)
    }

    /// [`Vm::fork_from`], built in `shell` (made ahead, `vstate/shell.rs`)
    /// when one is given. A shell of another shape is refused.
    pub fn fork_from_shell(
        &self,
        capture: &Capture,
        child_id: &str,
        opts: &VmOptions,
        shell: Option<Shell>,
    ) -> Result<Self, VmError> {
        self.fork_child(capture, child_id, opts, shell, &ChildSpec::default())
    }

    /// [`Vm::fork_from_shell`] with what the child gets instead of its
    /// source's ([`ChildSpec`]: a pod's network, its own vsock socket).
    pub fn fork_child(
        &self,
        capture: &Capture,
        child_id: &str,
        opts: &VmOptions,
        shell: Option<Shell>,
        spec: &ChildSpec,
    ) -> Result<Self, VmError> {
        if let Some(s) = &shell
            && s.shape() != self.shape()
        {
            return Err(VmError::Refused(format!(
                "a shell for {} vCPUs and {} MiB cannot hold a child of vm {} ({} vCPUs, {} MiB)",
                s.shape().vcpus,
                s.shape().ram >> 20,
                self.id(),
                self.config().vcpus,
                self.ram().size() >> 20
            )));
        }
        // The capture holds only while this VM has stood still since.
        if !matches!(self.state(), VmState::Paused | VmState::Created)
            || capture.pauses != self.pauses()
            || capture.rebases != self.rebases()
        {
            return Err(VmError::Refused(format!(
                "vm {} ran or was re-based since its fork instant was captured: capture it again",
                self.id()
            )));
        }
        // What the child gets instead, checked before any device hands
        // over a backend (blk's is a copy-on-write view, charged to the
        // source's budget).
        let config = spec
            .child_config(self.config(), self.id(), child_id)
            .map_err(|e| VmError::Refused(format!("vm {} cannot be forked into {child_id}: {e}", self.id())))?;
        let state = &capture.state;
        // Each device hands over what its twin in the child takes, checked
        // after the child's config (blk's is charged to the source's budget).
        let backends = self.device_manager().fork_backends(self.id())?;
        Self::build(
            child_id,
            &config,
            opts,
            BuildPlan::Fork {
                state,
                parent: self.ram(),
                backends,
                shell,
            },
        )
    }
}

/// A fork instant handed to another process (a child in a VM process of
/// its own, `vmproc/`): the machine state, the source's frozen base, and
/// the pages that differed from it, copied into a memfd of their own at
/// their offsets (`delta`), so that nothing of the source's mapping is
/// needed afterwards: the source may run on at once.
pub struct Exported {
    /// The machine state.
    pub state: super::persist::MachineState,
    /// The pages in `delta` (bitmap words over the whole RAM).
    pub words: Vec<u64>,
    /// The source's frozen base.
    pub base: Arc<std::fs::File>,
    /// The diverged pages.
    pub delta: std::fs::File,
    /// Each read-write disk's overlay as the children's copies hold it.
    pub disks: Vec<ExportedDisk>,
}

/// An [`Exported`] fork instant as a child's process receives it.
pub struct Received<'a> {
    /// The machine state.
    pub state: &'a super::persist::MachineState,
    /// The source's frozen base.
    pub base: std::fs::File,
    /// The diverged pages.
    pub delta: std::fs::File,
    /// The pages in `delta` (bitmap words over the whole RAM).
    pub words: &'a [u64],
    /// The source's read-write disks' overlays.
    pub disks: &'a [ExportedDisk],
}

/// The overlay files a fork across processes gives read-write disk `disk`
/// (made by the caller: a VM process creates no file): `own` becomes the
/// source's overlay at its first fork (the base freezes), `child` gets a
/// copy of the source's present clusters ([`DiskImage::fork_into`]).
///
/// [`DiskImage::fork_into`]: k7d_devices::virtio::block::DiskImage::fork_into
pub struct OverlayFiles {
    /// The disk's place in the config's disks.
    pub disk: u16,
    /// The source's overlay, if its base is not frozen yet.
    pub own: Option<std::fs::File>,
    /// The children's overlay as of the fork instant.
    pub child: std::fs::File,
    /// The image opened again read-only, to take the place of this
    /// process's read-write descriptor of the frozen base
    /// ([`DiskImage::make_base_read_only`]).
    ///
    /// [`DiskImage::make_base_read_only`]: k7d_devices::virtio::block::DiskImage::make_base_read_only
    pub base: Option<std::fs::File>,
}

/// What an exported fork instant says of read-write disk `disk`: the
/// present clusters of its children's overlay, and which file its frozen
/// base is (device and inode: the caller, which opens the base again for
/// the children, checks it is the same file).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportedDisk {
    /// The disk's place in the config's disks.
    pub disk: u16,
    /// `[first, end)` runs of present clusters.
    pub runs: Vec<(u64, u64)>,
    /// The base's device.
    pub dev: u64,
    /// The base's inode.
    pub ino: u64,
}

impl Vm {
    /// Captures this paused VM's fork instant for a child built in another
    /// process ([`Vm::capture`], then the diverged pages written out).
    /// The children's devices are made from their own configs and files
    /// ([`Vm::from_export`]); each read-write disk needs its
    /// [`OverlayFiles`] in `overlays` (the first fork freezes its base, and
    /// the children's overlay gets a copy of what this VM wrote since).
    pub fn export_capture(&self, overlays: Vec<OverlayFiles>) -> Result<Exported, VmError> {
        // Exactly one per read-write disk, none for any other (or for a
        // disk it does not have): checked before anything is frozen.
        let mut overlays = overlays;
        overlays.sort_by_key(|o| o.disk);
        let rw: Vec<u16> = (0u16..)
            .zip(&self.config().devices.disks)
            .filter(|(_, d)| !d.read_only && d.path.is_some())
            .map(|(i, _)| i)
            .collect();
        let given: Vec<u16> = overlays.iter().map(|o| o.disk).collect();
        if given != rw {
            return Err(VmError::Refused(format!(
                "vm {}: overlay files were given for disks {given:?}, and its read-write disks are {rw:?}",
                self.id()
            )));
        }
        let capture = self.capture()?;
        let mut disks = Vec::with_capacity(overlays.len());
        // A disk's error with its cause, as one sentence.
        let device = |i: usize, e: k7d_devices::virtio::block::DiskError| VmError::Device {
            what: "virtio-blk",
            msg: format!(
                "disk {i}: {e}{}",
                std::error::Error::source(&e)
                    .map(|c| format!(": {c}"))
                    .unwrap_or_default()
            ),
        };
        for o in overlays {
            let i = usize::from(o.disk);
            let image = self
                .device_manager()
                .disks()
                .get(i)
                .ok_or_else(|| VmError::Refused(format!("vm {} has no disk {i}", self.id())))?;
            let runs = image.fork_into(o.own, &o.child).map_err(|e| device(i, e))?;
            if let Some(base) = o.base {
                image.make_base_read_only(base).map_err(|e| device(i, e))?;
            }
            let meta = image.file().metadata().map_err(|source| VmError::Io {
                what: format!("disk {i}'s base cannot be read"),
                source,
            })?;
            use std::os::unix::fs::MetadataExt;
            disks.push(ExportedDisk {
                disk: o.disk,
                runs,
                dev: meta.dev(),
                ino: meta.ino(),
            });
        }
        let words = self.ram().diverged_words();
        let delta = crate::sys::memfd(&format!("k7d-delta-{}", self.id()), self.ram().size()).map_err(|source| {
            VmError::Io {
                what: "cannot make the memfd of a fork's diverged pages".into(),
                source,
            }
        })?;
        self.ram().write_pages_to(&delta, &words)?;
        Ok(Exported {
            state: capture.state,
            words,
            base: self.ram().memfd(),
            delta,
            disks,
        })
    }

    /// A fork child built from an [`Exported`] fork instant (its parts as
    /// received): `config` is the child's ([`ChildSpec::child_config`]).
    /// Its devices are built from its config and the files handed over
    /// with it (its own taps, vsock socket and entropy source), its
    /// read-only disks from the same images as the source's (handed open:
    /// what a read-only disk's copy-on-write view is), its read-write ones
    /// from the source's frozen base and an overlay of its own (both
    /// handed open) with the present clusters of `received.disks`.
    pub fn from_export(
        id: &str,
        config: &crate::config::VmConfig,
        opts: &VmOptions,
        received: Received<'_>,
    ) -> Result<Self, VmError> {
        let Received {
            state,
            base,
            delta,
            words,
            disks,
        } = received;
        let parent = GuestRam::from_capture(base, delta, words, config.memory_mib << 20)?;
        // The devices' backends in bus order (rng, disks, NICs, vsock).
        let mut backends = VecDeque::new();
        if config.devices.rng {
            backends.push_back(ForkBackend::from_config());
        }
        for (i, d) in config.devices.disks.iter().enumerate() {
            let index = u16::try_from(i).map_err(|_| VmError::Refused(format!("vm {id}: too many disks")))?;
            let take = |role: super::handed::FileRole| {
                opts.files
                    .take(role)
                    .and_then(|f| f.ok_or_else(|| format!("{role} was not handed over")))
                    .map_err(|msg| VmError::Device {
                        what: "virtio-blk",
                        msg,
                    })
            };
            let disk = match &d.path {
                Some(p) if d.read_only => k7d_devices::virtio::block::DiskImage::from_file(
                    take(super::handed::FileRole::Disk { index })?,
                    true,
                    p.display().to_string(),
                ),
                Some(p) => {
                    let runs = disks
                        .iter()
                        .find(|x| x.disk == index)
                        .map(|x| x.runs.as_slice())
                        .ok_or_else(|| VmError::Device {
                            what: "virtio-blk",
                            msg: format!("disk {i} is read-write, and its overlay's clusters were not given"),
                        })?;
                    k7d_devices::virtio::block::DiskImage::from_parts(
                        take(super::handed::FileRole::Disk { index })?,
                        take(super::handed::FileRole::DiskOverlay { index })?,
                        runs,
                        p.display().to_string(),
                    )
                }
                None => k7d_devices::virtio::block::DiskImage::empty(),
            }
            .map_err(|e| VmError::Device {
                what: "virtio-blk",
                msg: format!("disk {i}: {e}"),
            })?;
            backends.push_back(ForkBackend::new(disk));
        }
        for _ in &config.devices.nics {
            backends.push_back(ForkBackend::from_config());
        }
        if config.devices.vsock.is_some() {
            backends.push_back(ForkBackend::from_config());
        }
        Self::build(
            id,
            config,
            opts,
            BuildPlan::Fork {
                state,
                parent: &parent,
                backends,
                shell: None,
            },
        )
    }
}

impl Vm {
    /// What a shell for this VM's fork children must fit.
    pub fn shape(&self) -> Shape {
        Shape {
            vcpus: self.config().vcpus,
            ram: self.ram().size(),
        }
    }
}

/// What one fork child gets instead of its source's. The default: a bare
/// tap of its own per NIC, and its vsock's host socket beside the
/// source's (`<source socket>-<child id>`).
#[derive(Debug, Clone, Default)]
pub struct ChildSpec {
    /// NIC `i` attached through the datapath (a pod's network) instead of a
    /// bare tap; at most as many as the source has NICs.
    pub nics: Vec<Option<crate::config::DatapathNicConfig>>,
    /// The child's vsock host socket (an absolute path that does not exist).
    pub vsock_uds: Option<std::path::PathBuf>,
}

impl ChildSpec {
    /// The config of fork child `child_id` of the VM `source_id` whose
    /// config is `source`: no shells of its own (they are kept for the VMs
    /// that ask, not for every child: a batch of 50 would ask for 50 times
    /// as many), its own taps (named after it) with the source's MACs (the
    /// guest's driver holds them), and this spec's NICs and vsock socket.
    pub fn child_config(
        &self,
        source: &crate::config::VmConfig,
        source_id: &str,
        child_id: &str,
    ) -> Result<crate::config::VmConfig, String> {
        let mut config = source.clone();
        config.id = Some(child_id.to_string());
        config.fork.shells = None;
        pin_macs(&mut config, source_id);
        for n in &mut config.devices.nics {
            n.tap = None;
        }
        self.apply(&mut config, child_id)?;
        Ok(config)
    }

    /// Puts this into the child's `config` (the source's, copied), each
    /// NIC attachment checked as a create's is.
    fn apply(&self, config: &mut crate::config::VmConfig, child_id: &str) -> Result<(), String> {
        if self.nics.len() > config.devices.nics.len() {
            return Err(format!(
                "{} NIC attachment(s) given, the source has {} NIC(s)",
                self.nics.len(),
                config.devices.nics.len()
            ));
        }
        for (i, (n, d)) in config.devices.nics.iter_mut().zip(&self.nics).enumerate() {
            if let Some(d) = d {
                d.check().map_err(|e| format!("nic {i}: {e}"))?;
                n.datapath = Some(d.clone());
                // The datapath never gives vhost: the child's plane is
                // the userspace one whatever the source's was.
                n.vhost = Some(false);
            }
        }
        match (&mut config.devices.vsock, &self.vsock_uds) {
            (None, Some(_)) => return Err("a vsock socket was given, but the source has no vsock".into()),
            (None, None) => {}
            (Some(v), Some(uds)) => v.uds = uds.clone(),
            (Some(v), None) => {
                let mut uds = v.uds.clone().into_os_string();
                uds.push(format!("-{child_id}"));
                v.uds = uds.into();
            }
        }
        // sun_path holds 107 bytes and a NUL.
        if let Some(v) = &config.devices.vsock
            && v.uds.as_os_str().len() > 107
        {
            return Err(format!(
                "the child's vsock socket {} is longer than a unix socket path may be (107 bytes): name one with vsock_uds",
                v.uds.display()
            ));
        }
        Ok(())
    }
}

/// A paused VM's fork instant ([`Vm::capture`]): its machine state, and
/// which pause and which base it belongs to (a capture from before the VM
/// last ran, or before a re-base, is refused).
pub struct Capture {
    state: super::persist::MachineState,
    pauses: u64,
    rebases: u64,
}
