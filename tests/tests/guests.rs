//! Each test guest runs under the real VMM (real KVM) and its observable
//! result is asserted: serial text, tick rates, both vCPUs, memory pattern.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use k7d_guest::{HELLO_TEXT, RESULTS_ADDR, memwriter_pattern, result};
use k7d_tests::{TempDir, boot, builtin, read_u32, wait_for};
use k7d_vmm::StopReason;

#[test]
fn hello_prints_and_resets() {
    let dir = TempDir::new("hello");
    let log = dir.0.join("serial.log");
    let vm = boot("hello", &builtin("hello", 1, 16, &[]), &log);
    let reason = vm
        .wait(Duration::from_secs(10))
        .expect("hello did not stop within 10 s");
    assert_eq!(reason, StopReason::GuestReset);
    assert_eq!(std::fs::read_to_string(&log).unwrap(), HELLO_TEXT);
}

fn ticks_over(name: &str, vcpus: u8, counters: &[u64], wall: Duration) -> Vec<u32> {
    let dir = TempDir::new(name);
    let log = dir.0.join("serial.log");
    let mut vm = boot(name, &builtin(name, vcpus, 16, &[]), &log);
    // Wait for the first tick of every counter, then measure over `wall`.
    assert!(
        wait_for(Duration::from_secs(10), || counters
            .iter()
            .all(|c| read_u32(&vm, RESULTS_ADDR + c) > 0)),
        "{name}: no tick within 10 s; serial: {:?}",
        std::fs::read_to_string(&log)
    );
    let before: Vec<u32> = counters.iter().map(|c| read_u32(&vm, RESULTS_ADDR + c)).collect();
    let t0 = Instant::now();
    std::thread::sleep(wall);
    let after: Vec<u32> = counters.iter().map(|c| read_u32(&vm, RESULTS_ADDR + c)).collect();
    let elapsed = t0.elapsed();
    vm.stop();
    let ms = elapsed.as_secs_f64() * 1000.0;
    before
        .iter()
        .zip(after)
        .map(|(b, a)| {
            let n = a.wrapping_sub(*b);
            eprintln!("{name}: {n} ticks in {ms:.0} ms");
            (f64::from(n) * 1000.0 / ms) as u32
        })
        .collect()
}

/// 1 kHz ± 40% over 500 ms: the rate, not the exact count, is the contract
/// (emulated real mode on a shared 2-core host loses some ticks under load).
fn assert_khz(name: &str, rate: u32) {
    assert!((600..=1400).contains(&rate), "{name}: {rate} ticks/s, expected ~1000/s");
}

#[test]
fn pit_ticks_at_1khz() {
    let r = ticks_over("pit", 1, &[result::BSP_TICKS], Duration::from_millis(500));
    assert_khz("pit", r[0]);
}

#[test]
fn tscdeadline_ticks_at_1khz() {
    let r = ticks_over("tscdeadline", 1, &[result::BSP_TICKS], Duration::from_millis(500));
    assert_khz("tscdeadline", r[0]);
}

#[test]
fn smp_both_vcpus_report_and_tick() {
    let dir = TempDir::new("smp");
    let log = dir.0.join("serial.log");
    let mut vm = boot("smp", &builtin("smp", 2, 16, &[]), &log);
    let up = wait_for(Duration::from_secs(10), || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("smp: 2 vCPUs up")
    });
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(up, "smp did not report both vCPUs; serial: {text:?}");
    assert!(text.contains("smp: BSP up\n"), "{text:?}");
    assert!(text.contains("smp: AP up\n"), "{text:?}");
    assert_eq!(read_u32(&vm, RESULTS_ADDR + result::AP_UP), 1);
    assert!(
        wait_for(Duration::from_secs(5), || read_u32(
            &vm,
            RESULTS_ADDR + result::BSP_TICKS
        ) > 10
            && read_u32(&vm, RESULTS_ADDR + result::AP_TICKS) > 10),
        "timers did not tick on both vCPUs"
    );
    vm.stop();
}

#[test]
fn memwriter_pattern_reads_back_from_the_memfd() {
    const PAGES: u32 = 64;
    const BASE: u32 = 0x20_0000;
    let dir = TempDir::new("memwriter");
    let log = dir.0.join("serial.log");
    let mut vm = boot("memwriter", &builtin("memwriter", 1, 16, &[PAGES, BASE, 0]), &log);
    assert!(
        wait_for(Duration::from_secs(20), || read_u32(
            &vm,
            RESULTS_ADDR + result::PATTERN_DONE
        ) == 1),
        "memwriter did not finish; serial: {:?}",
        std::fs::read_to_string(&log)
    );
    let c0 = read_u32(&vm, RESULTS_ADDR + result::LOOP_COUNTER);
    assert!(wait_for(Duration::from_secs(5), || read_u32(
        &vm,
        RESULTS_ADDR + result::LOOP_COUNTER
    ) > c0));
    vm.stop();
    // Read through the memfd itself, not the mapping the guest used.
    let mut page = vec![0u8; 4096];
    for i in 0..PAGES {
        vm.memfd()
            .read_exact_at(&mut page, u64::from(BASE) + u64::from(i) * 4096)
            .unwrap();
        let want = memwriter_pattern(i).to_le_bytes();
        assert!(page.chunks(4).all(|d| d == want), "page {i} does not hold the pattern");
    }
    // The page after the last is untouched.
    vm.memfd()
        .read_exact_at(&mut page, u64::from(BASE) + u64::from(PAGES) * 4096)
        .unwrap();
    assert!(page.iter().all(|&b| b == 0));
}
