//! Builds the tc classifier object with clang. A missing or failing clang is
//! not a build error: an empty object is embedded and the loader reports
//! "bpf object missing" at run time, so `auto` mode falls back.
use std::{env, fs, path::PathBuf, process::Command};

fn main() {
    let src = "src/c/k7d_tc.c";
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=K7D_CLANG");
    println!("cargo:rerun-if-env-changed=K7D_BPF_SKIP_BUILD");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("k7d_tc.o");
    let _ = fs::remove_file(&out);
    if env::var_os("K7D_BPF_SKIP_BUILD").is_some() {
        println!("cargo:warning=K7D_BPF_SKIP_BUILD set: embedding no bpf object");
        fs::write(&out, b"").expect("write empty bpf object");
        return;
    }
    let clang = env::var("K7D_CLANG").unwrap_or_else(|_| "clang".to_string());
    let mut cmd = Command::new(&clang);
    cmd.args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]);
    // asm/types.h lives under the multiarch include dir on Debian.
    for dir in ["/usr/include/x86_64-linux-gnu", "/usr/include/aarch64-linux-gnu"] {
        if std::path::Path::new(dir).is_dir() {
            cmd.arg(format!("-I{dir}"));
        }
    }
    cmd.arg("-c").arg(src).arg("-o").arg(&out);
    match cmd.status() {
        Ok(s) if s.success() => {}
        Ok(s) => {
            println!("cargo:warning={clang} failed ({s}) on {src}: embedding no bpf object");
            fs::write(&out, b"").expect("write empty bpf object");
        }
        Err(e) => {
            println!("cargo:warning={clang} not runnable ({e}): embedding no bpf object");
            fs::write(&out, b"").expect("write empty bpf object");
        }
    }
}
