//! A bzImage's compressed payload unpacked on the host, once, into the ELF
//! `vmlinux` it carries, and cached by the file's identity.
//!
//! A bzImage is a decompressor plus the compressed kernel. Booted as is,
//! the guest runs the decompressor on every boot: it reads the payload,
//! writes the whole kernel (~60 MiB for Debian's cloud kernel) and moves it
//! into place, all in fresh guest RAM. Unpacked once on the host, every
//! later boot loads the ELF kernel directly at its link address, as
//! Firecracker and Cloud Hypervisor boot a `vmlinux`. Only the LZ4 payload
//! (Debian's choice, `CONFIG_KERNEL_LZ4`) is unpacked; any other kernel
//! boots through its own decompressor, as before.
//!
//! The kernel file is hostile input: the payload's offsets are checked
//! against the file, each LZ4 block is bounded, the output is capped, and
//! the result must be an x86-64 executable ELF, or nothing is cached.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The LZ4 "legacy" frame's magic (`lz4 -l`, what the kernel's build uses).
pub const LZ4_LEGACY_MAGIC: u32 = 0x184c_2102;
/// A legacy frame's blocks each unpack to at most 8 MiB.
const LZ4_LEGACY_BLOCK: usize = 8 << 20;
/// LZ4_compressBound(8 MiB): no honest block is larger.
const LZ4_MAX_BLOCK_IN: usize = LZ4_LEGACY_BLOCK + LZ4_LEGACY_BLOCK / 255 + 16;
/// The most an unpacked kernel may be (a hostile payload stops here).
pub const MAX_UNPACKED: usize = 512 << 20;
/// Unpacked kernels kept in a cache directory; older ones are removed.
pub const KEEP: usize = 4;
/// Offsets in the setup header (boot protocol 2.08+).
const PAYLOAD_OFFSET: usize = 0x248;
const PAYLOAD_LENGTH: usize = 0x24c;
const SETUP_SECTS: usize = 0x1f1;
const VERSION: usize = 0x206;
const HDRS: usize = 0x202;
const SUFFIX: &str = ".vmlinux";
/// The largest honest payload: every block of [`MAX_UNPACKED`] at its bound,
/// with its size word, a magic between frames and the trailer.
const MAX_PAYLOAD: u64 = ((MAX_UNPACKED / LZ4_LEGACY_BLOCK) * (LZ4_MAX_BLOCK_IN + 8) + 8) as u64;
/// How much of the kernel file's tail goes into its cache key.
const TAIL_KEYED: u64 = 64 << 10;

fn le32(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}

/// The compressed payload of the bzImage open in `f` (`len` bytes), if it
/// is LZ4; `Ok(None)` for anything that is not a bzImage (no "HdrS"), any
/// other compression or an old boot protocol.
pub fn lz4_payload(f: &mut File, len: u64) -> Result<Option<Vec<u8>>, String> {
    let mut head = vec![0u8; 0x260];
    if len < head.len() as u64 {
        return Ok(None);
    }
    f.seek(SeekFrom::Start(0))
        .and_then(|_| f.read_exact(&mut head))
        .map_err(|e| format!("its setup header cannot be read: {e}"))?;
    if le32(&head, HDRS) != Some(u32::from_le_bytes(*b"HdrS")) {
        return Ok(None);
    }
    let version = u16::from_le_bytes([head[VERSION], head[VERSION + 1]]);
    if version < 0x0208 {
        return Ok(None);
    }
    let sects = u64::from(if head[SETUP_SECTS] == 0 { 4 } else { head[SETUP_SECTS] });
    let (off, plen) = (
        le32(&head, PAYLOAD_OFFSET).unwrap_or(0),
        le32(&head, PAYLOAD_LENGTH).unwrap_or(0),
    );
    let start = (sects + 1) * 512 + u64::from(off);
    if plen < 8 || start.saturating_add(u64::from(plen)) > len {
        return Err(format!(
            "its payload ({plen} bytes at {start}) does not lie inside its {len} bytes"
        ));
    }
    if u64::from(plen) > MAX_PAYLOAD {
        return Err(format!(
            "its payload of {plen} bytes is larger than any kernel of at most {MAX_UNPACKED} bytes packs to"
        ));
    }
    let mut magic = [0u8; 4];
    f.seek(SeekFrom::Start(start))
        .and_then(|_| f.read_exact(&mut magic))
        .map_err(|e| format!("its payload cannot be read: {e}"))?;
    if u32::from_le_bytes(magic) != LZ4_LEGACY_MAGIC {
        return Ok(None);
    }
    let mut payload = vec![0u8; plen as usize];
    f.seek(SeekFrom::Start(start))
        .and_then(|_| f.read_exact(&mut payload))
        .map_err(|e| format!("its payload cannot be read: {e}"))?;
    Ok(Some(payload))
}

