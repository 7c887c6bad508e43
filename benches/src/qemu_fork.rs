//! QEMU's nearest equivalent of a fork, for the fork benchmark: stop the
//! source, migrate its state to a file, start a new QEMU with `-incoming`
//! from that file, `cont`. The source runs the same test guest k7d's bench
//! uses for QEMU (`hello` as a `-bios` image); its RAM is a shared file the
//! bench fills with the same number of non-zero pages k7d's source diverged
//! by, so QEMU migrates what k7d's fork must account for (zero pages are
//! QEMU's cheap case).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// A QMP connection (line-delimited JSON; events are skipped).
struct Qmp {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Qmp {
    fn connect(sock: &Path, timeout: Duration) -> Result<Self> {
        let end = Instant::now() + timeout;
        let s = loop {
            match UnixStream::connect(sock) {
                Ok(s) => break s,
                Err(e) if Instant::now() < end => {
                    let _ = e;
                    std::thread::sleep(Duration::from_micros(200));
                }
                Err(e) => return Err(e).with_context(|| format!("QMP socket {}", sock.display())),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut q = Self {
            r: BufReader::new(s.try_clone()?),
            w: s,
        };
        let mut greeting = String::new();
        q.r.read_line(&mut greeting)?;
        q.cmd(r#"{"execute":"qmp_capabilities"}"#)?;
        Ok(q)
    }

    /// Sends one command; returns its `return` line.
    fn cmd(&mut self, c: &str) -> Result<String> {
        self.w.write_all(c.as_bytes())?;
        self.w.write_all(b"\n")?;
        loop {
            let mut line = String::new();
            if self.r.read_line(&mut line)? == 0 {
                bail!("QMP closed during {c}");
            }
            if line.contains("\"error\"") {
                bail!("QMP {c}: {}", line.trim());
            }
            if line.contains("\"return\"") {
                return Ok(line);
            }
        }
    }

    /// Polls `query` until its answer contains `want`.
    fn wait_for(&mut self, query: &str, want: &str, timeout: Duration) -> Result<()> {
        let end = Instant::now() + timeout;
        loop {
            let r = self.cmd(query)?;
            if r.contains(want) {
                return Ok(());
            }
            if r.contains("\"failed\"") {
                bail!("{query}: {}", r.trim());
            }
            if Instant::now() > end {
                bail!("{query} did not reach {want}: {}", r.trim());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One QEMU fork stand-in, set up once per (RAM, dirty pages).
pub struct QemuFork {
    qemu: PathBuf,
    bios: PathBuf,
    dir: PathBuf,
    mib: u64,
}

impl QemuFork {
    /// Uses `qemu` and the `-bios` image `bios`; scratch files go to `dir`
    /// (tmpfs keeps the migration file out of disk I/O, as k7d's fork is).
    pub fn new(qemu: &Path, bios: &Path, dir: &Path, mib: u64) -> Self {
        Self {
            qemu: qemu.to_path_buf(),
            bios: bios.to_path_buf(),
            dir: dir.to_path_buf(),
            mib,
        }
    }

    fn base_args(&self, c: &mut Command, log: &Path) -> Result<()> {
        c.args(["-accel", "kvm", "-machine", "pc", "-m"])
            .arg(format!("{}M", self.mib))
            .args(["-nodefaults", "-no-user-config", "-display", "none", "-serial", "none"])
            .args(["-monitor", "none", "-bios"])
            .arg(&self.bios)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?);
        Ok(())
    }

    fn log_tail(&self, which: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("qemu-{which}.log")))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.contains("host doesn't support requested feature"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Times stop → migrate to a file → a new QEMU `-incoming` that file →
    /// `cont`, with `dirty` non-zero pages spread over the source's RAM.
    pub fn run(&self, dirty: u64, round: u32) -> Result<Duration> {
        let ram = self.dir.join("qemu-ram");
        let state = self.dir.join("qemu-state");
        let (s1, s2) = (self.dir.join("qmp-src.sock"), self.dir.join("qmp-dst.sock"));
        for p in [&ram, &state, &s1, &s2] {
            let _ = std::fs::remove_file(p);
        }
        let f = std::fs::File::create(&ram)?;
        f.set_len(self.mib << 20)?;
        let pages = (self.mib << 20) / 4096;
        let stride = (pages / dirty.max(1)).max(1);
        let page = vec![0x5a ^ round as u8 | 1; 4096];
        for i in 0..dirty {
            let p = ((i * stride) % pages).max(256);
            f.write_all_at(&page, p * 4096)?;
        }
        drop(f);
        let mut c = Command::new(&self.qemu);
        self.base_args(&mut c, &self.dir.join("qemu-src.log"))?;
        c.arg("-object")
            .arg(format!(
                "memory-backend-file,id=ram0,size={}M,mem-path={},share=on",
                self.mib,
                ram.display()
            ))
            .args(["-machine", "memory-backend=ram0", "-qmp"])
            .arg(format!("unix:{},server=on,wait=off", s1.display()));
        let _src = Killed(c.spawn().context("starting the source QEMU")?);
        let mut q1 = Qmp::connect(&s1, Duration::from_secs(10))
            .with_context(|| format!("the source QEMU: {}", self.log_tail("src")))?;
        q1.wait_for(r#"{"execute":"query-status"}"#, "\"running\"", Duration::from_secs(10))?;

        let t = Instant::now();
        q1.cmd(r#"{"execute":"stop"}"#)?;
        q1.cmd(&format!(
            r#"{{"execute":"migrate","arguments":{{"uri":"exec:cat > {}"}}}}"#,
            state.display()
        ))?;
        q1.wait_for(
            r#"{"execute":"query-migrate"}"#,
            "\"completed\"",
            Duration::from_secs(120),
        )?;
        let mut c = Command::new(&self.qemu);
        self.base_args(&mut c, &self.dir.join("qemu-dst.log"))?;
        // The same RAM block name as the source's, in anonymous memory.
        c.arg("-object")
            .arg(format!("memory-backend-ram,id=ram0,size={}M", self.mib))
            .args(["-machine", "memory-backend=ram0"]);
        c.args(["-S", "-incoming"])
            .arg(format!("exec:cat {}", state.display()))
            .arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", s2.display()));
        let _dst = Killed(c.spawn().context("starting the incoming QEMU")?);
        let mut q2 = Qmp::connect(&s2, Duration::from_secs(10))
            .with_context(|| format!("the incoming QEMU: {}", self.log_tail("dst")))?;
        // -S: the incoming VM stops in "paused" once the state is in.
        q2.wait_for(r#"{"execute":"query-status"}"#, "\"paused\"", Duration::from_secs(120))
            .with_context(|| format!("the incoming QEMU: {}", self.log_tail("dst")))?;
        q2.cmd(r#"{"execute":"cont"}"#)?;
        let d = t.elapsed();
        for p in [&ram, &state, &s1, &s2] {
            let _ = std::fs::remove_file(p);
        }
        Ok(d)
    }
}
