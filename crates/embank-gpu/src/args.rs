//! The kernels' argument structs: `kernels/cache.cu`'s, field for field (`#[repr(C)]`,
//! pointers as `u64`), passed to a launch as bytes.
// ---- argument structs: cache.cu's, field for field ----

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CacheDesc {
    pub(crate) keys: u64,
    pub(crate) digests: u64,
    pub(crate) scores: u64,
    pub(crate) rows: u64,
    pub(crate) versions: u64,
    pub(crate) counters: u64,
    pub(crate) clock: u64,
    pub(crate) n_buckets: u32,
    pub(crate) slots: u32,
    pub(crate) dim: u32,
    pub(crate) dtype: u32,
    pub(crate) policy: u32,
    pub(crate) pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Report {
    pub(crate) host: u64,
    pub(crate) done: u64,
    pub(crate) hint: u64,
    pub(crate) warps: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FindArgs {
    pub(crate) c: CacheDesc,
    pub(crate) ids: u64,
    pub(crate) out: u64,
    pub(crate) dflt: u64,
    pub(crate) payload: u64,
    pub(crate) miss_at: u64,
    pub(crate) given: u64,
    pub(crate) n: u64,
    pub(crate) cap: u64,
    pub(crate) r: Report,
    pub(crate) parity: u32,
    pub(crate) vec4: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PoolArgs {
    pub(crate) c: CacheDesc,
    pub(crate) ids: u64,
    pub(crate) offsets: u64,
    pub(crate) weights: u64,
    pub(crate) out: u64,
    pub(crate) dflt: u64,
    pub(crate) payload: u64,
    pub(crate) miss_at: u64,
    pub(crate) miss_w: u64,
    pub(crate) given: u64,
    pub(crate) n: u64,
    pub(crate) bags: u64,
    pub(crate) cap: u64,
    pub(crate) r: Report,
    pub(crate) parity: u32,
    pub(crate) mean: u32,
    pub(crate) add_default: u32,
    pub(crate) pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct FillArgs {
    pub(crate) c: CacheDesc,
    pub(crate) out: u64,
    pub(crate) miss_at: u64,
    pub(crate) row_of: u64,
    pub(crate) rows: u64,
    pub(crate) keys: u64,
    pub(crate) key_row: u64,
    pub(crate) key_ver: u64,
    pub(crate) key_score: u64,
    pub(crate) groups: u64,
    pub(crate) miss_w: u64,
    pub(crate) n_answer: u64,
    pub(crate) n_groups: u64,
    pub(crate) stored: u32,
    pub(crate) row_bytes: u32,
    pub(crate) which: u32,
    pub(crate) pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct InvalidateArgs {
    pub(crate) c: CacheDesc,
    pub(crate) keys: u64,
    pub(crate) n: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RefreshArgs {
    pub(crate) c: CacheDesc,
    pub(crate) slots: u64,
    pub(crate) keys: u64,
    pub(crate) vers: u64,
    pub(crate) found: u64,
    pub(crate) rows: u64,
    pub(crate) n: u64,
    pub(crate) stored: u32,
    pub(crate) row_bytes: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct CountArgs {
    pub(crate) c: CacheDesc,
    pub(crate) n: u64,
}

pub(crate) fn bytes_of<T: Copy>(t: &T) -> &[u8] {
    // SAFETY: plain #[repr(C)] structs of integers, read as bytes.
    unsafe { std::slice::from_raw_parts((t as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

// ---- training (kernels/train.cuh) ----

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct TrainDesc {
    pub(crate) keys: u64,
    pub(crate) used: u64,
    pub(crate) records: u64,
    pub(crate) dirty: u64,
    pub(crate) n_buckets: u64,
    pub(crate) slots: u32,
    pub(crate) width: u32,
    pub(crate) dim: u32,
    pub(crate) pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct TrainFindArgs {
    pub(crate) t: TrainDesc,
    pub(crate) ids: u64,
    pub(crate) slot: u64,
    pub(crate) out: u64,
    pub(crate) payload: u64,
    pub(crate) n: u64,
    pub(crate) clock: u64,
    pub(crate) r: Report,
    pub(crate) parity: u32,
    pub(crate) pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct TrainPlaceArgs {
    pub(crate) t: TrainDesc,
    pub(crate) keys: u64,
    pub(crate) at: u64,
    pub(crate) recs: u64,
    pub(crate) groups: u64,
    pub(crate) slot: u64,
    pub(crate) out: u64,
    pub(crate) ev: u64,
    pub(crate) m: u64,
    pub(crate) n_groups: u64,
    pub(crate) clock: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct TrainUpdateArgs {
    pub(crate) t: TrainDesc,
    pub(crate) slots: u64,
    pub(crate) grads: u64,
    pub(crate) n: u64,
    pub(crate) kind: u32,
    pub(crate) mark_dirty: u32,
    pub(crate) lr: f32,
    pub(crate) eps: f32,
    pub(crate) beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) weight_decay: f32,
    pub(crate) l1: f32,
    pub(crate) l2: f32,
    pub(crate) beta: f32,
}
