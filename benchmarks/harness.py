"""The benchmark harness every reproduction script and ``compare.py`` share.

One implementation of what a grid of simulated runs needs:

* a results file (``{"commands": [...], "runs": [...], "failures": [...]}``, JSON) that is
  appended to after every run and resumed from: a run whose spec (the dict that determines it)
  is already among ``runs`` is skipped, a run that raised is kept under ``failures`` with its
  traceback and retried by the next invocation;
* one run: a :class:`SimRun` executed through :func:`coordinator.sim.simulate.simulate` (the
  in-memory transport, the same code paths as a real fleet) with a per-step deadline and a
  torch thread count; with ``--work-dir`` a run killed midway resumes where it stopped (its
  coordinator and agents restart on their state), to the curve it would have had;
* reading the step records: the final step, train steps, per-round bytes as the coordinator's
  endpoint counted them (``tx`` = to agents = down, ``rx`` = from them = up);
* table cells: mean ± sd over seeds, paired per-seed differences with two-sided 95 % Student t
  intervals, markdown written to a file;
* :func:`code_label`: the git HEAD the runs came from.

A script declares its grid as an ``experiment.Experiment`` (``benchmarks/experiment/``), whose
one main runs it with these parts; a spec is any JSON-able dict, and its identity in a results
file is :func:`spec_key`. Nothing here imports torch at import time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coordinator import accuracy

__all__ = [
    "IMAGE_SIZE",
    "T975",
    "SimRun",
    "add_grid_args",
    "by_seed",
    "ci95",
    "ci_cell",
    "client_test_sizes",
    "code_label",
    "final_step",
    "group_by",
    "guarded",
    "host_label",
    "load_results",
    "mean_cell",
    "mean_of",
    "mean_sd",
    "paired_diffs",
    "pending",
    "personalised_accuracy",
    "run_grid",
    "save_results",
    "simulate_run",
    "spec_key",
    "step_bytes",
    "train_steps",
    "write_markdown",
]

Record = dict[str, Any]
ROOT = Path(__file__).resolve().parent.parent

# the datasets the grids run on: name -> image side the agents resize to (None: the dataset's
# own, 8x8 for digits), in the order tables show them
IMAGE_SIZE: dict[str, int | None] = {"digits": None, "mnist5k": 28}
# two-sided 95 % Student t quantiles by degrees of freedom (the normal 1.96 beyond the table)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179)


# ----- the results file -----------------------------------------------------------------------
def spec_key(spec: Record) -> str:
    """A run's identity in a results file: its spec as canonical JSON (sorted keys)."""
    return json.dumps(spec, sort_keys=True)


def _read(path: Path) -> Record:
    return json.loads(path.read_text()) if path.is_file() else {}  # type: ignore[no-any-return]


def _commands(doc: Record) -> list[str]:
    # results files that fedvtc_repro.py wrote without the harness hold one "command"
    if "commands" in doc:
        return list(doc["commands"])
    return [doc["command"]] if "command" in doc else []


def load_results(path: Path) -> tuple[list[Record], list[Record]]:
    """Runs and failures already in ``path`` (empty lists when it does not exist)."""
    doc = _read(path)
    return list(doc.get("runs", [])), list(doc.get("failures", []))


