//! `embank.plan`: the core's planner (`embank_core::plan_request`) with the traces given
//! as arrays, progress drawn on stderr as `embank plan` draws it.

use std::sync::Arc;

use embank_core as core;
use indicatif::{ProgressBar, ProgressStyle};
use numpy::PyReadonlyArray1;
use pyo3::prelude::*;

use crate::{slice, to_py_err};

/// `embank plan` through its API: `request_json` its options (`embank plan`'s by their
/// long names), the traces given as arrays (`names[i]` -> `traces[i]`); the plan as JSON.
#[pyfunction]
pub(crate) fn plan_json<'py>(
    py: Python<'py>,
    request_json: &str,
    names: Vec<String>,
    traces: Vec<PyReadonlyArray1<'py, u64>>,
) -> PyResult<String> {
    let keys = names
        .into_iter()
        .zip(&traces)
        .map(|(n, t)| Ok((n, Arc::new(slice(t, "trace")?.to_vec()))))
        .collect::<PyResult<Vec<_>>>()?;
    let plan = py
        .detach(|| core::plan_request(request_json, keys, &mut Bars(None)))
        .map_err(|e| to_py_err(core::Error::config(e)))?;
    Ok(serde_json::to_string(&plan).expect("a plan serializes"))
}

/// A progress bar of each pass over a stream, on stderr (the command's style).
struct Bars(Option<ProgressBar>);

impl core::PlanProgress for Bars {
    fn begin(&mut self, what: &str, total: u64) {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template("{msg:>10} [{bar:40}] {human_pos}/{human_len} ({per_sec}, {eta} left)")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_message(what.to_owned());
        self.0 = Some(bar);
    }

    fn advance(&mut self, done: u64) {
        if let Some(bar) = &self.0 {
            bar.set_position(done);
        }
    }

    fn end(&mut self) {
        if let Some(bar) = self.0.take() {
            bar.finish_and_clear();
        }
    }
}
