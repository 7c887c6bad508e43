//! End-to-end tests of [`configure_linux`] on synthetic and (if cached) real kernels.

use std::path::PathBuf;

use linux_loader::loader::bootparam::boot_params;
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::vstate::memory::GuestRam;

struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, bytes: &[u8]) -> Self {
        let p = std::env::temp_dir().join(format!("k7d-arch-{}-{name}", std::process::id()));
        std::fs::write(&p, bytes).unwrap();
        Self(p)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn put<const N: usize>(b: &mut [u8], off: usize, v: [u8; N]) {
    b[off..off + N].copy_from_slice(&v);
}

/// A minimal bzImage: 1 setup sector + boot sector, `payload` bytes of code.
fn bzimage(payload: usize, xloadflags: u16) -> Vec<u8> {
    let mut b = vec![0u8; 1024 + payload];
    b[0x1f1] = 1; // setup_sects
    put(&mut b, 0x1f4, ((payload / 16) as u32).to_le_bytes()); // syssize
    put(&mut b, 0x1fe, 0xaa55u16.to_le_bytes());
    put(&mut b, 0x202, *b"HdrS");
    put(&mut b, 0x206, 0x020fu16.to_le_bytes()); // protocol 2.15
    b[0x211] = 1; // LOADED_HIGH
    put(&mut b, 0x214, 0x10_0000u32.to_le_bytes()); // code32_start
    put(&mut b, 0x22c, 0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
    put(&mut b, 0x230, 0x20_0000u32.to_le_bytes()); // kernel_alignment
    b[0x234] = 1; // relocatable
    put(&mut b, 0x236, xloadflags.to_le_bytes());
    put(&mut b, 0x238, 2047u32.to_le_bytes()); // cmdline_size
    put(&mut b, 0x258, 0x100_0000u64.to_le_bytes()); // pref_address
    put(&mut b, 0x260, 0x40_0000u32.to_le_bytes()); // init_size
    for (i, x) in b[1024..].iter_mut().enumerate() {
        *x = (i % 251) as u8;
    }
    b
}

/// A minimal x86-64 ELF vmlinux: one PT_LOAD of `code` at 16 MiB, entry there.
fn elf(class: u8, machine: u16, code: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; 0x1000 + code.len()];
    put(&mut b, 0, *b"\x7fELF");
    b[4] = class;
    b[5] = 1; // little endian
    b[6] = 1;
    put(&mut b, 16, 2u16.to_le_bytes()); // ET_EXEC
    put(&mut b, 18, machine.to_le_bytes());
    put(&mut b, 20, 1u32.to_le_bytes());
    put(&mut b, 24, 0x100_0000u64.to_le_bytes()); // e_entry
    put(&mut b, 32, 64u64.to_le_bytes()); // e_phoff
    put(&mut b, 52, 64u16.to_le_bytes()); // e_ehsize
    put(&mut b, 54, 56u16.to_le_bytes()); // e_phentsize
    put(&mut b, 56, 1u16.to_le_bytes()); // e_phnum
    let ph = 64;
    put(&mut b, ph, 1u32.to_le_bytes()); // PT_LOAD
    put(&mut b, ph + 8, 0x1000u64.to_le_bytes()); // p_offset
    put(&mut b, ph + 16, 0xffff_ffff_8100_0000u64.to_le_bytes()); // p_vaddr
    put(&mut b, ph + 24, 0x100_0000u64.to_le_bytes()); // p_paddr
    put(&mut b, ph + 32, (code.len() as u64).to_le_bytes()); // p_filesz
    put(&mut b, ph + 40, (code.len() as u64 + 0x1000).to_le_bytes()); // p_memsz
    b[0x1000..].copy_from_slice(code);
    b
}

fn cfg<'a>(kernel: &'a Path, initrd: Option<&'a Path>, cmdline: &'a str, vcpus: u32) -> LinuxBootConfig<'a> {
    LinuxBootConfig {
        kernel,
        initrd,
        cmdline,
        vcpus,
        pci: Some(PciConfig {
            ecam: true,
            mmio64: None,
        }),
        irq0_override: false,
        vmgenid: true,
        kernel_cache: None,
        files: None,
    }
}

fn zero_page(mem: &GuestMemoryMmap) -> boot_params {
    mem.read_obj(GuestAddress(ZERO_PAGE_ADDR)).unwrap()
}

