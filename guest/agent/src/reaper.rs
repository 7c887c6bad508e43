//! The reaper: the one place the agent waits for children.
//!
//! As PID 1 (or a child subreaper) every orphan in the guest becomes the
//! agent's child, so a thread blocks in `waitpid(-1, ..)` and records each
//! exit in a map pid → exit status that [`Reaper::wait_for`] reads. Nothing
//! else may wait: `std::process::Child::wait` would race this thread for the
//! same zombie. Children are started with [`Reaper::spawn`], which also wakes
//! the thread when it had found no children (it sleeps on a condvar then,
//! never polls).
//!
//! Exits nobody has claimed (a pid the agent never asks about: a process
//! the container forked and orphaned) are kept for a while for a late
//! claimer, up to [`MAX_UNCLAIMED`], oldest dropped first. Claimed pids are
//! never dropped.

use crate::lock;
use std::collections::{HashMap, HashSet, VecDeque};
use std::io;
use std::process::Command;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How many unclaimed exits are remembered.
pub const MAX_UNCLAIMED: usize = 1024;

/// An exit status as containerd reports it: the exit code, or 128 + the
/// signal number for a process killed by a signal.
pub fn decode_status(raw: i32) -> u32 {
    if libc::WIFEXITED(raw) {
        libc::WEXITSTATUS(raw) as u32
    } else if libc::WIFSIGNALED(raw) {
        128 + libc::WTERMSIG(raw) as u32
    } else {
        // waitpid without WUNTRACED/WCONTINUED reports only terminations.
        255
    }
}

/// What to run when a pid exits.
type OnExit = Box<dyn FnOnce(u32) + Send>;

#[derive(Default)]
struct State {
    /// Exit statuses not yet taken by `wait_for`.
    exited: HashMap<i32, u32>,
    /// Pids in `exited` that nobody claimed, oldest first.
    unclaimed: VecDeque<i32>,
    /// Pids someone will wait for.
    claimed: HashSet<i32>,
    /// Callbacks for pids (see [`Reaper::on_exit`]).
    callbacks: HashMap<i32, OnExit>,
    /// Bumped on every spawn so the reaper thread knows to wait again.
    spawns: u64,
    /// The thread found no child and sleeps until a spawn of this reaper
    /// (tests wait for it: a thread in `waitpid(-1)` takes the exits of
    /// other tests' children).
    parked: bool,
}

/// The exit-status registry; see the module documentation.
pub struct Reaper {
    state: Mutex<State>,
    /// Notified on every recorded exit.
    exited: Condvar,
    /// Notified on every spawn.
    spawned: Condvar,
}

impl Reaper {
    /// A reaper whose thread is not started (tests feed it with [`Reaper::record`]).
    pub fn new() -> Arc<Reaper> {
        Arc::new(Reaper {
            state: Mutex::new(State::default()),
            exited: Condvar::new(),
            spawned: Condvar::new(),
        })
    }

    /// A reaper with its `waitpid` thread running.
    pub fn start() -> io::Result<Arc<Reaper>> {
        let reaper = Reaper::new();
        let r = Arc::clone(&reaper);
        std::thread::Builder::new()
            .name("reaper".into())
            .stack_size(128 << 10)
            .spawn(move || r.run())?;
        Ok(reaper)
    }

