//! Per-frame cost of the guest datapath, k7d direct vs Kata's tc u32+mirred
//! vs the Linux bridge chain, against a floor, all measured in one run.
//!
//! Topology per variant (own namespaces): pod netns P holds k7d's tap (a real
//! tap, written through its fd as a VMM does) and `eth0`, whose veth peer
//! `lx` is in node netns N.
//!
//! * VM → pod: one `write()` per 60-byte frame (+ 12-byte virtio-net header)
//!   on the tap fd, an IPv4 packet of an unknown protocol to `lx`'s address;
//!   the node's stack drops it at local delivery and counts it (Ip
//!   InUnknownProtos, proving every frame arrived). Floor: the same local
//!   delivery in the pod netns, straight from the tap (which holds the
//!   address there).
//! * pod → VM: one `send()` per frame on an AF_PACKET socket bound to `lx`;
//!   the frame ends at the tap (nobody reads it, so tun's ring fills, then
//!   the tap's default qdisc backs up and drops; its sent + dropped + queued
//!   counts prove every frame reached the tap). Floor: the "other host" drop at `eth0`.
//! * direct: `k7d_net::Datapath` in `direct` mode (tap ingress →
//!   `bpf_redirect_peer(eth0)`; eth0 ingress → `bpf_redirect(tap)`);
//!   mirred: Kata's `u32 match u32 0 0 action mirred egress redirect` both
//!   ways; bridge: `Datapath` in `bridge` mode without bpf programs.
//! * ping: guest netns G (a tap relayed to k7d's tap by a thread, like a
//!   VMM's virtio-net) → `lx`'s address, direct vs bridge, interleaved.
//!
//! One pinned thread, interleaved rounds, medians. Run as root:
//! `cargo bench -p k7d-benches --bench datapath`. `K7D_BENCH_ROUNDS` (5),
//! `K7D_BENCH_FRAMES` (200000 per round and variant) and `K7D_BENCH_PINGS`
//! (100 per round) lengthen it; the default run takes well under 60 s.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use k7d_benches::{env_num, median};
use k7d_net::{AttachMethod, Attached, Datapath, DatapathConfig, Mode, NicRequest, ObjectSource, in_netns};

const NODE_IP: &str = "10.78.0.1";
const GUEST_IP: &str = "10.78.0.10";

fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .with_context(|| format!("cannot run {args:?}"))?;
    if !out.status.success() {
        bail!("{args:?} failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A named netns, deleted on drop.
struct Netns(String);

impl Netns {
    fn new(tag: &str) -> Result<Self> {
        let name = format!("k7b{}{tag}", std::process::id());
        sh(&["ip", "netns", "add", &name])?;
        let ns = Netns(name);
        ns.run(&["ip", "link", "set", "lo", "up"])?;
        ns.run(&["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])?;
        ns.run(&["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"])?;
        Ok(ns)
    }
    fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.0))
    }
    fn run(&self, args: &[&str]) -> Result<String> {
        let mut a = vec!["ip", "netns", "exec", &self.0];
        a.extend_from_slice(args);
        sh(&a)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.0]);
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    Floor,
    Direct,
    Mirred,
    Bridge,
}

impl Variant {
    const ALL: [Variant; 4] = [Variant::Floor, Variant::Direct, Variant::Mirred, Variant::Bridge];
    fn tag(self) -> &'static str {
        match self {
            Variant::Floor => "f",
            Variant::Direct => "d",
            Variant::Mirred => "m",
            Variant::Bridge => "b",
        }
    }
    fn label(self, to_vm: bool) -> &'static str {
        match (self, to_vm) {
            (Variant::Floor, false) => "floor: tap write + local delivery at the tap",
            (Variant::Floor, true) => "floor: AF_PACKET send + drop in eth0's ip_rcv",
            (Variant::Direct, false) => "k7d direct (bpf_redirect_peer)",
            (Variant::Direct, true) => "k7d direct (eth0 ingress bpf_redirect)",
            (Variant::Mirred, _) => "Kata tc u32+mirred",
            (Variant::Bridge, _) => "Linux bridge chain",
        }
    }
}

/// One variant's namespaces, tap and injection socket.
struct Lab {
    variant: Variant,
    node: Netns,
    pod: Netns,
    guest: Option<Netns>,
    dp: Option<Datapath>,
    tap_fd: OwnedFd,
    tap_name: String,
    _own_tap: Option<k7d_net::Tap>,
    att: Option<Attached>,
    pkt: OwnedFd,
    tx_frame: Vec<u8>,
    rx_frame: Vec<u8>,
    bpffs: PathBuf,
}

