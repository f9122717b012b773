"""The weights store as a long run's storage damages it (issue 68): a version is read only once it
is whole (its manifest, written last, read first), and a damaged chain is one line naming the
version, the file and what is wrong, never wrong weights and never a traceback.

Each case damages a copy of one real chain (the learner's trainer, ``DeltaWriter``: v1 full,
v2-v4 deltas, v5 full, v6-v7 deltas) the way storage does (a flipped byte, a truncated file, a
missing directory, a manifest never written) and reads it through ``streamrl export`` (the CLI, in
this process), the reader every other one shares (``weights_path``: rollout workers, the eval
stage), and a teacher's ``local_policy``.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from streamrl import cli, weights
from streamrl.errors import StreamrlError
from streamrl.weights import WeightLoadError, delta
from tests.core.weights_chain import same_files, train_chain

DELTA = f"model.safetensors{delta.SUFFIX}"


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, Path]:
    return train_chain(tmp_path_factory.mktemp("chain"), "float32")


@pytest.fixture
def run(chain, tmp_path, monkeypatch) -> Path:
    """A run directory holding a fresh copy of the chain, and this test's own reader state."""
    monkeypatch.setenv("STREAMRL_WEIGHTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "reconstructor", delta.Reconstructor())
    shutil.copytree(chain[0], tmp_path / "run" / "weights")
    return tmp_path / "run"


def export(run: Path, out: Path, capsys, *version: int) -> tuple[int, str]:
    """``streamrl export RUN OUT [--version N]``: its exit status and what it printed on stderr."""
    args = ["export", str(run), str(out), *(["--version", str(version[0])] if version else [])]
    rc = cli.main(args)
    return rc, capsys.readouterr().err


def refused(rc: int, err: str, *names: str) -> str:
    """One line, exit 2, naming each of ``names``; nothing exported."""
    assert rc == 2 and "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def test_a_flipped_byte_in_a_delta_names_it(run, tmp_path, capsys):
    frame = run / "weights" / "v3" / DELTA
    data = bytearray(frame.read_bytes())
    data[len(data) // 2] ^= 0xFF
    frame.write_bytes(bytes(data))
    line = refused(*export(run, tmp_path / "out", capsys, 4), "v4", f"v3/{DELTA}")
    assert "corrupt" in line or "checksum" in line
    assert not list((tmp_path / "out").glob("*.safetensors"))  # nothing exported


def test_a_truncated_delta_names_its_file_and_version(run, tmp_path, capsys):
    frame = run / "weights" / "v3" / DELTA
    frame.write_bytes(frame.read_bytes()[: frame.stat().st_size // 2])
    line = refused(*export(run, tmp_path / "out", capsys, 3), "v3", f"v3/{DELTA}")
    assert "truncated" in line


def test_a_missing_base_names_it(run, tmp_path, capsys):
    shutil.rmtree(run / "weights" / "v1")
    refused(*export(run, tmp_path / "out", capsys, 3), "v3", "v1")


def test_a_damaged_full_version_names_its_file(run, tmp_path, capsys):
    file = run / "weights" / "v5" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10
    file.write_bytes(bytes(data))
    refused(*export(run, tmp_path / "out", capsys, 6), "v6", "v5/model.safetensors", "checksum")
    file.write_bytes(bytes(data[:-100]))  # truncated: refused from its manifest's size, before reading
    refused(*export(run, tmp_path / "out2", capsys, 5), "version 5", "v5/model.safetensors", "truncated")


def test_a_half_written_version_is_passed_over_by_newest_and_refused_by_name(run, chain, tmp_path, capsys):
    """v7's delta without its manifest: what a cut write or upload leaves (the delta's file goes
    first). The newest whole version is v6; asked for by name, v7 is refused."""
    (run / "weights" / "v7" / delta.MANIFEST).unlink()
    rc, err = export(run, tmp_path / "newest", capsys)
    assert rc == 0 and "passing over version 7" in err and DELTA in err, err
    same_files(tmp_path / "newest", chain[0].parent / "full" / "v6")  # v6's weights, bit for bit
    refused(*export(run, tmp_path / "named", capsys, 7), "version 7", f"v7/{DELTA}", "manifest")
    assert not (tmp_path / "named").exists()

    from streamrl.rollout.fleet import server_path

    for reader in (lambda: weights.weights_path(str(run / "weights" / "v7")),  # an in-process backend
                   lambda: server_path(str(run / "weights" / "v7")),  # a server fleet's worker
                   lambda: weights.local_policy(str(run / "weights" / "v7"))):  # a teacher
        with pytest.raises(WeightLoadError, match="v7.*without its manifest") as err:
            reader()
        assert isinstance(err.value, StreamrlError)


def test_a_version_is_visible_by_uri_only_once_its_upload_is_whole(run, chain, tmp_path):
    """On an fsspec filesystem: the manifest is the last file ``upload`` writes; a reader that
    comes while it is missing is refused (and tries again later), then loads the version whole."""
    import fsspec

    fs = fsspec.filesystem("memory")
    prefix = f"memory://streamrl-damage-{uuid.uuid4().hex[:8]}/run"
    for v in (1, 2, 3):
        weights.upload(run / "weights" / f"v{v}", weights.version_uri(prefix, v))
    root = weights.version_uri(prefix, 3).removeprefix("memory://")
    created = {p.rsplit("/", 1)[-1]: fs.info(p)["created"] for p in fs.find(root)}
    assert created[delta.MANIFEST] == max(created.values()) and len(created) > 2

    manifest = fs.cat_file(f"{root}/{delta.MANIFEST}")
    fs.rm(f"{root}/{delta.MANIFEST}")  # the upload cut before its last file
    with pytest.raises(WeightLoadError, match=f"v3.*{DELTA}.*without its manifest"):
        weights.weights_path(weights.version_uri(prefix, 3))
    fs.pipe_file(f"{root}/{delta.MANIFEST}", manifest)  # the upload completes
    same_files(weights.weights_path(weights.version_uri(prefix, 3)), chain[0].parent / "full" / "v3")
