//! Test lab: network namespaces (always deleted), a "node" netns with a
//! bridge joining the pod's CNI veth and peer hosts B and C, and a guest
//! stand-in: a second tap in netns G whose frames the test process relays to
//! and from k7d's tap fd (what a VMM's virtio-net does), so G's kernel plays
//! the guest's network stack for ping and TCP.
#![allow(dead_code)]

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    os::fd::OwnedFd,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use k7d_net::{
    AttachMethod, Attached, Datapath, DatapathConfig, Mode, NicRequest, ObjectSource, in_netns, netlink::Netlink,
};

static SEQ: AtomicU32 = AtomicU32::new(0);

pub fn uniq(tag: &str) -> String {
    format!(
        "k7t{}x{}{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst),
        tag
    )
}

pub fn run(args: &[&str]) -> std::process::Output {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

pub fn must(args: &[&str]) {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A named network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Self {
        let name = uniq(tag);
        must(&["ip", "netns", "add", &name]);
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"]);
        // No IPv6 chatter (MLD/RS), so drop counters are exact.
        ns.exec(&["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]);
        ns.exec(&["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"]);
        ns
    }
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/run/netns/{}", self.name))
    }
    pub fn ip(&self, args: &[&str]) {
        let mut a = vec!["ip", "-n", &self.name];
        a.extend_from_slice(args);
        must(&a);
    }
    pub fn exec(&self, args: &[&str]) -> std::process::Output {
        let mut a = vec!["ip", "netns", "exec", &self.name];
        a.extend_from_slice(args);
        run(&a)
    }
    /// True when 2 pings to `dst` get replies.
    pub fn ping(&self, dst: &str) -> bool {
        self.exec(&["ping", "-c", "2", "-i", "0.2", "-W", "1", "-q", dst])
            .status
            .success()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = run(&["ip", "netns", "del", &self.name]);
    }
}

pub const GUEST_IP: &str = "10.77.0.10";
pub const B_IP: &str = "10.77.0.2";
pub const C_IP: &str = "10.77.0.3";

/// Node N (bridge `br0`), pod P (`eth0` ↔ `lx` in N), peers B and C.
pub struct Lab {
    pub node: Netns,
    pub pod: Netns,
    pub b: Netns,
    pub c: Netns,
    pub guest: Netns,
    pub bpffs: PathBuf,
}

impl Lab {
    pub fn new() -> Self {
        let node = Netns::new("n");
        let pod = Netns::new("p");
        let b = Netns::new("b");
        let c = Netns::new("c");
        let guest = Netns::new("g");
        node.ip(&["link", "add", "br0", "type", "bridge"]);
        node.ip(&["link", "set", "br0", "up"]);
        pod.ip(&[
            "link", "add", "eth0", "type", "veth", "peer", "name", "lx", "netns", &node.name,
        ]);
        for (ns, port, ip) in [(&b, "vb", B_IP), (&c, "vc", C_IP)] {
            ns.ip(&[
                "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", &node.name,
            ]);
            ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
            ns.ip(&["link", "set", "eth0", "up"]);
            node.ip(&["link", "set", port, "master", "br0", "up"]);
        }
        node.ip(&["link", "set", "lx", "master", "br0", "up"]);
        pod.ip(&["link", "set", "eth0", "up"]);
        let bpffs = PathBuf::from(format!("/sys/fs/bpf/{}", uniq("bpf")));
        Lab {
            node,
            pod,
            b,
            c,
            guest,
            bpffs,
        }
    }

    pub fn datapath(&self, object: ObjectSource, method: AttachMethod) -> Datapath {
        Datapath::new(DatapathConfig {
            bpffs_root: self.bpffs.clone(),
            object,
            attach_method: method,
        })
        .expect("datapath")
    }

    pub fn request<'a>(&'a self, vm: &'a str, mode: Mode, uid: Option<&'a str>) -> NicRequest<'a> {
        NicRequest {
            vm_id: vm,
            nic_idx: 0,
            mode,
            pod_netns: leak_path(self.pod.path()),
            pod_if: "eth0",
            queues: 1,
            vnet_hdr: true,
            pod_uid: uid,
            unsupported: None,
            adopt: false,
        }
    }

    /// Asserts no k7d link, clsact qdisc, k7d filter, TCX program or pin is
    /// left in the lab's namespaces or bpffs root.
    pub fn assert_clean(&self, dp: &Datapath) {
        let inv = dp.inventory(&[&self.pod.path(), &self.node.path()]).expect("inventory");
        assert!(inv.is_empty(), "leftovers: {inv:?}");
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.bpffs);
        let _ = std::fs::remove_dir(&self.bpffs);
    }
}