fn one_sentence(msg: &str, path: &Path) {
    assert!(msg.contains(&path.display().to_string()), "names the file: {msg}");
    assert!(!msg.contains('\n'), "one line: {msg}");
    assert_eq!(msg.matches(". ").count(), 0, "one sentence: {msg}");
}

fn refuse(bytes: &[u8], name: &str) -> String {
    let f = TempFile::new(name, bytes);
    let ram = GuestRam::new("arch-refuse", 64 << 20).unwrap();
    let err = configure_linux(ram.memory(), &cfg(&f.0, None, DEFAULT_CMDLINE, 1)).unwrap_err();
    let msg = err.to_string();
    one_sentence(&msg, &f.0);
    // probe_kernel refuses the same way, before any VM exists.
    assert_eq!(probe_kernel(&f.0).unwrap_err().to_string(), msg);
    msg
}

#[test]
fn refuses_junk_empty_and_truncated_kernels() {
    let junk = refuse(b"#!/bin/sh\necho this is not a kernel\n", "junk");
    assert!(junk.contains("is not a bzImage or ELF kernel: bad magic"), "{junk}");
    let big_junk = refuse(&vec![0x5a; 64 << 10], "bigjunk");
    assert!(big_junk.contains("bad magic"), "{big_junk}");
    let empty = refuse(b"", "empty");
    assert!(
        empty.ends_with("is not a bzImage or ELF kernel: the file is empty"),
        "{empty}"
    );
    let mut cut = bzimage(0x4000, 1);
    cut.truncate(cut.len() - 0x1000);
    let truncated = refuse(&cut, "truncated");
    assert!(
        truncated.contains("cannot be booted: it is a truncated bzImage"),
        "{truncated}"
    );
    let header_only = refuse(&bzimage(0x4000, 1)[..0x210], "headeronly");
    assert!(header_only.contains("truncated bzImage"), "{header_only}");
    let no64 = refuse(&bzimage(0x1000, 0), "no64");
    assert!(no64.contains("no 64-bit entry point"), "{no64}");
    let elf32 = refuse(&elf(1, 3, &[0x90; 16]), "elf32");
    assert!(
        elf32.contains("is not a bzImage or ELF kernel: it is an ELF file but not x86-64"),
        "{elf32}"
    );
    let mut elf_cut = elf(2, 62, &[0x90; 0x800]);
    elf_cut.truncate(0x1400);
    let elf_truncated = refuse(&elf_cut, "elftrunc");
    assert!(elf_truncated.contains("truncated ELF"), "{elf_truncated}");

    let missing = Path::new("/nonexistent/k7d/vmlinuz");
    let msg = probe_kernel(missing).unwrap_err().to_string();
    assert!(
        msg.starts_with("cannot read kernel /nonexistent/k7d/vmlinuz: "),
        "{msg}"
    );
}

