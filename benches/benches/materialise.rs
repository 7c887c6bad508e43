//! Materialising a fork child's diverged pages (issue 16, item 4): the
//! variant that copies them at fork time (k7d's, `GuestRam::copy_diverged_from`)
//! against the variant that does not materialise anything at fork time,
//! a child served by userfaultfd (its RAM the base mapped privately and
//! registered in minor-fault mode; a handler thread answers each first
//! touch of a page: a diverged page is copied in from the source
//! (`UFFDIO_COPY`), any other mapped from the base (`UFFDIO_CONTINUE`)).
//! Side by side in one run, on the same memfd, source and pages, with
//! what each costs at fork time and what the child pays at run time when
//! it first touches its diverged pages and then the rest of its RAM.
//! The handler spins (no poll): its fastest form.
//!
//! No VM is involved: these are the memory operations a fork and a child
//! make, on this host's kernel (under PVM every page-table change is the
//! expensive part).
//!
//! Run: `cargo bench -p k7d-benches --bench materialise` (root, or
//! `vm.unprivileged_userfaultfd = 1`). `K7D_BENCH_MIB` sets the RAM
//! (default 256).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k7d_benches::env_num;

const PAGE: usize = 4096;
const UFFDIO_API: u64 = 0xc018_aa3f;
const UFFDIO_REGISTER: u64 = 0xc020_aa00;
const UFFDIO_COPY: u64 = 0xc028_aa03;
const UFFDIO_CONTINUE: u64 = 0xc020_aa07;
const UFFD_API: u64 = 0xaa;
const UFFD_FEATURE_MINOR_SHMEM: u64 = 1 << 10;
const UFFDIO_REGISTER_MODE_MINOR: u64 = 1 << 2;
const UFFD_EVENT_PAGEFAULT: u8 = 0x12;

fn map(len: usize, fd: i32, shared: bool) -> Result<*mut u8> {
    let flags = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
    // SAFETY: a new mapping of our own memfd, placed by the kernel.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error()).context("mmap");
    }
    Ok(p.cast())
}

fn unmap(p: *mut u8, len: usize) {
    // SAFETY: `p` is a mapping of `len` bytes this bench made and no longer uses.
    unsafe { libc::munmap(p.cast(), len) };
}

/// First touch (a read) of every page in `pages`; returns how long it
/// took and how many pages did not read `want(page)`.
fn touch(base: *mut u8, pages: &[usize], want: impl Fn(usize) -> u8) -> (Duration, usize) {
    let t = Instant::now();
    let mut bad = 0;
    for &p in pages {
        // SAFETY: `p` is a page index inside the mapping at `base`.
        let b = unsafe { std::ptr::read_volatile(base.add(p * PAGE)) };
        bad += usize::from(b != want(p));
    }
    (t.elapsed(), bad)
}

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioContinue {
    range: UffdioRange,
    mode: u64,
    mapped: i64,
}

fn ioctl<T>(fd: i32, req: u64, arg: &mut T) -> std::io::Result<()> {
    // SAFETY: `arg` is the `repr(C)` struct `req` reads and writes.
    if unsafe { libc::ioctl(fd, req as _, arg as *mut T) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A userfaultfd in minor-fault mode over `[child, child + len)`.
fn uffd_register(child: *mut u8, len: usize) -> Result<i32> {
    // SAFETY: userfaultfd(2) with flags only.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) } as i32;
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("userfaultfd");
    }
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_MINOR_SHMEM,
        ioctls: 0,
    };
    let mut reg = UffdioRegister {
        range: UffdioRange {
            start: child as u64,
            len: len as u64,
        },
        mode: UFFDIO_REGISTER_MODE_MINOR,
        ioctls: 0,
    };
    let r = ioctl(fd, UFFDIO_API, &mut api)
        .context("UFFDIO_API with minor faults on shmem")
        .and_then(|()| ioctl(fd, UFFDIO_REGISTER, &mut reg).context("UFFDIO_REGISTER (minor)"));
    if r.is_err() {
        // SAFETY: our own descriptor, closed once, on this failure only.
        unsafe { libc::close(fd) };
    }
    r.map(|()| fd)
}

