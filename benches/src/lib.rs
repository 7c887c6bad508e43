//! Shared helpers for k7d's benchmarks: timing child processes, medians,
//! side-by-side tables.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The release `k7d` binary (`K7D_BIN` overrides).
pub fn k7d_bin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("K7D_BIN") {
        return Ok(PathBuf::from(p));
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/k7d");
    if !p.exists() {
        bail!(
            "{} is missing: build it first with `cargo build --release --bin k7d`",
            p.display()
        );
    }
    Ok(p)
}

/// Spawns `cmd` and returns the time from spawn to the first byte on its stdout
/// (then waits for it to exit, killing it after `grace`).
pub fn time_to_first_stdout_byte(cmd: &mut Command, grace: Duration) -> Result<Duration> {
    let t0 = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("cannot start {cmd:?}"))?;
    let mut out = child.stdout.take().context("no stdout")?;
    let mut b = [0u8; 1];
    let n = out.read(&mut b).context("reading the child's stdout")?;
    let dt = t0.elapsed();
    if n == 0 {
        let _ = child.kill();
        let _ = child.wait();
        bail!("{cmd:?} printed nothing");
    }
    let deadline = Instant::now() + grace;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(dt)
}

/// Median, minimum and maximum.
pub fn stats(v: &[Duration]) -> (Duration, Duration, Duration) {
    let mut s = v.to_vec();
    s.sort();
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

/// Milliseconds with 2 decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

pub mod daemon;
pub mod qemu_fork;
pub mod ring;

/// The first `name` on `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| std::path::Path::new(d).join(name))
        .find(|p| p.exists())
}

/// A number from the environment, else `default`.
pub fn env_num(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Median of `v` (sorted in place); zero for an empty slice.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A started VM running the embedded `idle` guest with `mib` MiB of RAM
/// (the fork benches' sources and cluster members).
pub fn idle_vm(id: &str, mib: u64) -> Result<k7d_vmm::Vm> {
    let cfg = k7d_api::config::VmConfig {
        id: Some(id.into()),
        memory_mib: mib,
        guest: k7d_api::config::GuestSpec::Builtin {
            name: "idle".into(),
            args: vec![],
        },
        ..Default::default()
    };
    let mut vm = k7d_vmm::Vm::new(id, &cfg, &k7d_vmm::VmOptions::default())?;
    vm.start()?;
    Ok(vm)
}

/// One API request line to the daemon at `sock`; its result, or its error
/// as an error.
pub fn api_call(sock: &std::path::Path, op: &str, args: serde_json::Value) -> Result<serde_json::Value> {
    use std::io::{BufRead, BufReader, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock)?;
    writeln!(s, "{}", serde_json::json!({"v": 1, "op": op, "args": args}))?;
    let mut back = String::new();
    BufReader::new(s).read_line(&mut back)?;
    let v: serde_json::Value = serde_json::from_str(&back)?;
    if v["ok"] != true {
        bail!("{op}: {}", v["error"]);
    }
    Ok(v["result"].clone())
}

/// Kills every VM process whose jail is under `dir`: they outlive their
/// daemon by design, so a bench that stops half-way must not leave them.
pub fn kill_vm_processes_under(dir: &std::path::Path) {
    let dir = dir.to_string_lossy().into_owned();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline);
        if cmdline.contains("vm-process") && cmdline.contains(&dir) {
            // SAFETY: kill takes integers; a VM process this bench's daemon started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}
