//! Arbitrary snapshot files through every check a restore makes before it
//! builds anything (`vstate::snapshot::verify_bytes`: the manifest's format,
//! version, checksum and entries; the config as create validates it; sizes;
//! `state.json`'s checksums, format, version and fit to the config).
//!
//! Input: byte 0 picks the mode.
//! - even: the rest is `state.json`, wrapped in a well-formed manifest (a
//!   2-vCPU, 2 MiB built-in guest; the checksums computed): the fuzzer reaches
//!   the machine-state parser and `check_fits` instead of stopping at a
//!   checksum. Seed: a real snapshot's state.
//! - odd: bytes 1-2 (little endian) split the rest into `manifest.json` and
//!   `state.json`, both as given: the manifest parser and every refusal.
//!
//! Invariants: no panic, no hang, no unbounded allocation (the rss limit).

#![no_main]

use std::path::Path;

use k7d_vmm::VmConfig;
use k7d_vmm::vstate::snapshot::{manifest_bytes, verify_bytes, zero_memory_digests};
use libfuzzer_sys::fuzz_target;

const MEMORY: u64 = 2 << 20;
const CONFIG: &str = r#"{"id":"a","vcpus":2,"memory_mib":2,"guest":{"kind":"builtin","name":"pit","args":[]},"serial":{"console":false},"devices":{"rng":false,"disks":[],"nics":[],"vsock":null}}"#;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let dir = Path::new("/nonexistent/snapshot");
    if mode % 2 == 0 {
        let config: VmConfig = serde_json::from_str(CONFIG).expect("the fixed config parses");
        let (chunk, digests) = zero_memory_digests(MEMORY);
        let Ok(manifest) = manifest_bytes(&config, rest, MEMORY, chunk, digests) else {
            return;
        };
        let _ = verify_bytes(dir, "fuzzed", &manifest, rest, MEMORY);
    } else {
        if rest.len() < 2 {
            return;
        }
        let split = (u16::from_le_bytes([rest[0], rest[1]]) as usize).min(rest.len() - 2);
        let (manifest, state) = rest[2..].split_at(split);
        let _ = verify_bytes(dir, "fuzzed", manifest, state, MEMORY);
    }
});
