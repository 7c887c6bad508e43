use crate::BpfError;

/// A validated Kubernetes pod UID (letters, digits and `-`, 1..=64 bytes).
///
/// Anything else (`../x`, slashes, dots, spaces, control characters, empty)
/// is refused before any state is touched.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodUid(String);

impl PodUid {
    /// Validates `uid`.
    pub fn parse(uid: &str) -> Result<Self, BpfError> {
        let bad = |reason| BpfError::InvalidPodUid {
            uid: uid.chars().take(80).collect(),
            reason,
        };
        if uid.is_empty() {
            return Err(bad("it is empty"));
        }
        if uid.len() > 64 {
            return Err(bad("it is longer than 64 bytes"));
        }
        if !uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(bad("only ASCII letters, digits and '-' are allowed"));
        }
        if uid.starts_with('-') {
            return Err(bad("it starts with '-'"));
        }
        Ok(Self(uid.to_ascii_lowercase()))
    }

    /// The UID, lower-cased.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for PodUid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The stable 32-bit pod identity of a UID: FNV-1a over the lower-cased UID,
/// never 0 (0 means "unknown peer" in the datapath). Stateless, so two
/// daemons (or a restarted one) always agree; a 32-bit hash can collide, with
/// probability about n²/2³³ for n pods.
pub fn pod_identity(uid: &PodUid) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in uid.as_str().bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    if h == 0 { 1 } else { h }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_uids_parse_and_ids_are_stable() {
        let a = PodUid::parse("4f1c2a9e-8d0b-4c6e-9a51-0c6d2b7e9f10").unwrap();
        let b = PodUid::parse("4F1C2A9E-8D0B-4C6E-9A51-0C6D2B7E9F10").unwrap();
        assert_eq!(a, b);
        assert_eq!(pod_identity(&a), pod_identity(&b));
        assert_ne!(pod_identity(&a), 0);
        let c = PodUid::parse("another-pod").unwrap();
        assert_ne!(pod_identity(&a), pod_identity(&c));
        // FNV-1a reference value, so the id is stable across releases.
        assert_eq!(pod_identity(&PodUid::parse("a").unwrap()), 0xe40c292c);
    }

    #[test]
    fn hostile_uids_are_refused() {
        for uid in ["../x", "", "a/b", "a.b", "a b", "-a", "x\n", &"a".repeat(65), "ü"] {
            let e = PodUid::parse(uid).unwrap_err();
            assert!(matches!(e, BpfError::InvalidPodUid { .. }), "{uid:?}: {e}");
            assert!(e.to_string().starts_with("pod UID"), "{e}");
        }
    }
}
