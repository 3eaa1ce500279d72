//! A scratch directory per fuzzing process (on tmpfs when there is one), removed when the
//! process exits normally (libFuzzer ends a timed run with `exit`): a tmpfs keeps what is
//! left in it in memory until the machine restarts. A crash leaves it, beside its input.
use std::path::PathBuf;
use std::sync::OnceLock;

static DIR: OnceLock<PathBuf> = OnceLock::new();

extern "C" fn remove_scratch() {
    if let Some(d) = DIR.get() {
        let _ = std::fs::remove_dir_all(d);
    }
}

pub fn scratch() -> &'static PathBuf {
    DIR.get_or_init(|| {
        let base = if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let d = base.join(format!("embank-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        // SAFETY: registers a plain function with no arguments, run once at exit.
        unsafe { libc::atexit(remove_scratch) };
        d
    })
}
