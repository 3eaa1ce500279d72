//! embank-core: the engine of embank, a tiered parameter server for embedding tables.
//!
//! A [`Store`] is a directory holding named [`Table`]s. A table maps `u64` keys
//! to fixed-size rows of `f32`, kept in a persistent medium (a memory-mapped
//! file, or a data file read with O_DIRECT through io_uring under a DRAM row
//! cache) under a one-read persistent hash index. All operations take
//! a batch of keys.
//!
//! ```
//! use embank_core::{Store, StoreOptions, TableOptions, Initializer};
//! let dir = tempfile::tempdir().unwrap();
//! let store = Store::open(dir.path().join("model"), StoreOptions::default()).unwrap();
//! let mut options = TableOptions::new(4);
//! options.init = Initializer::Normal { mean: 0.0, std: 0.01 };
//! let users = store.create_table("user", options).unwrap();
//! users.push(&[7], &[1.0, 2.0, 3.0, 4.0]).unwrap();
//! let mut rows = vec![0.0; 8];
//! users.pull(&[7, 8], &mut rows).unwrap(); // key 8 is created with the initializer
//! assert_eq!(&rows[..4], &[1.0, 2.0, 3.0, 4.0]);
//! assert_eq!(users.len().unwrap(), 2);
//! ```
//!
//! **Architecture invariant:** this crate knows nothing of the network or Python.
//!
//! Its public surface is the list below, once: every module is private, and what the
//! other crates (embank-net, embank-gpu, embank-py, embank-cli) and the integration
//! tests name is re-exported here. Inside a module `pub` reaches no further than this
//! crate unless this list names it: nothing outside can reach the index, so a slot
//! changes only where the write protocol changes it. Two seams behind features reach
//! further, for tests and fuzzing only: `testing` and `fuzzing`.

// Records and the wire format store `f32` and `u64` little-endian and are read in place.
#[cfg(not(target_endian = "little"))]
compile_error!("embank stores rows little-endian and reads them in place: little-endian targets only");

#[macro_use]
mod assert;
mod api;
mod catalog;
mod checkpoint;
mod error;
mod format;
mod fsutil;
mod fused;
mod hash;
mod hot;
mod index;
mod init;
mod io;
mod journal;
mod layout;
mod lifecycle;
mod limits;
mod medium;
mod npy;
mod optim;
mod plan;
mod pooled;
mod prefetch;
mod runtime;
mod staleness;
mod store;
mod table;
mod tier;
mod units;
mod workload;

// The store and its tables, and the batch API every store (embedded or remote) offers.
pub use api::{ChunkSink, StoreApi, TableApi};
pub use checkpoint::{CheckpointInfo, CHECKPOINT_META_BYTES_MAX};
pub use store::{CheckpointPin, Store, StoreOptions, StoreStats, IO_DEPTH_DEFAULT};
pub use table::{
    validate_name, ExportCursor, LoadReport, Loader, PlaceReport, Table, TableOptions, TableStats, DIM_MAX,
};

/// A table's durable entry in the store's catalog, as `Table::meta` and a remote
/// store's table list give it; `catalog_tables` reads them from a closed store.
pub use catalog::{catalog_tables, TableMeta};

// What the stats are made of.
pub use io::IoStats;
pub use lifecycle::LifecycleStats;
pub use table::RecoverStats;
pub use tier::CacheStats;

// A table's options and what they are made of.
pub use catalog::{MissingDefault, Placement};
pub use hot::HotOptions;
pub use init::Initializer;
pub use io::{FaultPlan, IoChoice};
pub use lifecycle::{EvictPolicy, LifecycleOptions};
pub use medium::{MediumKind, RowWrites};
pub use optim::{sum_duplicates, Optimizer};
pub use pooled::{PooledStats, Pooling};

// Rows as stored: element types, the record layout, the strides of the two media.
pub use format::{block_stride, record_stride, DType};
pub use layout::{check_stored_lens, encode_rows, RecordLayout};
/// Address space the mmap medium reserves for each table's rows file (1 TiB): a
/// process's open tables on it are bounded by the user address space over this.
pub use medium::mmap::RESERVE_BYTES as MMAP_RESERVE_BYTES;

// Tiers a store is stacked with from outside (a shared tier, listeners of changes),
// and the collection-level training path.
pub use fused::{Bags, Collection, CollectionTable, Grads, Step};
pub use tier::{Changed, Listener, SharedTier, SharedTierStats};

// Errors: one type for the whole engine.
pub use error::{Error, ErrorKind, Result};

// Hashing and prefetching helpers the server, the client and the replica share.
pub use hash::{splitmix64, IdHasher};
pub use prefetch::prefetch_read;

// The capacity planner (`embank plan`, `embank.plan`) and what it reads and measures:
// key traces (`.npy` files, generated key streams), this machine's limits, byte counts.
pub use limits::{copy_bandwidth, device_limits, DeviceLimits};
pub use npy::{NpyReader, NpyWriter};
pub use plan::{
    plan, plan_request, tier_bytes, CurvePoint, Limits, Plan, PlanOptions, PlanProgress, StorePlan, TablePlan,
    TableShape, TierBytes,
};
pub use units::{human_bytes, parse_bytes};
pub use workload::KeyStream;

/// The internals the core's own integration tests (`tests/`) reach: a reference pooling
/// and the index file's layout, to corrupt one on purpose. Behind the `testing` feature,
/// which only this crate's dev-dependency on itself turns on.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing {
    pub use crate::format::INDEX_HEADER_BYTES;
    pub use crate::index::{slot_offsets, BUCKET_BYTES, SLOTS_PER_BUCKET};
    pub use crate::pooled::pool;
}

/// The fuzz targets' entry points (`fuzz/`): the readers of every file format, fed any
/// bytes. Behind the `fuzzing` feature, which `fuzz/Cargo.toml` turns on.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::catalog::{Catalog, CATALOG_FILE};
    pub use crate::checkpoint::load_checkpoints;
    pub use crate::format::RowUnits;
    pub use crate::index::Index;
    pub use crate::journal::{path_of as journal_path_of, Journal};
    pub use crate::medium::MmapMedium;
}
