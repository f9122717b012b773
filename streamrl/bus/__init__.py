"""The bus: the thin transport layer between streamrl and Kafka, and the loop every consuming
stage runs.

- ``transport``: the Kafka client, wrapped (``Bus``, ``Producer``, ``Consumer``, ``Admin``); the
  only module that imports aiokafka (``_bare`` too: the benchmark's bare-client baseline);
- ``reader``: ``Reader``, reading topic ranges without a consumer group, with exact end offsets;
- ``checkpoint``: ``Checkpoint``, the ordered commit unit (flush outputs, save state, commit);
- ``loop``: ``StageLoop``.

Client: aiokafka (native asyncio). Measured in DESIGN.md and ``streamrl bench bus``: ~90 MB/s of
32 KB records on 2 cores, a group member gets its first record in ~3 s with a 6 s session;
confluent-kafka is faster on raw bytes but its asyncio story is callbacks on threads, and
kafka-python is CPU-bound at ~5 MB/s.

Delivery is at-least-once: a record's offset is committed only after everything it produced
(outputs or its dead letter) was acknowledged by the broker ("flush outputs, then commit").
Writes downstream must be idempotent: the learner de-duplicates by ``id``.
"""

from streamrl.bus.checkpoint import Checkpoint
from streamrl.bus.loop import DeadLetterError, StageLoop
from streamrl.bus.reader import Reader
from streamrl.bus.transport import Admin, Bus, Consumer, Delivery, Message, Producer, TopicPartition

__all__ = ["Admin", "Bus", "Checkpoint", "Consumer", "DeadLetterError", "Delivery", "Message",
           "Producer", "Reader", "StageLoop", "TopicPartition"]
