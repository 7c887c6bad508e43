//! A small synchronous rtnetlink client (netlink-sys + netlink-packet-route):
//! links, bridges, veths, netns moves, qdiscs and filters. The socket is
//! bound to the network namespace of the thread that opens it.
use std::os::fd::{AsRawFd, RawFd};

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    RouteNetlinkMessage,
    link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use crate::NetError;

/// A link as seen by a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// `IFLA_INFO_KIND` (veth, bridge, tun, ...), if any.
    pub kind: Option<String>,
    pub master: Option<u32>,
    pub mac: Option<[u8; 6]>,
    pub up: bool,
    /// `IFF_PROMISC` is set.
    pub promisc: bool,
    /// Set when the link's peer (veth) lives in another netns.
    pub link_netnsid: Option<i32>,
}

/// A qdisc as seen by a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qdisc {
    pub ifindex: u32,
    pub kind: String,
    pub handle: u32,
    pub parent: u32,
}

/// A tc filter as seen by a dump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub ifindex: u32,
    pub parent: u32,
    pub kind: String,
    /// `info` of the tc header: prio << 16 | protocol.
    pub info: u32,
    pub handle: u32,
    /// The bpf program name of a `bpf` filter.
    pub bpf_name: Option<String>,
}

/// Parent handles of the clsact hooks.
pub const CLSACT_INGRESS: u32 = 0xffff_fff2;
pub const CLSACT_EGRESS: u32 = 0xffff_fff3;
const CLSACT_PARENT: u32 = 0xffff_fff1;

fn h(v: u32) -> TcHandle {
    TcHandle {
        major: (v >> 16) as u16,
        minor: (v & 0xffff) as u16,
    }
}

fn hv(t: TcHandle) -> u32 {
    (u32::from(t.major) << 16) | u32::from(t.minor)
}

/// One netlink route socket.
pub struct Netlink {
    sock: Socket,
    seq: u32,
}

impl Netlink {
    /// Opens a socket in the calling thread's network namespace.
    pub fn open() -> Result<Self, NetError> {
        let err = |e: std::io::Error| NetError::Netlink {
            op: "open a route socket".into(),
            reason: e.to_string(),
        };
        let mut sock = Socket::new(NETLINK_ROUTE).map_err(err)?;
        sock.bind_auto().map_err(err)?;
        sock.connect(&SocketAddr::new(0, 0)).map_err(err)?;
        let _ = sock.set_ext_ack(true);
        Ok(Self { sock, seq: 0 })
    }

