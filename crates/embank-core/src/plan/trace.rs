//! Where a table's key stream comes from: a `.npy` trace, keys in memory, a generated
//! workload replayed as `embank bench` runs it, or a categorical feature of Criteo files.

use std::path::PathBuf;
use std::sync::Arc;

use super::PlanOptions;
use crate::npy::NpyReader;
use crate::workload::KeyStream;

/// Streams the accesses of one table into `f`.
pub(super) fn each_access(args: &PlanOptions, source: &Source, f: &mut dyn FnMut(u64, bool)) -> Result<(), String> {
    match source {
        Source::File(path) => {
            let mut r = NpyReader::open(path)?;
            if r.shape.len() != 1 || (r.descr != "<u8" && r.descr != "<i8") {
                return Err(format!("{}: a trace is a 1-D uint64/int64 array", path.display()));
            }
            let n = r.shape[0];
            let mut buf = Vec::new();
            let mut done = 0;
            while done < n {
                let m = (n - done).min(1 << 20);
                r.read_keys(m, &mut buf)?;
                for &k in &buf {
                    f(k, true);
                }
                done += m;
            }
        }
        Source::Keys(keys) => keys.iter().for_each(|&k| f(k, true)),
        Source::Criteo(n) => each_criteo_line(args, &[*n], &mut |ids| f(ids[0], true))?,
        Source::Workload(zipf) => {
            let streams: Vec<Vec<u64>> = (0..args.threads.max(1))
                .map(|t| {
                    let seed = args.seed.wrapping_add(t as u64 * 7919);
                    Ok(KeyStream::new(args.keys, *zipf, seed)?.batches(args.stream_batches, args.batch))
                })
                .collect::<Result<_, String>>()?;
            // Three replays of the interleaved batches; the first is the warm-up.
            for replay in 0..3 {
                for b in 0..args.stream_batches {
                    for s in &streams {
                        for &k in &s[b * args.batch..(b + 1) * args.batch] {
                            f(k, replay > 0);
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

pub(super) enum Source {
    File(PathBuf),
    Keys(Arc<Vec<u64>>),
    Workload(f64),
    /// Categorical feature `n` (1-based) of Criteo files.
    Criteo(usize),
}

/// The id a Criteo categorical value stands for (`embank.datasets` reads it the same way).
fn criteo_id(field: &str, hash_size: Option<u64>) -> Result<u64, String> {
    let id = if field.is_empty() {
        1u64 << 32
    } else {
        u64::from_str_radix(field, 16).map_err(|_| format!("categorical value {field:?} is not hex"))?
    };
    Ok(hash_size.map_or(id, |h| id % h))
}

/// Calls `f` with the ids of categorical `features` (1-based) of every line of the
/// Criteo files, in file order; an error names the file and line.
pub(super) fn each_criteo_line(
    args: &PlanOptions,
    features: &[usize],
    f: &mut dyn FnMut(&[u64]),
) -> Result<(), String> {
    use std::io::BufRead;
    let mut ids = vec![0u64; features.len()];
    for path in &args.criteo {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        for (i, line) in std::io::BufReader::with_capacity(1 << 20, file).lines().enumerate() {
            let line = line.map_err(|e| format!("{}: {e}", path.display()))?;
            let fields: Vec<&str> = line.split('\t').collect();
            if fields.len() < 40 {
                return Err(format!("{} line {}: fewer than 40 tab-separated fields", path.display(), i + 1));
            }
            for (id, &n) in ids.iter_mut().zip(features) {
                *id = criteo_id(fields[13 + n], args.hash_size)
                    .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
            }
            f(&ids);
        }
    }
    Ok(())
}

/// Accesses of a source (the Criteo files' line count, counted once for all features,
/// is kept in `criteo_lines`).
pub(super) fn accesses_of(args: &PlanOptions, source: &Source, criteo_lines: &mut Option<u64>) -> Result<u64, String> {
    Ok(match source {
        Source::File(p) => NpyReader::open(p)?.shape.first().copied().unwrap_or(0) as u64,
        Source::Keys(keys) => keys.len() as u64,
        Source::Workload(_) => 3 * (args.threads.max(1) * args.stream_batches * args.batch) as u64,
        Source::Criteo(_) => match criteo_lines {
            Some(n) => *n,
            None => {
                // Lines of the files: one access per line per feature.
                let mut n = 0u64;
                each_criteo_line(args, &[], &mut |_| n += 1)?;
                *criteo_lines = Some(n);
                n
            }
        },
    })
}
