//! Which block device holds a path, as the I/O throttle names it.
//!
//! The throttle takes rules for whole disks only (a partition's `major:minor` is refused), so
//! a path on `/dev/vda1` is capped on `vda`. File systems without a device of their own
//! (overlay, btrfs subvolumes, which report an anonymous `0:N`) are followed through
//! `/proc/self/mountinfo`: an overlay to its upper directory (where the host writes), any
//! other to its mount source. Device-mapper and md devices are kept as they are: they are
//! disks of their own to the throttle. Memory-backed file systems (tmpfs) have no disk to cap.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use crate::error::{LabError, Result};

/// A block device number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct DevId {
    pub major: u32,
    pub minor: u32,
}

impl DevId {
    pub fn new(major: u32, minor: u32) -> Self {
        Self { major, minor }
    }

    /// Splits a `dev_t` as glibc's `major()`/`minor()` do.
    pub fn from_dev_t(dev: u64) -> Self {
        Self {
            major: (((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff)) as u32,
            minor: ((dev & 0xff) | ((dev >> 12) & !0xff)) as u32,
        }
    }

    fn parse(s: &str) -> Option<Self> {
        let (a, b) = s.trim().split_once(':')?;
        Some(Self::new(a.parse().ok()?, b.parse().ok()?))
    }
}

impl std::fmt::Display for DevId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.major, self.minor)
    }
}

/// The disk a path was resolved to, and how.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockDevice {
    pub id: DevId,
    /// The kernel's name for it (`vda`).
    pub name: String,
    /// The steps from the path to it, for the selftest to print.
    pub how: String,
}

/// One line of `/proc/self/mountinfo`, the fields used here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub dev: DevId,
    pub mount_point: PathBuf,
    pub fs_type: String,
    pub source: String,
    pub super_options: String,
}

/// Parses `/proc/self/mountinfo` (fields: id, parent, major:minor, root, mount point, options,
/// optional fields…, `-`, type, source, super options); lines it cannot read are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (head, tail) = line.split_once(" - ")?;
            let head: Vec<&str> = head.split(' ').collect();
            let mut tail = tail.split(' ');
            Some(Mount {
                dev: DevId::parse(head.get(2)?)?,
                mount_point: PathBuf::from(unescape(head.get(4)?)),
                fs_type: tail.next()?.to_string(),
                source: unescape(tail.next()?),
                super_options: tail.next().unwrap_or_default().to_string(),
            })
        })
        .collect()
}

/// mountinfo writes space, tab, newline and backslash as octal escapes (`\040`).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount holding `path` (absolute, canonical): the last one listed whose mount point is
/// its longest prefix (later mounts hide earlier ones at the same point).
pub fn mount_of<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    let mut best: Option<&Mount> = None;
    for m in mounts.iter().filter(|m| path.starts_with(&m.mount_point)) {
        let longer = best.is_none_or(|b| {
            m.mount_point.components().count() >= b.mount_point.components().count()
        });
        if longer {
            best = Some(m);
        }
    }
    best
}

/// `upperdir=` of an overlay's super options.
fn overlay_upper(super_options: &str) -> Option<PathBuf> {
    super_options
        .split(',')
        .find_map(|o| o.strip_prefix("upperdir="))
        .map(PathBuf::from)
}

fn sys_block(id: DevId) -> PathBuf {
    PathBuf::from(format!("/sys/dev/block/{id}"))
}

/// The block device holding `path`, resolved to the whole disk the throttle caps.
pub fn device_of(path: &Path) -> Result<BlockDevice> {
    let path = path
        .canonicalize()
        .map_err(|e| LabError::io(format!("resolving {}", path.display()), e))?;
    resolve(&path, 0)
}

fn resolve(path: &Path, depth: usize) -> Result<BlockDevice> {
    if depth > 8 {
        return Err(LabError::Spec(format!(
            "{}: too many file systems stacked to find its disk",
            path.display()
        )));
    }
    let meta = std::fs::metadata(path)
        .map_err(|e| LabError::io(format!("reading {}", path.display()), e))?;
    let id = DevId::from_dev_t(meta.dev());
    if sys_block(id).exists() {
        return whole_disk(id, format!("{} is on {id}", path.display()));
    }
    // No block device of its own: follow the mount.
    let text = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| LabError::io("reading /proc/self/mountinfo", e))?;
    let mounts = parse_mountinfo(&text);
    let m = mount_of(&mounts, path)
        .ok_or_else(|| LabError::Spec(format!("{}: no mount holds it", path.display())))?;
    let via = format!(
        "{} is on {} ({} from {:?})",
        path.display(),
        m.mount_point.display(),
        m.fs_type,
        m.source
    );
    if m.fs_type == "overlay" {
        let upper = overlay_upper(&m.super_options).ok_or_else(|| {
            LabError::Spec(format!("{via}: an overlay without an upper directory"))
        })?;
        let mut d = resolve(&upper, depth + 1)?;
        d.how = format!("{via}, upper directory {}; {}", upper.display(), d.how);
        return Ok(d);
    }
    if m.source.starts_with("/dev/") {
        let rdev = std::fs::metadata(&m.source)
            .map_err(|e| LabError::io(format!("reading {}", m.source), e))?
            .rdev();
        let id = DevId::from_dev_t(rdev);
        if sys_block(id).exists() {
            return whole_disk(id, format!("{via}, {} is {id}", m.source));
        }
    }
    Err(LabError::NoBlockDevice {
        path: path.to_path_buf(),
        via,
    })
}