/// Unpacks an LZ4 legacy frame as the kernel's build writes it: the magic,
/// blocks of `[u32 size][LZ4 block]` (each unpacking to at most 8 MiB; the
/// magic may repeat between concatenated frames), and the unpacked size as
/// the last 4 bytes, which must match.
pub fn lz4_legacy(data: &[u8]) -> Result<Vec<u8>, String> {
    if le32(data, 0) != Some(LZ4_LEGACY_MAGIC) {
        return Err("the payload is not an LZ4 legacy frame".into());
    }
    let Some(body_end) = data.len().checked_sub(4) else {
        return Err("the payload is truncated".into());
    };
    let want = le32(data, body_end).unwrap_or(0) as usize;
    if want == 0 || want > MAX_UNPACKED {
        return Err(format!(
            "the payload says it unpacks to {want} bytes (at most {MAX_UNPACKED} are accepted)"
        ));
    }
    let mut out = vec![0u8; want];
    let (mut pos, mut filled) = (4usize, 0usize);
    while pos < body_end {
        if body_end - pos < 4 {
            return Err(format!("a block header at offset {pos} is truncated"));
        }
        let size = le32(data, pos).ok_or("a block header is truncated")? as usize;
        pos += 4;
        if size as u32 == LZ4_LEGACY_MAGIC {
            continue;
        }
        if size == 0 || size > LZ4_MAX_BLOCK_IN || size > body_end - pos {
            return Err(format!("a block of {size} bytes at offset {} is malformed", pos - 4));
        }
        let room = (want - filled).min(LZ4_LEGACY_BLOCK);
        let n = lz4_flex::block::decompress_into(&data[pos..pos + size], &mut out[filled..filled + room])
            .map_err(|e| format!("the block at offset {} does not unpack: {e}", pos - 4))?;
        filled += n;
        pos += size;
    }
    if filled != want {
        return Err(format!(
            "the payload unpacked to {filled} bytes, its trailer says {want}"
        ));
    }
    Ok(out)
}

/// The kernel file's identity, which names its cache entry: device, inode,
/// size, modification and change times, and a hash of its last 64 KiB (the
/// end of the payload and its size trailer), so that a same-size rewrite
/// within one tick of a coarse file clock still gets a new name. `ctime`
/// cannot be set back by a file's owner. Reads the tail through `f`.
pub fn identity(f: &mut File) -> std::io::Result<String> {
    use sha2::Digest;
    let meta = f.metadata()?;
    let tail = meta.len().min(TAIL_KEYED);
    let mut buf = vec![0u8; tail as usize];
    f.seek(SeekFrom::Start(meta.len() - tail))?;
    f.read_exact(&mut buf)?;
    let h = sha2::Sha256::digest(&buf);
    Ok(format!(
        "{:x}-{:x}-{:x}-{:x}.{:x}-{:x}.{:x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        meta.dev(),
        meta.ino(),
        meta.size(),
        meta.mtime(),
        meta.mtime_nsec(),
        meta.ctime(),
        meta.ctime_nsec(),
        h[0],
        h[1],
        h[2],
        h[3],
        h[4],
        h[5],
        h[6],
        h[7]
    ))
}

/// Whether `name` is one of this cache's files: an entry
/// (`<identity>.vmlinux`) or a temp file of one (`.<identity>.vmlinux.<pid>.<n>.tmp`).
/// Eviction touches nothing else, whatever else the directory holds.
fn ours(name: &str) -> bool {
    let identity = |s: &str| {
        !s.is_empty()
            && s.split(['-', '.']).count() == 8
            && s.chars().all(|c| c.is_ascii_hexdigit() || c == '-' || c == '.')
    };
    if let Some(id) = name.strip_suffix(SUFFIX) {
        return identity(id);
    }
    let Some(rest) = name.strip_prefix('.').and_then(|n| n.strip_suffix(".tmp")) else {
        return false;
    };
    let mut parts = rest.rsplitn(3, '.');
    let (seq, pid, entry) = (parts.next(), parts.next(), parts.next());
    let digits = |s: Option<&str>| s.is_some_and(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()));
    digits(seq) && digits(pid) && entry.and_then(|e| e.strip_suffix(SUFFIX)).is_some_and(identity)
}

