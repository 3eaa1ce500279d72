//! The store's catalog: which tables exist and how they were created.
//!
//! One file, `STORE`: a first line `embank-store <format version> <crc32c hex>`
//! and then a JSON body. Replaced atomically (write, fsync, rename, fsync dir).

use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{io_at, Error, ErrorKind, Result};
use crate::format::{DType, CATALOG_MAGIC, FORMAT_VERSION};
use crate::init::Initializer;

/// What fills the rows of keys a `lookup` does not find.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize, Default)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum MissingDefault {
    /// Zeros (the default).
    #[default]
    Zeros,
    /// Every element `value`.
    Value { value: f32 },
    /// The row the initializer would create (without creating it).
    Init,
}

/// Where a table's rows are kept in DRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// `cache` on the block medium when the store has a row cache, `bypass` otherwise.
    #[default]
    Auto,
    /// Hot rows in the store's DRAM row cache; updates written back in batches.
    Cache,
    /// The whole table kept in the row cache (loaded at open, never evicted).
    Pin,
    /// No row cache: reads go to the medium, writes go through to it.
    Bypass,
}

impl Placement {
    pub fn parse(s: &str) -> Result<Placement> {
        match s {
            "auto" => Ok(Placement::Auto),
            "cache" => Ok(Placement::Cache),
            "pin" => Ok(Placement::Pin),
            "bypass" => Ok(Placement::Bypass),
            other => Err(Error::config(format!("unknown placement {other:?}: use auto, cache, pin or bypass"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Placement::Auto => "auto",
            Placement::Cache => "cache",
            Placement::Pin => "pin",
            Placement::Bypass => "bypass",
        }
    }
}

/// Everything the catalog keeps about one table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableMeta {
    pub id: u32,
    pub name: String,
    pub dim: u32,
    pub dtype: DType,
    pub init: Initializer,
    pub seed: u64,
    pub growth: bool,
    pub load_factor_max: f64,
    pub missing: MissingDefault,
    /// Which `index.<generation>.ebi` is current; bumped by each rebuild.
    pub index_generation: u64,
    pub grow_count: u64,
    /// Which medium holds the rows (absent in catalogs written before media existed: mmap).
    #[serde(default)]
    pub medium: crate::medium::MediumKind,
    #[serde(default)]
    pub placement: Placement,
    /// Server-side optimizer (learning rate as last set).
    #[serde(default)]
    pub optimizer: crate::optim::Optimizer,
    /// Bounded staleness (`None`: ASP).
    #[serde(default)]
    pub staleness_bound: Option<u32>,
    #[serde(default = "default_lease")]
    pub lease_seconds: f64,
    /// Admission and eviction (absent: none).
    #[serde(default)]
    pub lifecycle: crate::lifecycle::LifecycleOptions,
    /// The training step of the table's last update, for the optimizers that [use the
    /// table's step](crate::optim::Optimizer::uses_table_step) (absent: 0). Written at
    /// `flush` and close; a rollback to a checkpoint takes the checkpoint's instead.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub optimizer_step: u64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

impl TableMeta {
    /// The layout of the table's records.
    pub fn layout(&self) -> crate::layout::RecordLayout {
        let dim = self.dim as usize;
        crate::layout::RecordLayout::new(dim, self.optimizer.state_len(dim), self.dtype)
    }
}

fn default_lease() -> f64 {
    60.0
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CatalogData {
    pub next_table_id: u32,
    pub tables: Vec<TableMeta>,
}

pub struct Catalog {
    path: PathBuf,
    data: Mutex<CatalogData>,
}

pub const CATALOG_FILE: &str = "STORE";

pub fn encode(data: &CatalogData) -> Vec<u8> {
    let body = serde_json::to_vec_pretty(data).expect("catalog serializes");
    let mut out = format!("{CATALOG_MAGIC} {FORMAT_VERSION} {:08x}\n", crc32c::crc32c(&body)).into_bytes();
    out.extend_from_slice(&body);
    out
}

pub fn decode(bytes: &[u8]) -> Result<CatalogData> {
    let newline = bytes.iter().position(|&b| b == b'\n').unwrap_or(bytes.len());
    let first = std::str::from_utf8(&bytes[..newline]).unwrap_or("");
    let mut words = first.split(' ');
    if words.next() != Some(CATALOG_MAGIC) {
        return Err(Error::new(ErrorKind::Recover, "not an embank store (STORE file has a bad magic)"));
    }
    let version: u32 = words
        .next()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| Error::new(ErrorKind::Recover, "STORE file has no format version"))?;
    if version != FORMAT_VERSION {
        return Err(Error::new(
            ErrorKind::FormatVersion,
            format!("store has format version {version}; this build of embank reads version {FORMAT_VERSION}"),
        ));
    }
    let crc = words.next().and_then(|c| u32::from_str_radix(c, 16).ok());
    let body = bytes.get(newline + 1..).unwrap_or(&[]);
    if crc != Some(crc32c::crc32c(body)) {
        return Err(Error::new(ErrorKind::ChecksumMismatch, "STORE file checksum mismatch"));
    }
    serde_json::from_slice(body)
        .map_err(|e| Error::new(ErrorKind::Recover, "STORE file body is not valid").with_source(e))
}

/// The entries of the tables a store directory's catalog names, read as the file has
/// them: without opening the store or taking its lock (what `embank serve` checks its
/// declared tables against before it opens the store).
pub fn catalog_tables(dir: &Path) -> Result<Vec<TableMeta>> {
    Ok(Catalog::open(dir)?.snapshot().tables)
}

impl Catalog {
    pub fn create(dir: &Path) -> Result<Catalog> {
        let catalog = Catalog { path: dir.join(CATALOG_FILE), data: Mutex::new(CatalogData::default()) };
        crate::fsutil::write_atomic(&catalog.path, &encode(&CatalogData::default()))?;
        Ok(catalog)
    }

    pub fn open(dir: &Path) -> Result<Catalog> {
        let path = dir.join(CATALOG_FILE);
        let bytes = std::fs::read(&path).map_err(|e| io_at("cannot read", &path, e))?;
        let data = decode(&bytes).map_err(|e| e.context(path.display().to_string()))?;
        Ok(Catalog { path, data: Mutex::new(data) })
    }

    /// The entry of table `id`, if the catalog has it.
    pub fn table(&self, id: u32) -> Option<TableMeta> {
        self.data.lock().tables.iter().find(|m| m.id == id).cloned()
    }

    pub fn snapshot(&self) -> CatalogData {
        self.data.lock().clone()
    }

    /// Applies `f` to a copy and makes the result durable before it becomes current.
    pub fn update<T>(&self, f: impl FnOnce(&mut CatalogData) -> Result<T>) -> Result<T> {
        let mut data = self.data.lock();
        let mut next = data.clone();
        let out = f(&mut next)?;
        crate::fsutil::write_atomic(&self.path, &encode(&next))?;
        *data = next;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() {
        let data = CatalogData { next_table_id: 3, tables: vec![] };
        let b = encode(&data);
        assert_eq!(decode(&b).unwrap(), data);
        let mut bad = b.clone();
        let n = bad.len();
        bad[n - 3] ^= 1;
        assert_eq!(decode(&bad).unwrap_err().kind(), ErrorKind::ChecksumMismatch);
        let future = String::from_utf8(b.clone()).unwrap().replacen(" 1 ", " 99 ", 1);
        assert_eq!(decode(future.as_bytes()).unwrap_err().kind(), ErrorKind::FormatVersion);
        assert_eq!(decode(b"hello").unwrap_err().kind(), ErrorKind::Recover);
    }
}
