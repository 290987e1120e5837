"""One poisoning agent out of 10 against each aggregation option.

Every run goes through :func:`coordinator.sim.simulate.simulate` (the in-memory transport, the same
code paths as a real fleet). The attacker is not in the product: it is :class:`PoisonTransport`,
a transport that rewrites its own device's ``train`` replies on the way out, i.e. a compromised
device that runs the honest agent and sends whatever it likes. Its replies are finite and within
the value bounds (``WIRE.md`` §10: |x| <= 1e4 in prototypes, <= 1e6 in weights), so validation
accepts them and only the aggregation rule stands between them and the global state.

Attacks (``ATTACKS``, one per payload):

* ``fedavg``: a sign-flipped, scaled update: ``g - 10 (w - g)`` with ``g`` the global model of
  its task (round 1, before any global model: ``-10 w``), clipped to the weight bound.
* ``fedproto``, ``fedtgp``, ``fedgh``: every prototype sign-flipped and scaled to the feature
  bound: ``-p * 9990 / max|p|``.

Options: ``mean`` (the default), ``median``, ``trimmed_mean`` (trim_fraction 0.1: one value
dropped at each end of 10), ``clip`` (mean with clip_norm 2: deviations from the coordinate-wise
median beyond twice the median deviation norm are scaled down); tighter ``trimmed_mean_0.2``
(two values per end) and ``clip_1`` (clip_norm 1); ``screen`` (``upload_screen`` 3: what FedTGP's
and FedGH's servers train on leaves out a class's outlier uploads) and ``median_screen``
(FedTGP: both). An option an algorithm's config does not take is skipped.

Reported: the honest agents' (``agent0`` .. ``agent8``) mean accuracy after the ``final`` step on
their own test splits (``acc_local``) and on the global test set (``acc_global``), in runs with
all 10 agents honest ("clean") and with ``agent9`` poisoning ("attacked").

Usage::

    python benchmarks/poisoning.py --seeds 0 1 2 --rounds 8 --epochs 5 \\
        --options mean median trimmed_mean clip \\
        --out benchmarks/results/poisoning.json --md benchmarks/results/poisoning.md
    python benchmarks/poisoning.py --seeds 0 1 2 --rounds 8 --epochs 5 --algorithms fedavg \\
        --options trimmed_mean_0.2 clip_1 \\
        --out benchmarks/results/poisoning.json --md benchmarks/results/poisoning.md
    python benchmarks/poisoning.py --seeds 0 1 2 --rounds 8 --epochs 5 \\
        --algorithms fedtgp fedgh --options mean median screen median_screen \\
        --out benchmarks/results/poisoning.json --md benchmarks/results/poisoning.md
    python benchmarks/poisoning.py --out benchmarks/results/poisoning.json --table-only

Settings and options: ``benchmarks/presets/poisoning.toml``. Results are appended to ``--out``
after every run; a rerun skips runs already there, and a run that raised is recorded under
``failures`` and retried by the next invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import experiment
import numpy as np
from harness import mean_sd

from protocol.contract.codec import decode, encode
from protocol.contract.messages import Knowledge, Reply, Task
from protocol.contract.payloads import Payload, PrototypeSet, TensorMap
from protocol.contract.validate import MAX_ABS_FEATURE, MAX_ABS_WEIGHT
from protocol.transport.base import Handler, MemoryBroker, MemoryTransport, Transport, Will

logging.basicConfig(level=logging.ERROR)

ATTACKER = "agent9"
PRESET = experiment.load_preset("poisoning")
# aggregation option -> what it sets over the algorithm's config
OPTIONS: dict[str, dict[str, Any]] = PRESET.other["options"]
SCALE = 10.0  # the sign-flipped update's factor
Attack = Callable[[dict[str, Payload], dict[str, Payload]], dict[str, Payload]]


def flip_weights(payloads: dict[str, Payload], task: dict[str, Payload]) -> dict[str, Payload]:
    """``g - SCALE (w - g)`` for every float tensor (``g`` = 0 before any global model)."""
    w = payloads["weights"]
    g = task.get("weights")
    assert isinstance(w, TensorMap)
    out = {}
    for name, t in w.tensors.items():
        if t.dtype.kind != "f":
            out[name] = t
            continue
        ref = g.tensors[name] if isinstance(g, TensorMap) else np.zeros_like(t)
        bad = ref - SCALE * (t - ref)
        out[name] = np.clip(bad, -0.999 * MAX_ABS_WEIGHT, 0.999 * MAX_ABS_WEIGHT).astype(t.dtype)
    return {**payloads, "weights": TensorMap(out, encoding=w.encoding)}


def flip_prototypes(payloads: dict[str, Payload], task: dict[str, Payload]) -> dict[str, Payload]:
    """Every prototype sign-flipped and scaled to just under the feature bound."""
    p = payloads["protos"]
    assert isinstance(p, PrototypeSet)
    peak = max(float(np.abs(p.vectors).max()), 1e-12)
    vectors = (-p.vectors * (0.999 * MAX_ABS_FEATURE / peak)).astype(np.float32)
    bad = PrototypeSet(p.class_ids, vectors, p.counts, sd=p.sd, encoding=p.encoding)
    return {**payloads, "protos": bad}


ATTACKS: dict[str, Attack] = {
    "fedavg": flip_weights,
    "fedproto": flip_prototypes,
    "fedtgp": flip_prototypes,
    "fedgh": flip_prototypes,
}
ALGORITHMS = tuple(ATTACKS)


def applies(algorithm: str, option: str) -> bool:
    """Whether the algorithm's config takes the option's keys (FedGH averages nothing, so it
    takes no ``aggregation``; only the servers that train on uploads take ``upload_screen``)."""
    from protocol.algorithms import config_type
    from protocol.errors import ConfigError

    try:
        config_type(algorithm).from_dict(OPTIONS[option])
    except ConfigError:
        return False
    return True


class PoisonTransport(MemoryTransport):
    """The attacker's link: remembers each task's payloads and rewrites its ``train`` replies."""

    def __init__(self, broker: MemoryBroker, client_id: str, attack: Attack, will: Will) -> None:
        super().__init__(broker, client_id, will=will)
        self.attack = attack
        self.tasks: dict[str, dict[str, Payload]] = {}  # task id -> payloads sent down
        # payloads a step's tasks share arrive once on bcast/knowledge, by digest
        self.knowledge: dict[bytes, dict[str, Payload]] = {}
        self.poisoned = 0

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Also keep the payloads of every task that arrives (the global model)."""

        def spy(topic: str, data: bytes) -> None:
            try:
                env = decode(data)
            except Exception:  # chunks and anything else: the agent's endpoint decides
                env = None
            if env is not None and isinstance(env.body, Knowledge):
                self.knowledge[env.body.digest] = dict(env.body.payloads)
            if env is not None and isinstance(env.body, Task):
                shared = self.knowledge.get(env.body.shared, {})
                self.tasks[env.body.task_id] = {**shared, **env.body.payloads}
            handler(topic, data)

        super().subscribe(topic_filter, spy, qos)

    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> None:
        """Rewrite a ``train`` reply's payloads; everything else passes unchanged."""
        env = decode(payload)
        body = env.body
        if isinstance(body, Reply) and body.phase == "train" and body.payloads:
            task = self.tasks.get(body.task_id, {})
            bad = dataclasses.replace(body, payloads=self.attack(dict(body.payloads), task))
            payload = encode(dataclasses.replace(env, body=bad))
            self.poisoned += 1
        super().publish(topic, payload, qos=qos, retain=retain)


