"""The bus: the layers between streamrl's stages and Kafka, and the loop every consuming stage runs.

Bytes (a transport: topic names, keys, values, headers; no record types, no metrics):

- ``base``: the interface both transports implement (``TopicPartition``, ``Message``, ...);
- ``kafka``: the Kafka client (confluent-kafka, librdkafka), wrapped; the only module that
  imports it (and ``streamrl.bench.bare_clients``, the benchmark's bare-client baselines);
- ``memory``: an in-process broker with the same interface (``bus.bootstrap_servers:
  memory://NAME``), for stage logic tested in milliseconds (``streamrl.testing.memory_bus``).

Records, on top (what stages use):

- ``client``: ``Bus`` (settings, picks the transport, builds clients), ``Producer``
  (``send(record)`` to its type's topic, dead letters, counters, ``on_delivery``), ``Consumer``;
- ``reader``: ``Reader``, reading topic ranges without a consumer group, with exact end offsets;
- ``checkpoint``: ``Checkpoint``, the ordered commit unit (flush outputs, save state, commit),
  which tracks the offsets taken and finished (``take``/``done``/``holds``);
- ``loop``: ``StageLoop``;
- ``lag``: ``ConsumerLag``, each stage's lag gauges, a checkpoint's ``on_commit`` (the runtime
  sets it as the bus's ``commit_observer``).

Client: confluent-kafka (librdkafka), chosen by measurement with distinct records (issue 24,
BENCHMARKS.md "Bus"): librdkafka compresses, batches and fetches in C threads, off the event
loop; aiokafka compressed lz4 on the loop at ~20 MB/s per core, and kafka-python is CPU-bound at
~5 MB/s. ``kafka`` says how its threads meet the event loop.

Delivery is at-least-once: a record's offset is committed only after everything it produced
(outputs or its dead letter) was acknowledged by the broker ("flush outputs, then commit").
Writes downstream must be idempotent: the learner de-duplicates by ``id``.
"""

from streamrl.bus.base import Admin, Delivery, Message, TopicPartition
from streamrl.bus.checkpoint import Checkpoint
from streamrl.bus.loop import StageLoop
from streamrl.bus.reader import Reader
from streamrl.bus.client import Bus, Consumer, Producer

__all__ = ["Admin", "Bus", "Checkpoint", "Consumer", "Delivery", "Message",
           "Producer", "Reader", "StageLoop", "TopicPartition"]
