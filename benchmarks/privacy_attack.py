"""What differential privacy buys, measured: two attacks of the coordinator on what a device
uploads, with ``hyper.dp`` at several budgets and off.

Threat model: an honest-but-curious coordinator (``docs/concepts/privacy.md``) that reads every
reply of one device over a run of ``--releases`` rounds; for the membership attack it also holds
the device's trained feature extractor (the worst case: the device publishes its exported ONNX
model, or the algorithm shares the model), the fleet's class set, a public labelled set from
the data's distribution (here the union of the clients' test splits, which no device trains
on) and candidate images, some of which the device trained on.

Setting: the reference tier's (``benchmarks/reference.py``): MNIST-5k at 28x28, the Dirichlet
1.0 split file of 20 clients, the ``htfl_cnn`` family (client ``k`` gets member ``k mod 4``).

1. **Membership from a prototype.** Each attacked device trains its model alone with HtFLlib's
   client recipe (SGD lr 0.01, batch 10, no momentum, fixed batch order) for ``--epochs``
   epochs, through the agent's one training loop; then computes its per-class feature sums as
   FedProto's upload does (``class_feature_sums``, each feature clipped to ``clip`` when DP is
   on) and releases them through ``edge_agent.dp.privatize``: the noise of one release of a run
   of ``--releases`` releases at budget epsilon (each release goes through a fresh ledger, so
   every one carries the noise of a release of that run). For each class the device holds, the
   candidates are its training samples of the class (members) and as many samples of that
   class from other clients' training data (non-members, seeded). Scores, from the
   extractor's (clipped) feature ``f(x)`` of a candidate and the released prototype ``p``:
   ``inner`` = ``<f(x) - m, p - m>`` with ``m`` the class's mean feature on the public set (a
   tracing test on a released mean), ``distance`` = ``-||f(x) - p||``. Reported: the attack's
   ROC AUC per class (0.5: chance), averaged over classes of at most ``--small`` samples and
   the others; the TPR at 1 % FPR of ``inner`` on the large classes (scores standardised by the
   public set's, pooled over a device's classes and draws); and the "nearest image" rate: how
   often the candidate nearest to the prototype is a member (for a class of one sample it
   recovers that image). Each for one release ("one") and for the mean of the run's releases
   ("run": the coordinator averages what it saw; an upper bound, as the model is frozen).
2. **Label histogram from the counts.** Every reply of a per-class-sum algorithm carries each
   held class's count, noised by ``privatize`` (FedProto, FedTGP, FedGH, FD: 2 mechanisms a
   release; Felo: 3). For every client of the split file, its true training histogram through
   ``privatize`` ``--releases`` times; the attacker's estimate from one release, from the mean
   of the run's, and from the maximum of the run's. ``privatize`` caps each count at a public bound,
   here the device's total (what a registration of the class set and total discloses; a cap at the
   true count would let the run's maximum meet it). Reported: the total-variation distance between
   the
   normalised estimate and the true histogram (0: recovered exactly).

Seeds vary the training (initialisation, batch order) and the non-members drawn; the noise comes
from the operating system's entropy (``privatize``'s, by design), ``--draws`` runs of releases a
budget.

Usage::

    python benchmarks/privacy_attack.py --threads 1            # resumable
    python benchmarks/privacy_attack.py --table-only           # rewrite the page only
    python benchmarks/privacy_attack.py --seeds 1 --devices 0 --epochs 1 --draws 1 \\
        --out /tmp/a.json --md /tmp/a.md                       # smoke

Settings: ``benchmarks/presets/privacy_attack.toml``; results in
``benchmarks/results/privacy_attack.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import experiment
import numpy as np
from harness import ROOT
from privacy_attack_page import OFF, tables

if TYPE_CHECKING:
    from torch import Tensor

    from edge_agent.class_stats import ClassMeans
    from edge_agent.data import ArrayDataset
    from edge_agent.dp import DpSettings
    from models import Classifier

logging.basicConfig(level=logging.ERROR)

PRESET = experiment.load_preset("privacy_attack")
FPR = 0.01
# released sums per reply (each with the shared counts): FedProto/FedTGP/FedGH/FD send one
# table of sums, Felo two (features and logits)
HISTOGRAM_SENDERS = {"fedproto, fedtgp, fedgh, fd": 1, "felo": 2}


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/privacy_attack.toml)."""
    ap.add_argument("--devices", nargs="+", type=int, help="clients of the split file attacked")
    ap.add_argument("--epsilons", nargs="+", type=float, help="budgets; 0 = off (infinite)")
    ap.add_argument("--delta", type=float, help="hyper.dp.delta")
    ap.add_argument("--clip", type=float, help="hyper.dp.clip")
    ap.add_argument("--releases", type=int, help="hyper.dp.releases: the run's releases")
    ap.add_argument("--epochs", type=int, help="local epochs before the upload")
    ap.add_argument("--draws", type=int, help="independent runs of releases per budget")
    ap.add_argument("--small", type=int, help="a class of at most this many samples is small")
    ap.add_argument("--family", help="models.families name")
    ap.add_argument("--split", help="the split file")


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The histogram attack once (it trains nothing), then seed by seed, device by device."""
    common = {
        "split": args.split,
        "epsilons": list(args.epsilons),
        "delta": args.delta,
        "clip": args.clip,
        "releases": args.releases,
        "draws": args.draws,
    }
    specs: list[dict[str, Any]] = [{"method": "histogram", **common}]
    for seed in args.seeds:
        for device in args.devices:
            specs.append(
                {
                    "method": "membership",
                    "device": device,
                    "seed": seed,
                    "family": args.family,
                    "epochs": args.epochs,
                    "small": args.small,
                    **common,
                }
            )
    return specs


# ----- the mechanism, as a device runs it ------------------------------------------------------
def dp_settings(epsilon: float, delta: float, clip: float, releases: int) -> DpSettings | None:
    """``hyper.dp`` of a run (None: off)."""
    from edge_agent.dp import DpSettings

    return None if epsilon == OFF else DpSettings(epsilon, delta, clip, releases)


def released(
    stats: Sequence[ClassMeans], held: Sequence[int], settings: DpSettings | None, count: int
) -> list[list[ClassMeans]]:
    """``count`` releases of ``stats`` as ``privatize`` makes them (each a copy through a fresh
    ledger: one release of the run ``settings`` is calibrated for); unchanged when DP is off."""
    from edge_agent.class_stats import ClassMeans
    from edge_agent.dp import PrivacyLedger, privatize

    out = []
    for _ in range(count if settings is not None else 1):
        copies = []
        for s in stats:
            c = ClassMeans(s.sums.shape[0], s.sums.shape[1], s.sums.device, s.clip)
            c.sums.copy_(s.sums)
            c.counts.copy_(s.counts)
            copies.append(c)
        if settings is not None:
            privatize(copies, held, 1, settings, PrivacyLedger())
        out.append(copies)
    return out


# ----- the membership attack -------------------------------------------------------------------
def auc(members: np.ndarray, others: np.ndarray) -> float:
    """ROC AUC of scores where members should score higher (ties count a half)."""
    diff = members[:, None] - others[None, :]
    return float((diff > 0).mean() + 0.5 * (diff == 0).mean())


def tpr_at(members: np.ndarray, others: np.ndarray, fpr: float = FPR) -> float:
    """The share of members above the threshold that at most ``fpr`` of the others pass."""
    threshold = np.quantile(others, 1.0 - fpr, method="higher")
    return float((members > threshold).mean())


def inner_scores(features: np.ndarray, proto: np.ndarray, public_mean: np.ndarray) -> np.ndarray:
    """The tracing statistic ``<f(x) - m, p - m>`` of each row of ``features``."""
    return np.asarray((features - public_mean) @ (proto - public_mean))


def distances(features: np.ndarray, proto: np.ndarray) -> np.ndarray:
    """``||f(x) - p||`` of each row of ``features``."""
    return np.asarray(np.linalg.norm(features - proto, axis=1))


def class_attack(
    members: np.ndarray, others: np.ndarray, public: np.ndarray, protos: Sequence[np.ndarray]
) -> dict[str, Any]:
    """The attack on one class: its members' and non-members' features, the public set's, and
    one run's released prototypes (``protos[0]`` the first release)."""
    m = public.mean(axis=0)
    out: dict[str, Any] = {}
    candidates = np.concatenate([members, others])
    for which, proto in (("one", protos[0]), ("run", np.mean(protos, axis=0))):
        inner = inner_scores(candidates, proto, m)
        dist = distances(candidates, proto)
        ref = inner_scores(public, proto, m)
        k = len(members)
        out[f"auc_inner_{which}"] = auc(inner[:k], inner[k:])
        out[f"auc_distance_{which}"] = auc(-dist[:k], -dist[k:])
        out[f"nearest_{which}"] = float(np.argmin(dist) < k)
        # standardised by the public set's scores: comparable across classes, no labels used
        z = (inner - ref.mean()) / max(float(ref.std()), 1e-12)
        out[f"z_{which}"] = (z[:k], z[k:])
    return out


