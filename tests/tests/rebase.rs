//! Re-basing a fork source (issue 16, `docs/fork.md` "Re-basing"): a
//! source that ran on after its first fork gets a new base holding its RAM
//! as it is, built while it runs; it sees exactly what it saw before, the
//! children of its old base see nothing of it, and its next fork copies
//! only what it wrote since.

use std::sync::Arc;
use std::time::Duration;

use k7d_guest::{RESULTS_ADDR, result};
use k7d_tests::{TempDir, boot, builtin, read_u32, wait_for};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{Vm, VmOptions};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 16 * MIB;

fn ram(vm: &Vm) -> Vec<u8> {
    let mut v = vec![0u8; SIZE as usize];
    vm.memory().read_slice(&mut v, GuestAddress(0)).unwrap();
    v
}

fn differing_pages(a: &[u8], b: &[u8]) -> usize {
    a.chunks(4096).zip(b.chunks(4096)).filter(|(x, y)| x != y).count()
}

/// How many descriptors of this process are guest RAM memfds named `name`.
fn memfds(name: &str) -> usize {
    let want = format!("/memfd:{name} ");
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_link(e.path())
                .map(|l| l.to_string_lossy().starts_with(&want))
                .unwrap_or(false)
        })
        .count()
}

fn opts(dir: &TempDir, name: &str) -> VmOptions {
    VmOptions {
        serial_log: Some(dir.0.join(format!("{name}.log"))),
        ..Default::default()
    }
}

/// Writes one word into each of `n` pages from 4 MiB up (the VMM's writes
/// go through the VM's bitmap, as a device worker's do).
fn scribble(vm: &Vm, n: u64, round: u32) {
    for i in 0..n {
        let gpa = 4 * MIB + (i * 4096) % (SIZE - 4 * MIB);
        vm.memory().write_obj(round ^ i as u32, GuestAddress(gpa)).unwrap();
    }
}

#[test]
fn a_rebased_source_forks_exactly_and_copies_only_what_it_wrote_since() {
    let dir = TempDir::new("rebase");
    let mut src = boot(
        "src",
        &builtin("memwriter", 1, SIZE / MIB, &[64, 0x20_0000, 1]),
        &dir.0.join("src.log"),
    );
    let counter = || read_u32(&src, RESULTS_ADDR + result::LOOP_COUNTER);
    assert!(
        wait_for(Duration::from_secs(20), || counter() > 1000),
        "memwriter did not start"
    );

    // Never forked: nothing to re-base.
    let e = src.rebase(Duration::from_secs(2)).unwrap_err().to_string();
    assert!(e.contains("never forked"), "{e}");

    src.pause(Duration::from_secs(2)).unwrap();
    let at_first = ram(&src);
    let first = src.fork("first", &opts(&dir, "first")).unwrap();
    src.resume().unwrap();
    let old_base = src.memfd();

    for round in 0..5u32 {
        // The source diverges: its vCPU churns, the VMM writes 1500 pages.
        scribble(&src, 1500, round);
        let c = counter();
        assert!(wait_for(Duration::from_secs(5), || counter() > c + 2000));
        let pauses = src.pauses();
        let r = src.rebase(Duration::from_secs(2)).unwrap();
        assert_eq!(
            src.pauses(),
            pauses + 1,
            "a running source is paused once, for the last round"
        );
        assert!(
            r.diverged_mib >= 1500.0 * 4096.0 / MIB as f64,
            "round {round}: the re-base saw {} MiB diverged",
            r.diverged_mib
        );
        assert!(
            !Arc::ptr_eq(&src.memfd(), &old_base),
            "the source is still over its old base"
        );
        // It goes on, and its next fork copies only what it wrote since.
        let c = counter();
        assert!(
            wait_for(Duration::from_secs(5), || counter() > c + 2000),
            "the source stopped after the re-base"
        );
        src.pause(Duration::from_secs(2)).unwrap();
        let now = ram(&src);
        let child = src.fork(&format!("c{round}"), &opts(&dir, "c")).unwrap();
        assert_eq!(
            differing_pages(&ram(&child), &now),
            0,
            "round {round}: a fork after the re-base differs from its source"
        );
        let copied = child.ram().diverged_count();
        assert!(
            copied < 300,
            "round {round}: the fork after a re-base copied {copied} pages"
        );
        // The old base's child never saw any of it.
        assert_eq!(
            differing_pages(&ram(&first), &at_first),
            0,
            "round {round}: the old base's child changed"
        );
        drop(child);
        src.resume().unwrap();
    }

    // Held paused after the last round, the guest's own writes are all
    // there: memwriter writes its loop counter into its 64 pages in turn,
    // so they hold 64 consecutive values ending at the counter. A write
    // between the last running round and the pause that the paused round
    // missed would show an older value.
    for round in 0..20u32 {
        src.rebase_and_hold(Duration::from_secs(2)).unwrap();
        let c = counter();
        let mut v: Vec<u32> = (0..64).map(|k| read_u32(&src, 0x20_0000 + k * 4096)).collect();
        v.sort_unstable();
        assert!(
            v.windows(2).all(|w| w[1] == w[0] + 1) && (c - 1..=c).contains(&v[63]),
            "round {round}: after the re-base memwriter's pages hold {v:?} with its counter at {c}"
        );
        src.resume().unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }

    // Re-based while paused: the source sees exactly what it saw, and
    // stays paused (no pause of its own).
    scribble(&src, 700, 99);
    src.pause(Duration::from_secs(2)).unwrap();
    let before = ram(&src);
    let pauses = src.pauses();
    let r = src.rebase(Duration::from_secs(2)).unwrap();
    assert_eq!((r.paused_ms, src.pauses()), (0.0, pauses));
    assert_eq!(
        differing_pages(&ram(&src), &before),
        0,
        "a re-base changed what the source sees"
    );
    assert_eq!(src.ram().diverged_count(), 0);

    // A child re-based: its own fork equals it.
    let mut child = src.fork("child", &opts(&dir, "child")).unwrap();
    child.start().unwrap();
    let cc = || read_u32(&child, RESULTS_ADDR + result::LOOP_COUNTER);
    let c = cc();
    assert!(
        wait_for(Duration::from_secs(5), || cc() > c + 2000),
        "the child did not run"
    );
    scribble(&child, 900, 7);
    child.rebase(Duration::from_secs(2)).unwrap();
    child.pause(Duration::from_secs(2)).unwrap();
    let child_now = ram(&child);
    let grandchild = child.fork("grandchild", &opts(&dir, "gc")).unwrap();
    assert_eq!(
        differing_pages(&ram(&grandchild), &child_now),
        0,
        "a re-based child's fork differs"
    );
    assert_eq!(
        differing_pages(&ram(&src), &before),
        0,
        "the source saw its child's writes"
    );
    drop(grandchild);
    // Old bases go with their last user: the first one lives while its
    // child does, and nothing else keeps it open.
    drop(old_base);
    let open = memfds("k7d-ram-src");
    drop(first);
    assert_eq!(
        memfds("k7d-ram-src"),
        open - 1,
        "the first base stayed open after its last child went"
    );
    child.stop();
    src.stop();
}