pub fn leak_path(p: PathBuf) -> &'static Path {
    Box::leak(p.into_boxed_path())
}

/// The guest stand-in: tap `gtap` in netns G with the guest MAC and IP, and
/// two relay threads between its fd and k7d's tap fd.
pub struct Guest {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    _gtap: k7d_net::Tap,
    /// Frames relayed from k7d's tap to the guest.
    pub rx: Arc<AtomicU64>,
}

impl Guest {
    pub fn start(lab: &Lab, att: &Attached) -> Self {
        Self::start_on(&lab.guest, &att.tap, att.guest_mac, &format!("{GUEST_IP}/24"))
    }

    /// A guest in netns `ns` with `mac` and `cidr` on `gtap`, relayed to and
    /// from k7d's `tap`.
    pub fn start_on(ns: &Netns, tap: &k7d_net::Tap, mac: [u8; 6], cidr: &str) -> Self {
        let gtap = in_netns(Some(&ns.path()), || {
            let mut nl = Netlink::open()?;
            let t = k7d_net::create_tap(&mut nl, "gtap", 1, true)?;
            nl.set_mac(t.ifindex, mac)?;
            Ok(t)
        })
        .expect("guest tap");
        ns.ip(&["addr", "add", cidr, "dev", "gtap"]);
        let stop = Arc::new(AtomicBool::new(false));
        let rx = Arc::new(AtomicU64::new(0));
        let a = tap.queues[0].try_clone().unwrap();
        let g = gtap.queues[0].try_clone().unwrap();
        let threads = vec![
            relay(
                a.try_clone().unwrap(),
                g.try_clone().unwrap(),
                stop.clone(),
                Some(rx.clone()),
            ),
            relay(g, a, stop.clone(), None),
        ];
        Guest {
            stop,
            threads,
            _gtap: gtap,
            rx,
        }
    }
}

fn relay(from: OwnedFd, to: OwnedFd, stop: Arc<AtomicBool>, count: Option<Arc<AtomicU64>>) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536 + 12];
        while !stop.load(Ordering::Relaxed) {
            match k7d_net::wait_readable(&from, 50) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(_) => return,
            }
            loop {
                match k7d_net::read_frame(&from, &mut buf) {
                    Ok(Some(n)) => {
                        if let Some(c) = &count {
                            c.fetch_add(1, Ordering::Relaxed);
                        }
                        // Full queues drop, like a NIC would.
                        let _ = k7d_net::write_frame(&to, &buf[..n]);
                    }
                    Ok(None) => break,
                    Err(_) => return,
                }
            }
        }
    })
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Sends `len` bytes over TCP from a client in `client_ns` to a server in
/// `server_ns` at `server_ip`, which echoes a checksum back; asserts it.
pub fn tcp_roundtrip(server_ns: &Netns, server_ip: &str, client_ns: &Netns, len: usize) {
    let port = 5000 + (SEQ.fetch_add(1, Ordering::SeqCst) % 1000) as u16;
    let addr = format!("{server_ip}:{port}");
    let listener = in_netns(Some(&server_ns.path()), || {
        TcpListener::bind(&addr).map_err(|e| k7d_net::NetError::Invalid {
            what: "listener".into(),
            reason: e.to_string(),
        })
    })
    .expect("listen");
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut sum: u64 = 0;
        let mut total = 0usize;
        let mut buf = vec![0u8; 65536];
        loop {
            let n = s.read(&mut buf).expect("server read");
            if n == 0 {
                break;
            }
            total += n;
            sum = buf[..n]
                .iter()
                .fold(sum, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
        }
        s.write_all(format!("{total} {sum}").as_bytes()).unwrap();
    });
    let mut stream = in_netns(Some(&client_ns.path()), || {
        TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(5)).map_err(|e| {
            k7d_net::NetError::Invalid {
                what: format!("connect to {addr}"),
                reason: e.to_string(),
            }
        })
    })
    .expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
    stream.write_all(&data).expect("client write");
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("client read");
    server.join().unwrap();
    let want = data
        .iter()
        .fold(0u64, |a, b| a.wrapping_mul(31).wrapping_add(u64::from(*b)));
    assert_eq!(reply, format!("{len} {want}"), "TCP payload mismatch");
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_test_writer()
        .try_init();
}

pub fn object_missing() -> ObjectSource {
    ObjectSource::File(PathBuf::from("/nonexistent/k7d/k7d_tc.bpf.o"))
}