@functools.cache
def _split(split: str) -> tuple[ArrayDataset, Any]:
    from edge_agent.data import load_dataset, load_partition_file

    return load_dataset("mnist5k"), load_partition_file(ROOT / split)


def _tensor_data(ds: ArrayDataset, idx: np.ndarray) -> Any:
    import torch

    from edge_agent.trainer import TensorData

    return TensorData(torch.as_tensor(ds.x[idx]), torch.as_tensor(ds.y[idx], dtype=torch.long))


def train_device(spec: dict[str, Any]) -> tuple[Classifier, Any, dict[str, float]]:
    """The device's model trained alone on its split with HtFLlib's client recipe, through the
    agent's loop (``local``'s hooks); its data, and its accuracy on its train and test splits."""
    import torch

    from edge_agent.algorithms import EdgeContext, create_edge_algorithm
    from edge_agent.trainer import evaluate
    from models import create_model
    from models.families import family_models
    from models.seeding import seeded
    from protocol.algorithms import config_type
    from protocol.algorithms.base import HTFLLIB_TRAINING

    ds, pf = _split(spec["split"])
    k, seed = spec["device"], spec["seed"]
    train, test = _tensor_data(ds, pf.train[k]), _tensor_data(ds, pf.test[k])
    arch = family_models(spec["family"], pf.num_clients)[k]
    # the per-device seeds of edge_agent.factory.build_agent
    with seeded(seed * 1009 + k):
        model = create_model(arch, num_classes=ds.num_classes, in_chans=1, input_size=28)
        ctx = EdgeContext(
            model=model,
            train=train,
            test=test,
            num_classes=ds.num_classes,
            device=torch.device("cpu"),
            generator=torch.Generator().manual_seed(seed * 7919 + k),
        )
        local = create_edge_algorithm("local", ctx)
    local.cfg = config_type("local").from_dict(dict(HTFLLIB_TRAINING))
    local.local_train(train, spec["epochs"])
    fit = {"acc_train": evaluate(model, train).accuracy, "acc_test": evaluate(model, test).accuracy}
    return model, train, {"model": arch, **fit}


