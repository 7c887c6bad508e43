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
		if (ip6->nexthdr == IPPROTO_ICMPV6) {
			struct icmp6hdr *ic = (void *)(ip6 + 1);
			if ((void *)(ic + 1) > end)
				return R_MALFORMED;
			/* Neighbour and router discovery always pass. */
			if (ic->icmp6_type >= 133 && ic->icmp6_type <= 137)
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
	if (cfg->mode == K7D_MODE_POLICY_ONLY)
		return TC_ACT_OK;
	return bpf_redirect(cfg->tap_ifindex, 0);
}

char _license[] SEC("license") = "GPL";
