//! The pod's network inside the VM (`network`): the CNI gave the pod an
//! address on its interface on the host; k7d's datapath connects the VM's
//! NIC there, and the agent puts the same address, gateway and MTU on the
//! guest's NIC, so the containers (which share the VM's network namespace)
//! see the pod's network as runc's would.
//!
//! Plain ioctls (`SIOCSIFHWADDR`, `SIOCSIFADDR`, `SIOCSIFNETMASK`,
//! `SIOCSIFMTU`, `SIOCSIFFLAGS`, `SIOCADDRT`): one IPv4 address and a default route need
//! no netlink library in PID 1.

use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use k7d_agent::proto::Network;

/// What `network` set up, checked: the interface and the parsed values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The guest interface (`eth0`).
    pub interface: String,
    /// The address.
    pub address: Ipv4Addr,
    /// Its prefix length.
    pub prefix: u8,
    /// The default gateway.
    pub gateway: Option<Ipv4Addr>,
    /// The MTU.
    pub mtu: Option<u32>,
    /// The MAC the interface takes first.
    pub set_mac: Option<[u8; 6]>,
}

/// Parses a unicast `aa:bb:cc:dd:ee:ff` (not all zero).
fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let bad = || format!("the MAC {s:?} is not a unicast aa:bb:cc:dd:ee:ff");
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for m in &mut mac {
        let p = parts.next().filter(|p| p.len() == 2).ok_or_else(bad)?;
        *m = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if parts.next().is_some() || mac[0] & 1 == 1 || mac == [0; 6] {
        return Err(bad());
    }
    Ok(mac)
}

/// Parses `a.b.c.d/len`.
fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), String> {
    let (a, p) = s
        .split_once('/')
        .ok_or_else(|| format!("the address {s:?} has no prefix length (a.b.c.d/len)"))?;
    let addr: Ipv4Addr = a
        .parse()
        .map_err(|_| format!("{a:?} is not an IPv4 address (IPv6 pods are not supported yet)"))?;
    let prefix: u8 = p
        .parse()
        .ok()
        .filter(|p| (1..=32).contains(p))
        .ok_or_else(|| format!("the prefix length {p:?} is not 1..=32"))?;
    Ok((addr, prefix))
}

/// The netmask of a prefix length.
fn mask(prefix: u8) -> Ipv4Addr {
    Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0))
}

/// Whether `gw` is on the subnet `addr/prefix`.
fn on_link(addr: Ipv4Addr, prefix: u8, gw: Ipv4Addr) -> bool {
    let m = u32::from(mask(prefix));
    u32::from(addr) & m == u32::from(gw) & m
}

/// Checks `n` (hostile: it came over the wire) and picks the interface
/// under `class_net` (`/sys/class/net`): the one with `n.mac`, else the
/// only Ethernet interface.
pub fn plan(n: &Network, class_net: &Path) -> Result<Plan, String> {
    let (address, prefix) = parse_cidr(&n.address)?;
    let gateway = n
        .gateway
        .as_deref()
        .map(|g| {
            g.parse::<Ipv4Addr>()
                .map_err(|_| format!("the gateway {g:?} is not an IPv4 address"))
        })
        .transpose()?;
    if let Some(m) = n.mtu
        && !(68..=65535).contains(&m)
    {
        return Err(format!("the MTU {m} is not 68..=65535"));
    }
    let set_mac = n.set_mac.as_deref().map(parse_mac).transpose()?;
    let want_mac = n.mac.as_deref().map(str::to_ascii_lowercase);
    let mut found = Vec::new();
    let entries = std::fs::read_dir(class_net).map_err(|e| format!("cannot list {}: {e}", class_net.display()))?;
    for e in entries.flatten() {
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let read = |f: &str| std::fs::read_to_string(e.path().join(f)).map(|t| t.trim().to_string());
        // ARPHRD_ETHER; `lo` is 772.
        if read("type").ok().as_deref() != Some("1") {
            continue;
        }
        let mac = read("address").unwrap_or_default();
        if want_mac.as_ref().is_none_or(|w| *w == mac) {
            found.push(name);
        }
    }
    found.sort();
    let interface = match (found.len(), &want_mac) {
        (1, _) => found.remove(0),
        (0, Some(m)) => return Err(format!("the VM has no network interface with MAC {m}")),
        (0, None) => return Err("the VM has no network interface".into()),
        (_, _) => {
            return Err(format!(
                "the VM has {} network interfaces; name one by its MAC",
                found.len()
            ));
        }
    };
    Ok(Plan {
        interface,
        address,
        prefix,
        gateway,
        mtu: n.mtu,
        set_mac,
    })
}

