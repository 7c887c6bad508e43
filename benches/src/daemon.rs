//! A `k7d daemon` of its own for a benchmark: a private state dir and
//! socket, killed and removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use k7d_api::api::Request;
use k7d_api::client::Client;

/// The daemon process and where it lives.
pub struct Daemon {
    child: Child,
    socket: PathBuf,
    dir: PathBuf,
}

impl Daemon {
    /// Starts `k7d <global...> daemon --jail off` (every VM inside it)
    /// under a temp dir named after `tag`
    /// and waits (10 s at most) until its API answers.
    pub fn start(k7d: &Path, tag: &str, global: &[&str]) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("k7d-bench-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let socket = dir.join("k7d.sock");
        let child = Command::new(k7d)
            .args(global)
            .args(["daemon", "--jail", "off", "--state-dir"])
            .arg(dir.join("state"))
            .arg("--socket")
            .arg(&socket)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        let d = Self { child, socket, dir };
        let t = Instant::now();
        while d.client().and_then(|mut c| Ok(c.call(&Request::Version)?)).is_err() {
            if t.elapsed() > Duration::from_secs(10) {
                bail!("the {tag} daemon did not come up");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    /// A new API connection.
    pub fn client(&self) -> Result<Client> {
        Ok(Client::connect(&self.socket)?)
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // SAFETY: signalling our own child, not yet reaped.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
