//! tc-eBPF programs for the k7d direct datapath (C, built with clang by
//! `build.rs`) and their aya 0.14 loader.
//!
//! One object load per VM NIC: two classifier programs (`k7d_tap_in` at the
//! tap's ingress, `k7d_pod_in` at the pod veth's ingress) and five maps, all
//! pinned under the NIC's bpffs directory (`<root>/<vm-tag>/nic<idx>/`).
//! Policy and counters are read and written through those pins, so no
//! in-memory state is needed and a restarted daemon finds everything again.
//!
//! The same object also holds the standalone l2-uplink programs
//! (`k7d_ul_up_in` at an uplink's ingress, `k7d_ul_tap_in` at each guest
//! tap's ingress), loaded once per uplink; see [`UplinkPrograms`].
//!
//! The loader must be called from a thread whose network namespace holds the
//! tap and the pod device (interface names and ifindexes are netns-local).

mod counters;
mod error;
mod identity;
mod loader;
mod policy;
mod uplink;

pub use counters::{Forwarded, forwarded};
pub use error::BpfError;
pub use identity::{PodUid, pod_identity};
pub use loader::{
    AttachMethod, AttachedPrograms, LINK_PINS, MAP_PINS, NicPrograms, ObjectSource, PROG_NAMES, ProgMode, detach_nic,
    load_object, tc_object_embedded, tc_object_missing_reason, tcx_program_count,
};
pub use policy::{Direction, DropCount, DropReason, Peer, Policy, clear_policy, drops, read_policy_flag, set_policy};
pub use uplink::{
    UPLINK_MAP_PINS, UPLINK_PROG_NAMES, UplinkPort, UplinkPortInfo, UplinkPrograms, attach_uplink_port, detach_uplink,
    detach_uplink_port, uplink_ifindex, uplink_ports, uplink_promisc_set,
};