#[test]
fn boots_a_synthetic_bzimage_with_initrd() {
    let image = bzimage(0x2000, 1);
    let k = TempFile::new("bz", &image);
    let initrd_bytes: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
    let i = TempFile::new("initrd", &initrd_bytes);
    let ram = GuestRam::new("arch-bz", 128 << 20).unwrap();
    let mem = ram.memory();
    let cmdline = "console=ttyS0 reboot=k panic=1 root=/dev/ram0";
    let e = configure_linux(mem, &cfg(&k.0, Some(&i.0), cmdline, 2)).unwrap();
    assert_eq!(e.kind, KernelKind::BzImage);
    assert_eq!(e.entry, GuestAddress(0x10_0200));
    assert_eq!(e.kernel, (0x10_0000, 0x10_2000));
    assert_eq!(e.zero_page, GuestAddress(ZERO_PAGE_ADDR));

    // The protected-mode code is at 1 MiB.
    let mut code = vec![0u8; 0x2000];
    mem.read_slice(&mut code, GuestAddress(0x10_0000)).unwrap();
    assert_eq!(code, image[1024..]);

    // initrd: page aligned, at the top of RAM, intact.
    let (addr, size) = e.initrd.unwrap();
    assert_eq!(addr % 4096, 0);
    assert_eq!(size, initrd_bytes.len() as u64);
    assert!(addr + size <= 128 << 20 && addr + size + 4096 > 128 << 20);
    let mut back = vec![0u8; initrd_bytes.len()];
    mem.read_slice(&mut back, GuestAddress(addr)).unwrap();
    assert_eq!(back, initrd_bytes);

    let bp = zero_page(mem);
    let h = bp.hdr;
    let (tol, magic, flag, cl, ri, rs) = (
        h.type_of_loader,
        h.header,
        h.boot_flag,
        h.cmd_line_ptr,
        h.ramdisk_image,
        h.ramdisk_size,
    );
    assert_eq!((tol, magic, flag), (0xff, 0x5372_6448, 0xaa55));
    assert_eq!(cl as u64, CMDLINE_ADDR);
    assert_eq!((ri as u64, rs as u64), (addr, size));
    let rsdp = bp.acpi_rsdp_addr;
    assert_eq!(rsdp, RSDP_ADDR);
    let mut c = vec![0u8; cmdline.len() + 1];
    mem.read_slice(&mut c, GuestAddress(CMDLINE_ADDR)).unwrap();
    assert_eq!(&c[..cmdline.len()], cmdline.as_bytes());
    assert_eq!(c[cmdline.len()], 0);

    // e820 in the zero page = the layout's map (with ECAM reserved).
    let n = bp.e820_entries as usize;
    let want = e820_map(&[(0, 128 << 20)], Some(ecam_described()));
    assert_eq!(n, want.len());
    for (got, want) in bp.e820_table[..n].iter().zip(&want) {
        let (ga, gs, gt, wa, ws, wt) = (got.addr, got.size, got.r#type, want.addr, want.size, want.r#type);
        assert_eq!((ga, gs, gt), (wa, ws, wt));
    }
    // The structures the entry state relies on are in memory.
    let gdt2: u64 = mem.read_obj(GuestAddress(BOOT_GDT_ADDR + 16)).unwrap();
    assert_eq!(gdt2, 0x00af_9b00_0000_ffff);
    let pml4: u64 = mem.read_obj(GuestAddress(PML4_ADDR)).unwrap();
    assert_eq!(pml4 & !0xfff, PDPT_ADDR);
    let mut sig = [0u8; 8];
    mem.read_slice(&mut sig, GuestAddress(RSDP_ADDR)).unwrap();
    assert_eq!(&sig, b"RSD PTR ");
}

#[test]
fn e820_in_the_zero_page_above_the_hole() {
    let k = TempFile::new("bzhigh", &bzimage(0x1000, 1));
    let size = MMIO32_START + (512 << 20);
    let ram = GuestRam::new("arch-high", size).unwrap();
    let mem = ram.memory();
    let mut c = cfg(&k.0, None, DEFAULT_CMDLINE, 1);
    c.pci = None;
    configure_linux(mem, &c).unwrap();
    let bp = zero_page(mem);
    let ram_ranges: Vec<(u64, u64)> = bp.e820_table[..bp.e820_entries as usize]
        .iter()
        .filter(|e| e.r#type == E820_RAM)
        .map(|e| (e.addr, e.size))
        .collect();
    assert_eq!(
        ram_ranges,
        vec![
            (0, EBDA_START),
            (HIMEM_START, MMIO32_START - HIMEM_START),
            (MMIO32_END, 512 << 20)
        ]
    );
}

#[test]
fn refuses_initrd_and_cmdline_that_do_not_fit() {
    let k = TempFile::new("bzfit", &bzimage(0x1000, 1));
    // 24 MiB of RAM: the kernel needs up to 16 MiB + init_size (4 MiB) = 20 MiB.
    let ram = GuestRam::new("arch-fit", 24 << 20).unwrap();
    let big = TempFile::new("biginitrd", &vec![1u8; 6 << 20]);
    let msg = configure_linux(ram.memory(), &cfg(&k.0, Some(&big.0), DEFAULT_CMDLINE, 1))
        .unwrap_err()
        .to_string();
    one_sentence(&msg, &big.0);
    assert!(msg.contains("cannot be loaded: it is 6 MiB but only"), "{msg}");
    let empty = TempFile::new("emptyinitrd", b"");
    let msg = configure_linux(ram.memory(), &cfg(&k.0, Some(&empty.0), DEFAULT_CMDLINE, 1))
        .unwrap_err()
        .to_string();
    assert!(msg.ends_with("cannot be loaded: the file is empty"), "{msg}");

    let small = GuestRam::new("arch-small", 16 << 20).unwrap();
    let msg = configure_linux(small.memory(), &cfg(&k.0, None, DEFAULT_CMDLINE, 1))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("needs guest RAM up to 20 MiB"), "{msg}");

    let long = "x".repeat(3000);
    let msg = configure_linux(ram.memory(), &cfg(&k.0, None, &long, 1))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("command line is invalid: it is 3000 bytes but the kernel accepts at most 2047"),
        "{msg}"
    );
}