def save_results(
    path: Path, runs: list[Record], failures: list[Record], command: str | None = None
) -> None:
    """Write all results atomically; ``commands`` keeps every distinct command line that
    contributed (default: this process's ``python`` + ``sys.argv``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    commands = _commands(_read(path))
    cmd = command if command is not None else "python " + " ".join(sys.argv)
    if cmd not in commands:
        commands.append(cmd)
    _write(path, {"commands": commands, "runs": runs, "failures": failures})


def _write(path: Path, doc: Record) -> None:
    tmp = path.with_suffix(".tmp")  # atomic: a reader never sees half a file
    tmp.write_text(json.dumps(doc, indent=1, default=float) + "\n")
    tmp.replace(path)


def merge_results(path: Path, other: Path) -> int:
    """Add to ``path`` the runs of ``other`` (another machine's results file, e.g. a GPU
    lease's) whose specs ``path`` lacks, clear ``path``'s failures of those specs and keep
    ``other``'s command lines; a spec ``path`` already has keeps its run. Returns the number
    of runs added."""
    runs, failures = load_results(path)
    theirs = _read(other)
    have = {spec_key(r["spec"]) for r in runs}
    new = [r for r in theirs.get("runs", []) if spec_key(r["spec"]) not in have]
    added = {spec_key(r["spec"]) for r in new}
    failures = [f for f in failures if spec_key(f["spec"]) not in added]
    commands = _commands(_read(path))
    commands += [c for c in _commands(theirs) if c not in commands]
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, {"commands": commands, "runs": runs + new, "failures": failures})
    return len(new)


def pending(specs: Iterable[Record], runs: list[Record]) -> list[Record]:
    """The specs (in their order) that no recorded run has; failures are not done."""
    done = {spec_key(r["spec"]) for r in runs}
    return [s for s in specs if spec_key(s) not in done]


# ----- one run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimRun:
    """Everything :func:`simulate_run` needs: the run config's part and the fleet's part."""

    algorithm: str
    hyper: dict[str, Any]
    seed: int
    rounds: int
    clients: int
    models: tuple[str, ...]  # client i gets models[i % len(models)]
    data: str = "digits"
    partition: str = "dirichlet:0.5"
    feature_dim: int | None = None
    image_size: int | None = None
    global_test: int = 360
    fraction: float = 1.0
    deadline_s: float = 1800.0  # per step
    max_retries: int | None = None  # None: the run config's default
    wait_agents_s: float | None = None  # None: the run config's default
    num_classes: int = 10
    run_id: str = "bench"
    device: str = "cpu"  # where the agents train
    server_device: str | None = None  # the coordinator's server-side training; None: device
    partition_file: str | None = None  # a split file, instead of ``partition``
    preset: str = ""  # run.preset (e.g. "htfllib")
    patience: int = 0  # run.patience: early stopping (0: every round runs)
    global_eval_every: int = 1  # agents score the global test set every N-th round

    @classmethod
    def from_spec(cls, spec: Record, **fields: Any) -> SimRun:
        """The run a grid spec describes: the keys every script's specs share (``algorithm``,
        ``hyper``, ``seed``, ``rounds``, ``clients``, ``alpha`` as a Dirichlet partition, and
        ``data``, ``feature_dim``, ``global_test``, ``fraction`` where the spec has them),
        then ``fields`` (``models`` at least)."""
        values: dict[str, Any] = {
            "algorithm": spec["algorithm"],
            "hyper": spec["hyper"],
            "seed": spec["seed"],
            "rounds": spec["rounds"],
            "clients": spec["clients"],
            "partition": f"dirichlet:{spec['alpha']}",
        }
        for key in ("data", "feature_dim", "fraction"):
            if key in spec:
                values[key] = spec[key]
        if "global_test" in spec:
            values["global_test"] = spec["global_test"]
        return cls(**{**values, **fields})

    def key(self) -> str:
        """A short digest of every field: the name of the run's resumable folder.

        The split file counts by its content, not its path, so that the same command resumes
        the run from another checkout of the tree (a worktree, a fresh clone).
        """
        fields = asdict(self)
        if self.partition_file:
            split = Path(self.partition_file).read_bytes()
            fields["partition_file"] = hashlib.sha256(split).hexdigest()
        return hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:16]

    def config_values(self, run_dir: Path) -> dict[str, Any]:
        """The keyword values for :func:`coordinator.config.load_config`."""
        values: dict[str, Any] = {
            "algorithm": self.algorithm,
            "rounds": self.rounds,
            "run_dir": str(run_dir),
            "min_agents": self.clients,
            "seed": self.seed,
            "fraction": self.fraction,
            "deadline_s": self.deadline_s,
            "num_classes": self.num_classes,
            "run_id": self.run_id,
            "server_device": self.server_device or self.device,
        }
        if self.max_retries is not None:
            values["max_retries"] = self.max_retries
        if self.preset:
            values["preset"] = self.preset
        if self.patience:
            values["patience"] = self.patience
            # HtFLlib's protocol reports the best test round: the benchmarks stop on the
            # personalised test accuracy on purpose, whatever run.monitor's default
            values["monitor"] = accuracy.PERSONALISED
        if self.wait_agents_s is not None:
            values["wait_agents_s"] = self.wait_agents_s
        return values

    def fleet(self) -> Any:
        """The :class:`~coordinator.sim.simulate.FleetSpec` of the run."""
        from coordinator.sim.simulate import FleetSpec

        return FleetSpec(
            num_agents=self.clients,
            models=tuple(self.models),
            data=self.data,
            partition=self.partition,
            feature_dim=self.feature_dim,
            image_size=self.image_size,
            global_test_size=self.global_test,
            device=self.device,
            partition_file=self.partition_file,
            global_eval_every=self.global_eval_every,
        )


def run_folder(run: SimRun, work_dir: Path) -> Path:
    """``run``'s resumable folder in ``work_dir`` (named by :meth:`SimRun.key`)."""
    return work_dir / f"{run.run_id}-{run.key()}"


