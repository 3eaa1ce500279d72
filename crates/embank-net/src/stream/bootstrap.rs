//! A new replica of a running group: before it follows the stream, it copies the
//! checkpoint a sibling serves (`EXPORT_AT` pages of that sibling's retained checkpoint,
//! exactly as it was), takes its own checkpoint with the sibling's stream position, and
//! goes on from there. The stream's retention need not reach back to a full snapshot, and
//! the copy costs the sibling one paged read of its tables.
//!
//! While it copies, the replica refuses reads with `Unavailable` (clients read its
//! siblings; `/readyz` answers 503), so it starts taking reads only once it serves the
//! checkpoint its group served when it began, and then follows the stream as every
//! replica does.

use embank_core::{Error, ErrorKind, Result, Store, TableOptions};

use super::replica::ReplicaMeta;
use crate::client::{Client, ClientOptions};

/// Rows per `EXPORT_AT` page.
const PAGE_KEYS: usize = 8192;

/// What a bootstrap copied.
#[derive(Clone, Debug)]
pub struct Copied {
    pub meta: ReplicaMeta,
    pub from: String,
    pub tables: usize,
    pub rows: u64,
    pub seconds: f64,
}

/// Copies the checkpoint one of `siblings` serves into `store` (whose own checkpoints
/// must hold none of this stream) and takes the store's checkpoint `own_batch` with that
/// checkpoint's stream position. `stream` and `partition` must be the sibling's.
pub fn copy_from_siblings(
    store: &Store,
    siblings: &[String],
    token: Option<&str>,
    stream: &str,
    partition: u32,
    own_batch: u64,
) -> Result<Copied> {
    let mut errors = Vec::new();
    for addr in siblings {
        match copy_from(store, addr, token, stream, partition, own_batch) {
            Ok(c) => return Ok(c),
            Err(e) => errors.push(format!("{addr}: {e}")),
        }
    }
    Err(Error::new(
        ErrorKind::Unavailable,
        format!("no sibling replica could give a checkpoint to start from ({})", errors.join("; ")),
    ))
}

fn copy_from(
    store: &Store,
    addr: &str,
    token: Option<&str>,
    stream: &str,
    partition: u32,
    own_batch: u64,
) -> Result<Copied> {
    let started = std::time::Instant::now();
    let opts = ClientOptions { token: token.map(str::to_string), ..Default::default() };
    let client = Client::connect_groups(&[vec![addr.to_string()]], opts)?;
    let served = client.served()?;
    let v = &served[0];
    let Some(batch_id) = v["batch_id"].as_u64() else {
        return Err(Error::new(ErrorKind::Unavailable, "it serves no checkpoint yet"));
    };
    if v["replica"].as_bool() != Some(true) {
        return Err(Error::config("it is not a replica fed by the stream"));
    }
    let meta: ReplicaMeta = serde_json::from_value(v["meta"].clone())
        .map_err(|e| Error::corrupt(format!("its served reply names no stream position: {e}")))?;
    if meta.stream != stream || meta.partition != partition {
        return Err(Error::config(format!(
            "it replicates partition {} of {}, this replica partition {partition} of {stream}",
            meta.partition, meta.stream
        )));
    }
    let mut rows = 0u64;
    let names = client.tables()?;
    for name in &names {
        let remote = client.table(name)?;
        let local = match store.table(name) {
            Ok(t) if t.dim() == remote.dim() => t,
            Ok(t) => {
                return Err(Error::config(format!(
                    "table {name:?} has dim {} here but {} on the sibling",
                    t.dim(),
                    remote.dim()
                )))
            }
            // As the stream creates the tables it brings.
            Err(e) if e.kind() == ErrorKind::NotFound => {
                store.create_table(name, TableOptions::new(remote.dim() as u32))?
            }
            Err(e) => return Err(e),
        };
        // Rows of an earlier attempt that did not finish: not part of this checkpoint.
        let mut stale = Vec::new();
        local.export_keys(PAGE_KEYS, |keys| {
            stale.extend_from_slice(keys);
            Ok(())
        })?;
        for chunk in stale.chunks(PAGE_KEYS) {
            local.delete(chunk)?;
        }
        // One bulk load (rows in runs, the index built in DRAM and written once): the
        // replica serves nothing until the copy is whole, so nothing else writes it.
        let mut load = local.loader(remote.len()?)?;
        remote.export_at(batch_id, PAGE_KEYS, |keys, r| {
            rows += keys.len() as u64;
            load.push(keys, r)
        })?;
        load.finish()?;
    }
    let blob = serde_json::to_vec(&serde_json::json!({ "replica": meta })).expect("serializes");
    store.checkpoint_with_meta(own_batch, &blob)?;
    Ok(Copied { meta, from: addr.to_string(), tables: names.len(), rows, seconds: started.elapsed().as_secs_f64() })
}