/// The handler: answers page faults until `stop`, spinning on a
/// non-blocking read; counts the faults served.
fn serve(fd: i32, child: usize, src: usize, diverged: &[bool], stop: &AtomicBool, served: &AtomicU64) {
    let mut msg = [0u8; 32];
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: reads at most 32 bytes into `msg`.
        let n = unsafe { libc::read(fd, msg.as_mut_ptr().cast(), msg.len()) };
        if n != 32 {
            std::hint::spin_loop();
            continue;
        }
        if msg[0] != UFFD_EVENT_PAGEFAULT {
            continue;
        }
        let addr = u64::from_ne_bytes(msg[16..24].try_into().unwrap_or_default()) as usize & !(PAGE - 1);
        let page = (addr - child) / PAGE;
        let r = if diverged.get(page).copied().unwrap_or(false) {
            let mut c = UffdioCopy {
                dst: addr as u64,
                src: (src + page * PAGE) as u64,
                len: PAGE as u64,
                mode: 0,
                copy: 0,
            };
            ioctl(fd, UFFDIO_COPY, &mut c)
        } else {
            let mut c = UffdioContinue {
                range: UffdioRange {
                    start: addr as u64,
                    len: PAGE as u64,
                },
                mode: 0,
                mapped: 0,
            };
            ioctl(fd, UFFDIO_CONTINUE, &mut c)
        };
        match r {
            Ok(()) => {
                served.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => eprintln!("uffd handler: {e}"),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() -> Result<()> {
    let mib = env_num("K7D_BENCH_MIB", 256);
    let len = mib << 20;
    let pages = len / PAGE;
    println!("materialising a fork child's diverged pages: {mib} MiB, one run per cell");
    println!(
        "{:>6} | {:>10} {:>12} {:>12} | {:>10} {:>12} {:>12} | {:>11}",
        "dirty", "copy: fork", "its diverged", "the rest", "uffd: fork", "its diverged", "the rest", "us/page c/u"
    );
    for pct in [1usize, 10] {
        let name = std::ffi::CString::new("k7d-bench-base")?;
        // SAFETY: memfd_create with a valid name.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            bail!("memfd_create: {}", std::io::Error::last_os_error());
        }
        // SAFETY: sizing our own memfd.
        if unsafe { libc::ftruncate(fd, len as i64) } != 0 {
            bail!("ftruncate: {}", std::io::Error::last_os_error());
        }
        // The base: every page holds 1. The source: its private view, with
        // every `stride`-th page written (2): its divergence.
        let shared = map(len, fd, true)?;
        // SAFETY: `shared` maps `len` writable bytes.
        unsafe { std::ptr::write_bytes(shared, 1, len) };
        let src = map(len, fd, false)?;
        let stride = 100 / pct;
        let diverged: Vec<bool> = (0..pages).map(|p| p % stride == 0).collect();
        let dpages: Vec<usize> = (0..pages).filter(|&p| diverged[p]).collect();
        let rest: Vec<usize> = (0..pages).filter(|&p| !diverged[p]).collect();
        for &p in &dpages {
            // SAFETY: inside the source's mapping.
            unsafe { src.add(p * PAGE).write_volatile(2) };
        }
        let want = |p: usize| if diverged[p] { 2 } else { 1 };

        // Copy at fork time.
        let t = Instant::now();
        let child = map(len, fd, false)?;
        for &p in &dpages {
            // SAFETY: both mappings hold page `p`; they do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(src.add(p * PAGE), child.add(p * PAGE), PAGE) };
        }
        let copy_fork = t.elapsed();
        let (copy_div, b1) = touch(child, &dpages, want);
        let (copy_rest, b2) = touch(child, &rest, want);
        unmap(child, len);

        // userfaultfd: nothing at fork time but a mapping and a register.
        let t = Instant::now();
        let child = map(len, fd, false)?;
        let uffd = uffd_register(child, len);
        let uffd_fork = t.elapsed();
        let cells = match uffd {
            Ok(ufd) => {
                let stop = Arc::new(AtomicBool::new(false));
                let served = Arc::new(AtomicU64::new(0));
                let (c, s, d) = (child as usize, src as usize, diverged.clone());
                let (st, sv) = (stop.clone(), served.clone());
                let h = std::thread::spawn(move || serve(ufd, c, s, &d, &st, &sv));
                let (u_div, b3) = touch(child, &dpages, want);
                let (u_rest, b4) = touch(child, &rest, want);
                stop.store(true, Ordering::Relaxed);
                let _ = h.join();
                // SAFETY: our own descriptor, closed once.
                unsafe { libc::close(ufd) };
                if b3 + b4 > 0 {
                    bail!("the userfaultfd child read {} wrong pages", b3 + b4);
                }
                if served.load(Ordering::Relaxed) != pages as u64 {
                    bail!(
                        "the handler served {} faults for {pages} pages",
                        served.load(Ordering::Relaxed)
                    );
                }
                Some((u_div, u_rest))
            }
            Err(e) => {
                println!("(the userfaultfd variant cannot run here: {e:#})");
                None
            }
        };
        unmap(child, len);
        unmap(src, len);
        unmap(shared, len);
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        if b1 + b2 > 0 {
            bail!("the copying child read {} wrong pages", b1 + b2);
        }
        let per = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n.max(1) as f64;
        println!(
            "{:>5}% | {:>10.2} {:>12.2} {:>12.2} | {:>10} {:>12} {:>12} | {:>11}",
            pct,
            ms(copy_fork),
            ms(copy_div),
            ms(copy_rest),
            format!("{:.3}", ms(uffd_fork)),
            cells.map_or("-".into(), |c| format!("{:.2}", ms(c.0))),
            cells.map_or("-".into(), |c| format!("{:.2}", ms(c.1))),
            cells.map_or("-".into(), |c| format!(
                "{:.2}/{:.1}",
                per(copy_fork + copy_div, dpages.len()),
                per(c.0, dpages.len())
            )),
        );
    }
    Ok(())
}
