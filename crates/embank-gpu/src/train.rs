//! Training through the GPU cache: the kernels of `embank.gpu.TrainCache(kernels="native")`
//! (`kernels/train.cuh`), launched from Rust on the caller's stream over the Python
//! cache's own tensors (keys, used, records, dirty: device addresses). The cache's
//! bookkeeping (the table's reads, the background writer, the statistics) stays in
//! Python; what was many PyTorch operations a step is three native calls:
//!
//! - [`TrainKernels::find`]: each id's slot, the slots found touched with the call's
//!   clock, their rows gathered, the misses listed (one launch, one host sync: the miss
//!   count, reported by the kernel's last warp into mapped pinned memory);
//! - [`TrainKernels::place`]: the misses (their records read from the table by the
//!   caller) put in their buckets, each taking an empty slot, else the least recently used
//!   one the call does not use; an evicted dirty row's key and record copied out for the
//!   caller to write back (one launch, one sync);
//! - [`TrainKernels::update`]: the table's optimizer on the rows at the given slots, in
//!   place, marked dirty (one launch, no sync).
//!
//! The slots chosen are those of the Python path's PyTorch operations (the tests compare
//! them), so a cache can be driven by either.

use std::sync::Arc;

use embank_core::{Error, ErrorKind, Result};
use parking_lot::Mutex;

use crate::args::{bytes_of, Report, TrainDesc, TrainFindArgs, TrainPlaceArgs, TrainUpdateArgs};
use crate::device::{Device, Kernel, Stream};
use crate::mem::{align, Scratch};
use crate::{mix, MISS_HINT_MIN, PAYLOAD_HEAD, REPORT_WARPS_MAX};

/// Where the cache's arrays are (device addresses of the Python cache's tensors) and
/// their shape.
#[derive(Clone, Copy, Debug)]
pub struct TrainLayout {
    /// i64 per slot, -1 when empty.
    pub keys: u64,
    /// i64 per slot: the clock of the last call that used it.
    pub used: u64,
    /// f32 per slot: `width` values (the row's `dim`, then the optimizer's state).
    pub records: u64,
    /// One byte per slot (a bool tensor).
    pub dirty: u64,
    pub n_buckets: usize,
    pub slots: usize,
    pub width: usize,
    pub dim: usize,
}

/// The optimizers applied on the device (their state as `crates/embank-core/src/optim.rs`
/// lays it out after the row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleKind {
    Sgd = 0,
    Adagrad = 1,
    RowWiseAdagrad = 2,
    Adam = 3,
    AdamW = 4,
    Ftrl = 5,
}

impl RuleKind {
    /// The kind named as `Table.optimizer["kind"]` names it, if applied on the device.
    pub fn from_name(name: &str) -> Option<RuleKind> {
        Some(match name {
            "sgd" => RuleKind::Sgd,
            "adagrad" => RuleKind::Adagrad,
            "rowwise_adagrad" => RuleKind::RowWiseAdagrad,
            "adam" => RuleKind::Adam,
            "adamw" => RuleKind::AdamW,
            "ftrl" => RuleKind::Ftrl,
            _ => return None,
        })
    }

    /// State values a row keeps after its `dim` values.
    pub fn state_len(self, dim: usize) -> usize {
        match self {
            RuleKind::Sgd => 0,
            RuleKind::Adagrad => dim,
            RuleKind::RowWiseAdagrad => 1,
            RuleKind::Adam | RuleKind::AdamW => 2 * dim + 1,
            RuleKind::Ftrl => 2 * dim,
        }
    }
}

/// An optimizer and its hyper-parameters (f32, as the store holds them; those a kind
/// does not use are ignored).
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub kind: RuleKind,
    pub lr: f32,
    pub eps: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub weight_decay: f32,
    pub l1: f32,
    pub l2: f32,
    /// FTRL's beta.
    pub beta: f32,
}

/// A find's misses, in the call's order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Missed {
    pub keys: Vec<u64>,
    /// Each miss's index in the call.
    pub at: Vec<u32>,
}

