//! `k7d demo`: k7d's main job on embedded guests, on any KVM host (PVM
//! included). A small cluster of `memwriter` test guests boots and keeps
//! dirtying memory; it is forked as a cluster, under one pause, a few
//! times; every page of every child is compared with its member at the
//! fork instant; and the fork's cost is printed beside its floor measured
//! in the same run (building the bare KVM VM a child needs at least).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k7d_guest::{RESULTS_ADDR, result};
use vm_memory::{Bytes, GuestAddress};

use crate::config::{GuestSpec, VmConfig};
use crate::vstate::cluster::ClusterPause;
use crate::vstate::vm::{Vm, VmOptions};

/// Pages each member keeps dirtying, from guest address 2 MiB.
const DIRTY_PAGES: u32 = 64;
const DIRTY_BASE: u32 = 0x20_0000;

/// What the demo runs.
#[derive(Debug, Clone, Copy)]
pub struct DemoConfig {
    /// Cluster members.
    pub members: usize,
    /// Cluster forks, one batch each.
    pub forks: usize,
    /// Guest RAM per member, MiB.
    pub memory_mib: u64,
}

/// One cluster fork.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Parking every member.
    pub pause: Duration,
    /// Building each child, in member order.
    pub children: Vec<Duration>,
    /// Pages compared, and pages that differed (0 when the fork is right).
    pub pages: usize,
    /// See `pages`.
    pub differing: usize,
}

impl Batch {
    /// The fork's cost: the pause and every child.
    pub fn total(&self) -> Duration {
        self.pause + self.children.iter().sum::<Duration>()
    }
}

/// What the demo saw.
#[derive(Debug, Clone)]
pub struct Report {
    /// The forks.
    pub batches: Vec<Batch>,
    /// The floor per child: building a bare KVM VM of the same size (median of 3).
    pub floor_vm: Duration,
    /// Each member's loop counter at the end (they ran on between forks).
    pub counters: Vec<u32>,
}

fn member_config(id: &str, memory_mib: u64) -> VmConfig {
    VmConfig {
        id: Some(id.into()),
        vcpus: 1,
        memory_mib,
        guest: GuestSpec::Builtin {
            name: "memwriter".into(),
            args: vec![DIRTY_PAGES, DIRTY_BASE, 1],
        },
        ..Default::default()
    }
}

fn counter(vm: &Vm) -> u32 {
    vm.memory()
        .read_obj(GuestAddress(RESULTS_ADDR + result::LOOP_COUNTER))
        .unwrap_or(0)
}

fn ram(vm: &Vm, size: usize) -> Result<Vec<u8>> {
    let mut v = vec![0u8; size];
    vm.memory()
        .read_slice(&mut v, GuestAddress(0))
        .with_context(|| format!("cannot read vm {}'s RAM", vm.id()))?;
    Ok(v)
}

/// Runs the demo; `say` gets a line per step.
pub fn run(cfg: &DemoConfig, mut say: impl FnMut(String)) -> Result<Report> {
    if !(1..=8).contains(&cfg.members) || !(1..=100).contains(&cfg.forks) || !(8..=1024).contains(&cfg.memory_mib) {
        bail!("the demo takes 1 to 8 members, 1 to 100 forks and 8 to 1024 MiB per member");
    }
    let size = usize::try_from(cfg.memory_mib << 20).context("the guest RAM size does not fit this host")?;
    let names: Vec<String> = (0..cfg.members)
        .map(|i| format!("demo-{}", char::from(b'a' + i as u8)))
        .collect();
    let mut members = Vec::with_capacity(cfg.members);
    for n in &names {
        let mut vm = Vm::new(n, &member_config(n, cfg.memory_mib), &VmOptions::default())
            .with_context(|| format!("cannot build vm {n}"))?;
        vm.start().with_context(|| format!("cannot start vm {n}"))?;
        members.push(vm);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while members.iter().any(|m| counter(m) < 1000) {
        if Instant::now() > deadline {
            bail!("the memwriter guests did not start looping within 20 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    say(format!(
        "{} memwriter guests running under KVM ({} MiB, 1 vCPU each), each rewriting {DIRTY_PAGES} pages in a loop",
        cfg.members, cfg.memory_mib
    ));

    let mut batches = Vec::with_capacity(cfg.forks);
    for b in 0..cfg.forks {
        // The members run between forks.
        std::thread::sleep(Duration::from_millis(2));
        let refs: Vec<&Vm> = members.iter().collect();
        let held = ClusterPause::pause(&refs, Duration::from_secs(2)).context("cannot pause the cluster")?;
        let at_fork: Vec<Vec<u8>> = refs.iter().map(|m| ram(m, size)).collect::<Result<_>>()?;
        let ids = vec![names.iter().map(|n| format!("{n}-f{}", b + 1)).collect::<Vec<_>>()];
        let children = held
            .fork(&ids, |_| VmOptions::default())
            .context("the cluster fork failed")?;
        let pause = held.took();
        held.resume().context("cannot resume the cluster")?;
        let (mut pages, mut differing) = (0, 0);
        for (m, child) in children.vms[0].iter().enumerate() {
            let got = ram(child, size)?;
            for (a, c) in at_fork[m].chunks(4096).zip(got.chunks(4096)) {
                pages += 1;
                differing += usize::from(a != c);
            }
        }
        let batch = Batch {
            pause,
            children: children.times[0].clone(),
            pages,
            differing,
        };
        say(format!(
            "fork {}: {} members paused in {:.2} ms, children built in {} ms: {:.2} ms in all; {}",
            b + 1,
            cfg.members,
            ms(batch.pause),
            batch
                .children
                .iter()
                .map(|d| format!("{:.2}", ms(*d)))
                .collect::<Vec<_>>()
                .join(" + "),
            ms(batch.total()),
            if differing == 0 {
                format!("every page of every child equals its member at the fork ({pages} pages)")
            } else {
                format!("{differing} of {pages} pages DIFFER")
            }
        ));
        batches.push(batch);
    }
    let counters = members.iter().map(counter).collect();
    for m in &mut members {
        m.stop();
    }
    drop(members);

    let mut floors = Vec::with_capacity(3);
    for i in 0..3 {
        let cfg = VmConfig {
            memory_mib: cfg.memory_mib,
            guest: GuestSpec::Builtin {
                name: "idle".into(),
                args: Vec::new(),
            },
            ..Default::default()
        };
        let t = Instant::now();
        let vm = Vm::new(&format!("floor-{i}"), &cfg, &VmOptions::default()).context("cannot build the floor VM")?;
        floors.push(t.elapsed());
        drop(vm);
    }
    floors.sort();
    Ok(Report {
        batches,
        floor_vm: floors[1],
        counters,
    })
}

/// Milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
