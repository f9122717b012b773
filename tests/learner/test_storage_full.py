"""Issue 68: a full storage under the learner's checkpoints or the archive stops the stage with
one line naming the path (``StorageFull``, exit 2: the run stops instead of restarting it into
the same wall), the half-written files are given back, and the previous checkpoint stays the
latest. The storage fills for real: a child process under a file-size limit (``ulimit -f``,
``RLIMIT_FSIZE``: the kernel refuses the write with EFBIG, as a full device refuses it with
ENOSPC), so no root and no mount are needed."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap

from streamrl.errors import StorageFull, storage_full
from tests.helpers import ROOT

CHILD = textwrap.dedent('''
    import json, os, resource, signal, sys
    from pathlib import Path

    import pyarrow as pa

    from streamrl.archive.store import Writer
    from streamrl.errors import StorageFull, storage_full
    from streamrl.learner import checkpoint
    from streamrl.learner.checkpoint import full_storage_stops
    from streamrl.resume import LearnerState, latest_good

    root = Path(sys.argv[1])

    def weights(size):
        def write(tmp):
            (tmp / "policy").mkdir()
            (tmp / "policy" / "config.json").write_text("{}")
            with open(tmp / "optimizer.pt", "wb") as f:
                f.write(os.urandom(size))
        return write

    checkpoint.save(root / "ckpt", None, None, None, LearnerState(version=1), write=weights(1000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))
    out = {}
    try:
        with full_storage_stops("the checkpoint of version", 2, str(root / "ckpt"), "learner.keep_checkpoints"):
            checkpoint.save(root / "ckpt", None, None, None, LearnerState(version=2), write=weights(200_000))
    except StorageFull as exc:
        out["learner"] = str(exc)
    good = latest_good(root / "ckpt")
    out["latest"] = [good[0].name, good[1].version]
    out["ckpt_left"] = sorted(os.listdir(root / "ckpt"))
    table = pa.table({"timestamp_ms": list(range(1, 20001)), "blob": [os.urandom(16).hex() for _ in range(20000)]})
    try:
        Writer(str(root / "archive"), compression="none").write("rollouts", table)
    except OSError as exc:
        out["archive_full"] = storage_full(exc)
    out["archive_left"] = sorted(os.listdir(root / "archive" / "rollouts"))
    print(json.dumps(out))
''')


def test_a_full_storage_stops_the_learner_naming_it_and_keeps_the_last_checkpoint(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    msg = out["learner"]
    assert msg.startswith("learner: the checkpoint of version 2 did not fit in ") and str(tmp_path / "ckpt") in msg
    assert "File too large" in msg and "streamrl run --resume" in msg and "\n" not in msg
    assert out["latest"] == ["ckpt-00000001", 1] and out["ckpt_left"] == ["ckpt-00000001"]  # no half-written one
    assert out["archive_full"] is True and out["archive_left"] == []  # the failed file's bytes given back


def test_what_reads_as_a_full_storage():
    assert storage_full(OSError(errno.ENOSPC, "No space left on device"))
    assert storage_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    wrapped = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert storage_full(wrapped)  # safetensors' own error, the OS error in its message
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as exc:
            raise ValueError("writing failed") from exc
    except ValueError as outer:
        assert storage_full(outer)
    assert not storage_full(OSError(errno.EACCES, "Permission denied")) and not storage_full(None)
    assert issubclass(StorageFull, OSError)