def add_args(ap: argparse.ArgumentParser) -> None:
    """The script's own options (defaults: benchmarks/presets/poisoning.toml)."""
    ap.add_argument("--algorithms", nargs="+", choices=ALGORITHMS)
    ap.add_argument("--options", nargs="+", choices=sorted(OPTIONS))
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--epochs", type=int, help="local epochs per round")
    ap.add_argument("--model", help="every agent's architecture")
    ap.add_argument("--alpha", type=float, help="Dirichlet label skew")
    ap.add_argument("--clients", type=int)


def run_spec(
    args: argparse.Namespace, algorithm: str, option: str, attacked: bool, seed: int
) -> dict[str, Any]:
    """Everything that determines one run (also its identity in the results file)."""
    return {
        "algorithm": algorithm,
        "option": option,
        "attacked": attacked,
        "seed": seed,
        "rounds": args.rounds,
        "epochs": args.epochs,
        "model": args.model,
        "alpha": args.alpha,
        "clients": args.clients,
        "hyper": {"local_epochs": args.epochs, **OPTIONS[option]},
    }


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every seed, algorithm and option that applies to it, clean and attacked."""
    return [
        run_spec(args, algorithm, option, attacked, seed)
        for seed in args.seeds
        for algorithm in args.algorithms
        for option in args.options
        if applies(algorithm, option)
        for attacked in (False, True)
    ]


def execute(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One simulation; the honest agents' final accuracies."""
    from coordinator.config import load_config
    from coordinator.sim.simulate import FleetSpec, simulate
    from models.cpu_threads import limit_cpu_threads

    limit_cpu_threads(args.threads)

    run_dir = Path(tempfile.mkdtemp(prefix="poisoning-"))
    broker = MemoryBroker()
    links: list[PoisonTransport] = []

    def transport(client_id: str, will: Will) -> Transport:
        if spec["attacked"] and client_id == ATTACKER:
            links.append(PoisonTransport(broker, client_id, ATTACKS[spec["algorithm"]], will))
            return links[-1]
        return MemoryTransport(broker, client_id, will=will)

    try:
        cfg = load_config(
            None,
            [],
            algorithm=spec["algorithm"],
            rounds=spec["rounds"],
            run_dir=str(run_dir),
            min_agents=spec["clients"],
            seed=spec["seed"],
            fraction=1.0,
            deadline_s=args.deadline,
            max_retries=1,
            num_classes=10,
            run_id="poisoning",
        ).replace(hyper=spec["hyper"])
        fleet = FleetSpec(
            num_agents=spec["clients"],
            models=(spec["model"],),
            data="digits",
            partition=f"dirichlet:{spec['alpha']}",
            feature_dim=64,
        )
        t0 = time.time()
        result = simulate(cfg, fleet, transport_factory=transport)
        wall = time.time() - t0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    # a run whose steps all failed may end without a final step: its last step's agents
    last = ([s for s in result.metrics if s["phase"] == "final"] or result.metrics or [{}])[-1]
    honest = {d: a for d, a in last.get("agents", {}).items() if d != ATTACKER}
    return {
        "spec": spec,
        "wall_s": wall,
        "poisoned_replies": links[0].poisoned if links else 0,
        "honest_agents": len(honest),
        "acc_local": _mean([a.get("acc_local") for a in honest.values()]),
        "acc_global": _mean([a.get("acc_global") for a in honest.values()]),
        "final_phase": last.get("phase"),
        "steps": [(s["phase"], s.get("status", "done"), len(s["agents"])) for s in result.metrics],
    }


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and np.isfinite(v)]
    return statistics.fmean(vals) if vals else None


