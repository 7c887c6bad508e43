//! containerd's `runtimeoptions.v1.Options`: what a CRI runtime entry's
//! `[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.NAME.options]`
//! table becomes for a shim that is not runc, handed to the shim with each
//! task's create. Its `ConfigPath` names the shim config of that runtime
//! class (as Kata reads it), so one node can serve a cold, a fork and a
//! pool RuntimeClass through one shim binary.

use std::path::PathBuf;

use anyhow::{Context, bail};
use containerd_shim::protos::protobuf::CodedInputStream;
use containerd_shim::protos::protobuf::rt::WireType;
use containerd_shim::protos::protobuf::well_known_types::any::Any;

/// The message's type, as containerd names it in the `Any`.
const TYPE: &str = "runtimeoptions.v1.Options";
/// `config_path`'s field number.
const CONFIG_PATH: u32 = 2;

/// The runtime class's shim config path in a create's `options`: `None`
/// without options, or for options of another type (a runtime entry's
/// `options` of runc's kind) or without a path. A path that is not
/// absolute, or options that do not decode, are an error.
pub fn config_path(options: Option<&Any>) -> anyhow::Result<Option<PathBuf>> {
    let Some(any) = options else {
        return Ok(None);
    };
    if any.type_url.rsplit('/').next() != Some(TYPE) {
        if !any.type_url.is_empty() {
            tracing::debug!(type_url = %any.type_url, "runtime options of another kind: the node's shim config");
        }
        return Ok(None);
    }
    let mut is = CodedInputStream::from_bytes(&any.value);
    let mut path = None;
    while let Some(tag) = is
        .read_raw_tag_or_eof()
        .context("containerd's runtime options do not decode")?
    {
        let wire = WireType::new(tag & 7).context("containerd's runtime options hold an unknown wire type")?;
        if tag >> 3 == CONFIG_PATH && wire == WireType::LengthDelimited {
            path = Some(
                is.read_string()
                    .context("the runtime options' ConfigPath is not text")?,
            );
        } else {
            is.skip_field(wire)
                .context("containerd's runtime options do not decode")?;
        }
    }
    let Some(p) = path.filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    let p = PathBuf::from(p);
    if !p.is_absolute() {
        bail!(
            "the runtime options' ConfigPath {} is not an absolute path",
            p.display()
        );
    }
    Ok(Some(p))
}

#[cfg(test)]
mod tests {
    use containerd_shim::protos::protobuf::CodedOutputStream;

    use super::*;

    fn options(type_url: &str, fields: &[(u32, &str)]) -> Any {
        let mut value = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut value);
            for (n, s) in fields {
                os.write_string(*n, s).unwrap();
            }
            os.flush().unwrap();
        }
        let mut a = Any::new();
        a.type_url = type_url.into();
        a.value = value;
        a
    }

    #[test]
    fn a_runtime_class_names_its_config_and_nothing_else_does() {
        assert_eq!(config_path(None).unwrap(), None);
        let a = options(
            TYPE,
            &[(1, "io.containerd.k7d.v2"), (CONFIG_PATH, "/etc/k7d/fork.toml")],
        );
        assert_eq!(config_path(Some(&a)).unwrap(), Some("/etc/k7d/fork.toml".into()));
        let a = options(
            &format!("type.googleapis.com/{TYPE}"),
            &[(CONFIG_PATH, "/etc/k7d/pool.toml")],
        );
        assert_eq!(config_path(Some(&a)).unwrap(), Some("/etc/k7d/pool.toml".into()));
        // Unknown fields are skipped; an empty path or none: the node's.
        let a = options(TYPE, &[(3, "body"), (9, "x")]);
        assert_eq!(config_path(Some(&a)).unwrap(), None);
        assert_eq!(config_path(Some(&options(TYPE, &[(CONFIG_PATH, "")]))).unwrap(), None);
        // runc's options (another type) are not k7d's business.
        let a = options("containerd.runc.v1.Options", &[(CONFIG_PATH, "/x")]);
        assert_eq!(config_path(Some(&a)).unwrap(), None);
        let e = format!(
            "{:#}",
            config_path(Some(&options(TYPE, &[(CONFIG_PATH, "k7d.toml")]))).unwrap_err()
        );
        assert!(e.contains("not an absolute path"), "{e}");
        let mut bad = options(TYPE, &[]);
        bad.value = vec![0x12, 0x10, b'/'];
        let e = format!("{:#}", config_path(Some(&bad)).unwrap_err());
        assert!(e.contains("runtime options"), "{e}");
    }
}
