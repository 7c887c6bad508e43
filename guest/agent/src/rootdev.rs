//! Which block device the kernel command line's `root=` names, as
//! initramfs-tools finds it (through blkid and udev's `/dev/disk/by-*`, of
//! which k7d's initramfs has neither): a `/dev/` path, or `UUID=` /
//! `LABEL=` of the filesystem on a device (ext2/3/4, erofs, xfs), or
//! `PARTUUID=` / `PARTLABEL=` of a partition (GPT; `PARTUUID=` of an MBR
//! partition is the disk's signature and the partition's number,
//! `SSSSSSSS-NN`). The superblocks and partition tables are read off the
//! devices themselves: nothing here trusts more than their bytes.

use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// What `root=` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootSpec {
    /// A device path under `/dev/`.
    Path(PathBuf),
    /// The filesystem's UUID (lower-case, as blkid prints it).
    Uuid(String),
    /// The filesystem's label.
    Label(String),
    /// The partition's UUID (lower-case).
    PartUuid(String),
    /// The GPT partition's name.
    PartLabel(String),
}

impl fmt::Display for RootSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RootSpec::Path(p) => write!(f, "{}", p.display()),
            RootSpec::Uuid(u) => write!(f, "UUID={u}"),
            RootSpec::Label(l) => write!(f, "LABEL={l}"),
            RootSpec::PartUuid(u) => write!(f, "PARTUUID={u}"),
            RootSpec::PartLabel(l) => write!(f, "PARTLABEL={l}"),
        }
    }
}

/// The longest UUID or label `root=` may name (a GPT name is 36 UTF-16
/// units; an MBR PARTUUID is 11 characters).
const MAX_TAG: usize = 72;

/// Whether `v` is a plain absolute path under `under` (which ends in `/`):
/// no `.` or `..` component, at most 256 bytes. The one check of a path the
/// kernel command line names (`root=`, `init=`).
pub fn plain_path(v: &str, under: &str) -> bool {
    let p = Path::new(v);
    v.len() <= 256
        && v.starts_with(under)
        && p.is_absolute()
        && p.components()
            .all(|c| matches!(c, std::path::Component::RootDir | std::path::Component::Normal(_)))
}

