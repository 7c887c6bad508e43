//! What the metrics endpoint costs (issue 39): two daemons of this build
//! with VM processes (`--jail on`), one with `--metrics-listen` and a
//! scraper reading it every second as Prometheus would, one without;
//! alternating, the same requests: a single fork of a 64 MiB `memwriter`
//! (child deleted after) and a create-and-start of a 16 MiB `idle` VM
//! (deleted after). Each daemon's `memwriter` runs only during its own
//! round (paused otherwise, untimed), so the two never share the host's
//! CPUs with the other's writer. Reported: medians and their ratio, metrics
//! on / off, and the median of the paired ratios (each on round against the
//! off round next to it, which cancels the host's drift). Goal: ≤ 1.02×.
//!
//! Then the scrape itself with `K7D_BENCH_VMS` (default 200) idle 1 MiB VMs
//! in the daemon with metrics on: the time to answer a whole scrape over
//! HTTP (median and max of 21) and its size, in all and per VM. Goal: ≤ 50 ms;
//! the size grows by a fixed amount per VM (printed at half and all VMs).
//!
//! `K7D_BENCH_CONTROL=1` runs the same with neither daemon serving metrics
//! (an A/A control for the first table).
//!
//! The daemon counts every request (`Metrics::observe`) whether or not it
//! serves metrics, so the first table compares the endpoint and its
//! scrapes, not the counting: the counting of one fork request and of one
//! failed request is timed directly too, against the fork's median.
//!
//! Run as root: `cargo build --release --bin k7d && K7D_BIN=target/release/k7d cargo bench -p k7d-benches --bench metrics`
//! (`K7D_BENCH_RUNS` sets the run count, default 1001: about a minute; at
//! 41 runs the A/A control alone read 0.97-1.12x on the 2-CPU CI host).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k7d_benches::{env_num, is_root, k7d_bin, kill_vm_processes_under, median};

struct Daemon {
    child: Child,
    sock: PathBuf,
}

