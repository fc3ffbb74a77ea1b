//! The `TOKEN@HOST:PORT` lines a head (`coordinator`, `serve --nodes-expected`) hands out, and
//! where it puts them.
//!
//! The head writes the address it is bound to, which is useless to a node when the head
//! listens on `0.0.0.0`: in a container, behind a port forward, or on a machine whose name the
//! nodes know better than its address. `--advertise HOST:PORT` names the address nodes dial
//! instead, kept as written so that a name is resolved by each node on its own network (a
//! compose service name resolves only there). `--join-copy PATH` writes the node line to a
//! second file, e.g. on a volume the nodes mount read-only, so they read the line without
//! seeing the head's data directory (its key and the operator token).

use std::fmt::Display;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;

/// `HOST:PORT` for `--advertise`, checked but not resolved.
pub fn parse_advertise(s: &str) -> Result<String, String> {
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s}: expected HOST:PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("{s}: the port is not a number from 1 to 65535"))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.is_empty() || port == 0 {
        return Err(format!("{s}: give the host and port nodes should dial"));
    }
    if bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
        return Err(format!(
            "{s} cannot be dialled: give the host and port nodes should dial"
        ));
    }
    Ok(s.to_string())
}

/// `TOKEN@HOST:PORT`: the advertised address when there is one, else the bound one.
pub fn line(token: impl Display, bound: SocketAddr, advertise: Option<&str>) -> String {
    match advertise {
        Some(a) => format!("{token}@{a}"),
        None => format!("{token}@{bound}"),
    }
}

/// `--join-copy`: the node line, owner-only, replacing any older copy whole.
pub fn write_copy(path: &Path, join: &str) -> anyhow::Result<()> {
    super::up::write_secret(path, &format!("{join}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertise_keeps_names_and_refuses_what_cannot_be_dialled() {
        assert_eq!(parse_advertise("head:7070").unwrap(), "head:7070");
        assert_eq!(parse_advertise("[fd00::1]:7070").unwrap(), "[fd00::1]:7070");
        for bad in [
            "head",
            "head:0",
            ":7070",
            "0.0.0.0:7070",
            "[::]:7070",
            "head:x",
        ] {
            assert!(parse_advertise(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn the_line_names_the_advertised_address_over_the_bound_one() {
        let bound: SocketAddr = "0.0.0.0:7070".parse().unwrap();
        assert_eq!(line("T", bound, Some("head:7070")), "T@head:7070");
        assert_eq!(line("T", bound, None), "T@0.0.0.0:7070");
    }
}
