//! The planner's API: a plan asked for with typed options and traces in memory (what
//! `embank.plan` calls), instead of argument strings and files.

use std::path::PathBuf;
use std::sync::Arc;

use super::{plan, Plan, PlanArgs};
use crate::bench::{parse_bytes, parse_dtype};

/// A plan asked for through the API (`embank.plan`): the options of `embank plan` by
/// their long names (`cache_bytes` as numbers or strings such as `"8M"`), absent ones
/// defaulted as the command defaults them; traces in memory beside.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    pub traces: Vec<String>,
    pub criteo: Vec<PathBuf>,
    pub features: Vec<usize>,
    pub hash_size: Option<u64>,
    pub training: bool,
    pub lookahead: bool,
    pub workload: Option<String>,
    pub keys: Option<u64>,
    pub zipf: Option<f64>,
    pub batch: Option<usize>,
    pub threads: Option<usize>,
    pub stream_batches: Option<usize>,
    pub seed: Option<u64>,
    pub dim: Option<usize>,
    pub dtype: Option<String>,
    pub optimizer: Option<String>,
    pub medium: Option<String>,
    pub cache_bytes: Vec<Bytes>,
    pub budget_dram: Option<Bytes>,
    pub budget_gpu: Option<Bytes>,
    pub target_hit_rate: Option<f64>,
    pub sample_rate: Option<f64>,
    pub tracked_max: Option<usize>,
}

/// A size in bytes: a number, or a string such as `"8M"`.
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
pub enum Bytes {
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

/// The plan of `request` (JSON, a [`PlanRequest`]) with the traces of `keys`: what the
/// Python package's `embank.plan` calls, without argument strings or files.
pub fn plan_request(request: &str, keys: Vec<(String, Arc<Vec<u64>>)>) -> Result<Plan, String> {
    #[derive(clap::Parser)]
    struct Wrapper {
        #[command(flatten)]
        args: PlanArgs,
    }
    use clap::Parser;
    let r: PlanRequest = serde_json::from_str(request).map_err(|e| format!("plan: {e}"))?;
    let mut a = Wrapper::try_parse_from(["plan"]).map_err(|e| e.to_string())?.args;
    a.traces = r.traces;
    a.criteo = r.criteo;
    a.features = r.features;
    a.hash_size = r.hash_size;
    a.training = r.training;
    a.lookahead = r.lookahead;
    a.workload = r.workload;
    a.trace_keys = keys;
    a.cache_bytes = r.cache_bytes.iter().map(Bytes::get).collect::<Result<_, _>>()?;
    a.budget_dram = r.budget_dram.as_ref().map(Bytes::get).transpose()?;
    a.budget_gpu = r.budget_gpu.as_ref().map(Bytes::get).transpose()?;
    a.zipf = r.zipf.or(a.zipf);
    a.sample_rate = r.sample_rate.or(a.sample_rate);
    if let Some(d) = &r.dtype {
        a.dtype = parse_dtype(d)?;
    }
    macro_rules! given {
        ($($field:ident <- $from:ident),*) => { $(if let Some(v) = r.$from { a.$field = v; })* };
    }
    given!(keys <- keys, batch <- batch, threads <- threads, stream_batches <- stream_batches,
        seed <- seed, dim <- dim, optimizer <- optimizer, medium <- medium,
        target_hit_rate <- target_hit_rate, tracked_max <- tracked_max);
    plan(&a)
}
