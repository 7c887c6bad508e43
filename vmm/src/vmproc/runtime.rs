//! The VM process's side of the channel (`k7d vm-process`, after its
//! jail): one VM built, run and stopped on request, for one caller at a
//! time. Each caller begins with hello. When the caller goes away (its
//! channel closes: a daemon that crashed or was upgraded), the VM runs on
//! and, if the process was handed a listening socket, the next caller that
//! connects to it re-attaches; without one, the VM stops with its caller.
//!
//! When the guest stops by itself (a reset, a poweroff, a vCPU error), the
//! process ends with the status `exit_code_of` gives, once any request it
//! is serving has its reply: its daemon's watcher records the stop, an
//! event and the VM's record, from the process's end, as it would a crash.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use super::proto::{Reply, Request, UNKNOWN_REQUEST, VERSION};
use super::wire::Channel;
use crate::vstate::control::StopReason;
use crate::vstate::handed::{FileRole, HandedFiles, HostFiles};
use crate::{Vm, VmOptions};

/// Most words one `peek` reads.
pub const MAX_PEEK_WORDS: u32 = 1024;

/// Held while a request is served, from its arrival to its reply: a guest
/// stop ends the process only between requests.
static SERVING: Mutex<()> = Mutex::new(());

/// How a caller's session ended.
enum Ended {
    /// It asked to stop: the VM is stopped, the process exits.
    Stop,
    /// Its channel closed (or it was refused): the next caller may come.
    Closed,
}

/// Serves `channel`, then every caller `listener` accepts, until a stop
/// (module docs). Every request gets one reply; a bad line gets an error
/// reply and is otherwise ignored. A first caller that is refused ends the
/// process when there is no listener.
pub fn serve(channel: UnixStream, listener: Option<UnixListener>) -> Result<(), String> {
    let mut vm: Option<Vm> = None;
    // Told of the guest's own stop by the last vCPU thread to leave (which
    // makes no call but a futex's to tell it), it ends the process.
    let (stopped, stop_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("k7d-guest-stop".into())
        .spawn(move || end_on_guest_stop(stop_rx))
        .map_err(|e| format!("cannot start the thread that ends the process with its guest: {e}"))?;
    let mut armed = false;
    // A VM process spawned ahead (a spare) gets its listening socket with
    // the request that builds its VM.
    let mut listener = listener;
    let mut next = Some(channel);
    loop {
        let conn = match next.take() {
            Some(c) => c,
            None => match &listener {
                Some(l) => match l.accept() {
                    Ok((c, _)) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot accept a caller; waiting for the next");
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    }
                },
                None => break,
            },
        };
        match session(conn, &mut vm, &mut listener, &mut armed, &stopped) {
            Ok(Ended::Stop) => return Ok(()),
            Ok(Ended::Closed) => {}
            Err(e) if listener.is_none() => return Err(e),
            Err(e) => tracing::warn!("a caller was refused: {e}"),
        }
    }
    // The caller is gone and no other can come: the VM goes with it.
    if let Some(mut v) = vm {
        v.stop();
    }
    Ok(())
}

/// Waits for a stop reason from [`arm`] and ends the process with its
/// status, once no request is being served (a channel that closes ends
/// the wait with the process, which then ends as it would anyway).
fn end_on_guest_stop(stops: Receiver<StopReason>) {
    let Ok(reason) = stops.recv() else {
        return;
    };
    let Some(code) = super::exit_code_of(&reason) else {
        return;
    };
    let _serving = SERVING.lock().unwrap_or_else(|p| p.into_inner());
    tracing::warn!(%reason, code, "the guest stopped the VM: the VM process ends");
    crate::sys::exit_now(code);
}

/// Has `vm`'s own stop (not a requested one) sent to [`end_on_guest_stop`],
/// once per process: the callback runs when its last vCPU leaves, and a
/// VM that stopped before it was armed is sent at once.
fn arm(vm: &Vm, armed: &mut bool, stopped: &Sender<StopReason>) {
    if *armed {
        return;
    }
    *armed = true;
    let tx = stopped.clone();
    vm.control().set_on_stopped(Box::new(move |reason| {
        if super::exit_code_of(reason).is_some() {
            let _ = tx.send(reason.clone());
        }
    }));
    if let crate::vstate::vm::VmState::Stopped { reason } = vm.state()
        && super::exit_code_of(&reason).is_some()
    {
        let _ = stopped.send(reason);
    }
}

