//! The `k7d-vm-memory` thread, run while the daemon serves metrics: it
//! reads each VM process's memory (the VM process's own smaps reading,
//! `Request::GuestRam`: its RSS and PSS, its guest RAM resident and
//! copied) in the background and keeps the last reading for the scrape.
//!
//! A scrape then costs one status round trip per VM process whatever the
//! node's size. Read in the scrape, the smaps walks made a scrape of 200
//! idle VMs take 60 ms on the 2-CPU CI host (goal ≤ 50 ms), most of it the
//! VM processes formatting and parsing their smaps. As cAdvisor reads
//! container stats on its own housekeeping interval, not per scrape, a VM's
//! memory series are at most [`READ_EVERY`] (plus a pass) old; a VM with
//! no reading yet (new since the last pass) is read first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use super::Daemon;
use super::periodic::Periodic;
use crate::vmproc::proto::{Reply, Request, UNKNOWN_REQUEST};

/// How often the thread makes a pass.
pub const MEMORY_PERIOD: Duration = Duration::from_secs(1);

/// How old a VM's reading may grow before a pass reads it again; the
/// passes spread the VMs over this period.
pub const READ_EVERY: Duration = Duration::from_secs(10);

/// One VM process's memory, as last read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Reading {
    /// The VM process it was read from (a reading of an earlier process of
    /// the same id is not its).
    pub(super) pid: u32,
    /// Its whole RSS and PSS, bytes.
    pub(super) process: Option<(u64, u64)>,
    /// Its guest RAM: resident and, of that, its own copies, bytes (none
    /// from a VM process of an earlier k7d, read through `/proc`).
    pub(super) guest_ram: Option<(u64, u64)>,
}

/// The last reading of each VM process, by VM id.
#[derive(Default)]
pub(super) struct Readings(Mutex<HashMap<String, (Reading, Instant)>>);

impl Readings {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Reading, Instant)>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// VM `id`'s last reading, if it was read from VM process `pid`.
    pub(super) fn get(&self, id: &str, pid: u32) -> Option<Reading> {
        self.map().get(id).map(|(r, _)| *r).filter(|r| r.pid == pid)
    }

    fn put(&self, id: &str, r: Reading) {
        self.map().insert(id.to_string(), (r, Instant::now()));
    }

    /// VMs to read this pass, in order: those never read (or read from
    /// another process), then those whose reading is older than
    /// [`READ_EVERY`], oldest first, at most `budget` of the latter.
    /// Forgets the readings of VMs not in `live` (id, pid).
    fn due(&self, live: &[(String, u32)], budget: usize, now: Instant) -> Vec<String> {
        let mut map = self.map();
        let ids: std::collections::HashSet<&str> = live.iter().map(|(id, _)| id.as_str()).collect();
        map.retain(|id, _| ids.contains(id.as_str()));
        let mut new = Vec::new();
        let mut stale = Vec::new();
        for (id, pid) in live {
            match map.get(id) {
                Some((r, at)) if r.pid == *pid => {
                    let age = now.saturating_duration_since(*at);
                    if age >= READ_EVERY {
                        stale.push((age, id.clone()));
                    }
                }
                _ => new.push(id.clone()),
            }
        }
        stale.sort_by_key(|s| std::cmp::Reverse(s.0));
        new.extend(stale.into_iter().take(budget).map(|(_, id)| id));
        new
    }
}

