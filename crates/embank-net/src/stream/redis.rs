//! Redis Streams: partition `p` of topic `t` is the stream key `t.p`; each message is
//! one entry with the field `m` holding its bytes (`XADD t.p * m <bytes>`). A replica
//! reads with `XREAD COUNT n BLOCK ms STREAMS t.p <last id>`. Its position is
//! `<last id>@<entries read>`: the count gives the lag against `XINFO STREAM`'s
//! `entries-added`. Durability is the server's: run it with `appendonly yes`
//! (and `appendfsync always` to lose nothing acknowledged on a power cut).
//!
//! The publisher trims a stream with `XTRIM <key> MINID <id>` (Redis 6.2 or later), only
//! ever at the first entry of a full snapshot: a replica whose position was trimmed away
//! (`XINFO STREAM`'s `max-deleted-entry-id` is past it) reads on from the stream's first
//! entry, that snapshot, and an `XREAD` past a trim lands on one too.

use std::time::Duration;

use embank_core::{Error, Result};
use redis::Value;

use super::{unavailable, Polled, Sink, Source, Start, StreamConfig};

fn connect(c: &StreamConfig, timeout: Duration) -> Result<redis::Connection> {
    let client = redis::Client::open(c.brokers.as_str())
        .map_err(|e| Error::config(format!("updates: bad Redis URL {:?}: {e}", c.brokers)))?;
    // A signal landing in the connect or its handshake fails it with EINTR (seen once in a
    // CI run of `bench-stream`): that is no answer from the server, so try again.
    let mut interrupted = 0;
    let con = loop {
        match client.get_connection_with_timeout(timeout) {
            Ok(con) => break con,
            Err(e) if interrupted < 3 && is_interrupted(&e) => interrupted += 1,
            Err(e) => return Err(unavailable(format!("cannot connect to Redis at {}", c.brokers), e)),
        }
    };
    con.set_write_timeout(Some(timeout)).map_err(|e| unavailable("Redis socket".into(), e))?;
    con.set_read_timeout(Some(timeout)).map_err(|e| unavailable("Redis socket".into(), e))?;
    Ok(con)
}

/// Whether a Redis error is an interrupted system call (EINTR).
fn is_interrupted(e: &redis::RedisError) -> bool {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| io.kind() == std::io::ErrorKind::Interrupted)
}

/// Sends in pipelines of this many entries.
const PIPELINE: usize = 64;

pub struct RedisSink {
    config: StreamConfig,
    con: Option<redis::Connection>,
    partitions: u32,
    timeout: Duration,
    /// Per partition: whether the next entry's id is to be noted (see [`Sink::mark`]),
    /// and the id noted.
    marking: Vec<bool>,
    marked: Vec<Option<String>>,
}

impl RedisSink {
    pub fn connect(c: &StreamConfig, partitions: u32) -> Result<RedisSink> {
        let timeout = c.timeout()?;
        let con = connect(c, timeout)?;
        let n = partitions as usize;
        Ok(RedisSink {
            config: c.clone(),
            con: Some(con),
            partitions,
            timeout,
            marking: vec![false; n],
            marked: vec![None; n],
        })
    }

    fn con(&mut self) -> Result<&mut redis::Connection> {
        if self.con.is_none() {
            self.con = Some(connect(&self.config, self.timeout)?);
        }
        Ok(self.con.as_mut().unwrap())
    }
}

