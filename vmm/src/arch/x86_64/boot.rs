//! Kernel, initrd and command line loading, and the zero page (`boot_params`).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{LOADED_HIGH, XLF_KERNEL_64, boot_e820_entry, boot_params, setup_header};
use linux_loader::loader::{Cmdline, KernelLoader, KernelLoaderResult, bzimage::BzImage, elf::Elf, load_cmdline};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryBackend};

use super::BootError;
use super::layout::*;
use crate::vstate::memory::GuestMemoryMmap;

/// Offset of the setup header in a bzImage (and in `boot_params`).
const SETUP_HEADER_OFFSET: usize = 0x1f1;
/// "HdrS" at 0x202.
const HDRS_MAGIC: u32 = 0x5372_6448;
/// 0xAA55 at 0x1fe.
const BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `type_of_loader`: "undefined loader".
pub const LOADER_TYPE_OTHER: u8 = 0xff;
/// Boot protocol 2.12: the first with `xloadflags` (the 64-bit entry flag).
const MIN_PROTOCOL: u16 = 0x020c;
/// The `cmdline_size` assumed for ELF kernels (x86's COMMAND_LINE_SIZE - 1).
const ELF_CMDLINE_SIZE: u32 = 2047;
/// ELF: 64-bit class, x86-64 machine, executable.
const ELFCLASS64: u8 = 2;
const EM_X86_64: u16 = 62;
const ET_EXEC: u16 = 2;
const PT_LOAD: u32 = 1;

/// Kernel image formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelKind {
    /// A bzImage (`vmlinuz`): entered at its 64-bit entry, load address + 0x200.
    BzImage,
    /// An uncompressed ELF `vmlinux`: entered at `e_entry` (physical `startup_64`).
    Elf,
}

/// What a kernel file is, from its header alone (no guest memory needed).
#[derive(Debug, Clone, Copy)]
pub struct KernelInfo {
    /// Format.
    pub kind: KernelKind,
    /// The setup header (read from a bzImage, built for an ELF kernel).
    pub header: setup_header,
    /// Bytes of guest RAM the kernel needs from its load address to run
    /// (bzImage: `init_size` at `pref_address`; ELF: up to the end of its segments).
    pub needs_ram_to: u64,
    /// The lowest guest address the image is loaded at (bzImage: 1 MiB,
    /// its protected-mode code; ELF: its lowest segment).
    pub start: u64,
}

/// A kernel in guest memory.
#[derive(Debug, Clone, Copy)]
pub struct LoadedKernel {
    /// Format and header.
    pub info: KernelInfo,
    /// Where its image starts.
    pub load: u64,
    /// End of the image (exclusive).
    pub end: u64,
    /// The 64-bit entry point (RIP).
    pub entry: u64,
}

