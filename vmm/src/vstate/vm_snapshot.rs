//! Snapshots of a whole VM: [`Vm::snapshot`] and [`Vm::snapshot_parts`]
//! (what is written, and for a VM in a VM process what is handed to the
//! daemon to write) and [`Vm::restore_from`], over `snapshot.rs`'s file
//! format.

use std::path::Path;

use super::builder::BuildPlan;
use super::device_manager::pin_macs;
use super::error::snapshot_io;
use super::memory::GuestRam;
use super::snapshot::{self, SnapshotError, SnapshotParts, SnapshotRam};
use super::vm::{Vm, VmError, VmOptions};

impl Vm {
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
        if let Some(i) = self.device_manager().disks().iter().position(|d| d.is_frozen()) {
            return Err(VmError::Refused(format!(
                "vm {} cannot be snapshotted: its disk {i} is a copy-on-write view since a fork, and a snapshot would not carry what it wrote",
                self.id()
            )));
        }
        let state = self.save_state()?;
        if self.ram().is_frozen() {
            // Since a fork this VM's own pages are private copies over the
            // frozen base; the writer reads them from the diverged set, so
            // bring it up to date (the VM is paused: nothing writes).
            self.device_manager().start_ram_logs(self.id(), "snapshotted")?;
            self.device_manager().harvest_ram_writes_into(self.ram());
            self.ram().harvest(self.vm_fd())?;
        }
        let mut config = self.config().clone();
        pin_macs(&mut config, self.id());
        snapshot::write(dir, replace, &config, &state, self.ram()).map_err(|e| match e {
            SnapshotError::Refused(msg) => VmError::Refused(msg),
            io => snapshot_io(io),
        })
    }

    /// What a snapshot of this paused VM is written from by another
    /// process (the daemon, for a VM in a VM process, which reaches no
    /// directory; the daemon writes the config it holds, not one from
    /// here): the machine state and the guest RAM as files, its memfd,
    /// or after a fork the frozen base and the pages diverged from it
    /// (as [`Vm::export_capture`] hands them to a fork's children).
    /// Refused as [`Vm::snapshot`] refuses.
    pub fn snapshot_parts(&self) -> Result<SnapshotParts, VmError> {
        if let Some(i) = self.device_manager().disks().iter().position(|d| d.is_frozen()) {
            return Err(VmError::Refused(format!(
                "vm {} cannot be snapshotted: its disk {i} is a copy-on-write view since a fork, and a snapshot would not carry what it wrote",
                self.id()
            )));
        }
        let state = self.save_state()?;
        if !self.ram().is_frozen() {
            return Ok(SnapshotParts {
                state,
                ram: SnapshotRam::Whole(self.ram().memfd()),
            });
        }
        // As [`Vm::snapshot`] brings the diverged set up to date, then
        // the diverged pages into a memfd of their own, as a fork's
        // export writes them (but nothing of a fork: no check of what
        // a child would need, no mark that this VM forked).
        self.device_manager().start_ram_logs(self.id(), "snapshotted")?;
        self.device_manager().harvest_ram_writes_into(self.ram());
        self.ram().harvest(self.vm_fd())?;
        let words = self.ram().diverged_words();
        let delta = crate::sys::memfd(&format!("k7d-delta-{}", self.id()), self.ram().size()).map_err(|source| {
            VmError::Io {
                what: "cannot make the memfd of a snapshot's diverged pages".into(),
                source,
            }
        })?;
        self.ram().write_pages_to(&delta, &words)?;
        Ok(SnapshotParts {
            state,
            ram: SnapshotRam::Forked {
                base: self.ram().memfd(),
                delta,
                words,
            },
        })
    }

    /// Builds a VM from a snapshot directory written by [`Vm::snapshot`]
    /// (an absolute path), with the config it was saved with (its id
    /// replaced by `id`). Everything is verified before any KVM object
    /// exists: the format version, the manifest's checksum, the config
    /// (create's validation), each file's kind and size, and every chunk's
    /// checksum, the memory file's as it is copied into the new memfd.
    pub fn restore_from(id: &str, dir: &Path, opts: &VmOptions) -> Result<Self, VmError> {
        let snap = snapshot::open(dir, id)?;
        let ram = GuestRam::new(id, snap.config.memory_bytes())?;
        snap.copy_memory_into(&ram)?;
        Self::build(
            id,
            &snap.config,
            opts,
            BuildPlan::Restore {
                state: &snap.state,
                ram,
            },
        )
    }
}
