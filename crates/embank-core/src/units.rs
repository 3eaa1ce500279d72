//! Byte counts as people write and read them: `8M` in, `8.0 MiB` out (the planner's
//! options and answers, the command's flags and reports).

/// `4G`, `512M`, `64K` (binary multiples, any case) or a plain number of bytes; a
/// fraction such as `1.5G` is rounded down to whole bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().last() {
        Some((i, c)) if c.eq_ignore_ascii_case(&'k') => (&s[..i], 1u64 << 10),
        Some((i, c)) if c.eq_ignore_ascii_case(&'m') => (&s[..i], 1 << 20),
        Some((i, c)) if c.eq_ignore_ascii_case(&'g') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| *v >= 0.0)
        .map(|v| (v * mul as f64) as u64)
        .ok_or_else(|| format!("not a byte count: {s:?} (use e.g. 2G, 512M, 1048576)"))
}

/// `b` bytes in the largest binary unit under it, one decimal (`1536` is `1.5 KiB`;
/// under 1 KiB, whole bytes: `512 B`).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}
