"""Fixtures for the export tests: one CPU thread, seeded torch, checkpoint factory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from export_helpers import CLASS_NAMES, make_head

from models import create_model
from models.checkpoint import Checkpoint, save_checkpoint


@pytest.fixture(autouse=True)
def _one_thread_seeded() -> Iterator[None]:
    # The machine's two cores are shared: one intra-op thread keeps runs predictable.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: save a checkpoint of a fresh registry model and return its path."""

    def make(
        name: str = "mlp_s",
        head: str = "logits",
        *,
        invalid: tuple[int, ...] = (),
        meta: dict[str, Any] | None = None,
        **model_kw: Any,
    ) -> Path:
        kw = {"num_classes": 10, "in_chans": 1, "input_size": 8, **model_kw}
        model = create_model(name, **kw)
        meta = {
            "algorithm": "fedproto",
            "round": 5,
            "federation": "fleet",
            "run_id": "run-1",
            "device_id": "dev-7",
            "class_names": CLASS_NAMES,
            "metrics": {"accuracy": 0.5},
            **(meta or {}),
        }
        ckpt = Checkpoint.from_model(model, make_head(head, model.num_features, invalid), meta)
        return save_checkpoint(tmp_path / f"{name}-{head}.pt", ckpt)

    return make
