//! VMM process start → first guest instruction, k7d vs QEMU, same run.
//!
//! Both VMMs run the same guest program (`hello`): k7d loads it at 0x8000,
//! QEMU gets it as a 64 KiB `-bios` image with a reset-vector jump. The
//! observable "first guest instruction" is the guest's first `out` to the
//! serial port, which both VMMs turn into a byte on stdout: we time process
//! spawn → that byte. Runs alternate k7d / QEMU so drift hits both.
//!
//! Run: `cargo build --release --bin k7d && cargo bench -p k7d-benches --bench start_latency`
//! (needs `qemu-system-x86` from Debian; `K7D_BENCH_RUNS` sets the run count).

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result};
use k7d_benches::{k7d_bin, ms, stats, time_to_first_stdout_byte, which};

fn main() -> Result<()> {
    let runs: usize = std::env::var("K7D_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(31);
    let k7d = k7d_bin()?;
    let qemu = which("qemu-system-x86_64").context("qemu-system-x86_64 not found: apt-get install qemu-system-x86")?;
    let bios = std::env::temp_dir().join(format!("k7d-bench-hello-bios-{}.bin", std::process::id()));
    std::fs::write(&bios, k7d_guest::hello_bios_image())?;
    let qemu_version = Command::new(&qemu).arg("--version").output()?;
    let qemu_version = String::from_utf8_lossy(&qemu_version.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .to_string();

    let k7d_cmd = || {
        let mut c = Command::new(&k7d);
        c.args(["run", "--builtin", "hello", "--memory", "64"]);
        c
    };
    let qemu_cmd = || {
        let mut c = Command::new(&qemu);
        c.args([
            "-accel",
            "kvm",
            "-machine",
            "pc",
            "-m",
            "64",
            "-nodefaults",
            "-no-user-config",
        ])
        .args([
            "-display",
            "none",
            "-monitor",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
            "-bios",
        ])
        .arg(&bios);
        c
    };
    // Warm both (page cache, dynamic loader).
    time_to_first_stdout_byte(&mut k7d_cmd(), Duration::from_secs(5))?;
    time_to_first_stdout_byte(&mut qemu_cmd(), Duration::from_secs(5))?;
    let (mut k, mut q) = (Vec::new(), Vec::new());
    for _ in 0..runs {
        k.push(time_to_first_stdout_byte(&mut k7d_cmd(), Duration::from_secs(5))?);
        q.push(time_to_first_stdout_byte(&mut qemu_cmd(), Duration::from_secs(5))?);
    }
    let _ = std::fs::remove_file(&bios);
    let (km, kmin, kmax) = stats(&k);
    let (qm, qmin, qmax) = stats(&q);
    println!(
        "VMM process start -> first guest instruction (first serial byte of `hello`), {runs} runs each, alternating"
    );
    println!("{:<44} {:>10} {:>10} {:>10}", "", "median", "min", "max");
    println!(
        "{:<44} {:>10} {:>10} {:>10}",
        "k7d run (embedded hello, 64 MiB)",
        ms(km),
        ms(kmin),
        ms(kmax)
    );
    println!(
        "{:<44} {:>10} {:>10} {:>10}",
        format!(
            "QEMU -accel kvm -bios hello ({})",
            qemu_version.trim_start_matches("QEMU emulator version ")
        ),
        ms(qm),
        ms(qmin),
        ms(qmax)
    );
    let ratio = km.as_secs_f64() / qm.as_secs_f64();
    println!(
        "ratio k7d / QEMU (medians): {ratio:.3}  (goal <= 0.2: {})",
        if ratio <= 0.2 { "met" } else { "NOT met" }
    );
    Ok(())
}