fn mac_of(ns: &Netns, dev: &str) -> Result<[u8; 6]> {
    let s = ns.run(&["cat", &format!("/sys/class/net/{dev}/address")])?;
    let mut m = [0u8; 6];
    for (i, b) in s.trim().split(':').enumerate().take(6) {
        m[i] = u8::from_str_radix(b, 16)?;
    }
    Ok(m)
}

/// 60-byte Ethernet/IPv4 frame, 10.78.0.10 -> 10.78.0.1, IP protocol 253
/// (experimental): valid all the way (bridge netfilter checks it), and the
/// receiving host drops it at local delivery, counting InUnknownProtos.
fn frame(dst: [u8; 6], src: [u8; 6], vnet_hdr: bool) -> Vec<u8> {
    let mut f = Vec::with_capacity(72);
    if vnet_hdr {
        f.extend_from_slice(&[0u8; 12]);
    }
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00]);
    // IPv4, 46 bytes: 20 header + 26 payload.
    let mut ip = [
        0x45u8, 0, 0, 46, 0, 0, 0x40, 0, 64, 253, 0, 0, 10, 78, 0, 10, 10, 78, 0, 1,
    ];
    let sum: u32 = ip.chunks(2).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&[0x30, 0x39, 0x30, 0x39, 0, 26, 0, 0]);
    f.extend_from_slice(&[0u8; 18]);
    f
}

fn packet_socket(ns: &Netns, dev: &str) -> Result<OwnedFd> {
    let dev = dev.to_string();
    Ok(in_netns(Some(&ns.path()), move || {
        let err = |e: std::io::Error| k7d_net::NetError::Invalid {
            what: "AF_PACKET socket".into(),
            reason: e.to_string(),
        };
        let cname = std::ffi::CString::new(dev.clone()).unwrap();
        // SAFETY: `cname` is a valid NUL-terminated string.
        let ifindex = unsafe { libc::if_nametoindex(cname.as_ptr()) };
        if ifindex == 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        // SAFETY: plain socket(2) call; protocol 0 means the socket receives nothing.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        // SAFETY: `fd` is a fresh socket that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero sockaddr_ll is a valid value of this C struct.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: `sll` is a live sockaddr_ll and the length passed is its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if rc < 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        Ok(fd)
    })?)
}

/// IPv4 packets the netns delivered locally and dropped for an unknown
/// protocol (Ip InUnknownProtos): where the VM -> pod frames end.
fn unknown_protos(ns: &Netns) -> Result<u64> {
    let s = ns.run(&["cat", "/proc/net/snmp"])?;
    let mut lines = s.lines().filter(|l| l.starts_with("Ip:"));
    let (names, values) = (lines.next().context("no Ip")?, lines.next().context("no Ip values")?);
    let i = names
        .split_whitespace()
        .position(|n| n == "InUnknownProtos")
        .context("no InUnknownProtos")?;
    Ok(values.split_whitespace().nth(i).context("short Ip line")?.parse()?)
}

/// Frames `dev` dropped because they were addressed to another host
/// (`rx_otherhost_dropped`, counted in ip_rcv): where the VM -> pod frames,
/// sent to a foreign MAC, end.
fn otherhost(ns: &Netns, dev: &str) -> Result<u64> {
    let s = ns.run(&["ip", "-s", "-s", "-j", "link", "show", "dev", dev])?;
    // iproute2 prints the counter only once it is non-zero.
    let Some(i) = s.find("\"otherhost\":") else {
        return Ok(0);
    };
    let n: String = s[i + 12..].chars().take_while(char::is_ascii_digit).collect();
    Ok(n.parse()?)
}

/// Frames the tap's qdisc took: sent on to tun + dropped + still queued.
/// (With nobody reading, tun's ring fills and then the qdisc backs up and
/// drops; either way the frame made the whole trip to the tap.)
fn tap_qdisc_in(ns: &Netns, dev: &str) -> Result<u64> {
    let s = ns.run(&["tc", "-s", "qdisc", "show", "dev", dev])?;
    let w: Vec<&str> = s.split_whitespace().collect();
    let num = |x: &str| x.trim_end_matches([',', ')', 'p']).parse::<u64>().unwrap_or(0);
    let mut total = 0;
    for (i, x) in w.iter().enumerate() {
        match *x {
            "pkt" if i > 0 => total += num(w[i - 1]),
            "(dropped" if i + 1 < w.len() => total += num(w[i + 1]),
            "backlog" if i + 2 < w.len() => total += num(w[i + 2]),
            _ => {}
        }
    }
    Ok(total)
}

