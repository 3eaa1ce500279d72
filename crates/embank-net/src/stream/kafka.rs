//! Kafka through `rskafka`, a Kafka client in pure Rust: nothing to link, nothing to
//! compile but Rust, on any machine (the wheel and `make demo` need no system library).
//!
//! Ordering is kept by the sink, not by an idempotent producer. Within one checkpoint a
//! partition's row and delete messages commute (each key appears once), so up to
//! [`IN_FLIGHT_MAX`] produce requests of them are in flight at once (`acks=all`); a
//! reset (it must come first) and a commit marker (it must come last, after every
//! message before it is acknowledged) are barriers: the sink waits for what is in
//! flight, sends the barrier alone and waits for it too. The first request that fails
//! ends the send or flush with an error, so no commit ever follows a lost message. A
//! request that failed may still have been written (its answer was lost): the caller
//! sends the checkpoint again, and a replica skips what it already applied, so a repeat
//! is harmless.
//!
//! The replica's source reads its one partition from an offset it keeps itself (no
//! consumer group, nothing committed to Kafka): its position lives in its own checkpoints.
//!
//! The publisher trims a partition with `DeleteRecords`, only ever at the first message
//! of a full snapshot; a replica whose offset was trimmed away (the fetch answers
//! `OffsetOutOfRange`) reads on from the partition's earliest offset, that snapshot. The
//! topic's own retention (`retention.ms`, 7 days by default, and `retention.bytes`) cuts
//! anywhere instead: set both to -1 on the topic (`kafka-configs.sh --alter --entity-type
//! topics --entity-name <topic> --add-config retention.ms=-1,retention.bytes=-1`), as
//! `rskafka` creates topics without configs (docs/serve.sample.toml).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use embank_core::{Error, Result};
use rskafka::client::error::{Error as KafkaError, ProtocolError};
use rskafka::client::partition::{Compression, OffsetAt, PartitionClient, UnknownTopicHandling};
use rskafka::client::{Client, ClientBuilder};
use rskafka::record::Record;
use rskafka::BackoffConfig;
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use super::message::{Kind, MAGIC};
use super::{unavailable, Polled, Sink, Source, Start, StreamConfig};

/// Bytes of messages one produce request carries at most (a single larger message goes
/// alone). Kafka's default limit of a record batch is 1 MiB.
const REQUEST_BYTES_MAX: usize = 1 << 20;
/// Produce requests of one partition in flight at once: what waits for the broker is
/// at most `IN_FLIGHT_MAX` x [`REQUEST_BYTES_MAX`] per partition.
const IN_FLIGHT_MAX: usize = 4;
/// Bytes one fetch asks for at most.
const FETCH_BYTES_MAX: i32 = 16 << 20;

/// One small runtime per sink or source, with one worker (the sink's requests in flight
/// progress between calls); every call blocks on it, so the stream's threads stay the
/// plain threads they are for the other transports.
fn runtime(what: &str) -> Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("embank-kafka")
        .enable_all()
        .build()
        .map_err(|e| unavailable(format!("cannot start the Kafka client's runtime for {what}"), e))
}

/// Connects to the cluster; every request retries transient errors until `timeout`.
fn client(rt: &Runtime, c: &StreamConfig, timeout: Duration, what: &str) -> Result<Client> {
    let brokers: Vec<String> = c.brokers.split(',').map(|b| b.trim().to_owned()).filter(|b| !b.is_empty()).collect();
    let backoff = BackoffConfig {
        init_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(500),
        base: 2.0,
        deadline: Some(timeout),
    };
    let build = ClientBuilder::new(brokers).client_id("embank").backoff_config(backoff).build();
    block_on(rt, timeout, build, || format!("cannot reach Kafka at {what}"))
}

/// Runs `f` on `rt` for at most `timeout`.
fn block_on<T>(
    rt: &Runtime,
    timeout: Duration,
    f: impl std::future::Future<Output = std::result::Result<T, KafkaError>>,
    what: impl FnOnce() -> String,
) -> Result<T> {
    match rt.block_on(async { tokio::time::timeout(timeout, f).await }) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(unavailable(what(), e)),
        Err(_) => Err(unavailable(what(), format!("no answer within {timeout:?}"))),
    }
}

fn record(payload: Vec<u8>) -> Record {
    let ms = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
    Record {
        key: None,
        value: Some(payload),
        headers: Default::default(),
        timestamp: rskafka::chrono::DateTime::from_timestamp_millis(ms).unwrap_or_default(),
    }
}

