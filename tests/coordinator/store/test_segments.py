"""Reply payloads in segment files: appended durably by one process a file, read back by any,
refused when damaged or not ours, and removed a step at a time."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from coordinator.store.segments import Segments


def test_blobs_are_appended_back_to_back_and_read_back(tmp_path: Path) -> None:
    segments = Segments(tmp_path / "replies")

    first = segments.append(3, [b"abc", b"", b"defgh"])
    second = segments.append(3, [b"ij"])

    (rel, offset, length), empty, last = first
    assert rel.startswith("3/") and (offset, length) == (0, 3)
    assert empty == (rel, 3, 0) and last == (rel, 3, 5) and second == [(rel, 8, 2)]
    assert (tmp_path / "replies" / rel).read_bytes() == b"abcdefghij"
    reader = Segments(tmp_path / "replies")  # another process's view
    assert [reader.read(ref) for ref in [*first, *second]] == [b"abc", b"", b"defgh", b"ij"]
    assert segments.append(3, []) == []
    segments.close()
    reader.close()


def test_each_writer_has_a_file_of_its_own_per_step(tmp_path: Path) -> None:
    a, b = Segments(tmp_path), Segments(tmp_path)  # two processes (or a restart) on one step

    (ref_a,) = a.append(1, [b"from a"])
    (ref_b,) = b.append(1, [b"from b"])
    (ref_next,) = a.append(2, [b"next step"])

    assert ref_a[0] != ref_b[0] and ref_a[1] == ref_b[1] == 0
    assert ref_next[0].startswith("2/") and ref_next[1] == 0
    assert (a.read(ref_a), a.read(ref_b), b.read(ref_next)) == (b"from a", b"from b", b"next step")
    a.close()
    b.close()


def test_a_damaged_or_foreign_reference_reads_as_none_with_the_reason_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    segments = Segments(tmp_path)
    (ref,) = segments.append(0, [b"0123456789"])
    rel = ref[0]
    (tmp_path / rel).write_bytes(b"01234")  # cut short: a damaged disk, or someone's editor

    with caplog.at_level(logging.ERROR, "edgefl.coordinator.store.segments"):
        short = segments.read(ref)
        missing = segments.read(("0/1-0123abcd.seg", 0, 1))
        escaping = segments.read(("../state.sqlite", 0, 16))
        negative = segments.read((rel, -1, 2))

    assert short is None and missing is None and escaping is None and negative is None
    assert "5 of 10 bytes" in caplog.text and "No such file" in caplog.text
    assert "not a segment reference" in caplog.text
    assert segments.read((rel, 0, 5)) == b"01234"  # what is there is still read
    segments.close()


def test_sweep_removes_the_steps_up_to_one_and_keeps_the_later_ones(tmp_path: Path) -> None:
    segments = Segments(tmp_path / "replies")
    refs = {step: segments.append(step, [f"step {step}".encode()])[0] for step in (0, 1, 2)}
    assert segments.read(refs[1]) == b"step 1"  # an open reader of a step to be swept

    segments.sweep(1)
    segments.join()  # the files go on a thread of their own

    assert sorted(p.name for p in (tmp_path / "replies").iterdir()) == ["2"]
    assert segments.read(refs[2]) == b"step 2"
    assert segments.read(refs[1]) is None
    (again,) = segments.append(1, [b"late"])  # a straggler's write after the sweep
    assert segments.read(again) == b"late"  # (never referenced: its step's intake is closed)
    Segments(tmp_path / "nothing here").sweep(5)  # no segments yet: nothing to do
    segments.close()


def test_a_failed_write_leaves_the_next_offsets_true(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    segments = Segments(tmp_path)
    segments.append(0, [b"ok"])
    real_write = os.write
    calls = iter([True, False])

    def half_then_fail(fd: int, data: bytes) -> int:
        if next(calls):  # the first write gets half in, the second hits a full disk
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("coordinator.store.segments.os.write", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        segments.append(0, [b"abcdef"])
    monkeypatch.undo()

    (ref,) = segments.append(0, [b"after"])

    assert ref[1] == 5 and segments.read(ref) == b"after"  # past the torn bytes, not over them
    segments.close()
