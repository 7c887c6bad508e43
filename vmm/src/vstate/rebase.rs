//! Re-basing a fork source (issue 16, `docs/fork.md` "Re-basing"): a VM
//! that keeps running after its first fork diverges from its frozen base,
//! and every later fork copies all of that divergence into its child. A
//! re-base builds a new base that holds the VM's RAM as it is now, while
//! the VM runs (as a live migration pre-copies: the old base's data and the
//! diverged pages first, then what was written meanwhile, round after
//! round), pauses it only for the last round, and remaps it privately over
//! the new base. Its next fork copies only what it wrote since.
//!
//! The old base is not touched: the children that map it keep it alive
//! and see nothing of this. The cost is one copy of the VM's RAM done by
//! the kernel (`copy_file_range` and `pwrite` into the new memfd), and the
//! memory of the new base beside the old one while old children live.

use std::time::{Duration, Instant};

use super::memory::PAGE;
use super::vm::{Vm, VmError, VmState};
pub use k7d_api::state::Rebased;

/// Pre-copy rounds while the VM runs, at most, before the paused one.
const MAX_ROUNDS: u32 = 8;
/// A round that wrote at most this many pages ends the pre-copy: the
/// paused round has about as few left.
const SMALL_ROUND: u64 = 256;

/// A new base being built ([`Vm::rebase_prepare`]), waiting for its last
/// round under a pause ([`Vm::rebase_finish`]); dropped, it goes and the VM
/// keeps its base.
pub struct PendingBase {
    file: std::fs::File,
    diverged: u64,
    recopied: u64,
    rounds: u32,
    started: Instant,
}

/// Below this divergence a batch's children copy so little (half a MiB
/// each) that a re-base is not worth its copy of the whole RAM.
const BATCH_MIN_PAGES: u64 = 128;

impl Vm {
    /// Re-bases this fork source (see the module's doc): running, it is
    /// paused for the last round only (at most `pause_timeout` to park);
    /// paused or never started, it stays so. A VM that was never forked
    /// has no base to re-base. On failure the VM keeps its old base,
    /// nothing it wrote is lost, and a running VM runs on.
    pub fn rebase(&self, pause_timeout: Duration) -> Result<Rebased, VmError> {
        let running = matches!(self.state(), VmState::Running);
        let r = self.rebase_and_hold(pause_timeout)?;
        if running && let Err(e) = self.resume() {
            return Err(VmError::DeviceState(format!(
                "vm {} was re-based, but resuming it afterwards failed: {e}",
                self.id()
            )));
        }
        Ok(r)
    }

    /// How many pages differ from this fork source's base now (0 for a VM
    /// never forked): KVM's dirty log and the VMM's bitmaps are harvested
    /// while the VM runs (the devices' own records are read at a fork or
    /// re-base).
    pub fn divergence(&self) -> Result<u64, VmError> {
        if !self.ram().is_frozen() {
            return Ok(0);
        }
        self.ram().take_writes(self.vm_fd())?;
        Ok(self.ram().diverged_count())
    }

    /// [`Vm::rebase`], leaving a running VM paused after its last round
    /// (the caller resumes it, or forks it first: the fork then copies
    /// nothing). On failure a running VM runs on.
    pub fn rebase_and_hold(&self, pause_timeout: Duration) -> Result<Rebased, VmError> {
        let running = matches!(self.state(), VmState::Running);
        let pending = self.rebase_prepare()?;
        let paused_at = Instant::now();
        if running {
            self.pause(pause_timeout)?;
        }
        match self.rebase_finish(pending, running.then_some(paused_at)) {
            Ok(r) => Ok(r),
            Err(e) => {
                if running && let Err(r) = self.resume() {
                    return Err(VmError::DeviceState(format!(
                        "{e}; resuming vm {} afterwards failed too: {r}",
                        self.id()
                    )));
                }
                Err(e)
            }
        }
    }

