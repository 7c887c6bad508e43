//! VM shells made ahead of a fork (`vstate/shell.rs`, issue 16): a child
//! built in a shell equals its source page for page at the fork instant
//! and runs on its own; a shell of another shape is refused; a pool's
//! shells leave nothing behind; the daemon keeps its pool at what its VMs
//! ask for and builds fork children in it.
//!
//! The tests of this file run one at a time: they count this process's
//! threads.

use std::sync::Mutex;
use std::time::Duration;

use k7d_guest::{RESULTS_ADDR, result};
use k7d_tests::{TempDir, TestDaemon, boot, builtin, open_fds, read_u32, thread_names, wait_for};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::vstate::cluster::ClusterPause;
use k7d_vmm::vstate::shell::{Shape, Shell, ShellPool};
use k7d_vmm::{Vm, VmOptions, VmState};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 2 * MIB;
const PAGES: u32 = 64;
const BASE: u32 = 0x10_0000;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn ram(vm: &Vm) -> Vec<u8> {
    let mut v = vec![0u8; vm.ram().size() as usize];
    vm.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

fn differing_pages(a: &[u8], b: &[u8]) -> usize {
    a.chunks(4096).zip(b.chunks(4096)).filter(|(x, y)| x != y).count()
}

fn counter(vm: &Vm) -> u32 {
    read_u32(vm, RESULTS_ADDR + result::LOOP_COUNTER)
}

/// A `memwriter` that keeps dirtying its 64 pages.
fn churning(dir: &TempDir, name: &str) -> Vm {
    churning_on(dir, name, 1)
}

/// [`churning`] with `vcpus` vCPUs (the others wait for a SIPI).
fn churning_on(dir: &TempDir, name: &str, vcpus: u8) -> Vm {
    let vm = boot(
        name,
        &builtin("memwriter", vcpus, SIZE / MIB, &[PAGES, BASE, 1]),
        &dir.0.join(format!("{name}.log")),
    );
    assert!(
        wait_for(Duration::from_secs(20), || counter(&vm) > 1000),
        "memwriter {name} did not start churning"
    );
    vm
}

fn vcpu_threads() -> usize {
    thread_names().iter().filter(|n| n.starts_with("vcpu")).count()
}

#[test]
fn children_built_in_shells_equal_their_sources_and_run_on_their_own() {
    let _one = serial();
    let dir = TempDir::new("shells-fork");
    let mut members: Vec<Vm> = ["a", "b", "c"].iter().map(|n| churning(&dir, n)).collect();
    let shape = members[0].shape();
    assert_eq!(shape, Shape { vcpus: 1, ram: SIZE });
    let pool = ShellPool::new();
    let opts = |id: &str| VmOptions {
        serial_log: Some(dir.0.join(format!("{id}.log"))),
        ..Default::default()
    };
    // 50 batches of 4 cluster forks (12 children each), 7 shells ready per
    // batch: some children are built in shells, the rest from scratch.
    const PER_BATCH: usize = 4;
    const SHELLS: usize = 7;
    let mut differing = 0;
    let mut in_shells = 0;
    let mut kept = None;
    for b in 0..50 {
        assert_eq!(pool.count(shape), 0);
        assert_eq!(pool.fill(shape, SHELLS).unwrap(), SHELLS);
        assert_eq!(pool.count(shape), SHELLS);
        let refs: Vec<&Vm> = members.iter().collect();
        let held = ClusterPause::pause_for_batch(&refs, PER_BATCH as u32, Duration::from_secs(2)).unwrap();
        let at_fork: Vec<Vec<u8>> = refs.iter().map(|m| ram(m)).collect();
        let ids: Vec<Vec<String>> = (0..PER_BATCH)
            .map(|f| ["a", "b", "c"].iter().map(|n| format!("{n}-b{b}-f{f}")).collect())
            .collect();
        let children = held.fork_in(&ids, opts, Some(&pool)).unwrap();
        held.resume().unwrap();
        assert_eq!(pool.count(shape), 0, "batch {b}: the children took every shell");
        for fork in &children.vms {
            for (m, child) in fork.iter().enumerate() {
                differing += differing_pages(&at_fork[m], &ram(child));
                in_shells += usize::from(child.built_in_shell());
            }
        }
        if b == 49 {
            // A child of member a built in a shell (which jobs got shells
            // depends on the builders' order).
            kept = children
                .vms
                .into_iter()
                .filter_map(|f| f.into_iter().next())
                .find(Vm::built_in_shell);
        }
    }
    assert_eq!(
        differing, 0,
        "{differing} pages differed between children and their sources"
    );
    assert_eq!(in_shells, 50 * SHELLS, "every shell ready was used, once");

    // A child built in a shell runs on its own: its counter moves on from
    // the fork instant, and neither it nor its source sees the other's
    // writes.
    let mut child = kept.expect("the last batch's first child");
    assert!(child.built_in_shell());
    let source = &members[0];
    let c0 = counter(&child);
    child.start().unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || counter(&child) > c0 + 2000),
        "the child built in a shell did not run"
    );
    child.memory().write_obj(0xc0ffee_u32, GuestAddress(0x9000)).unwrap();
    source.memory().write_obj(0xbeef_u32, GuestAddress(0xa000)).unwrap();
    assert_ne!(read_u32(source, 0x9000), 0xc0ffee, "the source saw its child's write");
    assert_ne!(read_u32(&child, 0xa000), 0xbeef, "the child saw its source's write");
    // Forked in turn: what the guest wrote through the shell's memslots
    // reaches KVM's dirty log (the shell registered them with it on), so
    // the grandchild equals the child page for page.
    child.pause(Duration::from_secs(2)).unwrap();
    let child_now = ram(&child);
    let grandchild = child.fork("grandchild", &opts("grandchild")).unwrap();
    assert_eq!(
        differing_pages(&child_now, &ram(&grandchild)),
        0,
        "the grandchild of a child built in a shell differs from it"
    );
    drop(grandchild);
    child.stop();
    for m in &mut members {
        m.stop();
    }
}