def simulate_run(
    run: SimRun, threads: int, work_dir: Path | None = None
) -> tuple[list[Record], float]:
    """Run ``run`` in this process with ``threads`` CPU threads (torch's and BLAS's pools);
    return the coordinator's step records and the wall time in seconds.

    The run directory is temporary, or with ``work_dir`` the run's own folder there
    (:meth:`SimRun.key`): a process killed midway leaves it behind, and the next call with the
    same run resumes it from its last completed round (the wall time then counts the resumed
    part only). The folder is removed once the run finishes or fails.
    """
    import coordinator.strategies  # noqa: F401 - registers every server half
    import edge_agent.algorithms  # noqa: F401 - registers every edge half
    from coordinator.config import load_config
    from coordinator.sim.simulate import simulate
    from models.cpu_threads import limit_cpu_threads

    limit_cpu_threads(threads)
    if work_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix=f"{run.run_id}-"))
    else:
        run_dir = run_folder(run, work_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    try:
        cfg = load_config(None, [], **run.config_values(run_dir)).replace(hyper=run.hyper)
        cfg.algorithm_config()  # validate the hyperparameters before starting agents
        t0 = time.time()
        result = simulate(cfg, run.fleet())
        wall = time.time() - t0
    except BaseException as exc:
        # a failed run starts afresh when retried; an interrupted one (Ctrl-C; a kill never
        # gets here) keeps its work-dir folder for the next call to resume
        if work_dir is None or isinstance(exc, Exception):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    shutil.rmtree(run_dir, ignore_errors=True)
    return result.metrics, wall


class _ErrorLog(logging.Handler):
    """Collects the distinct messages logged at ERROR or above (agents log why they stopped:
    an admission refused, a task that failed), the first ``limit`` of them."""

    def __init__(self, limit: int = 10) -> None:
        super().__init__(logging.ERROR)
        self.limit = limit
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if len(self.messages) < self.limit and text not in self.messages:
            self.messages.append(text)


def client_test_sizes(run: SimRun) -> list[int]:
    """Each client's own test-split size, from the partition spec :func:`simulate` hands its
    agents (the weights of a sample-weighted personalised accuracy)."""
    from coordinator.config import load_config
    from coordinator.sim.simulate import agent_options
    from edge_agent.data import load_dataset, make_federated_split

    cfg = load_config(None, [], **run.config_values(Path(tempfile.gettempdir())))
    spec = agent_options(cfg, run.fleet(), 0).partition  # one spec for every client
    split = make_federated_split(load_dataset(run.data), spec)
    return [len(split.client(k)[1]) for k in range(run.clients)]


def split_test_sizes(split: Path) -> list[int]:
    """Each client's test-split size in a partition file (the weights of a sample-weighted
    personalised accuracy)."""
    from edge_agent.data import load_partition_file

    return [len(t) for t in load_partition_file(split).test]


def guarded(execute: Callable[[Record], Record], spec: Record) -> Record:
    """``execute(spec)``, or the error record of the exception it raised (the grid goes on):
    the error, its traceback and the distinct errors logged during the run (``log``)."""
    errors = _ErrorLog()
    logging.getLogger().addHandler(errors)
    try:
        return execute(spec)
    except Exception as exc:
        return {
            "spec": spec,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
            "log": errors.messages,
        }
    finally:
        logging.getLogger().removeHandler(errors)


# ----- a grid ---------------------------------------------------------------------------------
def add_grid_args(
    ap: argparse.ArgumentParser,
    out: str | None,
    *,
    jobs: bool = True,
    deadline: float | None = 600.0,
    code: bool = True,
) -> None:
    """The options every grid script shares: ``--jobs`` (when ``jobs``), ``--threads``,
    ``--work-dir``, ``--deadline`` (when a default is given), ``--code`` (when ``code``),
    ``--out`` (default ``out``; None leaves it to the script), ``--md``, ``--table-only`` and
    ``--progress``."""
    if jobs:
        ap.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per run (torch, BLAS)")
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep each unfinished run's directory here: a grid killed midway resumes its "
        "runs where they stopped (default: temporary directories, a killed run starts over)",
    )
    if deadline is not None:
        ap.add_argument("--deadline", type=float, default=deadline, help="per-step deadline (s)")
    if code:
        ap.add_argument(
            "--code", default=None, help="label of the code version run (default: git HEAD)"
        )
    ap.add_argument("--out", type=Path, default=None if out is None else Path(out))
    ap.add_argument("--md", type=Path, default=None, help="write the markdown tables here")
    ap.add_argument("--table-only", action="store_true", help="only print tables from --out")
    ap.add_argument(
        "--progress",
        action="store_true",
        help="print where each planned run stands (done, in progress in --work-dir with its "
        "round and the time it may still take, to do) and exit; safe beside a running grid",
    )