/// What a place did.
#[derive(Clone, Debug, Default)]
pub struct Placed {
    /// Misses that took the slot of a cached row (clean or dirty).
    pub evicted: u64,
    /// The dirty rows evicted, to write back: keys and records (`width` each).
    pub dirty_keys: Vec<u64>,
    pub dirty_records: Vec<f32>,
    /// Misses that found no slot (their positions among the misses given, ascending):
    /// answered, not cached.
    pub unplaced: Vec<u32>,
}

struct Scratches {
    find: Scratch,
    place: Scratch,
    hint: usize,
}

/// The training kernels over one cache's arrays (see the module's text).
pub struct TrainKernels {
    dev: Arc<dyn Device>,
    t: TrainDesc,
    st: Mutex<Scratches>,
}

// Flags of `kernels/train.cuh`'s place.
const PLACED_EVICTED: u64 = 1;
const PLACED_DIRTY: u64 = 2;
const PLACED_NONE: u64 = 3;

fn invalid(msg: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidInput, msg)
}

/// The bucket of `key` among `n_buckets`: `torch.remainder(key_hash(key), n_buckets)`.
pub fn train_bucket(key: u64, n_buckets: u64) -> u64 {
    (mix(key) as i64).rem_euclid(n_buckets as i64) as u64
}

impl TrainKernels {
    pub fn new(dev: Arc<dyn Device>, l: TrainLayout) -> Result<TrainKernels> {
        if l.slots == 0 || l.slots > u32::MAX as usize || l.n_buckets == 0 || l.n_buckets > i64::MAX as usize {
            return Err(invalid(format!("a train cache needs buckets and slots, got {} x {}", l.n_buckets, l.slots)));
        }
        if l.dim == 0 || l.width < l.dim || l.width > u32::MAX as usize {
            return Err(invalid(format!("records of width {} cannot hold rows of dim {}", l.width, l.dim)));
        }
        let _cx = dev.enter()?;
        let st = Scratches {
            find: Scratch::new(&dev, 1 << 16, 0)?,
            place: Scratch::new(&dev, 1 << 16, 0)?,
            hint: MISS_HINT_MIN,
        };
        let t = TrainDesc {
            keys: l.keys,
            used: l.used,
            records: l.records,
            dirty: l.dirty,
            n_buckets: l.n_buckets as u64,
            slots: l.slots as u32,
            width: l.width as u32,
            dim: l.dim as u32,
            pad: 0,
        };
        Ok(TrainKernels { dev, t, st: Mutex::new(st) })
    }

    /// The slots of the `n` distinct ids (u64) at `ids` into `slot` (i64, -1 where not
    /// cached), their rows into `out` (`n * dim` f32; a miss's row left as it was; 0:
    /// none), the slots found given `clock` (0: untouched). Returns the misses; waits for
    /// the device once.
    pub fn find(&self, ids: u64, n: usize, slot: u64, out: u64, clock: u64, stream: Stream) -> Result<Missed> {
        if n == 0 {
            return Ok(Missed::default());
        }
        let _cx = self.dev.enter()?;
        let mut st = self.st.lock();
        let hint = st.hint.min(n);
        let s = &mut st.find;
        s.reserve(&self.dev, align(8 * (PAYLOAD_HEAD + 3 * n), 256), stream)?;
        self.dev.wait(s.last)?;
        let payload = s.dev_buf.ptr;
        let reported = n <= REPORT_WARPS_MAX;
        let r = Report {
            host: if reported { s.host.dev_ptr } else { 0 },
            done: payload + 16,
            hint: hint as u64,
            warps: n as u64,
        };
        let args =
            TrainFindArgs { t: self.t, ids, slot, out, payload, n: n as u64, clock, r, parity: s.parity, pad: 0 };
        self.dev.launch(Kernel::TrainFind, n as u64 * 32, bytes_of(&args), stream)?;
        if !reported {
            // SAFETY: the pinned buffer is this call's (under the lock) until the wait.
            unsafe { self.dev.dtoh(s.host.ptr, payload, 8 * (PAYLOAD_HEAD + 3 * hint), stream)? };
        }
        self.dev.record(s.copied, stream)?;
        s.last = s.copied;
        self.dev.wait(s.copied)?; // the one host sync
        let parity = s.parity as usize;
        s.parity ^= 1;
        let m = s.host.u64s(0, PAYLOAD_HEAD)[parity] as usize;
        if m > hint {
            // SAFETY: as above.
            unsafe {
                self.dev.dtoh(
                    s.host.ptr.add(8 * (PAYLOAD_HEAD + 3 * hint)),
                    payload + 8 * (PAYLOAD_HEAD + 3 * hint) as u64,
                    8 * 3 * (m - hint),
                    stream,
                )?
            };
            self.dev.record(s.copied, stream)?;
            self.dev.wait(s.copied)?;
        }
        let words = s.host.u64s(8 * PAYLOAD_HEAD, 3 * m);
        let mut misses: Vec<(u32, u64)> = words.chunks_exact(3).map(|w| (w[1] as u32, w[0])).collect();
        misses.sort_unstable();
        st.hint = (m + m / 2).max(MISS_HINT_MIN);
        Ok(Missed { keys: misses.iter().map(|&(_, k)| k).collect(), at: misses.iter().map(|&(i, _)| i).collect() })
    }

