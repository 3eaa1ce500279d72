#!/usr/bin/env bash
# Runs a one-node Kafka broker in KRaft mode (no ZooKeeper) from the jars that
# `make kafka-jars` put in tools/kafka/lib, for embank's update-stream tests and
# benchmarks. Usage: broker.sh DATA_DIR PORT [CONTROLLER_PORT]
# Listens on 127.0.0.1:PORT only. A DATA_DIR already formatted is reused (a restart
# keeps its topics and messages). Runs in the foreground: stop it with SIGTERM.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="$1"; port="$2"; cport="${3:-$((port + 1))}"
[ -d "$here/lib" ] || { echo "broker.sh: no $here/lib: run \`make kafka-jars\` first" >&2; exit 2; }
mkdir -p "$dir"
cat > "$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/logs
num.partitions=1
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
message.max.bytes=8388608
replica.fetch.max.bytes=8388608
log.retention.hours=-1
# The publisher trims a partition with DeleteRecords; Kafka frees a segment once all of it
# lies before the new start, checked every log.retention.check.interval.ms. Segments of a
# few checkpoints (not the default 1 GiB) make a trimmed stream's disk flat.
log.segment.bytes=8388608
log.retention.check.interval.ms=30000
log.flush.interval.messages=9223372036854775807
PROPS
cat > "$dir/log4j.properties" <<PROPS
log4j.rootLogger=WARN, file
log4j.appender.file=org.apache.log4j.FileAppender
log4j.appender.file.File=$dir/broker.log
log4j.appender.file.layout=org.apache.log4j.PatternLayout
log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n
PROPS
cp="$here/lib/*"
java_opts=(-Xms256m -Xmx1g -XX:+UseG1GC -Djava.awt.headless=true "-Dlog4j.configuration=file:$dir/log4j.properties")
if [ ! -e "$dir/logs/meta.properties" ]; then
  java "${java_opts[@]}" -cp "$cp" kafka.tools.StorageTool format -t "$(java -cp "$cp" kafka.tools.StorageTool random-uuid)" \
    -c "$dir/server.properties" >/dev/null
fi
exec java "${java_opts[@]}" -cp "$cp" kafka.Kafka "$dir/server.properties"