/// A reset or a commit marker: it may not overtake, nor be overtaken by, another
/// message of its partition.
fn is_barrier(m: &[u8]) -> bool {
    m.len() > 6 && m[..4] == MAGIC && (m[6] == Kind::Reset as u8 || m[6] == Kind::Commit as u8)
}

type InFlight = JoinHandle<std::result::Result<Vec<i64>, KafkaError>>;

/// One partition's end of the sink.
struct Lane {
    client: Arc<PartitionClient>,
    /// Messages sent and not yet in a request, with their bytes.
    pending: Vec<Record>,
    pending_bytes: usize,
    /// Requests in flight, each with whether its first message is the marked one.
    in_flight: VecDeque<(InFlight, bool)>,
    /// Whether the next request's first message is to be marked (see [`Sink::mark`]), and
    /// the offset of the marked message once acknowledged.
    marking: bool,
    marked: Option<i64>,
}

pub struct KafkaSink {
    rt: Runtime,
    lanes: Vec<Lane>,
    topic: String,
    timeout: Duration,
    what: String,
}

impl KafkaSink {
    /// Connects, creates the topic with `partitions` partitions if it is missing
    /// (replication factor 1: create it yourself for a replicated cluster), and checks
    /// that it has at least that many.
    pub fn connect(c: &StreamConfig, partitions: u32) -> Result<KafkaSink> {
        let timeout = c.timeout()?;
        let what = c.describe();
        let rt = runtime(&what)?;
        let client = client(&rt, c, timeout, &what)?;
        let controller =
            client.controller_client().map_err(|e| unavailable(format!("cannot reach Kafka at {what}"), e))?;
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        match rt.block_on(async {
            tokio::time::timeout(timeout, controller.create_topic(c.topic.clone(), partitions as i32, 1, ms)).await
        }) {
            Ok(Ok(())) => {}
            Ok(Err(KafkaError::ServerError { protocol_error: ProtocolError::TopicAlreadyExists, .. })) => {}
            Ok(Err(e)) => return Err(unavailable(format!("cannot create Kafka topic {:?} at {what}", c.topic), e)),
            Err(_) => {
                return Err(unavailable(format!("cannot create Kafka topic {:?} at {what}", c.topic), "timed out"))
            }
        }
        let have = partition_count(&rt, &client, &c.topic, timeout, &what)?;
        if have < partitions {
            return Err(Error::config(format!(
                "Kafka topic {:?} has {have} partitions, the publisher needs {partitions} (one per serving shard)",
                c.topic
            )));
        }
        let mut lanes = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            let pc = client.partition_client(c.topic.clone(), p as i32, UnknownTopicHandling::Retry);
            let client = Arc::new(block_on(&rt, timeout, pc, || format!("cannot reach {what} partition {p}"))?);
            lanes.push(Lane {
                client,
                pending: Vec::new(),
                pending_bytes: 0,
                in_flight: VecDeque::new(),
                marking: false,
                marked: None,
            });
        }
        Ok(KafkaSink { rt, lanes, topic: c.topic.clone(), timeout, what })
    }

    /// Puts partition `p`'s pending messages in flight as one request, after waiting
    /// for the oldest request while [`IN_FLIGHT_MAX`] are.
    fn launch(&mut self, p: usize) -> Result<()> {
        if self.lanes[p].pending.is_empty() {
            return Ok(());
        }
        while self.lanes[p].in_flight.len() >= IN_FLIGHT_MAX {
            self.wait_oldest(p)?;
        }
        let lane = &mut self.lanes[p];
        let records = std::mem::take(&mut lane.pending);
        lane.pending_bytes = 0;
        let client = Arc::clone(&lane.client);
        let marks = std::mem::take(&mut lane.marking);
        lane.in_flight.push_back((
            self.rt.spawn(async move { client.produce(records, Compression::NoCompression).await }),
            marks,
        ));
        Ok(())
    }

    /// Waits for partition `p`'s oldest request in flight.
    fn wait_oldest(&mut self, p: usize) -> Result<()> {
        let Some((h, marks)) = self.lanes[p].in_flight.pop_front() else { return Ok(()) };
        let r = match self.rt.block_on(async { tokio::time::timeout(self.timeout, h).await }) {
            Ok(Ok(Ok(offsets))) => {
                if marks {
                    self.lanes[p].marked = offsets.first().copied();
                }
                Ok(())
            }
            Ok(Ok(Err(e))) => {
                Err(unavailable(format!("messages to {} partition {p} were not delivered", self.what), e))
            }
            Ok(Err(join)) => Err(unavailable(format!("sending to {} partition {p} failed", self.what), join)),
            Err(_) => Err(unavailable(
                format!("messages to {} partition {p} not acknowledged", self.what),
                format!("no answer within {:?}", self.timeout),
            )),
        };
        if r.is_err() {
            self.abandon();
        }
        r
    }

    /// Waits for everything partition `p` has in flight.
    fn drain(&mut self, p: usize) -> Result<()> {
        while !self.lanes[p].in_flight.is_empty() {
            self.wait_oldest(p)?;
        }
        Ok(())
    }

    /// After a failure: drops every pending message and request in flight (the caller
    /// sends the checkpoint again).
    fn abandon(&mut self) {
        for lane in &mut self.lanes {
            lane.pending.clear();
            lane.pending_bytes = 0;
            lane.marking = false;
            for (h, _) in lane.in_flight.drain(..) {
                h.abort();
            }
        }
    }
}