/// The kernel's block devices (`sys_block`, `/sys/class/block`), by name,
/// sorted.
fn block_devices(sys_block: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(sys_block)
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

impl RootSpec {
    /// `root=`'s value: `UUID=`, `LABEL=`, `PARTUUID=`, `PARTLABEL=`, their
    /// `/dev/disk/by-*/` spellings, or a plain path under `/dev/`; an error
    /// (one sentence) for anything else.
    pub fn parse(v: &str) -> Result<RootSpec, String> {
        let tagged = [
            ("UUID=", "/dev/disk/by-uuid/"),
            ("LABEL=", "/dev/disk/by-label/"),
            ("PARTUUID=", "/dev/disk/by-partuuid/"),
            ("PARTLABEL=", "/dev/disk/by-partlabel/"),
        ];
        for (i, (tag, dir)) in tagged.iter().enumerate() {
            let Some(value) = v.strip_prefix(tag).or_else(|| v.strip_prefix(dir)) else {
                continue;
            };
            if value.is_empty() || value.len() > MAX_TAG || value.contains('/') || value.chars().any(char::is_control) {
                return Err(format!("root={v} does not name a UUID or label k7d-agent can look for"));
            }
            let lower = value.to_ascii_lowercase();
            return Ok(match i {
                0 => RootSpec::Uuid(lower),
                1 => RootSpec::Label(value.to_string()),
                2 => RootSpec::PartUuid(lower),
                _ => RootSpec::PartLabel(value.to_string()),
            });
        }
        if plain_path(v, "/dev/") {
            Ok(RootSpec::Path(PathBuf::from(v)))
        } else {
            Err(format!(
                "root={v} is neither a path under /dev/ nor UUID=, LABEL=, PARTUUID= or PARTLABEL="
            ))
        }
    }

    /// The device it names among the kernel's block devices
    /// (`sys_block`, `/sys/class/block`, each one at `dev/<name>`); none
    /// yet (a device may still be probing: the caller waits and asks again).
    pub fn find(&self, sys_block: &Path, dev: &Path) -> Option<PathBuf> {
        if let RootSpec::Path(p) = self {
            return std::fs::symlink_metadata(p).is_ok().then(|| p.clone());
        }
        block_devices(sys_block).into_iter().find_map(|name| {
            let path = dev.join(&name);
            let fs = || fs_id_of(&path);
            let part = || part_id_of(sys_block, dev, &name);
            let hit = match self {
                RootSpec::Uuid(u) => fs().is_some_and(|id| id.uuid.as_ref() == Some(u)),
                RootSpec::Label(l) => fs().is_some_and(|id| id.label.as_ref() == Some(l)),
                RootSpec::PartUuid(u) => part().is_some_and(|p| p.uuid == *u),
                RootSpec::PartLabel(l) => part().is_some_and(|p| p.label.as_ref() == Some(l)),
                RootSpec::Path(_) => false,
            };
            hit.then_some(path)
        })
    }

    /// What each block device holds, for a `root=` that matched none
    /// ("vda: erofs UUID=…; vdb: nothing k7d-agent reads").
    pub fn seen(sys_block: &Path, dev: &Path) -> String {
        let names = block_devices(sys_block);
        if names.is_empty() {
            return "no block device".into();
        }
        let each: Vec<String> = names
            .iter()
            .map(|n| {
                let mut what = Vec::new();
                if let Some(id) = fs_id_of(&dev.join(n)) {
                    what.push(format!(
                        "{} UUID={}{}",
                        id.kind,
                        id.uuid.as_deref().unwrap_or("-"),
                        id.label.map(|l| format!(" LABEL={l}")).unwrap_or_default()
                    ));
                }
                if let Some(p) = part_id_of(sys_block, dev, n) {
                    what.push(format!(
                        "PARTUUID={}{}",
                        p.uuid,
                        p.label.map(|l| format!(" PARTLABEL={l}")).unwrap_or_default()
                    ));
                }
                if what.is_empty() {
                    what.push("nothing k7d-agent reads".into());
                }
                format!("{n}: {}", what.join(" "))
            })
            .collect();
        each.join("; ")
    }
}

/// A filesystem's identity, read off its superblock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsId {
    /// ext4 (for ext2/3/4), erofs or xfs.
    pub kind: &'static str,
    /// Its UUID, lower-case (none when all zeros).
    pub uuid: Option<String>,
    /// Its label (none when empty).
    pub label: Option<String>,
}

/// How much of a device's start the superblocks need.
const HEAD: usize = 2048;

fn fs_id_of(path: &Path) -> Option<FsId> {
    let f = File::open(path).ok()?;
    let mut head = vec![0u8; HEAD];
    let n = f.read_at(&mut head, 0).ok()?;
    fs_id(&head[..n])
}

/// The identity of the filesystem whose device starts with `head`: ext2/3/4
/// (magic 0xEF53 in the superblock at 1024), erofs (0xE0F5E1E2 at 1024) or
/// xfs ("XFSB" at 0); none for anything else.
pub fn fs_id(head: &[u8]) -> Option<FsId> {
    let at = |o: usize, n: usize| head.get(o..o + n);
    if at(0, 4) == Some(b"XFSB") {
        return Some(FsId {
            kind: "xfs",
            uuid: uuid_in_order(at(32, 16)?),
            label: label(at(108, 12)?),
        });
    }
    if at(1024 + 56, 2) == Some(&0xEF53u16.to_le_bytes()[..]) {
        return Some(FsId {
            kind: "ext4",
            uuid: uuid_in_order(at(1024 + 104, 16)?),
            label: label(at(1024 + 120, 16)?),
        });
    }
    if at(1024, 4) == Some(&0xE0F5_E1E2u32.to_le_bytes()[..]) {
        return Some(FsId {
            kind: "erofs",
            uuid: uuid_in_order(at(1024 + 48, 16)?),
            label: label(at(1024 + 64, 16)?),
        });
    }
    None
}

/// 16 bytes as a UUID in byte order (filesystems store it so); none when
/// all zeros (no UUID set).
fn uuid_in_order(b: &[u8]) -> Option<String> {
    if b.iter().all(|&x| x == 0) {
        return None;
    }
    Some(uuid_text(b))
}

