"""Mutation probe round 9c (``nnsight_lorsa/_atomic.py``): what survived the atomic-write tests.

* a name with a ``..`` part is not a name inside the directory (the module docstring: the manifest lists files
  *inside* it; a tampered manifest listing ``../x`` must not make a load read or check files outside it);
* a replacing save drops the files the previous save wrote inside a folder, and keeps only what it did not write
  (``_carry_over``'s documented rule, checked on the folder's contents);
* a save after a crash between the two renames (only ``<dir>.old`` left) carries the unrelated files of
  ``<dir>.old`` over, as it would those of ``<dir>`` (the module docstring: "a later save cleans up what a killed
  one left", and unrelated entries are carried over).
"""

from __future__ import annotations

import json

import pytest

from nnsight_lorsa import _atomic
from nnsight_lorsa.errors import CheckpointError, SaveError


@pytest.mark.parametrize("name", ["..", "../x", "a/../b", "a/..", "/abs", "a\\b", " a", ""])
def test_names_that_leave_or_do_not_name_a_file_inside_the_directory_are_refused(name):
    assert not _atomic.is_relative_name(name)


@pytest.mark.parametrize("name", ["a", "a/b", "a.b/c..d", "..a", "b.."])
def test_names_inside_the_directory_are_accepted(name):
    assert _atomic.is_relative_name(name)


def test_a_staged_file_cannot_be_written_outside_the_staging_directory(tmp_path):
    d = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="relative file name"), _atomic.atomic_directory(d) as stage:
        stage.write_bytes("../escape.bin", b"x")
    assert not (tmp_path / "escape.bin").exists() and not d.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # the staging removed too


def test_a_manifest_listing_a_file_outside_the_directory_is_corrupt(tmp_path):
    d = tmp_path / "ckpt"
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("a.bin", b"abc")
    (tmp_path / "outside.bin").write_bytes(b"abc")  # a real file there: a check of it would pass
    m = json.loads((d / _atomic.MANIFEST).read_text())
    m["files"]["../outside.bin"] = m["files"]["a.bin"]
    (d / _atomic.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="bad file name"):
        _atomic.verify(d)


def test_a_replacing_save_drops_the_files_the_previous_save_wrote_inside_a_folder(tmp_path):
    d = tmp_path / "ckpt"
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("sub/a.bin", b"a")
        stage.write_bytes("sub/b.bin", b"b")
    (d / "sub" / "README").write_text("mine")  # the user's, beside the save's files
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("top.bin", b"t")
    assert sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()) == [
        _atomic.MANIFEST, "sub/README", "top.bin"]
    assert set(json.loads((d / _atomic.MANIFEST).read_text())["files"]) == {"top.bin"}
    _atomic.verify(d)


def test_a_save_after_a_crash_between_the_renames_carries_the_old_directorys_files(tmp_path):
    d = tmp_path / "ckpt"
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("model.bin", b"old")
    (d / "README.md").write_text("notes")
    d.rename(d.with_name("ckpt.old"))  # killed after `<dir>` -> `<dir>.old`, before the staging -> `<dir>`
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("model.bin", b"new")
    assert (d / "model.bin").read_bytes() == b"new"
    assert (d / "README.md").read_text() == "notes"
    assert not d.with_name("ckpt.old").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _atomic.verify(d)


@pytest.mark.parametrize("failure", [OSError, KeyboardInterrupt])
def test_a_save_failing_between_the_renames_puts_the_old_directory_back_itself(tmp_path, monkeypatch, failure):
    """The docstring's rule, on disk (not through a later load's ``resolve``): the old directory is back at its name,
    no ``.old`` and no staging beside it."""
    d = tmp_path / "ckpt"
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("model.bin", b"old")

    def boundary(event: str) -> None:
        if event == "rename:old":
            raise failure("injected")

    monkeypatch.setattr(_atomic, "_boundary", boundary)
    with pytest.raises(SaveError if failure is OSError else KeyboardInterrupt), _atomic.atomic_directory(d) as stage:
        stage.write_bytes("model.bin", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (d / "model.bin").read_bytes() == b"old"
    _atomic.verify(d)


@pytest.mark.parametrize("change", ["append", "truncate"])
def test_a_size_only_check_refuses_a_file_of_another_size(tmp_path, change):
    """``hashes=False`` checks sizes only (an activation cache's open, a ``device="meta"`` load): a file grown is as
    wrong as one truncated (the size must equal the manifest's)."""
    d = tmp_path / "ckpt"
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("a.bin", b"0123456789")
    data = (d / "a.bin").read_bytes()
    (d / "a.bin").write_bytes(data + b"x" if change == "append" else data[:-1])
    with pytest.raises(CheckpointError, match="a.bin"):
        _atomic.verify(d, hashes=False)


def test_resolve_of_a_missing_directory_is_that_directory(tmp_path):
    """No ``<dir>.old`` either: the path given, so that a load's error names it (not ``<dir>.old``)."""
    assert _atomic.resolve(tmp_path / "nope") == tmp_path / "nope"
    d = tmp_path / "ckpt"
    d.mkdir()
    (d.with_name("ckpt.old")).mkdir()  # both: `<dir>` is complete, the `.old` a leftover
    (d.with_name("ckpt.old") / "stale").write_text("x")
    assert _atomic.resolve(d) == d and list(d.iterdir()) == []


def test_a_directory_without_a_manifest_is_unchecked_only_where_the_manifest_is_optional(tmp_path):
    d = tmp_path / "older"
    d.mkdir()
    (d / "a.bin").write_bytes(b"abc")
    assert _atomic.verify(d) == {}  # written by an older version or another library: read as before
    with pytest.raises(CheckpointError, match="missing checkpoint manifest"):
        _atomic.verify(d, manifest="manifest.json", optional=False)  # a training checkpoint's is required


def test_a_required_file_the_manifest_does_not_list_is_refused(tmp_path):
    d = tmp_path / "ckpt"
    with _atomic.atomic_directory(d) as stage:
        stage.write_bytes("a.bin", b"a")
    _atomic.verify(d, required=("a.bin",))
    for required in (("config.json",), ("a.bin", "config.json")):
        with pytest.raises(CheckpointError, match="config.json"):
            _atomic.verify(d, required=required)


def test_resolve_gives_the_old_directory_where_it_cannot_be_renamed_back(tmp_path, monkeypatch):
    """Only ``<dir>.old`` left and the rename refused (a read-only folder): ``<dir>.old`` itself (the docstring)."""
    d = tmp_path / "ckpt"
    old = d.with_name("ckpt.old")
    old.mkdir()

    def refuse(self, target):
        raise PermissionError(13, "read-only", str(self))

    monkeypatch.setattr(type(old), "rename", refuse)
    assert _atomic.resolve(d) == old
