//! `embank reshard` on real stores: two shards trained past a checkpoint, resharded to
//! three at it, hold every row and optimizer state of the checkpoint, routed as clients
//! route, and train on exactly as the two restored shards do; bad inputs are refused
//! with what is wrong and nothing written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use embank_core::{Initializer, MediumKind, Optimizer, Placement, Store, StoreOptions, TableOptions};
use embank_net::proto::shard_of;

/// Keys of the tables: every one on the source its shard hash names.
const KEYS: u64 = 3000;
const BATCH: u64 = 10;
const META: &[u8] = b"trainer position: epoch 0, batch 10";

fn embank(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_embank")).args(args).output().unwrap()
}

fn open(dir: &Path) -> Store {
    Store::open(dir, StoreOptions::default()).unwrap()
}

/// (table, dim, optimizer, medium): Adagrad on the mapped medium, Adam on the block one
/// (behind the row cache: a placement the targets must be able to create).
fn tables() -> Vec<(&'static str, u32, Optimizer, MediumKind)> {
    vec![
        ("ada", 8, Optimizer::Adagrad { lr: 0.05, eps: 1e-8, initial_accumulator_value: 0.1 }, MediumKind::Mmap),
        ("adam", 4, Optimizer::Adam { lr: 0.01, beta1: 0.9, beta2: 0.999, eps: 1e-8 }, MediumKind::Block),
    ]
}

/// A deterministic gradient for (step, key, element).
fn grads(step: u64, keys: &[u64], dim: usize) -> Vec<f32> {
    let mut g = Vec::with_capacity(keys.len() * dim);
    for &k in keys {
        for e in 0..dim as u64 {
            let x = (k.wrapping_mul(2654435761).wrapping_add(step * 97 + e * 13) % 2001) as f32;
            g.push((x - 1000.0) / 1000.0);
        }
    }
    g
}

/// Training steps `steps` on a set of shard stores: every key of each step pulled (rows
/// created where missing) and its gradient pushed, on the shard it routes to.
fn train(stores: &[Store], steps: std::ops::Range<u64>) {
    let n = stores.len() as u32;
    for step in steps {
        // A stride through the key space, and keys beyond it: new rows too.
        let keys: Vec<u64> = (0..400).map(|i| (i * 7 + step * 131) % (KEYS + 500)).collect();
        for (name, dim, _, _) in tables() {
            let dim = dim as usize;
            for (s, store) in stores.iter().enumerate() {
                let mine: Vec<u64> = keys.iter().copied().filter(|&k| shard_of(k, n) == s as u32).collect();
                let t = store.table(name).unwrap();
                let mut rows = vec![0f32; mine.len() * dim];
                t.pull(&mine, &mut rows).unwrap();
                t.push_grad(&mine, &grads(step, &mine, dim)).unwrap();
            }
        }
    }
}

/// Two shard stores trained to checkpoint `BATCH` (with `META`), then on: more steps,
/// deletes, a learning rate change; the first also takes a later checkpoint the second
/// lacks.
fn two_trained_shards(root: &Path) -> Vec<PathBuf> {
    let dirs: Vec<PathBuf> = (0..2).map(|i| root.join(format!("src{i}"))).collect();
    let stores: Vec<Store> = dirs.iter().map(|d| open(d)).collect();
    for store in &stores {
        for (name, dim, optimizer, medium) in tables() {
            let placement = if medium == MediumKind::Block { Placement::Cache } else { Placement::Auto };
            let options = TableOptions {
                placement,
                init: Initializer::Uniform { low: -0.1, high: 0.1 },
                seed: 7,
                capacity: 4096,
                optimizer,
                medium,
                ..TableOptions::new(dim)
            };
            store.create_table(name, options).unwrap();
        }
    }
    train(&stores, 0..6);
    for s in &stores {
        s.checkpoint_with_meta(BATCH, META).unwrap();
    }
    train(&stores, 6..10);
    let gone: Vec<u64> = (0..KEYS).step_by(17).collect();
    for (i, s) in stores.iter().enumerate() {
        let mine: Vec<u64> = gone.iter().copied().filter(|&k| shard_of(k, 2) == i as u32).collect();
        s.table("ada").unwrap().delete(&mine).unwrap();
        s.table("adam").unwrap().set_lr(0.02).unwrap();
    }
    stores[0].checkpoint(BATCH + 10).unwrap();
    train(&stores, 10..12);
    for s in stores {
        s.close().unwrap();
    }
    dirs
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), &dest).unwrap();
        }
    }
}

/// Records by (table, key): the shard each was found on, the row then optimizer state.
type Records = BTreeMap<(String, u64), (usize, Vec<f32>)>;