    /// Puts the misses `keys` (distinct, not cached; `at`: each one's index in the call)
    /// in their buckets with their `records` (`width` f32 each, in `keys`' order), writes
    /// each placed miss's slot into `slot` and every miss's row into `out` (0: none), the
    /// slots taken given `clock` (the call's `find`'s: the slots it touched are never
    /// taken). Waits for the device once.
    #[allow(clippy::too_many_arguments)]
    pub fn place(
        &self,
        keys: &[u64],
        at: &[u32],
        records: &[f32],
        slot: u64,
        out: u64,
        clock: u64,
        stream: Stream,
    ) -> Result<Placed> {
        let m = keys.len();
        let w = self.t.width as usize;
        if at.len() != m || records.len() != m * w {
            return Err(invalid(format!(
                "place: {m} keys, {} places and {} values of records of width {w}",
                at.len(),
                records.len()
            )));
        }
        if m == 0 {
            return Ok(Placed::default());
        }
        if clock == 0 {
            return Err(invalid("place needs the call's clock (> 0)"));
        }
        let _cx = self.dev.enter()?;
        // Grouped by bucket, the call's order kept within one.
        let nb = self.t.n_buckets;
        let buckets: Vec<u64> = keys.iter().map(|&k| train_bucket(k, nb)).collect();
        let mut order: Vec<u32> = (0..m as u32).collect();
        order.sort_by_key(|&i| buckets[i as usize]);
        let mut groups: Vec<u32> = vec![0];
        for k in 1..m {
            if buckets[order[k] as usize] != buckets[order[k - 1] as usize] {
                groups.push(k as u32);
            }
        }
        groups.push(m as u32);
        let n_groups = groups.len() - 1;
        let keys_off = align(4 * m * w, 8);
        let at_off = keys_off + 8 * m;
        let groups_off = at_off + 4 * m;
        let end = align(groups_off + 4 * groups.len(), 256);
        let ev_off = end;
        let ev_bytes = 16 * m + 4 * m * w;
        let mut st = self.st.lock();
        let s = &mut st.place;
        s.reserve(&self.dev, ev_off + ev_bytes, stream)?;
        self.dev.wait(s.last)?;
        {
            let recs = s.host.slice_mut(0, 4 * m * w);
            for (k, &i) in order.iter().enumerate() {
                let src = &records[i as usize * w..(i as usize + 1) * w];
                // SAFETY: `w` f32 into the `4 * w` bytes of record `k` (in bounds above).
                unsafe {
                    std::ptr::copy_nonoverlapping(src.as_ptr().cast::<u8>(), recs.as_mut_ptr().add(4 * k * w), 4 * w)
                };
            }
        }
        s.host.u64s(keys_off, m).iter_mut().zip(&order).for_each(|(d, &i)| *d = keys[i as usize]);
        s.host.u32s(at_off, m).iter_mut().zip(&order).for_each(|(d, &i)| *d = at[i as usize]);
        s.host.u32s(groups_off, groups.len()).copy_from_slice(&groups);
        let d = s.dev_buf.ptr;
        // SAFETY: the pinned buffer is this call's (under the lock) until the wait below.
        unsafe { self.dev.htod(d, s.host.ptr, end, stream)? };
        let args = TrainPlaceArgs {
            t: self.t,
            keys: d + keys_off as u64,
            at: d + at_off as u64,
            recs: d,
            groups: d + groups_off as u64,
            slot,
            out,
            ev: s.host.dev_ptr + ev_off as u64,
            m: m as u64,
            n_groups: n_groups as u64,
            clock,
        };
        self.dev.launch(Kernel::TrainPlace, n_groups as u64 * 32, bytes_of(&args), stream)?;
        self.dev.record(s.copied, stream)?;
        s.last = s.copied;
        self.dev.wait(s.copied)?;
        let flags: Vec<u64> = s.host.u64s(ev_off, m).to_vec();
        let ev_keys: Vec<u64> = s.host.u64s(ev_off + 8 * m, m).to_vec();
        let ev_recs = s.host.slice_mut(ev_off + 16 * m, 4 * m * w);
        let mut placed = Placed::default();
        for (k, &f) in flags.iter().enumerate() {
            match f {
                PLACED_EVICTED => placed.evicted += 1,
                PLACED_DIRTY => {
                    placed.evicted += 1;
                    placed.dirty_keys.push(ev_keys[k]);
                    let at = placed.dirty_records.len();
                    placed.dirty_records.resize(at + w, 0.0);
                    let src = &ev_recs[4 * k * w..4 * (k + 1) * w];
                    // SAFETY: `4 * w` bytes into the `w` f32 just made room for.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            src.as_ptr(),
                            placed.dirty_records[at..].as_mut_ptr().cast::<u8>(),
                            4 * w,
                        )
                    };
                }
                PLACED_NONE => placed.unplaced.push(order[k]),
                _ => {}
            }
        }
        placed.unplaced.sort_unstable();
        Ok(placed)
    }

    /// `rule` applied to the `n` rows at `slots` (i64; < 0: skipped) with gradients
    /// `grads` (`n * dim` f32, one a row: duplicates summed by the caller), in place on
    /// `stream`; `mark_dirty` flags them. No wait.
    pub fn update(
        &self,
        slots: u64,
        grads: u64,
        n: usize,
        rule: &Rule,
        mark_dirty: bool,
        stream: Stream,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if self.t.width as usize != self.t.dim as usize + rule.kind.state_len(self.t.dim as usize) {
            return Err(invalid(format!(
                "{:?} keeps {} state values a row; the cache's records hold {}",
                rule.kind,
                rule.kind.state_len(self.t.dim as usize),
                self.t.width - self.t.dim
            )));
        }
        let _cx = self.dev.enter()?;
        let args = TrainUpdateArgs {
            t: self.t,
            slots,
            grads,
            n: n as u64,
            kind: rule.kind as u32,
            mark_dirty: u32::from(mark_dirty),
            lr: rule.lr,
            eps: rule.eps,
            beta1: rule.beta1,
            beta2: rule.beta2,
            weight_decay: rule.weight_decay,
            l1: rule.l1,
            l2: rule.l2,
            beta: rule.beta,
        };
        self.dev.launch(Kernel::TrainUpdate, n as u64 * 32, bytes_of(&args), stream)
    }
}

impl Drop for TrainKernels {
    fn drop(&mut self) {
        let _cx = self.dev.enter();
        let st = self.st.get_mut();
        for s in [&st.find, &st.place] {
            let _ = self.dev.wait(s.last);
            // SAFETY: waited above; nothing else uses them.
            unsafe {
                self.dev.drop_event(s.done);
                self.dev.drop_event(s.copied);
            }
        }
    }
}
