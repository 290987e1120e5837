"""FedType, edge half (``shared/specs/fedtype.md`` §3-4): a private model and a shared proxy
co-train in the one loop; only the proxy travels.

Both models are parameter groups of the main step, on one summed loss::

    J = CE(w(x), y) + BKD(w(x), S, eta)  +  CE(p(x), y) + KL(softmax w(x).detach() || softmax p(x))
        \\_______ private model ______/     \\______________ proxy (+ FedProx) _______________/

The two halves touch disjoint parameters (the teacher logits are detached; S, L and eta come
from frozen snapshots without gradients), so the gradient of the sum w.r.t. each model is the
gradient of its own loss, and each group's own Adam steps it: exactly the spec's two-optimiser
joint schedule (§4.1), with one backward pass.

Conformal models are calibrated at the start of every epoch from frozen eval-mode snapshots of
both models on ``D'`` (a seeded ``val_fraction`` of the device's training data, never trained
on), in the loop's ``before_epoch`` hook (after the previous epoch's last update).
"""

from __future__ import annotations

import copy
import logging
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.algorithms.base import (
    EdgeContext,
    PhaseResult,
    SharedModule,
    received,
    register_edge_algorithm,
)
from edge_agent.algorithms.shared_model import (
    build_fleet_model,
    fleet_model_seed,
    seeded_fleet_model,
)
from edge_agent.algorithms.weights import WeightExchangeEdge, load_tensormap
from edge_agent.conformal import (
    Calibration,
    calibrate,
    consensus,
    g_penalty,
    prediction_sets,
    topk_sets,
    uniform,
)
from edge_agent.distillation import forward_kd
from edge_agent.trainer import ParamGroup, TensorData, TrainStats, evaluate
from models import Classifier
from models.checkpoint import Checkpoint, HeadSpec
from models.seeding import derived_seed
from protocol.algorithms.fedtype import FedTypeConfig
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Task
from protocol.contract.payloads import TensorMap

__all__ = ["FedTypeEdge", "backward_kd", "symmetric_kd"]

log = logging.getLogger("edgefl.fedtype")
_PROXY = "proxy."  # prefix of the proxy's tensors in the checkpoint's extra state
PROXY_ROLE = "fedtype-proxy"  # names the proxy in its fleet-wide seed