fn sockaddr(a: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(a).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: `sockaddr_in` and `sockaddr` have the same size (16 bytes) and
    // `sockaddr` is plain data: any bytes are a valid value.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn ifreq(name: &str) -> std::io::Result<libc::ifreq> {
    // SAFETY: `ifreq` is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "an interface name is too long",
        ));
    }
    for (dst, &src) in req.ifr_name.iter_mut().zip(name.as_bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn ioctl<T>(sock: &OwnedFd, op: libc::Ioctl, arg: &mut T, what: &str) -> Result<(), String> {
    // SAFETY: each caller passes the structure `op` reads (and may write):
    // an `ifreq` for SIOC*IF*, an `rtentry` for SIOCADDRT.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), op, arg as *mut T) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        // A route that exists already is what was asked for.
        if op == libc::SIOCADDRT && e.raw_os_error() == Some(libc::EEXIST) {
            return Ok(());
        }
        return Err(format!("{what} failed: {e}"));
    }
    Ok(())
}

/// Applies `p`: address and netmask, MTU, link up, and the default route
/// (with an on-link route to a gateway outside the subnet, as CNIs that
/// hand out a link-local gateway need).
pub fn apply(p: &Plan) -> Result<(), String> {
    // SAFETY: `socket` takes plain integers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(format!("cannot open a socket: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by `socket` and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = &p.interface;
    let req = |what: &str| ifreq(name).map_err(|e| format!("{what} on {name}: {e}"));
    if let Some(mac) = p.set_mac {
        let mut r = req("setting the MAC")?;
        // SAFETY: `sockaddr` is plain data; all zeroes is a valid value.
        let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
        sa.sa_family = libc::ARPHRD_ETHER;
        for (d, &b) in sa.sa_data.iter_mut().zip(&mac) {
            *d = b as libc::c_char;
        }
        r.ifr_ifru.ifru_hwaddr = sa;
        ioctl(
            &sock,
            libc::SIOCSIFHWADDR,
            &mut r,
            &format!("setting the MAC of {name}"),
        )?;
    }
    let mut r = req("setting the address")?;
    r.ifr_ifru.ifru_addr = sockaddr(p.address);
    ioctl(
        &sock,
        libc::SIOCSIFADDR,
        &mut r,
        &format!("setting {} on {name}", p.address),
    )?;
    let mut r = req("setting the netmask")?;
    r.ifr_ifru.ifru_netmask = sockaddr(mask(p.prefix));
    ioctl(
        &sock,
        libc::SIOCSIFNETMASK,
        &mut r,
        &format!("setting the /{} netmask on {name}", p.prefix),
    )?;
    if let Some(mtu) = p.mtu {
        let mut r = req("setting the MTU")?;
        r.ifr_ifru.ifru_mtu = mtu as libc::c_int;
        ioctl(&sock, libc::SIOCSIFMTU, &mut r, &format!("setting MTU {mtu} on {name}"))?;
    }
    let mut r = req("reading the flags")?;
    ioctl(
        &sock,
        libc::SIOCGIFFLAGS,
        &mut r,
        &format!("reading the flags of {name}"),
    )?;
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    let flags = unsafe { r.ifr_ifru.ifru_flags };
    r.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    ioctl(&sock, libc::SIOCSIFFLAGS, &mut r, &format!("bringing {name} up"))?;
    if let Some(gw) = p.gateway {
        // The kernel copies IFNAMSIZ - 1 bytes from `rt_dev`: a buffer of
        // IFNAMSIZ, NUL-padded (the name's length was checked by `ifreq`).
        let mut dev = [0 as libc::c_char; libc::IFNAMSIZ];
        for (d, &b) in dev.iter_mut().zip(name.as_bytes()) {
            *d = b as libc::c_char;
        }
        // SAFETY: `rtentry` is plain old data; all zeroes is a valid value.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        if !on_link(p.address, p.prefix, gw) {
            rt.rt_dst = sockaddr(gw);
            rt.rt_genmask = sockaddr(Ipv4Addr::BROADCAST);
            rt.rt_flags = libc::RTF_UP | libc::RTF_HOST;
            rt.rt_dev = dev.as_mut_ptr();
            ioctl(
                &sock,
                libc::SIOCADDRT,
                &mut rt,
                &format!("adding the on-link route to {gw}"),
            )?;
        }
        // SAFETY: as above.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr(gw);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        rt.rt_dev = dev.as_mut_ptr();
        ioctl(
            &sock,
            libc::SIOCADDRT,
            &mut rt,
            &format!("adding the default route via {gw}"),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class_net(tag: &str, ifaces: &[(&str, &str, &str)]) -> std::path::PathBuf {
        let root = std::env::temp_dir().join(format!("k7d-agent-net-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for (name, typ, mac) in ifaces {
            let d = root.join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("type"), format!("{typ}\n")).unwrap();
            std::fs::write(d.join("address"), format!("{mac}\n")).unwrap();
        }
        root
    }

    fn net(address: &str, gateway: Option<&str>, mac: Option<&str>) -> Network {
        Network {
            mac: mac.map(str::to_string),
            address: address.into(),
            gateway: gateway.map(str::to_string),
            mtu: None,
            set_mac: None,
        }
    }

    #[test]
    fn the_only_ethernet_interface_gets_the_pods_address() {
        let root = class_net(
            "one",
            &[("lo", "772", "00:00:00:00:00:00"), ("eth0", "1", "02:aa:bb:cc:dd:ee")],
        );
        let p = plan(&net("10.88.0.5/16", Some("10.88.0.1"), None), &root).unwrap();
        assert_eq!(p.interface, "eth0");
        assert_eq!((p.address, p.prefix), (Ipv4Addr::new(10, 88, 0, 5), 16));
        assert_eq!(p.gateway, Some(Ipv4Addr::new(10, 88, 0, 1)));
        assert_eq!(mask(16), Ipv4Addr::new(255, 255, 0, 0));
        assert_eq!(mask(32), Ipv4Addr::BROADCAST);
        assert!(on_link(p.address, p.prefix, Ipv4Addr::new(10, 88, 255, 1)));
        assert!(!on_link(p.address, p.prefix, Ipv4Addr::new(169, 254, 1, 1)));
        let by_mac = plan(&net("10.88.0.5/16", None, Some("02:AA:BB:CC:DD:EE")), &root).unwrap();
        assert_eq!(by_mac.interface, "eth0");
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// `apply` on a real interface: a veth `eth0` in a network namespace
    /// of its own (the test thread enters it; needs root and `ip`).
    #[test]
    fn apply_sets_the_address_mtu_and_routes_on_a_real_interface() {
        let _children = crate::test_children();
        let ns = format!("k7d-agent-net-{}", std::process::id());
        let ip = |args: &[&str]| {
            let out = std::process::Command::new("ip").args(args).output().unwrap();
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        ip(&["netns", "add", &ns]);
        let r = std::panic::catch_unwind(|| {
            ip(&[
                "-n", &ns, "link", "add", "eth0", "type", "veth", "peer", "name", "peer0",
            ]);
            let nsf = std::fs::File::open(format!("/run/netns/{ns}")).unwrap();
            let plan = Plan {
                interface: "eth0".into(),
                address: Ipv4Addr::new(10, 88, 0, 5),
                prefix: 16,
                gateway: Some(Ipv4Addr::new(169, 254, 1, 1)),
                mtu: Some(1400),
                set_mac: Some([0x02, 0x6b, 0x37, 0x64, 0x00, 0x05]),
            };
            std::thread::spawn(move || {
                // SAFETY: setns on this thread only, with a namespace fd.
                assert_eq!(unsafe { libc::setns(nsf.as_raw_fd(), libc::CLONE_NEWNET) }, 0);
                apply(&plan)
            })
            .join()
            .unwrap()
            .unwrap();
            let addr = ip(&["-n", &ns, "-4", "-o", "addr", "show", "dev", "eth0"]);
            assert!(addr.contains("inet 10.88.0.5/16"), "{addr}");
            let link = ip(&["-n", &ns, "-o", "link", "show", "dev", "eth0"]);
            assert!(link.contains("mtu 1400") && link.contains(",UP"), "{link}");
            assert!(link.contains("link/ether 02:6b:37:64:00:05"), "{link}");
            let routes = ip(&["-n", &ns, "-4", "route"]);
            assert!(routes.contains("default via 169.254.1.1 dev eth0"), "{routes}");
            assert!(
                routes.contains("169.254.1.1 dev eth0"),
                "the gateway is on-link: {routes}"
            );
        });
        ip(&["netns", "delete", &ns]);
        if let Err(p) = r {
            std::panic::resume_unwind(p);
        }
    }

    #[test]
    fn bad_settings_are_refused_with_a_sentence() {
        let root = class_net(
            "bad",
            &[("eth0", "1", "02:00:00:00:00:01"), ("eth1", "1", "02:00:00:00:00:02")],
        );
        let e = |n: Network| plan(&n, &root).unwrap_err();
        assert_eq!(
            e(net("10.88.0.5", None, None)),
            "the address \"10.88.0.5\" has no prefix length (a.b.c.d/len)"
        );
        assert_eq!(
            e(net("10.88.0.5/33", None, None)),
            "the prefix length \"33\" is not 1..=32"
        );
        assert_eq!(
            e(net("fd00::5/64", None, None)),
            "\"fd00::5\" is not an IPv4 address (IPv6 pods are not supported yet)"
        );
        assert_eq!(
            e(net("10.88.0.5/16", Some("gw"), None)),
            "the gateway \"gw\" is not an IPv4 address"
        );
        for mac in [
            "01:00:5e:00:00:01",
            "00:00:00:00:00:00",
            "02:00:00:00:00",
            "02:00:00:00:00:01:02",
            "zz:00:00:00:00:01",
        ] {
            let mut n = net("10.88.0.5/16", None, None);
            n.set_mac = Some(mac.into());
            assert_eq!(e(n), format!("the MAC {mac:?} is not a unicast aa:bb:cc:dd:ee:ff"));
        }
        assert_eq!(
            e(net("10.88.0.5/16", None, None)),
            "the VM has 2 network interfaces; name one by its MAC"
        );
        assert_eq!(
            e(net("10.88.0.5/16", None, Some("02:00:00:00:00:09"))),
            "the VM has no network interface with MAC 02:00:00:00:00:09"
        );
        let mut n = net("10.88.0.5/16", None, Some("02:00:00:00:00:02"));
        assert_eq!(plan(&n, &root).unwrap().interface, "eth1");
        n.mtu = Some(10);
        assert_eq!(e(n), "the MTU 10 is not 68..=65535");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
