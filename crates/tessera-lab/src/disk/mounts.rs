//! The host's side of the emulated disks: a command's process made to see the views at the
//! paths they show (a mount namespace of its own, each view bound over its source), and the
//! views a lab whose process died left mounted, found and unmounted.

use std::path::{Path, PathBuf};

use super::emulated::{c_path, MountedView, FS_NAME};

/// Makes `cmd`'s process see `views` at their sources: a mount namespace of its own (private,
/// so nothing propagates back) with each view bound over the directory it shows.
///
/// Every view's root is opened by its mount point before any is bound: a mount point may lie
/// inside another view's source (the views are mounted in the temp directory, and `lab exec
/// -- env X=1 /tmp/tessera …` shows `/tmp`), and once that view is bound, the path leads into
/// it instead, so the inner view's reads went through the outer one, whose disk thread then
/// waited on its own queue (the command hung in the kernel). Outer sources are bound before
/// the sources inside them, which a later outer bind would hide; and the command re-enters
/// its working directory by name, so one started inside a viewed directory reads through it.
pub fn bind_in_child(
    cmd: &mut std::process::Command,
    views: &[MountedView],
) -> crate::error::Result<()> {
    use std::os::unix::process::CommandExt as _;
    if views.is_empty() {
        return Ok(());
    }
    let c = |p: &Path| {
        c_path(p).map_err(|_| crate::error::LabError::Spec(format!("{} has a NUL", p.display())))
    };
    let mut ordered: Vec<&MountedView> = views.iter().collect();
    ordered.sort_by_key(|v| v.source.components().count());
    let binds = ordered
        .iter()
        .map(|v| Ok((c(&v.mount_point)?, c(&v.source)?)))
        .collect::<crate::error::Result<Vec<_>>>()?;
    let mut roots: Vec<libc::c_int> = vec![-1; binds.len()];
    let mut cwd: Vec<u8> = vec![0; libc::PATH_MAX as usize + 1];
    // SAFETY: between fork and exec the closure makes only system calls, on strings and
    // buffers made before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fail = || Err(std::io::Error::last_os_error());
            let here = !libc::getcwd(cwd.as_mut_ptr().cast(), cwd.len()).is_null();
            // A directory with no name (deleted) is returned to by a descriptor instead.
            let start = if here {
                -1
            } else {
                libc::open(c".".as_ptr(), libc::O_PATH | libc::O_CLOEXEC)
            };
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return fail();
            }
            let none = std::ptr::null();
            if libc::mount(
                c"none".as_ptr(),
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                none.cast(),
            ) != 0
            {
                return fail();
            }
            for ((view, _), root) in binds.iter().zip(roots.iter_mut()) {
                *root = libc::open(
                    view.as_ptr(),
                    libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
                );
                if *root < 0 {
                    return fail();
                }
            }
            for ((_, source), &root) in binds.iter().zip(&roots) {
                // The view's root is the working directory for a moment: "." names it.
                if libc::fchdir(root) != 0
                    || libc::mount(
                        c".".as_ptr(),
                        source.as_ptr(),
                        none,
                        libc::MS_BIND,
                        none.cast(),
                    ) != 0
                {
                    return fail();
                }
                libc::close(root);
            }
            let back = if here {
                libc::chdir(cwd.as_ptr().cast())
            } else {
                libc::fchdir(start)
            };
            if back != 0 {
                return fail();
            }
            Ok(())
        });
    }
    Ok(())
}

/// The mount points of views left mounted (by a lab whose process died): from
/// `/proc/self/mountinfo`, those mounted with [`FS_NAME`].
pub fn leftover_views() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    super::device::parse_mountinfo(&text)
        .into_iter()
        .filter(|m| m.source == FS_NAME)
        .map(|m| m.mount_point)
        .collect()
}

/// Unmounts a view left mounted and removes its directory.
pub fn unmount_leftover(mount_point: &Path) -> std::io::Result<()> {
    let c = c_path(mount_point)?;
    // SAFETY: a valid C string; a lazy unmount touches nothing of ours.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    std::fs::remove_dir(mount_point)
}