/// Every record (row, then optimizer state) of every table of a set of stores, by
/// (table, key), with the shard each was found on.
fn records(stores: &[Store]) -> Records {
    let mut out = BTreeMap::new();
    for (s, store) in stores.iter().enumerate() {
        for name in store.tables().unwrap() {
            let t = store.table(&name).unwrap();
            let mut keys = Vec::new();
            t.export(1024, |k, _| {
                keys.extend_from_slice(k);
                Ok(())
            })
            .unwrap();
            let w = t.dim() + t.state_len();
            let mut recs = vec![0f32; keys.len() * w];
            let mut found = vec![false; keys.len()];
            t.lookup_with_state(&keys, &mut recs, &mut found).unwrap();
            assert!(found.iter().all(|&f| f));
            for (i, &k) in keys.iter().enumerate() {
                let old = out.insert((name.clone(), k), (s, recs[i * w..(i + 1) * w].to_vec()));
                assert!(old.is_none(), "key {k} of {name} on two shards");
            }
        }
    }
    out
}

/// What a store holds: its checkpoints (batch id, metadata) and every record.
fn fingerprint(dir: &Path) -> (Vec<(u64, Vec<u8>)>, Records) {
    let store = open(dir);
    let kept = store.checkpoints().unwrap().into_iter().map(|c| (c.batch_id, c.meta)).collect();
    let recs = records(std::slice::from_ref(&store));
    store.close().unwrap();
    (kept, recs)
}

fn assert_same_records(a: &Records, b: &Records) {
    assert_eq!(a.len(), b.len());
    for ((key, (_, ra)), (key_b, (_, rb))) in a.iter().zip(b) {
        assert_eq!(key, key_b);
        assert_eq!(
            ra.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            rb.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{key:?}"
        );
    }
}

#[test]
fn two_shards_resharded_to_three_at_a_checkpoint_train_on_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let src = two_trained_shards(tmp.path());
    // The sources as they are (past the checkpoint), kept aside to restore later.
    let kept: Vec<PathBuf> = (0..2).map(|i| tmp.path().join(format!("kept{i}"))).collect();
    for (s, k) in src.iter().zip(&kept) {
        copy_dir(s, k);
    }
    let dst: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("dst{i}"))).collect();
    std::fs::create_dir_all(&dst[1]).unwrap(); // an empty directory is a fine target
    let mut args = vec!["reshard", "--chunk-keys", "100", "--from"];
    args.extend(src.iter().map(|p| p.to_str().unwrap()));
    args.push("--to");
    args.extend(dst.iter().map(|p| p.to_str().unwrap()));
    let out = embank(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // The default checkpoint: the newest both retain (the first also retains BATCH + 10).
    assert!(stderr.contains(&format!("resharded 2 -> 3 stores at checkpoint {BATCH}: 2 tables")), "{stderr}");

    // The sources: as they were.
    for (s, k) in src.iter().zip(&kept) {
        assert_eq!(fingerprint(s), fingerprint(k));
    }
    // At the checkpoint, as the sources give it without a restore: rows.
    let sources: Vec<Store> = src.iter().map(|d| open(d)).collect();
    let targets: Vec<Store> = dst.iter().map(|d| open(d)).collect();
    let on_targets = records(&targets);
    for ((name, key), (shard, rec)) in &on_targets {
        assert_eq!(*shard as u32, shard_of(*key, 3), "key {key} of {name} on target {shard}");
        let t = sources[0].table(name).unwrap();
        let (mut row, mut found) = (vec![0f32; t.dim()], [false]);
        sources[shard_of(*key, 2) as usize].lookup_checkpoint(name, BATCH, &[*key], &mut row, &mut found).unwrap();
        assert!(found[0], "key {key} of {name} was not there at the checkpoint");
        assert_eq!(&rec[..t.dim()], &row[..]);
    }
    for s in sources {
        s.close().unwrap();
    }
    // The targets: the checkpoint with its metadata, the tables' options.
    let restored: Vec<Store> = kept.iter().map(|d| open(d)).collect();
    for s in &restored {
        s.restore(BATCH).unwrap();
    }
    for t in &targets {
        let c = t.checkpoints().unwrap();
        assert_eq!(c.iter().map(|c| (c.batch_id, c.meta.as_slice())).collect::<Vec<_>>(), vec![(BATCH, META)]);
        for (name, ..) in tables() {
            let (a, b) = (t.table(name).unwrap().meta(), restored[0].table(name).unwrap().meta());
            assert_eq!(
                (a.dim, a.dtype, a.init, a.seed, a.optimizer, a.medium, a.placement),
                (b.dim, b.dtype, b.init, b.seed, b.optimizer, b.medium, b.placement)
            );
        }
    }
    assert!(matches!(targets[0].table("adam").unwrap().optimizer(), Optimizer::Adam { lr, .. } if lr == 0.02));
    // Every record (row and state) of the restored sources, and nothing more.
    let at_checkpoint = records(&restored);
    assert!(at_checkpoint.len() > KEYS as usize, "{}", at_checkpoint.len());
    assert_same_records(&at_checkpoint, &on_targets);
    // Training on: the same steps on both sets give the same rows and states.
    train(&restored, 100..108);
    train(&targets, 100..108);
    assert_same_records(&records(&restored), &records(&targets));
}

