"""Conformal pieces of FedType (fedtype.md §4.4-4.6, gates of §10): RAPS scores and sets
against hand-computed values, the exact split quantile, marginal coverage by Monte Carlo
(Gate A), S_g inside S_lambda, non-empty top-k prefixes, g and eta."""

from __future__ import annotations

import math

import pytest
import torch

from edge_agent.conformal import (
    Calibration,
    calibrate,
    consensus,
    fit_temperature,
    g_penalty,
    label_scores,
    prediction_sets,
    rank_scores,
    split_quantile,
    topk_sets,
)


def mask(rows: list[list[int]], c: int = 4) -> torch.Tensor:
    out = torch.zeros(len(rows), c, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, r] = True
    return out


def test_raps_scores_match_hand_computed_values() -> None:
    # probs .5 .3 .2, u = .5, penalty .1 beyond rank k_reg = 1:
    # E1 = 0 + .25 = .25; E2 = .5 + .15 + .1 = .75; E3 = .8 + .1 + .2 = 1.1
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    scores, order = rank_scores(probs, torch.tensor([0.5]), penalty=0.1, k_reg=1)
    assert scores[0].tolist() == pytest.approx([0.25, 0.75, 1.1])
    assert order[0].tolist() == [0, 1, 2]
    # the same distribution with labels permuted: label 2 holds .3, its score is E2
    permuted = torch.tensor([[0.2, 0.5, 0.3]])
    u = torch.tensor([0.5])
    assert label_scores(permuted, torch.tensor([2]), u, 0.1, 1).item() == pytest.approx(0.75)
    assert label_scores(permuted, torch.tensor([0]), u, 0.1, 1).item() == pytest.approx(1.1)


def test_split_quantile_is_the_exact_order_statistic() -> None:
    scores = torch.arange(20, dtype=torch.float32).flip(0)  # 19..0
    # n = 19: k = ceil(20 * .9) = 18 -> the 18th smallest of 0..18 is 17 (numpy "higher": 18)
    assert split_quantile(scores[1:], 0.1) == 17.0
    assert split_quantile(scores[:9], 0.1) == 19.0  # n = 9: k = 9, the maximum
    assert split_quantile(scores[:8], 0.1) is None  # n = 8: k = 9 > n
    assert split_quantile(torch.zeros(0), 0.1) is None


def test_temperature_fit_moves_towards_calibration() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 5, (200,), generator=g)
    right = torch.nn.functional.one_hot(y, 5).float()
    # under-confident correct logits want T < 1.3; over-confident wrong ones want T > 1.3
    assert fit_temperature(right * 0.5, y) < 1.3
    wrong = torch.nn.functional.one_hot((y + 1) % 5, 5).float() * 4
    t_wrong = fit_temperature(wrong, y)
    assert t_wrong > 1.3
    # more than one pass ran: one pass of 7 SGD steps cannot move T this far
    assert t_wrong - 1.3 > 7 * 0.01 * 1.0
    assert fit_temperature(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)) == 1.3


