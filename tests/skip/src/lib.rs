//! A test whose prerequisite is missing skips its body through [`skip`], never
//! with a bare `return`: the skip is printed (`K7D-SKIP test: why`) and, when
//! `$K7D_SKIP_LOG` names a file, appended to it. `tests/run-all.sh` sets it and
//! ends CI's output with the count and the list, so a skipped check is seen.
//! `K7D_NO_SKIP=1` turns every skip into a failure (for machines where every
//! prerequisite is known to be present).

use std::io::Write;

/// Records that `test` skipped its body because of `why`. Returns `true`, so a
/// test reads `if !prerequisite && skip("name", "why") { return; }`.
///
/// # Panics
/// When `K7D_NO_SKIP` is set: a skip is then a failure.
pub fn skip(test: &str, why: &str) -> bool {
    let line = format!("K7D-SKIP {test}: {why}");
    assert!(std::env::var_os("K7D_NO_SKIP").is_none(), "{line} (K7D_NO_SKIP is set)");
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("K7D_SKIP_LOG") {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
        if let Err(e) = written {
            eprintln!("K7D-SKIP: cannot append to {}: {e}", path.to_string_lossy());
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_appended_to_the_log() {
        let dir = std::env::temp_dir().join(format!("k7d-skip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("skips");
        // SAFETY: this crate's only test that touches the environment; no
        // other thread of this test binary reads K7D_SKIP_LOG concurrently.
        unsafe { std::env::set_var("K7D_SKIP_LOG", &log) };
        assert!(skip("a_test", "its prerequisite is missing"));
        assert!(skip("b_test", "another"));
        // SAFETY: as above.
        unsafe { std::env::remove_var("K7D_SKIP_LOG") };
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            text,
            "K7D-SKIP a_test: its prerequisite is missing\nK7D-SKIP b_test: another\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
