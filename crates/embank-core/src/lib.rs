//! embank-core: the engine of embank, a tiered parameter server for embedding tables.
//!
//! A [`Store`] is a directory holding named [`Table`]s. A table maps `u64` keys
//! to fixed-size rows of `f32`, kept in a persistent medium (a memory-mapped
//! file, or a data file read with O_DIRECT through io_uring under a DRAM row
//! [`cache`]) under a one-read persistent hash [`index`]. All operations take
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

// Records and the wire format store `f32` and `u64` little-endian and are read in place.
#[cfg(not(target_endian = "little"))]
compile_error!("embank stores rows little-endian and reads them in place: little-endian targets only");

#[macro_use]
pub mod assert;
pub mod api;
pub mod catalog;
pub mod checkpoint;
pub mod error;
pub mod format;
mod fsutil;
pub mod fused;
pub mod hash;
pub mod hot;
pub mod index;
pub mod init;
pub mod io;
pub mod journal;
pub mod layout;
pub mod lifecycle;
mod limits;
pub mod medium;
mod npy;
pub mod optim;
pub mod plan;
pub mod pooled;
pub mod prefetch;
mod runtime;
pub mod staleness;
pub mod store;
pub mod table;
pub mod tier;
mod units;
mod workload;

pub use api::{StoreApi, TableApi};
pub use catalog::{MissingDefault, Placement};
pub use checkpoint::CheckpointInfo;
pub use error::{Error, ErrorKind, Result};
pub use format::DType;
pub use hot::HotOptions;
pub use init::Initializer;
pub use io::IoChoice;
pub use layout::RecordLayout;
pub use lifecycle::{EvictPolicy, LifecycleOptions};
pub use limits::{copy_bandwidth, device_limits, DeviceLimits};
pub use medium::{MediumKind, RowWrites};
pub use npy::{NpyReader, NpyWriter};
pub use optim::Optimizer;
pub use plan::{plan, plan_request, CurvePoint, Limits, Plan, PlanOptions, PlanProgress, StorePlan, TablePlan};
pub use pooled::{PooledStats, Pooling};
pub use store::IO_DEPTH_DEFAULT;
pub use store::{CheckpointPin, Store, StoreOptions, StoreStats};
pub use table::{ExportCursor, Table, TableOptions, TableStats, DIM_MAX};
pub use units::{human_bytes, parse_bytes};
pub use workload::KeyStream;
