//! `embank serve`: one shard of a networked store.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use embank_core::{Error, Store};
use embank_net::config::ServeConfig;
use embank_net::metrics::serve_admin;
use embank_net::stream::Replica;
use embank_net::Server;

const SAMPLE: &str = include_str!("../../../docs/serve.sample.toml");

#[derive(clap::Args, Debug)]
#[command(after_help = "Without --config, --store is required and every other setting takes its default \
    (loopback on port 7070, no admin endpoint). Stop with SIGTERM or Ctrl-C: the server stops accepting, \
    finishes requests in flight, flushes the store and exits 0.\n\n\
    Clients: embank.connect([\"127.0.0.1:7070\", ...]) in Python, or `embank bench --target tcp://...`.\n\n\
    With an [updates] section the server is a read-only replica: it applies one partition of the update \
    stream a training store publishes (Kafka or Redis Streams; store.publisher(...) or `embank publish`), \
    checkpoints at each commit marker, and after a crash resumes from its last one. \
    See --print-sample-config.")]
pub struct ServeArgs {
    /// TOML config file (print a commented one with --print-sample-config).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Store directory (overrides the config's `store`).
    #[arg(long)]
    pub store: Option<PathBuf>,
    /// Protocol address (overrides `listen`); port 0 picks a free port, printed at start.
    #[arg(long)]
    pub listen: Option<String>,
    /// Admin HTTP address for /metrics, /readyz and /livez (overrides `admin`).
    #[arg(long)]
    pub admin: Option<String>,
    /// Print a commented sample config and exit.
    #[arg(long)]
    pub print_sample_config: bool,
    /// Check the config and exit: every key, the tables' options, the TLS and token files,
    /// the listen address (a port, and a token and TLS off loopback), the declared tables'
    /// dims against an existing store's (read, not opened). 0 and "config ok" when `serve`
    /// would start, else the error naming what it would refuse.
    #[arg(long)]
    pub check_config: bool,
}

pub fn run(args: ServeArgs) -> Result<(), String> {
    if args.print_sample_config {
        print!("{SAMPLE}");
        return Ok(());
    }
    let mut config = match (&args.config, &args.store) {
        (Some(path), _) => ServeConfig::from_file(path).map_err(|e| e.to_string())?,
        (None, Some(store)) => {
            ServeConfig::parse(&format!("store = {:?}", store.display().to_string())).map_err(|e| e.to_string())?
        }
        (None, None) => return Err("give --config FILE (or at least --store DIR); see `embank serve --help`".into()),
    };
    if let Some(s) = args.store {
        config.store = s;
    }
    if let Some(l) = args.listen {
        config.listen = l;
    }
    if let Some(a) = args.admin {
        config.admin = Some(a);
    }
    if args.check_config {
        check(&config).map_err(|e| e.to_string())?;
        let what = match &config.updates {
            Some(u) => format!("a replica of {} (partition {})", u.stream.describe(), u.partition),
            None => "a primary".into(),
        };
        println!("config ok: {what} of store {}, {} table(s) declared", config.store.display(), config.tables.len());
        for d in &config.deprecated {
            println!("warning: {d}");
        }
        return Ok(());
    }
    serve(config).map_err(|e| e.to_string())
}

/// What `serve` checks before it listens, without opening the store or listening: the
/// options and their files, the listen address (port, token, TLS), and the declared
/// tables' dims against an existing store's catalog (read, not locked).
fn check(config: &ServeConfig) -> Result<(), Error> {
    let opts = config.server_options_loaded()?;
    Server::check_listen(&config.listen, &opts)?;
    let declared = config.table_options()?;
    if let Ok(have) = embank_core::catalog_tables(&config.store) {
        for (name, options) in declared {
            if let Some(m) = have.iter().find(|m| m.name == name) {
                if m.dim != options.dim {
                    return Err(Error::config(format!(
                        "table {name:?} exists in {} with dim {}, but the config says dim {}",
                        config.store.display(),
                        m.dim,
                        options.dim
                    )));
                }
            }
        }
    }
    Ok(())
}

fn serve(config: ServeConfig) -> Result<(), Error> {
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&shutdown)).map_err(|e| Error::io("cannot handle signals", e))?;
    }
    let store = Arc::new(Store::open(&config.store, config.store_options()?)?);
    if let Some(t) = &config.shared_tier {
        let tier = embank_net::redis_tier::RedisClusterTier::new(t).map_err(Error::config)?;
        store.set_shared_tier(Some(Arc::new(tier)))?;
    }
    let mut created = Vec::new();
    for (name, options) in config.table_options()? {
        match store.table(&name) {
            Ok(t) => {
                if t.dim() != options.dim as usize {
                    return Err(Error::config(format!(
                        "table {name:?} exists in {} with dim {}, but the config says dim {}",
                        config.store.display(),
                        t.dim(),
                        options.dim
                    )));
                }
            }
            Err(_) => {
                store.create_table(&name, options)?;
                created.push(name);
            }
        }
    }
    let server = Server::bind(&config.listen, Arc::clone(&store), config.server_options_loaded()?)?;
    let mut replica = match &config.updates {
        Some(u) => {
            let mut u = u.clone();
            u.bootstrap_token = config.token.clone();
            let r = Replica::start(Arc::clone(&store), u)?;
            let _ = server.metrics().replica.set(r.status_fn());
            server.set_view(r.view());
            Some(r)
        }
        None => None,
    };
    let mut admin_line = String::new();
    let admin = match &config.admin {
        Some(addr) => {
            let listener = std::net::TcpListener::bind(addr)
                .map_err(|e| Error::io(format!("cannot listen on admin {addr}"), e))?;
            let local = listener.local_addr().map_err(|e| Error::io("admin address", e))?;
            admin_line = format!(" (admin http://{local})");
            let (store, metrics, shutdown) = (Arc::clone(&store), server.metrics(), Arc::clone(&shutdown));
            Some(
                std::thread::Builder::new()
                    .name("embank-admin".into())
                    .spawn(move || serve_admin(listener, store, metrics, shutdown))
                    .map_err(|e| Error::io("cannot start the admin thread", e))?,
            )
        }
        None => None,
    };
    let tables = store.tables()?;
    let security = match &config.tls {
        Some(t) if t.client_ca_file.is_some() => ", TLS with client certificates",
        Some(_) => ", TLS",
        None => "",
    };
    let replica_line = match &config.updates {
        Some(u) => format!(", replica of {} partition {}", u.stream.describe(), u.partition),
        None => String::new(),
    };
    println!(
        "embank serve: listening on {}{admin_line}{security}, store {}, {} tables ({} created){replica_line}",
        server.local_addr(),
        config.store.display(),
        tables.len(),
        created.len()
    );
    let _ = std::io::stdout().flush();
    server.run(&shutdown, config.drain()?)?;
    if let Some(h) = admin {
        let _ = h.join();
    }
    if let Some(r) = replica.as_mut() {
        r.close();
    }
    eprintln!("embank serve: shutting down; flushing the store");
    store.close()?;
    println!("embank serve: stopped cleanly");
    let _ = std::io::stdout().flush();
    Ok(())
}
