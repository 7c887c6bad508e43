//! A device worker that makes a call its filter denies (`docs/security.md`):
//! the call fails with EPERM, the denial is reported with the thread and the
//! call's number, and the VM the worker works for stops with one sentence
//! saying so. Its own test binary: `seccomp::init` confines the whole
//! process (the test harness included) with the control filter.

use std::sync::mpsc;
use std::time::Duration;

use k7d_api::config::{GuestSpec, VmConfig};
use k7d_vmm::seccomp::{self, DeviceSandbox, Mode};
use k7d_vmm::{StopReason, Vm, VmOptions};

fn status_of(tid: i32) -> String {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).unwrap()
}

fn field<'a>(status: &'a str, key: &str) -> &'a str {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .map(str::trim)
        .unwrap_or("")
}

#[test]
fn a_device_worker_making_a_denied_call_gets_eperm_and_stops_its_vm() {
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
    let mut vm = Vm::new("denied", &cfg, &VmOptions::default()).expect("build vm");
    vm.start().expect("start vm");

    // A device worker of this VM, spawned and confined exactly as the
    // devices' workers are (the k7d_devices::sandbox seam).
    let token = {
        let _scope = seccomp::vm_scope(vm.control());
        k7d_devices::sandbox::capture()
    };
    let (tid_tx, tid_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let worker = std::thread::Builder::new()
        .name("k7d-test-worker".into())
        .spawn(move || {
            let _sandbox = k7d_devices::sandbox::enter(token, "k7d-test-worker");
            // SAFETY: gettid has no arguments.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            go_rx.recv().unwrap();
            // A worker has no business opening files.
            std::fs::File::open("/etc/hostname")
                .map(|_| ())
                .map_err(|e| e.raw_os_error())
        })
        .unwrap();
    let tid = tid_rx.recv().unwrap();
    let status = status_of(tid);
    assert_eq!(field(&status, "Seccomp:"), "2", "{status}");
    assert_eq!(field(&status, "NoNewPrivs:"), "1", "{status}");
    assert_eq!(field(&status, "CapEff:"), "0000000000000000", "{status}");
    go_tx.send(()).unwrap();
    let opened = worker.join().unwrap();
    assert_eq!(opened, Err(Some(libc::EPERM)), "the denied open must fail with EPERM");

    let reason = vm
        .wait(Duration::from_secs(5))
        .expect("the VM did not stop after the denied call");
    match &reason {
        StopReason::SeccompDenied {
            thread,
            syscall,
            message,
        } => {
            assert_eq!(thread, "k7d-test-worker");
            assert_eq!(*syscall, libc::SYS_openat);
            assert!(message.contains("vm denied"), "{message}");
            assert!(message.contains("device worker"), "{message}");
            assert!(
                message.contains(&format!("system call {}", libc::SYS_openat)),
                "{message}"
            );
        }
        other => panic!("the VM stopped for another reason: {other:?}"),
    }
    assert!(!reason.is_clean());
    assert_eq!(reason.kind(), "seccomp_denied");
    // The daemon's scrape counts it (`k7d_seccomp_denials_total`), by kind.
    assert_eq!(seccomp::denials(), [("control", 0), ("vcpu", 0), ("worker", 1)]);
}