#[test]
fn boots_a_synthetic_elf_vmlinux() {
    let code: Vec<u8> = (0..0x800u32).map(|i| i as u8).collect();
    let k = TempFile::new("vmlinux", &elf(2, 62, &code));
    let ram = GuestRam::new("arch-elf", 64 << 20).unwrap();
    let mem = ram.memory();
    let e = configure_linux(mem, &cfg(&k.0, None, DEFAULT_CMDLINE, 4)).unwrap();
    assert_eq!(e.kind, KernelKind::Elf);
    assert_eq!(e.entry, GuestAddress(0x100_0000));
    let mut back = vec![0u8; code.len()];
    mem.read_slice(&mut back, GuestAddress(0x100_0000)).unwrap();
    assert_eq!(back, code);
    let h = zero_page(mem).hdr;
    let (flag, magic, tol) = (h.boot_flag, h.header, h.type_of_loader);
    assert_eq!((flag, magic, tol), (0xaa55, 0x5372_6448, 0xff));
}

/// The Debian cloud kernel the lab unpacked (`$K7D_LAB_CACHE/pkgs`);
/// `tests/run-all.sh` fetches it (`tests/lab/run.sh --fetch`) before the tests.
fn cached_cloud_kernel() -> Option<PathBuf> {
    let cache = std::env::var_os("K7D_LAB_CACHE").map_or_else(|| PathBuf::from("/var/cache/k7d-lab"), PathBuf::from);
    for pkg in std::fs::read_dir(cache.join("pkgs")).ok()?.flatten() {
        if !pkg.file_name().to_string_lossy().starts_with("linux-image-") {
            continue;
        }
        for f in std::fs::read_dir(pkg.path().join("boot")).ok()?.flatten() {
            let name = f.file_name().to_string_lossy().into_owned();
            if name.starts_with("vmlinuz-") && name.ends_with("-cloud-amd64") {
                return Some(f.path());
            }
        }
    }
    None
}

