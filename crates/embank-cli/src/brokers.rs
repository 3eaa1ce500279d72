//! Local brokers for the update-stream tests and `embank bench-stream`: a
//! `redis-server` (append-only file, fsync always) and a one-node Kafka broker in KRaft
//! mode (tools/kafka/broker.sh over the jars `make kafka-jars` fetches), each on a free
//! loopback port with its data in a directory, killable and restartable in place.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which broker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    Redis,
    Kafka,
}

/// A broker process this crate started. Killed when dropped.
pub struct LocalBroker {
    pub kind: BrokerKind,
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// Where tools/kafka lives: `EMBANK_KAFKA_HOME`, else beside this source tree.
pub fn kafka_home() -> PathBuf {
    std::env::var_os("EMBANK_KAFKA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/kafka"))
}

fn free_port() -> u16 {
    // Two ports in a row for Kafka (broker and controller): pick one whose successor is free too.
    for _ in 0..100 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let port = l.local_addr().unwrap().port();
        if port < 65000 && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port pair")
}

impl LocalBroker {
    /// Starts a broker with its data under `dir` and waits until it accepts connections.
    pub fn start(kind: BrokerKind, dir: &Path) -> Result<LocalBroker, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let mut b = LocalBroker { kind, port: free_port(), dir: dir.to_owned(), child: None };
        b.spawn()?;
        Ok(b)
    }

    /// What a publisher or replica config names as `brokers`.
    pub fn brokers(&self) -> String {
        match self.kind {
            BrokerKind::Redis => format!("redis://127.0.0.1:{}", self.port),
            BrokerKind::Kafka => format!("127.0.0.1:{}", self.port),
        }
    }

    fn spawn(&mut self) -> Result<(), String> {
        let child = match self.kind {
            BrokerKind::Redis => Command::new("redis-server")
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "yes", "--appendfsync", "always"])
                .arg("--dir")
                .arg(&self.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| format!("cannot start redis-server ({e}); install it (apt-get install redis-server)"))?,
            BrokerKind::Kafka => {
                let script = kafka_home().join("broker.sh");
                if !kafka_home().join("lib").is_dir() {
                    return Err(format!(
                        "no Kafka jars in {}: run `make kafka-jars` (Maven fetches them)",
                        kafka_home().join("lib").display()
                    ));
                }
                Command::new("bash")
                    .arg(&script)
                    .arg(&self.dir)
                    .arg(self.port.to_string())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    // Its own process group: killing the group takes the JVM too.
                    .process_group(0)
                    .spawn()
                    .map_err(|e| format!("cannot start {}: {e}", script.display()))?
            }
        };
        self.child = Some(child);
        let limit = if self.kind == BrokerKind::Kafka { 90 } else { 10 };
        let deadline = Instant::now() + Duration::from_secs(limit);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!("{:?} broker exited at start ({status}); see {}", self.kind, self.dir.display()));
            }
            if Instant::now() > deadline {
                return Err(format!("{:?} broker not listening on {} after {limit} s", self.kind, self.port));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// The broker's process id (Kafka: the JVM's; broker.sh execs it), while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Where its data lives (Kafka: the partitions' logs under `logs/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// SIGKILLs the broker (its data stays).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = c.id() as i32;
            // SAFETY: signalling a process group this struct started.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and data.
    pub fn restart(&mut self) -> Result<(), String> {
        self.kill();
        self.spawn()
    }
}

impl Drop for LocalBroker {
    fn drop(&mut self) {
        self.kill();
    }
}

use std::os::unix::process::CommandExt as _;