def random_logits(n: int, c: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(n, c, generator=g) * 2


def test_sets_are_non_empty_top_k_prefixes_and_match_the_scores() -> None:
    g = torch.Generator().manual_seed(1)
    logits = random_logits(500, 10, g)
    cal = Calibration(temperature=1.2, tau=0.8, penalty=0.5, k_reg=2, n=100)
    u = torch.rand(500, generator=g)
    sets = prediction_sets(logits, cal, u)
    assert bool(sets.any(dim=1).all())  # never empty at prediction
    probs = torch.softmax(logits / 1.2, dim=1)
    order = probs.argsort(dim=1, descending=True)
    sizes = sets.sum(dim=1)
    for i in range(500):  # the set is exactly the first |S| labels by probability
        assert set(order[i, : int(sizes[i])].tolist()) == set(sets[i].nonzero().flatten().tolist())
    # with zero sets allowed, membership is exactly "score <= tau"
    free = prediction_sets(logits, cal, u, allow_empty=True)
    for label in range(10):
        y = torch.full((500,), label)
        inside = label_scores(probs, y, u, 0.5, 2) <= 0.8
        assert torch.equal(free[:, label], inside)


def test_marginal_coverage_by_monte_carlo_gate_a() -> None:
    # Prepare: exchangeable (logit, label) pairs: labels drawn from the softmax of the logits
    theta, n, c, trials, m = 0.1, 36, 10, 600, 200
    g = torch.Generator().manual_seed(2)
    hits = torch.empty(trials)
    for t in range(trials):
        logits = random_logits(n + m, c, g)
        y = torch.multinomial(torch.softmax(logits, dim=1), 1, generator=g).squeeze(1)
        # Execute: calibrate on n points (fixed T = 1), zero sets allowed, test on m more
        cal = calibrate(
            logits[:n], y[:n], theta=theta, penalty=0.5, k_reg=2, generator=g, temperature=1.0
        )
        sets = prediction_sets(logits[n:], cal, torch.rand(m, generator=g), allow_empty=True)
        hits[t] = sets[torch.arange(m), y[n:]].float().mean()
    # Assert: E[coverage] in [1 - theta, 1 - theta + 1/(n+1)], within 3 standard errors
    mean, se = float(hits.mean()), float(hits.std()) / math.sqrt(trials)
    assert 1 - theta - 3 * se <= mean <= 1 - theta + 1 / (n + 1) + 3 * se


def test_a_larger_penalty_only_shrinks_sets() -> None:
    g = torch.Generator().manual_seed(3)
    logits = random_logits(400, 10, g)
    y = torch.randint(0, 10, (400,), generator=g)
    cal = calibrate(logits, y, theta=0.1, penalty=0.5, k_reg=2, generator=g)
    u = torch.rand(400, generator=g)
    s_lam = prediction_sets(logits, cal, u)
    for kind in ("piecewise_linear", "quadratic", "quadratic_linear", "constant"):
        for delta in (-1.0, -0.3, -0.01, 0.0, 0.2):
            pen = g_penalty(delta, 0.5, kind)  # type: ignore[arg-type]
            assert pen >= 0.5
            s_g = prediction_sets(logits, cal, u, penalty=pen)
            assert not bool((s_g & ~s_lam).any())  # S_g is a subset of S_lambda
    assert prediction_sets(logits, cal, u, penalty=1.0).sum() < s_lam.sum()


def test_calibration_function_g() -> None:
    assert g_penalty(-0.2, 0.5) == pytest.approx(0.6)  # 0.5 * -0.2 + 0.2 + 0.5
    assert g_penalty(-1.0, 0.5) == pytest.approx(1.0)
    assert g_penalty(-0.2, 0.5, "constant") == 0.5
    assert g_penalty(-0.2, 0.5, "quadratic") == pytest.approx(0.52)
    assert g_penalty(-0.2, 0.5, "quadratic_linear") == pytest.approx(0.68)
    assert g_penalty(0.0, 0.5) == g_penalty(0.3, 0.5, "quadratic") == 0.5


def test_consensus_weight_hand_computed_and_bounded() -> None:
    s = mask([[0], [0, 1, 2], [2], [0, 1]])
    l_set = mask([[0, 1], [1, 3], [0, 1], [0, 1]])
    # |S|<|L|: 1/1; |S|>=|L|: 1/4 (inter {1}, union {0,1,2,3}); disjoint: 0; equal: 1
    assert consensus(s, l_set).tolist() == pytest.approx([1.0, 0.25, 0.0, 1.0])
    g = torch.Generator().manual_seed(4)
    a = torch.rand(1000, 10, generator=g) < 0.3
    b = torch.rand(1000, 10, generator=g) < 0.3
    a[:, 0] = b[:, 1] = True  # non-empty, as at prediction
    eta = consensus(a, b)
    assert bool(((eta >= 0) & (eta <= 1)).all())


def test_topk_sets() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    assert topk_sets(logits, 3)[0].nonzero().flatten().tolist() == [1, 2, 4]
    assert topk_sets(logits, 9).all()


def test_a_too_small_calibration_split_has_no_threshold() -> None:
    g = torch.Generator().manual_seed(5)
    cal = calibrate(
        torch.randn(8, 4),
        torch.zeros(8, dtype=torch.long),
        theta=0.1,
        penalty=0.5,
        k_reg=2,
        generator=g,
    )
    assert not cal.valid
    with pytest.raises(ValueError, match="too small"):
        prediction_sets(torch.randn(2, 4), cal, torch.rand(2))