/// Sends `r` with `fds`.
fn send(chan: &Channel, r: &Reply, fds: &[std::os::fd::RawFd]) -> Result<(), String> {
    let line = serde_json::to_string(r).map_err(|e| e.to_string())?;
    chan.send(&line, fds).map_err(|e| format!("the channel closed: {e}"))
}

/// Refuses the caller with `message` (as its error reply and as the end of
/// its session).
fn refuse(chan: &Channel, message: String) -> Result<Ended, String> {
    send(
        chan,
        &Reply::Error {
            message: message.clone(),
        },
        &[],
    )?;
    Err(message)
}

/// One caller: hello, then requests until it closes or asks to stop.
fn session(
    channel: UnixStream,
    vm: &mut Option<Vm>,
    listener: &mut Option<UnixListener>,
    armed: &mut bool,
    stopped: &Sender<StopReason>,
) -> Result<Ended, String> {
    let mut chan = Channel::new(channel);
    let first = match chan.recv() {
        Ok(Some((l, _))) => l,
        _ => return Ok(Ended::Closed),
    };
    match serde_json::from_str::<Request>(&first) {
        Ok(Request::Hello { version }) if version == VERSION => send(
            &chan,
            &Reply::Hello {
                version: VERSION,
                pid: std::process::id(),
                vm: vm.as_ref().map(|v| v.id().to_string()),
            },
            &[],
        )?,
        Ok(Request::Hello { version }) => {
            return refuse(
                &chan,
                format!(
                    "the caller speaks channel version {version}, this VM process speaks version {VERSION}: refused"
                ),
            );
        }
        _ => return refuse(&chan, "the first request on the channel must be hello".into()),
    }
    loop {
        let (line, fds) = match chan.recv() {
            Ok(Some(m)) => m,
            _ => break,
        };
        let _serving = SERVING.lock().unwrap_or_else(|p| p.into_inner());
        let req = match serde_json::from_str::<Request>(&line) {
            Ok(r) => r,
            Err(e) => {
                send(
                    &chan,
                    &Reply::Error {
                        message: format!("{UNKNOWN_REQUEST}: {e}"),
                    },
                    &[],
                )?;
                continue;
            }
        };
        let stop = matches!(req, Request::Stop);
        let (reply, out) =
            handle(vm, listener, req, fds).unwrap_or_else(|message| (Reply::Error { message }, Vec::new()));
        if let Some(v) = vm.as_ref() {
            arm(v, armed, stopped);
        }
        let raw: Vec<_> = out.iter().map(|f| f.as_raw_fd()).collect();
        // A caller gone before its reply: the next one will ask again.
        if send(&chan, &reply, &raw).is_err() && !stop {
            return Ok(Ended::Closed);
        }
        if stop {
            return Ok(Ended::Stop);
        }
    }
    Ok(Ended::Closed)
}

/// The VM, or the sentence for a request that needs one before `build`.
/// The most of its own smaps it reads (a VM process maps a few hundred
/// ranges: tens of KiB).
const MAX_SMAPS: usize = 16 << 20;

/// This process's smaps, through the descriptor its jail kept open
/// (`jail::own_smaps`): read from the start each time, it is the current
/// text.
fn read_own_smaps() -> Result<String, String> {
    use std::os::unix::fs::FileExt;
    let f = crate::jail::own_smaps().ok_or("this VM process has no smaps of its own open (it was not jailed)")?;
    let mut buf = vec![0u8; 256 << 10];
    let mut len = 0;
    loop {
        if len == buf.len() {
            if buf.len() >= MAX_SMAPS {
                return Err(format!("its smaps is over {} MiB", MAX_SMAPS >> 20));
            }
            buf.resize(buf.len() * 2, 0);
        }
        match f.read_at(&mut buf[len..], len as u64) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("cannot read its own smaps: {e}")),
        }
    }
    buf.truncate(len);
    String::from_utf8(buf).map_err(|_| "its smaps is not text".to_string())
}

fn built(vm: &mut Option<Vm>) -> Result<&mut Vm, String> {
    vm.as_mut()
        .ok_or_else(|| "there is no VM in this process yet: build it first".to_string())
}

/// Descriptors a reply carries (a fork instant's memfds).
type Fds = Vec<std::sync::Arc<std::fs::File>>;