impl Lab {
    fn new(variant: Variant) -> Result<Self> {
        let t = variant.tag();
        let node = Netns::new(&format!("{t}n"))?;
        let pod = Netns::new(&format!("{t}p"))?;
        let guest = matches!(variant, Variant::Direct | Variant::Bridge)
            .then(|| Netns::new(&format!("{t}g")))
            .transpose()?;
        pod.run(&[
            "ip", "link", "add", "eth0", "type", "veth", "peer", "name", "lx", "netns", &node.0,
        ])?;
        pod.run(&["ip", "link", "set", "eth0", "up"])?;
        node.run(&["ip", "link", "set", "lx", "up"])?;
        node.run(&["ip", "addr", "add", &format!("{NODE_IP}/24"), "dev", "lx"])?;
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/k7b{}{t}", std::process::id()));
        let mut lab_dp = None;
        let mut att = None;
        let mut own_tap = None;
        let tap_name = "k7dbench0".to_string();
        let tap_fd;
        let guest_mac;
        match variant {
            Variant::Direct | Variant::Bridge => {
                let dp = Datapath::new(DatapathConfig {
                    bpffs_root: bpffs.clone(),
                    object: if variant == Variant::Direct {
                        ObjectSource::Embedded
                    } else {
                        ObjectSource::Missing
                    },
                    attach_method: AttachMethod::Auto,
                })?;
                let pod_path = pod.path();
                let a = dp.attach(&NicRequest {
                    vm_id: "bench",
                    nic_idx: 0,
                    mode: if variant == Variant::Direct {
                        Mode::Direct
                    } else {
                        Mode::Bridge
                    },
                    pod_netns: &pod_path,
                    pod_if: "eth0",
                    queues: 1,
                    vnet_hdr: true,
                    pod_uid: None,
                    unsupported: None,
                    adopt: false,
                })?;
                tap_fd = a.tap.queues[0].try_clone()?;
                guest_mac = a.guest_mac;
                lab_dp = Some(dp);
                att = Some(a);
            }
            Variant::Floor | Variant::Mirred => {
                let name = tap_name.clone();
                let tap = in_netns(Some(&pod.path()), move || {
                    let mut nl = k7d_net::netlink::Netlink::open()?;
                    k7d_net::create_tap(&mut nl, &name, 1, true)
                })?;
                tap_fd = tap.queues[0].try_clone()?;
                guest_mac = [0x02, 0x6b, 0, 0, 0, 0x10];
                own_tap = Some(tap);
            }
        }
        let tap_name = att.as_ref().map(|a| a.tap.name.clone()).unwrap_or(tap_name);
        if variant == Variant::Mirred {
            {
                for (from, to) in [(tap_name.as_str(), "eth0"), ("eth0", tap_name.as_str())] {
                    pod.run(&["tc", "qdisc", "add", "dev", from, "ingress"])?;
                    pod.run(&[
                        "tc", "filter", "add", "dev", from, "parent", "ffff:", "protocol", "all", "u32", "match",
                        "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", to,
                    ])?;
                }
            }
        }
        let lx_mac = mac_of(&node, "lx")?;
        let pkt = packet_socket(&node, "lx")?;
        // The floor's frames end in the tap's own stack, the others at lx.
        let tx_dst = if variant == Variant::Floor {
            pod.run(&["ip", "addr", "add", &format!("{NODE_IP}/24"), "dev", &tap_name])?;
            mac_of(&pod, &tap_name)?
        } else {
            lx_mac
        };
        Ok(Lab {
            variant,
            tx_frame: frame(tx_dst, guest_mac, true),
            rx_frame: frame(guest_mac, lx_mac, false),
            node,
            pod,
            guest,
            dp: lab_dp,
            tap_fd,
            tap_name,
            _own_tap: own_tap,
            att,
            pkt,
            bpffs,
        })
    }

