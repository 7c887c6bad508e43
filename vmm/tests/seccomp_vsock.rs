//! The host side of the hybrid vsock runs under the device-worker filter
//! (`docs/security.md`): the `k7d-vsock` worker accepts a host process's
//! connection on the VM's unix socket and makes the stream non-blocking,
//! exactly as `devices/src/virtio/vsock/muxer.rs` does, and the VM keeps
//! running. Before `accept4` and `FIONBIO` were allowed, every pod VM the
//! containerd shim created stopped at its first vsock connection
//! (CHALLENGES.md, "The shim's first vsock connect stopped the pod VM").
//! Its own test binary: `seccomp::init` confines the whole process.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::mpsc;
use std::time::Duration;

use k7d_api::config::{GuestSpec, VmConfig};
use k7d_vmm::seccomp::{self, DeviceSandbox, Mode};
use k7d_vmm::{Vm, VmOptions, VmState};

#[test]
fn a_confined_vsock_worker_accepts_a_host_connection_and_its_vm_keeps_running() {
    k7d_devices::sandbox::install(&DeviceSandbox);
    seccomp::init(Mode::Enforce).expect("seccomp init");
    let cfg = VmConfig {
        vcpus: 1,
        memory_mib: 8,
        guest: GuestSpec::Builtin {
            name: "idle".into(),
            args: vec![],
        },
        ..Default::default()
    };
    let mut vm = Vm::new("vsock-accept", &cfg, &VmOptions::default()).expect("build vm");
    vm.start().expect("start vm");

    let dir = std::env::temp_dir().join(format!("k7d-seccomp-vsock-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vsock.sock");
    let listener = UnixListener::bind(&path).unwrap();
    listener.set_nonblocking(true).unwrap();

    let token = {
        let _scope = seccomp::vm_scope(vm.control());
        k7d_devices::sandbox::capture()
    };
    let (ready_tx, ready_rx) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name("k7d-vsock".into())
        .spawn(move || -> Result<Vec<u8>, String> {
            let _sandbox = k7d_devices::sandbox::enter(token, "k7d-vsock");
            ready_tx.send(()).unwrap();
            // The muxer's accept loop: the listener is non-blocking.
            let mut stream = loop {
                match listener.accept() {
                    Ok((s, _)) => break s,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    Err(e) => return Err(format!("accept: {e}")),
                }
            };
            stream
                .set_nonblocking(true)
                .map_err(|e| format!("set_nonblocking: {e}"))?;
            let mut line = vec![0u8; 13];
            stream
                .set_nonblocking(false)
                .map_err(|e| format!("set_nonblocking: {e}"))?;
            stream.read_exact(&mut line).map_err(|e| format!("read: {e}"))?;
            Ok(line)
        })
        .unwrap();
    ready_rx.recv().unwrap();
    let mut host = UnixStream::connect(&path).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    let got = worker.join().unwrap();
    assert_eq!(
        got.as_deref(),
        Ok(&b"CONNECT 1024\n"[..]),
        "the confined worker must accept and read"
    );
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(vm.state(), VmState::Running, "no denial may stop the VM");
    vm.stop();
    std::fs::remove_dir_all(dir).unwrap();
}
