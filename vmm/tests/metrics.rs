//! The daemon's Prometheus endpoint (issue 39, `docs/observability.md`):
//! a real Prometheus (Debian's `prometheus`, on loopback, scraping every
//! second) scrapes a daemon that creates, forks (single, batch, cluster),
//! pauses and deletes test guests; its HTTP API must then show the VM
//! counts, a fork histogram whose count is the forks made, and no series
//! of a deleted VM. `promtool check metrics` finds nothing to say about a
//! scrape; the dashboard in `docs/` asks only for metrics a scrape has; the
//! endpoint bounds hostile clients.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{K7D, Scratch, root_or_skip, text};

/// A TCP port on loopback nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn cli(dir: &Path, args: &[&str]) -> Output {
    let o = Command::new(K7D)
        .arg("--socket")
        .arg(dir.join("k7d.sock"))
        .args(args)
        .output()
        .unwrap();
    assert!(o.status.success(), "k7d {args:?}: {:?}", text(&o));
    o
}

/// An HTTP/1.0 exchange with `port` on loopback: the status code and body.
fn http(port: u16, request: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut back = Vec::new();
    s.read_to_end(&mut back).unwrap();
    let back = String::from_utf8_lossy(&back).into_owned();
    let (head, body) = back.split_once("\r\n\r\n").unwrap_or((&back, ""));
    let code = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, body.to_string())
}

fn get(port: u16, path: &str) -> (u16, String) {
    http(
        port,
        format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes(),
    )
}

fn scrape(port: u16) -> String {
    let (code, body) = get(port, "/metrics");
    assert_eq!(code, 200, "scrape: {body}");
    body
}

/// Percent-encodes a PromQL query for a URL.
fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus's answer to an instant query: each series' labels and value.
fn query(prom: u16, q: &str) -> Vec<(serde_json::Value, f64)> {
    let (code, body) = get(prom, &format!("/api/v1/query?query={}", encode(q)));
    assert_eq!(code, 200, "query {q}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"], "success", "query {q}: {body}");
    v["data"]["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let val = r["value"][1].as_str().unwrap().parse::<f64>().unwrap();
            (r["metric"].clone(), val)
        })
        .collect()
}

