//! Forking a cluster of VMs under one pause (issue 16, `docs/fork.md`):
//! every member is paused (vCPUs and devices, all or none), every child of
//! every fork in the batch is built from that one instant, and the members
//! resume. A batch of N forks costs one pause, not N.

use std::time::{Duration, Instant};

use super::rebase::Rebased;
use super::shell::ShellPool;
use super::vm::{Vm, VmError, VmOptions, VmState};

/// Most threads that build a batch's children at once.
pub const MAX_BUILDERS: usize = 4;

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
    /// one pause per member. The re-base only saves time: a member whose
    /// re-base fails keeps its base (with every page it wrote still in its
    /// diverged set) and the batch goes on without it, with a warning.
    pub fn pause_for_batch(members: &[&'a Vm], count: u32, timeout: Duration) -> Result<Self, VmError> {
        let threads = builders();
        // The members' new bases are built side by side, while they run.
        let prepared = on_threads(
            members,
            threads,
            |m| {
                if !matches!(m.state(), VmState::Running | VmState::Paused | VmState::Created) {
                    return None;
                }
                match m
                    .batch_gains_from_rebase(count)
                    .and_then(|yes| yes.then(|| m.rebase_prepare()).transpose())
                {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(vm = %m.id(), error = %e, "no re-base before the batch; its children copy what it diverged");
                        None
                    }
                }
            },
            |_| false,
        );
        let pending: Vec<_> = members
            .iter()
            .zip(prepared)
            .filter_map(|(m, p)| p.flatten().map(|p| (*m, std::sync::Mutex::new(Some(p)))))
            .collect();
        let mut held = Self::pause(members, timeout)?;
        let paused_at = held.since;
        let paused = &held.paused;
        let finished = on_threads(
            &pending,
            threads,
            |(m, p)| {
                let p = p.lock().unwrap_or_else(|e| e.into_inner()).take()?;
                let was_running = paused.iter().any(|v| std::ptr::eq(*v, *m));
                match m.rebase_finish(p, was_running.then_some(paused_at)) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::warn!(vm = %m.id(), error = %e, "no re-base before the batch; its children copy what it diverged");
                        None
                    }
                }
            },
            |_| false,
        );
        held.rebased.extend(finished.into_iter().flatten().flatten());
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
    /// Each member is captured once for the batch ([`Vm::capture`]), and
    /// the children are built from the captures on as many threads as the
    /// host has cores, at most [`MAX_BUILDERS`].
    pub fn fork(&self, ids: &[Vec<String>], opts: impl Fn(&str) -> VmOptions + Sync) -> Result<Children, VmError> {
        self.fork_in(ids, opts, None)
    }

    /// [`ClusterPause::fork`], each child built in a shell taken from
    /// `shells` while the pool has one of its shape (`vstate/shell.rs`),
    /// the others from scratch.
    pub fn fork_in(
        &self,
        ids: &[Vec<String>],
        opts: impl Fn(&str) -> VmOptions + Sync,
        shells: Option<&ShellPool>,
    ) -> Result<Children, VmError> {
        self.fork_on(ids, &opts, builders(), shells)
    }

    /// [`ClusterPause::fork_in`] on at most `builders` threads.
    pub fn fork_on(
        &self,
        ids: &[Vec<String>],
        opts: &(impl Fn(&str) -> VmOptions + Sync),
        builders: usize,
        shells: Option<&ShellPool>,
    ) -> Result<Children, VmError> {
        if let Some(f) = ids.iter().position(|row| row.len() != self.members.len()) {
            return Err(VmError::Refused(format!(
                "fork {f} names {} children for {} members",
                ids[f].len(),
                self.members.len()
            )));
        }
        if ids.is_empty() {
            return Ok(Children {
                vms: Vec::new(),
                times: Vec::new(),
            });
        }
        // Every member's refusals before any member is frozen.
        for m in &self.members {
            m.check_forkable()?;
        }
        // One capture per member for the whole batch (a member's first
        // capture freezes its base).
        let captures: Vec<_> = self.members.iter().map(|m| m.capture()).collect::<Result<_, _>>()?;
        let mut vms: Vec<Vec<Vm>> = Vec::with_capacity(ids.len());
        let mut times = Vec::with_capacity(ids.len());

        // Every (fork, member) job taken in turn by the builders; each
        // result in its slot.
        let jobs: Vec<(usize, usize)> = (0..ids.len())
            .flat_map(|f| (0..self.members.len()).map(move |m| (f, m)))
            .collect();
        // The first failure stops the builders: the batch fails as a whole.
        let built = on_threads(
            &jobs,
            builders,
            |&(f, m)| {
                let id = &ids[f][m];
                let t = Instant::now();
                let member = self.members[m];
                let shell = shells.and_then(|p| p.take(member.shape()));
                member
                    .fork_from_shell(&captures[m], id, &opts(id), shell)
                    .map(|vm| (vm, t.elapsed()))
            },
            Result::is_err,
        );
        let mut results = built.into_iter();
        let mut first_err = None;
        for row in ids {
            let mut forks = Vec::with_capacity(row.len());
            let mut took = Vec::with_capacity(row.len());
            for _ in row {
                match results.next().flatten() {
                    Some(Ok((vm, t))) => {
                        forks.push(vm);
                        took.push(t);
                    }
                    Some(Err(e)) => {
                        first_err.get_or_insert(e);
                    }
                    None => {}
                }
            }
            vms.push(forks);
            times.push(took);
        }
        // Every child or none: on a failure every child built is dropped
        // (never started).
        match first_err {
            Some(e) => Err(e),
            None if vms.iter().any(|row| row.len() != self.members.len()) => {
                Err(VmError::Refused("a fork of the batch was not built".into()))
            }
            None => Ok(Children { vms, times }),
        }
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

/// How many threads build a batch: one per core, at most [`MAX_BUILDERS`].
fn builders() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_BUILDERS)
}

/// `f` of every item, on up to `threads` threads (this one included), in
/// the items' order, each item taken in turn by the next free thread. Once
/// a result makes `stop_after` true no item is started any more; the items
/// never started are `None` (so is one whose thread panicked: the panic is
/// propagated here).
fn on_threads<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
    stop_after: impl Fn(&R) -> bool + Sync,
) -> Vec<Option<R>> {
    let threads = threads.clamp(1, items.len().max(1));
    let slots: Vec<std::sync::Mutex<Option<R>>> = items.iter().map(|_| std::sync::Mutex::new(None)).collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(item) = items.get(i) else { return };
            let r = f(item);
            let stop = stop_after(&r);
            *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            if stop {
                next.store(items.len(), std::sync::atomic::Ordering::Relaxed);
                return;
            }
        }
    };
    if threads == 1 {
        work();
    } else {
        std::thread::scope(|s| {
            for _ in 1..threads {
                // A thread that cannot start leaves its items to the others.
                if let Err(e) = std::thread::Builder::new()
                    .name("k7d-fork-build".into())
                    .spawn_scoped(s, work)
                {
                    tracing::warn!(error = %e, "cannot start another fork thread; fewer do the work");
                    break;
                }
            }
            work();
        });
    }
    slots
        .into_iter()
        .map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()))
        .collect()
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
