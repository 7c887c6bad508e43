// SPDX-License-Identifier: (GPL-2.0-only OR Apache-2.0)
// k7d direct datapath: tc classifier programs for one VM NIC.
//
//   k7d_tap_in : attached at the tap's ingress (frames the guest sent).
//                Egress policy on the destination address, then
//                bpf_redirect_peer(pod veth) (or bpf_redirect when the pod
//                device has no peer in another netns).
//   k7d_pod_in : attached at the pod veth's ingress (frames for the guest).
//                Ingress policy on the source address, then bpf_redirect(tap),
//                all in one pass.
//
// Maps are private to one NIC (one object load per NIC); userspace pins them
// under the NIC's bpffs directory and updates them through the pins.
//
// Standalone l2-uplink mode (one object load per uplink, maps shared by the
// uplink and all its guests' taps; the k7d_ul_* maps are created but unused,
// and not preallocated, in per-NIC loads):
//   k7d_ul_up_in  : at the uplink's ingress. Unicast to a guest MAC -> its
//                   tap; ARP request for a declared guest IPv4 -> that
//                   guest's tap only; anything else -> the host (TC_ACT_OK).
//   k7d_ul_tap_in : at each guest tap's ingress. Destination MAC of another
//                   local guest, or ARP request for another local guest's
//                   IPv4 -> its tap (guest<->guest without a bridge); anything
//                   else -> out of the uplink.
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/icmpv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define K7D_MODE_REDIRECT 0 /* direct: policy + redirect */
#define K7D_MODE_POLICY_ONLY 1 /* policy, then TC_ACT_OK (no redirect) */

struct k7d_cfg {
	__u32 tap_ifindex;
	__u32 pod_ifindex;
	__u32 use_peer; /* 1: bpf_redirect_peer(pod), 0: bpf_redirect(pod) */
	__u32 mode;
	__u32 pod_id; /* this VM's pod identity */
	__u32 default_deny; /* 1: only allowed peers pass */
};

struct k7d_addr {
	__u8 a[16]; /* IPv6, or IPv4-mapped ::ffff:a.b.c.d */
};

#define VERDICT_ALLOW 1
#define VERDICT_DENY 2

/* Drop reasons, index = reason * 2 + direction (0 egress, 1 ingress). */
#define R_POLICY_DENY 1
#define R_DEFAULT_DENY 2
#define R_MALFORMED 3
#define R_NO_TARGET 4
#define DIR_EGRESS 0
#define DIR_INGRESS 1
#define DROP_SLOTS 16

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct k7d_cfg);
} k7d_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, struct k7d_addr);
	__type(value, __u32);
} k7d_ipcache SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u32);
} k7d_peer_verdict SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, DROP_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
} k7d_drops SEC(".maps");

/* What the programs passed on (redirected, or TC_ACT_OK in policy-only
 * mode), per direction (index DIR_*): frames and their bytes, the
 * Ethernet header included. */
struct k7d_fwd {
	__u64 packets;
	__u64 bytes;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, struct k7d_fwd);
} k7d_fwd SEC(".maps");

static __always_inline void forwarded(struct __sk_buff *skb, __u32 dir)
{
	struct k7d_fwd *f = bpf_map_lookup_elem(&k7d_fwd, &dir);
	if (f) {
		f->packets += 1;
		f->bytes += skb->len;
	}
}

static __always_inline int drop(__u32 reason, __u32 dir)
{
	__u32 idx = reason * 2 + dir;
	__u64 *c = bpf_map_lookup_elem(&k7d_drops, &idx);
	if (c)
		*c += 1;
	return TC_ACT_SHOT;
}

/* Returns 0 to pass, or a drop reason. peer_dst selects the address that
 * names the peer: destination for egress, source for ingress. */
static __always_inline __u32 policy(struct __sk_buff *skb, struct k7d_cfg *cfg, int peer_dst)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct k7d_addr key = {};

	if ((void *)(eth + 1) > end)
		return R_MALFORMED;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end)
			return R_MALFORMED;
		__u32 addr = peer_dst ? ip->daddr : ip->saddr;
		key.a[10] = 0xff;
		key.a[11] = 0xff;
		__builtin_memcpy(&key.a[12], &addr, 4);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return R_MALFORMED;
		void *l4 = (void *)(ip6 + 1);
		__u8 nexthdr = ip6->nexthdr;
		/* MLD reports carry a hop-by-hop header (router alert) before
		 * ICMPv6: look through one such 8-byte header. */
		if (nexthdr == IPPROTO_HOPOPTS) {
			__u8 *hbh = l4;
			if ((void *)(hbh + 8) > end)
				return R_MALFORMED;
			if (hbh[1] == 0) {
				nexthdr = hbh[0];
				l4 = hbh + 8;
			}
		}
		if (nexthdr == IPPROTO_ICMPV6) {
			struct icmp6hdr *ic = l4;
			if ((void *)(ic + 1) > end)
				return R_MALFORMED;
			/* Link-local control always passes: multicast listener
			 * discovery (130-132, MLDv2 reports 143), router and
			 * neighbour discovery (133-137). An interface sends MLD
			 * reports by itself for a second or so after it comes up;
			 * policing them counted drops no pod ever sent. */
			if ((ic->icmp6_type >= 130 && ic->icmp6_type <= 137) || ic->icmp6_type == 143)
				return 0;
		}
		if (peer_dst)
			__builtin_memcpy(key.a, &ip6->daddr, 16);
		else
			__builtin_memcpy(key.a, &ip6->saddr, 16);
	} else {
		return 0; /* ARP and other non-IP traffic is not policed */
	}

	__u32 peer_id = 0;
	__u32 *id = bpf_map_lookup_elem(&k7d_ipcache, &key);
	if (id)
		peer_id = *id;
	__u32 verdict = 0;
	if (peer_id) {
		__u32 *v = bpf_map_lookup_elem(&k7d_peer_verdict, &peer_id);
		if (v)
			verdict = *v;
	}
	if (verdict == VERDICT_DENY)
		return R_POLICY_DENY;
	if (cfg->default_deny && verdict != VERDICT_ALLOW)
		return R_DEFAULT_DENY;
	return 0;
}

