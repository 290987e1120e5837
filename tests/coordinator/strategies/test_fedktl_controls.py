"""FedKTL's matched controls (spec §10): the same server and agents with the transfer's content
broken one way each. ``derangement``: every image paired with another class's latent, by one
fixed derangement; ``noise_images``: the images replaced by noise of the same mean and std,
true latents; ``random_latents``: valid latents drawn without any upload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.strategies import ServerContext, Step
from coordinator.strategies.fedktl.server import deranged_rows, matched_noise
from protocol.algorithms.fedktl import FedKTLConfig
from protocol.contract.payloads import ImageVectorPairs
from protocol.errors import ConfigError
from tests.coordinator.strategies.test_fedktl_strategy import (
    A,
    B,
    C,
    one_round,
    protos,
    reply,
    strategy,
)


def pairs_of(s: object, r: int, who: object = A) -> ImageVectorPairs:
    p = s.configure(Step(r, "train"), who)["pairs"]  # type: ignore[attr-defined]
    assert isinstance(p, ImageVectorPairs)
    return p


def row_map(true: np.ndarray, sent: np.ndarray) -> list[int]:
    """For each sent latent, the row of ``true`` it equals (each must equal exactly one)."""
    out = []
    for v in sent:
        hits = np.flatnonzero((true == v).all(axis=1))
        assert hits.size == 1
        out.append(int(hits[0]))
    return out


def test_derangement_pairs_each_image_with_another_class_latent_by_one_fixed_cycle() -> None:
    # Prepare: the same run with and without the control (the control changes no training)
    plain, deranged = strategy(), strategy(control="derangement")
    maps = []
    for r in (1, 2):
        one_round(plain, r)
        one_round(deranged, r)

        # Execute
        true, sent = pairs_of(plain, r + 1), pairs_of(deranged, r + 1)

        # Assert: same images, latents permuted with no class keeping its own
        np.testing.assert_array_equal(true.images, sent.images)
        maps.append(row_map(true.vectors, sent.vectors))
        assert sorted(maps[-1]) == [0, 1, 2]
        assert all(m != i for i, m in enumerate(maps[-1]))
    assert maps[0] == maps[1]  # one derangement for the whole run


def test_the_derangement_stays_fixed_point_free_on_any_subset_of_classes() -> None:
    order = np.random.default_rng(0).permutation(10)
    full = deranged_rows(np.arange(10), order)
    for classes in ([0, 1], [2, 5, 9], list(range(10)), [1, 3, 4, 6, 7, 8]):
        ids = np.array(classes)
        rows = deranged_rows(ids, order)
        assert sorted(rows.tolist()) == list(range(len(ids)))
        assert (rows != np.arange(len(ids))).all()
    # on all classes: c -> the class after c in the cycle, one cycle of length 10
    c, seen = 0, set()
    while c not in seen:
        seen.add(c)
        c = int(full[c])
    assert len(seen) == 10


def test_noise_images_keep_the_true_latents_and_the_image_sets_mean_and_std() -> None:
    plain, noisy = strategy(), strategy(control="noise_images")
    one_round(plain)
    one_round(noisy)
    for who in (A, B):
        true, sent = pairs_of(plain, 2, who), pairs_of(noisy, 2, who)
        np.testing.assert_array_equal(true.vectors, sent.vectors)
        real, fake = true.images.astype(float), sent.images.astype(float)
        assert fake.shape == real.shape and not np.array_equal(fake, real)
        axes = (0, 2, 3)
        np.testing.assert_allclose(fake.mean(axes), real.mean(axes), atol=3.0)
        np.testing.assert_allclose(fake.std(axes), real.std(axes), rtol=0.1)
        # content-blind: within each channel the noise does not follow the images
        for ch in range(real.shape[1]):
            corr = np.corrcoef(fake[:, ch].ravel(), real[:, ch].ravel())[0, 1]
            assert abs(corr) < 0.3


def test_matched_noise_is_exact_before_rounding_and_seeded() -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(60, 200, size=(4, 3, 16, 16)).astype(np.uint8)
    a = matched_noise(images, np.random.default_rng(7))
    b = matched_noise(images, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    axes = (0, 2, 3)
    np.testing.assert_allclose(a.mean(axes), images.mean(axes), atol=0.6)
    np.testing.assert_allclose(a.std(axes), images.std(axes), rtol=0.02)


def test_random_latents_ignore_the_uploads_and_are_valid_latents_of_every_class() -> None:
    # Prepare: two runs whose agents upload different prototypes
    runs = [strategy(control="random_latents"), strategy(control="random_latents")]
    step = Step(1, "train")
    for seed, s in enumerate(runs):
        s.aggregate(step, [(A, reply(protos([0, 1], seed))), (B, reply(protos([2], seed + 5)))])
        s.server_train(step, ServerContext.for_step(3, 0, "cpu"))

    # Execute
    first, second = pairs_of(runs[0], 2), pairs_of(runs[1], 2, B)

    # Assert: the same pairs whatever was uploaded; all C classes; no F was trained
    np.testing.assert_array_equal(first.vectors, second.vectors)
    assert first.vectors.shape == (C, 8)
    assert first.class_ids is not None and first.class_ids.tolist() == list(range(C))
    assert runs[0].aligner is None
    gen = runs[0]._ready()
    from coordinator.strategies.fedktl.server import random_latents

    seed = (5 ^ 0x4B4433) % 2**63
    np.testing.assert_array_equal(first.vectors, random_latents(gen, C, seed))
    expect = gen.sample_w(C, torch.Generator().manual_seed(seed)).numpy()
    np.testing.assert_allclose(first.vectors, expect)


def test_without_a_control_the_uploads_shape_the_pairs() -> None:
    # the test above fails on the plain method: its latents follow the uploads
    runs = [strategy(), strategy()]
    step = Step(1, "train")
    for seed, s in enumerate(runs):
        s.aggregate(step, [(A, reply(protos([0, 1], seed))), (B, reply(protos([2], seed + 5)))])
        s.server_train(step, ServerContext.for_step(3, 0, "cpu"))
    assert not np.array_equal(pairs_of(runs[0], 2).vectors, pairs_of(runs[1], 2).vectors)


def test_an_unknown_control_is_refused() -> None:
    with pytest.raises((ConfigError, ValueError), match="control"):
        FedKTLConfig.from_dict({"control": "shuffle"})
