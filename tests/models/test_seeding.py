"""seeded(): seeded module init that threads (simulated agents) cannot disturb."""

from __future__ import annotations

import threading

import torch
from torch import nn

from models.seeding import seeded


def _build() -> nn.Module:
    # several layers: construction spans many global-RNG draws, so unguarded threads interleave
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])


def _weights(seed: int) -> torch.Tensor:
    with seeded(seed):
        net = _build()
    return torch.cat([p.detach().flatten() for p in net.parameters()])


def test_same_seed_same_weights_and_global_generator_restored() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    a, b = _weights(7), _weights(7)
    assert torch.equal(a, b) and not torch.equal(a, _weights(8))
    assert torch.equal(torch.rand(4), expected_next)  # the caller's stream did not move


def test_concurrent_threads_get_their_seeds_weights() -> None:
    reference = {s: _weights(s) for s in range(4)}
    wrong: list[int] = []

    def work(seed: int) -> None:
        for _ in range(15):
            if not torch.equal(_weights(seed), reference[seed]):
                wrong.append(seed)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []


def test_a_blank_build_leaves_the_global_generator_and_other_threads_seeds_alone() -> None:
    from models.seeding import blank

    torch.manual_seed(5)
    expected_next = torch.rand(4)
    torch.manual_seed(5)
    a = blank(_build)
    torch.manual_seed(99)  # whatever the global state, a blank build is the same
    b = blank(_build)
    torch.manual_seed(5)
    blank(_build)
    assert torch.equal(torch.rand(4), expected_next)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    # and a thread building blank modules all along does not move seeded builds elsewhere
    reference = _weights(3)
    stop = threading.Event()

    def build_blanks() -> None:
        while not stop.is_set():
            blank(_build)

    worker = threading.Thread(target=build_blanks, daemon=True)
    worker.start()
    try:
        assert all(torch.equal(_weights(3), reference) for _ in range(10))
    finally:
        stop.set()
        worker.join(10)
