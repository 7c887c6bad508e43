use std::{fs::File, path::Path};

use crate::{NetError, sys};

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
        Some(p) => Some(File::open(p).map_err(|e| NetError::os(format!("open netns {}", p.display()), e))?),
        None => None,
    };
    std::thread::scope(|s| {
        s.spawn(move || {
            if let Some(ns) = &ns {
                sys::setns_net(ns).map_err(|e| NetError::os("enter the pod netns", e))?;
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