SEC("classifier")
int k7d_tap_in(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct k7d_cfg *cfg = bpf_map_lookup_elem(&k7d_cfg, &zero);
	if (!cfg || !cfg->pod_ifindex)
		return drop(R_NO_TARGET, DIR_EGRESS);
	__u32 r = policy(skb, cfg, 1);
	if (r)
		return drop(r, DIR_EGRESS);
	forwarded(skb, DIR_EGRESS);
	if (cfg->mode == K7D_MODE_POLICY_ONLY)
		return TC_ACT_OK;
	if (cfg->use_peer)
		return bpf_redirect_peer(cfg->pod_ifindex, 0);
	return bpf_redirect(cfg->pod_ifindex, 0);
}

SEC("classifier")
int k7d_pod_in(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct k7d_cfg *cfg = bpf_map_lookup_elem(&k7d_cfg, &zero);
	if (!cfg || !cfg->tap_ifindex)
		return drop(R_NO_TARGET, DIR_INGRESS);
	__u32 r = policy(skb, cfg, 0);
	if (r)
		return drop(r, DIR_INGRESS);
	forwarded(skb, DIR_INGRESS);
	if (cfg->mode == K7D_MODE_POLICY_ONLY)
		return TC_ACT_OK;
	return bpf_redirect(cfg->tap_ifindex, 0);
}

/* ---- Standalone l2-uplink ---- */

struct k7d_ul_cfg {
	__u32 uplink_ifindex;
	__u32 promisc_set; /* 1: k7d turned promiscuous mode on (restored on detach) */
};

struct k7d_mac {
	__u8 a[6];
	__u8 pad[2];
};

struct arp_eth_ipv4 {
	__be16 htype;
	__be16 ptype;
	__u8 hlen;
	__u8 plen;
	__be16 op;
	__u8 sha[6];
	__u8 spa[4];
	__u8 tha[6];
	__u8 tpa[4];
} __attribute__((packed));

#define K7D_UL_MAX_GUESTS 4096

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct k7d_ul_cfg);
} k7d_ul_cfg SEC(".maps");

/* guest MAC -> guest tap ifindex */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, K7D_UL_MAX_GUESTS);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct k7d_mac);
	__type(value, __u32);
} k7d_ul_fdb SEC(".maps");

/* declared guest IPv4 (network order) -> guest tap ifindex */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, K7D_UL_MAX_GUESTS * 4);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, __u32);
	__type(value, __u32);
} k7d_ul_arp SEC(".maps");

/* The tap owning the frame's destination MAC, or 0. */
static __always_inline __u32 ul_fdb(struct ethhdr *eth)
{
	struct k7d_mac key = {};
	__builtin_memcpy(key.a, eth->h_dest, 6);
	__u32 *ifx = bpf_map_lookup_elem(&k7d_ul_fdb, &key);
	return ifx ? *ifx : 0;
}

/* For an ARP request (Ethernet/IPv4) whose target is a declared guest
 * address: that guest's tap; else 0. */
static __always_inline __u32 ul_arp(struct ethhdr *eth, void *end)
{
	if (eth->h_proto != bpf_htons(ETH_P_ARP))
		return 0;
	struct arp_eth_ipv4 *arp = (void *)(eth + 1);
	if ((void *)(arp + 1) > end)
		return 0;
	if (arp->op != bpf_htons(1) || arp->ptype != bpf_htons(ETH_P_IP) || arp->plen != 4)
		return 0;
	__u32 tpa;
	__builtin_memcpy(&tpa, arp->tpa, 4);
	__u32 *ifx = bpf_map_lookup_elem(&k7d_ul_arp, &tpa);
	return ifx ? *ifx : 0;
}

SEC("classifier")
int k7d_ul_up_in(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_OK; /* not ours to judge: the host stack decides */
	__u32 ifx = ul_fdb(eth);
	if (!ifx)
		ifx = ul_arp(eth, end);
	if (ifx)
		return bpf_redirect(ifx, 0);
	return TC_ACT_OK;
}

SEC("classifier")
int k7d_ul_tap_in(struct __sk_buff *skb)
{
	__u32 zero = 0;
	struct k7d_ul_cfg *cfg = bpf_map_lookup_elem(&k7d_ul_cfg, &zero);
	if (!cfg || !cfg->uplink_ifindex)
		return TC_ACT_SHOT;
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > end)
		return TC_ACT_SHOT;
	__u32 ifx = ul_fdb(eth);
	if (!ifx)
		ifx = ul_arp(eth, end);
	if (ifx && ifx != skb->ifindex)
		return bpf_redirect(ifx, 0);
	return bpf_redirect(cfg->uplink_ifindex, 0);
}

char _license[] SEC("license") = "GPL";
