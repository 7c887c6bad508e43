//! What a VM's guest RAM costs the host, as `k7d guest-ram` shows it (the
//! API's `guest_ram`; not in `info`, which the containerd shim polls every
//! 200 ms per pod: an smaps read walks every mapping of the process): the pages
//! of its RAM mapping that are resident, those of them that are its own
//! copies (written since its fork, or copied in from its source's diverged
//! pages: anonymous pages over a private mapping of the fork base), and
//! their proportional share (PSS: a page shared with the fork base and its
//! other children counts in part). Read from `/proc/<pid>/smaps`: by the
//! mapping's address for a VM inside the daemon, by the guest RAM memfd's
//! name (`/memfd:k7d-ram-…`) in a VM process, which holds one VM.

pub use k7d_api::state::GuestRamUsage;

/// The name prefix of guest RAM memfds in `/proc/<pid>/smaps`.
const RAM_MEMFD: &str = "/memfd:k7d-ram-";

/// Sums `Rss`, `Anonymous` and `Pss` over the mappings of an smaps text
/// for which `want(start, end, path)` holds.
fn sum(text: &str, want: impl Fn(u64, u64, &str) -> bool) -> GuestRamUsage {
    let mut u = GuestRamUsage::default();
    let mut taking = false;
    for line in text.lines() {
        if let Some((start, end, path)) = header(line) {
            taking = want(start, end, path);
            continue;
        }
        if !taking {
            continue;
        }
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        let kib = || {
            rest.trim()
                .strip_suffix("kB")
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        match name {
            "Rss" => u.resident += kib() * 1024,
            "Anonymous" => u.copied += kib() * 1024,
            "Pss" => u.pss += kib() * 1024,
            _ => {}
        }
    }
    u
}

/// A mapping's first line (`start-end perms offset dev inode [path]`): its
/// range and path; `None` for a field line (`Rss:   4 kB`).
fn header(line: &str) -> Option<(u64, u64, &str)> {
    let mut parts = line.split_whitespace();
    let (start, end) = parts.next()?.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    // perms, offset, dev, inode, then the path (which may hold spaces).
    let mut rest = line.trim_start();
    for _ in 0..5 {
        rest = rest.split_once(char::is_whitespace).map_or("", |(_, r)| r.trim_start());
    }
    Some((start, end, rest.trim_end()))
}

/// The guest RAM of a VM inside this process: the mappings within
/// `ranges` (host address, length), read from `/proc/self/smaps`.
pub fn in_this_process(ranges: &[(u64, u64)]) -> std::io::Result<GuestRamUsage> {
    let text = std::fs::read_to_string("/proc/self/smaps")?;
    Ok(sum(&text, |s, e, _| {
        ranges.iter().any(|&(a, len)| s >= a && e <= a.saturating_add(len))
    }))
}

/// The guest RAM of the VM in VM process `pid` (its guest RAM memfd's
/// mappings).
pub fn in_vm_process(pid: u32) -> std::io::Result<GuestRamUsage> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    Ok(of_vm_process_smaps(&text))
}

/// Every mapping of a process's `smaps` text summed: its resident set and
/// PSS (`copied`: its anonymous pages).
pub fn of_whole_smaps(text: &str) -> GuestRamUsage {
    sum(text, |_, _, _| true)
}

/// What a VM process's guest RAM costs, from the text of its `smaps`
/// (read by the VM process itself: `vmproc::runtime`, `GuestRam`).
pub fn of_vm_process_smaps(text: &str) -> GuestRamUsage {
    sum(text, |_, _, path| path.starts_with(RAM_MEMFD))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-p 00000000 00:01 77                         /memfd:k7d-ram-tpl (deleted)
Size:               4096 kB
Rss:                1024 kB
Pss:                 600 kB
Anonymous:           200 kB
VmFlags: rd wr mr mw me ac sd
7f0000400000-7f0000401000 rw-p 00000000 00:00 0 
Size:                  4 kB
Rss:                   4 kB
Pss:                   4 kB
Anonymous:             4 kB
7f1000000000-7f1000200000 rw-s 00000000 00:01 78                         /memfd:k7d-ram-other (deleted)
Rss:                 512 kB
Pss:                 512 kB
Anonymous:             0 kB
";

    #[test]
    fn only_the_wanted_mappings_are_summed() {
        let by_name = sum(SMAPS, |_, _, p| p.starts_with(RAM_MEMFD));
        assert_eq!(
            by_name,
            GuestRamUsage {
                id: String::new(),
                resident: 1536 * 1024,
                copied: 200 * 1024,
                pss: 1112 * 1024,
            }
        );
        let by_range = sum(SMAPS, |s, e, _| s >= 0x7f00_0000_0000 && e <= 0x7f00_0040_0000);
        assert_eq!(by_range.resident, 1024 * 1024);
        assert_eq!(by_range.shared(), 824 * 1024);
        assert_eq!(header("Rss:   4 kB"), None);
        assert_eq!(
            header("7f0000400000-7f0000401000 rw-p 00000000 00:00 0 "),
            Some((0x7f00_0040_0000, 0x7f00_0040_1000, ""))
        );
    }

    #[test]
    fn a_fork_childs_copies_show_as_copied_and_the_rest_as_shared() {
        // A private mapping of a memfd, as a fork child's RAM: pages read
        // stay the memfd's, pages written become the child's own.
        const PAGES: usize = 64;
        let fd = crate::sys::memfd("k7d-ram-usage-test", (PAGES * 4096) as u64).unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh private mapping of a memfd this test owns, of its
        // whole length; unmapped below and used only through `p`.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGES * 4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let base = p as *mut u8;
        for i in 0..PAGES {
            // SAFETY: within the mapping made above.
            let _ = unsafe { std::ptr::read_volatile(base.add(i * 4096)) };
        }
        for i in 0..PAGES / 4 {
            // SAFETY: within the mapping made above.
            unsafe { std::ptr::write_volatile(base.add(i * 4096), 1) };
        }
        let u = in_this_process(&[(p as u64, (PAGES * 4096) as u64)]).unwrap();
        // SAFETY: the mapping made above, not used after.
        unsafe { libc::munmap(p, PAGES * 4096) };
        assert_eq!(u.copied, (PAGES / 4 * 4096) as u64, "{u:?}");
        assert_eq!(u.resident, (PAGES * 4096) as u64, "{u:?}");
        assert_eq!(u.shared(), (PAGES * 3 / 4 * 4096) as u64, "{u:?}");
    }
}