impl Daemon {
    fn start(k7d: &Path, dir: &Path, name: &str, id_base: &str, metrics: Option<u16>) -> Result<Self> {
        let sock = dir.join(format!("{name}.sock"));
        let mut cmd = Command::new(k7d);
        cmd.args([
            "daemon",
            "--jail",
            "on",
            "--jail-cgroup",
            "off",
            "--jail-id-base",
            id_base,
            "--state-dir",
        ])
        .arg(dir.join(format!("state-{name}")))
        .arg("--socket")
        .arg(&sock);
        if let Some(port) = metrics {
            cmd.arg("--metrics-listen").arg(format!("127.0.0.1:{port}"));
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("cannot start a daemon")?;
        let t = Instant::now();
        while UnixStream::connect(&sock).is_err() {
            if t.elapsed() > Duration::from_secs(10) {
                bail!("the daemon did not start");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(Self { child, sock })
    }

    fn call(&self, op: &str, args: serde_json::Value) -> Result<serde_json::Value> {
        k7d_benches::api_call(&self.sock, op, args)
    }

    fn create(&self, id: &str, guest: &str, mib: u64) -> Result<()> {
        self.call(
            "create",
            serde_json::json!({
                "config": {"id": id, "memory_mib": mib, "guest": {"kind": "builtin", "name": guest}},
                "start": true,
            }),
        )?;
        Ok(())
    }

    fn delete_all(&self) {
        if let Ok(l) = self.call("list", serde_json::json!(null)) {
            for v in l["vms"].as_array().into_iter().flatten() {
                let _ = self.call("delete", serde_json::json!({"id": v["id"]}));
            }
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.delete_all();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// One scrape over HTTP: its wall time and body.
fn scrape_timed(port: u16) -> Result<(Duration, String)> {
    let t = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
    let mut back = Vec::new();
    s.read_to_end(&mut back)?;
    let took = t.elapsed();
    let text = String::from_utf8_lossy(&back);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("not an HTTP answer");
    };
    if !head.starts_with("HTTP/1.1 200") {
        bail!("scrape answered {head}");
    }
    Ok((took, body.to_string()))
}

/// One scrape over HTTP: its wall time and body size.
fn scrape(port: u16) -> Result<(Duration, usize)> {
    scrape_timed(port).map(|(t, b)| (t, b.len()))
}

/// One scrape's body.
fn scrape_body(port: u16) -> Result<String> {
    scrape_timed(port).map(|(_, b)| b)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A fork of `src` (child deleted) and a create-and-start (deleted), in ms.
fn one_round(d: &Daemon) -> Result<(f64, f64)> {
    let t = Instant::now();
    d.call("fork", serde_json::json!({"id": "src"}))?;
    let fork = ms(t.elapsed());
    d.call("delete", serde_json::json!({"id": "src-f1"}))?;
    let t = Instant::now();
    d.create("fresh", "idle", 16)?;
    let start = ms(t.elapsed());
    d.call("delete", serde_json::json!({"id": "fresh"}))?;
    Ok((fork, start))
}

/// The time `Metrics::observe` takes for one fork request (a real fork's
/// reply, one child) and for one failed request, in ns, printed against
/// the fork's median (`fork_ms`).
fn counting_cost(d: &Daemon, fork_ms: f64) -> Result<()> {
    use k7d_api::api::{ApiError, ErrorCode, Forked, Reply};
    use k7d_vmm::daemon::metrics::Metrics;
    let forked: Forked =
        serde_json::from_value(d.call("fork", serde_json::json!({"id": "src"}))?).context("a fork's reply")?;
    for c in &forked.children {
        d.call("delete", serde_json::json!({"id": c.info.id}))?;
    }
    let m = Metrics::new(true);
    const N: u32 = 200_000;
    let time = |op: &'static str, fork: Option<(bool, u32)>, res: &Result<Reply, ApiError>| {
        let t = Instant::now();
        for i in 0..N {
            let took = Duration::from_micros(u64::from(i % 20_000));
            m.observe(op, fork, took, std::hint::black_box(res));
        }
        t.elapsed().as_secs_f64() * 1e9 / f64::from(N)
    };
    let fork_ns = time("fork", Some((false, 1)), &Ok(Reply::Forked(forked)));
    let err_ns = time("info", None, &Err(ApiError::new(ErrorCode::NotFound, "vm x not found")));
    println!(
        "  counting one fork request: {fork_ns:.0} ns ({:.4} % of the fork's median {fork_ms:.2} ms); one failed info: {err_ns:.0} ns",
        fork_ns / (fork_ms * 1e6) * 100.0
    );
    Ok(())
}

fn main() -> Result<()> {
    if !is_root() {
        println!("metrics: skipped (VM processes need root)");
        return Ok(());
    }
    let k7d = k7d_bin()?;
    let dir = std::env::temp_dir().join(format!("k7d-bench-metrics-{}", std::process::id()));
    std::fs::create_dir_all(&dir).context("scratch dir")?;
    let measured = measure(&k7d, &dir);
    kill_vm_processes_under(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    measured
}

fn measure(k7d: &Path, dir: &Path) -> Result<()> {
    let runs = env_num("K7D_BENCH_RUNS", 1001);
    let vms = env_num("K7D_BENCH_VMS", 200);
    let port = free_port()?;
    let off = Daemon::start(k7d, dir, "off", "2000001000", None)?;
    // K7D_BENCH_CONTROL=1: the second daemon without metrics too (an A/A
    // run: what the two daemons differ by without the endpoint).
    let control = std::env::var_os("K7D_BENCH_CONTROL").is_some_and(|v| !v.is_empty() && v != "0");
    let on = Daemon::start(k7d, dir, "on", "2000100000", (!control).then_some(port))?;
    if control {
        println!("metrics: control run (K7D_BENCH_CONTROL): neither daemon serves metrics; the scrape part is skipped");
    }
    // A scraper every second on the daemon with metrics, as Prometheus.
    let stop = Arc::new(AtomicBool::new(false));
    let scraper = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut n = 0u32;
            while !stop.load(Ordering::SeqCst) {
                if scrape(port).is_ok() {
                    n += 1;
                }
                std::thread::sleep(Duration::from_secs(1));
            }
            n
        })
    };
    for d in [&off, &on] {
        d.create("src", "memwriter", 64)?;
        d.call("pause", serde_json::json!({"id": "src"}))?;
    }
    // A round on one daemon: its writer resumed, a fork and a start timed,
    // its writer paused again.
    let round = |d: &Daemon| -> Result<(f64, f64)> {
        d.call("resume", serde_json::json!({"id": "src"}))?;
        let r = one_round(d)?;
        d.call("pause", serde_json::json!({"id": "src"}))?;
        Ok(r)
    };
    let (mut fork_off, mut fork_on, mut start_off, mut start_on) = (vec![], vec![], vec![], vec![]);
    // One warm-up round each, then alternating.
    round(&off)?;
    round(&on)?;
    for i in 0..runs {
        let order: [(&Daemon, bool); 2] = if i % 2 == 0 {
            [(&off, false), (&on, true)]
        } else {
            [(&on, true), (&off, false)]
        };
        for (d, is_on) in order {
            let (f, s) = round(d)?;
            if is_on {
                fork_on.push(f);
                start_on.push(s);
            } else {
                fork_off.push(f);
                start_off.push(s);
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    let scrapes = scraper.join().unwrap_or(0);
    let paired = |on: &[f64], off: &[f64]| {
        let mut r: Vec<f64> = on.iter().zip(off).map(|(a, b)| a / b).collect();
        median(&mut r)
    };
    let (fp, sp) = (paired(&fork_on, &fork_off), paired(&start_on, &start_off));
    let (fo, fn_) = (median(&mut fork_off), median(&mut fork_on));
    let (so, sn) = (median(&mut start_off), median(&mut start_on));
    println!("metrics: medians of {runs}, VM processes, metrics off vs on (scraped {scrapes} times meanwhile)");
    println!(
        "  {:<34} {:>10} {:>10} {:>8} {:>8}",
        "", "off ms", "on ms", "on/off", "paired"
    );
    println!(
        "  {:<34} {:>10.2} {:>10.2} {:>7.3}x {:>7.3}x",
        "fork, 64 MiB memwriter",
        fo,
        fn_,
        fn_ / fo,
        fp
    );
    println!(
        "  {:<34} {:>10.2} {:>10.2} {:>7.3}x {:>7.3}x",
        "create and start, 16 MiB idle",
        so,
        sn,
        sn / so,
        sp
    );
    println!("  goal: on/off <= 1.02x");
    counting_cost(&on, fn_)?;
    drop(off);
    if control {
        return Ok(());
    }

    // The scrape with many VMs.
    on.call("delete", serde_json::json!({"id": "src"}))?;
    let mut sizes = Vec::new();
    for (i, target) in [vms / 2, vms].into_iter().enumerate() {
        let have = if i == 0 { 0 } else { vms / 2 };
        for n in have..target {
            on.create(&format!("v{n}"), "idle", 1)?;
        }
        // Every VM's memory read once (`k7d-vm-memory`, in the background)
        // before the timing: a scrape without those series would be cheaper.
        let t = Instant::now();
        loop {
            let body = scrape_body(port)?;
            let read = body
                .lines()
                .filter(|l| l.starts_with("k7d_vm_process_pss_bytes{"))
                .count();
            if read >= target {
                break;
            }
            if t.elapsed() > Duration::from_secs(60) {
                bail!("only {read} of {target} VMs' memory in the scrape after 60 s");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        println!(
            "  every VM's memory in the scrape {:.1} s after its VMs were made",
            t.elapsed().as_secs_f64()
        );
        let mut times = Vec::new();
        let mut size = 0;
        for _ in 0..21 {
            let (t, s) = scrape(port)?;
            times.push(ms(t));
            size = s;
        }
        let max = times.iter().cloned().fold(0.0, f64::max);
        let med = median(&mut times);
        println!(
            "  scrape with {target} VMs: median {med:.2} ms, max {max:.2} ms, {size} bytes ({:.0} bytes per VM)",
            size as f64 / target.max(1) as f64
        );
        sizes.push((target, size));
    }
    if let [(a, sa), (b, sb)] = sizes[..] {
        println!(
            "  size grows by {:.0} bytes per VM from {a} to {b} VMs; goal: a scrape of {b} VMs <= 50 ms",
            (sb as f64 - sa as f64) / (b - a).max(1) as f64
        );
    }
    Ok(())
}
