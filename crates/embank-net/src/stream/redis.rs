//! Redis Streams: partition `p` of topic `t` is the stream key `t.p`; each message is
//! one entry with the field `m` holding its bytes (`XADD t.p * m <bytes>`). A replica
//! reads with `XREAD COUNT n BLOCK ms STREAMS t.p <last id>`. Its position is
//! `<last id>@<entries read>`: the count gives the lag against `XINFO STREAM`'s
//! `entries-added`. Durability is the server's: run it with `appendonly yes`
//! (and `appendfsync always` to lose nothing acknowledged on a power cut).

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
}

impl RedisSink {
    pub fn connect(c: &StreamConfig, partitions: u32) -> Result<RedisSink> {
        let timeout = c.timeout()?;
        let con = connect(c, timeout)?;
        Ok(RedisSink { config: c.clone(), con: Some(con), partitions, timeout })
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
            if let Err(e) = r {
                self.con = None; // reconnect next time
                return Err(unavailable(format!("cannot append to Redis stream {key} at {}", self.config.brokers), e));
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

    /// `entries-added` and `last-generated-id` of the stream (0 and `0-0` if it is missing).
    fn info(&mut self) -> Result<(u64, String)> {
        let key = self.key.clone();
        let r: redis::RedisResult<Value> = redis::cmd("XINFO").arg("STREAM").arg(&key).query(self.con()?);
        let v = match r {
            Ok(v) => v,
            Err(e) if e.to_string().contains("no such key") => return Ok((0, "0-0".into())),
            Err(e) => return Err(self.failed("inspect", e)),
        };
        let (mut added, mut last) = (0, "0-0".to_string());
        let pairs: Vec<(Value, Value)> = match v {
            Value::Array(items) => items.chunks_exact(2).map(|p| (p[0].clone(), p[1].clone())).collect(),
            Value::Map(m) => m,
            _ => Vec::new(),
        };
        for (k, val) in pairs {
            match (text(&k).as_deref(), val) {
                (Some("entries-added"), Value::Int(n)) => added = n.max(0) as u64,
                (Some("last-generated-id"), v) => last = text(&v).unwrap_or(last),
                _ => {}
            }
        }
        Ok((added, last))
    }
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
            }
            None => match start {
                Start::Earliest => {
                    self.last = "0-0".into();
                    self.read = 0;
                }
                Start::Latest => {
                    let (added, last) = self.info()?;
                    self.last = last;
                    self.read = added;
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
        let (added, _) = self.info()?;
        Ok(Some(added.saturating_sub(self.read)))
    }
}