#[test]
fn real_debian_cloud_kernel_if_cached() {
    let Some(path) = cached_cloud_kernel() else {
        k7d_test_skip::skip(
            "real_debian_cloud_kernel_if_cached",
            "no Debian cloud kernel in the lab cache (tests/lab/run.sh --fetch puts it there)",
        );
        return;
    };
    let info = probe_kernel(&path).unwrap();
    let h = info.header;
    let (version, xlf, init_size, pref, align) =
        (h.version, h.xloadflags, h.init_size, h.pref_address, h.kernel_alignment);
    eprintln!(
        "{}: protocol {:#x}, xloadflags {xlf:#x}, init_size {} MiB, pref_address {pref:#x}, alignment {align:#x}",
        path.display(),
        version,
        init_size >> 20
    );
    assert_eq!(info.kind, KernelKind::BzImage);
    assert!(version >= 0x020c);
    assert_ne!(xlf & 1, 0, "XLF_KERNEL_64");

    let image = std::fs::read(&path).unwrap();
    let ram = GuestRam::new("arch-real", 256 << 20).unwrap();
    let mem = ram.memory();
    let initrd = TempFile::new("realinitrd", &[7u8; 8192]);
    let e = configure_linux(mem, &cfg(&path, Some(&initrd.0), &default_cmdline(true), 2)).unwrap();
    assert_eq!(e.entry, GuestAddress(KERNEL_LOAD_ADDR + 0x200));
    let setup = (usize::from(image[0x1f1].max(4)) + 1) * 512;
    let mut head = vec![0u8; 4096];
    mem.read_slice(&mut head, GuestAddress(KERNEL_LOAD_ADDR)).unwrap();
    assert_eq!(head, image[setup..setup + 4096]);
    assert_eq!(e.kernel.1 - e.kernel.0, (image.len() - setup) as u64);
    let (ri, _) = e.initrd.unwrap();
    assert!(ri >= info.needs_ram_to);

    // Unpacked on the host (Debian packs it with LZ4), it boots as the ELF
    // it carries: entered at `startup_64` at its link address, its own header
    // in the zero page.
    let cache = TempDir::new("realcache");
    let ram = GuestRam::new("arch-real-elf", 256 << 20).unwrap();
    let cmdline = default_cmdline(true);
    let mut c = cfg(&path, Some(&initrd.0), &cmdline, 2);
    c.kernel_cache = Some(&cache.0);
    let e = configure_linux(ram.memory(), &c).unwrap();
    assert_eq!(e.kind, KernelKind::Elf);
    let elf_path = cache.entries().pop().expect("the unpacked kernel is cached");
    let unpacked = std::fs::read(&elf_path).unwrap();
    assert!(unpacked.starts_with(b"\x7fELF") && unpacked.len() > image.len());
    // e_entry: the physical `startup_64`, at the kernel's 16 MiB link address.
    let e_entry = u64::from_le_bytes(unpacked[24..32].try_into().unwrap());
    assert_eq!(e.entry, GuestAddress(e_entry));
    assert_eq!(e.kernel.0, 0x100_0000);
    let hv = zero_page(ram.memory()).hdr.version;
    assert_eq!(hv, version);
    let (ri, _) = e.initrd.unwrap();
    assert!(ri >= e.kernel.1);
    eprintln!(
        "unpacked: {} MiB ELF from a {} MiB bzImage, image in guest RAM {:#x}..{:#x}",
        unpacked.len() >> 20,
        image.len() >> 20,
        e.kernel.0,
        e.kernel.1
    );

    // A truncated copy is refused before anything is loaded.
    let cut = TempFile::new("realcut", &image[..image.len() / 2]);
    let msg = probe_kernel(&cut.0).unwrap_err().to_string();
    one_sentence(&msg, &cut.0);
    assert!(msg.contains("truncated bzImage"), "{msg}");
}

