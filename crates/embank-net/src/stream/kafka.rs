//! Kafka through librdkafka (the `rdkafka` crate linked to the system library).
//!
//! The publisher's producer is idempotent with `acks=all`, so a message retried inside
//! librdkafka is neither repeated nor reordered; a checkpoint counts as sent only when
//! `flush` saw every delivery report succeed. The replica's consumer assigns its one
//! partition by hand (no consumer group, nothing committed to Kafka): its position
//! lives in its own checkpoints.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use embank_core::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message as _;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::{unavailable, Polled, Sink, Source, Start, StreamConfig};

/// Counts delivery failures and keeps the last one's reason.
#[derive(Default)]
struct Deliveries {
    failed: AtomicU64,
    last_error: Mutex<Option<String>>,
}

#[derive(Clone, Default)]
struct Ctx(Arc<Deliveries>);

impl ClientContext for Ctx {}

impl ProducerContext for Ctx {
    type DeliveryOpaque = ();
    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        if let Err((e, _)) = result {
            self.0.failed.fetch_add(1, Ordering::Relaxed);
            *self.0.last_error.lock() = Some(e.to_string());
        }
    }
}

pub struct KafkaSink {
    producer: BaseProducer<Ctx>,
    ctx: Ctx,
    topic: String,
    partitions: u32,
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
        let ms = timeout.as_millis().to_string();
        let mut cfg = ClientConfig::new();
        cfg.set("bootstrap.servers", &c.brokers)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .set("message.max.bytes", (16 << 20).to_string())
            // librdkafka's own buffer: the bound of what waits for the broker.
            .set("queue.buffering.max.kbytes", (256 << 10).to_string())
            .set("message.timeout.ms", &ms)
            .set("socket.timeout.ms", &ms);
        let ctx = Ctx::default();
        let producer: BaseProducer<Ctx> = cfg
            .create_with_context(ctx.clone())
            .map_err(|e| unavailable(format!("cannot create a Kafka producer for {what}"), e))?;
        let admin: AdminClient<DefaultClientContext> =
            cfg.create().map_err(|e| unavailable(format!("cannot create a Kafka admin client for {what}"), e))?;
        let topic = NewTopic::new(&c.topic, partitions as i32, TopicReplication::Fixed(1));
        let opts = AdminOptions::new().operation_timeout(Some(timeout)).request_timeout(Some(timeout));
        let created = futures_executor::block_on(admin.create_topics([&topic], &opts))
            .map_err(|e| unavailable(format!("cannot reach Kafka at {what}"), e))?;
        for r in created {
            match r {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((t, code)) => return Err(unavailable(format!("cannot create Kafka topic {t:?} at {what}"), code)),
            }
        }
        let sink = KafkaSink { producer, ctx, topic: c.topic.clone(), partitions, timeout, what };
        let have = sink.partition_count()?;
        if have < partitions {
            return Err(Error::config(format!(
                "Kafka topic {:?} has {have} partitions, the publisher needs {partitions} (one per serving shard)",
                sink.topic
            )));
        }
        Ok(sink)
    }

    fn partition_count(&self) -> Result<u32> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let md = self
                .producer
                .client()
                .fetch_metadata(Some(&self.topic), self.timeout)
                .map_err(|e| unavailable(format!("cannot read Kafka metadata of {}", self.what), e))?;
            let n = md.topics().first().map_or(0, |t| t.partitions().len() as u32);
            // A topic just created shows up after a moment.
            if n > 0 || Instant::now() > deadline {
                return Ok(n);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Sink for KafkaSink {
    fn send(&mut self, partition: u32, messages: Vec<Vec<u8>>) -> Result<()> {
        for m in &messages {
            let deadline = Instant::now() + self.timeout;
            loop {
                let record = BaseRecord::<(), [u8]>::to(&self.topic).partition(partition as i32).payload(m.as_slice());
                match self.producer.send(record) {
                    Ok(()) => break,
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _))
                        if Instant::now() < deadline =>
                    {
                        self.producer.poll(Duration::from_millis(20));
                    }
                    Err((e, _)) => {
                        return Err(unavailable(
                            format!("cannot queue a message for {} partition {partition}", self.what),
                            e,
                        ))
                    }
                }
            }
            self.producer.poll(Duration::ZERO);
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let flushed = self.producer.flush(self.timeout);
        let failed = self.ctx.0.failed.swap(0, Ordering::Relaxed);
        if failed > 0 {
            let why = self.ctx.0.last_error.lock().take().unwrap_or_default();
            return Err(unavailable(format!("{failed} messages were not delivered to {}", self.what), why));
        }
        flushed.map_err(|e| {
            Error::new(
                ErrorKind::Unavailable,
                format!("messages to {} not acknowledged within {:?}: {e}", self.what, self.timeout),
            )
        })
    }

    fn partitions(&self) -> u32 {
        self.partitions
    }
}

