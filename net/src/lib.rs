//! Host networking for k7d: taps (TUNSETIFF, multi-queue), bridges, veths,
//! netns moves, deterministic names, the per-NIC datapath in `direct`,
//! `bridge` or `auto` mode, pod policy, and a reconcile that removes what a
//! crashed k7d left behind. See `docs/datapath.md`.

mod bridge;
mod datapath;
mod error;
mod fallback;
mod names;
pub mod netlink;
mod netns;
pub mod policy;
mod reconcile;
mod sys;
mod tap;
mod uplink;

pub use bridge::{attach_port, create_private_bridge, delete_bridge, detach_port, master_of};
pub use datapath::{Attached, Datapath, DatapathConfig, EffectiveMode, Mode, NicRequest};
pub use error::NetError;
pub use fallback::{FallbackReason, fallbacks};
pub use k7d_bpf::UplinkPortInfo;
pub use k7d_bpf::{
    AttachMethod, BpfError, Direction, DropCount, DropReason, Forwarded, ObjectSource, Peer, PodUid, Policy,
    pod_identity, tc_object_embedded, tc_object_missing_reason,
};
pub use k7d_sys::tap::{TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6};
pub use names::{LINK_PREFIX, NicNames, cluster_bridge_name, nic_names, validate_vm_id, vm_tag};
pub use netns::in_netns;
pub use reconcile::{Inventory, ReconcileReport};
pub use tap::{Tap, create_tap, read_frame, wait_readable, write_frame};
pub use uplink::{UPLINKS_DIR, Uplink, UplinkGuest, UplinkNic, UplinkRequest};