def tables(results: experiment.Results) -> str:
    """Markdown: one row per (algorithm, option), clean vs attacked accuracy."""
    runs = results.runs
    cells: dict[tuple[str, str, bool], list[dict[str, Any]]] = {}
    for r in runs:
        s = r["spec"]
        cells.setdefault((s["algorithm"], s["option"], s["attacked"]), []).append(r)
    specs = [r["spec"] for r in runs]
    setting = sorted({(s["rounds"], s["epochs"], s["model"], s["alpha"]) for s in specs})
    lines = [
        "# One poisoning agent out of 10",
        "",
        "Honest agents' mean accuracy in % (mean ± sd over seeds) after the `final` step: "
        "`agent0`..`agent8` on their own test splits (local) and on the 360-image global test "
        "set (global). clean: all 10 agents honest; attacked: `agent9` poisons every `train` "
        "reply (see `benchmarks/poisoning.py`). Settings (rounds, local epochs, model, "
        f"Dirichlet alpha): {setting}; digits, 10 agents, all participate every round.",
        "",
        "| algorithm | option | seeds | clean local | attacked local | clean global "
        "| attacked global | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for algorithm in ALGORITHMS:
        for option in OPTIONS:
            clean = cells.get((algorithm, option, False), [])
            bad = cells.get((algorithm, option, True), [])
            if not clean and not bad:
                continue
            wall = statistics.fmean(r["wall_s"] for r in clean + bad)
            lines.append(
                f"| {algorithm} | {option} | {len(clean)}/{len(bad)} | "
                f"{mean_sd([r['acc_local'] for r in clean])} | "
                f"{mean_sd([r['acc_local'] for r in bad])} | "
                f"{mean_sd([r['acc_global'] for r in clean])} | "
                f"{mean_sd([r['acc_global'] for r in bad])} | {wall:.0f} |"
            )
    return "\n".join(lines) + "\n"


def _describe(r: dict[str, Any]) -> str:
    return (
        f"attacked={r['spec']['attacked']} option={r['spec']['option']}: "
        f"local {r['acc_local']} global {r['acc_global']} ({r['wall_s']:.0f} s)"
    )


EXPERIMENT = experiment.Experiment(
    description=__doc__ or "",
    preset=PRESET,
    plan=plan,
    execute=execute,
    describe=_describe,
    tables=tables,
    add_args=add_args,
    jobs=False,
    deadline=900.0,
)


if __name__ == "__main__":
    experiment.main(EXPERIMENT)
