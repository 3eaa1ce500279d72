//! Small file-system helpers: atomic file replacement, directory sync, the store lock.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::error::{io_at, Error, ErrorKind, Result};

/// The kernel's id of the running boot (`/proc/sys/kernel/random/boot_id`, a UUID), or
/// zeros where it cannot be read.
pub fn boot_id() -> [u8; 16] {
    let mut id = [0u8; 16];
    let Ok(text) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else { return id };
    let hex: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
    if hex.len() != 32 {
        return [0; 16];
    }
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).unwrap_or("00");
        id[i] = u8::from_str_radix(s, 16).unwrap_or(0);
    }
    id
}

/// Makes a directory's entries (creates, renames, removes) durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_at("cannot sync directory", dir, e))
}

/// Replaces `path` with `bytes` so that a crash leaves either the old or the new file whole.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        let mut f = File::create(&tmp).map_err(|e| io_at("cannot create", &tmp, e))?;
        f.write_all(bytes).map_err(|e| io_at("cannot write", &tmp, e))?;
        f.sync_all().map_err(|e| io_at("cannot sync", &tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| io_at("cannot rename into place", path, e))?;
    sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Takes the exclusive lock of a store directory, or fails at once.
pub fn lock_exclusive(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| io_at("cannot open lock file", path, e))?;
    // A lock this very process holds may be on its way out: a child forked by another
    // thread keeps the lock's descriptor until it execs (or exits), so a store just
    // closed here can look locked for a moment. Wait for that briefly; another
    // process's lock fails at once.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        // SAFETY: flock on a descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let holder = std::fs::read_to_string(path).unwrap_or_default();
            if holder.trim() == std::process::id().to_string() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
                continue;
            }
            return Err(Error::new(
                ErrorKind::Locked,
                format!(
                    "store {} is in use by another process or handle{}",
                    path.parent().unwrap_or(path).display(),
                    if holder.trim().is_empty() { String::new() } else { format!(" (pid {})", holder.trim()) }
                ),
            ));
        }
        return Err(io_at("cannot lock", path, e));
    }
    let _ = file.set_len(0);
    let _ = (&file).write_all(std::process::id().to_string().as_bytes());
    Ok(file)
}

/// Backs bytes `[from, to)` of a file with blocks of its file system and extends the
/// file to at least `to` (`fallocate`), so stores through a mapping of that range never
/// meet an unbacked page: on a full disk that would be SIGBUS, here it is an `Io` error
/// naming the file and saying "no space left on device", returned to the call that
/// needed the space. File systems without `fallocate` get a plain `ftruncate` (sparse;
/// the old behaviour) and a warning.
pub fn allocate(file: &File, path: &Path, from: u64, to: u64) -> Result<()> {
    if to <= from {
        return Ok(());
    }
    loop {
        // SAFETY: fallocate on a descriptor we own; mode 0 allocates and extends.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, from as libc::off_t, (to - from) as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EOPNOTSUPP) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        path = %path.display(),
                        "file system cannot fallocate: mapped files are sparse, and a full disk may kill the process"
                    )
                });
                if file.metadata().map(|m| m.len() < to).unwrap_or(true) {
                    file.set_len(to).map_err(|e| io_at("cannot grow", path, e))?;
                }
                return Ok(());
            }
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
                return Err(Error::io(
                    format!("no space left on device for {} (growing it to {to} bytes)", path.display()),
                    e,
                ))
            }
            _ => return Err(io_at("cannot allocate space for", path, e)),
        }
    }
}

/// Backs bytes `[from, to)` of a file that reads as zeros there (a hole: nothing was
/// written) by writing zeros to them. As with [`allocate`], the file system takes the
/// space now, so later stores through a mapping of the range never meet an unbacked page
/// and a full disk is an `Io` error here ("no space left on device"), not SIGBUS. Unlike
/// `fallocate`, a file system that allocates at write-back (ext4, XFS: delayed
/// allocation) lays out pieces written in any order as few extents: an index whose
/// 64 KiB chunks were backed in random order took 2,048 extents with `fallocate` (and
/// twice the CPU to write back), 2 this way.
pub fn zero_fill(file: &File, path: &Path, from: u64, to: u64) -> Result<()> {
    use std::os::unix::fs::FileExt;
    const ZEROS_BYTES: usize = 64 << 10;
    static ZEROS: [u8; ZEROS_BYTES] = [0; ZEROS_BYTES];
    let mut at = from;
    while at < to {
        let n = (to - at).min(ZEROS_BYTES as u64) as usize;
        if let Err(e) = file.write_all_at(&ZEROS[..n], at) {
            return Err(match e.raw_os_error() {
                Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
                    Error::io(format!("no space left on device for {} (writing bytes {at}..{to})", path.display()), e)
                }
                _ => io_at("cannot write zeros to", path, e),
            });
        }
        at += n as u64;
    }
    Ok(())
}

/// True when sparse mapped files are safe and cheap on `file`'s file system: reading a
/// hole through a shared mapping takes no space, and `SEEK_HOLE`/`SEEK_DATA` tell holes
/// from data (ext4, XFS, btrfs, f2fs, ZFS, bcachefs). Elsewhere mapped files are
/// allocated whole: on tmpfs every read fault of a hole takes a page of the file
/// system's size (SIGBUS when it is full), and a file system that cannot tell holes
/// would hide the parts of a file still to be backed.
pub fn sparse_files_ok(file: &File) -> bool {
    // SAFETY: statfs is plain data; fstatfs fills it for a descriptor we own.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatfs(file.as_raw_fd(), &mut s) } != 0 {
        return false;
    }
    const EXT4: u64 = 0xEF53;
    const XFS: u64 = 0x5846_5342;
    const BTRFS: u64 = 0x9123_683E;
    const F2FS: u64 = 0xF2F5_2010;
    const ZFS: u64 = 0x2FC1_2FC1;
    const BCACHEFS: u64 = 0xCA45_1A4E;
    matches!(s.f_type as u64, EXT4 | XFS | BTRFS | F2FS | ZFS | BCACHEFS)
}

/// Where the first data of `file` at or after `from` and before `to` lies (`SEEK_DATA`);
/// `None` when there is none, `from` itself where the file system cannot say.
pub fn next_data(file: &File, from: u64, to: u64) -> Option<u64> {
    // SAFETY: lseek on a descriptor we own.
    let at = unsafe { libc::lseek(file.as_raw_fd(), from as libc::off_t, libc::SEEK_DATA) };
    if at < 0 {
        return if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) { None } else { Some(from) };
    }
    ((at as u64) < to).then_some(at as u64)
}