def _fmt_head(t0: float, spec: Record) -> str:
    alpha = spec.get("alpha")
    where = f" a={alpha:g}" if isinstance(alpha, (int, float)) else ""
    return f"[{time.time() - t0:7.0f}s] {method_name(spec):15s}{where} seed={spec.get('seed')}"


def method_name(spec: Record) -> str:
    """A spec's row name: its method, else its algorithm."""
    return str(spec.get("method", spec.get("algorithm", "?")))


def run_grid(
    out: Path,
    specs: list[Record],
    execute: Callable[[Record], Record],
    *,
    describe: Callable[[Record], str],
    jobs: int = 0,
    code: str | None = None,
) -> tuple[list[Record], list[Record]]:
    """Run the specs that ``out`` does not hold yet, saving after every run.

    ``execute(spec)`` returns a run's summary (a dict with ``spec``); it runs in this process
    when ``jobs`` is 0, else in a pool of ``jobs`` processes (then it must be picklable: a
    module-level function or a ``functools.partial`` of one). Each result gets ``code`` (when
    given); one that holds ``error`` goes to ``failures``, replacing the spec's earlier failure.
    ``describe(result)`` is the end of the progress line of a successful run.
    """
    runs, failures = load_results(out)
    todo = pending(specs, runs)
    print(f"{len(todo)} runs to do, {len(runs)} already in {out}", flush=True)
    t0 = time.time()

    def record(r: Record) -> None:
        nonlocal failures
        if code is not None:
            r["code"] = code
        key = spec_key(r["spec"])
        failures = [f for f in failures if spec_key(f["spec"]) != key]
        head = _fmt_head(t0, r["spec"])
        # another process (a second grid, a --merge) may have added runs to the file since we
        # read it: keep them, or this save would drop them
        have = {spec_key(x["spec"]) for x in runs}
        runs.extend(x for x in load_results(out)[0] if spec_key(x["spec"]) not in have)
        if key not in have and any(spec_key(x["spec"]) == key for x in runs):
            # ...including this very spec: the run recorded first stays, as with --merge
            print(f"{head} already recorded by another process; this result is not kept")
            return
        if "error" in r:
            failures.append(r)
            save_results(out, runs, failures)
            print(f"{head} FAILED {r['error']}\n{r['traceback']}", flush=True)
            return
        runs.append(r)
        save_results(out, runs, failures)
        print(f"{head} {describe(r)}", flush=True)

    if jobs <= 0:
        for spec in todo:
            record(guarded(execute, spec))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(guarded, execute, s) for s in todo]
            for fut in as_completed(futures):
                record(fut.result())
    return runs, failures


def failure_line(out: Path, failures: list[Record]) -> str:
    """``N failed runs recorded in OUT: method/a0.1/s0, ...`` (empty when there are none)."""
    if not failures:
        return ""
    names = ", ".join(
        f"{method_name(f['spec'])}/a{f['spec'].get('alpha')}/s{f['spec'].get('seed')}"
        for f in failures
    )
    return f"{len(failures)} failed runs recorded in {out}: {names}"


def write_markdown(path: Path | None, text: str) -> None:
    """Write ``text`` to ``path`` (parents created); nothing when ``path`` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def host_label() -> str:
    """The machine a run ran on: its name, CPU count and CPU model. Float results can differ
    in their last bits between CPU models (each picks its own vector kernels), and over many
    rounds such bits can move a test sample: the model says which runs can agree to the bit."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{platform.node()} ({os.cpu_count()} CPUs, {model})"