impl Sink for RedisSink {
    /// Each pipeline is acknowledged before the next is sent: when this returns the
    /// entries are in the server.
    fn send(&mut self, partition: u32, messages: Vec<Vec<u8>>) -> Result<()> {
        let key = format!("{}.{partition}", self.config.topic);
        for chunk in messages.chunks(PIPELINE) {
            let mut pipe = redis::pipe();
            for m in chunk {
                pipe.cmd("XADD").arg(&key).arg("*").arg("m").arg(m.as_slice());
            }
            let r: redis::RedisResult<Vec<String>> = pipe.query(self.con()?);
            match r {
                Ok(ids) => {
                    let p = partition as usize;
                    if self.marking.get(p) == Some(&true) {
                        self.marking[p] = false;
                        self.marked[p] = ids.into_iter().next();
                    }
                }
                Err(e) => {
                    self.con = None; // reconnect next time
                    return Err(unavailable(
                        format!("cannot append to Redis stream {key} at {}", self.config.brokers),
                        e,
                    ));
                }
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    fn partitions(&self) -> u32 {
        self.partitions
    }

    fn mark(&mut self) -> Result<()> {
        self.marking.iter_mut().for_each(|m| *m = true);
        self.marked.iter_mut().for_each(|m| *m = None);
        Ok(())
    }

    fn marked(&self) -> Vec<Option<String>> {
        self.marked.clone()
    }

    /// `XTRIM <key> MINID <place>`: exact (no `~`), so the stream begins at `place`.
    fn trim(&mut self, partition: u32, place: &str) -> Result<Option<u64>> {
        let key = format!("{}.{partition}", self.config.topic);
        let r: redis::RedisResult<u64> = redis::cmd("XTRIM").arg(&key).arg("MINID").arg(place).query(self.con()?);
        match r {
            Ok(n) => Ok(Some(n)),
            Err(e) => {
                self.con = None;
                Err(unavailable(
                    format!("cannot trim Redis stream {key} at {} (XTRIM MINID: Redis 6.2+)", self.config.brokers),
                    e,
                ))
            }
        }
    }
}

pub struct RedisSource {
    config: StreamConfig,
    con: Option<redis::Connection>,
    key: String,
    /// Id of the last entry read (`0-0`: none).
    last: String,
    read: u64,
    timeout: Duration,
}

impl RedisSource {
    pub fn connect(c: &StreamConfig, partition: u32) -> Result<RedisSource> {
        let timeout = c.timeout()?;
        Ok(RedisSource {
            config: c.clone(),
            con: None,
            key: format!("{}.{partition}", c.topic),
            last: "0-0".into(),
            read: 0,
            timeout,
        })
    }

    fn con(&mut self) -> Result<&mut redis::Connection> {
        if self.con.is_none() {
            self.con = Some(connect(&self.config, self.timeout)?);
        }
        Ok(self.con.as_mut().unwrap())
    }

    fn failed(&mut self, what: &str, e: redis::RedisError) -> Error {
        self.con = None;
        unavailable(format!("cannot {what} Redis stream {} at {}", self.key, self.config.brokers), e)
    }

    /// What `XINFO STREAM` says of the stream (all zero if it is missing).
    fn info(&mut self) -> Result<StreamInfo> {
        let key = self.key.clone();
        let r: redis::RedisResult<Value> = redis::cmd("XINFO").arg("STREAM").arg(&key).query(self.con()?);
        let mut info = StreamInfo { added: 0, length: 0, last: "0-0".into(), max_deleted: "0-0".into() };
        let v = match r {
            Ok(v) => v,
            Err(e) if e.to_string().contains("no such key") => return Ok(info),
            Err(e) => return Err(self.failed("inspect", e)),
        };
        let pairs: Vec<(Value, Value)> = match v {
            Value::Array(items) => items.chunks_exact(2).map(|p| (p[0].clone(), p[1].clone())).collect(),
            Value::Map(m) => m,
            _ => Vec::new(),
        };
        for (k, val) in pairs {
            match (text(&k).as_deref(), val) {
                (Some("entries-added"), Value::Int(n)) => info.added = n.max(0) as u64,
                (Some("length"), Value::Int(n)) => info.length = n.max(0) as u64,
                (Some("last-generated-id"), v) => info.last = text(&v).unwrap_or(info.last),
                (Some("max-deleted-entry-id"), v) => info.max_deleted = text(&v).unwrap_or(info.max_deleted),
                _ => {}
            }
        }
        Ok(info)
    }
}

/// The fields of `XINFO STREAM` a source uses.
struct StreamInfo {
    /// `entries-added`: entries ever appended.
    added: u64,
    /// `length`: entries there now (the others were trimmed).
    length: u64,
    /// `last-generated-id`.
    last: String,
    /// `max-deleted-entry-id` (Redis 7; `0-0` before): the newest entry trimmed.
    max_deleted: String,
}

impl StreamInfo {
    /// How many entries came before the first one still there.
    fn first_index(&self) -> u64 {
        self.added.saturating_sub(self.length)
    }
}

/// A stream entry id (`<ms>-<seq>`) as a pair that orders as Redis orders ids.
fn entry_id(id: &str) -> (u64, u64) {
    let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
    (ms.parse().unwrap_or(0), seq.parse().unwrap_or(0))
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

impl Source for RedisSource {
    fn seek(&mut self, position: Option<&str>, start: Start) -> Result<()> {
        match position {
            Some(p) => {
                let (id, n) = p.split_once('@').ok_or_else(|| {
                    Error::invalid(format!(
                        "{p:?} is not a Redis stream position (from a checkpoint of another transport?)"
                    ))
                })?;
                self.last = id.to_string();
                self.read = n.parse().map_err(|_| Error::invalid(format!("bad Redis stream position {p:?}")))?;
                let info = self.info()?;
                if entry_id(&info.max_deleted) > entry_id(id) {
                    // Entries after the position were trimmed: the stream now begins with
                    // a full snapshot (the publisher trims nowhere else), read from there.
                    tracing::warn!(
                        key = %self.key,
                        position = p,
                        first = info.first_index(),
                        "the stream was trimmed past this replica's position: reading on from its \
                         first entry, a full snapshot"
                    );
                    self.last = "0-0".into();
                    self.read = info.first_index();
                }
            }
            None => match start {
                Start::Earliest => {
                    self.last = "0-0".into();
                    self.read = self.info()?.first_index();
                }
                Start::Latest => {
                    let info = self.info()?;
                    self.last = info.last;
                    self.read = info.added;
                }
            },
        }
        Ok(())
    }

    fn poll(&mut self, max: usize, wait: Duration) -> Result<Vec<Polled>> {
        let (key, last) = (self.key.clone(), self.last.clone());
        let block_ms = wait.as_millis().max(1) as u64;
        let r: redis::RedisResult<Value> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(block_ms)
            .arg("STREAMS")
            .arg(&key)
            .arg(&last)
            .query(self.con()?);
        let v = r.map_err(|e| self.failed("read", e))?;
        let mut out = Vec::new();
        // [[key, [[id, [field, value, ...]], ...]]], or nil when nothing came.
        let Value::Array(streams) = v else { return Ok(out) };
        for s in streams {
            let Value::Array(kv) = s else { continue };
            let Some(Value::Array(entries)) = kv.into_iter().nth(1) else { continue };
            for e in entries {
                let Value::Array(mut parts) = e else { continue };
                if parts.len() != 2 {
                    continue;
                }
                let fields = parts.pop().unwrap();
                let id = text(&parts[0]).unwrap_or_default();
                let payload = match fields {
                    Value::Array(f) => f
                        .chunks_exact(2)
                        .find(|p| text(&p[0]).as_deref() == Some("m"))
                        .and_then(|p| match &p[1] {
                            Value::BulkString(b) => Some(b.clone()),
                            _ => None,
                        })
                        .unwrap_or_default(),
                    _ => Vec::new(),
                };
                self.read += 1;
                self.last = id.clone();
                out.push(Polled { position: format!("{id}@{}", self.read), payload });
            }
        }
        Ok(out)
    }

    fn lag(&mut self) -> Result<Option<u64>> {
        let info = self.info()?;
        // An XREAD past a trim skipped entries this count never saw: at most what the
        // stream holds is unread.
        self.read = self.read.max(info.first_index());
        Ok(Some(info.added.saturating_sub(self.read)))
    }
}