    /// Writes `n` frames into the tap; returns the elapsed time.
    fn to_pod(&self, n: usize) -> Result<Duration> {
        let count = |s: &Lab| {
            if s.variant == Variant::Floor {
                unknown_protos(&s.pod)
            } else {
                unknown_protos(&s.node)
            }
        };
        let before = count(self)?;
        let t0 = Instant::now();
        for _ in 0..n {
            k7d_net::write_frame(&self.tap_fd, &self.tx_frame)?;
        }
        let dt = t0.elapsed();
        let got = count(self)? - before;
        // Stray control traffic (an ICMP error, ARP) may add a few.
        if got < n as u64 || got > (n + n / 100 + 16) as u64 {
            bail!("{:?}: {got} of {n} frames reached their end", self.variant);
        }
        Ok(dt)
    }

    /// Sends `n` frames from the node side towards the tap.
    fn to_vm(&self, n: usize) -> Result<Duration> {
        let count = |s: &Lab| {
            if s.variant == Variant::Floor {
                otherhost(&s.pod, "eth0")
            } else {
                tap_qdisc_in(&s.pod, &s.tap_name)
            }
        };
        let before = count(self)?;
        let t0 = Instant::now();
        for _ in 0..n {
            // SAFETY: the frame buffer is live and readable for its length.
            let rc = unsafe {
                libc::send(
                    self.pkt.as_raw_fd(),
                    self.rx_frame.as_ptr().cast(),
                    self.rx_frame.len(),
                    0,
                )
            };
            if rc < 0 {
                bail!("AF_PACKET send failed: {}", std::io::Error::last_os_error());
            }
        }
        let dt = t0.elapsed();
        let got = count(self)? - before;
        if got < n as u64 || got > (n + n / 100 + 16) as u64 {
            bail!("{:?}: {got} of {n} frames reached the tap", self.variant);
        }
        Ok(dt)
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if let (Some(dp), Some(_)) = (&self.dp, &self.att) {
            let _ = dp.detach("bench", 0, Some(&self.pod.path()), "eth0");
        }
        let _ = std::fs::remove_dir_all(&self.bpffs);
    }
}

/// Relays frames between k7d's tap and a guest tap in G (what a VMM does).
struct Relay {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    _gtap: k7d_net::Tap,
}

impl Relay {
    fn start(lab: &Lab) -> Result<Self> {
        let g = lab.guest.as_ref().context("no guest netns")?;
        let mac = lab.att.as_ref().context("no attach")?.guest_mac;
        let gtap = in_netns(Some(&g.path()), move || {
            let mut nl = k7d_net::netlink::Netlink::open()?;
            let t = k7d_net::create_tap(&mut nl, "gtap", 1, true)?;
            nl.set_mac(t.ifindex, mac)?;
            Ok(t)
        })?;
        g.run(&["ip", "addr", "add", &format!("{GUEST_IP}/24"), "dev", "gtap"])?;
        let stop = Arc::new(AtomicBool::new(false));
        let a = lab.tap_fd.try_clone()?;
        let b = gtap.queues[0].try_clone()?;
        let threads = vec![
            relay(a.try_clone()?, b.try_clone()?, stop.clone()),
            relay(b, a, stop.clone()),
        ];
        Ok(Relay {
            stop,
            threads,
            _gtap: gtap,
        })
    }
}

fn relay(from: OwnedFd, to: OwnedFd, stop: Arc<AtomicBool>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536 + 12];
        while !stop.load(Ordering::Relaxed) {
            match k7d_net::wait_readable(&from, 50) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(_) => return,
            }
            while let Ok(Some(n)) = k7d_net::read_frame(&from, &mut buf) {
                let _ = k7d_net::write_frame(&to, &buf[..n]);
            }
        }
    })
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// RTTs in µs of `n` pings from G to the node.
fn ping(lab: &Lab, n: usize) -> Result<Vec<f64>> {
    let g = lab.guest.as_ref().context("no guest netns")?;
    let out = g.run(&["ping", "-c", &n.to_string(), "-i", "0.005", "-W", "1", NODE_IP])?;
    let v: Vec<f64> = out
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("time="))
        .filter_map(|t| t.parse::<f64>().ok())
        .map(|ms| ms * 1000.0)
        .collect();
    if v.len() < n * 9 / 10 {
        bail!("{:?}: only {} of {n} pings answered", lab.variant, v.len());
    }
    Ok(v)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn pin_to_last_cpu() {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let n = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    // SAFETY: CPU_SET writes one bit inside the live `set`.
    unsafe { libc::CPU_SET(n - 1, &mut set) };
    // SAFETY: `set` is a live cpu_set_t and the size passed is its size.
    let _ = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}

