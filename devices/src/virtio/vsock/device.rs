//! The virtio-vsock device: identity, config space (the guest CID), the
//! listening unix socket, and the worker's start/stop.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use tracing::{info, warn};
use virtio_queue::Queue;
use vmm_sys_util::epoll::Epoll;

use super::event_handler::VsockWorker;
use super::muxer::Muxer;
use super::{LOCAL_PORT_BASE, MAX_PKT_BUF_SIZE, NUM_QUEUES, QUEUE_SIZE, VsockError, persist};
use crate::virtio::worker::WorkerThread;
use crate::virtio::{ActivateContext, VIRTIO_F_VERSION_1, VirtioDevice, VirtioError};

/// A virtio-vsock device with the hybrid (unix socket) host side.
///
/// The socket at `uds_path` is bound by [`Vsock::new`] (so host processes can
/// connect before the guest driver is up; they wait in the backlog) and
/// removed when the device is dropped. [`Vsock::with_listener`] takes a
/// socket somebody else bound (a VM process's, bound by its daemon), whose
/// path stays theirs to remove.
pub struct Vsock {
    cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    /// Whether this device bound `uds_path` (and so removes it).
    owns_path: bool,
    queue_sizes: [u16; NUM_QUEUES],
    worker: WorkerThread<VsockWorker>,
    /// Restored from a snapshot or a fork: the guest's sockets still think
    /// they are connected to peers this device never had. The worker's
    /// first act is a TRANSPORT_RESET event (virtio 1.2 §5.10.6.7).
    reset_guest: bool,
    /// The first host-side port handed out for host-initiated connections:
    /// [`LOCAL_PORT_BASE`], or for a restored device one far from its
    /// source's ([`restored_first_port`]).
    first_local_port: u32,
}

/// Where a restored (or forked) device starts handing out host-side ports:
/// away from the ports its source handed out, which the guest may still
/// hold in sockets its transport reset has not reached yet, or that its
/// agent has not closed since (a connection request on such a port is
/// answered with a reset, and the host reads "not listening"). A point in
/// [2^30 + 2^29, 2^31) taken from the clock: forks of one source differ,
/// and a source's own few ports are 2^29 wide apart from it on average.
fn restored_first_port() -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let mixed = t.subsec_nanos() ^ (t.as_secs() as u32).rotate_left(13);
    LOCAL_PORT_BASE + (1 << 29) + mixed % (1 << 29)
}

/// Refuses the reserved CIDs (0-2) and those past 32 bits.
fn check_cid(cid: u64) -> Result<(), VsockError> {
    if !(3..u64::from(u32::MAX)).contains(&cid) {
        return Err(VsockError::BadCid(cid));
    }
    Ok(())
}

impl std::fmt::Debug for Vsock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vsock")
            .field("cid", &self.cid)
            .field("uds_path", &self.uds_path)
            .field("active", &self.worker.is_running())
            .finish_non_exhaustive()
    }
}

impl Vsock {
    /// A device for guest `cid` whose host side listens at `uds_path`. Fails
    /// if the CID is reserved or the path cannot be bound (an existing file
    /// there is an error: it may be another VM's socket).
    pub fn new(cid: u64, uds_path: impl Into<PathBuf>) -> Result<Self, VsockError> {
        check_cid(cid)?;
        let uds_path = uds_path.into();
        let bind_err = |source| VsockError::Bind {
            path: uds_path.clone(),
            source,
        };
        let listener = UnixListener::bind(&uds_path).map_err(bind_err)?;
        if let Err(e) = listener.set_nonblocking(true) {
            let _ = std::fs::remove_file(&uds_path);
            return Err(bind_err(e));
        }
        info!(cid, path = %uds_path.display(), "vsock unix socket bound");
        Ok(Self::built(cid, uds_path, listener, true))
    }

    /// A device for guest `cid` whose host side is `listener`, a listening
    /// unix socket bound at `uds_path` by the caller, who removes the path.
    /// The guest's own connections to the host (`<uds_path>_<port>`) are
    /// made by path as ever: a process with no filesystem refuses them.
    pub fn with_listener(cid: u64, uds_path: impl Into<PathBuf>, listener: UnixListener) -> Result<Self, VsockError> {
        check_cid(cid)?;
        let uds_path = uds_path.into();
        listener.set_nonblocking(true).map_err(|source| VsockError::Bind {
            path: uds_path.clone(),
            source,
        })?;
        Ok(Self::built(cid, uds_path, listener, false))
    }

