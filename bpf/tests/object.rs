//! The embedded object: present when clang was there at build time, both
//! programs pass the kernel verifier (needs root), and a missing object is
//! the error `auto` mode falls back on.
use std::path::PathBuf;

use aya::{Ebpf, programs::SchedClassifier};
use k7d_bpf::{
    BpfError, MAP_PINS, ObjectSource, PROG_NAMES, load_object, tc_object_embedded, tc_object_missing_reason,
};

#[test]
fn embedded_object_has_both_programs_and_passes_the_verifier() {
    let obj = match load_object(&ObjectSource::Embedded) {
        Ok(o) => o,
        Err(e) if std::env::var_os("K7D_BPF_SKIP_BUILD").is_some() || std::env::var_os("K7D_CLANG").is_some() => {
            assert!(e.to_string().starts_with("bpf object missing"));
            return;
        }
        Err(e) => panic!(
            "clang is installed in CI, so the object must be embedded: {e} (build.rs: {:?})",
            tc_object_missing_reason()
        ),
    };
    let mut bpf = Ebpf::load(&obj).expect("object parses and maps are created");
    for m in MAP_PINS {
        assert!(bpf.map(m).is_some(), "map {m} missing");
    }
    for name in PROG_NAMES {
        let prog: &mut SchedClassifier = bpf.program_mut(name).unwrap().try_into().unwrap();
        prog.load()
            .unwrap_or_else(|e| panic!("{name} refused by the verifier: {e}"));
    }
}

#[test]
fn missing_object_is_a_clear_error() {
    for src in [
        ObjectSource::File(PathBuf::from("/nonexistent/k7d_tc.o")),
        ObjectSource::Missing,
    ] {
        let e = load_object(&src).unwrap_err();
        assert!(matches!(e, BpfError::ObjectMissing(_)));
        assert!(e.to_string().starts_with("bpf object missing: "), "{e}");
    }
}

/// What `k7d check` reports agrees with what the loader finds; the reason is
/// one line (it travels through `cargo:rustc-env`). Prints the status, which
/// `bpf/tests/clang-appears.sh` reads.
#[test]
fn tc_object_status_matches_the_object() {
    let loaded = load_object(&ObjectSource::Embedded);
    assert_eq!(tc_object_embedded(), loaded.is_ok());
    match tc_object_missing_reason() {
        None => {
            assert!(tc_object_embedded());
            println!("tc object: embedded");
        }
        Some(why) => {
            assert!(!tc_object_embedded());
            assert!(!why.is_empty() && !why.contains('\n'), "{why:?}");
            let e = loaded.unwrap_err().to_string();
            assert!(e.starts_with("bpf object missing: ") && e.contains(why), "{e}");
            println!("tc object: missing ({why})");
        }
    }
}
