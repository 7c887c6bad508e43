//! The state dump: on `SIGUSR1`, k7d writes the state of every VM in the
//! process to stderr, one block of lines prefixed `k7d-dump:`, without
//! stopping anything (`docs/diagnostics.md` has the format).
//!
//! No work happens in a signal handler: [`install`] blocks `SIGUSR1` in the
//! calling thread before any other thread exists (every thread inherits
//! the mask) and starts the `k7d-diag` thread, which takes the signal with
//! `sigwaitinfo` and gathers the state. Sources: per-vCPU atomics
//! ([`VcpuDiag`]), the control block, the serial port's lock-free counters
//! and its registers, and each virtio function's registers, the worker
//! counters and the guest's ring indexes read from guest memory
//! (bounds-checked). Device locks are only tried, for a bounded time: a
//! device held by a stuck thread shows up as `locked`, and the dump goes on.
//!
//! Every VM registers itself when it is built ([`register`]) and leaves the
//! registry when it is dropped, so `k7d run` and `k7d daemon` (every VM)
//! dump alike.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Arc, Mutex, MutexGuard, TryLockError, Weak};
use std::time::{Duration, Instant};

use k7d_devices::legacy::{Serial, SerialProbe};
use k7d_devices::virtio::transport::VirtioPciDevice;

use crate::vstate::control::VmControl;
use crate::vstate::vcpu::{VcpuDiag, VcpuRunState};

/// The prefix of every dump line.
pub const PREFIX: &str = "k7d-dump: ";
/// How long the dump waits for a device's lock before reporting it locked.
const LOCK_WAIT: Duration = Duration::from_millis(200);

/// What the dump reads of one VM. Holds no device alive: the serial port
/// and the virtio functions are weak references.
pub struct VmProbe {
    pub(crate) id: String,
    pub(crate) control: Arc<VmControl>,
    pub(crate) vcpus: Arc<[VcpuDiag]>,
    pub(crate) serial: Weak<Mutex<Serial>>,
    pub(crate) serial_probe: SerialProbe,
    pub(crate) virtio: Vec<Weak<Mutex<VirtioPciDevice>>>,
}

struct Registry {
    next: u64,
    vms: Vec<(u64, Arc<VmProbe>)>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    next: 0,
    vms: Vec::new(),
});

fn registry() -> MutexGuard<'static, Registry> {
    REGISTRY.lock().unwrap_or_else(|p| p.into_inner())
}

/// A VM's place in the dump; leaves it when dropped.
pub struct Registration(u64);

impl Drop for Registration {
    fn drop(&mut self) {
        registry().vms.retain(|(k, _)| *k != self.0);
    }
}

/// Adds a VM to every later dump.
pub fn register(probe: VmProbe) -> Registration {
    let mut r = registry();
    r.next += 1;
    let key = r.next;
    r.vms.push((key, Arc::new(probe)));
    Registration(key)
}

