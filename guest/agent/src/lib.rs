//! k7d's guest agent: the pod VM's PID 1 (the `k7d-agent` binary) and the
//! protocol the containerd shim speaks to it over vsock ([`proto`]).

pub mod proto;