/// Takes a listening socket handed over with a build request, when this
/// process has none yet (a spare's).
fn take_listener(listener: &mut Option<UnixListener>, fd: Option<OwnedFd>) -> Result<(), String> {
    match (fd, listener.is_some()) {
        (Some(_), true) => Err("this VM process has its listening socket already".into()),
        (Some(fd), false) => {
            *listener = Some(UnixListener::from(fd));
            Ok(())
        }
        (None, _) => Ok(()),
    }
}

/// The sentence for a config a VM process cannot build.
fn check_kind(config: &crate::config::VmConfig) -> Result<(), String> {
    config.validate_handed().map_err(|e| e.to_string())
}

/// Splits the descriptors of a build: `files.len()` host files (each named
/// by `files`), then at most one listening socket.
fn split_files(
    files: &[FileRole],
    mut fds: Vec<OwnedFd>,
    what: &str,
) -> Result<(Vec<std::fs::File>, Option<OwnedFd>), String> {
    if fds.len() != files.len() && fds.len() != files.len() + 1 {
        return Err(format!(
            "{what} names {} files but came with {} descriptors",
            files.len(),
            fds.len()
        ));
    }
    let listen = (fds.len() > files.len()).then(|| fds.pop()).flatten();
    Ok((fds.into_iter().map(std::fs::File::from).collect(), listen))
}

/// The options of a VM whose files were handed over; its own log, when
/// handed, becomes this process's standard error first.
fn handed_options(
    files: &[FileRole],
    opened: Vec<std::fs::File>,
    serial_log: Option<std::path::PathBuf>,
) -> Result<VmOptions, String> {
    let handed = HandedFiles::new(files, opened)?;
    if let Some(log) = handed.take(FileRole::ProcessLog) {
        crate::sys::redirect_stderr(&log).map_err(|e| format!("cannot write to its own log: {e}"))?;
    }
    Ok(VmOptions {
        serial_log,
        files: HostFiles::Handed(std::sync::Arc::new(handed)),
        ..VmOptions::default()
    })
}

