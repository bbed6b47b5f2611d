"""Single-file writes (``_atomic.atomic_file``: graph JSON exports, dashboards, figures, model cards, the demo's
results) that meet an ``OSError`` (a full disk, no permission, an I/O error) at any of their steps: a ``SaveError``
naming the file, the file there before intact (or still absent), no temporary left. Until 2026-11-28 the bare
``OSError`` of the step (seen failing: ``OSError: [Errno 28] No space left on device``, no file of ours named)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from helpers import generated
from hypothesis import strategies as st

from nnsight_lorsa import _atomic
from nnsight_lorsa.errors import SaveError

#: the steps of atomic_file that touch the disk, as (module attribute patched, which call of it fails)
STEPS = ("mkdir", "open", "write", "fsync", "replace", "fsync_dir")
ERRNOS = (errno.ENOSPC, errno.EACCES, errno.EIO, errno.EROFS)


def _inject(monkeypatch, step: str, code: int) -> None:
    """Make ``step`` of the next ``atomic_file`` raise ``OSError(code)``."""
    err = OSError(code, os.strerror(code))

    def fail(*_a, **_k):
        raise err

    if step == "mkdir":
        monkeypatch.setattr(Path, "mkdir", fail)
    elif step == "open":
        monkeypatch.setattr("builtins.open", fail)
    elif step == "write":
        real_open = open

        class Torn:
            def __init__(self, *a, **k):
                self.f = real_open(*a, **k)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.f.close()

            def write(self, data):
                self.f.write(data[: len(data) // 2])
                raise err

        monkeypatch.setattr("builtins.open", Torn)
    elif step == "fsync":
        monkeypatch.setattr(os, "fsync", fail)
    elif step == "replace":
        monkeypatch.setattr(os, "replace", fail)
    else:
        monkeypatch.setattr(_atomic, "_fsync", fail)


@generated(examples=12, sweep=120, step=st.sampled_from(STEPS), code=st.sampled_from(ERRNOS), before=st.booleans(),
           size=st.integers(0, 3000))
def test_a_failed_single_file_write_is_a_save_error_and_leaves_the_file_as_before(tmp_path_factory, step, code,
                                                                                   before, size):
    d = tmp_path_factory.mktemp("w") / "sub"
    target = d / "graph.json"
    if before:
        d.mkdir()
        target.write_bytes(b"old contents")
    with pytest.MonkeyPatch.context() as mp:
        _inject(mp, step, code)
        with pytest.raises(SaveError) as info:
            _atomic.atomic_file(target, b"x" * size)
    assert str(target) in str(info.value) and isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == code
    if step == "fsync_dir":  # after the rename: the new file is in place, and the message says so
        assert target.read_bytes() == b"x" * size and "the new file is in place" in str(info.value)
    else:
        assert (target.read_bytes() == b"old contents") if before else not target.exists()
        assert "intact" in str(info.value)
    assert not list(d.glob(".graph.json.tmp-*")) if d.exists() else True


def test_a_public_writer_raises_the_save_error(tmp_path, monkeypatch):
    """Through public writers: a training-curves picture (matplotlib) and a head dashboard on a full disk."""
    pytest.importorskip("matplotlib")
    from nnsight_lorsa.viz.figures import plot_training_curves

    history = [{"step": 1, "loss": 1.0, "fvu": 0.5, "l0": 3.0}, {"step": 2, "loss": 0.5, "fvu": 0.4, "l0": 3.0}]
    target = tmp_path / "curves.png"
    target.write_bytes(b"old")
    with pytest.MonkeyPatch.context() as mp:
        _inject(mp, "replace", errno.ENOSPC)
        with pytest.raises(SaveError, match=r"curves\.png: the write failed \(OSError: \[Errno 28\]"):
            plot_training_curves(history, target)
    assert target.read_bytes() == b"old"
    from nnsight_lorsa.viz.dashboard import write_dashboard

    _inject(monkeypatch, "fsync", errno.EIO)
    with pytest.raises(SaveError, match=r"head\.html: the write failed"):
        write_dashboard(tmp_path / "head.html", {"title": "t"})
    assert not (tmp_path / "head.html").exists()
