//! `EXPORT_AT` reads a checkpoint page by page while the store goes on taking new ones:
//! the checkpoint stays retained for the export however far retention moves meanwhile
//! (a new replica copying its sibling while training publishes every 100 ms).

use std::collections::HashMap;

use super::*;
use crate::client::{Client, ClientOptions};

#[test]
fn a_checkpoint_being_exported_outlives_retention_until_its_last_page() {
    const KEYS: u64 = 1000;
    let row = |k: u64, b: u64| -> Vec<f32> { (0..DIM).map(|j| (k * 10 + j as u64) as f32 + b as f32 * 0.5).collect() };
    let served = Served::start_with(ServerOptions::default(), |store| {
        let t = store.create_table("t", TableOptions::new(DIM as u32)).unwrap();
        let keys: Vec<u64> = (0..KEYS).collect();
        t.push(&keys, &keys.iter().flat_map(|&k| row(k, 1)).collect::<Vec<_>>()).unwrap();
        store.checkpoint(1).unwrap();
    });
    let keep = StoreOptions::default().keep_checkpoints as u64;
    let client = Client::connect(&[served.addr.to_string()], ClientOptions::default()).unwrap();
    let t = client.table("t").unwrap();
    let mut got: HashMap<u64, Vec<f32>> = HashMap::new();
    let mut pages = 0;
    t.export_at(1, 64, |keys, rows| {
        pages += 1;
        if pages == 1 {
            // Retention passes checkpoint 1 several times over while the export is paged.
            let table = served.store.table("t").unwrap();
            for b in 2..=keep + 4 {
                let keys: Vec<u64> = (0..KEYS).collect();
                table.push(&keys, &keys.iter().flat_map(|&k| row(k, b)).collect::<Vec<_>>()).unwrap();
                served.store.checkpoint(b).unwrap();
            }
        }
        for (i, &k) in keys.iter().enumerate() {
            got.insert(k, rows[i * DIM..(i + 1) * DIM].to_vec());
        }
        Ok(())
    })
    .unwrap_or_else(|e| panic!("the export of checkpoint 1 failed after {pages} pages: {e}"));
    assert!(pages > 2, "the export took {pages} pages: too few to page past a retention");
    assert_eq!(got.len() as u64, KEYS);
    for (k, r) in &got {
        assert_eq!(r, &row(*k, 1), "key {k}: not its row at checkpoint 1");
    }
    // Checkpoint 1 is still held (the lease runs EXPORT_LEASE past the last page), and
    // so are the ones after it.
    let kept: Vec<u64> = served.store.checkpoints().unwrap().iter().map(|c| c.batch_id).collect();
    assert_eq!(kept.first(), Some(&1), "retained: {kept:?}");
    // A lease that has run out lets retention go on at the next checkpoint.
    served.ctx.export_leases.lock().clear();
    served.store.checkpoint(keep + 5).unwrap();
    let kept: Vec<u64> = served.store.checkpoints().unwrap().iter().map(|c| c.batch_id).collect();
    assert_eq!(kept.len() as u64, keep, "retained: {kept:?}");
}