/// Partitions of `topic` (a topic just created shows up after a moment).
fn partition_count(rt: &Runtime, client: &Client, topic: &str, timeout: Duration, what: &str) -> Result<u32> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let topics = block_on(rt, timeout, client.list_topics(), || format!("cannot read Kafka metadata of {what}"))?;
        let n = topics.iter().find(|t| t.name == topic).map_or(0, |t| t.partitions.len() as u32);
        if n > 0 || std::time::Instant::now() > deadline {
            return Ok(n);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Sink for KafkaSink {
    fn send(&mut self, partition: u32, messages: Vec<Vec<u8>>) -> Result<()> {
        let p = partition as usize;
        if p >= self.lanes.len() {
            return Err(Error::invalid(format!(
                "partition {partition} of Kafka topic {:?}: the sink has {}",
                self.topic,
                self.lanes.len()
            )));
        }
        for m in messages {
            if is_barrier(&m) {
                // Everything before it acknowledged, then it alone, acknowledged too.
                self.launch(p)?;
                self.drain(p)?;
                self.lanes[p].pending.push(record(m));
                self.launch(p)?;
                self.drain(p)?;
                continue;
            }
            if self.lanes[p].pending_bytes + m.len() > REQUEST_BYTES_MAX {
                self.launch(p)?;
            }
            let lane = &mut self.lanes[p];
            lane.pending_bytes += m.len();
            lane.pending.push(record(m));
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        for p in 0..self.lanes.len() {
            self.launch(p)?;
        }
        for p in 0..self.lanes.len() {
            self.drain(p)?;
        }
        Ok(())
    }

    fn partitions(&self) -> u32 {
        self.lanes.len() as u32
    }

    fn mark(&mut self) -> Result<()> {
        for p in 0..self.lanes.len() {
            // What is pending goes first, so the next message begins a request.
            self.launch(p)?;
            self.lanes[p].marking = true;
            self.lanes[p].marked = None;
        }
        Ok(())
    }

    fn marked(&self) -> Vec<Option<String>> {
        self.lanes.iter().map(|l| l.marked.map(|o| o.to_string())).collect()
    }

    /// `DeleteRecords` up to `place` (an offset): the partition's earliest offset becomes it.
    fn trim(&mut self, partition: u32, place: &str) -> Result<Option<u64>> {
        let offset: i64 = place.parse().map_err(|_| Error::invalid(format!("{place:?} is not a Kafka offset")))?;
        let lane = self.lanes.get(partition as usize).ok_or_else(|| {
            Error::invalid(format!(
                "partition {partition} of Kafka topic {:?}: the sink has {}",
                self.topic,
                self.lanes.len()
            ))
        })?;
        let ms = self.timeout.as_millis().min(i32::MAX as u128) as i32;
        let client = Arc::clone(&lane.client);
        block_on(&self.rt, self.timeout, async move { client.delete_records(offset, ms).await }, || {
            format!("cannot trim {} partition {partition} (DeleteRecords)", self.what)
        })?;
        Ok(None)
    }
}

pub struct KafkaSource {
    rt: Runtime,
    client: PartitionClient,
    /// Offset of the next message to hand out.
    next: i64,
    /// Messages fetched and not handed out yet (a fetch returns whole record batches).
    fetched: VecDeque<(i64, Vec<u8>)>,
    timeout: Duration,
    what: String,
}

impl KafkaSource {
    pub fn connect(c: &StreamConfig, partition: u32) -> Result<KafkaSource> {
        let timeout = c.timeout()?;
        let what = format!("{} partition {partition}", c.describe());
        let rt = runtime(&what)?;
        let cl = client(&rt, c, timeout, &what)?;
        // A replica may start before its publisher created the topic: retry until then.
        let pc = cl.partition_client(c.topic.clone(), partition as i32, UnknownTopicHandling::Retry);
        let client = block_on(&rt, timeout, pc, || format!("cannot reach {what}"))?;
        Ok(KafkaSource { rt, client, next: 0, fetched: VecDeque::new(), timeout, what })
    }

    fn offset(&self, at: OffsetAt) -> Result<i64> {
        block_on(&self.rt, self.timeout, self.client.get_offset(at), || {
            format!("cannot read the offsets of {}", self.what)
        })
    }
}

impl Source for KafkaSource {
    fn seek(&mut self, position: Option<&str>, start: Start) -> Result<()> {
        self.fetched.clear();
        self.next = match position {
            Some(p) => p.parse().map_err(|_| {
                Error::invalid(format!("{p:?} is not a Kafka offset (from a checkpoint of another transport?)"))
            })?,
            None => self.offset(match start {
                Start::Earliest => OffsetAt::Earliest,
                Start::Latest => OffsetAt::Latest,
            })?,
        };
        Ok(())
    }

    fn poll(&mut self, max: usize, wait: Duration) -> Result<Vec<Polled>> {
        if self.fetched.is_empty() {
            let wait_ms = wait.as_millis().min(i32::MAX as u128) as i32;
            let fetch = self.client.fetch_records(self.next, 1..FETCH_BYTES_MAX, wait_ms);
            let fetched = self.rt.block_on(async { tokio::time::timeout(self.timeout + wait, fetch).await });
            if let Ok(Err(KafkaError::ServerError { protocol_error: ProtocolError::OffsetOutOfRange, .. })) = fetched {
                let earliest = self.offset(OffsetAt::Earliest)?;
                if self.next < earliest {
                    // Trimmed past this offset: the partition now begins with a full
                    // snapshot (the publisher trims nowhere else), read from there.
                    tracing::warn!(
                        what = %self.what,
                        offset = self.next,
                        earliest,
                        "the stream was trimmed past this replica's position: reading on from its \
                         earliest offset, a full snapshot"
                    );
                    self.next = earliest;
                    return Ok(Vec::new());
                }
            }
            let (records, _high) = match fetched {
                Ok(Ok(v)) => v,
                Ok(Err(e)) => return Err(unavailable(format!("cannot read {}", self.what), e)),
                Err(_) => {
                    return Err(unavailable(
                        format!("cannot read {}", self.what),
                        format!("no answer within {:?}", self.timeout + wait),
                    ))
                }
            };
            for r in records {
                if r.offset >= self.next {
                    self.fetched.push_back((r.offset, r.record.value.unwrap_or_default()));
                }
            }
        }
        let mut out = Vec::new();
        while out.len() < max {
            let Some((offset, payload)) = self.fetched.pop_front() else { break };
            self.next = offset + 1;
            out.push(Polled { position: self.next.to_string(), payload });
        }
        Ok(out)
    }

    fn lag(&mut self) -> Result<Option<u64>> {
        let high = self.offset(OffsetAt::Latest)?;
        Ok(Some(high.saturating_sub(self.next).max(0) as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::super::message::{self, CheckpointId};
    use super::*;

    #[test]
    fn resets_and_commits_are_barriers_rows_and_deletes_are_not() {
        let ck = CheckpointId { seq: 3, batch_id: 7, unix_micros: 1 };
        assert!(is_barrier(&message::encode_reset(ck, "t", 4)));
        assert!(is_barrier(&message::encode_commit(ck, 2)));
        assert!(!is_barrier(&message::encode_rows(ck, "t", 2, &[1], &[0.5, 1.5])));
        assert!(!is_barrier(&message::encode_deletes(ck, "t", &[9])));
        assert!(!is_barrier(b"not a message at all"));
    }
}
