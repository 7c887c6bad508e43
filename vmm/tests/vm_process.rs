//! VM processes (issue 36, `vmm/src/vmproc/`): each VM in a jailed process
//! of its own, driven over its channel. Three at once: each its own uid,
//! jailed (`jail::probe`), holding only its own memfd and KVM descriptors
//! (none of another VM's), its vCPU under its seccomp filter; pause and
//! resume through the channel; `kill -9` of one stops only that one. A
//! caller of another channel version is refused with a sentence.

use std::time::{Duration, Instant};

use k7d_api::config::{GuestSpec, VmConfig};
use k7d_vmm::jail::JailConfig;
use k7d_vmm::vmproc::handle::VmProcess;
use k7d_vmm::vmproc::proto::{Reply, Request};

mod common;
use common::{K7D, Scratch, jail_root, root_or_skip};

/// uids and gids no account on a CI machine has.
const BASE_ID: u32 = 2_000_000_100;

/// The jail of VM process `n`: its own root under `dir`, its own ids.
fn jail(dir: &Scratch, n: u32) -> JailConfig {
    JailConfig {
        root: jail_root(dir, &format!("vm{n}")),
        uid: BASE_ID + n,
        gid: BASE_ID + n,
        keep_fds: Vec::new(),
    }
}

/// The `memwriter` guest churning its 64 pages: its loop counter says it runs.
fn memwriter(id: String) -> Request {
    Request::Build {
        id,
        config: Box::new(VmConfig {
            memory_mib: 16,
            guest: GuestSpec::Builtin {
                name: "memwriter".into(),
                args: vec![64, 0x20_0000, 1],
            },
            ..Default::default()
        }),
        files: Vec::new(),
        serial_log: None,
        node: Default::default(),
    }
}

fn spawn(dir: &Scratch, i: u32) -> VmProcess {
    VmProcess::spawn(std::path::Path::new(K7D), &jail(dir, i)).unwrap_or_else(|e| panic!("vm{i}: {e}"))
}

fn ok(p: &mut VmProcess, req: Request) {
    let r = p.call(&req).unwrap_or_else(|e| panic!("{req:?}: {e}"));
    assert_eq!(r, Reply::Ok, "{req:?}");
}

/// The memwriter's loop counter, read through the channel.
fn counter(p: &mut VmProcess) -> u32 {
    match p.call(&Request::Peek {
        addr: k7d_guest::RESULTS_ADDR + k7d_guest::result::LOOP_COUNTER,
        count: 1,
    }) {
        Ok(Reply::Peeked { words }) => words[0],
        other => panic!("peek: {other:?}"),
    }
}