/// The running `k7d-vm-memory` thread; dropping it stops and joins it.
pub struct MemoryReader(#[expect(dead_code, reason = "held for its Drop")] Periodic);

impl MemoryReader {
    /// Starts the thread: every `period` it reads the VM processes of
    /// `daemon` that are due, skipping one a request holds (read at a
    /// later pass), and stops between two VMs when dropped.
    pub fn start(daemon: &Arc<Daemon>, period: Duration) -> std::io::Result<Self> {
        Periodic::start("k7d-vm-memory", daemon, period, move |d, stop| {
            d.read_vm_memory(period, stop)
        })
        .map(Self)
    }
}

impl Daemon {
    /// One pass of the `k7d-vm-memory` thread; false when `stop` said to stop.
    pub(super) fn read_vm_memory(&self, period: Duration, stop: &dyn Fn() -> bool) -> bool {
        let procs = self.live_processes_weakly();
        let mut live = Vec::with_capacity(procs.len());
        let mut held = HashMap::with_capacity(procs.len());
        for (id, weak) in procs {
            let Some(r) = weak.upgrade() else { continue };
            let pid = match r.try_lock() {
                Ok(g) => g.record().pid,
                Err(TryLockError::Poisoned(p)) => p.into_inner().record().pid,
                // Busy: its reading stays as it is until a later pass.
                Err(TryLockError::WouldBlock) => match self.vm_memory.map().get(&id) {
                    Some((r, _)) => r.pid,
                    None => continue,
                },
            };
            live.push((id.clone(), pid));
            // Held weakly: a pass must not keep a deleted VM's process alive.
            held.insert(id, weak);
        }
        let passes = (READ_EVERY.as_millis() / period.as_millis().max(1)).max(1) as usize;
        let budget = live.len().div_ceil(passes);
        for id in self.vm_memory.due(&live, budget, Instant::now()) {
            if stop() {
                return false;
            }
            let Some(r) = held.get(&id).and_then(std::sync::Weak::upgrade) else {
                continue;
            };
            // (A stopped VM's process answers nothing: the call says so.)
            let Ok(mut g) = r.try_lock() else { continue };
            let pid = g.record().pid;
            let reading = match g.call(&Request::GuestRam) {
                Ok(Reply::GuestRam {
                    resident,
                    copied,
                    process_rss,
                    process_pss,
                    ..
                }) if process_rss > 0 => Reading {
                    pid,
                    process: Some((process_rss, process_pss)),
                    guest_ram: Some((resident, copied)),
                },
                // A VM process of an earlier k7d does not know the
                // request: /proc, where this host lets the daemon read it.
                Err(e) if e.message.contains(UNKNOWN_REQUEST) => Reading {
                    pid,
                    process: super::vm_samples::rss_pss(pid),
                    guest_ram: None,
                },
                Ok(_) => Reading {
                    pid,
                    process: None,
                    guest_ram: None,
                },
                Err(e) => {
                    tracing::debug!(vm = %id, error = %e, "cannot read a VM process's memory");
                    continue;
                }
            };
            drop(g);
            self.vm_memory.put(&id, reading);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(pid: u32) -> Reading {
        Reading {
            pid,
            process: Some((1, 1)),
            guest_ram: None,
        }
    }

    #[test]
    fn new_vms_come_first_then_the_oldest_readings_within_the_budget() {
        let r = Readings::default();
        let t0 = Instant::now();
        // a, b, c read long ago (c the oldest), d read just now.
        for (id, ago) in [("a", 20), ("b", 30), ("c", 40), ("d", 0)] {
            r.map().insert(id.into(), (reading(7), t0 - Duration::from_secs(ago)));
        }
        let live: Vec<(String, u32)> = ["a", "b", "c", "d", "e"].iter().map(|i| (i.to_string(), 7)).collect();
        // e (never read) first, then the 2 oldest of the stale ones; d is fresh.
        assert_eq!(r.due(&live, 2, t0), ["e", "c", "b"]);
        assert_eq!(r.due(&live, 5, t0), ["e", "c", "b", "a"]);
        // A reading of an earlier process of the same id does not count.
        let live2: Vec<(String, u32)> = vec![("d".into(), 8)];
        assert_eq!(r.due(&live2, 0, t0), ["d"]);
        assert_eq!(r.get("d", 8), None);
        // ... and the readings of VMs gone were forgotten.
        assert!(r.map().keys().all(|k| k == "d"));
        r.put("d", reading(8));
        assert_eq!(r.get("d", 8), Some(reading(8)));
        assert_eq!(r.get("d", 7), None);
    }
}
