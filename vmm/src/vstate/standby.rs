//! vCPU threads spawned when a VM's build begins: each confines itself
//! (capabilities dropped, the vCPU seccomp filter attached; ~40–100 µs of
//! kernel work) while the builder creates the machine, then waits for the
//! vCPU it will run. `Vm::start` only hands each thread its vCPU, so the
//! confinement is off the path to the guest's first instruction
//! (`benches/benches/seccomp.rs`). A VM dropped before it starts drops its
//! standby threads' channels: they end without running anything.

use std::sync::mpsc::{Receiver, Sender, SyncSender, channel, sync_channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use super::control::VmControl;
use super::vcpu::{self, Buses, SharedVcpu, VcpuDiag};
use crate::seccomp::{self, ThreadKind};

/// What a standby thread needs to run its vCPU.
pub(crate) struct Job {
    pub vcpu: SharedVcpu,
    pub control: Arc<VmControl>,
    pub buses: Arc<Buses>,
    pub diags: Arc<[VcpuDiag]>,
}

/// One thread per vCPU, confined or confining, none running yet.
pub(crate) struct Standby {
    threads: Vec<(SyncSender<Job>, JoinHandle<()>)>,
    /// One message per thread once it has confined itself (or failed to).
    confined: std::sync::Mutex<Receiver<()>>,
}

impl Standby {
    /// Spawns `n` threads named `vcpu0..` working for `vm`.
    pub(crate) fn spawn(n: u32, vm: &Arc<VmControl>) -> std::io::Result<Self> {
        // On an error, the threads spawned so far end as `standby` drops.
        let (confined_tx, confined) = channel();
        let mut standby = Self {
            threads: Vec::with_capacity(n as usize),
            confined: std::sync::Mutex::new(confined),
        };
        for index in 0..n {
            let (tx, rx) = sync_channel(1);
            let vm = Arc::downgrade(vm);
            let confined = confined_tx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("vcpu{index}"))
                .spawn(move || body(index, vm, rx, confined))?;
            standby.threads.push((tx, handle));
        }
        Ok(standby)
    }

    /// Waits, at most `timeout`, until every thread has confined itself
    /// (or failed to: `Vm::start` reports that): a shell made ahead is done
    /// with its work when it is handed out. False on the timeout.
    pub(crate) fn wait_confined(&self, timeout: std::time::Duration) -> bool {
        let until = std::time::Instant::now() + timeout;
        let confined = self.confined.lock().unwrap_or_else(|p| p.into_inner());
        (0..self.threads.len()).all(|_| {
            confined
                .recv_timeout(until.saturating_duration_since(std::time::Instant::now()))
                .is_ok()
        })
    }

    /// Hands each thread its vCPU, in order. Returns the handles of the
    /// threads that took one, and the index of the first that could not
    /// (it had ended) if any: the caller rolls back.
    pub(crate) fn start(mut self, jobs: Vec<Job>) -> (Vec<JoinHandle<()>>, Option<usize>) {
        let mut started = Vec::with_capacity(jobs.len());
        let mut rest = std::mem::take(&mut self.threads).into_iter();
        for (i, job) in jobs.into_iter().enumerate() {
            let Some((tx, handle)) = rest.next() else {
                return (started, Some(i));
            };
            if tx.send(job).is_err() {
                join_quietly(handle);
                return (started, Some(i));
            }
            started.push(handle);
        }
        for (tx, handle) in rest {
            drop(tx);
            join_quietly(handle);
        }
        (started, None)
    }
}

impl Drop for Standby {
    fn drop(&mut self) {
        for (tx, handle) in self.threads.drain(..) {
            drop(tx);
            join_quietly(handle);
        }
    }
}

fn join_quietly(handle: JoinHandle<()>) {
    if handle.join().is_err() {
        tracing::error!("a standby vCPU thread panicked");
    }
}

fn body(index: u32, vm: Weak<VmControl>, rx: Receiver<Job>, done: Sender<()>) {
    // The filters are in place (or failed, which `Vm::start` reports
    // before it hands out any vCPU) once the process's set-up is done.
    seccomp::wait_set_up();
    let confined = seccomp::enter(ThreadKind::Vcpu, &format!("vcpu{index}"), Some(vm));
    let _ = done.send(());
    drop(done);
    let Ok(job) = rx.recv() else {
        return; // the VM never started
    };
    vcpu::run_loop(job.vcpu, index, job.control, job.buses, job.diags, confined);
}