#[test]
fn a_shell_of_another_shape_is_refused_and_the_source_forks_after() {
    let _one = serial();
    let dir = TempDir::new("shells-shape");
    let threads = vcpu_threads();
    let mut src = churning(&dir, "src");
    src.pause(Duration::from_secs(2)).unwrap();
    let capture = src.capture().unwrap();
    let wrong = Shell::new(Shape { vcpus: 2, ram: SIZE }).unwrap();
    let e = src
        .fork_from_shell(&capture, "child", &VmOptions::default(), Some(wrong))
        .err()
        .expect("a 2-vCPU shell cannot hold a 1-vCPU child");
    assert_eq!(
        e.to_string(),
        "a shell for 2 vCPUs and 2 MiB cannot hold a child of vm src (1 vCPUs, 2 MiB)"
    );
    assert_eq!(src.state(), VmState::Paused);
    let at_fork = ram(&src);
    let right = Shell::new(src.shape()).unwrap();
    let child = src
        .fork_from_shell(&capture, "child", &VmOptions::default(), Some(right))
        .unwrap();
    assert_eq!(differing_pages(&at_fork, &ram(&child)), 0);
    drop(child);
    src.resume().unwrap();
    src.stop();
    drop(src);

    // Two vCPUs: the child built in a 2-vCPU shell runs.
    let mut src = churning_on(&dir, "src2", 2);
    src.pause(Duration::from_secs(2)).unwrap();
    let shell = Shell::new(src.shape()).unwrap();
    assert_eq!(shell.shape().vcpus, 2);
    let capture = src.capture().unwrap();
    let mut child = src
        .fork_from_shell(&capture, "child2", &VmOptions::default(), Some(shell))
        .unwrap();
    assert!(child.built_in_shell());
    let c0 = counter(&child);
    child.start().unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || counter(&child) > c0 + 2000),
        "the 2-vCPU child built in a shell did not run"
    );
    child.stop();
    drop(child);
    src.stop();
    drop(src);
    assert!(
        wait_for(Duration::from_secs(5), || vcpu_threads() == threads),
        "vCPU threads left behind: {} (was {threads})",
        vcpu_threads()
    );
}

