"""``edge-export --checkpoint best|last``: a device's best round (``checkpoint.best.pt``
beside its last checkpoint) is exported by default, and the bundle says which round it is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from export_helpers import CLASS_NAMES, images

from export.cli import main
from export.heads import with_head
from export.runtime import make_session, run_batches
from models import create_model
from models.checkpoint import (
    Checkpoint,
    CheckpointError,
    HeadSpec,
    build_model,
    load_checkpoint,
    save_checkpoint,
)
from models.selection import best_path, choose, mark_best


def _checkpoint(path: Path, round_: int, run_id: str = "run-1", seed: int = 0) -> Path:
    torch.manual_seed(seed)  # each round's weights differ
    model = create_model("mlp_s", num_classes=10, in_chans=1, input_size=8)
    meta = {"round": round_, "run_id": run_id, "class_names": CLASS_NAMES, "metrics": {}}
    return save_checkpoint(path, Checkpoint.from_model(model, HeadSpec("logits"), meta))


def _best(last: Path, round_: int, value: float, run_id: str = "run-1") -> Path:
    source = _checkpoint(last.with_name("source.pt"), round_, run_id, seed=round_)
    return save_checkpoint(best_path(last), mark_best(load_checkpoint(source), value))


def _scores(path: Path, x: np.ndarray) -> np.ndarray:
    ckpt = load_checkpoint(path)
    with torch.no_grad():
        scores, _ = with_head(build_model(ckpt), ckpt.head).eval()(torch.from_numpy(x))
    return np.asarray(scores.numpy())


@pytest.mark.parametrize(("which", "round_"), [("best", 3), ("last", 7)])
def test_edge_export_exports_the_chosen_checkpoint_and_says_which_round(
    which: str, round_: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last = _checkpoint(tmp_path / "checkpoint.pt", 7)
    best = _best(last, 3, 0.9)
    argv = [str(last), "-o", str(tmp_path / "b"), "--exporter", "legacy"]
    code = main([*argv, "--checkpoint", which] if which == "last" else argv)
    out = capsys.readouterr().out
    assert code == 0
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["checkpoint"]["checkpoint"] == which
    assert manifest["checkpoint"]["round"] == round_
    assert manifest["metadata"]["round"] == str(round_)
    assert json.loads(manifest["metadata"]["checkpoint"])["round"] == round_
    assert f"checkpoint: {which}" in out and f"round {round_}" in out
    x = images(16)
    exported, _ = run_batches(make_session(tmp_path / "b" / "model.onnx"), x)
    chosen, other = (best, last) if which == "best" else (last, best)
    np.testing.assert_allclose(exported, _scores(chosen, x), rtol=1e-4, atol=1e-4)
    assert np.abs(exported - _scores(other, x)).max() > 1e-3


def test_without_a_best_checkpoint_best_is_the_last_and_says_so(tmp_path: Path) -> None:
    last = _checkpoint(tmp_path / "checkpoint.pt", 4)
    chosen = choose(last, "best")
    assert (chosen.checkpoint, chosen.path, chosen.round) == ("last", last, 4)
    assert "no validation split" in chosen.note


def test_a_best_checkpoint_of_another_run_is_not_exported(tmp_path: Path) -> None:
    last = _checkpoint(tmp_path / "checkpoint.pt", 4, run_id="run-2")
    _best(last, 2, 0.8, run_id="run-1")
    chosen = choose(last, "best")
    assert (chosen.checkpoint, chosen.path) == ("last", last)
    assert "another run" in chosen.note


def test_the_best_checkpoint_given_itself_is_exported_as_best(tmp_path: Path) -> None:
    best = _best(_checkpoint(tmp_path / "checkpoint.pt", 4), 2, 0.8)
    chosen = choose(best, "best")
    assert (chosen.checkpoint, chosen.round, chosen.value) == ("best", 2, pytest.approx(0.8))


def test_a_malformed_selection_is_refused(tmp_path: Path) -> None:
    last = _checkpoint(tmp_path / "checkpoint.pt", 4)
    ckpt = load_checkpoint(last)
    ckpt.meta["selection"] = {"metric": "acc_val", "value": "high"}
    save_checkpoint(best_path(last), ckpt)
    with pytest.raises(CheckpointError, match=r"meta\.selection"):
        choose(last, "best")