pub struct KafkaSource {
    consumer: BaseConsumer,
    topic: String,
    partition: i32,
    /// Offset of the next message to read.
    next: i64,
    timeout: Duration,
    what: String,
}

impl KafkaSource {
    pub fn connect(c: &StreamConfig, partition: u32) -> Result<KafkaSource> {
        let timeout = c.timeout()?;
        let what = format!("{} partition {partition}", c.describe());
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &c.brokers)
            .set("group.id", "embank-replica")
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "false")
            .set("allow.auto.create.topics", "false")
            .set("fetch.message.max.bytes", (16 << 20).to_string())
            .set("socket.timeout.ms", timeout.as_millis().to_string())
            .create()
            .map_err(|e| unavailable(format!("cannot create a Kafka consumer for {what}"), e))?;
        Ok(KafkaSource { consumer, topic: c.topic.clone(), partition: partition as i32, next: 0, timeout, what })
    }
}

impl Source for KafkaSource {
    fn seek(&mut self, position: Option<&str>, start: Start) -> Result<()> {
        let offset = match position {
            Some(p) => {
                let n: i64 = p.parse().map_err(|_| {
                    Error::invalid(format!("{:?} is not a Kafka offset (from a checkpoint of another transport?)", p))
                })?;
                self.next = n;
                Offset::Offset(n)
            }
            None => match start {
                Start::Earliest => Offset::Beginning,
                Start::Latest => Offset::End,
            },
        };
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.topic, self.partition, offset)
            .map_err(|e| unavailable(format!("cannot seek {}", self.what), e))?;
        self.consumer.assign(&tpl).map_err(|e| unavailable(format!("cannot assign {}", self.what), e))?;
        if position.is_none() {
            let (low, high) = self.watermarks()?;
            self.next = if start == Start::Earliest { low } else { high };
        }
        Ok(())
    }

    fn poll(&mut self, max: usize, wait: Duration) -> Result<Vec<Polled>> {
        let mut out = Vec::new();
        let mut wait = wait;
        while out.len() < max {
            match self.consumer.poll(wait) {
                None => break,
                Some(Err(e)) => {
                    if out.is_empty() {
                        return Err(unavailable(format!("cannot read {}", self.what), e));
                    }
                    break;
                }
                Some(Ok(m)) => {
                    self.next = m.offset() + 1;
                    out.push(Polled { position: self.next.to_string(), payload: m.payload().unwrap_or(&[]).to_vec() });
                }
            }
            wait = Duration::ZERO;
        }
        Ok(out)
    }

    fn lag(&mut self) -> Result<Option<u64>> {
        let (_, high) = self.watermarks()?;
        Ok(Some(high.saturating_sub(self.next).max(0) as u64))
    }
}

impl KafkaSource {
    fn watermarks(&self) -> Result<(i64, i64)> {
        self.consumer
            .fetch_watermarks(&self.topic, self.partition, self.timeout)
            .map_err(|e| unavailable(format!("cannot read the offsets of {}", self.what), e))
    }
}