    /// Whether a batch of `count` forks costs less with a re-base first:
    /// each child copies every diverged page by faulting it in (about five
    /// times what the kernel pays per page to build a base), while a
    /// re-base copies the old base's data and the diverged pages once.
    /// Harvests while the VM runs, as [`Vm::divergence`].
    pub fn batch_gains_from_rebase(&self, count: u32) -> Result<bool, VmError> {
        if count < 2 || !self.ram().is_frozen() {
            return Ok(false);
        }
        let diverged = self.divergence()?;
        let base_pages = self
            .ram()
            .memfd()
            .metadata()
            .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512 / PAGE)
            .unwrap_or(self.ram().size() / PAGE);
        Ok(diverged >= BATCH_MIN_PAGES && diverged * u64::from(count) * 5 > base_pages + diverged)
    }

    /// Rounds 0.. of a re-base (see the module's doc), while the VM runs
    /// (or as it stands). Nothing may harvest this VM's writes between this
    /// and [`Vm::rebase_finish`] (a fork would take pages the last round
    /// needs): the callers hold the VM throughout.
    pub(super) fn rebase_prepare(&self) -> Result<PendingBase, VmError> {
        let started = Instant::now();
        let running = match self.state() {
            VmState::Running => true,
            VmState::Paused | VmState::Created => false,
            _ => return Err(self.state_error("re-base")),
        };
        if !self.ram().is_frozen() {
            return Err(VmError::Refused(format!(
                "vm {} has no fork base to re-base: it was never forked",
                self.id()
            )));
        }
        let size = self.ram().size();
        let file = crate::sys::memfd(&format!("k7d-ram-{}", self.id()), size).map_err(|source| VmError::Io {
            what: format!("cannot create a new base of {} MiB for vm {}", size >> 20, self.id()),
            source,
        })?;
        // Round 0: what the old base holds, then every page that differs
        // from it (a harvest first, so the set is complete up to now).
        self.ram().take_writes(self.vm_fd())?;
        let diverged = self.ram().diverged_count();
        self.ram().copy_base_to(&file)?;
        self.ram().write_pages_to(&file, &self.ram().diverged_words())?;
        let mut recopied = 0;
        let mut rounds = 1;
        // Rounds while the VM runs: what it wrote during the last one.
        while running && rounds < MAX_ROUNDS {
            let written = self.ram().take_writes(self.vm_fd())?;
            let n = self.ram().write_pages_to(&file, &written)?;
            recopied += n;
            rounds += 1;
            if n <= SMALL_ROUND {
                break;
            }
        }
        Ok(PendingBase {
            file,
            diverged,
            recopied,
            rounds,
            started,
        })
    }

    /// The last round of a re-base and the switch; the VM is paused (since
    /// `paused_at`, if this re-base paused it) or never started.
    pub(super) fn rebase_finish(&self, p: PendingBase, paused_at: Option<Instant>) -> Result<Rebased, VmError> {
        if !matches!(self.state(), VmState::Paused | VmState::Created) {
            return Err(self.state_error("finish a re-base"));
        }
        let n = self.last_round(p.file)?;
        self.count_rebase();
        let held = self
            .ram()
            .memfd()
            .metadata()
            .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512);
        let r = Rebased {
            id: self.id().to_string(),
            diverged_mib: mib(p.diverged * PAGE),
            base_mib: mib(held.unwrap_or(0)),
            recopied_pages: p.recopied + n,
            rounds: p.rounds,
            paused_ms: paused_at.map_or(0.0, |t| ms(t.elapsed())),
            took_ms: ms(p.started.elapsed()),
        };
        tracing::info!(vm = %self.id(), diverged_mib = r.diverged_mib, rounds = r.rounds, paused_ms = r.paused_ms, took_ms = r.took_ms, "re-based");
        Ok(r)
    }

    /// The round with every writer paused: the pages written since the last
    /// round by the vCPUs, the VMM and the devices, then the switch to the
    /// new base. Returns the pages written.
    /// On failure the VM keeps its old base and every page it wrote is in
    /// its diverged set (a switch cut short between two regions leaves
    /// some regions over the new base, which holds the same bytes as the
    /// old one outside that set: forks and snapshots stay exact).
    fn last_round(&self, base: std::fs::File) -> Result<u64, VmError> {
        // A fork child's devices hand over their records here, as at its
        // first fork (they have recorded since the child was built).
        self.device_manager().start_ram_logs(self.id(), "re-based")?;
        let devices = self.device_manager().drain_ram_writes();
        let mut n = self.ram().write_pages_to(&base, &self.ram().words_of_gpas(&devices))?;
        let written = self.ram().take_writes(self.vm_fd())?;
        n += self.ram().write_pages_to(&base, &written)?;
        self.ram().switch_base(base)?;
        Ok(n)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}