/// Creates `cache` (0700) if needed and checks that it is a private
/// directory of this user: not a link, owned by the effective user, not
/// writable by group or others (else another user could plant an entry).
fn private_dir(cache: &Path) -> Result<(), String> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(cache)
        .map_err(|e| format!("cannot create the kernel cache {}: {e}", cache.display()))?;
    let m = std::fs::symlink_metadata(cache)
        .map_err(|e| format!("cannot stat the kernel cache {}: {e}", cache.display()))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if !m.file_type().is_dir() || m.uid() != me || m.mode() & 0o022 != 0 {
        return Err(format!(
            "the kernel cache {} is not a private directory of this user (a link, another owner, or writable by others)",
            cache.display()
        ));
    }
    Ok(())
}

/// An unpacked kernel: its cache path (for messages) and the file, open
/// (the loader reads this descriptor, so a concurrent eviction of the path
/// cannot take it away between the check and the load).
#[derive(Debug)]
pub struct Unpacked {
    /// Where it is cached.
    pub path: PathBuf,
    /// Open for reading.
    pub file: File,
}

/// The cache entry at `path`, open, if this process may trust it: a regular
/// file (not a link: `O_NOFOLLOW`) owned by this user that no one else can
/// write, checked on the open descriptor.
fn open_trusted(path: &Path) -> Option<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .ok()?;
    let m = f.metadata().ok()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    (m.file_type().is_file() && m.uid() == me && m.mode() & 0o022 == 0).then_some(f)
}

/// The unpacked ELF of bzImage `kernel`, open as `f` (the loader's own
/// descriptor, already probed), in `cache`: found there, or unpacked now and
/// written there. `Ok(None)`: the kernel's payload is not LZ4 (it
/// boots through its own decompressor). An error says why in one sentence;
/// the caller boots the bzImage instead and nothing is left behind.
pub fn unpacked(kernel: &Path, f: &mut File, cache: &Path) -> Result<Option<Unpacked>, String> {
    let meta = f
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", kernel.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", kernel.display()));
    }
    let source = identity(f).map_err(|e| format!("cannot read {}: {e}", kernel.display()))?;
    let path = cache.join(format!("{source}{SUFFIX}"));
    if let Some(file) = open_trusted(&path) {
        return Ok(Some(Unpacked { path, file }));
    }
    let Some(payload) = lz4_payload(f, meta.len()).map_err(|e| format!("{}: {e}", kernel.display()))? else {
        return Ok(None);
    };
    // Before the work: a cache that cannot be written or trusted is found
    // out without unpacking 50 MiB for nothing.
    private_dir(cache)?;
    let elf = lz4_legacy(&payload).map_err(|e| format!("{}: {e}", kernel.display()))?;
    drop(payload);
    // Unique per process and call: two VMs of one daemon may unpack the
    // same kernel at once (the second rename wins; both files are equal).
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = cache.join(format!(".{source}{SUFFIX}.{}.{seq}.tmp", std::process::id()));
    let written = (|| {
        let mut out = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        out.write_all(&elf)
            .and_then(|()| out.sync_all())
            .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
        // Only a kernel the loader will take is cached: the same checks as
        // a vmlinux given as --kernel (x86-64 executable, segments in the
        // file and above 1 MiB, the entry inside one).
        let info = super::boot::probe_open_kernel(&tmp, &mut out, elf.len() as u64)
            .map_err(|e| format!("{}: its payload unpacks to no usable kernel: {e}", kernel.display()))?;
        if info.kind != super::boot::KernelKind::Elf {
            return Err(format!("{}: its payload unpacks to no ELF kernel", kernel.display()));
        }
        std::fs::rename(&tmp, &path).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(out)
    })();
    let file = match written {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    evict(cache, &path);
    tracing::info!(
        "unpacked {} ({} MiB of LZ4) into {} ({} MiB)",
        kernel.display(),
        meta.len() >> 20,
        path.display(),
        elf.len() >> 20
    );
    Ok(Some(Unpacked { path, file }))
}