def code_label(dirty: bool = False) -> str:
    """``git rev-parse --short HEAD`` of this checkout (``unknown`` outside one); with
    ``dirty``, ``-dirty`` appended when tracked files differ from HEAD."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        changed = _git("status", "--porcelain", "--untracked-files=no") if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if changed else "")


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip()


# ----- step records ---------------------------------------------------------------------------
def final_step(steps: list[Record]) -> Record:
    """The last ``final`` step, else the last step."""
    final = [s for s in steps if s["phase"] == "final"]
    return final[-1] if final else steps[-1]


def train_steps(steps: list[Record]) -> list[Record]:
    """The training rounds' records, in order."""
    return [s for s in steps if s["phase"] == "train"]


def mean_of(records: Iterable[Record], key: str) -> float | None:
    """Mean of the numeric ``key`` values of ``records`` (None when there is none)."""
    vals = [float(a[key]) for a in records if isinstance(a.get(key), (int, float))]
    return statistics.fmean(vals) if vals else None


def step_bytes(step: Record, direction: str, *, progress: bool = True) -> int:
    """Bytes of one step in ``direction`` (``tx`` = to agents, ``rx`` = from them), as the
    coordinator's endpoint counted them; ``progress=False`` leaves out the agents' progress
    messages (time-throttled, not part of an algorithm's exchange)."""
    return sum(
        int(v)
        for k, v in step["bytes"].items()
        if k.startswith(direction) and (progress or not k.endswith(".progress"))
    )


def personalised_accuracy(agents: dict[str, Record], test_sizes: list[int]) -> float | None:
    """``acc_local`` of a step's agents weighted by their own test split's size: the accuracy
    over the union of the clients' test splits. Agents are simulate()'s ``agent{i}``."""
    weights = {device: test_sizes[int(device.removeprefix("agent"))] for device in agents}
    return accuracy.personalised_accuracy(agents, weights)


# ----- tables ---------------------------------------------------------------------------------
def group_by(runs: Iterable[Record], key: Callable[[Record], Any]) -> dict[Any, list[Record]]:
    """Runs grouped by ``key(run)``, groups and runs in first-seen order."""
    out: dict[Any, list[Record]] = {}
    for r in runs:
        out.setdefault(key(r), []).append(r)
    return out


def mean_sd(vals: Iterable[float | None], scale: float = 100.0, digits: int = 1) -> str:
    """``mean ± sd`` of the non-None values times ``scale`` (sd 0 for one value, ``–`` for
    none)."""
    xs = [v for v in vals if v is not None]
    if not xs:
        return "–"
    mean = statistics.fmean(xs) * scale
    sd = statistics.stdev(xs) * scale if len(xs) > 1 else 0.0
    return f"{mean:.{digits}f} ± {sd:.{digits}f}"


def mean_cell(vals: Iterable[float | None], digits: int = 2) -> str:
    """The mean of the non-None values (``–`` for none)."""
    xs = [v for v in vals if v is not None]
    return f"{statistics.fmean(xs):.{digits}f}" if xs else "–"


def ci95(vals: list[float]) -> tuple[float, float]:
    """Mean and half-width of the two-sided 95 % Student t interval (NaN for one value)."""
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return mean, math.nan
    df = len(vals) - 1
    t = T975[df - 1] if df <= len(T975) else 1.96
    return mean, t * statistics.stdev(vals) / math.sqrt(len(vals))


def ci_cell(vals: list[float], scale: float = 100.0, digits: int = 1) -> str:
    """``+mean [+low, +high]`` of ``vals`` times ``scale`` (95 % t interval); one value alone
    has no interval."""
    mean, half = ci95([scale * v for v in vals])
    if len(vals) < 2:
        return f"{mean:+.{digits}f}"
    return f"{mean:+.{digits}f} [{mean - half:+.{digits}f}, {mean + half:+.{digits}f}]"


def by_seed(runs: Iterable[Record]) -> dict[int, Record]:
    """Runs by their spec's seed (the last one wins)."""
    return {r["spec"]["seed"]: r for r in runs}


def paired_diffs(
    runs_a: Iterable[Record], runs_b: Iterable[Record], key: str, key_b: str | None = None
) -> list[float]:
    """Per-seed ``a[key] - b[key_b or key]`` over the seeds both have, where both values exist
    (same seed = same partition, inits and test sets)."""
    ra, rb = by_seed(runs_a), by_seed(runs_b)
    kb = key_b or key
    return [
        ra[s][key] - rb[s][kb]
        for s in sorted(set(ra) & set(rb))
        if ra[s].get(key) is not None and rb[s].get(kb) is not None
    ]
