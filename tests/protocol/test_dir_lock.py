"""The one-process-per-directory lock: refusal with the holder's pid, and no trace of a
directory it created and nothing used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protocol.dir_lock import DirBusyError, DirLock, lock_holder


def test_a_second_lock_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    first = DirLock(tmp_path / "state", "x.lock")
    with pytest.raises(DirBusyError, match=str(os.getpid())):
        DirLock(tmp_path / "state", "x.lock")
    assert lock_holder(tmp_path / "state", "x.lock") == os.getpid()
    first.release()
    DirLock(tmp_path / "state", "x.lock").release()


def test_a_directory_the_lock_created_and_nothing_used_is_removed(tmp_path: Path) -> None:
    DirLock(tmp_path / "state", "x.lock").release()
    assert not (tmp_path / "state").exists()


def test_a_used_or_existing_directory_is_kept(tmp_path: Path) -> None:
    used = DirLock(tmp_path / "used", "x.lock")
    (tmp_path / "used" / "outbox").write_text("kept")
    used.release()
    assert (tmp_path / "used" / "outbox").exists()
    (tmp_path / "existing").mkdir()
    DirLock(tmp_path / "existing", "x.lock").release()
    assert (tmp_path / "existing").is_dir()


def test_a_lock_won_on_a_file_its_holder_just_removed_is_retaken_on_the_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    from protocol import dir_lock

    real_flock = fcntl.flock
    removed: list[Path] = []

    def flock_after_the_holder_left(fd: int, operation: int) -> None:
        if not removed:  # the holder unlinks the file between our open and our lock
            path = tmp_path / "state" / "x.lock"
            path.unlink()
            removed.append(path)
        real_flock(fd, operation)

    monkeypatch.setattr(dir_lock.fcntl, "flock", flock_after_the_holder_left)
    lock = DirLock(tmp_path / "state", "x.lock")
    monkeypatch.setattr(dir_lock.fcntl, "flock", real_flock)
    assert removed and lock.path.exists()  # the lock is held on the file now in the directory
    with pytest.raises(DirBusyError):
        DirLock(tmp_path / "state", "x.lock")
    lock.release()
