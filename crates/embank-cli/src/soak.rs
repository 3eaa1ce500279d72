//! `embank soak`: a server under mixed load for a set time, watched.
//!
//! Starts `embank serve` (this binary) on a fresh store, then runs client threads
//! doing pulls, pushes and `push_grad`s against two tables, one thread that
//! checkpoints every few seconds, and one that keeps dropping its client and
//! connecting again. Every `--every` seconds it records the server's RSS, open
//! descriptors, the store's bytes on disk and the p50/p99 of the batches since the
//! last sample into a CSV, and draws them into a PNG at the end. The verdict line
//! compares RSS and descriptors after the warm-up (the first fifth) with the last
//! sample: the goal is flat within 5 %.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use embank_core::{Optimizer, TableOptions};
use embank_net::{Client, ClientOptions};
use plotters::prelude::*;
use rand::{Rng, SeedableRng};

#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Seconds to run.
    #[arg(long, default_value_t = 3600)]
    pub duration: u64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 10)]
    pub every: u64,
    /// Client threads doing pulls, pushes and push_grads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Keys per table (Zipf-ish: a quarter of the batches hit the first 1 %).
    #[arg(long, default_value_t = 1_000_000)]
    pub keys: u64,
    /// Directory for the store, the CSV and the PNG.
    #[arg(long, default_value = "soak-out")]
    pub out: PathBuf,
}

/// One sample.
struct Sample {
    seconds: f64,
    rss_bytes: u64,
    /// Anonymous memory (the heap): RSS less the pages of mapped files.
    anon_bytes: u64,
    fds: u64,
    disk_bytes: u64,
    batches: u64,
    p50_us: f64,
    p99_us: f64,
}

/// A `kB` line of `/proc/<pid>/status`, in bytes.
fn proc_status(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with(field)).map(|l| l.to_string()))
        .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .map_or(0, |kib| kib * 1024)
}

fn proc_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64)
}

fn disk_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.blocks() * 512,
            Err(_) => 0,
        })
        .sum()
}

fn percentile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize] as f64
}