/// Runs a reshard that must fail; returns its stderr after checking that the sources
/// hold what they held and no target was left behind.
fn refused(src: &[PathBuf], dst: &[PathBuf], extra: &[&str]) -> String {
    let before: Vec<_> = src.iter().map(|d| fingerprint(d)).collect();
    let mut args = vec!["reshard", "--from"];
    args.extend(src.iter().map(|p| p.to_str().unwrap()));
    args.push("--to");
    args.extend(dst.iter().map(|p| p.to_str().unwrap()));
    args.extend_from_slice(extra);
    let out = embank(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    let after: Vec<_> = src.iter().map(|d| fingerprint(d)).collect();
    assert!(before == after, "a refused reshard changed a source");
    stderr
}

#[test]
fn bad_inputs_are_refused_with_what_is_wrong_and_nothing_written() {
    let tmp = tempfile::tempdir().unwrap();
    let src = two_trained_shards(tmp.path());
    let dst: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("dst{i}"))).collect();
    let gone = |d: &[PathBuf]| d.iter().all(|p| !p.exists());

    // A checkpoint some source does not retain: what each one retains.
    let e = refused(&src, &dst, &["--checkpoint", &(BATCH + 10).to_string()]);
    assert!(e.contains(&format!("checkpoint {} is not retained by every source", BATCH + 10)), "{e}");
    assert!(
        e.contains(&format!("src0 retains [{BATCH}, {}]", BATCH + 10))
            && e.contains(&format!("src1 retains [{BATCH}]")),
        "{e}"
    );
    assert!(gone(&dst));

    // A target that is not empty: named, and left as it was.
    std::fs::create_dir_all(&dst[2]).unwrap();
    std::fs::write(dst[2].join("precious"), b"x").unwrap();
    let e = refused(&src, &dst, &[]);
    assert!(e.contains(&format!("target {} is not empty", dst[2].display())), "{e}");
    assert_eq!(std::fs::read(dst[2].join("precious")).unwrap(), b"x");
    std::fs::remove_dir_all(&dst[2]).unwrap();

    // A source that is also a target.
    let e = refused(&src, &[dst[0].clone(), src[1].clone()], &[]);
    assert!(e.contains("named twice"), "{e}");

    // Checkpoint metadata that differs: not one coordinated checkpoint.
    let odd = tmp.path().join("odd");
    {
        let s = open(&odd);
        for (name, dim, optimizer, medium) in tables() {
            s.create_table(name, TableOptions { optimizer, medium, ..TableOptions::new(dim) }).unwrap();
        }
        s.checkpoint_with_meta(BATCH, b"another run").unwrap();
    }
    let e = refused(&[src[0].clone(), odd.clone()], &dst, &[]);
    assert!(e.contains(&format!("the metadata of checkpoint {BATCH} differs")), "{e}");
    assert!(gone(&dst));

    // A table whose dim differs between the sources.
    let other = tmp.path().join("other");
    {
        let s = open(&other);
        for (name, dim, optimizer, medium) in tables() {
            let dim = if name == "ada" { dim * 2 } else { dim };
            s.create_table(name, TableOptions { optimizer, medium, ..TableOptions::new(dim) }).unwrap();
        }
        s.checkpoint_with_meta(BATCH, META).unwrap();
    }
    let e = refused(&[src[0].clone(), other], &dst, &[]);
    assert!(e.contains("table \"ada\": its dim differs between") && e.contains("(8) and") && e.contains("(16)"), "{e}");
    assert!(gone(&dst));

    // A key on two sources (two copies of one shard): caught by the count, targets emptied.
    let twin = tmp.path().join("twin");
    copy_dir(&src[0], &twin);
    let e = refused(&[src[0].clone(), twin], &dst, &[]);
    assert!(e.contains("a key is on two sources") && e.contains("the targets were emptied again"), "{e}");
    assert!(gone(&dst));
}
