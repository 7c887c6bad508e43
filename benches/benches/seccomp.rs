//! What the seccomp filters cost (issue 12): the same operations with
//! `--seccomp enforce` and `--seccomp off`, interleaved in one run, as
//! medians and ratios (goal: no measurable cost, ratio <= 1.03).
//!
//! - start: `k7d run --builtin hello` process spawn -> first guest serial byte
//!   (every filter installed before the guest runs is on that path);
//! - pause + resume, and fork (one child, then its delete), as API round
//!   trips to two daemons, one per mode, each holding a running 64 MiB VM.
//!
//! Each round runs both modes, in alternating order.
//!
//! Run: `cargo build --release --bin k7d && cargo bench -p k7d-benches --bench seccomp`
//! (root, /dev/kvm). `K7D_BENCH_RUNS` sets the runs per cell (default 31).

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use k7d_api::api::{CreateArgs, ForkArgs, Request};
use k7d_api::config::{GuestSpec, VmConfig};
use k7d_benches::daemon::Daemon;
use k7d_benches::{env_num, k7d_bin, median, time_to_first_stdout_byte};

const MODES: [&str; 2] = ["enforce", "off"];

fn time(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64() * 1000.0)
}

fn row(name: &str, on: &mut [f64], off: &mut [f64]) {
    let (a, b) = (median(on), median(off));
    println!(
        "{name:<34} {a:>12.3} {b:>12.3} {:>8.3}{}",
        a / b,
        if a / b <= 1.03 { "" } else { "  (> 1.03)" }
    );
}

fn main() -> Result<()> {
    let runs = env_num("K7D_BENCH_RUNS", 31);
    let k7d = k7d_bin()?;
    let run_cmd = |mode: &str| {
        let mut c = Command::new(&k7d);
        c.args(["--seccomp", mode, "run", "--builtin", "hello", "--memory", "64"]);
        c
    };
    let mut start: [Vec<f64>; 2] = Default::default();
    for m in MODES {
        time_to_first_stdout_byte(&mut run_cmd(m), Duration::from_secs(5))?; // warm
    }
    // Each round alternates which mode goes first: whatever the first of a
    // pair pays (a cold cache, a timer tick) falls on both alike.
    let order = |round: usize| if round.is_multiple_of(2) { [0, 1] } else { [1, 0] };
    for round in 0..runs {
        for i in order(round) {
            let m = MODES[i];
            let d = time_to_first_stdout_byte(&mut run_cmd(m), Duration::from_secs(5))?;
            start[i].push(d.as_secs_f64() * 1000.0);
        }
    }

    let daemons = [
        Daemon::start(&k7d, "seccomp-enforce", &["--seccomp", MODES[0]])?,
        Daemon::start(&k7d, "seccomp-off", &["--seccomp", MODES[1]])?,
    ];
    let config = VmConfig {
        id: Some("src".into()),
        memory_mib: 64,
        guest: GuestSpec::Builtin {
            name: "pit".into(),
            args: vec![],
        },
        ..Default::default()
    };
    for d in &daemons {
        d.client()?
            .call(&Request::Create(CreateArgs {
                config: config.clone(),
                start: true,
            }))
            .context("create the source VM")?;
    }
    let (mut pr, mut fork): ([Vec<f64>; 2], [Vec<f64>; 2]) = Default::default();
    for round in 0..runs {
        for i in order(round) {
            let d = &daemons[i];
            let mut c = d.client()?;
            pr[i].push(time(|| {
                c.call(&Request::Pause("src".into()))?;
                c.call(&Request::Resume("src".into()))?;
                Ok(())
            })?);
            let mut child = String::new();
            fork[i].push(time(|| {
                let v = c.call(&Request::Fork(ForkArgs {
                    id: "src".into(),
                    count: 1,
                    ..Default::default()
                }))?;
                child = v["children"][0]["id"].as_str().unwrap_or_default().to_string();
                Ok(())
            })?);
            c.call(&Request::Delete(child)).context("delete the child")?;
        }
    }
    println!("seccomp filters on (enforce) vs off, {runs} runs per cell, interleaved; medians in ms");
    println!("{:<34} {:>12} {:>12} {:>8}", "", "enforce", "off", "ratio");
    row(
        "k7d run: spawn -> first guest byte",
        &mut start[0].clone(),
        &mut start[1].clone(),
    );
    row(
        "pause + resume (API round trips)",
        &mut pr[0].clone(),
        &mut pr[1].clone(),
    );
    row(
        "fork, 1 child of 64 MiB (API)",
        &mut fork[0].clone(),
        &mut fork[1].clone(),
    );
    println!("goal: ratio <= 1.03 (no measurable cost)");
    Ok(())
}
