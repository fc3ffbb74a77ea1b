//! A TAP (Ethernet) device inside a host's namespace, read and written by the switch in this
//! process. (TAP and not TUN: see [`crate::packet`] for why the lab switches Ethernet.)
//!
//! The device is made by opening `/dev/net/tun` from a thread inside the namespace
//! ([`Netns::run_in`]), so it lives there, while the file descriptor stays with the switch.
//! It is not persistent: when the descriptor closes (the lab ends, or this process dies) the
//! kernel removes the device.

use std::fs::{File, OpenOptions};
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

use crate::error::{LabError, Result};
use crate::netns::{ip, Netns};

/// The device's name inside every host (namespaces keep them apart).
pub const DEVICE: &str = "tlab0";

const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Makes the TAP device in `ns` with MAC address `mac`, gives it `addr/prefix`, `mtu` and a
/// multicast route, brings it up, and turns IPv6 off in the namespace (the lab is IPv4: its
/// addresses, and mDNS's 224.0.0.251). Returns the descriptor frames are read from and
/// written to.
pub fn create(ns: &Netns, mac: [u8; 6], addr: Ipv4Addr, prefix: u8, mtu: u32) -> Result<File> {
    let file = ns.run_in(|| {
        // Without IPv6 the device gets no link-local address and sends no router
        // solicitations: the switch sees only the lab's own traffic.
        for key in ["all", "default"] {
            let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{key}/disable_ipv6"), "1");
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")?;
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI,
            _pad: [0; 22],
        };
        req.name[..DEVICE.len()].copy_from_slice(DEVICE.as_bytes());
        // SAFETY: TUNSETIFF reads and writes one `struct ifreq`, which `IfReq` lays out.
        if unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF as _, &mut req) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(file)
    })?;
    let n = ns.name();
    let cidr = format!("{addr}/{prefix}");
    let mac = mac.map(|b| format!("{b:02x}")).join(":");
    ip(&["-n", n, "link", "set", DEVICE, "address", &mac])?;
    ip(&["-n", n, "addr", "add", &cidr, "dev", DEVICE])?;
    ip(&[
        "-n",
        n,
        "link",
        "set",
        DEVICE,
        "mtu",
        &mtu.to_string(),
        "multicast",
        "on",
        "up",
    ])?;
    ip(&["-n", n, "route", "add", "224.0.0.0/4", "dev", DEVICE])?;
    Ok(file)
}

/// Checks a TAP device can be made here (root, `/dev/net/tun`, `ip`).
pub fn check_supported() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(LabError::Unsupported(
            "not root: network namespaces and TAP devices need root".into(),
        ));
    }
    if !std::path::Path::new("/dev/net/tun").exists() {
        return Err(LabError::Unsupported("no /dev/net/tun".into()));
    }
    match std::process::Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => Ok(()),
        _ => Err(LabError::Unsupported("no `ip` command (iproute2)".into())),
    }
}