#[test]
fn a_pool_fills_trims_and_leaves_no_thread_or_fd() {
    let _one = serial();
    let shape = Shape { vcpus: 2, ram: 4 * MIB };
    let (threads, fds) = (vcpu_threads(), open_fds().len());
    let pool = ShellPool::new();
    assert_eq!(pool.fill(shape, 3).unwrap(), 3);
    assert_eq!(pool.fill(shape, 3).unwrap(), 0, "a full pool makes none");
    assert_eq!((pool.count(shape), pool.total()), (3, 3));
    assert_eq!(vcpu_threads(), threads + 6, "each shell parks one thread per vCPU");
    assert_eq!(pool.total_vcpus(), 6);
    assert_eq!(pool.trim(|_| 1), 2);
    assert_eq!(pool.count(shape), 1);
    assert!(
        wait_for(Duration::from_secs(5), || vcpu_threads() == threads + 2),
        "a trimmed shell's threads did not end: {}",
        vcpu_threads()
    );
    let other = Shape { vcpus: 1, ram: 2 * MIB };
    assert!(pool.take(other).is_none(), "no shell of another shape is handed out");
    let s = pool.take(shape).expect("one shell left");
    assert_eq!(s.shape(), shape);
    drop(s);
    drop(pool);
    assert!(
        wait_for(Duration::from_secs(5), || (vcpu_threads(), open_fds().len())
            == (threads, fds)),
        "shells left threads or fds behind: {} threads (was {threads}), {} fds (was {fds})",
        vcpu_threads(),
        open_fds().len()
    );
}

#[test]
fn the_daemon_keeps_shells_for_the_vms_that_ask_and_forks_into_them() {
    use k7d_api::api::{CreateArgs, ForkArgs, Reply, Request};
    let _one = serial();
    let d = TestDaemon::start("shells-daemon");
    let _keeper = k7d_vmm::daemon::ShellKeeper::start(&d.daemon, Duration::from_millis(20)).unwrap();
    let create = |id: &str, shells: Option<u32>| {
        let mut cfg = builtin("memwriter", 1, 8, &[64, 0x20_0000, 1]);
        cfg.id = Some(id.into());
        cfg.fork.shells = shells;
        d.daemon.handle(Request::Create(CreateArgs {
            config: cfg,
            start: true,
        }))
    };
    let e = create("bad", Some(65)).unwrap_err();
    assert_eq!(
        e.message,
        "shells = 65 is out of range: use 1 to 64 (shells kept ready for this VM's fork children)"
    );
    let mut big = builtin("memwriter", 8, 8, &[64, 0x20_0000, 1]);
    big.fork.shells = Some(64);
    let e = d
        .daemon
        .handle(Request::Create(CreateArgs {
            config: big,
            start: false,
        }))
        .unwrap_err();
    assert_eq!(
        e.message,
        "shells = 64 of 8 vCPUs each would hold 512 vCPUs, more than 256: ask for fewer shells"
    );
    create("src", Some(3)).unwrap();
    let ready = |id: &str| {
        let Reply::Vm(i) = d.daemon.handle(Request::Info(id.into())).unwrap() else {
            panic!("info answered another type")
        };
        i.shells_ready
    };
    assert!(
        wait_for(Duration::from_secs(10), || ready("src") == Some(3)),
        "the daemon did not make the 3 shells src asks for: {:?}",
        ready("src")
    );
    // A fork of 2 takes 2 shells, a single fork one more; the pool refills.
    for (count, want) in [(2, 2), (1, 1)] {
        let Reply::Forked(f) = d
            .daemon
            .handle(Request::Fork(ForkArgs {
                id: "src".into(),
                count,
                ..Default::default()
            }))
            .unwrap()
        else {
            panic!("fork answered another type")
        };
        assert_eq!(f.children.iter().filter(|c| c.shell).count(), want, "{f:?}");
        for c in &f.children {
            assert_eq!(c.info.config.fork.shells, None, "a child inherited its source's shells");
        }
        assert!(
            wait_for(Duration::from_secs(10), || ready("src") == Some(3)),
            "the pool did not refill"
        );
    }
    // Nobody asks any more: the pool empties.
    d.daemon.handle(Request::Delete("src".into())).unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || d.daemon.shells_ready() == 0),
        "shells outlived the VM that asked for them: {}",
        d.daemon.shells_ready()
    );
}