fn grows(p: &mut VmProcess) -> bool {
    let c = counter(p);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if counter(p) > c {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn three_vm_processes_are_each_jailed_with_only_their_own_memory() {
    if !root_or_skip("three_vm_processes_are_each_jailed_with_only_their_own_memory") {
        return;
    }
    let dir = Scratch::new("vmproc");
    let mut procs: Vec<VmProcess> = (0..3).map(|i| spawn(&dir, i)).collect();
    for (i, p) in procs.iter_mut().enumerate() {
        ok(p, memwriter(format!("vm{i}")));
        ok(p, Request::Start);
        assert!(grows(p), "vm{i} does not run");
    }
    let mut uids = std::collections::HashSet::new();
    for (i, p) in procs.iter().enumerate() {
        let uid = common::assert_jailed_vm_process(p.pid, &format!("vm{i}"));
        assert!(uids.insert(uid), "vm{i} shares uid {uid}");
        // Its own guest RAM, and no other VM's, in its descriptors and its maps.
        for j in 0..3 {
            assert_eq!(
                common::holds_ram_of(p.pid, &format!("vm{j}")),
                i == j,
                "vm{i}'s process and vm{j}'s guest RAM"
            );
        }
    }

    // Pause and resume through the channel.
    ok(&mut procs[0], Request::Pause);
    let c = counter(&mut procs[0]);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(counter(&mut procs[0]), c, "a paused VM ran");
    match procs[0].call(&Request::Status).unwrap() {
        Reply::Status(s) => {
            assert_eq!(s.state, k7d_vmm::vstate::vm::VmState::Paused);
            assert!(s.exits > 0, "a guest that ran made no exits");
        }
        other => panic!("status: {other:?}"),
    }
    ok(&mut procs[0], Request::Resume);
    assert!(grows(&mut procs[0]));
    // What its guest RAM costs, read by the VM process from its own smaps
    // (the daemon may not read a process of another uid's): the guest has
    // touched some of it, all its own (no fork).
    match procs[0].call(&Request::GuestRam).unwrap() {
        Reply::GuestRam {
            resident,
            copied,
            pss,
            process_rss,
            process_pss,
        } => {
            assert!(
                resident > 0 && pss > 0 && pss <= resident,
                "resident {resident} pss {pss}"
            );
            assert_eq!(copied, 0, "a VM that was never forked copied nothing");
            assert!(
                process_rss > resident && process_pss > pss,
                "the whole process ({process_rss}, PSS {process_pss}) is more than its guest RAM"
            );
        }
        other => panic!("guest RAM: {other:?}"),
    }

    // kill -9 of one VM process stops only that VM.
    let victim = procs[1].pid;
    // SAFETY: kill takes integers; the pid is a child process this test spawned.
    assert_eq!(unsafe { libc::kill(victim as i32, libc::SIGKILL) }, 0);
    let t = Instant::now();
    let e = loop {
        match procs[1].call(&Request::Status) {
            Err(e) => break e,
            Ok(_) if t.elapsed() < Duration::from_secs(5) => std::thread::sleep(Duration::from_millis(10)),
            Ok(r) => panic!("vm1 still answers after kill -9: {r:?}"),
        }
    };
    assert!(e.contains(&victim.to_string()), "{e}");
    // The caller (a subreaper) learns why, in one sentence.
    assert_eq!(
        procs[1].ended(Duration::from_secs(5)).as_deref(),
        Some(format!("VM process {victim} was killed by signal 9").as_str())
    );
    assert_eq!(procs[0].ended(Duration::ZERO), None, "vm0 ended with vm1");
    assert!(
        grows(&mut procs[0]) && grows(&mut procs[2]),
        "a VM stopped with another's process"
    );

    for i in [0, 2] {
        ok(&mut procs[i], Request::Stop);
        let pid = procs[i].pid;
        assert_eq!(
            procs[i].ended(Duration::from_secs(5)).as_deref(),
            Some(format!("VM process {pid} exited").as_str())
        );
    }
}

#[test]
fn a_vm_process_refuses_a_caller_of_another_channel_version() {
    if !root_or_skip("a_vm_process_refuses_a_caller_of_another_channel_version") {
        return;
    }
    let dir = Scratch::new("vmproc-version");
    let jail = jail(&dir, 10);
    let mut p = VmProcess::spawn_unhello(std::path::Path::new(K7D), &jail).unwrap();
    match p.call(&Request::Hello { version: 999 }) {
        Ok(Reply::Error { message }) => {
            assert!(
                message.contains("version 999") && message.contains("refused"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    // It is gone after the refusal.
    assert!(p.call(&Request::Status).is_err());
    // A request before hello is refused too.
    let jail2 = JailConfig {
        root: jail_root(&dir, "second"),
        ..jail
    };
    let mut q = VmProcess::spawn_unhello(std::path::Path::new(K7D), &jail2).unwrap();
    match q.call(&Request::Status) {
        Ok(Reply::Error { message }) => assert!(message.contains("must be hello"), "{message}"),
        other => panic!("{other:?}"),
    }
}

/// Issue 36 item 4, at the VM process's end: its caller (the daemon) goes
/// away and the guests run on; the next caller re-attaches to each at its
/// socket, checks the VM's id in the hello, and finds the counters moved
/// on. A caller of another version is refused at re-attach, and the VM
/// waits for the next.
#[test]
fn vm_processes_outlive_their_caller_and_the_next_one_re_attaches() {
    use k7d_vmm::vmproc::proto::VERSION;
    if !root_or_skip("vm_processes_outlive_their_caller_and_the_next_one_re_attaches") {
        return;
    }
    let dir = Scratch::new("vmproc-reattach");
    let mut records = Vec::new();
    let mut procs = Vec::new();
    for i in 0..3u32 {
        let sock = dir.0.join(format!("vm{i}.sock"));
        let mut p = VmProcess::spawn_listening(std::path::Path::new(K7D), &jail(&dir, 20 + i), &sock).unwrap();
        let id = format!("re{i}");
        ok(&mut p, memwriter(id.clone()));
        ok(&mut p, Request::Start);
        assert!(grows(&mut p));
        records.push((sock, p.pid, id));
        procs.push(p);
    }
    let before: Vec<u32> = procs.iter_mut().map(counter).collect();
    // The caller is gone: every channel closes.
    drop(procs);
    std::thread::sleep(Duration::from_millis(200));
    let mut again = Vec::new();
    for ((sock, pid, id), b) in records.iter().zip(&before) {
        let (mut p, hello) = VmProcess::attach(sock, *pid, VERSION).unwrap();
        assert_eq!(
            hello,
            Reply::Hello {
                version: VERSION,
                pid: 1,
                vm: Some(id.clone())
            }
        );
        assert!(counter(&mut p) > *b, "{id} stood still while it had no caller");
        assert!(grows(&mut p), "{id} does not run after the re-attach");
        again.push(p);
    }
    // Another version is refused at re-attach; the VM waits for the next caller.
    drop(again.remove(0));
    let (sock, pid, _) = &records[0];
    match VmProcess::attach(sock, *pid, VERSION + 1) {
        Ok((_, Reply::Error { message })) => assert!(message.contains("refused"), "{message}"),
        other => panic!("{:?}", other.map(|(_, r)| r)),
    }
    let (p0, _) = VmProcess::attach(sock, *pid, VERSION).unwrap();
    again.insert(0, p0);
    assert!(grows(&mut again[0]));
    for p in &mut again {
        ok(p, Request::Stop);
        assert!(p.ended(Duration::from_secs(5)).is_some_and(|s| s.ends_with("exited")));
    }
}