def _features(model: Classifier, x: Tensor) -> np.ndarray:
    """What the attacker computes with the device's extractor: eval-mode features."""
    import torch

    model.eval()
    with torch.no_grad():
        return np.asarray(model.forward_features(x).float().numpy())


def _clipped(features: np.ndarray, clip: float) -> np.ndarray:
    """``features`` clipped as the device clips what it adds to a sum (0: not at all)."""
    import torch

    from edge_agent.dp import clip_rows

    return clip_rows(torch.as_tensor(features), clip).numpy() if clip > 0 else features


def membership(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one device, then attack each class it holds at each budget."""
    from edge_agent.class_stats import class_feature_sums
    from edge_agent.data.partition_file import global_test_of
    from edge_agent.dp import public_bounds

    model, train, fit = train_device(spec)
    ds, pf = _split(spec["split"])
    k, num_classes = spec["device"], ds.num_classes
    others = np.concatenate([pf.train[j] for j in range(pf.num_clients) if j != k])
    public = global_test_of(pf)
    labels = train.y.numpy()
    held = np.bincount(labels, minlength=num_classes).tolist()
    rng = np.random.default_rng([spec["seed"], k])
    outsiders = {
        c: rng.choice(others[ds.y[others] == c], size=n, replace=False)
        for c, n in enumerate(held)
        if n
    }
    raw: dict[int | str, np.ndarray] = {
        "members": _features(model, train.x),
        "public": _features(model, _tensor_data(ds, public).x),
        **{c: _features(model, _tensor_data(ds, idx).x) for c, idx in outsiders.items()},
    }
    cells, tprs = [], {}
    for epsilon in spec["epsilons"]:
        settings = dp_settings(epsilon, spec["delta"], spec["clip"], spec["releases"])
        clip = 0.0 if settings is None else settings.clip
        feats = {key: _clipped(f, clip) for key, f in raw.items()}
        sums = class_feature_sums(model, train, num_classes, clip=clip)
        present = sums.present().tolist()
        pooled: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {
            "one": ([], []),
            "run": ([], []),
        }
        per_class: dict[int, list[dict[str, Any]]] = {c: [] for c in outsiders}
        for _ in range(spec["draws"] if settings is not None else 1):
            run = [
                r[0].means(r[0].present()).numpy()
                for r in released([sums], public_bounds(held), settings, spec["releases"])
            ]
            for c in outsiders:
                res = class_attack(
                    feats["members"][labels == c],
                    feats[c],
                    feats["public"][ds.y[public] == c],
                    [protos[present.index(c)] for protos in run],
                )
                for which in ("one", "run"):
                    zm, zo = res.pop(f"z_{which}")
                    if held[c] > spec["small"]:
                        pooled[which][0].append(zm)
                        pooled[which][1].append(zo)
                per_class[c].append(res)
        for c, results in per_class.items():
            means = {key: float(np.mean([r[key] for r in results])) for key in results[0]}
            cells.append({"epsilon": epsilon, "class": c, "n": held[c], **means})
        tprs[str(epsilon)] = {
            which: tpr_at(np.concatenate(m), np.concatenate(o)) if m else None
            for which, (m, o) in pooled.items()
        }
    return {"spec": spec, **fit, "cells": cells, "tpr_inner_large": tprs}


# ----- the histogram attack --------------------------------------------------------------------
def tvd(estimate: np.ndarray, truth: np.ndarray) -> float:
    """Total-variation distance between two histograms, each normalised."""
    p = estimate / max(float(estimate.sum()), 1e-12)
    q = truth / max(float(truth.sum()), 1e-12)
    return float(0.5 * np.abs(p - q).sum())


def histogram_run(
    counts: Sequence[int], sums: int, settings: DpSettings | None, releases: int
) -> dict[str, float]:
    """One run of ``releases`` replies carrying ``sums`` tables and the noised ``counts``: the
    TVD of the estimate from the first release, the mean and the maximum of the run's."""
    import torch

    from edge_agent.class_stats import ClassMeans
    from edge_agent.dp import public_bounds

    truth = np.asarray(counts, dtype=np.float64)
    stats = []
    for _ in range(sums):
        s = ClassMeans(
            len(counts), 1, torch.device("cpu"), 0.0 if settings is None else settings.clip
        )
        s.counts.copy_(torch.as_tensor(counts))
        stats.append(s)
    seen = np.stack(
        [
            r[0].counts.numpy().astype(np.float64)
            for r in released(stats, public_bounds(counts), settings, releases)
        ]
    )
    return {
        "one": tvd(seen[0], truth),
        "mean": tvd(seen.mean(axis=0), truth),
        "max": tvd(seen.max(axis=0), truth),
    }


def histogram(spec: dict[str, Any]) -> dict[str, Any]:
    """Every client's histogram through ``privatize``, ``draws`` runs per budget and sender."""
    ds, pf = _split(spec["split"])
    cells = []
    for epsilon in spec["epsilons"]:
        settings = dp_settings(epsilon, spec["delta"], spec["clip"], spec["releases"])
        for sender, sums in HISTOGRAM_SENDERS.items():
            for k in range(pf.num_clients):
                counts = np.bincount(ds.y[pf.train[k]], minlength=ds.num_classes).tolist()
                draws = spec["draws"] if settings is not None else 1
                runs = [
                    histogram_run(counts, sums, settings, spec["releases"]) for _ in range(draws)
                ]
                mean = {key: float(np.mean([r[key] for r in runs])) for key in runs[0]}
                cells.append({"epsilon": epsilon, "sender": sender, "client": k, **mean})
    return {"spec": spec, "cells": cells}


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One spec of the plan, on ``--threads`` torch threads."""
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result = membership(spec) if spec["method"] == "membership" else histogram(spec)
    return {**result, "wall_s": time.perf_counter() - t0}


def _describe(r: dict[str, Any]) -> str:
    s = r["spec"]
    if s["method"] == "histogram":
        return f"histogram of {len(r['cells'])} cells ({r['wall_s']:.0f} s)"
    return (
        f"device {s['device']} ({r['model']}): train acc {100 * r['acc_train']:.1f}, test "
        f"{100 * r['acc_test']:.1f} ({r['wall_s']:.0f} s)"
    )


EXPERIMENT = experiment.Experiment(
    description=__doc__ or "",
    preset=PRESET,
    plan=plan,
    execute=execute,
    describe=_describe,
    tables=tables,
    add_args=add_args,
    deadline=None,
)


if __name__ == "__main__":
    experiment.main(EXPERIMENT)