/// A partition's whole disk (its parent in sysfs), or the device itself.
fn whole_disk(id: DevId, how: String) -> Result<BlockDevice> {
    let sys = sys_block(id)
        .canonicalize()
        .map_err(|e| LabError::io(format!("resolving {}", sys_block(id).display()), e))?;
    let name_of = |p: &Path| {
        p.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    if !sys.join("partition").exists() {
        return Ok(BlockDevice {
            id,
            name: name_of(&sys),
            how: format!("{how} ({}, a whole disk)", name_of(&sys)),
        });
    }
    let parent = sys
        .parent()
        .ok_or_else(|| LabError::Spec(format!("partition {id} has no parent disk in sysfs")))?;
    let dev = std::fs::read_to_string(parent.join("dev"))
        .map_err(|e| LabError::io(format!("reading {}/dev", parent.display()), e))?;
    let disk = DevId::parse(&dev)
        .ok_or_else(|| LabError::Spec(format!("{}/dev: {dev:?}", parent.display())))?;
    Ok(BlockDevice {
        id: disk,
        name: name_of(parent),
        how: format!(
            "{how}, partition {} of {} ({disk}): the throttle caps whole disks",
            name_of(&sys),
            name_of(parent)
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw,discard
30 22 0:26 / /tmp rw,nosuid shared:9 - tmpfs tmpfs rw,size=100k
31 22 0:40 / /var/lib/x rw master:3 - overlay overlay rw,lowerdir=/l,upperdir=/u/up,workdir=/u/w
32 22 8:1 / /mnt/my\\040disk rw - ext4 /dev/sda1 rw
33 22 8:2 / /mnt/my\\040disk/inner rw - xfs /dev/sda2 rw
";

    #[test]
    fn dev_t_splits_as_glibc_does() {
        assert_eq!(DevId::from_dev_t(0xfe00), DevId::new(254, 0));
        assert_eq!(DevId::from_dev_t(0x0801), DevId::new(8, 1));
        // Large numbers keep their high bits above glibc's makedev layout.
        let makedev = |ma: u64, mi: u64| {
            ((ma & 0xfff) << 8) | ((ma & !0xfff) << 32) | (mi & 0xff) | ((mi & !0xff) << 12)
        };
        assert_eq!(
            DevId::from_dev_t(makedev(0x1234abc, 0x5678)),
            DevId::new(0x1234abc, 0x5678)
        );
    }

    #[test]
    fn mountinfo_lines_give_device_type_source_and_options() {
        let m = parse_mountinfo(MOUNTINFO);
        assert_eq!(m.len(), 5);
        assert_eq!(m[0].dev, DevId::new(254, 0));
        assert_eq!(m[0].source, "/dev/vda");
        assert_eq!(m[2].fs_type, "overlay");
        assert_eq!(overlay_upper(&m[2].super_options), Some("/u/up".into()));
        assert_eq!(m[3].mount_point, PathBuf::from("/mnt/my disk"));
        assert!(parse_mountinfo("garbage\n1 2 3\n").is_empty());
    }

    #[test]
    fn a_path_belongs_to_its_longest_mount_point() {
        let m = parse_mountinfo(MOUNTINFO);
        let at = |p: &str| mount_of(&m, Path::new(p)).map(|m| m.mount_point.clone());
        assert_eq!(at("/home/x"), Some("/".into()));
        assert_eq!(at("/tmp/a/b"), Some("/tmp".into()));
        assert_eq!(
            at("/tmpx"),
            Some("/".into()),
            "a prefix of a name is not a parent"
        );
        assert_eq!(
            at("/mnt/my disk/inner/f"),
            Some("/mnt/my disk/inner".into())
        );
        assert_eq!(at("/mnt/my disk/f"), Some("/mnt/my disk".into()));
    }

    #[test]
    fn this_machines_temp_dir_resolves_to_a_whole_disk_or_says_why_not() {
        match device_of(&std::env::temp_dir()) {
            Ok(d) => {
                assert!(Path::new(&format!("/sys/dev/block/{}", d.id)).exists());
                assert!(!Path::new(&format!("/sys/dev/block/{}/partition", d.id)).exists());
            }
            // A memory file system, say: the one refusal the lab expects of a temp dir.
            Err(LabError::NoBlockDevice { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
}
