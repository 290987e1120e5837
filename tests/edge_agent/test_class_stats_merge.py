"""Received class statistics merged into an agent's table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_agent.class_stats import merge_prototypes
from protocol.contract.payloads import PrototypeSet
from protocol.errors import ValidationError


def _protos(ids: list[int], dim: int, value: float) -> PrototypeSet:
    return PrototypeSet(
        class_ids=np.array(ids, np.int32),
        vectors=np.full((len(ids), dim), value, np.float32),
        counts=np.ones(len(ids), np.int32),
    )


def test_received_classes_replace_their_rows_and_the_others_keep_theirs() -> None:
    table, valid = torch.zeros(3, 2), torch.zeros(3, dtype=torch.bool)
    table, valid = merge_prototypes(table, valid, _protos([0, 2], 2, 1.0))
    table, valid = merge_prototypes(table, valid, _protos([2], 2, 5.0))
    assert table.tolist() == [[1.0, 1.0], [0.0, 0.0], [5.0, 5.0]]  # class 0 kept from before
    assert valid.tolist() == [True, False, True]


@pytest.mark.parametrize(("ids", "dim"), [([3], 2), ([0], 4)])
def test_a_set_that_does_not_fit_the_table_is_refused(ids: list[int], dim: int) -> None:
    table, valid = torch.zeros(3, 2), torch.zeros(3, dtype=torch.bool)
    with pytest.raises(ValidationError, match=r"payloads\.protos"):
        merge_prototypes(table, valid, _protos(ids, dim, 1.0))
