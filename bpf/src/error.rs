use std::path::PathBuf;

/// Errors of the bpf loader and policy maps; each message is one sentence
/// naming the object and the reason.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    /// The compiled object is not available (clang missing at build time, or
    /// the object file named at run time does not exist).
    #[error("bpf object missing: {0}")]
    ObjectMissing(String),
    /// A pod UID failed validation.
    #[error("pod UID {uid:?} is invalid: {reason}")]
    InvalidPodUid { uid: String, reason: &'static str },
    /// A policy is self-contradictory or too large.
    #[error("policy is invalid: {0}")]
    InvalidPolicy(String),
    /// The object could not be parsed or a program was refused by the verifier.
    #[error("bpf object could not be loaded: {0}")]
    Load(String),
    /// A program could not be attached to an interface.
    #[error("bpf program {prog} could not be attached to {iface}: {reason}")]
    Attach {
        prog: &'static str,
        iface: String,
        reason: String,
    },
    /// A pin (or the pin directory) could not be created, opened or removed.
    #[error("bpf pin {path} could not be {op}: {reason}")]
    Pin {
        path: PathBuf,
        op: &'static str,
        reason: String,
    },
    /// A map could not be read or updated.
    #[error("bpf map {map} could not be {op}: {reason}")]
    Map {
        map: String,
        op: &'static str,
        reason: String,
    },
    /// A guest port of an l2 uplink was refused (address or MAC taken).
    #[error("guest port {port} cannot be added to the uplink: {reason}")]
    PortRefused { port: String, reason: String },
    /// No pinned state exists where a NIC's programs were expected.
    #[error("no direct datapath state at {0}: the NIC has no bpf programs attached")]
    NotAttached(PathBuf),
}