    fn request(
        &mut self,
        op: &str,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<RouteNetlinkMessage>, NetError> {
        let err = |reason: String| NetError::Netlink {
            op: op.to_string(),
            reason,
        };
        self.seq = self.seq.wrapping_add(1);
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST | flags;
        hdr.sequence_number = self.seq;
        let mut nl = NetlinkMessage::new(hdr, NetlinkPayload::from(msg));
        nl.finalize();
        let mut buf = vec![0u8; nl.buffer_len()];
        nl.serialize(&mut buf);
        self.sock.send(&buf, 0).map_err(|e| err(e.to_string()))?;
        let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
        let mut out = Vec::new();
        loop {
            let (data, _) = self.sock.recv_from_full().map_err(|e| err(e.to_string()))?;
            let mut off = 0usize;
            while off + 16 <= data.len() {
                let len = u32::from_ne_bytes([data[off], data[off + 1], data[off + 2], data[off + 3]]) as usize;
                if len < 16 || off + len > data.len() {
                    return Err(err(format!("truncated netlink message of {len} bytes")));
                }
                let slice = &data[off..off + len];
                off += (len + 3) & !3;
                let seq = u32::from_ne_bytes([slice[8], slice[9], slice[10], slice[11]]);
                if seq != self.seq {
                    continue;
                }
                let msg = match NetlinkMessage::<RouteNetlinkMessage>::deserialize(slice) {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::debug!(op, error = %e, "undecodable netlink message skipped");
                        continue;
                    }
                };
                match msg.payload {
                    NetlinkPayload::Done(_) => return Ok(out),
                    NetlinkPayload::Error(e) => match e.code {
                        None => {
                            if !dump {
                                return Ok(out);
                            }
                        }
                        Some(_) => {
                            return Err(NetError::Os {
                                op: op.to_string(),
                                source: e.to_io(),
                            });
                        }
                    },
                    NetlinkPayload::InnerMessage(m) => {
                        out.push(m);
                        if !dump && flags & NLM_F_ACK == 0 {
                            return Ok(out);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// All links of the namespace.
    pub fn links(&mut self) -> Result<Vec<Link>, NetError> {
        let msgs = self.request(
            "dump links",
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            NLM_F_DUMP,
        )?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(parse_link(&l)),
                _ => None,
            })
            .collect())
    }

    /// The link called `name`, if it exists.
    pub fn link(&mut self, name: &str) -> Result<Option<Link>, NetError> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        match self.request(&format!("get link {name}"), RouteNetlinkMessage::GetLink(msg), 0) {
            Ok(msgs) => Ok(msgs.into_iter().find_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(parse_link(&l)),
                _ => None,
            })),
            Err(NetError::Os { source, .. }) if source.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Creates bridge `name` (down).
    pub fn add_bridge(&mut self, name: &str) -> Result<(), NetError> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        msg.attributes
            .push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Bridge)]));
        self.request(
            &format!("create bridge {name}"),
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    /// Creates veth `name` with peer `peer`; the peer is created directly in
    /// the namespace open at `peer_ns` when given.
    pub fn add_veth(&mut self, name: &str, peer: &str, peer_ns: Option<RawFd>) -> Result<(), NetError> {
        let mut p = LinkMessage::default();
        p.attributes.push(LinkAttribute::IfName(peer.to_string()));
        if let Some(fd) = peer_ns {
            p.attributes.push(LinkAttribute::NetNsFd(fd));
        }
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.to_string()));
        msg.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(p))),
        ]));
        self.request(
            &format!("create veth {name}/{peer}"),
            RouteNetlinkMessage::NewLink(msg),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        )
        .map(drop)
    }

    fn set_link(&mut self, op: &str, index: u32, f: impl FnOnce(&mut LinkMessage)) -> Result<(), NetError> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        f(&mut msg);
        self.request(op, RouteNetlinkMessage::SetLink(msg), NLM_F_ACK).map(drop)
    }

    /// Sets a link up or down.
    pub fn set_up(&mut self, index: u32, up: bool) -> Result<(), NetError> {
        self.set_link(&format!("set link {index} up={up}"), index, |m| {
            if up {
                m.header.flags = LinkFlags::Up;
            }
            m.header.change_mask = LinkFlags::Up;
        })
    }

    /// Turns promiscuous mode on or off.
    pub fn set_promisc(&mut self, index: u32, on: bool) -> Result<(), NetError> {
        self.set_link(&format!("set link {index} promisc={on}"), index, |m| {
            if on {
                m.header.flags = LinkFlags::Promisc;
            }
            m.header.change_mask = LinkFlags::Promisc;
        })
    }

    /// Enslaves a link to `master` (or releases it with `None`).
    pub fn set_master(&mut self, index: u32, master: Option<u32>) -> Result<(), NetError> {
        self.set_link(&format!("set master of link {index}"), index, |m| {
            m.attributes.push(LinkAttribute::Controller(master.unwrap_or(0)));
        })
    }

    /// Sets a link's MAC address.
    pub fn set_mac(&mut self, index: u32, mac: [u8; 6]) -> Result<(), NetError> {
        self.set_link(&format!("set MAC of link {index}"), index, |m| {
            m.attributes.push(LinkAttribute::Address(mac.to_vec()));
        })
    }

    /// Moves a link into the namespace open at `ns`.
    pub fn set_netns(&mut self, index: u32, ns: &impl AsRawFd) -> Result<(), NetError> {
        let fd = ns.as_raw_fd();
        self.set_link(&format!("move link {index} to another netns"), index, |m| {
            m.attributes.push(LinkAttribute::NetNsFd(fd));
        })
    }

    /// Deletes a link; a missing link is not an error.
    pub fn del_link(&mut self, index: u32) -> Result<(), NetError> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        match self.request(
            &format!("delete link {index}"),
            RouteNetlinkMessage::DelLink(msg),
            NLM_F_ACK,
        ) {
            Ok(_) => Ok(()),
            Err(NetError::Os { source, .. }) if source.raw_os_error() == Some(libc::ENODEV) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Deletes the link called `name` if it exists; true if it did.
    pub fn del_link_by_name(&mut self, name: &str) -> Result<bool, NetError> {
        match self.link(name)? {
            Some(l) => self.del_link(l.index).map(|()| true),
            None => Ok(false),
        }
    }

    /// All qdiscs of the namespace (including the default ones).
    pub fn qdiscs(&mut self) -> Result<Vec<Qdisc>, NetError> {
        let msgs = self.request(
            "dump qdiscs",
            RouteNetlinkMessage::GetQueueDiscipline(TcMessage::default()),
            NLM_F_DUMP,
        )?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewQueueDiscipline(t) => Some(Qdisc {
                    ifindex: t.header.index as u32,
                    kind: tc_kind(&t),
                    handle: hv(t.header.handle),
                    parent: hv(t.header.parent),
                }),
                _ => None,
            })
            .collect())
    }

    /// Deletes the clsact (or ingress) qdisc of `ifindex`; missing is fine.
    pub fn del_clsact(&mut self, ifindex: u32) -> Result<(), NetError> {
        let mut msg = TcMessage::with_index(ifindex as i32);
        msg.header.parent = h(CLSACT_PARENT);
        msg.header.handle = h(0xffff_0000);
        match self.request(
            &format!("delete clsact qdisc of link {ifindex}"),
            RouteNetlinkMessage::DelQueueDiscipline(msg),
            NLM_F_ACK,
        ) {
            Ok(_) => Ok(()),
            Err(NetError::Os { source, .. })
                if matches!(
                    source.raw_os_error(),
                    Some(libc::ENOENT) | Some(libc::EINVAL) | Some(libc::ENODEV)
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Filters under `parent` (e.g. [`CLSACT_INGRESS`]) of `ifindex`.
    pub fn filters(&mut self, ifindex: u32, parent: u32) -> Result<Vec<Filter>, NetError> {
        let mut msg = TcMessage::with_index(ifindex as i32);
        msg.header.parent = h(parent);
        let msgs = match self.request(
            &format!("dump filters of link {ifindex}"),
            RouteNetlinkMessage::GetTrafficFilter(msg),
            NLM_F_DUMP,
        ) {
            Ok(m) => m,
            // No clsact: nothing to list.
            Err(NetError::Os { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOENT)) =>
            {
                return Ok(Vec::new());
            }
            Err(e) => return Err(e),
        };
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewTrafficFilter(t) => Some(Filter {
                    ifindex: t.header.index as u32,
                    parent: hv(t.header.parent),
                    kind: tc_kind(&t),
                    info: t.header.info,
                    handle: hv(t.header.handle),
                    bpf_name: t.attributes.iter().find_map(|a| match a {
                        TcAttribute::Options(opts) => opts.iter().find_map(|o| match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => Some(n.clone()),
                            _ => None,
                        }),
                        _ => None,
                    }),
                }),
                _ => None,
            })
            .filter(|f| f.info >> 16 != 0) // skip the chain header entry
            .collect())
    }

    /// Deletes one filter (by prio/protocol/handle).
    pub fn del_filter(&mut self, f: &Filter) -> Result<(), NetError> {
        let mut msg = TcMessage::with_index(f.ifindex as i32);
        msg.header.parent = h(f.parent);
        msg.header.info = f.info;
        msg.header.handle = h(f.handle);
        msg.attributes.push(TcAttribute::Kind(f.kind.clone()));
        match self.request(
            &format!("delete filter of link {}", f.ifindex),
            RouteNetlinkMessage::DelTrafficFilter(msg),
            NLM_F_ACK,
        ) {
            Ok(_) => Ok(()),
            Err(NetError::Os { source, .. })
                if matches!(source.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENODEV)) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

fn tc_kind(t: &TcMessage) -> String {
    t.attributes
        .iter()
        .find_map(|a| match a {
            TcAttribute::Kind(k) => Some(k.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

fn parse_link(l: &LinkMessage) -> Link {
    let mut link = Link {
        index: l.header.index,
        name: String::new(),
        kind: None,
        master: None,
        mac: None,
        up: l.header.flags.contains(LinkFlags::Up),
        promisc: l.header.flags.contains(LinkFlags::Promisc),
        link_netnsid: None,
    };
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Controller(m) if *m != 0 => link.master = Some(*m),
            LinkAttribute::Address(a) if a.len() == 6 => {
                let mut mac = [0u8; 6];
                mac.copy_from_slice(a);
                link.mac = Some(mac);
            }
            LinkAttribute::LinkNetNsId(id) => link.link_netnsid = Some(*id),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        link.kind = Some(k.to_string());
                    }
                }
            }
            _ => {}
        }
    }
    link
}