fn uuid_text(b: &[u8]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// A NUL-padded label; none when empty or not UTF-8.
fn label(b: &[u8]) -> Option<String> {
    let end = b.iter().position(|&x| x == 0).unwrap_or(b.len());
    let s = std::str::from_utf8(&b[..end]).ok()?;
    (!s.is_empty()).then(|| s.to_string())
}

/// A partition's identity, read off its disk's partition table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartId {
    /// The GPT entry's unique GUID, or the MBR disk signature and the
    /// partition's number (`SSSSSSSS-NN`), lower-case.
    pub uuid: String,
    /// The GPT entry's name (none on MBR or when empty).
    pub label: Option<String>,
}

/// The most GPT entries read (the usual table has 128).
const MAX_GPT_ENTRIES: u32 = 256;

/// `name`'s identity if it is a partition (`/sys/class/block/<name>/partition`
/// holds its number; its disk is the folder it sits in).
fn part_id_of(sys_block: &Path, dev: &Path, name: &str) -> Option<PartId> {
    let entry = sys_block.join(name);
    let number: u32 = std::fs::read_to_string(entry.join("partition"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let disk = std::fs::canonicalize(&entry)
        .ok()?
        .parent()?
        .file_name()?
        .to_str()?
        .to_string();
    let sector: u64 = std::fs::read_to_string(sys_block.join(&disk).join("queue/logical_block_size"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|s| [512, 1024, 2048, 4096].contains(s))
        .unwrap_or(512);
    let f = File::open(dev.join(&disk)).ok()?;
    part_id(&|off, buf| f.read_at(buf, off).ok(), sector, number)
}

/// Partition `number`'s identity on a disk read through `read` (offset,
/// buffer → bytes read) with `sector`-byte sectors: GPT when the header at
/// LBA 1 says "EFI PART", else MBR (its four primary entries).
pub fn part_id(read: &dyn Fn(u64, &mut [u8]) -> Option<usize>, sector: u64, number: u32) -> Option<PartId> {
    let mut hdr = [0u8; 92];
    if read(sector, &mut hdr)? == hdr.len() && &hdr[0..8] == b"EFI PART" {
        let u32_at = |o: usize| u32::from_le_bytes([hdr[o], hdr[o + 1], hdr[o + 2], hdr[o + 3]]);
        let lba = u64::from_le_bytes(hdr[72..80].try_into().ok()?);
        let (count, size) = (u32_at(80), u32_at(84));
        if number == 0 || number > count.min(MAX_GPT_ENTRIES) || !(128..=4096).contains(&size) {
            return None;
        }
        let off = lba
            .checked_mul(sector)?
            .checked_add(u64::from(number - 1) * u64::from(size))?;
        let mut e = [0u8; 128];
        if read(off, &mut e)? != e.len() || e[0..16].iter().all(|&x| x == 0) {
            return None; // an unused entry
        }
        let g = &e[16..32];
        // A GUID's first three fields are little-endian on disk.
        let ordered: Vec<u8> = [g[3], g[2], g[1], g[0], g[5], g[4], g[7], g[6]]
            .into_iter()
            .chain(g[8..16].iter().copied())
            .collect();
        let units: Vec<u16> = e[56..128]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .take_while(|&u| u != 0)
            .collect();
        let name = String::from_utf16(&units).ok().filter(|s| !s.is_empty());
        return Some(PartId {
            uuid: uuid_text(&ordered),
            label: name,
        });
    }
    let mut mbr = [0u8; 512];
    if read(0, &mut mbr)? != mbr.len() || mbr[510..512] != [0x55, 0xAA] || !(1..=4).contains(&number) {
        return None;
    }
    let entry = 446 + 16 * (number as usize - 1);
    if mbr[entry + 4] == 0 {
        return None; // an empty slot
    }
    let sig = u32::from_le_bytes(mbr[440..444].try_into().ok()?);
    Some(PartId {
        uuid: format!("{sig:08x}-{number:02x}"),
        label: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: [u8; 16] = [
        0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
    ];
    const UUID_TEXT: &str = "12345678-9abc-def0-0123-456789abcdef";

    fn image(put: &[(usize, &[u8])]) -> Vec<u8> {
        let mut v = vec![0u8; HEAD];
        for (o, b) in put {
            v[*o..*o + b.len()].copy_from_slice(b);
        }
        v
    }

    #[test]
    fn root_is_a_dev_path_or_a_tag_as_initramfs_tools_takes_it() {
        assert_eq!(RootSpec::parse("/dev/vda1"), Ok(RootSpec::Path("/dev/vda1".into())));
        assert_eq!(
            RootSpec::parse("UUID=12345678-9ABC-def0-0123-456789ABCDEF"),
            Ok(RootSpec::Uuid(UUID_TEXT.into())),
            "UUIDs compare without case"
        );
        assert_eq!(
            RootSpec::parse("/dev/disk/by-uuid/ABCD-1234"),
            Ok(RootSpec::Uuid("abcd-1234".into()))
        );
        assert_eq!(RootSpec::parse("LABEL=Root"), Ok(RootSpec::Label("Root".into())));
        assert_eq!(
            RootSpec::parse("PARTUUID=0A0B0C0D-01"),
            Ok(RootSpec::PartUuid("0a0b0c0d-01".into()))
        );
        assert_eq!(
            RootSpec::parse("/dev/disk/by-partlabel/rootfs"),
            Ok(RootSpec::PartLabel("rootfs".into()))
        );
        for bad in [
            "UUID=",
            "LABEL=a/b",
            "/dev/disk/by-uuid/../../etc",
            "/dev/../etc/passwd",
            "/tmp/x",
            "vda",
            "LABEL=\u{7}",
        ] {
            let e = RootSpec::parse(bad).unwrap_err();
            assert!(e.contains(bad) && !e.contains('\n'), "{bad}: {e}");
        }
        assert!(RootSpec::parse(&format!("LABEL={}", "x".repeat(MAX_TAG + 1))).is_err());
        assert_eq!(RootSpec::Uuid("u".into()).to_string(), "UUID=u");
    }

    #[test]
    fn the_superblocks_of_ext4_erofs_and_xfs_give_their_uuid_and_label() {
        let ext4 = image(&[(1024 + 56, &[0x53, 0xEF]), (1024 + 104, &UUID), (1024 + 120, b"rootfs")]);
        assert_eq!(
            fs_id(&ext4),
            Some(FsId {
                kind: "ext4",
                uuid: Some(UUID_TEXT.into()),
                label: Some("rootfs".into())
            })
        );
        let erofs = image(&[(1024, &0xE0F5_E1E2u32.to_le_bytes()), (1024 + 48, &UUID)]);
        assert_eq!(
            fs_id(&erofs),
            Some(FsId {
                kind: "erofs",
                uuid: Some(UUID_TEXT.into()),
                label: None
            })
        );
        let xfs = image(&[(0, b"XFSB"), (108, b"twelve-chars")]);
        assert_eq!(
            fs_id(&xfs),
            Some(FsId {
                kind: "xfs",
                uuid: None,
                label: Some("twelve-chars".into())
            }),
            "an all-zero UUID is none; a 12-byte label with no NUL is whole"
        );
        assert_eq!(fs_id(&image(&[])), None, "zeros are no filesystem");
        assert_eq!(fs_id(&ext4[..1100]), None, "a short read is no filesystem");
        let bad_label = image(&[(1024 + 56, &[0x53, 0xEF]), (1024 + 120, &[0xff, 0xfe])]);
        assert_eq!(
            fs_id(&bad_label).unwrap().label,
            None,
            "a label that is not UTF-8 is none"
        );
    }

    fn disk(put: &[(usize, &[u8])], len: usize) -> impl Fn(u64, &mut [u8]) -> Option<usize> + use<> {
        let mut v = vec![0u8; len];
        for (o, b) in put {
            v[*o..*o + b.len()].copy_from_slice(b);
        }
        move |off: u64, buf: &mut [u8]| {
            let off = usize::try_from(off).ok()?;
            let src = v.get(off..)?;
            let n = src.len().min(buf.len());
            buf[..n].copy_from_slice(&src[..n]);
            Some(n)
        }
    }

    #[test]
    fn gpt_and_mbr_partitions_give_their_partuuid() {
        let mut hdr = vec![0u8; 92];
        hdr[0..8].copy_from_slice(b"EFI PART");
        hdr[72..80].copy_from_slice(&2u64.to_le_bytes());
        hdr[80..84].copy_from_slice(&128u32.to_le_bytes());
        hdr[84..88].copy_from_slice(&128u32.to_le_bytes());
        let mut e2 = vec![0u8; 128];
        e2[0] = 0xAF; // a type GUID: in use
        e2[16..32].copy_from_slice(&UUID);
        for (i, u) in "root".encode_utf16().enumerate() {
            e2[56 + 2 * i..58 + 2 * i].copy_from_slice(&u.to_le_bytes());
        }
        let gpt = disk(&[(512, &hdr), (1024 + 128, &e2)], 64 << 10);
        assert_eq!(
            part_id(&gpt, 512, 2),
            Some(PartId {
                uuid: "78563412-bc9a-f0de-0123-456789abcdef".into(),
                label: Some("root".into())
            }),
            "a GUID's first three fields are little-endian"
        );
        assert_eq!(part_id(&gpt, 512, 1), None, "an unused entry");
        assert_eq!(part_id(&gpt, 512, 129), None, "past the table");
        assert_eq!(part_id(&gpt, 512, 0), None);
        let short = disk(&[(512, &hdr)], 1100);
        assert_eq!(part_id(&short, 512, 2), None, "a table past the disk's end");

        let mut mbr = vec![0u8; 512];
        mbr[440..444].copy_from_slice(&0x0a0b_0c0du32.to_le_bytes());
        mbr[446 + 16 + 4] = 0x83;
        mbr[510..512].copy_from_slice(&[0x55, 0xAA]);
        let m = disk(&[(0, &mbr)], 4096);
        assert_eq!(
            part_id(&m, 512, 2),
            Some(PartId {
                uuid: "0a0b0c0d-02".into(),
                label: None
            })
        );
        assert_eq!(part_id(&m, 512, 1), None, "an empty slot");
        assert_eq!(part_id(&m, 512, 5), None, "no logical partitions");
        assert_eq!(part_id(&disk(&[], 4096), 512, 1), None, "no table");
    }

    /// The UUID and label of filesystems made by their own tools, as blkid
    /// reads them: `mkfs.ext4 -U -L` and `mkfs.erofs -U` (erofs-utils 1.5
    /// sets no label), in image files.
    #[test]
    fn real_ext4_and_erofs_images_give_the_uuid_and_label_they_were_made_with() {
        let tools = ["/usr/sbin/mkfs.ext4", "/usr/bin/mkfs.erofs"];
        if let Some(t) = tools.iter().find(|t| !Path::new(t).exists()) {
            k7d_test_skip::skip(
                "real_ext4_and_erofs_images_give_the_uuid_and_label_they_were_made_with",
                &format!("no {t} (packages e2fsprogs and erofs-utils; tests/run-all.sh installs them)"),
            );
            return;
        }
        let t = std::env::temp_dir().join(format!("k7d-rootdev-mkfs-{}", std::process::id()));
        let src = t.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("marker"), b"x").unwrap();
        let run = |args: &[&str]| {
            let out = std::process::Command::new(args[0]).args(&args[1..]).output().unwrap();
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ext4 = t.join("ext4.img");
        std::fs::File::create(&ext4).unwrap().set_len(4 << 20).unwrap();
        let e = ext4.to_str().unwrap();
        run(&[tools[0], "-q", "-F", "-U", UUID_TEXT, "-L", "k7d-root", e]);
        let erofs = t.join("erofs.img");
        let (r, s) = (erofs.to_str().unwrap(), src.to_str().unwrap());
        run(&[tools[1], "--quiet", "-U", "6b376b37-0d1e-4c0a-9e5f-2a7e00c0ffee", r, s]);
        assert_eq!(
            fs_id_of(&ext4),
            Some(FsId {
                kind: "ext4",
                uuid: Some(UUID_TEXT.into()),
                label: Some("k7d-root".into())
            })
        );
        assert_eq!(
            fs_id_of(&erofs),
            Some(FsId {
                kind: "erofs",
                uuid: Some("6b376b37-0d1e-4c0a-9e5f-2a7e00c0ffee".into()),
                label: None
            })
        );
        std::fs::remove_dir_all(&t).unwrap();
    }

    /// A GPT and an MBR disk image partitioned by `sfdisk`: their
    /// partitions' PARTUUIDs as blkid prints them.
    #[test]
    fn real_gpt_and_mbr_tables_give_the_partuuid_they_were_made_with() {
        let sfdisk = "/usr/sbin/sfdisk";
        if !Path::new(sfdisk).exists() {
            k7d_test_skip::skip(
                "real_gpt_and_mbr_tables_give_the_partuuid_they_were_made_with",
                "no /usr/sbin/sfdisk (package fdisk; tests/run-all.sh installs it)",
            );
            return;
        }
        let t = std::env::temp_dir().join(format!("k7d-rootdev-sfdisk-{}", std::process::id()));
        std::fs::create_dir_all(&t).unwrap();
        let table = |name: &str, script: &str| {
            let img = t.join(name);
            std::fs::File::create(&img).unwrap().set_len(8 << 20).unwrap();
            let mut c = std::process::Command::new(sfdisk)
                .args(["-q", img.to_str().unwrap()])
                .stdin(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            std::io::Write::write_all(&mut c.stdin.take().unwrap(), script.as_bytes()).unwrap();
            let out = c.wait_with_output().unwrap();
            assert!(out.status.success(), "sfdisk: {}", String::from_utf8_lossy(&out.stderr));
            File::open(&img).unwrap()
        };
        let gpt = table(
            "gpt.img",
            &format!(
                "label: gpt\nsize=2MiB, name=k7d-root\nsize=2MiB, name=second, uuid={}\n",
                UUID_TEXT.to_uppercase()
            ),
        );
        assert_eq!(
            part_id(&|o, b| gpt.read_at(b, o).ok(), 512, 2),
            Some(PartId {
                uuid: UUID_TEXT.into(),
                label: Some("second".into())
            })
        );
        assert_eq!(
            part_id(&|o, b| gpt.read_at(b, o).ok(), 512, 1).and_then(|p| p.label),
            Some("k7d-root".into())
        );
        assert_eq!(part_id(&|o, b| gpt.read_at(b, o).ok(), 512, 3), None, "an unused entry");
        let mbr = table("mbr.img", "label: dos\nlabel-id: 0x0a0b0c0d\nsize=2MiB, type=83\n");
        assert_eq!(
            part_id(&|o, b| mbr.read_at(b, o).ok(), 512, 1),
            Some(PartId {
                uuid: "0a0b0c0d-01".into(),
                label: None
            })
        );
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn find_scans_the_block_devices_and_names_what_each_holds() {
        let t = std::env::temp_dir().join(format!("k7d-rootdev-{}", std::process::id()));
        let (sys, dev) = (t.join("sys"), t.join("dev"));
        for d in ["vda", "vdb"] {
            std::fs::create_dir_all(sys.join(d)).unwrap();
        }
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("vda"), image(&[])).unwrap();
        let erofs = image(&[
            (1024, &0xE0F5_E1E2u32.to_le_bytes()),
            (1024 + 48, &UUID),
            (1024 + 64, b"img"),
        ]);
        std::fs::write(dev.join("vdb"), &erofs).unwrap();
        let found = |s: &str| RootSpec::parse(s).unwrap().find(&sys, &dev);
        assert_eq!(
            found(&format!("UUID={}", UUID_TEXT.to_uppercase())),
            Some(dev.join("vdb"))
        );
        assert_eq!(found("LABEL=img"), Some(dev.join("vdb")));
        assert_eq!(found("LABEL=other"), None);
        assert_eq!(found("PARTUUID=0a0b0c0d-01"), None, "no partitions");
        let seen = RootSpec::seen(&sys, &dev);
        assert_eq!(
            seen,
            format!("vda: nothing k7d-agent reads; vdb: erofs UUID={UUID_TEXT} LABEL=img")
        );
        std::fs::remove_dir_all(&t).unwrap();
    }
}
