use std::{os::unix::fs::OpenOptionsExt, path::Path};

use crate::NetError;

/// Runs `f` on a fresh thread that has entered the network namespace at
/// `netns` (e.g. `/run/netns/x` or `/proc/<pid>/ns/net`); `None` runs it in
/// the caller's namespace on that thread. Sockets, taps and interface
/// lookups made inside `f` belong to that namespace.
pub fn in_netns<T, F>(netns: Option<&Path>, f: F) -> Result<T, NetError>
where
    T: Send,
    F: FnOnce() -> Result<T, NetError> + Send,
{
    let ns = match netns {
        // O_NONBLOCK: a FIFO at `p` must not block the opener (setns then
        // refuses it); a namespace file ignores the flag.
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
                .open(p)
                .map_err(|e| NetError::os(format!("open netns {}", p.display()), e))?,
        ),
        None => None,
    };
    std::thread::scope(|s| {
        s.spawn(move || {
            if let Some(ns) = &ns {
                k7d_sys::netif::setns_net(ns).map_err(|e| NetError::os("enter the pod netns", e))?;
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| {
            Err(NetError::Invalid {
                what: "netns worker".into(),
                reason: "it panicked".into(),
            })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A FIFO given as a netns is refused at once (setns), never waited on.
    #[test]
    fn a_fifo_as_netns_does_not_block() {
        let dir = std::env::temp_dir().join(format!("k7d-netns-fifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        k7d_sys::file::mkfifo(&fifo, 0o600).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let f = fifo.clone();
        std::thread::spawn(move || {
            let _ = tx.send(in_netns(Some(&f), || Ok(())).is_err());
        });
        let refused = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("entering a FIFO as a netns blocked");
        assert!(refused, "a FIFO was entered as a netns");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