/// Keeps the [`KEEP`] most recently written kernels of `cache` (`keep` among
/// them) and removes the rest; leftovers of a crashed write go too.
fn evict(cache: &Path, keep: &Path) {
    let Ok(dir) = std::fs::read_dir(cache) else { return };
    let mut entries: Vec<(std::time::SystemTime, PathBuf)> = dir
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            if !ours(&name) {
                return None;
            }
            let m = e.metadata().ok()?;
            let stale_tmp = name.ends_with(".tmp")
                && m.modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|a| a.as_secs() > 600);
            if stale_tmp {
                let _ = std::fs::remove_file(e.path());
                return None;
            }
            if !name.ends_with(SUFFIX) || e.path() == keep {
                return None;
            }
            Some((m.modified().ok()?, e.path()))
        })
        .collect();
    entries.sort();
    let excess = (entries.len() + 1).saturating_sub(KEEP);
    for (_, p) in entries.into_iter().take(excess) {
        if let Err(e) = std::fs::remove_file(&p) {
            tracing::warn!("cannot remove the old unpacked kernel {}: {e}", p.display());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `data` as the kernel's build packs it: an LZ4 legacy frame of
    /// `block`-byte blocks (8 MiB in real kernels), then the unpacked size.
    pub(crate) fn pack(data: &[u8], block: usize) -> Vec<u8> {
        let mut out = LZ4_LEGACY_MAGIC.to_le_bytes().to_vec();
        for chunk in data.chunks(block) {
            let c = lz4_flex::block::compress(chunk);
            out.extend_from_slice(&(c.len() as u32).to_le_bytes());
            out.extend_from_slice(&c);
        }
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out
    }

    fn sample(n: usize) -> Vec<u8> {
        (0..n).map(|i| ((i / 7) % 251) as u8 ^ (i % 3) as u8).collect()
    }

    #[test]
    fn a_legacy_frame_unpacks_across_blocks_and_repeated_magics() {
        let data = sample(LZ4_LEGACY_BLOCK + 12_345);
        assert_eq!(lz4_legacy(&pack(&data, LZ4_LEGACY_BLOCK)).unwrap(), data);
        // Two frames back to back (the magic between them is skipped).
        let half = data.len() / 2;
        let mut two = pack(&data[..half], LZ4_LEGACY_BLOCK);
        two.truncate(two.len() - 4);
        let second = pack(&data[half..], LZ4_LEGACY_BLOCK);
        two.extend_from_slice(&second[..second.len() - 4]);
        two.extend_from_slice(&(data.len() as u32).to_le_bytes());
        assert_eq!(lz4_legacy(&two).unwrap(), data);
    }

    #[test]
    fn eviction_knows_its_own_names_only() {
        let id = "803-1a2b-d88e40-674a1b2c.1f-674a1b2c.1f-0123456789abcdef";
        assert!(ours(&format!("{id}.vmlinux")));
        assert!(ours(&format!(".{id}.vmlinux.4242.0.tmp")));
        for other in [
            "vmlinuz-6.1.0-57-cloud-amd64",
            "notes.vmlinux",
            ".x.tmp",
            "a-b-c-d.e-f.g-h.vmlinux.old",
            &format!(".{id}.vmlinux.x.0.tmp"),
            &format!("{id}.vmlinux.tmp"),
            "",
        ] {
            assert!(!ours(other), "{other}");
        }
    }

    #[test]
    fn malformed_frames_are_refused_in_one_sentence() {
        let data = sample(100_000);
        let good = pack(&data, 4096);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            // A block header cut short right before the trailer (1 to 3 bytes).
            (
                [&LZ4_LEGACY_MAGIC.to_le_bytes()[..], &[7], &1u32.to_le_bytes()].concat(),
                "truncated",
            ),
            (
                [&LZ4_LEGACY_MAGIC.to_le_bytes()[..], &[7, 7, 7], &1u32.to_le_bytes()].concat(),
                "truncated",
            ),
            (b"junk".to_vec(), "not an LZ4 legacy frame"),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 4..].copy_from_slice(&99u32.to_le_bytes());
                    b
                },
                "unpack",
            ),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 4..].copy_from_slice(&u32::MAX.to_le_bytes());
                    b
                },
                "at most",
            ),
            (
                {
                    let mut b = good.clone();
                    b[4..8].copy_from_slice(&(1u32 << 30).to_le_bytes());
                    b
                },
                "malformed",
            ),
            (
                {
                    let mut b = good.clone();
                    b[4..8].copy_from_slice(&0u32.to_le_bytes());
                    b
                },
                "malformed",
            ),
            (
                {
                    let mut b = good.clone();
                    b.truncate(b.len() / 2);
                    b
                },
                "",
            ),
            (
                {
                    let mut b = good.clone();
                    let n = b.len();
                    b[n - 4..].copy_from_slice(&200_000u32.to_le_bytes());
                    b
                },
                "its trailer says 200000",
            ),
            (
                {
                    let mut b = good.clone();
                    for x in &mut b[8..40] {
                        *x = 0xff;
                    }
                    b
                },
                "",
            ),
        ];
        for (bytes, want) in cases {
            let e = lz4_legacy(&bytes).unwrap_err();
            assert!(e.contains(want), "{e}");
            assert!(!e.contains('\n') && !e.ends_with('.'), "{e}");
        }
    }
}