/// A bzImage whose payload is `vmlinux` packed as the kernel's build packs
/// it (`CONFIG_KERNEL_LZ4`), with the payload fields of its setup header set.
fn lz4_bzimage(vmlinux: &[u8]) -> Vec<u8> {
    let payload = super::unpack::tests::pack(vmlinux, 4096);
    let mut b = bzimage((payload.len() + 15) & !15, 1);
    b[1024..1024 + payload.len()].copy_from_slice(&payload);
    put(&mut b, 0x248, 0u32.to_le_bytes()); // payload_offset
    put(&mut b, 0x24c, (payload.len() as u32).to_le_bytes()); // payload_length
    b
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("k7d-arch-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Self(p)
    }

    fn entries(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn an_lz4_bzimage_boots_from_its_elf_unpacked_once() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let code: Vec<u8> = (0..0x3000u32).map(|i| (i * 13) as u8).collect();
    let vmlinux = elf(2, 62, &code);
    let image = lz4_bzimage(&vmlinux);
    let k = TempFile::new("lz4bz", &image);
    let cache = TempDir::new("kcache");
    let boot = |kernel_cache: Option<&Path>| {
        let ram = GuestRam::new("arch-lz4", 64 << 20).unwrap();
        let mut c = cfg(&k.0, None, DEFAULT_CMDLINE, 1);
        c.kernel_cache = kernel_cache;
        let e = configure_linux(ram.memory(), &c).unwrap();
        (ram, e)
    };
    let (ram, e) = boot(Some(&cache.0));
    assert_eq!(e.kind, KernelKind::Elf);
    assert_eq!(e.entry, GuestAddress(0x100_0000));
    let mut back = vec![0u8; code.len()];
    ram.memory().read_slice(&mut back, GuestAddress(0x100_0000)).unwrap();
    assert_eq!(back, code);
    // The zero page carries the bzImage's own header (its protocol version
    // and alignment), not the one built for a bare vmlinux.
    let h = zero_page(ram.memory()).hdr;
    let (version, align, tol) = (h.version, h.kernel_alignment, h.type_of_loader);
    assert_eq!((version, align, tol), (0x020f, 0x20_0000, 0xff));
    // One private cache entry, the ELF itself.
    let entries = cache.entries();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!(std::fs::read(&entries[0]).unwrap(), vmlinux);
    let meta = std::fs::metadata(&entries[0]).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    assert_eq!(std::fs::metadata(&cache.0).unwrap().permissions().mode() & 0o777, 0o700);
    // The second boot uses it as it is.
    let (_, e2) = boot(Some(&cache.0));
    assert_eq!(e2.kind, KernelKind::Elf);
    let again = std::fs::metadata(&entries[0]).unwrap();
    assert_eq!((again.ino(), again.mtime_nsec()), (meta.ino(), meta.mtime_nsec()));
    // Without a cache the bzImage boots through its decompressor.
    assert_eq!(boot(None).1.kind, KernelKind::BzImage);
    // A cache entry someone else could write is not trusted: it is replaced.
    std::fs::set_permissions(&entries[0], std::fs::Permissions::from_mode(0o666)).unwrap();
    std::fs::write(&entries[0], b"not a kernel").unwrap();
    let (ram, e3) = boot(Some(&cache.0));
    assert_eq!(e3.kind, KernelKind::Elf);
    ram.memory().read_slice(&mut back, GuestAddress(0x100_0000)).unwrap();
    assert_eq!(back, code);
    assert_eq!(std::fs::read(&entries[0]).unwrap(), vmlinux);
    // A rewritten kernel is unpacked again under its new identity, and the
    // cache keeps the newest four; files that are not its own stay.
    std::fs::write(cache.0.join("notes.txt"), b"not the cache's").unwrap();
    std::fs::write(cache.0.join("old.vmlinux"), b"not the cache's either").unwrap();
    for round in 0..5u8 {
        let mut code2 = code.clone();
        code2[0] = round;
        // File times tick with the kernel's clock (jiffies): a rewrite in
        // the same tick would keep the identity.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&k.0, lz4_bzimage(&elf(2, 62, &code2))).unwrap();
        let (ram, e) = boot(Some(&cache.0));
        assert_eq!(e.kind, KernelKind::Elf);
        let mut first = [0u8; 1];
        ram.memory().read_slice(&mut first, GuestAddress(0x100_0000)).unwrap();
        assert_eq!(first[0], round);
    }
    let names: Vec<String> = cache
        .entries()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), super::unpack::KEEP + 2, "{names:?}");
    assert!(names.iter().any(|n| n == "notes.txt") && names.iter().any(|n| n == "old.vmlinux"));
    // A cache directory others can write is not used.
    std::fs::set_permissions(&cache.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&k.0, lz4_bzimage(&elf(2, 62, &code[1..]))).unwrap();
    assert_eq!(boot(Some(&cache.0)).1.kind, KernelKind::BzImage);
    assert_eq!(cache.entries().len(), super::unpack::KEEP + 2);
}

#[test]
fn a_kernel_that_cannot_be_unpacked_boots_its_decompressor_and_leaves_nothing() {
    let cache = TempDir::new("kcache-bad");
    let code: Vec<u8> = (0..0x2000u32).map(|i| i as u8).collect();
    let mut corrupt = lz4_bzimage(&elf(2, 62, &code));
    for x in &mut corrupt[1024 + 8..1024 + 64] {
        *x = 0xff;
    }
    let not_elf = lz4_bzimage(&[0x5a; 0x3000]);
    // An ELF the loader would refuse (a shared object, not an executable).
    let mut dyn_elf = elf(2, 62, &code);
    put(&mut dyn_elf, 16, 3u16.to_le_bytes());
    let dyn_elf = lz4_bzimage(&dyn_elf);
    let plain = bzimage(0x2000, 1); // its payload is not LZ4
    for (name, image) in [
        ("corrupt", corrupt),
        ("notelf", not_elf),
        ("dynelf", dyn_elf),
        ("plain", plain),
    ] {
        let k = TempFile::new(name, &image);
        let ram = GuestRam::new("arch-lz4-bad", 64 << 20).unwrap();
        let mut c = cfg(&k.0, None, DEFAULT_CMDLINE, 1);
        c.kernel_cache = Some(&cache.0);
        let e = configure_linux(ram.memory(), &c).unwrap();
        assert_eq!(e.kind, KernelKind::BzImage, "{name}");
        assert!(cache.entries().is_empty(), "{name}: {:?}", cache.entries());
    }
}
