//! 50 VMs created concurrently through the daemon API, all running, all
//! deleted; afterwards no fd, memfd, thread or file of those VMs remains.
//!
//! This file holds ONE test on purpose: /proc/self/fd and /proc/self/task are
//! per process, and other tests running in parallel threads would disturb them.

use std::time::Duration;

use k7d_api::api::{CreateArgs, Request};
use k7d_tests::{TestDaemon, open_fds, thread_count, wait_for};

const N: usize = 50;

#[test]
fn fifty_concurrent_vms_leave_nothing_behind() {
    let d = TestDaemon::start("fifty");
    // Warm the process-wide, once-only pieces (kick signal handler) so they
    // are in the baseline rather than counted as a leak.
    {
        let mut c = d.client();
        c.call(&Request::Create(CreateArgs {
            config: k7d_tests::builtin("idle", 1, 8, &[]),
            start: true,
        }))
        .unwrap();
        let id = c.call(&Request::List).unwrap()["vms"][0]["id"]
            .as_str()
            .unwrap()
            .to_string();
        c.call(&Request::Delete(id)).unwrap();
    }
    assert!(wait_for(Duration::from_secs(5), || { !k7d_tests::vm_threads_alive() }));
    let fds0 = open_fds();
    let threads0 = thread_count();
    assert!(
        fds0.iter().all(|f| !f.contains("memfd:k7d-ram")),
        "baseline holds a memfd: {fds0:?}"
    );

    let sock = d.dir.0.join("k7d.sock");
    let creators: Vec<_> = (0..N)
        .map(|i| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut c = k7d_api::client::Client::connect(&sock).unwrap();
                let mut cfg = k7d_tests::builtin("idle", 1, 8, &[]);
                cfg.id = Some(format!("vm{i:02}"));
                c.call(&Request::Create(CreateArgs {
                    config: cfg,
                    start: true,
                }))
                .unwrap()
            })
        })
        .collect();
    for h in creators {
        let info = h.join().unwrap();
        assert_eq!(info["status"], "running", "{info}");
    }
    let mut c = d.client();
    let list = c.call(&Request::List).unwrap();
    let vms = list["vms"].as_array().unwrap();
    assert_eq!(vms.len(), N);
    assert!(vms.iter().all(|v| v["status"] == "running"), "{list}");
    assert_eq!(d.record_files().len(), N);
    let memfds = open_fds().iter().filter(|f| f.contains("memfd:k7d-ram")).count();
    assert_eq!(memfds, N, "one memfd per VM");
    assert!(thread_count() >= threads0 + N, "one vCPU thread per VM");
    drop(c);

    let deleters: Vec<_> = (0..N)
        .map(|i| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut c = k7d_api::client::Client::connect(&sock).unwrap();
                c.call(&Request::Delete(format!("vm{i:02}"))).unwrap()
            })
        })
        .collect();
    for h in deleters {
        h.join().unwrap();
    }
    // Connection threads leave when their clients hang up: give them a moment.
    let settled = wait_for(Duration::from_secs(5), || {
        thread_count() == threads0 && open_fds().len() == fds0.len()
    });
    let fds1 = open_fds();
    assert!(
        settled,
        "leftovers: threads {} -> {}, fds {fds0:?} -> {fds1:?}",
        threads0,
        thread_count()
    );
    assert!(
        fds1.iter().all(|f| !f.contains("memfd:k7d-ram")),
        "a memfd survived: {fds1:?}"
    );
    assert!(
        !k7d_tests::vm_threads_alive(),
        "threads left: {:?}",
        k7d_tests::thread_names()
    );
    assert!(
        fds1.iter()
            .all(|f| !f.contains("anon_inode:kvm-vm") && !f.contains("kvm-vcpu")),
        "{fds1:?}"
    );
    assert!(d.state_entries().is_empty(), "state dir holds {:?}", d.state_entries());
    assert!(
        d.client().call(&Request::List).unwrap()["vms"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}
