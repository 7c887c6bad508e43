//! The calling thread.

/// The calling thread's id (`gettid(2)`); async-signal-safe.
pub fn gettid() -> i32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_main_thread_and_another_differ() {
        let here = super::gettid();
        assert!(here > 0);
        let there = std::thread::spawn(super::gettid).join().unwrap();
        assert_ne!(here, there);
    }
}
