//! Snapshot directories as files on a disk (`docs/snapshots.md`): absolute
//! paths only, no symbolic link followed, modes, never written over without
//! `replace`, atomic replacement, every byte checksummed and every file
//! checked before a restore builds anything, holes kept as holes, guest
//! images never reopened, and `kill -9` at random points of a stream of
//! snapshots over one destination: every restore afterwards is exactly one
//! complete snapshot.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k7d_api::config::{GuestSpec, VmConfig};
use k7d_guest::{RESULTS_ADDR, result};
use k7d_vmm::vm_memory_reexport::{Bytes, GuestAddress};
use k7d_vmm::{Vm, VmOptions};
use sha2::{Digest, Sha256};

mod common;
use common::Scratch;

const COUNTER: u64 = RESULTS_ADDR + result::LOOP_COUNTER;
const DONE: u64 = RESULTS_ADDR + result::PATTERN_DONE;
/// `memwriter` fills 64 pages from 2 MiB and then writes its counter into
/// them in turn (ARG2 = 1).
const PATTERN_AT: u64 = 0x20_0000;

fn builtin(name: &str, memory_mib: u64, args: &[u32]) -> VmConfig {
    VmConfig {
        vcpus: 1,
        memory_mib,
        guest: GuestSpec::Builtin {
            name: name.into(),
            args: args.to_vec(),
        },
        ..Default::default()
    }
}

fn boot(id: &str, cfg: &VmConfig) -> Vm {
    let mut vm = Vm::new(id, cfg, &VmOptions::default()).expect("build vm");
    vm.start().expect("start vm");
    vm
}

fn read_u32(vm: &Vm, addr: u64) -> u32 {
    vm.memory().read_obj(GuestAddress(addr)).expect("read guest u32")
}

fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    while !f() {
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// A running `memwriter` whose pattern is written.
fn memwriter(id: &str, memory_mib: u64) -> Vm {
    let vm = boot(id, &builtin("memwriter", memory_mib, &[64, PATTERN_AT as u32, 1]));
    assert!(
        wait_for(Duration::from_secs(10), || read_u32(&vm, DONE) == 1),
        "memwriter never finished its pattern"
    );
    vm
}

fn pause(vm: &Vm) {
    vm.pause(Duration::from_secs(5)).expect("pause");
}

/// Runs the guest on until its counter moved, then pauses it again.
fn step(vm: &Vm) {
    let c = read_u32(vm, COUNTER);
    vm.resume().unwrap();
    assert!(wait_for(Duration::from_secs(5), || read_u32(vm, COUNTER) != c));
    pause(vm);
}

fn restore(id: &str, dir: &Path) -> Result<Vm, String> {
    Vm::restore_from(id, dir, &VmOptions::default()).map_err(|e| e.to_string())
}

fn refusal(id: &str, dir: &Path) -> String {
    match restore(id, dir) {
        Ok(_) => panic!("{} was restored", dir.display()),
        Err(e) => {
            assert!(!e.contains('\n'), "not one sentence: {e}");
            e
        }
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// Everything that identifies one instant of a `memwriter` VM: its counter,
/// the registers that say where its loop is, and a SHA-256 of all its RAM
/// (read from the memfd, where holes read as zeros and stay holes, unless
/// the VM was forked).
fn fingerprint(vm: &Vm) -> String {
    let st = vm.save_state().expect("save state");
    let r = &st.vcpus[0].regs;
    let size = vm.memfd().metadata().unwrap().len();
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0;
    while at < size {
        let n = (size - at).min(buf.len() as u64) as usize;
        if vm.ram().is_frozen() {
            // Since a fork the VM's own pages are private: read what it sees
            // (these RAMs stay below the 3 GiB hole: offset = address).
            vm.memory().read_slice(&mut buf[..n], GuestAddress(at)).unwrap();
        } else {
            vm.memfd().read_exact_at(&mut buf[..n], at).unwrap();
        }
        h.update(&buf[..n]);
        at += n as u64;
    }
    let ram: String = h.finalize().iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "counter={} rbx={:#x} rip={:#x} ram={ram}",
        read_u32(vm, COUNTER),
        r.rbx,
        r.rip
    )
}

/// Rewrites `dir`'s manifest with `edit` applied to its body, and the body's
/// checksum recomputed: a hand edit by someone who knows the format.
fn edit_manifest_body(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let mut body = m["body"].clone();
    edit(&mut body);
    let body = serde_json::to_string(&body).unwrap();
    let text = format!(
        r#"{{"format":"k7d-snapshot","version":1,"body_sha256":"{}","body":{body}}}"#,
        sha256_hex(body.as_bytes())
    );
    std::fs::write(&path, text).unwrap();
}

fn flip_bit(path: &Path, at: u64) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x10;
    f.write_all_at(&b, at).unwrap();
}

fn mkfifo(path: &Path) {
    k7d_sys::file::mkfifo(path, 0o600).unwrap_or_else(|e| panic!("mkfifo {}: {e}", path.display()));
}

#[test]
fn a_relative_snapshot_path_is_refused_in_one_sentence() {
    let mut vm = memwriter("snf-rel", 16);
    pause(&vm);
    let rel = Path::new("k7d-relative-snapshot");
    let e = vm.snapshot(rel, false).unwrap_err().to_string();
    assert!(e.contains("is relative") && e.contains("absolute path"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    assert!(!rel.exists(), "a refused snapshot created {}", rel.display());
    let e = refusal("snf-rel-r", rel);
    assert!(e.contains("is relative"), "{e}");
    let e = vm.snapshot(Path::new("/tmp/../tmp/x"), false).unwrap_err().to_string();
    assert!(e.contains("`..`"), "{e}");
    vm.stop();
}

#[test]
fn snapshot_files_are_0600_in_a_0700_directory_and_nothing_else_is_left() {
    let s = Scratch::new("snapfiles-modes");
    let mut vm = memwriter("snf-modes", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode();
    assert_eq!(mode(&dest) & 0o7777, 0o700, "the snapshot directory");
    assert!(std::fs::symlink_metadata(&dest).unwrap().is_dir());
    assert_eq!(names(&dest), ["manifest.json", "memory", "state.json"]);
    for f in ["manifest.json", "memory", "state.json"] {
        let md = std::fs::symlink_metadata(dest.join(f)).unwrap();
        assert!(md.is_file(), "{f}");
        assert_eq!(md.permissions().mode() & 0o7777, 0o600, "{f}");
    }
    // No temporary sibling stays behind, also after a replace.
    step(&vm);
    vm.snapshot(&dest, true).unwrap();
    assert_eq!(names(&s.0), ["snap"]);
    assert_eq!(mode(&dest) & 0o7777, 0o700);
    vm.stop();
}

#[test]
fn an_existing_snapshot_is_left_untouched_unless_replacing_is_asked_for() {
    let s = Scratch::new("snapfiles-replace");
    let mut vm = memwriter("snf-repl", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    let first = fingerprint(&vm);
    let before: Vec<(u64, Vec<u8>)> = ["manifest.json", "state.json", "memory"]
        .iter()
        .map(|f| {
            let p = dest.join(f);
            (std::fs::metadata(&p).unwrap().ino(), std::fs::read(&p).unwrap())
        })
        .collect();
    let dir_ino = std::fs::metadata(&dest).unwrap().ino();
    step(&vm);
    let second = fingerprint(&vm);
    assert_ne!(first, second);

    let e = vm.snapshot(&dest, false).unwrap_err().to_string();
    assert!(e.contains("already exists") && !e.contains('\n'), "{e}");
    let after: Vec<(u64, Vec<u8>)> = ["manifest.json", "state.json", "memory"]
        .iter()
        .map(|f| {
            let p = dest.join(f);
            (std::fs::metadata(&p).unwrap().ino(), std::fs::read(&p).unwrap())
        })
        .collect();
    assert!(before == after, "a refused snapshot changed the existing one");
    assert_eq!(fingerprint(&restore("snf-repl-a", &dest).unwrap()), first);

    // Replacing is explicit, and atomic: a new directory takes the name.
    vm.snapshot(&dest, true).unwrap();
    assert_ne!(std::fs::metadata(&dest).unwrap().ino(), dir_ino);
    assert_eq!(fingerprint(&restore("snf-repl-b", &dest).unwrap()), second);
    assert_eq!(names(&s.0), ["snap"]);

    // What is not a snapshot is never replaced.
    let other = s.0.join("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("keep"), b"mine").unwrap();
    let e = vm.snapshot(&other, true).unwrap_err().to_string();
    assert!(e.contains("not a k7d snapshot"), "{e}");
    assert_eq!(std::fs::read(other.join("keep")).unwrap(), b"mine");
    let file = s.0.join("file");
    std::fs::write(&file, b"mine").unwrap();
    let e = vm.snapshot(&file, true).unwrap_err().to_string();
    assert!(e.contains("a regular file"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"mine");
    vm.stop();
}

#[test]
fn no_symbolic_link_in_or_above_a_snapshot_is_followed() {
    let s = Scratch::new("snapfiles-links");
    let mut vm = memwriter("snf-link", 16);
    pause(&vm);
    let victim = s.0.join("victim");
    std::fs::write(&victim, b"not guest memory").unwrap();
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    let good_memory = s.0.join("memory.good");
    std::fs::rename(dest.join("memory"), &good_memory).unwrap();
    std::os::unix::fs::symlink(&victim, dest.join("memory")).unwrap();

    // Writing over it: refused without replace; with replace the link is
    // removed with the old snapshot, never written through.
    assert!(vm.snapshot(&dest, false).is_err());
    assert_eq!(std::fs::read(&victim).unwrap(), b"not guest memory");
    // Reading it: a link is refused, even to a good memory file.
    std::fs::remove_file(dest.join("memory")).unwrap();
    std::os::unix::fs::symlink(&good_memory, dest.join("memory")).unwrap();
    let e = refusal("snf-link-r", &dest);
    assert!(e.contains("memory is a symbolic link"), "{e}");
    std::fs::remove_file(dest.join("memory")).unwrap();
    std::os::unix::fs::symlink(&victim, dest.join("memory")).unwrap();
    step(&vm);
    vm.snapshot(&dest, true).unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"not guest memory");
    assert!(std::fs::symlink_metadata(dest.join("memory")).unwrap().is_file());
    restore("snf-link-ok", &dest).unwrap();

    // The destination itself, or a folder above it, a link: refused both
    // ways, and nothing is written where it points.
    let real = s.0.join("real");
    std::fs::create_dir(&real).unwrap();
    let link = s.0.join("link");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    for replace in [false, true] {
        let e = vm.snapshot(&link, replace).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let e = vm.snapshot(&link.join("snap"), replace).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
    }
    assert!(names(&real).is_empty(), "written through a link: {:?}", names(&real));
    std::fs::rename(&dest, real.join("snap")).unwrap();
    let e = refusal("snf-link-p", &link.join("snap"));
    assert!(e.contains("symbolic link"), "{e}");
    restore("snf-link-real", &real.join("snap")).unwrap();
    vm.stop();
}

#[test]
fn a_flipped_bit_is_refused_naming_the_file_and_its_byte_range() {
    let s = Scratch::new("snapfiles-flip");
    let mut vm = memwriter("snf-flip", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    vm.stop();
    let memory = dest.join("memory");

    // In the pattern (data) ...
    flip_bit(&memory, PATTERN_AT + 0x1234);
    let e = refusal("snf-flip-1", &dest);
    assert!(
        e.contains("memory: bytes 0x200000 to 0x2fffff do not match the manifest's checksum"),
        "{e}"
    );
    flip_bit(&memory, PATTERN_AT + 0x1234);
    restore("snf-flip-ok", &dest).unwrap();
    // ... and in a hole (a chunk the guest never wrote).
    flip_bit(&memory, 0x50_0007);
    let e = refusal("snf-flip-2", &dest);
    assert!(e.contains("memory: bytes 0x500000 to 0x5fffff do not match"), "{e}");
    flip_bit(&memory, 0x50_0007);
    restore("snf-flip-ok2", &dest).unwrap();
    // ... and data turned into a hole (zeros where the guest wrote).
    let keep = std::fs::read(&memory).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&memory).unwrap();
    // SAFETY: fallocate on our own open file; it touches no memory of ours.
    let rc = unsafe {
        libc::fallocate(
            std::os::fd::AsRawFd::as_raw_fd(&f),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            PATTERN_AT as i64,
            1 << 20,
        )
    };
    assert_eq!(rc, 0, "punching a hole: {}", std::io::Error::last_os_error());
    let e = refusal("snf-flip-h", &dest);
    assert!(e.contains("memory: bytes 0x200000 to 0x2fffff do not match"), "{e}");
    f.write_all_at(&keep[PATTERN_AT as usize..PATTERN_AT as usize + (1 << 20)], PATTERN_AT)
        .unwrap();
    restore("snf-flip-ok4", &dest).unwrap();

    let state = dest.join("state.json");
    flip_bit(&state, 100);
    let e = refusal("snf-flip-3", &dest);
    let len = std::fs::metadata(&state).unwrap().len();
    assert!(
        e.contains(&format!("state.json: bytes 0x0 to {:#x} do not match", len - 1)),
        "{e}"
    );
    flip_bit(&state, 100);

    // The manifest covers itself: a changed body is refused, however
    // plausible (the memory size here).
    let manifest = dest.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replacen("\"memory_mib\":16", "\"memory_mib\":17", 1)).unwrap();
    let e = refusal("snf-flip-4", &dest);
    assert!(e.contains("manifest.json is damaged"), "{e}");
    std::fs::write(&manifest, &text).unwrap();
    restore("snf-flip-ok3", &dest).unwrap();
}

#[test]
fn an_unknown_format_version_is_refused() {
    let s = Scratch::new("snapfiles-version");
    let mut vm = memwriter("snf-ver", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    vm.stop();
    let manifest = dest.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    assert!(
        text.starts_with(r#"{"format":"k7d-snapshot","version":1,"#),
        "{text:.80}"
    );
    std::fs::write(&manifest, text.replacen(r#""version":1"#, r#""version":2"#, 1)).unwrap();
    let e = refusal("snf-ver-r", &dest);
    assert!(e.contains("format version 2") && e.contains("reads version 1"), "{e}");
    std::fs::write(&manifest, text.replacen("k7d-snapshot", "qemu-savevm", 1)).unwrap();
    let e = refusal("snf-ver-f", &dest);
    assert!(e.contains("qemu-savevm"), "{e}");
    // A directory without a manifest is no snapshot (and says what one holds).
    std::fs::remove_file(&manifest).unwrap();
    let e = refusal("snf-ver-m", &dest);
    assert!(e.contains("has no manifest.json") && e.contains("state.json"), "{e}");
}

#[test]
fn a_fifo_in_place_of_a_snapshot_file_is_refused_without_blocking() {
    let s = Scratch::new("snapfiles-fifo");
    let mut vm = memwriter("snf-fifo", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    vm.stop();
    for f in ["memory", "state.json", "manifest.json"] {
        let p = dest.join(f);
        let aside = s.0.join(format!("{f}.aside"));
        std::fs::rename(&p, &aside).unwrap();
        mkfifo(&p);
        let (tx, rx) = std::sync::mpsc::channel();
        let d = dest.clone();
        let t = Instant::now();
        std::thread::spawn(move || {
            let _ = tx.send(restore("snf-fifo-r", &d).err());
        });
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Some(e)) => {
                assert!(e.contains(&format!("{f} is a FIFO, not a regular file")), "{e}");
                assert!(t.elapsed() < Duration::from_secs(2), "{f}: took {:?}", t.elapsed());
            }
            Ok(None) => panic!("a FIFO as {f} was restored"),
            Err(_) => {
                // Unblock the stuck reader before failing.
                let _ = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NONBLOCK)
                    .open(&p);
                panic!("restore blocked on a FIFO as {f}");
            }
        }
        std::fs::remove_file(&p).unwrap();
        std::fs::rename(&aside, &p).unwrap();
    }
    restore("snf-fifo-ok", &dest).unwrap();
}

#[test]
fn an_oversized_json_file_is_refused_without_being_read() {
    let s = Scratch::new("snapfiles-big");
    let mut vm = memwriter("snf-big", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    vm.stop();
    // 64 GiB (sparse): reading it would take minutes.
    for f in ["state.json", "manifest.json"] {
        let p = dest.join(f);
        let keep = std::fs::read(&p).unwrap();
        File::options().write(true).open(&p).unwrap().set_len(64 << 30).unwrap();
        let t = Instant::now();
        let e = refusal("snf-big-r", &dest);
        assert!(
            e.contains(&format!(
                "{f} is 68719476736 bytes, more than the 16777216 bytes it may have; it was not read"
            )),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(1), "{f}: {:?}", t.elapsed());
        std::fs::write(&p, keep).unwrap();
    }
    restore("snf-big-ok", &dest).unwrap();
}

#[test]
fn a_hand_edited_config_is_refused_by_create_s_validation() {
    let s = Scratch::new("snapfiles-config");
    let mut vm = memwriter("snf-cfg", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    vm.stop();
    let original = std::fs::read(dest.join("manifest.json")).unwrap();
    /// What is edited, in the config given to create and in the manifest.
    type Case = (&'static str, fn(&mut VmConfig), fn(&mut serde_json::Value));
    let cases: [Case; 3] = [
        ("0 vCPUs", |c| c.vcpus = 0, |b| b["config"]["vcpus"] = 0.into()),
        (
            "1 TiB of RAM",
            |c| c.memory_mib = 1 << 20,
            |b| b["config"]["memory_mib"] = (1u64 << 20).into(),
        ),
        (
            "an unknown guest",
            |c| {
                c.guest = GuestSpec::Builtin {
                    name: "nope".into(),
                    args: vec![],
                }
            },
            |b| b["config"]["guest"]["name"] = "nope".into(),
        ),
    ];
    for (what, edit_config, edit_json) in cases {
        let mut cfg = builtin("memwriter", 16, &[64, PATTERN_AT as u32, 1]);
        edit_config(&mut cfg);
        let create_says = cfg.validate().expect_err(what).to_string();
        edit_manifest_body(&dest, edit_json);
        let e = refusal("snf-cfg-r", &dest);
        assert!(
            e.contains("is refused") && e.contains(&create_says),
            "{what}: {e} / {create_says}"
        );
        std::fs::write(dest.join("manifest.json"), &original).unwrap();
    }
    // A manifest that disagrees with the memory file's size is refused too.
    edit_manifest_body(&dest, |b| b["config"]["memory_mib"] = 32.into());
    let e = refusal("snf-cfg-m", &dest);
    assert!(e.contains("config's RAM is 32 MiB"), "{e}");
    std::fs::write(dest.join("manifest.json"), &original).unwrap();
    restore("snf-cfg-ok", &dest).unwrap();
}

#[test]
fn an_interrupted_snapshot_leaves_the_old_one_whole_and_is_cleaned_up() {
    let s = Scratch::new("snapfiles-torn");
    let mut vm = memwriter("snf-torn", 16);
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    let old = fingerprint(&vm);
    // What a writer killed mid-way leaves: a temporary sibling with part of
    // a snapshot (a dead pid in its name), and one killed between the
    // exchange and the removal: the previous snapshot under such a name.
    let mut dead = Command::new("true").spawn().unwrap();
    let pid = dead.id();
    dead.wait().unwrap();
    let partial = s.0.join(format!(".snap.k7d-tmp-{pid}-0"));
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(partial.join("memory"), vec![0x5a; 3 << 20]).unwrap();
    std::fs::write(partial.join("manifest.json"), b"{\"format\":\"k7d-snap").unwrap();
    let replaced = s.0.join(format!(".snap.k7d-tmp-{pid}-1"));
    std::fs::create_dir(&replaced).unwrap();
    for f in ["manifest.json", "state.json", "memory"] {
        std::fs::copy(dest.join(f), replaced.join(f)).unwrap();
    }
    // A live writer's (ours) is not touched.
    let live = s.0.join(format!(".snap.k7d-tmp-{}-999", std::process::id()));
    std::fs::create_dir(&live).unwrap();

    assert_eq!(fingerprint(&restore("snf-torn-a", &dest).unwrap()), old);
    step(&vm);
    let new = fingerprint(&vm);
    vm.snapshot(&dest, true).unwrap();
    assert_eq!(fingerprint(&restore("snf-torn-b", &dest).unwrap()), new);
    assert!(
        !partial.exists() && !replaced.exists(),
        "leftovers stay: {:?}",
        names(&s.0)
    );
    assert!(live.exists());
    vm.stop();
}

#[test]
fn an_idle_vm_snapshot_reads_and_writes_only_the_pages_it_populated() {
    let s = Scratch::new("snapfiles-sparse");
    let mut vm = boot("snf-idle", &builtin("idle", 256, &[]));
    std::thread::sleep(Duration::from_millis(100));
    pause(&vm);
    let allocated = |f: &File| f.metadata().unwrap().blocks() * 512;
    let before = allocated(&vm.memfd());
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    let after = allocated(&vm.memfd());
    assert!(
        after <= before + (64 << 10),
        "the snapshot populated the idle guest's RAM: {before} -> {after} bytes allocated"
    );
    let mem = File::open(dest.join("memory")).unwrap();
    assert_eq!(mem.metadata().unwrap().len(), 256 << 20);
    assert!(
        allocated(&mem) < 1 << 20,
        "the memory file is not sparse: {} bytes allocated",
        allocated(&mem)
    );
    let r = restore("snf-idle-r", &dest).unwrap();
    // (Below 16 MiB: a host that gives shmem huge pages allocates 2 MiB at a time.)
    assert!(
        allocated(&r.memfd()) < 16 << 20,
        "the restore populated {} bytes",
        allocated(&r.memfd())
    );
    assert_eq!(fingerprint(&r), fingerprint(&vm));
    vm.stop();
}

#[test]
fn restore_and_fork_never_reopen_the_guest_image() {
    let s = Scratch::new("snapfiles-image");
    let image = s.0.join("memwriter.bin");
    std::fs::write(&image, k7d_guest::Builtin::MemWriter.image()).unwrap();
    let mut cfg = builtin("memwriter", 16, &[64, PATTERN_AT as u32, 1]);
    cfg.guest = GuestSpec::Raw {
        path: image.clone(),
        args: vec![64, PATTERN_AT as u32, 1],
    };
    let mut vm = boot("snf-img", &cfg);
    assert!(wait_for(Duration::from_secs(10), || read_u32(&vm, DONE) == 1));
    pause(&vm);
    let dest = s.0.join("snap");
    vm.snapshot(&dest, false).unwrap();
    std::fs::remove_file(&image).unwrap();
    let mut r = restore("snf-img-r", &dest).unwrap();
    let c = read_u32(&r, COUNTER);
    r.start().unwrap();
    assert!(wait_for(Duration::from_secs(5), || read_u32(&r, COUNTER) != c));
    r.stop();
    let mut child = vm
        .fork("snf-img-f", &VmOptions::default())
        .expect("fork without the image");
    child.start().unwrap();
    let c = read_u32(&child, COUNTER);
    assert!(wait_for(Duration::from_secs(5), || read_u32(&child, COUNTER) != c));
    child.stop();
    vm.stop();
}

#[test]
fn a_forked_vm_and_its_child_are_snapshotted_as_they_see_their_ram() {
    let s = Scratch::new("snapfiles-forked");
    let mut src = memwriter("snf-fsrc", 16);
    pause(&src);
    let mut child = src.fork("snf-fchild", &VmOptions::default()).unwrap();
    // Both run on: the source's writes land in its private pages over the
    // frozen base, the child's in its own.
    step(&src);
    child.start().unwrap();
    let c = read_u32(&child, COUNTER);
    assert!(wait_for(Duration::from_secs(5), || read_u32(&child, COUNTER) != c));
    pause(&child);
    assert!(src.ram().is_frozen() && child.ram().is_frozen());
    // And each writes where the frozen base has a hole (as a device would).
    src.memory().write_obj(0x5eed_u32, GuestAddress(0x70_0000)).unwrap();
    child.memory().write_obj(0xc41d_u32, GuestAddress(0x78_0000)).unwrap();
    for (vm, name) in [(&src, "src"), (&child, "child")] {
        let dest = s.0.join(name);
        vm.snapshot(&dest, false).unwrap();
        let r = restore(&format!("snf-f{name}-r"), &dest).unwrap();
        assert_eq!(fingerprint(&r), fingerprint(vm), "{name}");
    }
    child.stop();
    src.stop();
}

#[test]
fn a_reader_racing_replaces_restores_one_whole_snapshot_or_is_refused() {
    let s = Scratch::new("snapfiles-race");
    let dest = s.0.join("snap");
    let seen = std::sync::Arc::new(std::sync::Mutex::new(HashSet::new()));
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (dest, seen, done) = (dest.clone(), seen.clone(), done.clone());
        std::thread::spawn(move || {
            let mut vm = boot("snf-race", &builtin("memwriter", 32, &[2048, 0x10_0000, 1]));
            assert!(wait_for(Duration::from_secs(10), || read_u32(&vm, DONE) == 1));
            for _ in 0..40 {
                pause(&vm);
                seen.lock().unwrap().insert(fingerprint(&vm));
                vm.snapshot(&dest, true).unwrap();
                vm.resume().unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            vm.stop();
        })
    };
    assert!(wait_for(Duration::from_secs(20), || dest.exists()));
    let (mut whole, mut refused, mut mixes) = (0, Vec::new(), Vec::new());
    while !done.load(std::sync::atomic::Ordering::SeqCst) {
        match restore("snf-race-r", &dest) {
            Ok(vm) => {
                let f = fingerprint(&vm);
                if seen.lock().unwrap().contains(&f) {
                    whole += 1;
                } else {
                    mixes.push(f);
                }
            }
            Err(e) => refused.push(e),
        }
    }
    writer.join().unwrap();
    eprintln!(
        "{whole} whole restores, {} refused while racing: {refused:?}",
        refused.len()
    );
    assert!(mixes.is_empty(), "restored what no snapshot was: {mixes:#?}");
    assert!(whole > 0, "no restore ran while the writer replaced");
    for e in &refused {
        // A reader that opened the directory just before it was exchanged
        // may find the old files removed: refused, never mixed.
        assert!(e.contains("is missing"), "{e}");
    }
}

// ---------------------------------------------------------------------------
// kill -9 at random points while a process writes snapshots over one
// destination.

const CHILD_DEST: &str = "K7D_TEST_SNAPSHOT_WRITER_DEST";
const CHILD_LOG: &str = "K7D_TEST_SNAPSHOT_WRITER_LOG";

/// The writer that `kill_9_during_snapshots_leaves_exactly_one_complete_snapshot`
/// runs in a child process and kills: a `memwriter` (32 MiB, 2048 pages it
/// keeps rewriting) snapshotted over and over with `replace`, each
/// snapshot's fingerprint logged before it is written and `done` after.
#[test]
#[ignore = "a helper: kill_9_during_snapshots_leaves_exactly_one_complete_snapshot runs it in a child process"]
fn snapshot_writer_child() {
    use std::io::Write;
    let (Some(dest), Some(log)) = (std::env::var_os(CHILD_DEST), std::env::var_os(CHILD_LOG)) else {
        panic!(
            "run by kill_9_during_snapshots_leaves_exactly_one_complete_snapshot, with {CHILD_DEST} and {CHILD_LOG}"
        );
    };
    let vm = boot("writer", &builtin("memwriter", 32, &[2048, 0x10_0000, 1]));
    assert!(wait_for(Duration::from_secs(10), || read_u32(&vm, DONE) == 1));
    let mut log = std::fs::OpenOptions::new().create(true).append(true).open(log).unwrap();
    writeln!(log, "ready").unwrap();
    loop {
        pause(&vm);
        writeln!(log, "begin {}", fingerprint(&vm)).unwrap();
        vm.snapshot(Path::new(&dest), true).unwrap();
        writeln!(log, "done").unwrap();
        vm.resume().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn kill_9_during_snapshots_leaves_exactly_one_complete_snapshot() {
    const KILLS: usize = 50;
    let s = Scratch::new("snapfiles-kill");
    let dest = s.0.join("snap");
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        | 1;
    let mut rng = seed;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut logged: HashSet<String> = HashSet::new();
    let (mut mid, mut restored_last, mut refusals, mut mixes) = (0, 0, Vec::new(), Vec::new());
    for i in 0..KILLS {
        let log = s.0.join(format!("log-{i}"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "snapshot_writer_child",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DEST, &dest)
            .env(CHILD_LOG, &log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let lines = || std::fs::read_to_string(&log).unwrap_or_default();
        // The first writer is let finish one snapshot: from then on the
        // destination always holds one.
        let ready = if i == 0 { "done" } else { "ready" };
        let ok = wait_for(Duration::from_secs(30), || {
            lines().lines().any(|l| l == ready) || child.try_wait().unwrap().is_some()
        });
        assert!(
            ok && child.try_wait().unwrap().is_none(),
            "writer {i} did not start: {}",
            lines()
        );
        std::thread::sleep(Duration::from_micros(next() % 150_000));
        child.kill().unwrap();
        child.wait().unwrap();
        let text = lines();
        let mut last_begin = None;
        for l in text.lines() {
            if let Some(f) = l.strip_prefix("begin ") {
                logged.insert(f.to_string());
                last_begin = Some(f.to_string());
            }
        }
        let killed_mid = text.lines().last().is_some_and(|l| l.starts_with("begin "));
        mid += usize::from(killed_mid);
        match restore(&format!("k{i}"), &dest) {
            Ok(vm) => {
                let f = fingerprint(&vm);
                if !logged.contains(&f) {
                    mixes.push(format!("kill {i}: restored {f}, which no writer logged"));
                } else if killed_mid && last_begin.as_deref() == Some(f.as_str()) {
                    // Renamed into place before the kill, `done` not logged.
                    restored_last += 1;
                }
            }
            Err(e) => refusals.push(format!("kill {i}: {e}")),
        }
    }
    let leftovers: Vec<String> = names(&s.0).into_iter().filter(|n| n.starts_with(".snap")).collect();
    eprintln!(
        "kill -9 x{KILLS} (seed {seed:#x}): {mid} mid-snapshot, {restored_last} of them already renamed in; \
         {} refusals, {} mixes; leftovers {leftovers:?}",
        refusals.len(),
        mixes.len()
    );
    assert!(mixes.is_empty(), "{mixes:#?}");
    assert!(refusals.is_empty(), "{refusals:#?}");
    assert!(
        mid >= 5,
        "only {mid} of {KILLS} kills landed inside a snapshot: the test did not test much"
    );
    assert!(
        leftovers.len() <= 1,
        "interrupted snapshots' leftovers pile up: {leftovers:?}"
    );
}