fn handle(
    vm: &mut Option<Vm>,
    listener: &mut Option<UnixListener>,
    req: Request,
    mut fds: Vec<OwnedFd>,
) -> Result<(Reply, Fds), String> {
    match req {
        Request::Build {
            id,
            config,
            files,
            serial_log,
            node,
        } => {
            if vm.is_some() {
                return Err("this VM process already holds its VM".into());
            }
            check_kind(&config)?;
            let (opened, listen) = split_files(&files, fds, "the build")?;
            let mut opts = handed_options(&files, opened, serial_log)?;
            opts.node = node;
            let built = Vm::new(&id, &config, &opts).map_err(|e| e.to_string())?;
            take_listener(listener, listen)?;
            *vm = Some(built);
            Ok((Reply::Ok, Vec::new()))
        }
        Request::Capture => capture(vm, Vec::new()),
        Request::CaptureDisks { disks, bases } => {
            let overlays = overlay_files(disks, bases, fds)?;
            capture(vm, overlays)
        }
        Request::CaptureLive { disks, bases } => {
            let t = std::time::Instant::now();
            let overlays = overlay_files(disks, bases, fds)?;
            let v = built(vm)?;
            let running = matches!(v.state(), crate::vstate::vm::VmState::Running);
            if running {
                v.pause(Duration::from_secs(2)).map_err(|e| e.to_string())?;
            }
            let pause_us = micros(t.elapsed());
            let got = capture(vm, overlays);
            if running {
                let resumed = built(vm)?.resume().map_err(|e| e.to_string());
                if let Err(r) = resumed {
                    return Err(match got {
                        Ok(_) => format!("its fork instant was exported, but it cannot resume: {r}"),
                        Err(e) => format!("{e}; resuming it afterwards failed too: {r}"),
                    });
                }
            }
            let (mut reply, out) = got?;
            if let Reply::Captured {
                pause_us: p,
                still_us: s,
                ..
            } = &mut reply
            {
                *p = Some(pause_us);
                *s = Some(micros(t.elapsed()));
            }
            Ok((reply, out))
        }
        Request::SnapshotParts => {
            let p = built(vm)?.snapshot_parts().map_err(|e| e.to_string())?;
            let state = serde_json::to_string(&p.state).map_err(|e| e.to_string())?;
            let (diverged, fds) = match p.ram {
                crate::vstate::snapshot::SnapshotRam::Whole(ram) => (None, vec![ram]),
                crate::vstate::snapshot::SnapshotRam::Forked { base, delta, words } => {
                    (Some(words), vec![base, std::sync::Arc::new(delta)])
                }
            };
            Ok((Reply::SnapshotParts { state, diverged }, fds))
        }
        Request::BuildFork {
            id,
            config,
            state,
            diverged,
            files,
            serial_log,
            disks,
        } => {
            if vm.is_some() {
                return Err("this VM process already holds its VM".into());
            }
            if fds.len() < 2 {
                return Err(format!(
                    "a fork child takes its base and diverged pages, not {} descriptors",
                    fds.len()
                ));
            }
            let rest = fds.split_off(2);
            let (delta, base) = match (fds.pop(), fds.pop()) {
                (Some(d), Some(b)) => (d, b),
                _ => return Err("a fork child takes its base and diverged pages".into()),
            };
            check_kind(&config)?;
            let (opened, listen) = split_files(&files, rest, "the fork child")?;
            let opts = handed_options(&files, opened, serial_log)?;
            let state: crate::vstate::persist::MachineState =
                serde_json::from_str(&state).map_err(|e| format!("the fork instant's state is unreadable: {e}"))?;
            let received = crate::vstate::fork::Received {
                state: &state,
                base: std::fs::File::from(base),
                delta: std::fs::File::from(delta),
                words: &diverged,
                disks: &disks,
            };
            let child = Vm::from_export(&id, &config, &opts, received).map_err(|e| e.to_string())?;
            take_listener(listener, listen)?;
            *vm = Some(child);
            Ok((Reply::Ok, Vec::new()))
        }
        Request::BuildRestored {
            id,
            config,
            state,
            files,
            serial_log,
            node,
        } => {
            if vm.is_some() {
                return Err("this VM process already holds its VM".into());
            }
            if fds.is_empty() {
                return Err("a restored VM takes its guest RAM's memfd first".into());
            }
            let rest = fds.split_off(1);
            let ram = fds.pop().ok_or("a restored VM takes its guest RAM's memfd first")?;
            check_kind(&config)?;
            let (opened, listen) = split_files(&files, rest, "the restored VM")?;
            let mut opts = handed_options(&files, opened, serial_log)?;
            opts.node = node;
            let state: crate::vstate::persist::MachineState =
                serde_json::from_str(&state).map_err(|e| format!("the snapshot's state is unreadable: {e}"))?;
            let restored =
                Vm::restore_handed(&id, &config, &opts, &state, std::fs::File::from(ram)).map_err(|e| e.to_string())?;
            take_listener(listener, listen)?;
            *vm = Some(restored);
            Ok((Reply::Ok, Vec::new()))
        }
        Request::Medium { disk, path } => {
            let opened = match (fds.len(), &path) {
                (0, None) => None,
                (1, Some(_)) => fds.pop().map(std::fs::File::from),
                (n, _) => {
                    return Err(format!(
                        "a medium change takes its file with its path, one each, not {n} descriptors for {}",
                        if path.is_some() { "a path" } else { "no path" }
                    ));
                }
            };
            let index = usize::try_from(disk).unwrap_or(usize::MAX);
            built(vm)?
                .change_medium_to(index, path.as_deref(), opened)
                .map_err(|e| e.to_string())?;
            Ok((Reply::Ok, Vec::new()))
        }
        other => handle_plain(vm, other).map(|r| (r, Vec::new())),
    }
}