fn not_kernel(path: &Path, reason: impl Into<String>) -> BootError {
    BootError::NotAKernel {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn bad_kernel(path: &Path, reason: impl Into<String>) -> BootError {
    BootError::BadKernel {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The error for a file a VM process was not handed (it opens nothing).
fn not_handed(path: &Path, what: &'static str) -> BootError {
    BootError::Unreadable {
        what,
        path: path.to_path_buf(),
        reason: "it was not handed to this VM process".into(),
    }
}

fn mib(b: u64) -> u64 {
    b.div_ceil(1 << 20)
}

/// Opens `path` (`what`: "kernel" or "initrd"), or takes a duplicate of
/// the file `handed` over for it (a VM process opens nothing by path), and
/// refuses anything but a regular file.
fn open(path: &Path, what: &'static str, handed: Option<&File>) -> Result<(File, u64), BootError> {
    let unreadable = |e: std::io::Error| BootError::Unreadable {
        what,
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    // O_NONBLOCK: opening a FIFO (put in the file's place after the config
    // was validated) must not wait for a writer; it is refused below. On a
    // regular file the flag changes nothing.
    let f = match handed {
        Some(h) => h.try_clone(),
        None => std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path),
    }
    .map_err(unreadable)?;
    let meta = f.metadata().map_err(unreadable)?;
    if !meta.is_file() {
        return Err(BootError::Unreadable {
            what,
            path: path.to_path_buf(),
            reason: "it is not a regular file".into(),
        });
    }
    Ok((f, meta.len()))
}

fn read_at(f: &mut File, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
    f.seek(SeekFrom::Start(off))?;
    f.read_exact(buf)
}

/// Identifies and validates the kernel at `path` without loading it: the
/// check a VMM can run before it creates anything. Refuses empty, non-kernel,
/// truncated, 32-bit-only and too-old kernels with one sentence.
pub fn probe_kernel(path: &Path) -> Result<KernelInfo, BootError> {
    let (mut f, len) = open(path, "kernel", None)?;
    probe_open_kernel(path, &mut f, len)
}

/// [`probe_kernel`] of the kernel `path` open as `f` (handed over).
pub fn probe_kernel_file(path: &Path, f: &File) -> Result<KernelInfo, BootError> {
    let (mut f, len) = open(path, "kernel", Some(f))?;
    probe_open_kernel(path, &mut f, len)
}

pub(super) fn probe_open_kernel(path: &Path, f: &mut File, len: u64) -> Result<KernelInfo, BootError> {
    if len == 0 {
        return Err(not_kernel(path, "the file is empty"));
    }
    let mut head = vec![0u8; len.min(0x400) as usize];
    read_at(f, 0, &mut head).map_err(|e| BootError::Unreadable {
        what: "kernel",
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    if head.starts_with(b"\x7fELF") {
        return probe_elf(path, f, len, &head);
    }
    let hdr_end = SETUP_HEADER_OFFSET + std::mem::size_of::<setup_header>();
    if head.len() < 0x206 || u32::from_le_bytes([head[0x202], head[0x203], head[0x204], head[0x205]]) != HDRS_MAGIC {
        return Err(not_kernel(
            path,
            format!("bad magic (no ELF header and no \"HdrS\" at offset 0x202 in its {len} bytes)"),
        ));
    }
    if head.len() < hdr_end {
        return Err(bad_kernel(path, format!("it is a truncated bzImage: only {len} bytes")));
    }
    let h = setup_header::from_slice(&head[SETUP_HEADER_OFFSET..hdr_end])
        .copied()
        .ok_or_else(|| bad_kernel(path, "its setup header cannot be read"))?;
    let (version, xloadflags, loadflags, syssize) = (h.version, h.xloadflags, h.loadflags, h.syssize);
    if version < MIN_PROTOCOL {
        return Err(bad_kernel(
            path,
            format!(
                "its boot protocol {}.{:02} is too old (2.12 or later has the 64-bit entry)",
                version >> 8,
                version & 0xff
            ),
        ));
    }
    if xloadflags & XLF_KERNEL_64 == 0 {
        return Err(bad_kernel(path, "it has no 64-bit entry point (a 32-bit kernel?)"));
    }
    if loadflags & LOADED_HIGH == 0 {
        return Err(bad_kernel(path, "it is a zImage, not a bzImage (not loaded high)"));
    }
    let setup_sects = if h.setup_sects == 0 {
        4
    } else {
        u64::from(h.setup_sects)
    };
    let setup_size = (setup_sects + 1) * 512;
    let want = setup_size + u64::from(syssize) * 16;
    if len < want {
        return Err(bad_kernel(
            path,
            format!("it is a truncated bzImage: its header promises {want} bytes but the file has {len}"),
        ));
    }
    let (pref, init_size) = (h.pref_address, h.init_size);
    let needs_ram_to = pref.max(KERNEL_LOAD_ADDR) + u64::from(init_size);
    Ok(KernelInfo {
        kind: KernelKind::BzImage,
        header: h,
        needs_ram_to,
        start: HIMEM_START,
    })
}

fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or_default())
}

fn le64(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default())
}

fn probe_elf(path: &Path, f: &mut File, len: u64, head: &[u8]) -> Result<KernelInfo, BootError> {
    if head.len() < 64 {
        return Err(bad_kernel(
            path,
            format!("it is a truncated ELF file: only {len} bytes"),
        ));
    }
    if head[4] != ELFCLASS64 || le16(head, 18) != EM_X86_64 {
        return Err(not_kernel(
            path,
            format!(
                "it is an ELF file but not x86-64 (class {}, machine {})",
                head[4],
                le16(head, 18)
            ),
        ));
    }
    if le16(head, 16) != ET_EXEC {
        return Err(not_kernel(path, "it is an ELF file but not an executable vmlinux"));
    }
    let entry = le64(head, 24);
    let phoff = le64(head, 32);
    let phentsize = u64::from(le16(head, 54));
    let phnum = u64::from(le16(head, 56));
    if phentsize != 56 || phoff.saturating_add(phnum * 56) > len {
        return Err(bad_kernel(path, "its ELF program headers are missing or truncated"));
    }
    let mut ph = vec![0u8; (phnum * 56) as usize];
    read_at(f, phoff, &mut ph).map_err(|e| bad_kernel(path, format!("its program headers cannot be read: {e}")))?;
    let mut end = 0u64;
    let mut start = u64::MAX;
    let mut entry_in_segment = false;
    for p in ph.chunks_exact(56) {
        if le32(p, 0) != PT_LOAD {
            continue;
        }
        let (off, paddr, filesz, memsz) = (le64(p, 8), le64(p, 24), le64(p, 32), le64(p, 40));
        if off.saturating_add(filesz) > len {
            return Err(bad_kernel(
                path,
                format!(
                    "it is a truncated ELF file: a segment ends at byte {} but the file has {len}",
                    off + filesz
                ),
            ));
        }
        if paddr < HIMEM_START {
            return Err(bad_kernel(path, format!("a segment loads at {paddr:#x}, below 1 MiB")));
        }
        end = end.max(paddr.saturating_add(memsz));
        start = start.min(paddr);
        entry_in_segment |= (paddr..paddr.saturating_add(memsz)).contains(&entry);
    }
    if end == 0 {
        return Err(bad_kernel(path, "it has no loadable segment"));
    }
    if !entry_in_segment {
        return Err(bad_kernel(
            path,
            format!("its entry point {entry:#x} is not a physical address inside its segments"),
        ));
    }
    let header = setup_header {
        boot_flag: BOOT_FLAG_MAGIC,
        header: HDRS_MAGIC,
        type_of_loader: LOADER_TYPE_OTHER,
        kernel_alignment: 0x100_0000,
        cmdline_size: ELF_CMDLINE_SIZE,
        initrd_addr_max: (MMIO32_START - 1) as u32,
        ..Default::default()
    };
    Ok(KernelInfo {
        kind: KernelKind::Elf,
        header,
        needs_ram_to: end,
        start,
    })
}

fn loader_reason(e: &linux_loader::loader::Error) -> String {
    e.to_string().replace("Kernel Loader: ", "")
}

/// Populates the guest RAM at `[addr, addr + len)` before a loader writes
/// it (one call rather than a page fault per page; `sys::populate_write`).
/// Only an optimisation: a range outside one region is left to the faults.
fn prefault(mem: &GuestMemoryMmap, addr: u64, len: u64) {
    let Ok(len) = usize::try_from(len) else { return };
    if let Ok(slice) = mem.get_slice(GuestAddress(addr), len) {
        crate::sys::populate_write(slice.ptr_guard_mut().as_ptr(), len);
    }
}

/// Loads the kernel at `path` into `mem`, whose RAM below the MMIO hole ends
/// at `low_end`. With `kernel_cache`, a bzImage with an LZ4 payload is
/// unpacked there once ([`super::unpack`]) and the ELF it carries is loaded
/// instead, with the bzImage's own setup header in the zero page: the guest
/// skips its decompressor.
pub fn load_kernel(
    mem: &GuestMemoryMmap,
    path: &Path,
    low_end: u64,
    kernel_cache: Option<&Path>,
    handed: Option<&super::BootFiles>,
) -> Result<LoadedKernel, BootError> {
    let (mut f, len) = match handed {
        Some(h) => open(
            path,
            "kernel",
            Some(h.kernel.as_ref().ok_or_else(|| not_handed(path, "kernel"))?),
        )?,
        None => open(path, "kernel", None)?,
    };
    let info = probe_open_kernel(path, &mut f, len)?;
    let user_path = path;
    let elf_path;
    // A bzImage is unpacked (or found unpacked) from the descriptor just
    // probed, so the ELF is that file's. It boots if the loader takes it;
    // else the bzImage boots as it is (one warning says why). Handed files
    // come with the unpacked ELF when the daemon had it.
    let unpacked = match (handed, kernel_cache) {
        (Some(h), _) if info.kind == KernelKind::BzImage => match &h.unpacked_kernel {
            Some(u) => Some(super::unpack::Unpacked {
                path: PathBuf::from(format!("{} (unpacked, handed over)", path.display())),
                file: u.try_clone().map_err(|e| BootError::Unreadable {
                    what: "kernel",
                    path: path.to_path_buf(),
                    reason: format!("its unpacked ELF: {e}"),
                })?,
            }),
            None => None,
        },
        (Some(_), _) => None,
        (None, Some(cache)) if info.kind == KernelKind::BzImage => match super::unpack::unpacked(path, &mut f, cache) {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!("{e}; the kernel boots through its own decompressor");
                None
            }
        },
        _ => None,
    };
    let usable = match unpacked {
        Some(u) => {
            let mut ef = u.file;
            let probed = ef
                .metadata()
                .map_err(|e| e.to_string())
                .and_then(|m| probe_open_kernel(&u.path, &mut ef, m.len()).map_err(|e| e.to_string()));
            match probed {
                Ok(elf) if elf.kind == KernelKind::Elf => Some((u.path, ef, elf)),
                r => {
                    tracing::warn!(
                        "the unpacked kernel {} is not usable ({}); {} boots through its own decompressor",
                        u.path.display(),
                        r.err().unwrap_or_else(|| "not an ELF vmlinux".into()),
                        path.display()
                    );
                    None
                }
            }
        }
        None => None,
    };
    let (path, mut f, populate, info) = match usable {
        Some((p, ef, elf)) => {
            elf_path = p;
            let merged = KernelInfo {
                kind: KernelKind::Elf,
                header: info.header,
                needs_ram_to: info.needs_ram_to.max(elf.needs_ram_to),
                start: elf.start,
            };
            (
                elf_path.as_path(),
                ef,
                (elf.start, elf.needs_ram_to.saturating_sub(elf.start)),
                merged,
            )
        }
        None => (path, f, (HIMEM_START, len), info),
    };
    if info.needs_ram_to > low_end {
        return Err(BootError::KernelTooBig {
            path: user_path.to_path_buf(),
            need_mib: mib(info.needs_ram_to),
            have_mib: mib(low_end),
        });
    }
    f.rewind().map_err(|e| bad_kernel(path, e.to_string()))?;
    // Populate what the loader writes: from the image's first byte (1 MiB
    // for a bzImage, the lowest segment of an ELF) to its end.
    prefault(mem, populate.0, populate.1);
    let himem = Some(GuestAddress(HIMEM_START));
    let r: KernelLoaderResult = match info.kind {
        KernelKind::BzImage => BzImage::load(mem, None, &mut f, himem),
        KernelKind::Elf => Elf::load(mem, None, &mut f, himem),
    }
    .map_err(|e| bad_kernel(path, loader_reason(&e)))?;
    let mut info = info;
    let (load, entry) = match info.kind {
        KernelKind::BzImage => {
            // The loader put the protected-mode code at code32_start and updated the header.
            if let Some(h) = r.setup_header {
                info.header = h;
            }
            (r.kernel_load.0, r.kernel_load.0 + BZIMAGE_64BIT_ENTRY_OFFSET)
        }
        KernelKind::Elf => (r.kernel_load.0, r.kernel_load.0),
    };
    Ok(LoadedKernel {
        info,
        load,
        end: r.kernel_end,
        entry,
    })
}

/// Loads the initrd at `path` at the top of RAM below `max_end` (exclusive,
/// already limited by the kernel's `initrd_addr_max`), page aligned, and
/// not below `min_start` (what the kernel needs). Returns `(address, size)`.
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    min_start: u64,
    max_end: u64,
    handed: Option<&super::BootFiles>,
) -> Result<(u64, u64), BootError> {
    let (mut f, size) = match handed {
        Some(h) => open(
            path,
            "initrd",
            Some(h.initrd.as_ref().ok_or_else(|| not_handed(path, "initrd"))?),
        )?,
        None => open(path, "initrd", None)?,
    };
    let refuse = |reason: String| BootError::Initrd {
        path: path.to_path_buf(),
        reason,
    };
    if size == 0 {
        return Err(refuse("the file is empty".into()));
    }
    let addr = max_end
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|&a| a >= min_start)
        .ok_or_else(|| {
            refuse(format!(
                "it is {} MiB but only {} MiB of guest RAM are free between the kernel and {:#x}",
                mib(size),
                max_end.saturating_sub(min_start) >> 20,
                max_end
            ))
        })?;
    let count = usize::try_from(size).map_err(|_| refuse("it is too large".into()))?;
    prefault(mem, addr, size);
    mem.read_exact_volatile_from(GuestAddress(addr), &mut f, count)
        .map_err(|e| refuse(format!("reading it into guest RAM failed: {e}")))?;
    Ok((addr, size))
}