#[test]
fn the_daemon_rebases_a_source_past_its_threshold_and_leaves_the_others() {
    use k7d_api::api::{CreateArgs, ErrorCode, ForkArgs, Reply, Request};
    use k7d_tests::TestDaemon;
    let d = TestDaemon::start("rebase-policy");
    let _rebaser = k7d_vmm::daemon::Rebaser::start(&d.daemon, Duration::from_millis(50)).unwrap();
    let create = |id: &str, pct: Option<u32>| {
        let mut cfg = builtin("memwriter", 1, 8, &[64, 0x20_0000, 1]);
        cfg.id = Some(id.into());
        cfg.fork.rebase_at_percent = pct;
        d.daemon.handle(Request::Create(CreateArgs {
            config: cfg,
            start: true,
        }))
    };
    let e = create("bad", Some(0)).unwrap_err();
    assert_eq!(
        e.message,
        "rebase_at_percent = 0 is out of range: use 1 to 100 (percent of the VM's RAM)"
    );
    create("auto", Some(2)).unwrap();
    create("manual", None).unwrap();
    let rebases = |id: &str| {
        let Reply::Vm(i) = d.daemon.handle(Request::Info(id.into())).unwrap() else {
            panic!("info answered another type")
        };
        i.rebases
    };
    // Never forked: no base to re-base, on request or by the thread.
    let e = d.daemon.handle(Request::Rebase("manual".into())).unwrap_err();
    assert_eq!(e.code, ErrorCode::Conflict);
    assert_eq!(e.message, "vm manual has no fork base to re-base: it was never forked");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(rebases("auto"), 0);

    for id in ["auto", "manual"] {
        d.daemon
            .handle(Request::Fork(ForkArgs {
                id: id.into(),
                count: 1,
                ..Default::default()
            }))
            .unwrap();
    }
    // memwriter dirties 64 of its 2048 pages (3 %), past auto's 2 %: the
    // thread re-bases it again and again; manual has no threshold.
    assert!(
        wait_for(Duration::from_secs(10), || rebases("auto") >= 2),
        "the thread did not re-base a source past its threshold"
    );
    assert_eq!(rebases("manual"), 0);
    // auto's child inherits the threshold and diverges as fast (it runs
    // the same guest), but was never forked: nobody would copy from it.
    assert_eq!(rebases("auto-f1"), 0, "a child that was never forked was re-based");
    let Reply::Rebased(r) = d.daemon.handle(Request::Rebase("manual".into())).unwrap() else {
        panic!("rebase answered another type")
    };
    assert!(r.diverged_mib >= 0.25, "{r:?}");
    assert_eq!(rebases("manual"), 1);
    // Both run on.
    for id in ["auto", "manual", "auto-f1", "manual-f1"] {
        let Reply::Vm(i) = d.daemon.handle(Request::Info(id.into())).unwrap() else {
            panic!()
        };
        assert_eq!(i.status, "running", "{id}");
    }
}