    fn run(&self) {
        loop {
            let seen = lock(&self.state).spawns;
            match crate::sys::wait_any() {
                Ok((pid, raw)) => self.record(pid, decode_status(raw)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {
                    // No children: sleep until something is spawned. A spawn
                    // after `seen` was read changed `spawns`, so none is missed.
                    let mut st = lock(&self.state);
                    st.parked = true;
                    while st.spawns == seen {
                        st = self.spawned.wait(st).unwrap_or_else(|e| e.into_inner());
                    }
                    st.parked = false;
                }
                Err(e) => {
                    crate::log!("waitpid failed: {e}; retrying in 100 ms");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    /// Records `pid`'s exit (the reaper thread's job; public for tests).
    pub fn record(&self, pid: i32, status: u32) {
        let mut st = lock(&self.state);
        if let Some(f) = st.callbacks.remove(&pid) {
            st.claimed.remove(&pid);
            drop(st);
            f(status);
            return;
        }
        if st.exited.insert(pid, status).is_some() {
            crate::log!("pid {pid} exited again before its previous exit was collected (pid reuse)");
        }
        if !st.claimed.contains(&pid) {
            st.unclaimed.retain(|&p| p != pid);
            st.unclaimed.push_back(pid);
            while st.unclaimed.len() > MAX_UNCLAIMED {
                if let Some(old) = st.unclaimed.pop_front() {
                    st.exited.remove(&old);
                }
            }
        }
        drop(st);
        self.exited.notify_all();
    }

    /// Tells the reaper thread a child may exist now.
    pub fn notify_spawned(&self) {
        lock(&self.state).spawns += 1;
        self.spawned.notify_all();
    }

    /// Spawns `cmd`, wakes the reaper and returns the child's pid, claimed:
    /// collect it with [`Reaper::wait_for`]. (No `Child` is handed out, so
    /// nothing can `wait` on it behind the reaper's back.)
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<i32> {
        let pid = cmd.spawn().map(|child| child.id() as i32);
        // Wake the thread even on failure: std may have forked a child.
        self.notify_spawned();
        let pid = pid?;
        self.claim(pid);
        Ok(pid)
    }

    /// Marks `pid` as awaited: its exit is kept until [`Reaper::wait_for`] takes it.
    pub fn claim(&self, pid: i32) {
        let mut st = lock(&self.state);
        st.claimed.insert(pid);
        st.unclaimed.retain(|&p| p != pid);
    }

    /// Runs `f` with `pid`'s exit status when it exits (at once, in this
    /// thread, when it already has; else in the reaper thread, so `f` must
    /// be quick and must not wait for another exit).
    pub fn on_exit(&self, pid: i32, f: impl FnOnce(u32) + Send + 'static) {
        let mut st = lock(&self.state);
        if let Some(status) = st.exited.remove(&pid) {
            st.claimed.remove(&pid);
            st.unclaimed.retain(|&p| p != pid);
            drop(st);
            f(status);
            return;
        }
        st.claimed.insert(pid);
        st.callbacks.insert(pid, Box::new(f));
    }

    /// Blocks until `pid` has exited; takes and returns its exit status.
    pub fn wait_for(&self, pid: i32) -> u32 {
        // Without a deadline the wait only ends with the exit.
        self.wait_until(pid, None).unwrap_or_default()
    }

    /// [`Reaper::wait_for`] for at most `timeout`; `None` when it has not
    /// exited by then (it stays claimed).
    pub fn wait_for_timeout(&self, pid: i32, timeout: Duration) -> Option<u32> {
        self.wait_until(pid, Some(Instant::now() + timeout))
    }

    fn wait_until(&self, pid: i32, deadline: Option<Instant>) -> Option<u32> {
        let mut st = lock(&self.state);
        st.claimed.insert(pid);
        loop {
            if let Some(status) = st.exited.remove(&pid) {
                st.claimed.remove(&pid);
                st.unclaimed.retain(|&p| p != pid);
                return Some(status);
            }
            st = match deadline {
                None => self.exited.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    self.exited.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0
                }
            };
        }
    }

    /// Whether the thread sleeps with no child to wait for.
    #[cfg(test)]
    pub fn parked(&self) -> bool {
        lock(&self.state).parked
    }

    /// Whether an exit of `pid` is recorded and not yet taken.
    #[cfg(test)]
    pub fn has_exited(&self, pid: i32) -> bool {
        lock(&self.state).exited.contains_key(&pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_and_signals_decode_like_containerd() {
        // Raw wait statuses as the kernel encodes them.
        assert_eq!(decode_status(0), 0);
        assert_eq!(decode_status(3 << 8), 3);
        assert_eq!(decode_status(255 << 8), 255);
        assert_eq!(decode_status(libc::SIGKILL), 137);
        assert_eq!(decode_status(libc::SIGTERM), 143);
        // Killed with a core dump (0x80 set).
        assert_eq!(decode_status(libc::SIGSEGV | 0x80), 128 + 11);
    }

    #[test]
    fn a_waiter_gets_an_exit_recorded_before_or_after_it_asked() {
        let r = Reaper::new();
        r.record(10, 7);
        assert_eq!(r.wait_for(10), 7);
        assert!(!r.has_exited(10), "the status is taken");
        let r2 = Arc::clone(&r);
        let t = std::thread::spawn(move || r2.wait_for(11));
        std::thread::sleep(Duration::from_millis(20));
        r.record(11, 137);
        assert_eq!(t.join().unwrap(), 137);
        assert_eq!(r.wait_for_timeout(12, Duration::from_millis(10)), None);
    }

    #[test]
    fn unclaimed_exits_are_capped_but_claimed_ones_are_kept() {
        let r = Reaper::new();
        r.claim(1);
        r.record(1, 1);
        for pid in 100..100 + MAX_UNCLAIMED as i32 + 10 {
            r.record(pid, 0);
        }
        assert!(r.has_exited(1), "a claimed exit is never dropped");
        assert!(!r.has_exited(100), "the oldest unclaimed exit was dropped");
        assert!(r.has_exited(100 + MAX_UNCLAIMED as i32 + 9));
        assert_eq!(lock(&r.state).exited.len(), MAX_UNCLAIMED + 1);
        assert_eq!(r.wait_for(1), 1);
    }

    #[test]
    fn an_exit_callback_runs_once_whether_the_exit_came_before_or_after() {
        let r = Reaper::new();
        let (tx, rx) = std::sync::mpsc::channel();
        r.record(20, 1);
        let t = tx.clone();
        r.on_exit(20, move |s| t.send((20, s)).unwrap());
        assert_eq!(rx.try_recv().unwrap(), (20, 1));
        r.on_exit(21, move |s| tx.send((21, s)).unwrap());
        assert!(rx.try_recv().is_err());
        r.record(21, 143);
        assert_eq!(rx.try_recv().unwrap(), (21, 143));
        assert!(!r.has_exited(21), "a callback consumes the exit");
    }

    #[test]
    fn the_reaper_thread_collects_a_spawned_child() {
        // This test process is not a subreaper; its own children still come
        // to its waitpid(-1), so no other test may have a child meanwhile.
        let _children = crate::test_children();
        let r = Reaper::start().unwrap();
        let pid = r.spawn(Command::new("/bin/sh").args(["-c", "exit 5"])).unwrap();
        assert_eq!(r.wait_for_timeout(pid, Duration::from_secs(10)), Some(5));
        let pid = r.spawn(Command::new("/bin/sh").args(["-c", "kill -9 $$"])).unwrap();
        assert_eq!(r.wait_for_timeout(pid, Duration::from_secs(10)), Some(137));
        // The thread lives on: it must be asleep, out of waitpid(-1),
        // before another test's child exists.
        let until = Instant::now() + Duration::from_secs(10);
        while !r.parked() {
            assert!(Instant::now() < until, "the reaper thread never parked");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