/// Locks `m`, retrying for up to `wait`; `None` when another thread holds it
/// throughout (a poisoned lock is still read).
fn try_lock_for<T: ?Sized>(m: &Mutex<T>, wait: Duration) -> Option<MutexGuard<'_, T>> {
    let deadline = Instant::now() + wait;
    loop {
        match m.try_lock() {
            Ok(g) => return Some(g),
            Err(TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(TryLockError::WouldBlock) if Instant::now() >= deadline => return None,
            Err(TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(|| "never".into(), |s| format!("{s:.3}s"))
}

impl VmProbe {
    /// This VM's lines, each without the prefix.
    fn lines(&self, out: &mut Vec<String>) {
        let vm = format!("vm={}", self.id);
        let (control, nvcpus, parked, exited) = self.control.debug_view();
        out.push(format!(
            "{vm} control={control} vcpus={} started={nvcpus} parked={parked} exited={exited} exits={}",
            self.vcpus.len(),
            self.control.exit_count()
        ));
        for (i, d) in self.vcpus.iter().enumerate() {
            let v = d.view();
            let (kind, what) = v.last_exit.words();
            let mut line = format!(
                "{vm} vcpu{i} tid={} state={} exits={} last_exit={kind}",
                v.tid,
                v.state.as_str(),
                v.exits
            );
            if let Some(what) = what {
                let _ = write!(line, " {what}={:#x}", v.last_value);
            }
            let _ = write!(line, " since_exit={}", secs(v.since_exit_s));
            if v.state == VcpuRunState::Parked {
                let _ = write!(line, " parked_for={}", secs(v.parked_s));
            }
            out.push(line);
        }
        let c = self.serial_probe.counters();
        let regs = match self.serial.upgrade() {
            Some(s) => match try_lock_for(&s, LOCK_WAIT) {
                Some(g) => g.debug_regs().words(),
                None => format!(
                    "regs=locked(held by another thread for over {} ms)",
                    LOCK_WAIT.as_millis()
                ),
            },
            None => "regs=gone".into(),
        };
        out.push(format!(
            "{vm} serial {regs} irqs_raised={} bytes_out={} since_out={} writing_for={}",
            c.irqs_raised,
            c.bytes_out,
            secs(c.since_out_s),
            c.writing_for_s.map_or_else(|| "no".into(), |s| format!("{s:.3}s")),
        ));
        for (k, w) in self.virtio.iter().enumerate() {
            let Some(dev) = w.upgrade() else {
                out.push(format!("{vm} virtio{k} gone"));
                continue;
            };
            match try_lock_for(&dev, LOCK_WAIT) {
                Some(d) => {
                    let name = d.device_name();
                    for l in d.debug_state() {
                        out.push(format!("{vm} virtio{k} {name} {l}"));
                    }
                }
                None => out.push(format!(
                    "{vm} virtio{k} locked(held by another thread for over {} ms)",
                    LOCK_WAIT.as_millis()
                )),
            }
        }
    }

    /// Whether the console's last byte was not a newline.
    fn mid_line(&self) -> bool {
        self.serial_probe.counters().mid_line
    }
}

/// The whole dump as text: `begin`, every registered VM, `end`; every line
/// starts with [`PREFIX`] and ends with a newline.
pub fn dump_text() -> String {
    let started = Instant::now();
    let vms: Vec<Arc<VmProbe>> = registry().vms.iter().map(|(_, p)| p.clone()).collect();
    let mut lines = vec![format!(
        "begin pid={} vms={} uptime={:.3}s",
        std::process::id(),
        vms.len(),
        k7d_devices::virtio::diag::now_ns() as f64 / 1e9
    )];
    for vm in &vms {
        vm.lines(&mut lines);
    }
    lines.push(format!(
        "end vms={} took={:.1}ms",
        vms.len(),
        started.elapsed().as_secs_f64() * 1e3
    ));
    let mut text = String::new();
    // A guest line still open on the console (the same pipe, often) would
    // swallow the first dump line's prefix position: start on a fresh line.
    if vms.iter().any(|v| v.mid_line()) {
        text.push('\n');
    }
    for l in lines {
        text.push_str(PREFIX);
        text.push_str(&l);
        text.push('\n');
    }
    text
}

/// Also append every dump to this file, before stderr: when stderr is a pipe
/// nobody drains (the very stall being diagnosed may be one), the file still
/// gets it.
pub const DUMP_FILE_ENV: &str = "K7D_DUMP_FILE";

/// Writes one dump to `$K7D_DUMP_FILE` (if set) and to stderr, line by line
/// under stderr's lock (each line is one `write`, atomic on a pipe, so output
/// of other threads cannot split a line).
pub fn dump_to_stderr() {
    let text = dump_text();
    if let Some(path) = std::env::var_os(DUMP_FILE_ENV) {
        let r = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()));
        if let Err(e) = r {
            tracing::warn!(path = %std::path::Path::new(&path).display(), error = %e, "cannot append the state dump to {DUMP_FILE_ENV}");
        }
    }
    let mut err = std::io::stderr().lock();
    for line in text.split_inclusive('\n') {
        if err.write_all(line.as_bytes()).is_err() {
            return;
        }
    }
}

/// Blocks `SIGUSR1` in the calling thread and starts the thread that dumps
/// on each `SIGUSR1`. Call it first thing, before any other thread is
/// spawned, so every thread inherits the blocked mask (a thread that did not
/// would take the signal's default action: the process would die).
pub fn install() -> std::io::Result<()> {
    crate::sys::block_signal(libc::SIGUSR1)?;
    // Touch the diagnostics clock so uptimes count from here.
    let _ = k7d_devices::virtio::diag::now_ns();
    std::thread::Builder::new().name("k7d-diag".into()).spawn(|| {
        loop {
            if let Err(e) = crate::sys::wait_signal(libc::SIGUSR1) {
                tracing::error!(error = %e, "waiting for SIGUSR1 failed; state dumps are off");
                return;
            }
            dump_to_stderr();
        }
    })?;
    Ok(())
}