    fn built(cid: u64, uds_path: PathBuf, listener: UnixListener, owns_path: bool) -> Self {
        Self {
            cid,
            uds_path,
            listener,
            owns_path,
            queue_sizes: [QUEUE_SIZE; NUM_QUEUES],
            worker: WorkerThread::new("k7d-vsock"),
            reset_guest: false,
            first_local_port: LOCAL_PORT_BASE,
        }
    }

    /// The guest CID.
    pub fn cid(&self) -> u64 {
        self.cid
    }

    /// Where host processes connect.
    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// Whether a worker thread is running.
    pub fn is_active(&self) -> bool {
        self.worker.is_running()
    }

    /// Whether the device is paused (activated, worker parked).
    pub fn is_paused(&self) -> bool {
        self.worker.is_parked()
    }

    fn stop_worker(&mut self) -> Vec<Queue> {
        self.worker.stop().map(|w| w.queues).unwrap_or_default()
    }
}

impl VirtioDevice for Vsock {
    fn name(&self) -> &'static str {
        "vsock"
    }

    fn device_type(&self) -> u32 {
        virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn config_len(&self) -> u64 {
        8
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let cfg = self.cid.to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| o.checked_add(i))
                .and_then(|o| cfg.get(o).copied())
                .unwrap_or(0);
        }
    }

    fn activate(&mut self, ctx: ActivateContext) -> Result<(), VirtioError> {
        if self.worker.is_active() {
            return Err(VirtioError::AlreadyActive(self.name()));
        }
        let mut queues = ctx.queues;
        queues.sort_by_key(|q| q.index);
        let indices: Vec<u16> = queues.iter().map(|q| q.index).collect();
        if indices != [0, 1, 2] {
            return Err(VirtioError::QueueCount {
                device: "vsock",
                expected: NUM_QUEUES,
                got: queues.len(),
            });
        }
        let setup_err = |source| VirtioError::Open {
            path: self.uds_path.display().to_string(),
            source,
        };
        let listener = self.listener.try_clone().map_err(setup_err)?;
        let epoll = Epoll::new().map_err(setup_err)?;
        let muxer = Muxer::new(self.cid, &self.uds_path, listener, epoll, self.first_local_port).map_err(setup_err)?;
        let (qs, notify) = queues.into_iter().map(|q| (q.queue, q.notify)).unzip();
        let worker = VsockWorker {
            mem: ctx.mem,
            queues: qs,
            notify,
            interrupt: ctx.interrupt,
            muxer,
            malformed: 0,
            tx_stalled: false,
            buf: vec![0; MAX_PKT_BUF_SIZE as usize],
            tx_kick: false,
            mux_events: Vec::new(),
            pending_reset: std::mem::take(&mut self.reset_guest),
        };
        self.worker.spawn(worker)?;
        info!(cid = self.cid, features = ctx.acked_features, "virtio-vsock activated");
        Ok(())
    }

    fn reset(&mut self) -> Vec<Queue> {
        self.stop_worker()
    }

    /// Parks the worker after the packet it is handling: when this returns
    /// the device writes no guest memory. Host connections stay open (their
    /// data waits in the sockets). A device that is not active has nothing
    /// to pause.
    fn pause(&mut self) -> Result<(), VirtioError> {
        self.worker.park();
        Ok(())
    }

    /// Restarts a paused worker where it stopped.
    fn resume(&mut self) -> Result<(), VirtioError> {
        self.worker.unpark()
    }

    fn debug_state(&self) -> Vec<String> {
        vec![format!("backend worker={}", self.worker.state_word())]
    }

    /// A child gets a device of its own (its own host socket, no host
    /// connections) and the guest a transport reset (see [`persist`]).
    fn can_fork(&self) -> Result<(), VirtioError> {
        Ok(())
    }

    fn fork_backend(&mut self) -> Result<crate::virtio::ForkBackend, VirtioError> {
        Ok(crate::virtio::ForkBackend::from_config())
    }

    /// Host connections are not carried: the state is empty
    /// ([`persist::save`]); the source keeps its connections.
    fn snapshot(&mut self) -> Result<Vec<u8>, VirtioError> {
        Ok(persist::save())
    }

    /// Takes an empty state and resets the guest's connections when the
    /// device starts on the guest's rings.
    fn restore(&mut self, state: &[u8]) -> Result<(), VirtioError> {
        persist::restore(state).map_err(|e| VirtioError::Restore {
            device: "vsock",
            why: e.to_string(),
        })?;
        self.reset_guest = true;
        self.first_local_port = restored_first_port();
        Ok(())
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        self.stop_worker();
        if !self.owns_path {
            return;
        }
        if let Err(e) = std::fs::remove_file(&self.uds_path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(path = %self.uds_path.display(), error = %e, "could not remove the vsock unix socket");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("k7d-vsock-unit-{}-{name}", std::process::id()))
    }

    #[test]
    fn identity_config_and_lifecycle() {
        let p = tmp_path("id");
        let _ = std::fs::remove_file(&p);
        let mut v = Vsock::new(42, &p).unwrap();
        assert_eq!(v.device_type(), 19);
        assert_eq!(v.queue_max_sizes().len(), 3);
        assert_eq!(v.avail_features(), VIRTIO_F_VERSION_1);
        let mut cfg = [0u8; 8];
        v.read_config(0, &mut cfg);
        assert_eq!(u64::from_le_bytes(cfg), 42);
        let mut hi = [0xffu8; 4];
        v.read_config(4, &mut hi);
        assert_eq!(hi, [0; 4]);
        v.read_config(u64::MAX, &mut hi);
        assert_eq!(hi, [0; 4]);
        // No state but the queues (the transport's); a state with bytes
        // is refused with a sentence.
        assert_eq!(v.snapshot().unwrap(), Vec::<u8>::new());
        let e = v.restore(&[1]).unwrap_err().to_string();
        assert!(e.contains("vsock") && e.contains("1 byte"), "{e}");
        assert!(!v.reset_guest);
        assert_eq!(v.first_local_port, LOCAL_PORT_BASE);
        v.restore(&[]).unwrap();
        assert!(v.reset_guest, "a restored device resets the guest's connections");
        // ...and hands out host ports far from its source's, which the guest
        // may still hold (a request on one is answered with a reset).
        let first = v.first_local_port;
        assert!((LOCAL_PORT_BASE + (1 << 29)..1 << 31).contains(&first), "{first:#x}");
        let other: std::collections::HashSet<u32> = (0..16)
            .map(|_| {
                std::thread::sleep(std::time::Duration::from_micros(50));
                restored_first_port()
            })
            .collect();
        assert!(other.len() > 1, "forks of one source start apart: {other:?}");
        // Nothing to pause before activation.
        v.pause().unwrap();
        v.resume().unwrap();
        assert!(v.reset().is_empty());
        assert!(p.exists());
        let e = Vsock::new(43, &p).unwrap_err();
        assert!(matches!(e, VsockError::Bind { .. }), "{e}");
        drop(v);
        assert!(!p.exists(), "socket removed on drop");
    }

    #[test]
    fn reserved_cids_are_refused() {
        for cid in [0, 1, 2, u64::from(u32::MAX), 1 << 40] {
            let e = Vsock::new(cid, tmp_path("cid")).unwrap_err();
            assert!(matches!(e, VsockError::BadCid(c) if c == cid));
        }
    }

    #[test]
    fn a_handed_listener_is_served_and_its_path_left_to_whoever_bound_it() {
        let p = tmp_path("handed");
        let _ = std::fs::remove_file(&p);
        let l = UnixListener::bind(&p).unwrap();
        let e = Vsock::with_listener(2, &p, l.try_clone().unwrap()).unwrap_err();
        assert!(matches!(e, VsockError::BadCid(2)), "{e}");
        let v = Vsock::with_listener(7, &p, l).unwrap();
        assert_eq!(v.cid(), 7);
        assert_eq!(v.uds_path(), p.as_path());
        // A host process connects to the handed socket (it waits in the
        // backlog until the guest driver is up).
        std::os::unix::net::UnixStream::connect(&p).unwrap();
        drop(v);
        assert!(p.exists(), "the path is its binder's to remove");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn vhost_backend_is_an_explicit_error() {
        let e = crate::virtio::vsock::vhost::VhostVsock::open(3).unwrap_err();
        assert!(
            e.to_string().starts_with("the vhost-vsock backend is unavailable"),
            "{e}"
        );
    }
}