fn main() -> Result<()> {
    if !k7d_benches::is_root() {
        println!("datapath bench: skipped (needs root for netns, taps and bpf)");
        return Ok(());
    }
    let rounds = env_num("K7D_BENCH_ROUNDS", 5).max(1);
    let frames = env_num("K7D_BENCH_FRAMES", 200_000).max(1000);
    let pings = env_num("K7D_BENCH_PINGS", 100).max(10);
    let t_start = Instant::now();
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    pin_to_last_cpu();
    let labs: Vec<Lab> = Variant::ALL.iter().map(|v| Lab::new(*v)).collect::<Result<_>>()?;
    // Warm-up.
    for lab in &labs {
        lab.to_pod(frames / 10)?;
        lab.to_vm(frames / 10)?;
    }
    let mut tx: Vec<Vec<f64>> = vec![Vec::new(); labs.len()];
    let mut rx: Vec<Vec<f64>> = vec![Vec::new(); labs.len()];
    for r in 0..rounds {
        // Rotate the order so drift hits every variant alike.
        for k in 0..labs.len() {
            let i = (k + r) % labs.len();
            tx[i].push(labs[i].to_pod(frames)?.as_nanos() as f64 / frames as f64);
            rx[i].push(labs[i].to_vm(frames)?.as_nanos() as f64 / frames as f64);
        }
    }
    let kernel = sh(&["uname", "-r"])?.trim().to_string();
    println!(
        "k7d datapath bench: kernel {kernel}, {cpus} CPUs, 60-byte frames, one syscall per frame, one pinned thread,"
    );
    println!("{rounds} interleaved rounds x {frames} frames per variant and direction; medians (min-max ns/frame)");
    for (title, data, to_vm) in [
        ("VM -> pod (tap write -> node veth -> local delivery)", &mut tx, false),
        (
            "pod -> VM (AF_PACKET on node veth -> tap ring, reader excluded)",
            &mut rx,
            true,
        ),
    ] {
        println!();
        println!("{title}");
        println!(
            "  {:<44} {:>9} {:>15} {:>7} {:>10} {:>11}",
            "variant", "ns/frame", "(min-max)", "Mpps", "vs floor", "vs bridge"
        );
        let med: Vec<f64> = data.iter_mut().map(|v| median(v)).collect();
        let floor = med[0];
        let bridge = med[3];
        for (i, v) in Variant::ALL.iter().enumerate() {
            let d = &data[i];
            let (lo, hi) = (
                d.iter().cloned().fold(f64::MAX, f64::min),
                d.iter().cloned().fold(0.0, f64::max),
            );
            println!(
                "  {:<44} {:>9.0} {:>15} {:>7.3} {:>9.2}x {:>10.2}x",
                v.label(to_vm),
                med[i],
                format!("({lo:.0}-{hi:.0})"),
                1000.0 / med[i],
                floor / med[i],
                bridge / med[i],
            );
        }
        println!("  (vs floor / vs bridge: frames/s ratio; > 1 is faster)");
    }
    // Ping RTT, direct vs bridge, interleaved.
    let direct = &labs[1];
    let bridge = &labs[3];
    let _r1 = Relay::start(direct)?;
    let _r2 = Relay::start(bridge)?;
    let mut rtt: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    let _ = ping(direct, 10);
    let _ = ping(bridge, 10);
    for r in 0..rounds {
        let order = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let lab = if i == 0 { direct } else { bridge };
            rtt[i].extend(ping(lab, pings)?);
        }
    }
    println!();
    println!("ping RTT guest -> node through a relayed tap (µs), {rounds} interleaved rounds x {pings} pings, pooled");
    println!("  {:<44} {:>8} {:>8}", "variant", "p50", "p99");
    for (i, name) in ["k7d direct", "Linux bridge chain"].iter().enumerate() {
        let v = &mut rtt[i];
        println!("  {:<44} {:>8.1} {:>8.1}", name, pct(v, 0.5), pct(v, 0.99));
    }
    println!();
    println!("total run time {:.1} s", t_start.elapsed().as_secs_f64());
    Ok(())
}
