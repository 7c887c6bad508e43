//! A VM in its own jailed process (issue 36, `vmm/src/vmproc/`) against the
//! same VM built in this process, same run, alternating: create → the
//! guest's first loop iterations (the `memwriter` guest's loop counter
//! leaving 0, read from guest RAM; through the channel for the VM
//! process), and what a VM process costs in memory (its PSS and RSS with
//! the guest running; the guest has touched 64 pages, 256 KiB).
//! Goal (issue 36): start ≤ 1.3× in-process, ≤ 2.5 MiB PSS beyond guest RAM.
//!
//! Run as root: `cargo build --release --bin k7d && cargo bench -p k7d-benches --bench vm_process`
//! (`K7D_BENCH_RUNS` sets the run count, default 21).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k7d_api::config::{GuestSpec, VmConfig};
use k7d_benches::{env_num, is_root, k7d_bin, median};
use k7d_vmm::jail::JailConfig;
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::vmproc::handle::VmProcess;
use k7d_vmm::vmproc::proto::{Reply, Request};
use k7d_vmm::{Vm, VmOptions};

const COUNTER: u64 = k7d_guest::RESULTS_ADDR + k7d_guest::result::LOOP_COUNTER;
const MIB: u64 = 16;

fn config() -> VmConfig {
    VmConfig {
        memory_mib: MIB,
        guest: GuestSpec::Builtin {
            name: "memwriter".into(),
            args: vec![64, 0x20_0000, 1],
        },
        ..Default::default()
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> Result<bool>) -> Result<()> {
    let t = Instant::now();
    while !f()? {
        if t.elapsed() > Duration::from_secs(10) {
            bail!("{what} within 10 s");
        }
        std::hint::spin_loop();
    }
    Ok(())
}

/// In this process: build, start, until the loop counter moves.
fn in_process(i: usize) -> Result<Duration> {
    let t = Instant::now();
    let mut vm = Vm::new(&format!("inproc{i}"), &config(), &VmOptions::default())?;
    vm.start()?;
    wait_until("the in-process guest did not run", || {
        Ok(vm.memory().read_obj::<u32>(GuestAddress(COUNTER))? > 0)
    })?;
    let took = t.elapsed();
    vm.stop();
    Ok(took)
}

fn ok(p: &mut VmProcess, r: Request) -> Result<()> {
    match p.call(&r).map_err(anyhow::Error::msg)? {
        Reply::Ok => Ok(()),
        other => bail!("{r:?}: {other:?}"),
    }
}

fn peek(p: &mut VmProcess) -> Result<u32> {
    match p
        .call(&Request::Peek {
            addr: COUNTER,
            count: 1,
        })
        .map_err(anyhow::Error::msg)?
    {
        Reply::Peeked { words } => Ok(words[0]),
        other => bail!("peek: {other:?}"),
    }
}

/// In a VM process: spawn (jail), build, start, until the loop counter
/// moves; `pss` gets the process's PSS and RSS (KiB) while it runs.
fn vm_process(i: usize, k7d: &std::path::Path, dir: &std::path::Path, pss: &mut Vec<(u64, u64)>) -> Result<Duration> {
    let root = dir.join(format!("vm{i}"));
    std::fs::create_dir(&root)?;
    let id = 2_000_000_500 + i as u32;
    let jail = JailConfig {
        root,
        uid: id,
        gid: id,
        keep_fds: Vec::new(),
    };
    let t = Instant::now();
    let mut p = VmProcess::spawn(k7d, &jail).map_err(anyhow::Error::msg)?;
    ok(
        &mut p,
        Request::Build {
            id: format!("vmproc{i}"),
            config: Box::new(config()),
            files: Vec::new(),
            serial_log: None,
            node: Default::default(),
        },
    )?;
    ok(&mut p, Request::Start)?;
    wait_until("the VM process's guest did not run", || Ok(peek(&mut p)? > 0))?;
    let took = t.elapsed();
    let rollup = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", p.pid)).unwrap_or_default();
    let kib = |k: &str| {
        rollup
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    pss.push((kib("Pss:"), kib("Rss:")));
    ok(&mut p, Request::Stop)?;
    Ok(took)
}

fn main() -> Result<()> {
    if !is_root() {
        println!("vm_process: skipped (a VM process's jail needs root)");
        return Ok(());
    }
    let runs = env_num("K7D_BENCH_RUNS", 21);
    let k7d = k7d_bin()?;
    let dir = std::env::temp_dir().join(format!("k7d-bench-vmproc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).context("scratch dir")?;
    let (mut inproc, mut vmproc, mut pss) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..runs {
        inproc.push(in_process(i)?.as_secs_f64() * 1e3);
        vmproc.push(vm_process(i, &k7d, &dir, &mut pss)?.as_secs_f64() * 1e3);
    }
    let _ = std::fs::remove_dir_all(&dir);
    let (a, b) = (median(&mut inproc), median(&mut vmproc));
    let mut p: Vec<f64> = pss.iter().map(|(p, _)| *p as f64 / 1024.0).collect();
    let mut r: Vec<f64> = pss.iter().map(|(_, r)| *r as f64 / 1024.0).collect();
    println!("vm_process: create -> guest running, median of {runs} (memwriter, {MIB} MiB, 1 vCPU)");
    println!("  in this process:   {a:8.2} ms");
    println!("  in a VM process:   {b:8.2} ms  ({:.2}x; goal <= 1.3x)", b / a);
    println!(
        "  a VM process's PSS: {:.2} MiB, RSS {:.2} MiB (median; the guest touched 0.25 MiB of its RAM; goal <= 2.5 MiB beyond guest RAM)",
        median(&mut p),
        median(&mut r)
    );
    Ok(())
}