def symmetric_kd(private_logits: Tensor, proxy_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """The FedType_sym arm: ordinary KD ``KL(softmax p || softmax w)``, the proxy as teacher."""
    return forward_kd(private_logits, proxy_logits, temperature)


def backward_kd(
    private_logits: Tensor,
    sets: Tensor,
    eta: Tensor,
    reduction: str = "sum",
    form: str = "printed",
) -> Tensor:
    """Eq. 3 as a loss (§9-1): ``mean_j -eta_j * sum_{k in S_j} log softmax(w(x_j))_k``.

    ``sets`` is a mask ``[b, C]``. ``mean_over_set`` divides each sample's sum by ``|S_j|``;
    ``pairwise`` normalises each label of S against the labels outside S only.
    """
    z = private_logits.float()
    if form == "pairwise":  # log(e^{z_k} / (e^{z_k} + sum_{v not in S} e^{z_v}))
        outside = z.masked_fill(sets, -math.inf).logsumexp(dim=1, keepdim=True)
        logp = z - torch.logaddexp(z, outside)
    else:  # printed: Phi sums over S and V, i.e. the full softmax denominator
        logp = F.log_softmax(z, dim=1)
    per = -torch.where(sets, logp, torch.zeros_like(logp)).sum(dim=1)
    if reduction == "mean_over_set":
        per = per / sets.sum(dim=1).clamp(min=1)
    return (eta * per).mean()


@dataclass(frozen=True)
class _Split:
    """``D_i`` (trained on) and ``D_i'`` (conformal calibration and Delta only)."""

    train: TensorData
    val: TensorData


@dataclass(frozen=True)
class _Conformal:
    """One epoch's frozen eval-mode snapshots, their conformal wrappers (cp, cw) and g."""

    proxy: nn.Module
    private: nn.Module
    cal_p: Calibration
    cal_w: Calibration
    penalty_s: float  # g(Delta, lambda), the penalty of the proxy's sets S

    @property
    def valid(self) -> bool:
        """Both thresholds exist (else BKD is skipped this epoch, §9-11)."""
        return self.cal_p.valid and self.cal_w.valid


def _frozen(module: nn.Module) -> nn.Module:
    snap = copy.deepcopy(module).eval()
    for p in snap.parameters():
        p.requires_grad_(False)
    return snap


def _accuracy(model: nn.Module, data: TensorData) -> float | None:
    return evaluate(model, data).accuracy if len(data) else None


@register_edge_algorithm("fedtype")
class FedTypeEdge(WeightExchangeEdge[FedTypeConfig]):
    """Private model ``ctx.model`` (never sent) and proxy ``self.proxy`` (the ``weights``)."""

    discloses_model = False  # spec §3.3: not even the private model's name or size is sent

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        # built at the first task: its architecture is in the task's config
        self.proxy: Classifier | None = None
        self.split: _Split | None = None
        self.a_stored: float | None = None  # D' accuracy of the proxy last uploaded (§4.5)
        self._restored: dict[str, Tensor] | None = None
        seed = int(ctx.generator.initial_seed())
        # RAPS randomisation u (§9-12) and the coverage metric draw on their own streams, so
        # measuring coverage never changes training
        self.noise = torch.Generator().manual_seed(derived_seed(seed, "fedtype-raps"))
        self._eval_noise = torch.Generator().manual_seed(derived_seed(seed, "fedtype-coverage"))
        self.conformal: _Conformal | None = None  # this epoch's cp and cw
        self._a_prev: float | None = None
        self._anchor: list[Tensor] | None = None  # p_g for FedProx
        self.stats: defaultdict[str, float] = defaultdict(float)

    # ----- the proxy and the split, built once from the first task's config ------------------
    def _ready(self) -> tuple[Classifier, _Split]:
        if self.proxy is None:
            # already the fleet's shared p_g^0
            self.proxy = seeded_fleet_model(self.ctx, PROXY_ROLE, self.config.proxy_model)
            if self._restored is not None:
                self._load_restored(self.proxy, self._restored)
        if self.split is None:
            self.split = self._make_split()
        return self.proxy, self.split

    def _build_proxy(self) -> Classifier:
        return build_fleet_model(self.ctx, self.config.proxy_model)

    def _make_split(self) -> _Split:
        """A seeded per-device split, the same after a restart (§3.0: made once per run)."""
        data, cfg = self.ctx.train, self.config
        g = torch.Generator().manual_seed(
            derived_seed(int(self.ctx.generator.initial_seed()), "fedtype-split")
        )
        order = torch.randperm(len(data), generator=g).to(data.x.device)
        if cfg.calibration_split == "train":  # the authors' code: no hold-out, calibrate on D_i
            return _Split(data, TensorData(data.x[order], data.y[order]))
        n_val = round(cfg.val_fraction * len(data))
        if n_val < 20:
            log.warning("calibration split of %d samples: conformal sets will be coarse", n_val)
        val, train = order[:n_val], order[n_val:]
        return _Split(
            TensorData(data.x[train], data.y[train]), TensorData(data.x[val], data.y[val])
        )

    def exchanged_module(self) -> nn.Module:
        """The proxy travels; the private model never does."""
        return self._ready()[0]

    def weight_encoding(self) -> Encoding:
        """As the run configures (``weight_encoding``: raw, f16 or i8)."""
        return self.config.weight_encoding

    def shared_modules(self) -> dict[str, SharedModule]:
        """Only the proxy starts identical fleet-wide; the private model keeps its own init."""
        proxy, _ = self._ready()
        # the same seed on every agent: one proxy architecture and input for the fleet (admit)
        seed = fleet_model_seed(self.ctx, PROXY_ROLE, self.config.proxy_model)
        return {"proxy": SharedModule(proxy, self._build_proxy, seed)}

    # ----- one participation ----------------------------------------------------------------
    def train_phase(self, task: Task) -> PhaseResult:
        """Receive p_g, co-train R epochs, upload p; n_i = |D_i| weighs the average."""
        self._ready()
        self.stats = defaultdict(float)
        result = super().train_phase(task)
        result.num_samples = len(self._ready()[1].train)
        result.metrics.update(self.round_metrics())
        return result

    def final_phase(self, task: Task) -> PhaseResult:
        """Evaluate the last local proxy and the final global one (§3.4); train nothing."""
        proxy, split = self._ready()
        weights = received(task.payloads, "weights", TensorMap)
        glob = None
        if weights is not None:
            glob = copy.deepcopy(proxy)
            load_tensormap(glob, weights, "payloads.weights")
            if self.a_stored is None:  # never trained: its local proxy is p_g^T (§9-16)
                proxy.load_state_dict(glob.state_dict())
        metrics = {"proxy_acc": _accuracy(proxy, self.ctx.test)}
        if glob is not None:
            metrics["global_proxy_acc"] = _accuracy(glob, self.ctx.test)
        finite = {k: v for k, v in metrics.items() if v is not None}
        return PhaseResult(metrics=finite, num_samples=len(split.train))

    def local_train(self, data: TensorData, epochs: int | None = None) -> TrainStats:
        """R epochs over ``D_i`` (``data`` minus the calibration split), calibrating first."""
        proxy, split = self._ready()
        cfg = self.config
        self._record("global_proxy_acc", _accuracy(proxy, self.ctx.test))  # p_g, untrained
        self._anchor = (
            [p.detach().clone() for p in proxy.parameters()] if cfg.proxy_fl == "fedprox" else None
        )
        self._a_prev = self.a_stored  # Delta^1: did aggregation hurt my proxy? (§4.5)
        stats = super().local_train(split.train, epochs)
        self.a_stored = _accuracy(proxy, split.val)
        self._record("proxy_val_acc", self.a_stored)
        self._record("proxy_acc", _accuracy(proxy, self.ctx.test))
        return stats

    def param_groups(self) -> list[ParamGroup]:
        """Both models on the main step, each with its own optimiser (summed, separable loss)."""
        proxy, _ = self._ready()
        lr = self.config.proxy_lr or None
        return [ParamGroup("private", self.ctx.model), ParamGroup("proxy", proxy, lr=lr)]

    # ----- calibration at each epoch start (§4.4, §4.5) -------------------------------------
    def _start_epoch(self) -> None:
        proxy, split = self._ready()
        cfg = self.config
        a = _accuracy(proxy, split.val)
        delta = 0.0 if a is None or self._a_prev is None else a - self._a_prev
        self._a_prev = a
        pen_s = g_penalty(delta, cfg.raps_lambda, cfg.g_fn)
        snap_p, snap_w = _frozen(proxy), _frozen(self.ctx.model)
        pen_cal = cfg.raps_lambda if cfg.calibrate_penalty == "base" else pen_s
        cal_p = self._calibrate(snap_p, split.val, pen_cal)
        cal_w = self._calibrate(snap_w, split.val, cfg.raps_lambda)  # L uses lambda (§9-9)
        self.conformal = _Conformal(snap_p, snap_w, cal_p, cal_w, pen_s)
        st = self.stats
        if st["epochs"] == 0:
            st["delta_first"] = delta
        st["epochs"] += 1
        st["g_sum"] += pen_s
        if not self.conformal.valid:  # §9-11: skip BKD, never tau = inf
            st["bkd_skipped_epochs"] += 1
            log.warning(
                "%d calibration samples are too few at theta=%s: no BKD", len(split.val), cfg.theta
            )
        elif cfg.measure_coverage:
            self._coverage(self.conformal)

    @torch.no_grad()
    def _calibrate(self, snapshot: nn.Module, val: TensorData, penalty: float) -> Calibration:
        cfg = self.config
        platt = {
            "init": cfg.platt_init,
            "lr": cfg.platt_lr,
            "max_iters": cfg.platt_iters,
            "tol": cfg.platt_tol,
            "batch_size": cfg.platt_batch,
        }
        return calibrate(
            snapshot(val.x),
            val.y,
            theta=cfg.theta,
            penalty=penalty,
            k_reg=cfg.raps_k_reg,
            generator=self.noise,
            platt=platt,
        )

    @torch.no_grad()
    def _coverage(self, cp: _Conformal) -> None:
        """Coverage of this epoch's calibrated sets on the test split (Gate B, metrics only)."""
        test = self.ctx.test
        if not len(test):
            return
        idx = torch.arange(len(test), device=test.y.device)
        for name, snap, cal in (("p", cp.proxy, cp.cal_p), ("w", cp.private, cp.cal_w)):
            u = uniform(len(test), self._eval_noise, test.x.device)
            sets = prediction_sets(snap(test.x), cal, u)
            self.stats[f"cov_hits_{name}"] += float(sets[idx, test.y].sum())
        self.stats["cov_n"] += len(test)

    # ----- the loop's hooks -----------------------------------------------------------------
    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """Private: CE + BKD; proxy: CE + forward KD (+ FedProx). Summed; see the module doc."""
        proxy, _ = self._ready()
        cfg = self.config
        zp = proxy(x)
        ce_w, ce_p = F.cross_entropy(logits, y), F.cross_entropy(zp, y)
        fkd = forward_kd(zp, logits, cfg.kd_temperature)
        bkd = self._bkd(x, logits, zp)
        if not cfg.bkd_private:  # the authors' code: the term is computed, its gradient lost
            bkd = bkd.detach()
        loss = ce_w + bkd + ce_p + fkd
        if self._anchor is not None:
            prox = sum(
                (p - a).pow(2).sum() for p, a in zip(proxy.parameters(), self._anchor, strict=True)
            )
            loss = loss + cfg.prox_mu / 2 * prox
        for name, term in (("ce_private", ce_w), ("bkd", bkd), ("ce_proxy", ce_p), ("fkd", fkd)):
            self.stats[f"sum_{name}"] += float(term.detach())
        self.stats["steps"] += 1
        return loss

    def _bkd(self, x: Tensor, zw: Tensor, zp: Tensor) -> Tensor:
        cfg = self.config
        if cfg.bkd == "symmetric":
            return symmetric_kd(zw, zp, cfg.kd_temperature)
        if self.conformal is None or not self.conformal.valid:
            return zw.new_zeros(())
        sets, eta = self._sets(x, self.conformal)
        return backward_kd(zw, sets, eta, cfg.bkd_reduction, cfg.bkd_form)

    @torch.no_grad()
    def _sets(self, x: Tensor, cp: _Conformal) -> tuple[Tensor, Tensor]:
        """S (proxy, penalty g), L (private, lambda) and eta from this epoch's snapshots."""
        cfg = self.config
        zp, zw = cp.proxy(x), cp.private(x)
        u = uniform(len(x), self.noise, x.device)  # one u per sample for the proxy's sets
        s_lam = prediction_sets(zp, cp.cal_p, u)
        if cfg.bkd == "topk":
            s = topk_sets(zp, cfg.top_k)
        else:
            s = prediction_sets(zp, cp.cal_p, u, penalty=cp.penalty_s)
        u_l = uniform(len(x), self.noise, x.device) if cfg.raps_draws == "independent" else u
        l_set = prediction_sets(zw, cp.cal_w, u_l)
        eta = consensus(s, l_set) if cfg.eta_mode == "consensus" else torch.ones(len(x))
        st = self.stats
        st["sets_n"] += len(x)
        st["eta_sum"] += float(eta.sum())
        st["size_s"] += float(s.sum())
        st["size_l"] += float(l_set.sum())
        if cfg.bkd == "conformal" and cfg.calibrate_penalty == "base":
            st["not_nested"] += float((s & ~s_lam).any(dim=1).sum())  # S_g must sit in S_lambda
        return s, eta.to(x.device)

    def before_epoch(self, epoch: int) -> None:
        """Calibrate from snapshots of both models as they enter the epoch (§4.4)."""
        self._start_epoch()

    # ----- metrics, state, export -----------------------------------------------------------
    def _record(self, name: str, value: float | None) -> None:
        if value is not None:
            self.stats[name] = value

    def round_metrics(self) -> dict[str, float]:
        """This participation's accuracies, conformal statistics and mean loss terms."""
        st = self.stats
        out = {
            k: st[k]
            for k in ("global_proxy_acc", "proxy_acc", "proxy_val_acc", "delta_first")
            if k in st
        }
        out["bkd_skipped_epochs"] = st["bkd_skipped_epochs"]
        if st["epochs"]:
            out["g_mean"] = st["g_sum"] / st["epochs"]
        if st["sets_n"]:
            n = st["sets_n"]
            out.update(
                mean_eta=st["eta_sum"] / n,
                mean_set_size=st["size_s"] / n,
                mean_private_set_size=st["size_l"] / n,
                sets_not_nested=st["not_nested"],
            )
        if st["cov_n"]:
            n = st["cov_n"]
            out.update(
                coverage_proxy=st["cov_hits_p"] / n,
                coverage_private=st["cov_hits_w"] / n,
                coverage_n=n,
            )
        if st["steps"]:
            for name in ("ce_private", "bkd", "ce_proxy", "fkd"):
                out[name] = st[f"sum_{name}"] / st["steps"]
        return out

    def proxy_checkpoint(self) -> Checkpoint:
        """The proxy as an exportable checkpoint (the private model is the agent's own)."""
        proxy, _ = self._ready()
        head = HeadSpec(type="logits", prototypes=None, valid=None)
        return Checkpoint.from_model(proxy, head, meta={"algorithm": "fedtype", "role": "proxy"})

    def extra_exports(self) -> dict[str, Checkpoint]:
        """The proxy, when the run asks for it (``export_proxy``)."""
        if self.cfg is None or not self.cfg.export_proxy:
            return {}
        return {"proxy": self.proxy_checkpoint()}

    def random_streams(self) -> dict[str, torch.Generator]:
        """The batch order's, RAPS's randomisation and the coverage metric's draws."""
        return super().random_streams() | {
            "fedtype_raps": self.noise,
            "fedtype_coverage": self._eval_noise,
        }

    def extra_state(self) -> dict[str, Tensor]:
        """The local proxy and the D' accuracy of the last upload survive restarts."""
        if self.proxy is None:
            return {}
        out = {_PROXY + k: v.detach().cpu() for k, v in self.proxy.state_dict().items()}
        if self.a_stored is not None:
            out["proxy_val_acc"] = torch.tensor([self.a_stored])
        return out

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Keep the proxy's tensors until the first task says which proxy to build."""
        super().load_extra_state(state)
        proxy = {k[len(_PROXY) :]: v for k, v in state.items() if k.startswith(_PROXY)}
        self._restored = proxy or None
        if not proxy:  # nothing to resume from: the proxy still needs the shared init
            self._shared_ready = False
        acc = state.get("proxy_val_acc")
        self.a_stored = float(acc[0]) if acc is not None else None

    def _load_restored(self, proxy: nn.Module, state: dict[str, Tensor]) -> None:
        own = proxy.state_dict()
        if set(state) != set(own) or any(state[k].shape != own[k].shape for k in own):
            log.warning("checkpointed proxy does not fit %s: starting from p_g^0", type(proxy))
            return
        proxy.load_state_dict(state)
