"""Per-class statistics' scoring: the prototype scores the agents predict with."""

from __future__ import annotations

import torch

from edge_agent.class_stats import prototype_scores
from export.heads import CosineHead, PrototypeHead


def _noised_table() -> tuple[torch.Tensor, torch.Tensor]:
    """A feature along class 0's prototype; class 0's prototype carries noise of norm 5 (few
    samples under hyper.dp), class 1's is short and barely noised."""
    f = torch.zeros(1, 8)
    f[0, 0] = 10.0
    table = torch.zeros(2, 8)
    table[0, 0], table[0, 2] = 1.0, 5.0  # signal along the feature, noise across it
    table[1, 1] = 0.1
    return f, table


def test_noise_on_a_prototype_moves_the_nearest_but_not_the_most_aligned_class() -> None:
    f, table = _noised_table()
    valid = torch.ones(2, dtype=torch.bool)
    assert int(prototype_scores(f, table, valid).argmax()) == 1  # |noise|^2 outweighs
    assert int(prototype_scores(f, table, valid, "cosine").argmax()) == 0


def test_the_scores_are_the_export_heads() -> None:
    torch.manual_seed(0)
    f, table = torch.randn(5, 8), torch.randn(3, 8)
    valid = torch.tensor([True, False, True])
    for name, head in (
        ("prototype", PrototypeHead(table, valid)),
        ("cosine", CosineHead(table, valid)),
    ):
        got = prototype_scores(f, table, valid, name)  # type: ignore[arg-type]
        want, _ = head(f)
        assert torch.equal(got.argmax(dim=1), want.argmax(dim=1))
        assert torch.allclose(got[:, valid], want[:, valid], atol=1e-4)
        assert bool((got[:, ~valid] < got[:, valid].min()).all())
