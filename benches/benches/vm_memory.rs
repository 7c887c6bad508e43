//! VMM memory per VM (issue 13): the daemon's proportional set size (PSS)
//! beyond the guest RAM its VMs touched, with 0, 1 and 20 idle VMs in one
//! run. Goal: ≤ 3 MiB per VM (Firecracker documents a few MiB per microVM;
//! Kata ≈ 123 MB per pod with virtiofsd).
//!
//! Guest RAM is each VM's memfd, mapped as `/memfd:k7d-ram-<id>`: its PSS is
//! the guest's (the pages the guest and the loader touched) and is counted
//! apart; everything else the daemon maps (heap, vCPU and worker stacks,
//! kvm_run pages, the binary) is the VMM's. Test guests here (the host's
//! `/dev/kvm` runs no stock Linux): `idle`, 1 vCPU, 64 MiB.
//!
//! Run: `cargo build --release --bin k7d && cargo bench -p k7d-benches --bench vm_memory`
//! (root, /dev/kvm). `K7D_BENCH_VMS` sets the larger count (default 20).

use std::time::Duration;

use anyhow::{Context, Result, bail};
use k7d_api::api::{CreateArgs, Request};
use k7d_api::config::{GuestSpec, VmConfig};
use k7d_benches::daemon::Daemon;
use k7d_benches::{env_num, k7d_bin};

/// (the daemon's PSS, the part of it in guest RAM mappings), in KiB.
fn pss(pid: u32) -> Result<(u64, u64)> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).context("read the daemon's smaps")?;
    let (mut total, mut guest, mut in_guest) = (0, 0, false);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            in_guest = line.contains("/memfd:k7d-ram-");
        } else if let Some(v) = line.strip_prefix("Pss:") {
            let kib: u64 = v.trim().trim_end_matches("kB").trim().parse().context("a Pss line")?;
            total += kib;
            if in_guest {
                guest += kib;
            }
        }
    }
    if total == 0 {
        bail!("no Pss in /proc/{pid}/smaps");
    }
    Ok((total, guest))
}

fn settle_and_measure(d: &Daemon) -> Result<(u64, u64)> {
    std::thread::sleep(Duration::from_millis(500));
    pss(d.pid())
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn main() -> Result<()> {
    let n = env_num("K7D_BENCH_VMS", 20).max(2);
    let k7d = k7d_bin()?;
    let d = Daemon::start(&k7d, "memory", &[])?;
    let config = |i: usize| VmConfig {
        id: Some(format!("m{i}")),
        memory_mib: 64,
        guest: GuestSpec::Builtin {
            name: "idle".into(),
            args: vec![],
        },
        ..Default::default()
    };
    let create = |i: usize| -> Result<()> {
        d.client()?
            .call(&Request::Create(CreateArgs {
                config: config(i),
                start: true,
            }))
            .with_context(|| format!("create VM m{i}"))?;
        Ok(())
    };
    let mut rows = vec![(0, settle_and_measure(&d)?)];
    create(0)?;
    rows.push((1, settle_and_measure(&d)?));
    for i in 1..n {
        create(i)?;
    }
    rows.push((n, settle_and_measure(&d)?));

    let (_, (base_total, base_guest)) = rows[0];
    let base_vmm = base_total - base_guest;
    println!("k7d daemon PSS with idle test VMs (idle, 1 vCPU, 64 MiB each), MiB");
    println!(
        "{:>4} {:>12} {:>12} {:>16} {:>14}",
        "VMs", "daemon PSS", "guest RAM", "VMM beyond guest", "VMM per VM"
    );
    for &(vms, (total, guest)) in &rows {
        let vmm = total - guest;
        let per = if vms == 0 {
            String::from("-")
        } else {
            format!("{:.2}", mib(vmm.saturating_sub(base_vmm)) / vms as f64)
        };
        println!(
            "{vms:>4} {:>12.2} {:>12.2} {:>16.2} {per:>14}",
            mib(total),
            mib(guest),
            mib(vmm)
        );
    }
    println!("goal: VMM per VM <= 3 MiB");
    Ok(())
}
