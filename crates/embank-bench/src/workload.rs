//! What the command's workloads share: the rows they write and percentiles of their
//! latencies (their key streams are the core's [`embank_core::KeyStream`]).

/// The row a benchmark or demo writes for `key`: cheap, deterministic, key-dependent.
pub fn row_for(key: u64, out: &mut [f32]) {
    let base = (key % 1_000_003) as f32 * 1e-6;
    for (j, x) in out.iter_mut().enumerate() {
        *x = base + j as f32 * 1e-3;
    }
}

/// Percentile of sorted values (nearest rank).
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&v, 100.0), 100);
        assert_eq!(percentile(&[], 50.0), 0);
    }
}