/// Waits (30 s at most) until `q`'s one value is `want` in Prometheus.
fn until_value(prom: u16, q: &str, want: f64) {
    let t = Instant::now();
    loop {
        let r = query(prom, q);
        if r.len() == 1 && r[0].1 == want {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "Prometheus: {q} is {r:?}, not {want}, 30 s after the change"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits (30 s at most) until `q` names no series in Prometheus.
fn until_empty(prom: u16, q: &str) {
    let t = Instant::now();
    loop {
        let r = query(prom, q);
        if r.is_empty() {
            return;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "Prometheus: {q} still has {r:?} 30 s after the VM was deleted"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Debian's Prometheus, scraping `target` every second, its storage and
/// log under `dir`; waits until it is ready.
fn start_prometheus(dir: &Path, target: u16) -> (Child, u16) {
    let port = free_port();
    let cfg = dir.join("prometheus.yml");
    std::fs::write(
        &cfg,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: k7d\n    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let mut child = Command::new("prometheus")
        .arg(format!("--config.file={}", cfg.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start prometheus");
    let t = Instant::now();
    loop {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"GET /-/ready HTTP/1.0\r\n\r\n");
            let mut b = String::new();
            let _ = s.read_to_string(&mut b);
            if b.starts_with("HTTP/1.0 200") || b.starts_with("HTTP/1.1 200") {
                return (child, port);
            }
        }
        if let Some(st) = child.try_wait().unwrap() {
            panic!(
                "prometheus exited ({st}): {}",
                std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
            );
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "prometheus was not ready within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A daemon this test started: killed when dropped unless stopped (a test
/// that panics half-way leaves no daemon behind).
struct Running(Option<Child>);

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A daemon with VM processes (no cgroup) and the metrics endpoint on a
/// free port.
fn start_daemon(dir: &Path, jail: bool, id_base: &str) -> (Running, u16) {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec!["--metrics-listen", addr.as_str()];
    if jail {
        args.extend_from_slice(&["--jail-cgroup", "off", "--jail-id-base", id_base]);
    } else {
        args.extend_from_slice(&["--jail", "off"]);
    }
    (
        Running(Some(common::start_daemon(Path::new(K7D), dir, &args, true))),
        port,
    )
}

fn stop_daemon(mut running: Running) {
    let Some(mut d) = running.0.take() else {
        return;
    };
    // SAFETY: plain kill(2) of the daemon this test started.
    unsafe { libc::kill(d.id() as i32, libc::SIGTERM) };
    let t = Instant::now();
    while d.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(20) {
            let _ = d.kill();
            panic!("the daemon did not exit on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills the VM processes under its directory when dropped (a test that
/// panics half-way leaves none running).
struct Reaper(std::path::PathBuf);

impl Drop for Reaper {
    fn drop(&mut self) {
        common::kill_vm_processes_under(&self.0);
    }
}

/// The metric names of a scrape's samples (`_bucket`, `_sum`, `_count`
/// kept as written).
fn sample_names(scrape: &str) -> std::collections::BTreeSet<String> {
    scrape
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
        .collect()
}

#[test]
fn a_real_prometheus_scrapes_vm_counts_fork_histograms_and_forgets_deleted_vms() {
    if !root_or_skip("a_real_prometheus_scrapes_vm_counts_fork_histograms_and_forgets_deleted_vms") {
        return;
    }
    if Command::new("prometheus").arg("--version").output().is_err() {
        k7d_test_skip::skip(
            "a_real_prometheus_scrapes_vm_counts_fork_histograms_and_forgets_deleted_vms",
            "no prometheus binary (Debian's prometheus package; tests/run-all.sh installs it)",
        );
        return;
    }
    let dir = Scratch::new("metrics-prom");
    // VM processes outlive their daemon: a failed assertion must not leave them.
    let _reaper = Reaper(dir.0.clone());
    let (daemon, port) = start_daemon(&dir.0, true, "2000000600");
    let (mut prom, pport) = start_prometheus(&dir.0, port);
    let d = &dir.0;
    // 4 VMs: a (forked alone and in a batch), b (deleted later), c and e
    // (a cluster).
    for id in ["a", "b", "c", "e"] {
        cli(
            d,
            &[
                "create",
                "--id",
                id,
                "--builtin",
                "memwriter",
                "--memory",
                "16",
                "--start",
            ],
        );
    }
    cli(d, &["cluster", "create", "cl", "c", "e"]);
    cli(d, &["fork", "a"]);
    cli(d, &["fork", "a", "--count", "3"]);
    cli(d, &["fork", "cl"]);
    cli(d, &["pause", "b"]);
    // A refused request is counted with its code.
    let o = Command::new(K7D)
        .arg("--socket")
        .arg(d.join("k7d.sock"))
        .args(["info", "nosuch"])
        .output()
        .unwrap();
    assert!(!o.status.success());

    // 4 + 1 + 3 + 2 VMs: 9 running, b paused.
    until_value(pport, "sum(k7d_vms)", 10.0);
    until_value(pport, "k7d_vms{state=\"paused\"}", 1.0);
    until_value(pport, "k7d_vms{state=\"running\"}", 9.0);
    // One observation per fork request: 3 forks, 6 children.
    until_value(pport, "sum(k7d_fork_duration_seconds_count)", 3.0);
    until_value(pport, "k7d_fork_duration_seconds_count{kind=\"single\"}", 1.0);
    until_value(pport, "k7d_fork_duration_seconds_count{kind=\"batch\"}", 1.0);
    until_value(pport, "k7d_fork_duration_seconds_count{kind=\"cluster\"}", 1.0);
    until_value(pport, "sum(k7d_fork_children_total)", 6.0);
    until_value(pport, "k7d_fork_child_build_seconds_count", 6.0);
    until_value(pport, "k7d_vm_fork_children{vm=\"a\"}", 4.0);
    until_value(pport, "k7d_api_requests_total{op=\"info\",code=\"not_found\"}", 1.0);
    until_value(pport, "k7d_api_requests_total{op=\"fork\",code=\"ok\"}", 3.0);
    // A fork's p99 is a number (the histogram has buckets).
    let p99 = query(
        pport,
        "histogram_quantile(0.99, sum by (le) (k7d_fork_duration_seconds_bucket))",
    );
    assert!(
        p99.len() == 1 && p99[0].1.is_finite() && p99[0].1 > 0.0,
        "fork p99: {p99:?}"
    );
    // Each VM process's memory is there, and its guest counts exits.
    // (read in the background: a VM's first reading within a pass or two)
    until_value(pport, "count(k7d_vm_process_pss_bytes)", 10.0);
    // Each guest's populated RAM; a fork child's own copies (its memwriter
    // keeps writing its loop counter) and none for a VM never forked.
    until_value(pport, "count(k7d_vm_guest_ram_resident_bytes > 0)", 10.0);
    until_value(pport, "k7d_vm_guest_ram_copied_bytes{vm=\"b\"}", 0.0);
    until_value(pport, "k7d_vm_guest_ram_copied_bytes{vm=\"a-f1\"} > bool 0", 1.0);
    until_value(
        pport,
        "count(k7d_vm_guest_ram_copied_bytes <= bool on (vm) k7d_vm_guest_ram_resident_bytes == 1)",
        10.0,
    );
    // Its guest's exits, by reason (this k7d's VM processes say why).
    let exits = query(pport, "k7d_vm_exits_total{vm=\"a\"}");
    assert!(
        !exits.is_empty()
            && exits.iter().map(|e| e.1).sum::<f64>() > 0.0
            && exits
                .iter()
                .all(|e| e.0["reason"].as_str().is_some_and(|r| r != "unknown")),
        "exits of a: {exits:?}"
    );

    // Delete b and a fork child: their series go, the counts follow.
    cli(d, &["delete", "b"]);
    cli(d, &["delete", "a-f1"]);
    until_value(pport, "sum(k7d_vms)", 8.0);
    until_empty(pport, "k7d_vm_state{vm=\"b\"}");
    until_empty(pport, "{vm=\"b\"}");
    until_empty(pport, "{vm=\"a-f1\"}");
    until_value(pport, "k7d_vms{state=\"paused\"}", 0.0);
    until_value(pport, "k7d_vm_fork_children{vm=\"a\"}", 3.0);
    // A stopped VM says why (only it); nothing was denied.
    cli(d, &["stop", "a-f2"]);
    until_value(pport, "k7d_vms{state=\"stopped\"}", 1.0);
    until_value(pport, "k7d_vm_stop_reason{vm=\"a-f2\",reason=\"requested\"}", 1.0);
    until_value(pport, "sum(k7d_vm_stop_reason)", 1.0);
    until_value(pport, "sum(k7d_seccomp_denials_total)", 0.0);

    // promtool has nothing to say about a scrape.
    let body = scrape(port);
    let mut check = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    let (o, e) = text(&out);
    assert!(
        out.status.success() && o.trim().is_empty() && e.trim().is_empty(),
        "promtool check metrics: {o}{e}"
    );

    // Prometheus saw the target up all along.
    until_value(pport, "up{job=\"k7d\"}", 1.0);
    let _ = prom.kill();
    let _ = prom.wait();
    // VM processes outlive their daemon: every VM is deleted first.
    let clusters: serde_json::Value = serde_json::from_slice(&cli(d, &["--json", "cluster", "list"]).stdout).unwrap();
    for c in clusters["clusters"].as_array().unwrap() {
        cli(d, &["cluster", "delete", c["id"].as_str().unwrap()]);
    }
    let list: serde_json::Value = serde_json::from_slice(&cli(d, &["--json", "list"]).stdout).unwrap();
    for vm in list["vms"].as_array().unwrap() {
        cli(d, &["delete", vm["id"].as_str().unwrap()]);
    }
    stop_daemon(daemon);
    assert!(common::vm_process_pids_under(d).is_empty(), "VM processes left");
}

/// This package's directory in the checkout under test: cargo's
/// `CARGO_MANIFEST_DIR` at run time. The compile-time one names the
/// checkout the binary was built in, and cargo does not rebuild a crate
/// when only its checkout moved (a CI clone reusing another clone's build
/// products ran that clone's lab scenarios: CHALLENGES.md).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

#[test]
fn the_dashboard_and_the_docs_name_only_metrics_a_scrape_has() {
    if !root_or_skip("the_dashboard_and_the_docs_name_only_metrics_a_scrape_has") {
        return;
    }
    let dir = Scratch::new("metrics-dash");
    let (daemon, port) = start_daemon(&dir.0, false, "");
    let d = &dir.0;
    cli(
        d,
        &["create", "--id", "a", "--builtin", "idle", "--memory", "16", "--start"],
    );
    cli(d, &["fork", "a"]);
    // A stopped VM, for the stop reason's series; a VM named as a warm
    // pool's member, for the pool's.
    cli(d, &["stop", "a-f1"]);
    cli(
        d,
        &[
            "create",
            "--id",
            "pool-0123456789abcdef-1",
            "--builtin",
            "idle",
            "--memory",
            "16",
            "--start",
        ],
    );
    let samples = sample_names(&scrape(port));
    // A histogram's family name counts too (its samples add suffixes).
    let mut names = samples.clone();
    for n in &samples {
        for suffix in ["_bucket", "_sum", "_count"] {
            if let Some(family) = n.strip_suffix(suffix) {
                names.insert(family.to_string());
            }
        }
    }
    let root = manifest_dir().join("..");
    let dashboard = std::fs::read_to_string(root.join("docs/observability-dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dash, &mut exprs);
    assert!(exprs.len() >= 6, "the dashboard has {} queries", exprs.len());
    let docs = std::fs::read_to_string(root.join("docs/observability.md")).unwrap();
    // Every k7d_ name the dashboard's queries and the docs use is a sample
    // name of a scrape (a family whose series all went still shows: the
    // scrape above made one of each but the datapath's, the VM
    // processes' own, which the docs mark, and a pod VM's and a Linux
    // guest's NICs' and drives' (the built-in guests have no PCI devices), which the
    // lab's k7d-cri checks in its scrape).
    let optional = [
        "k7d_datapath_drops_total",
        "k7d_datapath_forwarded_packets_total",
        "k7d_datapath_forwarded_bytes_total",
        "k7d_vm_pod_info",
        "k7d_vm_net_bytes_total",
        "k7d_vm_net_frames_total",
        "k7d_vm_net_dropped_total",
        "k7d_vm_device_interrupts_total",
        "k7d_vm_device_notifications_total",
        "k7d_vm_blk_requests_total",
        "k7d_vm_blk_bytes_total",
        "k7d_vm_blk_failed_requests_total",
        "k7d_vm_process_resident_memory_bytes",
        "k7d_vm_process_pss_bytes",
        "k7d_vm_guest_ram_resident_bytes",
        "k7d_vm_guest_ram_copied_bytes",
        "k7d_vm_process_spares_ready",
        // Only shapes with a shell ready have a series (the shells test).
        "k7d_fork_shells_ready",
    ];
    let mut missing = Vec::new();
    for text in exprs.iter().map(String::as_str).chain(std::iter::once(docs.as_str())) {
        for w in text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
            if w.starts_with("k7d_")
                && w != "k7d_"
                && !names.contains(w)
                && !optional.contains(&w)
                && !missing.contains(&w.to_string())
            {
                missing.push(w.to_string());
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named but not in a scrape: {missing:?}\nscrape has: {names:?}"
    );
    // And the docs list every family a scrape has.
    let undocumented: Vec<_> = samples
        .iter()
        .map(|n| {
            n.trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count")
        })
        .filter(|n| !docs.contains(n))
        .collect();
    assert!(
        undocumented.is_empty(),
        "docs/observability.md does not list {undocumented:?}"
    );
    cli(d, &["delete", "a-f1"]);
    cli(d, &["delete", "a"]);
    stop_daemon(daemon);
}

#[test]
fn the_endpoint_answers_only_scrapes_and_outlasts_hostile_clients() {
    if !root_or_skip("the_endpoint_answers_only_scrapes_and_outlasts_hostile_clients") {
        return;
    }
    let dir = Scratch::new("metrics-hostile");
    let (daemon, port) = start_daemon(&dir.0, false, "");
    assert_eq!(get(port, "/").0, 404);
    assert_eq!(get(port, "/metrics/../etc/passwd").0, 404);
    assert_eq!(
        http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").0,
        405
    );
    assert_eq!(http(port, b"hello\r\n\r\n").0, 400);
    // A head larger than the endpoint reads: refused, not buffered.
    let mut big = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', 64 * 1024));
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(&big);
    let mut back = String::new();
    let _ = s.read_to_string(&mut back);
    assert!(back.starts_with("HTTP/1.1 400"), "a 64 KiB head: {back:?}");
    // A client that connects and says nothing is given up on (its head's
    // time runs out: closed, unanswered); a scrape behind it is answered.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = scrape(port);
    assert!(body.contains("k7d_build_info{"), "{body}");
    silent.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut left = Vec::new();
    silent
        .read_to_end(&mut left)
        .expect("the endpoint closed the silent connection");
    assert!(left.is_empty(), "a silent client was answered: {left:?}");
    // HEAD: the head only.
    let (code, body) = http(port, b"HEAD /metrics HTTP/1.0\r\n\r\n");
    assert_eq!((code, body.as_str()), (200, ""));
    stop_daemon(daemon);
    // The port is free again once the daemon is gone.
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the endpoint outlived the daemon"
    );
}

#[test]
fn a_metrics_address_that_cannot_be_had_refuses_the_start_in_one_sentence() {
    let dir = Scratch::new("metrics-busy");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let o = Command::new(K7D)
        .args(["--socket"])
        .arg(dir.0.join("k7d.sock"))
        .arg("daemon")
        .arg("--state-dir")
        .arg(dir.0.join("state"))
        .args(["--metrics-listen", &addr, "--jail", "off"])
        .output()
        .unwrap();
    let (_, err) = text(&o);
    assert!(!o.status.success(), "the daemon started on a taken metrics address");
    assert!(
        err.contains(&format!("cannot listen for metrics scrapes on {addr}")),
        "{err}"
    );
    assert!(!dir.0.join("k7d.sock").exists(), "the API socket was left");
}

/// `k7d guest-ram` shows what a VM's guest RAM costs the host (issue 38, item
/// 1: density measured honestly), inside the daemon and in a VM process:
/// a fork child of a guest that wrote 1 MiB and then only counts maps only
/// the few pages it touched, its copies among them, and pages read from
/// its base count as shared (resident, not copied, PSS below resident); a
/// VM that is no fork child has no copies.
#[test]
fn info_shows_how_much_of_a_fork_childs_guest_ram_is_shared_with_its_base() {
    if !root_or_skip("info_shows_how_much_of_a_fork_childs_guest_ram_is_shared_with_its_base") {
        return;
    }
    const PAGES: u64 = 256;
    for jail in [false, true] {
        let dir = Scratch::new(if jail { "ram-usage-jail" } else { "ram-usage" });
        let d = &dir.0;
        let _reaper = Reaper(d.clone());
        let (daemon, _) = start_daemon(d, jail, "2000000880");
        let pages = PAGES.to_string();
        // ARG2 0: the pattern once, then only the loop counter.
        cli(
            d,
            &[
                "create",
                "--id",
                "m",
                "--builtin",
                "memwriter",
                "--memory",
                "16",
                "--arg",
                &pages,
                "--arg",
                "2097152",
                "--arg",
                "0",
                "--start",
            ],
        );
        let ram = |id: &str| {
            let r: serde_json::Value = serde_json::from_slice(&cli(d, &["--json", "guest-ram", id]).stdout).unwrap();
            assert_eq!(r["id"], id, "{r}");
            let n = |k: &str| {
                r[k].as_u64()
                    .unwrap_or_else(|| panic!("jail {jail}: {id}'s guest-ram has no {k}: {r}"))
            };
            (n("resident"), n("copied"), n("pss"))
        };
        let info: serde_json::Value = serde_json::from_slice(&cli(d, &["--json", "info", "m"]).stdout).unwrap();
        assert!(
            info.get("guest_ram").is_none(),
            "info (polled by the shim) reads smaps: {info}"
        );
        let log = info["serial_log"].as_str().unwrap().to_string();
        let t = Instant::now();
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("memwriter: pattern done")
        {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "jail {jail}: m never finished its pattern"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let (resident, copied, _) = ram("m");
        assert!(resident >= PAGES * 4096, "jail {jail}: m: {resident} bytes resident");
        assert_eq!(copied, 0, "jail {jail}: m is no fork child, yet has copies");
        cli(d, &["fork", "m", "--count", "1"]);
        std::thread::sleep(Duration::from_millis(300));
        // The child maps only what it touched: its counter's pages, which
        // it wrote (copies), not the MiB its source wrote before the fork.
        let (r0, c0, p0) = ram("m-f1");
        assert!(
            r0 <= 32 * 4096,
            "jail {jail}: m-f1 maps {r0} bytes, more than it touched"
        );
        assert!(
            c0 >= 4096 && c0 <= r0 && p0 <= r0,
            "jail {jail}: m-f1: {r0} resident, {c0} copied, {p0} PSS"
        );
        // Reading 16 pages of the pattern maps them from the base, shared
        // (with the source, which wrote them: each counts in part).
        for i in 0..16u64 {
            let addr = format!("{:#x}", 0x20_0000 + i * 4096);
            cli(d, &["peek", "m-f1", &addr, "--count", "4"]);
        }
        let (resident, copied, pss) = ram("m-f1");
        assert!(
            resident >= r0 + 16 * 4096,
            "jail {jail}: m-f1: {resident} bytes resident after reading 16 pages"
        );
        assert!(
            copied <= c0 + 4 * 4096,
            "jail {jail}: reading copied pages: {c0} -> {copied}"
        );
        assert!(
            pss < resident,
            "jail {jail}: m-f1's PSS {pss} is not below its resident {resident}"
        );
        let text = String::from_utf8(cli(d, &["guest-ram", "m-f1"]).stdout).unwrap();
        assert!(text.starts_with("vm m-f1's guest RAM on the host: "), "{text}");
        cli(d, &["delete", "m-f1"]);
        cli(d, &["delete", "m"]);
        stop_daemon(daemon);
    }
}

#[test]
fn shells_ready_are_shown_by_shape_and_go_with_the_vms_that_asked() {
    if !root_or_skip("shells_ready_are_shown_by_shape_and_go_with_the_vms_that_asked") {
        return;
    }
    let dir = Scratch::new("metrics-shells");
    let d = &dir.0;
    let (daemon, port) = start_daemon(d, false, "");
    // Two shapes: 2 shells of 1 vCPU and 16 MiB, 1 of 1 vCPU and 8 MiB.
    for (id, mib, shells) in [("w", "16", "2"), ("v", "8", "1")] {
        let o = cli(
            d,
            &[
                "create",
                "--id",
                id,
                "--builtin",
                "idle",
                "--memory",
                mib,
                "--fork-shells",
                shells,
                "--start",
            ],
        );
        assert!(o.status.success(), "{:?}", text(&o));
    }
    let shells = |port: u16| -> Vec<String> {
        let mut v: Vec<String> = scrape(port)
            .lines()
            .filter(|l| l.starts_with("k7d_fork_shells_ready{"))
            .map(str::to_string)
            .collect();
        v.sort();
        v
    };
    let until = |want: &[&str]| {
        let t = Instant::now();
        loop {
            let have = shells(port);
            if have == want {
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "shells by shape in the scrape: {have:?}, not {want:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    until(&[
        "k7d_fork_shells_ready{vcpus=\"1\",memory_bytes=\"16777216\"} 2",
        "k7d_fork_shells_ready{vcpus=\"1\",memory_bytes=\"8388608\"} 1",
    ]);
    // The shells of a shape no VM asks for any more go, and their series.
    assert!(cli(d, &["delete", "w"]).status.success());
    until(&["k7d_fork_shells_ready{vcpus=\"1\",memory_bytes=\"8388608\"} 1"]);
    stop_daemon(daemon);
}