/// Validates `cmdline` for a kernel accepting `cmdline_size` bytes (without
/// the NUL) and writes it at [`CMDLINE_ADDR`].
pub fn write_cmdline(mem: &GuestMemoryMmap, cmdline: &str, cmdline_size: u32) -> Result<(), BootError> {
    // Protocols before 2.06 have no cmdline_size: 255 bytes.
    let max = if cmdline_size == 0 { 255 } else { cmdline_size as usize };
    let capacity = (max + 1).min(CMDLINE_MAX_SIZE);
    if cmdline.len() >= capacity {
        return Err(BootError::Cmdline(format!(
            "it is {} bytes but the kernel accepts at most {}",
            cmdline.len(),
            capacity - 1
        )));
    }
    let cl = Cmdline::try_from(cmdline, capacity).map_err(|e| BootError::Cmdline(e.to_string()))?;
    load_cmdline(mem, GuestAddress(CMDLINE_ADDR), &cl).map_err(|e| BootError::Cmdline(loader_reason(&e)))
}

/// Builds the zero page from the kernel's setup header and writes it at
/// [`ZERO_PAGE_ADDR`] with linux-loader's `LinuxBootConfigurator`.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    header: setup_header,
    initrd: Option<(u64, u64)>,
    e820: &[boot_e820_entry],
    rsdp: u64,
) -> Result<boot_params, BootError> {
    let mut hdr = header;
    hdr.type_of_loader = LOADER_TYPE_OTHER;
    hdr.cmd_line_ptr = CMDLINE_ADDR as u32;
    let (image, size) = initrd.unwrap_or((0, 0));
    hdr.ramdisk_image = image as u32;
    hdr.ramdisk_size = size as u32;
    let mut bp = boot_params {
        hdr,
        ext_cmd_line_ptr: (CMDLINE_ADDR >> 32) as u32,
        ext_ramdisk_image: (image >> 32) as u32,
        ext_ramdisk_size: (size >> 32) as u32,
        acpi_rsdp_addr: rsdp,
        ..Default::default()
    };
    if e820.len() > bp.e820_table.len() {
        return Err(BootError::Layout(format!(
            "{} e820 entries do not fit the zero page",
            e820.len()
        )));
    }
    for (slot, e) in bp.e820_table.iter_mut().zip(e820) {
        *slot = *e;
    }
    bp.e820_entries = e820.len() as u8;
    LinuxBootConfigurator::write_bootparams::<GuestMemoryMmap>(
        &BootParams::new(&bp, GuestAddress(ZERO_PAGE_ADDR)),
        mem,
    )
    .map_err(|e| BootError::Memory {
        what: "zero page",
        reason: e.to_string(),
    })?;
    Ok(bp)
}
