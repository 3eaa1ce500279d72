//! The planner's API: a plan asked for with typed options and traces in memory (what
//! `embank.plan` calls), instead of argument strings and files.

use std::path::PathBuf;
use std::sync::Arc;

use super::{plan, Plan, PlanOptions, PlanProgress};
use crate::format::DType;
use crate::units::parse_bytes;

/// A plan asked for through the API (`embank.plan`): the options of `embank plan` by
/// their long names (`cache_bytes` as numbers or strings such as `"8M"`), absent ones
/// defaulted as [`PlanOptions::default`] (the command's defaults); traces in memory beside.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanRequest {
    traces: Vec<String>,
    criteo: Vec<PathBuf>,
    features: Vec<usize>,
    hash_size: Option<u64>,
    training: bool,
    lookahead: bool,
    workload: Option<String>,
    keys: Option<u64>,
    zipf: Option<f64>,
    batch: Option<usize>,
    threads: Option<usize>,
    stream_batches: Option<usize>,
    seed: Option<u64>,
    dim: Option<usize>,
    dtype: Option<String>,
    optimizer: Option<String>,
    medium: Option<String>,
    cache_bytes: Vec<Bytes>,
    budget_dram: Option<Bytes>,
    budget_gpu: Option<Bytes>,
    target_hit_rate: Option<f64>,
    sample_rate: Option<f64>,
    tracked_max: Option<usize>,
}

/// A size in bytes: a number, or a string such as `"8M"`.
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum Bytes {
    Number(u64),
    Text(String),
}

impl Bytes {
    fn get(&self) -> Result<u64, String> {
        match self {
            Bytes::Number(n) => Ok(*n),
            Bytes::Text(t) => parse_bytes(t),
        }
    }
}

/// The plan of `request` (JSON: `embank plan`'s options by their long names, `"8M"` for
/// sizes, absent ones defaulted) with the traces of `keys` (a table's name, its keys in
/// access order): what the Python package's `embank.plan` calls, without argument
/// strings or files. `progress` hears each pass over a stream.
pub fn plan_request(
    request: &str,
    keys: Vec<(String, Arc<Vec<u64>>)>,
    progress: &mut dyn PlanProgress,
) -> Result<Plan, String> {
    let r: PlanRequest = serde_json::from_str(request).map_err(|e| format!("plan: {e}"))?;
    let mut a = PlanOptions {
        traces: r.traces,
        criteo: r.criteo,
        features: r.features,
        hash_size: r.hash_size,
        training: r.training,
        lookahead: r.lookahead,
        workload: r.workload,
        trace_keys: keys,
        cache_bytes: r.cache_bytes.iter().map(Bytes::get).collect::<Result<_, _>>()?,
        budget_dram: r.budget_dram.as_ref().map(Bytes::get).transpose()?,
        budget_gpu: r.budget_gpu.as_ref().map(Bytes::get).transpose()?,
        zipf: r.zipf,
        sample_rate: r.sample_rate,
        ..PlanOptions::default()
    };
    if let Some(d) = &r.dtype {
        a.dtype = DType::parse(d).map_err(|e| e.to_string())?;
    }
    macro_rules! given {
        ($($field:ident <- $from:ident),*) => { $(if let Some(v) = r.$from { a.$field = v; })* };
    }
    given!(keys <- keys, batch <- batch, threads <- threads, stream_batches <- stream_batches,
        seed <- seed, dim <- dim, optimizer <- optimizer, medium <- medium,
        target_hit_rate <- target_hit_rate, tracked_max <- tracked_max);
    plan(&a, progress)
}