/// A command that runs this program again (the `embank` binary, wherever it was started
/// from: `target/release`, a venv's `embank` script execs it too).
pub(crate) fn self_command() -> Result<Command, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    Ok(Command::new(exe))
}

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(out: &Path) -> Result<Server, String> {
        let config = out.join("soak.toml");
        std::fs::write(
            &config,
            format!("store = {:?}\nlisten = \"127.0.0.1:0\"\n", out.join("store").display().to_string()),
        )
        .map_err(|e| format!("cannot write {}: {e}", config.display()))?;
        let mut child = self_command()?
            .args(["serve", "--config"])
            .arg(&config)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start embank serve: {e}"))?;
        let mut line = String::new();
        BufReader::new(child.stdout.as_mut().expect("piped")).read_line(&mut line).map_err(|e| e.to_string())?;
        let addr = line
            .split("listening on ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .map(|a| a.trim_end_matches(',').to_string())
            .ok_or_else(|| format!("embank serve said {line:?}"))?;
        Ok(Server { child, addr })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

pub fn run(args: SoakArgs) -> Result<(), String> {
    if args.every == 0 || args.duration < args.every || args.threads == 0 || args.keys < 100 {
        return Err("soak: --every >= 1, --duration >= --every, --threads >= 1 and --keys >= 100".into());
    }
    std::fs::create_dir_all(&args.out).map_err(|e| format!("cannot create {}: {e}", args.out.display()))?;
    let _ = std::fs::remove_dir_all(args.out.join("store"));
    let server = Server::start(&args.out)?;
    let pid = server.child.id();
    let client =
        Client::connect(std::slice::from_ref(&server.addr), ClientOptions::default()).map_err(|e| e.to_string())?;
    let mut emb = TableOptions::new(64);
    emb.optimizer = Optimizer::Adagrad { lr: 0.05, eps: 1e-8, initial_accumulator_value: 0.0 };
    emb.capacity = args.keys;
    client.create_table("emb", emb).map_err(|e| e.to_string())?;
    let mut rows = TableOptions::new(128);
    rows.capacity = args.keys;
    client.create_table("rows", rows).map_err(|e| e.to_string())?;

    let stop = Arc::new(AtomicBool::new(false));
    let latencies = Arc::new(Mutex::new(Vec::<u64>::new()));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut handles = Vec::new();
    for t in 0..args.threads {
        let (client, stop, latencies, errors, keys) =
            (client.clone(), Arc::clone(&stop), Arc::clone(&latencies), Arc::clone(&errors), args.keys);
        handles.push(std::thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64);
            let (emb, rows) = (client.table("emb").unwrap(), client.table("rows").unwrap());
            let mut out = vec![0f32; 500 * 128];
            while !stop.load(Ordering::Relaxed) {
                let hot = rng.random_bool(0.25);
                let batch: Vec<u64> = (0..500)
                    .map(|_| if hot { rng.random_range(0..keys / 100) } else { rng.random_range(0..keys) })
                    .collect();
                let t0 = Instant::now();
                let r = match rng.random_range(0..10) {
                    0..=5 => rows.pull(&batch, &mut out[..500 * 128]),
                    6 => rows.push(&batch, &vec![0.5f32; 500 * 128]),
                    _ => emb
                        .pull(&batch, &mut out[..500 * 64])
                        .and_then(|()| emb.push_grad(&batch, &vec![0.01f32; 500 * 64])),
                };
                latencies.lock().unwrap().push(t0.elapsed().as_micros() as u64);
                if let Err(e) = r {
                    errors.lock().unwrap().push(e.to_string());
                }
            }
        }));
    }
    {
        // A client that keeps going away and coming back.
        let (addr, stop, errors) = (server.addr.clone(), Arc::clone(&stop), Arc::clone(&errors));
        handles.push(std::thread::spawn(move || {
            let mut out = vec![0f32; 10 * 128];
            while !stop.load(Ordering::Relaxed) {
                match Client::connect(std::slice::from_ref(&addr), ClientOptions::default()) {
                    Ok(c) => {
                        if let Err(e) = c.table("rows").and_then(|t| t.pull(&(0..10).collect::<Vec<u64>>(), &mut out)) {
                            errors.lock().unwrap().push(e.to_string());
                        }
                        drop(c); // connections closed without a goodbye
                    }
                    Err(e) => errors.lock().unwrap().push(e.to_string()),
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }));
    }
    {
        let (client, stop, errors) = (client.clone(), Arc::clone(&stop), Arc::clone(&errors));
        handles.push(std::thread::spawn(move || {
            let mut batch = 1u64;
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_secs(3));
                if let Err(e) = client.checkpoint(batch) {
                    errors.lock().unwrap().push(e.to_string());
                }
                batch += 1;
            }
        }));
    }

    let csv_path = args.out.join("soak.csv");
    let mut csv = std::fs::File::create(&csv_path).map_err(|e| format!("cannot create {}: {e}", csv_path.display()))?;
    writeln!(csv, "seconds,rss_bytes,anon_bytes,fds,disk_bytes,batches,p50_us,p99_us").map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut samples = Vec::new();
    let store_dir = args.out.join("store");
    while t0.elapsed() < Duration::from_secs(args.duration) {
        std::thread::sleep(Duration::from_secs(args.every));
        let mut lat = std::mem::take(&mut *latencies.lock().unwrap());
        lat.sort_unstable();
        let s = Sample {
            seconds: t0.elapsed().as_secs_f64(),
            rss_bytes: proc_status(pid, "VmRSS:"),
            anon_bytes: proc_status(pid, "RssAnon:"),
            fds: proc_fds(pid),
            disk_bytes: disk_bytes(&store_dir),
            batches: lat.len() as u64,
            p50_us: percentile(&lat, 0.5),
            p99_us: percentile(&lat, 0.99),
        };
        writeln!(
            csv,
            "{:.1},{},{},{},{},{},{:.0},{:.0}",
            s.seconds, s.rss_bytes, s.anon_bytes, s.fds, s.disk_bytes, s.batches, s.p50_us, s.p99_us
        )
        .map_err(|e| e.to_string())?;
        println!(
            "{:>7.0} s  rss {:>8.1} MiB (heap {:>7.1})  fds {:>4}  disk {:>8.1} MiB  {:>6} batches  p50 {:>6.0} us  p99 {:>7.0} us",
            s.seconds,
            s.rss_bytes as f64 / (1 << 20) as f64,
            s.anon_bytes as f64 / (1 << 20) as f64,
            s.fds,
            s.disk_bytes as f64 / (1 << 20) as f64,
            s.batches,
            s.p50_us,
            s.p99_us
        );
        samples.push(s);
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        let _ = h.join();
    }
    let errors = errors.lock().unwrap();
    let png = args.out.join("soak.png");
    draw(&samples, &png)?;
    let warm = samples.len() / 5;
    let (first, last) = (&samples[warm], samples.last().expect("at least one sample"));
    let drift = |a: u64, b: u64| if a == 0 { 0.0 } else { (b as f64 - a as f64) / a as f64 * 100.0 };
    println!(
        "soak: {} samples in {:.0} s; after warm-up (sample {}): RSS {:+.1} % (heap {:+.1} %), descriptors {:+.1} % (goal: within 5 %); {} errors{}; wrote {} and {}",
        samples.len(),
        last.seconds,
        warm + 1,
        drift(first.rss_bytes, last.rss_bytes),
        drift(first.anon_bytes, last.anon_bytes),
        drift(first.fds, last.fds),
        errors.len(),
        errors.first().map_or(String::new(), |e| format!(" (first: {e})")),
        csv_path.display(),
        png.display()
    );
    if errors.is_empty() {
        Ok(())
    } else {
        Err(format!("{} requests failed during the soak", errors.len()))
    }
}

/// A chart's title and the value it plots.
type Panel = (&'static str, fn(&Sample) -> f64);

fn draw(samples: &[Sample], path: &Path) -> Result<(), String> {
    embank_bench::plot::register_font()?;
    let err = |e: &dyn std::fmt::Display| format!("plot {}: {e}", path.display());
    let root = BitMapBackend::new(path, (1200, 1200)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((3, 2));
    let t_end = samples.last().map_or(1.0, |s| s.seconds).max(1.0);
    let panels: [Panel; 6] = [
        ("server RSS, MiB (with the mapped store)", |s| s.rss_bytes as f64 / (1 << 20) as f64),
        ("server heap (RssAnon), MiB", |s| s.anon_bytes as f64 / (1 << 20) as f64),
        ("open descriptors", |s| s.fds as f64),
        ("store on disk, MiB", |s| s.disk_bytes as f64 / (1 << 20) as f64),
        ("batch p99, us", |s| s.p99_us),
        ("batches per sample", |s| s.batches as f64),
    ];
    for (area, (title, f)) in areas.iter().zip(panels.iter()) {
        let top = samples.iter().map(f).fold(1.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .caption(*title, ("sans-serif", 18))
            .build_cartesian_2d(0f64..t_end, 0f64..top)
            .map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc("seconds").draw().map_err(|e| err(&e))?;
        chart
            .draw_series(LineSeries::new(
                samples.iter().map(|s| (s.seconds, f(s))),
                RGBColor(31, 119, 180).stroke_width(2),
            ))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}
