//! Builds the tc classifier object with clang.
//!
//! A missing or failing clang is not a build error outside CI: an empty
//! object is embedded, the reason is recorded in `K7D_BPF_MISSING_REASON`
//! (read by `k7d_bpf::tc_object_missing_reason`), and at run time the loader
//! reports "bpf object missing" so `auto` mode falls back to the bridge. With
//! `CI=true` a build without the object fails, unless `K7D_BPF_SKIP_BUILD` is
//! set explicitly.
//!
//! Reruns: on a change to any C source or header under `src/c`, on `K7D_CLANG`, `K7D_BPF_SKIP_BUILD`,
//! `CI` and `PATH`, on the clang binary when one is found, and, when none is,
//! on every existing `PATH` directory: installing clang adds an entry there,
//! which changes the directory's mtime. (Watching the not-yet-existing
//! `/usr/bin/clang` itself does not work: cargo treats a missing watched path
//! as dirty on every build, rebuilding everything that depends on this crate,
//! and once dpkg creates it, its mtime comes from the package, older than the
//! last build, so cargo calls it fresh and never reruns.)
use std::{
    env,
    ffi::OsString,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

const C_DIR: &str = "src/c";
const SRC: &str = "src/c/k7d_tc.c";

fn main() -> ExitCode {
    for var in ["K7D_CLANG", "K7D_BPF_SKIP_BUILD", "CI", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    watch_c_sources(Path::new(C_DIR));
    let Some(out_dir) = env::var_os("OUT_DIR") else {
        eprintln!("k7d-bpf build: OUT_DIR is not set (build.rs must run under cargo)");
        return ExitCode::FAILURE;
    };
    let out = PathBuf::from(out_dir).join("k7d_tc.o");
    let _ = fs::remove_file(&out);

    let reason = match build(&out) {
        Ok(()) => {
            println!("cargo:rustc-env=K7D_BPF_MISSING_REASON=");
            return ExitCode::SUCCESS;
        }
        Err(reason) => one_line(&reason),
    };
    let skip = env::var_os("K7D_BPF_SKIP_BUILD").is_some();
    if env::var("CI").as_deref() == Ok("true") && !skip {
        eprintln!(
            "k7d-bpf build: CI=true and the tc object cannot be built: {reason}. Install clang \
             (apt-get install clang libbpf-dev), or set K7D_BPF_SKIP_BUILD=1 to build without the \
             direct datapath on purpose."
        );
        return ExitCode::FAILURE;
    }
    println!("cargo:warning=embedding no bpf object: {reason}");
    if let Err(e) = fs::write(&out, b"") {
        eprintln!("k7d-bpf build: cannot write the empty object {}: {e}", out.display());
        return ExitCode::FAILURE;
    }
    println!("cargo:rustc-env=K7D_BPF_MISSING_REASON={reason}");
    ExitCode::SUCCESS
}

/// Compiles `SRC` into `out`, or says (one sentence) why not.
fn build(out: &Path) -> Result<(), String> {
    if env::var_os("K7D_BPF_SKIP_BUILD").is_some() {
        return Err("K7D_BPF_SKIP_BUILD was set at build time".into());
    }
    let clang = find_clang()?;
    let canonical = fs::canonicalize(&clang).unwrap_or_else(|_| clang.clone());
    println!("cargo:rerun-if-changed={}", clang.display());
    if canonical != clang {
        println!("cargo:rerun-if-changed={}", canonical.display());
    }
    let mut cmd = Command::new(&clang);
    cmd.args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]);
    // asm/types.h lives under the multiarch include dir on Debian.
    for dir in ["/usr/include/x86_64-linux-gnu", "/usr/include/aarch64-linux-gnu"] {
        if Path::new(dir).is_dir() {
            cmd.arg(format!("-I{dir}"));
        }
    }
    cmd.arg("-c").arg(SRC).arg("-o").arg(out);
    let output = cmd
        .output()
        .map_err(|e| format!("{} could not be run ({e})", clang.display()))?;
    if output.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    for line in stderr.lines().take(20) {
        println!("cargo:warning={line}");
    }
    let first = stderr
        .lines()
        .find(|l| l.contains("error"))
        .or_else(|| stderr.lines().next())
        .unwrap_or("no output");
    Err(format!(
        "{} failed on {SRC} ({}): {first}",
        clang.display(),
        output.status
    ))
}

/// The clang to use: `K7D_CLANG` (a path, or a name looked up in `PATH`), else
/// `clang` from `PATH`. When none is found, every existing `PATH` directory
/// is watched so that a later install reruns this script.
fn find_clang() -> Result<PathBuf, String> {
    let requested = env::var_os("K7D_CLANG");
    let name = requested.clone().unwrap_or_else(|| OsString::from("clang"));
    let name_path = PathBuf::from(&name);
    if name_path.components().count() > 1 {
        if is_executable(&name_path) {
            return Ok(name_path);
        }
        // Rerun when it appears (its folder gains an entry).
        if let Some(parent) = name_path.parent().filter(|p| p.is_dir()) {
            println!("cargo:rerun-if-changed={}", parent.display());
        }
        return Err(format!("K7D_CLANG={} is not an executable file", name_path.display()));
    }
    let path = env::var_os("PATH").unwrap_or_default();
    let dirs: Vec<PathBuf> = env::split_paths(&path).filter(|d| !d.as_os_str().is_empty()).collect();
    if let Some(found) = dirs.iter().map(|d| d.join(&name_path)).find(|c| is_executable(c)) {
        return Ok(found);
    }
    // Only existing folders: a missing watched path makes cargo rerun this
    // script, and rebuild every dependent crate, on every build.
    for d in dirs.iter().filter(|d| d.is_dir()) {
        println!("cargo:rerun-if-changed={}", d.display());
    }
    let what = match requested {
        Some(_) => format!("K7D_CLANG={}", name_path.display()),
        None => "clang".to_string(),
    };
    Err(format!("{what} was not found in PATH at build time"))
}

fn is_executable(p: &Path) -> bool {
    fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Every C source and header below `dir`, not the folders: a fresh clone
/// gives a folder a new mtime, which `.ci/mtimes.sh` (it restores files')
/// cannot give back, so a watched folder rebuilt this crate and all that
/// depend on it on every CI run (minutes). A new header matters only once a
/// watched file includes it, and that file then changes.
fn watch_c_sources(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            watch_c_sources(&p);
        } else if matches!(p.extension().and_then(|e| e.to_str()), Some("c" | "h")) {
            println!("cargo:rerun-if-changed={}", p.display());
        }
    }
}

/// `cargo:rustc-env` values end at a newline.
fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}
