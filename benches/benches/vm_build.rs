//! What the VMM does before a Linux guest runs (issue 13), step by step,
//! against the floor: the same machine's KVM ioctls alone.
//!
//! k7d: `Vm::new` of a Linux VM — the stock Debian cloud kernel and an
//! initramfs from the lab's cache, 2 vCPUs, 256 MiB, virtio-pci blk (a
//! sparse raw image), net (its own tap) and rng — never started (the host's
//! `/dev/kvm` is PVM: a stock guest would not boot here, and the build is
//! all the VMM's). Each step's median comes from `Vm::build_steps`.
//! Floor: `/dev/kvm` opened, `KVM_CREATE_VM`, a memfd of the same size
//! mapped and registered as the memslot, `KVM_CREATE_IRQCHIP`,
//! `KVM_CREATE_PIT2`, 2 × `KVM_CREATE_VCPU`, in one run interleaved with
//! k7d's builds; and the kernel and initrd files read into that machine's
//! fresh RAM (fresh pages and a copy: what loading them costs at least).
//!
//! Run: `cargo bench -p k7d-benches --bench vm_build` (root, /dev/kvm, the
//! lab's cache: `tests/lab/run.sh --fetch`). `K7D_BENCH_RUNS` sets the builds
//! per side (default 31).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k7d_benches::{env_num, median};
use k7d_vmm::{Vm, VmOptions};
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::Kvm;

const MIB: u64 = 256;

/// The lab cache's Debian cloud kernel and its newest initramfs.
fn lab_files() -> Result<(PathBuf, PathBuf)> {
    let cache = k7d_tests::lab_cache();
    let newest_cpio = std::fs::read_dir(cache.join("images"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|f| f.file_name().to_string_lossy().ends_with(".cpio"))
        .max_by_key(|f| f.metadata().and_then(|m| m.modified()).ok());
    match (k7d_tests::cached_cloud_kernel(), newest_cpio) {
        (Some(k), Some(i)) => Ok((k, i.path())),
        _ => bail!(
            "no Debian cloud kernel and initramfs in {}: fetch them with tests/lab/run.sh --fetch (and run one lab scenario for an initramfs)",
            cache.display()
        ),
    }
}

/// The floors: the KVM objects of the same machine, nothing else; then the
/// same kernel and initrd files read into that machine's fresh RAM (what
/// loading them must cost at least: fresh pages, and a copy).
fn floor(kernel: &std::path::Path, initrd: &std::path::Path) -> Result<(Duration, Duration)> {
    let t = Instant::now();
    let kvm = Kvm::new()?;
    let vm = kvm.create_vm()?;
    let size = MIB << 20;
    // SAFETY: memfd_create with a valid NUL-terminated name; the fd is owned below.
    let fd = unsafe { libc::memfd_create(c"k7d-bench-floor".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        bail!("memfd_create: {}", std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh fd that nothing else owns.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(size)?;
    // SAFETY: a fresh shared mapping of the memfd, unmapped below after the
    // VM (the only other user) is gone.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        bail!("mmap: {}", std::io::Error::last_os_error());
    }
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: size,
        userspace_addr: addr as u64,
        flags: 0,
    };
    // SAFETY: the region is a live mapping of `size` bytes that outlives the VM.
    unsafe { vm.set_user_memory_region(region)? };
    vm.create_irq_chip()?;
    vm.create_pit2(kvm_bindings::kvm_pit_config::default())?;
    let vcpus = [vm.create_vcpu(0)?, vm.create_vcpu(1)?];
    let took = t.elapsed();
    let t = Instant::now();
    {
        // SAFETY: the mapping is `size` bytes, this process's alone (the
        // VM's vCPUs never run), and outlives the slice.
        let ram = unsafe { std::slice::from_raw_parts_mut(addr.cast::<u8>(), size as usize) };
        let mut at = 1 << 20;
        for path in [kernel, initrd] {
            let mut f = std::fs::File::open(path)?;
            let len = f.metadata()?.len() as usize;
            f.read_exact(&mut ram[at..at + len])?;
            at += len.next_multiple_of(4096);
        }
    }
    let files = t.elapsed();
    drop(vcpus);
    drop(vm);
    // SAFETY: the mapping made above; the VM that used it is gone.
    unsafe { libc::munmap(addr, size as usize) };
    Ok((took, files))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() -> Result<()> {
    let runs = env_num("K7D_BENCH_RUNS", 31);
    let (kernel, initrd) = lab_files()?;
    let dir = std::env::temp_dir().join(format!("k7d-bench-build-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let disk = dir.join("disk.raw");
    std::fs::File::create(&disk)?.set_len(64 << 20)?;
    let cfg = k7d_tests::linux_build_config(&kernel, &initrd, &disk);
    cfg.validate().context("the bench's VM config")?;
    let opts = VmOptions::default();

    let mut steps: BTreeMap<usize, (&'static str, Vec<f64>)> = BTreeMap::new();
    let (mut total, mut floors, mut file_floors) = (Vec::new(), Vec::new(), Vec::new());
    // Warm both (page cache for the files, KVM's module state).
    drop(Vm::new("bench-build-warm", &cfg, &opts)?);
    floor(&kernel, &initrd)?;
    for round in 0..runs {
        let t = Instant::now();
        let vm = Vm::new(&format!("bench-build-{round}"), &cfg, &opts).context("build the VM")?;
        total.push(ms(t.elapsed()));
        for (i, &(name, d)) in vm.build_steps().iter().enumerate() {
            steps.entry(i).or_insert((name, Vec::new())).1.push(ms(d));
        }
        drop(vm);
        let (f, files) = floor(&kernel, &initrd)?;
        floors.push(ms(f));
        file_floors.push(ms(files));
    }
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "Vm::new of a Linux VM ({}, {} initramfs of {} MiB, 2 vCPUs, {MIB} MiB, blk + net + rng), {runs} builds; medians in ms",
        kernel.display(),
        initrd.display(),
        std::fs::metadata(&initrd).map(|m| m.len() >> 20).unwrap_or(0)
    );
    for (name, v) in steps.values_mut() {
        println!("  {name:<72} {:>8.3}", median(v));
    }
    let (t, f) = (median(&mut total), median(&mut floors));
    println!("  {:<72} {t:>8.3}", "total (Vm::new)");
    println!(
        "  {:<72} {f:>8.3}",
        "floor: the KVM ioctls alone (VM, memfd memslot, irqchip, PIT2, 2 vCPUs)"
    );
    println!("  {:<72} {:>8.2}x", "k7d / floor", t / f);
    println!(
        "  {:<72} {:>8.3}",
        "floor: kernel + initrd read into the fresh RAM of that machine",
        median(&mut file_floors)
    );
    println!(
        "  {:<72} {:>8.2}x",
        "k7d / both floors",
        t / (f + median(&mut file_floors))
    );
    Ok(())
}
