//! A fork child's own identity (`identity`): every child of one template
//! starts with the template's RAM, so its kernel RNG would hand every child
//! the same bytes, its clock would tell the template's time, and its
//! machine-id would be the template's. The shim sends host entropy, the
//! host's time and a fresh machine-id; the agent credits the entropy
//! (`RNDADDENTROPY`) and forces a reseed of the kernel's RNG
//! (`RNDRESEEDCRNG`), steps `CLOCK_REALTIME`, and writes `/etc/machine-id`.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;

use k7d_agent::proto::{Identity, MAX_ENTROPY, MIN_ENTROPY};

/// `_IOW('R', 0x03, int[2])`: add entropy and credit it.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// A checked [`Identity`].
#[derive(Debug, Clone)]
pub struct Plan {
    /// The entropy bytes.
    pub entropy: Vec<u8>,
    /// The wall clock to step to.
    pub time: libc::timespec,
    /// The machine-id.
    pub machine_id: String,
}

/// Checks `id`; each refusal is one sentence.
pub fn plan(id: &Identity) -> Result<Plan, String> {
    check_entropy(&id.entropy)?;
    let m = &id.machine_id;
    if m.len() != 32
        || !m.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        || m.bytes().all(|b| b == b'0')
    {
        return Err(format!(
            "machine-id {m:?} is not 32 lowercase hex digits (not all zero)"
        ));
    }
    let (Ok(tv_sec), Ok(tv_nsec)) = (
        libc::time_t::try_from(id.unix_time_ns / 1_000_000_000),
        libc::c_long::try_from(id.unix_time_ns % 1_000_000_000),
    ) else {
        return Err(format!("the time {} ns is out of range", id.unix_time_ns));
    };
    Ok(Plan {
        entropy: id.entropy.clone(),
        time: libc::timespec { tv_sec, tv_nsec },
        machine_id: m.clone(),
    })
}

/// Refuses too few or too many entropy bytes, in one sentence.
pub fn check_entropy(entropy: &[u8]) -> Result<(), String> {
    if !(MIN_ENTROPY..=MAX_ENTROPY).contains(&entropy.len()) {
        return Err(format!(
            "{} entropy bytes given: a reseed takes {MIN_ENTROPY} to {MAX_ENTROPY}",
            entropy.len()
        ));
    }
    Ok(())
}

/// Writes the machine-id under `etc`; with `system` (the agent is the VM's
/// PID 1) also mixes in the entropy, reseeds the RNG and steps the clock.
pub fn apply(plan: &Plan, etc: &Path, system: bool) -> Result<(), String> {
    if system {
        reseed(&plan.entropy)?;
        // SAFETY: clock_settime reads one timespec we own.
        if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &plan.time) } != 0 {
            return Err(format!("cannot step the clock: {}", std::io::Error::last_os_error()));
        }
    }
    write_machine_id(etc, &plan.machine_id)
}

/// Credits `entropy` to the kernel's pool and reseeds the CRNG from it.
pub fn reseed(entropy: &[u8]) -> Result<(), String> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/random")
        .map_err(|e| format!("cannot open /dev/random: {e}"))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + entropy.len().next_multiple_of(4));
    let bits = i32::try_from(entropy.len() * 8).map_err(|_| "too much entropy".to_string())?;
    let len = i32::try_from(entropy.len()).map_err(|_| "too much entropy".to_string())?;
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&len.to_ne_bytes());
    info.extend_from_slice(entropy);
    info.resize(8 + entropy.len().next_multiple_of(4), 0);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of buf_size bytes of
    // payload; `info` holds the header and that many bytes (rounded up).
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } != 0 {
        return Err(format!("cannot add entropy: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) } != 0 {
        let e = std::io::Error::last_os_error();
        // ENODATA: the CRNG is not ready yet, and will seed from the pool
        // (which now holds this entropy) when it is.
        if e.raw_os_error() != Some(libc::ENODATA) {
            return Err(format!("cannot reseed the kernel's RNG: {e}"));
        }
    }
    Ok(())
}

/// Replaces `<etc>/machine-id` atomically (a rename).
fn write_machine_id(etc: &Path, id: &str) -> Result<(), String> {
    std::fs::create_dir_all(etc).map_err(|e| format!("cannot create {}: {e}", etc.display()))?;
    let tmp = etc.join(".machine-id.k7d");
    let mut f = std::fs::File::create(&tmp).map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    f.write_all(format!("{id}\n").as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, etc.join("machine-id"))
        .map_err(|e| format!("cannot replace {}/machine-id: {e}", etc.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(entropy: usize, machine_id: &str) -> Identity {
        Identity {
            entropy: vec![7; entropy],
            unix_time_ns: 1_764_000_000_123_456_789,
            machine_id: machine_id.into(),
        }
    }

    #[test]
    fn an_identity_is_checked_before_anything_is_touched() {
        let good = "0123456789abcdef0123456789abcdef";
        let p = plan(&id(32, good)).unwrap();
        assert_eq!((p.time.tv_sec, p.time.tv_nsec), (1_764_000_000, 123_456_789));
        for (n, m, want) in [
            (31, good, "31 entropy bytes"),
            (513, good, "513 entropy bytes"),
            (32, "0123456789ABCDEF0123456789abcdef", "not 32 lowercase hex"),
            (32, "0123", "not 32 lowercase hex"),
            (32, "00000000000000000000000000000000", "not all zero"),
            (32, "../../../../etc/shadow0123456789a", "not 32 lowercase hex"),
        ] {
            let e = plan(&id(n, m)).unwrap_err();
            assert!(e.contains(want) && !e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn the_machine_id_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("k7d-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let etc = dir.join("etc");
        let p = plan(&id(64, "0123456789abcdef0123456789abcdef")).unwrap();
        apply(&p, &etc, false).unwrap();
        assert_eq!(
            std::fs::read_to_string(etc.join("machine-id")).unwrap(),
            "0123456789abcdef0123456789abcdef\n"
        );
        let p = plan(&id(64, "fedcba9876543210fedcba9876543210")).unwrap();
        apply(&p, &etc, false).unwrap();
        assert_eq!(
            std::fs::read_to_string(etc.join("machine-id")).unwrap(),
            "fedcba9876543210fedcba9876543210\n"
        );
        assert_eq!(std::fs::read_dir(&etc).unwrap().count(), 1, "a temporary file was left");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