/// The overlay files of a capture of read-write disks `disks`: two per
/// disk, and with `bases` a third (the image opened again read-only).
fn overlay_files(
    disks: Vec<u16>,
    bases: bool,
    fds: Vec<OwnedFd>,
) -> Result<Vec<crate::vstate::fork::OverlayFiles>, String> {
    let each = if bases { 3 } else { 2 };
    if fds.len() != disks.len().saturating_mul(each) {
        return Err(format!(
            "a capture of {} read-write disk(s) takes {each} files each, not {} descriptors",
            disks.len(),
            fds.len()
        ));
    }
    let mut files = fds.into_iter().map(std::fs::File::from);
    Ok(disks
        .into_iter()
        .map(|disk| crate::vstate::fork::OverlayFiles {
            disk,
            own: files.next(),
            child: files.next().expect("files per disk counted above"),
            base: if bases { files.next() } else { None },
        })
        .collect())
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// The fork instant of the VM in `vm` ([`Vm::export_capture`]) as its
/// reply: the base and the diverged-pages memfds ride along.
fn capture(
    vm: &mut Option<Vm>,
    overlays: Vec<crate::vstate::fork::OverlayFiles>,
) -> Result<(Reply, Vec<std::sync::Arc<std::fs::File>>), String> {
    let e = built(vm)?.export_capture(overlays).map_err(|e| e.to_string())?;
    let state = serde_json::to_string(&e.state).map_err(|e| e.to_string())?;
    Ok((
        Reply::Captured {
            state,
            diverged: e.words,
            disks: e.disks,
            pause_us: None,
            still_us: None,
        },
        vec![e.base, std::sync::Arc::new(e.delta)],
    ))
}

fn handle_plain(vm: &mut Option<Vm>, req: Request) -> Result<Reply, String> {
    match req {
        Request::Hello { .. } => Err("hello was already said".into()),
        Request::Capture
        | Request::CaptureDisks { .. }
        | Request::CaptureLive { .. }
        | Request::SnapshotParts
        | Request::BuildFork { .. }
        | Request::Build { .. }
        | Request::BuildRestored { .. }
        | Request::Medium { .. } => Err("handled above".into()),
        Request::Start => built(vm)?.start().map(|()| Reply::Ok).map_err(|e| e.to_string()),
        Request::Rebase => built(vm)?
            .rebase(Duration::from_secs(2))
            .map(Reply::Rebased)
            .map_err(|e| e.to_string()),
        Request::Divergence => {
            let v = built(vm)?;
            let live = matches!(
                v.state(),
                crate::vstate::vm::VmState::Running | crate::vstate::vm::VmState::Paused
            );
            let pages = match v.has_been_forked() && live {
                true => Some(v.divergence().map_err(|e| e.to_string())?),
                false => None,
            };
            Ok(Reply::Divergence { pages })
        }
        Request::Pause => built(vm)?
            .pause(Duration::from_secs(2))
            .map(|()| Reply::Ok)
            .map_err(|e| e.to_string()),
        Request::Resume => built(vm)?.resume().map(|()| Reply::Ok).map_err(|e| e.to_string()),
        Request::Peek { addr, count } => {
            let v = built(vm)?;
            if count > MAX_PEEK_WORDS {
                return Err(format!("peek reads at most {MAX_PEEK_WORDS} words, not {count}"));
            }
            let words = (0..u64::from(count))
                .map(|i| {
                    let at = addr.checked_add(i * 4).ok_or("the address overflows")?;
                    v.memory()
                        .read_obj::<u32>(GuestAddress(at))
                        .map_err(|e| format!("cannot read guest RAM at {at:#x}: {e}"))
                })
                .collect::<Result<_, String>>()?;
            Ok(Reply::Peeked { words })
        }
        Request::GuestRam => {
            built(vm)?;
            let text = read_own_smaps()?;
            let u = crate::daemon::ram_usage::of_vm_process_smaps(&text);
            let all = crate::daemon::ram_usage::of_whole_smaps(&text);
            Ok(Reply::GuestRam {
                resident: u.resident,
                copied: u.copied,
                pss: u.pss,
                process_rss: all.resident,
                process_pss: all.pss,
            })
        }
        Request::Status => {
            let v = built(vm)?;
            let started = v.started_at();
            Ok(Reply::Status(crate::vmproc::proto::VmStatus {
                state: v.state(),
                exits: v.control().exit_count(),
                ms_since_start: started.map(|s| s.elapsed().as_millis() as u64),
                first_exit_us_after_start: match (started, v.control().first_exit()) {
                    (Some(s), Some(f)) => Some(f.saturating_duration_since(s).as_micros() as u64),
                    _ => None,
                },
                devices: v.devices().to_vec(),
                rng_reseed: Some(v.rng_reseed()),
                vmgenid: v.generation_id().map(|g| crate::arch::x86_64::vmgenid::hex(&g)),
                rebases: v.rebases(),
                exits_by_reason: v.exits_by_reason(),
                device_counters: v.device_counters(),
            }))
        }
        Request::Stop => {
            if let Some(mut v) = vm.take() {
                v.stop();
            }
            Ok(Reply::Ok)
        }
    }
}
