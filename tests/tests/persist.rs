//! Machine state survives a save/restore into a new KVM VM and a fork:
//! timers keep ticking at their rate in the restored VM and in a fork child
//! (PIT2, LAPIC, IA32_TSC_DEADLINE set after IA32_TSC), on both vCPUs of
//! `smp`, and the source goes on too.

use std::time::{Duration, Instant};

use k7d_guest::{RESULTS_ADDR, result};
use k7d_tests::{TempDir, boot, builtin, read_u32, wait_for};
use k7d_vmm::{Vm, VmOptions};

fn rate(vm: &Vm, counter: u64, wall: Duration) -> u32 {
    let a = read_u32(vm, RESULTS_ADDR + counter);
    let t = Instant::now();
    std::thread::sleep(wall);
    let b = read_u32(vm, RESULTS_ADDR + counter);
    (f64::from(b.wrapping_sub(a)) / t.elapsed().as_secs_f64()) as u32
}

/// Boots `name`, lets it tick, pauses, saves, restores into a new VM from the
/// source's memfd, and checks every counter ticks at ~1 kHz in the restored VM
/// and again in the resumed source.
fn timers_survive(name: &str, vcpus: u8, counters: &[u64]) {
    let dir = TempDir::new(name);
    let cfg = builtin(name, vcpus, 16, &[]);
    let mut src = boot(&format!("{name}-src"), &cfg, &dir.0.join("src.log"));
    assert!(
        wait_for(Duration::from_secs(10), || counters
            .iter()
            .all(|c| read_u32(&src, RESULTS_ADDR + c) > 20)),
        "{name}: the source never ticked"
    );
    src.pause(Duration::from_secs(2)).unwrap();
    let state = src.save_state().unwrap();
    assert_eq!(state.vcpus.len(), usize::from(vcpus));
    // The state is plain data: it survives a JSON round trip.
    let json = serde_json::to_string(&state).unwrap();
    let state: k7d_vmm::vstate::persist::MachineState = serde_json::from_str(&json).unwrap();
    let frozen: Vec<u32> = counters.iter().map(|c| read_u32(&src, RESULTS_ADDR + c)).collect();

    let mut clone = Vm::restore(
        &format!("{name}-clone"),
        &cfg,
        &VmOptions {
            serial_log: Some(dir.0.join("clone.log")),
            ..Default::default()
        },
        &state,
        &src.memfd(),
    )
    .unwrap();
    // The clone starts from the source's counters, not from zero.
    for (c, f) in counters.iter().zip(&frozen) {
        assert_eq!(
            read_u32(&clone, RESULTS_ADDR + c),
            *f,
            "{name}: counter {c:#x} not carried over"
        );
    }
    clone.start().unwrap();
    for c in counters {
        let r = rate(&clone, *c, Duration::from_millis(500));
        assert!(
            (600..=1400).contains(&r),
            "{name}: restored counter {c:#x} ticks at {r}/s, expected ~1000/s"
        );
    }
    // A fork child (copy-on-write RAM, the same state path) ticks at its rate too.
    let mut child = src
        .fork(
            &format!("{name}-child"),
            &VmOptions {
                serial_log: Some(dir.0.join("child.log")),
                ..Default::default()
            },
        )
        .unwrap();
    for (c, f) in counters.iter().zip(&frozen) {
        assert_eq!(
            read_u32(&child, RESULTS_ADDR + c),
            *f,
            "{name}: the child's counter {c:#x} is not the source's"
        );
    }
    child.start().unwrap();
    for c in counters {
        let r = rate(&child, *c, Duration::from_millis(500));
        assert!(
            (600..=1400).contains(&r),
            "{name}: the fork child's counter {c:#x} ticks at {r}/s, expected ~1000/s"
        );
    }
    child.stop();
    src.resume().unwrap();
    // KVM's PIT re-injects the ticks it could not deliver while the source
    // was paused (lost-tick policy "delay", QEMU's default too): let that
    // catch-up finish before measuring the steady rate.
    std::thread::sleep(Duration::from_millis(1500));
    for c in counters {
        let r = rate(&src, *c, Duration::from_millis(300));
        assert!(
            (600..=1400).contains(&r),
            "{name}: resumed source counter {c:#x} ticks at {r}/s"
        );
    }
    clone.stop();
    src.stop();
}

#[test]
fn pit_ticks_after_restore() {
    timers_survive("pit", 1, &[result::BSP_TICKS]);
}

#[test]
fn tsc_deadline_ticks_after_restore() {
    timers_survive("tscdeadline", 1, &[result::BSP_TICKS]);
}

#[test]
fn both_vcpus_tick_after_restore() {
    timers_survive("smp", 2, &[result::BSP_TICKS, result::AP_TICKS]);
}

#[test]
fn restore_refuses_a_state_that_does_not_fit() {
    let dir = TempDir::new("misfit");
    let src = boot("misfit", &builtin("idle", 1, 8, &[]), &dir.0.join("s.log"));
    src.pause(Duration::from_secs(2)).unwrap();
    let state = src.save_state().unwrap();
    let e = Vm::restore(
        "x",
        &builtin("smp", 2, 8, &[]),
        &VmOptions::default(),
        &state,
        &src.memfd(),
    )
    .err()
    .expect("a 1-vCPU state restored into 2 vCPUs");
    assert!(e.to_string().contains("the state has 1 vCPUs, the config 2"), "{e}");
    src.resume().unwrap();
    let e = src.save_state().expect_err("saved a running VM");
    assert!(e.to_string().contains("is running, cannot save its state"), "{e}");
}
