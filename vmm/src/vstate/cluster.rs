//! Forking a cluster of VMs under one pause (issue 16, `docs/fork.md`):
//! every member is paused (vCPUs and devices, all or none), every child of
//! every fork in the batch is built from that one instant, and the members
//! resume. A batch of N forks costs one pause, not N.

use std::time::{Duration, Instant};

use super::rebase::Rebased;
use super::vm::{Vm, VmError, VmOptions, VmState};

/// The members of a cluster held still: built by [`ClusterPause::pause`],
/// resumed by [`ClusterPause::resume`] or, failing that, on drop.
pub struct ClusterPause<'a> {
    members: Vec<&'a Vm>,
    /// The members this pause parked (running before it), to resume.
    paused: Vec<&'a Vm>,
    since: Instant,
    took: Duration,
    /// The members re-based for this batch ([`ClusterPause::pause_for_batch`]).
    rebased: Vec<Rebased>,
}

/// The children of one cluster fork.
pub struct Children {
    /// `vms[f][m]`: fork `f`'s child of member `m`, built, not started.
    pub vms: Vec<Vec<Vm>>,
    /// How long each child took to build, as `vms`.
    pub times: Vec<Vec<Duration>>,
}

impl<'a> ClusterPause<'a> {
    /// Parks every running member (vCPUs and devices); members that are
    /// paused or never started stay as they are. All or none: a member that
    /// cannot pause resumes the ones already paused.
    pub fn pause(members: &[&'a Vm], timeout: Duration) -> Result<Self, VmError> {
        let since = Instant::now();
        let mut held = ClusterPause {
            members: members.to_vec(),
            paused: Vec::with_capacity(members.len()),
            since,
            took: Duration::ZERO,
            rebased: Vec::new(),
        };
        for m in members {
            if !matches!(m.state(), VmState::Running) {
                continue;
            }
            // On `?`, dropping `held` resumes the ones paused so far.
            m.pause(timeout)?;
            held.paused.push(m);
        }
        held.took = since.elapsed();
        Ok(held)
    }

    /// [`ClusterPause::pause`] for a batch of `count` forks: each member
    /// whose divergence makes the batch's children copy more than a re-base
    /// would ([`Vm::batch_gains_from_rebase`]) gets a new base first, built
    /// while it runs; the last rounds run under this one pause, and the
    /// batch's children then share that capture and copy nothing. Still
    /// one pause per member. A failed re-base resumes every member.
    pub fn pause_for_batch(members: &[&'a Vm], count: u32, timeout: Duration) -> Result<Self, VmError> {
        let mut pending = Vec::with_capacity(members.len());
        for m in members {
            if matches!(m.state(), VmState::Running | VmState::Paused | VmState::Created)
                && m.batch_gains_from_rebase(count)?
            {
                pending.push((*m, m.rebase_prepare()?));
            }
        }
        let mut held = Self::pause(members, timeout)?;
        let paused_at = held.since;
        for (m, p) in pending {
            // On `?`, dropping `held` resumes every member it paused.
            let was_running = held.paused.iter().any(|v| std::ptr::eq(*v, m));
            held.rebased.push(m.rebase_finish(p, was_running.then_some(paused_at))?);
        }
        held.took = held.since.elapsed();
        Ok(held)
    }

    /// The members re-based for this batch, with what each re-base did.
    pub fn rebased(&self) -> &[Rebased] {
        &self.rebased
    }

    /// How long parking every member took.
    pub fn took(&self) -> Duration {
        self.took
    }

    /// How long the members have stood still.
    pub fn held_for(&self) -> Duration {
        self.since.elapsed()
    }

    /// Forks every member at this instant: `ids[f][m]` names fork `f`'s
    /// child of member `m`, built with `opts(id)`. Every child or none.
    pub fn fork(&self, ids: &[Vec<String>], opts: impl Fn(&str) -> VmOptions) -> Result<Children, VmError> {
        if let Some(f) = ids.iter().position(|row| row.len() != self.members.len()) {
            return Err(VmError::Refused(format!(
                "fork {f} names {} children for {} members",
                ids[f].len(),
                self.members.len()
            )));
        }
        let mut vms = Vec::with_capacity(ids.len());
        let mut times = Vec::with_capacity(ids.len());
        for row in ids {
            let mut forks = Vec::with_capacity(row.len());
            let mut took = Vec::with_capacity(row.len());
            for (m, id) in self.members.iter().zip(row) {
                let t = Instant::now();
                // On `?`, the children built so far are dropped (never started).
                forks.push(m.fork(id, &opts(id))?);
                took.push(t.elapsed());
            }
            vms.push(forks);
            times.push(took);
        }
        Ok(Children { vms, times })
    }

    /// Resumes the members this pause parked, every one even when one
    /// fails; the first failure is returned.
    pub fn resume(mut self) -> Result<(), VmError> {
        resume_all(std::mem::take(&mut self.paused))
    }
}

impl Drop for ClusterPause<'_> {
    fn drop(&mut self) {
        let _ = resume_all(std::mem::take(&mut self.paused));
    }
}

fn resume_all(paused: Vec<&Vm>) -> Result<(), VmError> {
    let mut first = None;
    for m in paused {
        if let Err(e) = m.resume() {
            tracing::error!(vm = %m.id(), error = %e, "resuming a cluster member failed");
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}
