//! The VM process's side of the channel (`k7d vm-process`, after its
//! jail): the hello, then one VM built, run and stopped on request. The
//! channel closing stops the VM (re-attaching to a new caller is not built
//! yet).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use super::proto::{Reply, Request, VERSION};
use crate::config::GuestSpec;
use crate::{Vm, VmOptions};

/// Most words one `peek` reads.
pub const MAX_PEEK_WORDS: u32 = 1024;

/// Serves `channel` until it closes or a `stop` (module docs). Every
/// request gets one reply; a bad line gets an error reply and is otherwise
/// ignored.
pub fn serve(channel: UnixStream) -> Result<(), String> {
    let mut out = channel
        .try_clone()
        .map_err(|e| format!("cannot use the channel: {e}"))?;
    let mut lines = BufReader::new(channel).lines();
    let mut send = |r: &Reply| -> Result<(), String> {
        let mut line = serde_json::to_string(r).map_err(|e| e.to_string())?;
        line.push('\n');
        out.write_all(line.as_bytes())
            .map_err(|e| format!("the channel closed: {e}"))
    };
    // The hello first.
    let first = match lines.next() {
        Some(Ok(l)) => l,
        _ => return Ok(()),
    };
    match serde_json::from_str::<Request>(&first) {
        Ok(Request::Hello { version }) if version == VERSION => send(&Reply::Hello {
            version: VERSION,
            pid: std::process::id(),
        })?,
        Ok(Request::Hello { version }) => {
            let message = format!(
                "the caller speaks channel version {version}, this VM process speaks version {VERSION}: refused"
            );
            send(&Reply::Error {
                message: message.clone(),
            })?;
            return Err(message);
        }
        _ => {
            let message = "the first request on the channel must be hello".to_string();
            send(&Reply::Error {
                message: message.clone(),
            })?;
            return Err(message);
        }
    }
    let mut vm: Option<Vm> = None;
    for line in lines {
        let Ok(line) = line else { break };
        let req = match serde_json::from_str::<Request>(&line) {
            Ok(r) => r,
            Err(e) => {
                send(&Reply::Error {
                    message: format!("the request is not one this VM process knows: {e}"),
                })?;
                continue;
            }
        };
        let stop = req == Request::Stop;
        let reply = handle(&mut vm, req).unwrap_or_else(|message| Reply::Error { message });
        send(&reply)?;
        if stop {
            return Ok(());
        }
    }
    // The caller is gone: the VM goes with it (for now).
    if let Some(mut v) = vm {
        v.stop();
    }
    Ok(())
}

fn handle(vm: &mut Option<Vm>, req: Request) -> Result<Reply, String> {
    let need = |vm: &mut Option<Vm>| -> Result<(), String> {
        if vm.is_none() {
            return Err("there is no VM in this process yet: build it first".into());
        }
        Ok(())
    };
    match req {
        Request::Hello { .. } => Err("hello was already said".into()),
        Request::Build { id, config } => {
            if vm.is_some() {
                return Err("this VM process already holds its VM".into());
            }
            if !matches!(config.guest, GuestSpec::Builtin { .. }) || config.devices.any() {
                return Err("a VM process runs only a built-in guest without devices so far".into());
            }
            config.validate().map_err(|e| e.to_string())?;
            *vm = Some(Vm::new(&id, &config, &VmOptions::default()).map_err(|e| e.to_string())?);
            Ok(Reply::Ok)
        }
        Request::Start => {
            need(vm)?;
            vm.as_mut().map_or(Ok(()), |v| v.start()).map_err(|e| e.to_string())?;
            Ok(Reply::Ok)
        }
        Request::Pause => {
            need(vm)?;
            vm.as_ref()
                .map_or(Ok(()), |v| v.pause(Duration::from_secs(2)))
                .map_err(|e| e.to_string())?;
            Ok(Reply::Ok)
        }
        Request::Resume => {
            need(vm)?;
            vm.as_ref().map_or(Ok(()), |v| v.resume()).map_err(|e| e.to_string())?;
            Ok(Reply::Ok)
        }
        Request::Peek { addr, count } => {
            need(vm)?;
            if count > MAX_PEEK_WORDS {
                return Err(format!("peek reads at most {MAX_PEEK_WORDS} words, not {count}"));
            }
            let v = vm.as_ref().ok_or("no VM")?;
            let mut words = Vec::with_capacity(count as usize);
            for i in 0..u64::from(count) {
                let at = addr.checked_add(i * 4).ok_or("the address overflows")?;
                words.push(
                    v.memory()
                        .read_obj::<u32>(GuestAddress(at))
                        .map_err(|e| format!("cannot read guest RAM at {at:#x}: {e}"))?,
                );
            }
            Ok(Reply::Peeked { words })
        }
        Request::Status => {
            need(vm)?;
            Ok(Reply::Status {
                status: vm.as_ref().map(|v| v.state().to_string()).unwrap_or_default(),
            })
        }
        Request::Stop => {
            if let Some(mut v) = vm.take() {
                v.stop();
            }
            Ok(Reply::Ok)
        }
    }
}
