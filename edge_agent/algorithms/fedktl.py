"""FedKTL, edge half (``shared/specs/fedktl.md`` §3.2, §3.3, §4.1, §4.2, §9.2).

The model is ``normalize -> trunk -> proj -> [head]`` (:class:`models.Classifier`) built with
``feature_dim = K``: ``forward_features`` is the ETF-space embedding ``g = h o f`` with
``h = proj``, so the inference graph is ``forward_features`` followed by the cosine against
the fixed ETF vectors, exactly what the export's cosine head computes (§9.2); the classifier's
own linear head is unused. ``f``, the input of the fixed projection h', is the trunk's output
average-pooled to K' (the authors' ``AdaptiveAvgPool1d(K')``), common to every architecture.

A round: hold the set-up (ETF, h' weights; checked against the config's SHA-256), reload h'
from it, train with ``ArcFace(cos(g(x), V)) + mu * MSE(h'(f(I)), Q)`` on cycled mini-batches of
the received image-vector pairs (h' as its own SGD group with its own clip), then upload
unit-norm class prototypes of g over the training split (under ``hyper.dp``, their sums and
counts noised by :meth:`EdgeAlgorithm.release` before they are normalised).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edge_agent.algorithms.base import (
    EdgeAlgorithm,
    EdgeContext,
    PhaseResult,
    TaskPayloads,
    received,
    register_edge_algorithm,
    task_payloads,
)
from edge_agent.class_stats import ClassMeans
from edge_agent.trainer import ParamGroup, TensorData
from models import Classifier
from models.checkpoint import HeadSpec
from models.ktl import arcface_logits
from models.seeding import blank, derived_seed
from protocol.algorithms.fedktl import SETUP_KEYS, FedKTLConfig, setup_digest
from protocol.contract.arrays import Encoding
from protocol.contract.messages import Task
from protocol.contract.payloads import ImageVectorPairs, Payload, PrototypeSet, TensorMap
from protocol.contract.validate import check_class_ids
from protocol.errors import ConfigError, ValidationError

__all__ = ["UNIT_CLIP", "FedKTLEdge", "extractor_output", "unit_embedding_sums", "unit_prototypes"]

STATE_PREFIX = "ktl_setup."


def extractor_output(model: Classifier, x: Tensor, size: int) -> Tensor:
    """``f(x)``: the trunk's flattened output average-pooled to ``size`` (K') values ``[B, K']``.

    Reads the classifier's ``normalize`` and ``trunk`` stages (common to every registered
    architecture) because ``forward_features`` already includes ``h``.
    """
    z = model.trunk(model.normalize(x)).flatten(1)
    return F.adaptive_avg_pool1d(z.unsqueeze(1), size).squeeze(1)


#: The L2 bound of each vector of a released sum (hyper.dp): the embeddings are unit vectors,
#: so clipping to less would scale every one alike and change no prototype's direction, and
#: clipping to more would add noise for nothing (docs/concepts/privacy.md)
UNIT_CLIP = 1.0


@torch.no_grad()
def unit_embedding_sums(
    model: Classifier, data: TensorData, num_classes: int, clip: float = 0.0
) -> ClassMeans:
    """Per-class sums and counts of ``normalize(g(x))`` over ``data``, in eval mode (the
    authors' ``collect_protos``, §3.3); ``clip > 0`` (DP on) clips each to it as it adds."""
    was_training = model.training
    model.eval()
    stats = ClassMeans(num_classes, model.num_features, data.x.device, clip)
    for x, y in data.batches(256, None, shuffle=False):
        stats.add(F.normalize(model.forward_features(x).float(), dim=1), y)
    model.train(was_training)
    return stats


def unit_prototypes(stats: ClassMeans, encoding: Encoding = "raw") -> PrototypeSet:
    """``normalize(sum)`` of every class counted: the direction of its mean of unit
    embeddings (post-processing, so noised sums stay private)."""
    present = stats.present()
    return PrototypeSet(  # the sum's direction is the mean's: no division
        class_ids=present.cpu().numpy(),
        vectors=F.normalize(stats.sums[present], dim=1).cpu().numpy(),
        counts=stats.counts[present].cpu().numpy(),
        encoding=encoding,
    )


@register_edge_algorithm("fedktl")
class FedKTLEdge(EdgeAlgorithm[FedKTLConfig]):
    """ArcFace on the fixed ETF head + the knowledge-transfer regression; prototypes up."""

    TASK_PAYLOADS: ClassVar[TaskPayloads] = task_payloads(
        {"setup": TensorMap, "pairs": ImageVectorPairs}
    )

    def __init__(self, ctx: EdgeContext) -> None:
        super().__init__(ctx)
        self.setup: dict[str, Tensor] | None = None  # SETUP_KEYS -> CPU float32
        self.etf_t: Tensor | None = None  # rownormalise(V^T) [C, K] on the device
        self.proj: nn.Linear | None = None  # h', reloaded from the set-up every round
        self.images: Tensor | None = None  # received pairs: [N, ch, h, w] in [0, 1]
        self.latents: Tensor | None = None  # [N, H]
        self._order: list[int] = []  # what is left of the current pass over the pairs
        # the pairs' order on a stream of its own: the batches over the private data then come
        # in the same order as `local`'s on the same seed (a paired comparison)
        seed = derived_seed(int(ctx.generator.initial_seed()), "fedktl-pairs")
        self._pair_order = torch.Generator().manual_seed(seed)

    # ----- knowledge in ---------------------------------------------------------------------
    def receive(self, payloads: dict[str, Payload]) -> None:
        """Take the set-up if sent, check the held one against the config's digest, reload h',
        take this round's pairs (none in round 1: ArcFace only)."""
        setup = received(payloads, "setup", TensorMap)
        if setup is not None:
            self._take_setup(setup)
        self._check_setup()
        self._reset_proj()
        self._take_pairs(received(payloads, "pairs", ImageVectorPairs))

    def _take_setup(self, setup: TensorMap) -> None:
        if set(setup.tensors) != set(SETUP_KEYS):
            got = sorted(setup.tensors)
            raise ValidationError("payloads.setup", f"tensors {list(SETUP_KEYS)}", got)
        digest = setup_digest(setup.tensors)
        if digest != self.config.setup_sha256:
            raise ValidationError("payloads.setup", f"sha256 {self.config.setup_sha256}", digest)
        self._hold({k: torch.as_tensor(v) for k, v in setup.tensors.items()}, "payloads.setup")

    def _hold(self, tensors: dict[str, Tensor], where: str) -> None:
        """Check the set-up's shapes against this model and the config, then keep it."""
        etf, weight, bias = tensors["etf"], tensors["proj.weight"], tensors["proj.bias"]
        c, dim = self.ctx.num_classes, self.ctx.model.num_features
        if etf.dim() != 2 or etf.shape[1] != c or etf.shape[0] < c:
            raise ValidationError(f"{where}.etf", f"[K >= {c}, {c}]", list(etf.shape))
        if etf.shape[0] != dim:
            raise ConfigError(
                f"fedktl: the ETF has K = {etf.shape[0]} dimensions but the model's features "
                f"have {dim}; build the agent with feature_dim = {etf.shape[0]} (--feature-dim): "
                "forward_features is the ETF-space embedding g = h o f"
            )
        if weight.dim() != 2 or list(bias.shape) != [weight.shape[0]]:
            raise ValidationError(
                f"{where}.proj", "weight [H, K'] and bias [H]", (weight.shape, bias.shape)
            )
        self.setup = {k: v.detach().float().cpu() for k, v in tensors.items()}
        self.etf_t = F.normalize(self.setup["etf"].T, dim=1).to(self.ctx.device)

    def _check_setup(self) -> None:
        want = self.config.setup_sha256
        if self.setup is None:
            raise ConfigError(
                f"fedktl: this agent holds no set-up (ETF, h') and the task carries none; the "
                f"coordinator believes it delivered {want} (was the agent's state dir wiped?)"
            )
        held = setup_digest({k: v.numpy() for k, v in self.setup.items()})
        if held != want:
            raise ValidationError("task.config.setup_sha256", f"the held set-up {held}", want)
        kp = self.setup["proj.weight"].shape[1]
        if kp != self.config.feature_dim:  # the config is only known once a task arrives
            raise ValidationError("setup.proj.weight", f"K' = {self.config.feature_dim}", kp)

    def _reset_proj(self) -> None:
        assert self.setup is not None  # _check_setup passed
        weight, bias = self.setup["proj.weight"], self.setup["proj.bias"]
        # built every round in the agent's thread: blank, so that its draws move no other
        # agent's seeded start (the set-up's weights are copied in next)
        self.proj = blank(lambda: nn.Linear(weight.shape[1], weight.shape[0])).to(self.ctx.device)
        with torch.no_grad():
            self.proj.weight.copy_(weight)
            self.proj.bias.copy_(bias)

    def _take_pairs(self, pairs: ImageVectorPairs | None) -> None:
        self.images = self.latents = None
        self._order = []
        if pairs is None:
            return
        model, h = self.ctx.model, self.config.latent_dim
        shape = (model.in_chans, *model.input_size)
        n = pairs.images.shape[0]
        if tuple(pairs.images.shape[1:]) != shape or not 0 < n <= self.ctx.num_classes:
            raise ValidationError(
                "payloads.pairs.images", f"[1..{self.ctx.num_classes}, {shape}]", pairs.images.shape
            )
        if pairs.vectors.shape[1] != h:
            raise ValidationError("payloads.pairs.vectors", f"[{n}, {h}]", pairs.vectors.shape)
        self._check_classes(pairs)
        dev = self.ctx.device
        self.images = torch.as_tensor(pairs.images, device=dev).float() / 255.0
        self.latents = torch.as_tensor(pairs.vectors, device=dev)

    def _check_classes(self, pairs: ImageVectorPairs) -> None:
        """Every pair names its class, one of this agent's (the payload checked the rest)."""
        ids, c = pairs.class_ids, self.ctx.num_classes
        if ids is None:
            raise ValidationError(
                "payloads.pairs.class_ids", f"{len(pairs.images)} class ids", None
            )
        check_class_ids(ids, "payloads.pairs.class_ids", c)

    def train_phase(self, task: Task) -> PhaseResult:
        """One participation; reports how many pairs drove ``L^M`` (0 in round 1) and how many
        rounds old they are."""
        age = _pairs_age(task)
        result = super().train_phase(task)
        result.metrics["ktl_pairs"] = float(0 if self.latents is None else len(self.latents))
        if age is not None:
            result.metrics["ktl_pairs_age"] = float(age)
        return result

    # ----- the loop's hooks -----------------------------------------------------------------
    def param_groups(self) -> list[ParamGroup]:
        """The model, and h' with its own SGD step and clip norm (thrown away after the round)."""
        groups = [ParamGroup("model", self.ctx.model)]
        if self.proj is not None:
            clip = self.config.proj_grad_clip  # lr: the client's; plain SGD as the authors'
            h_prime = ParamGroup(
                "proj", self.proj, grad_clip=clip, optimizer="sgd", momentum=0.0, weight_decay=0.0
            )
            groups.append(h_prime)
        return groups

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        """``L_A + mu * L_M`` (§4.1, §4.2); ``features`` is ``g(x)``."""
        cfg = self.config
        loss = F.cross_entropy(
            arcface_logits(self._cosine(features), y, cfg.arc_scale, cfg.arc_margin), y
        )
        if cfg.mu > 0 and self.images is not None and self.latents is not None:
            idx = self._next_pairs(cfg.batch_size)
            f = extractor_output(self.ctx.model, self.images[idx], cfg.feature_dim)
            assert self.proj is not None  # receive() reloaded it
            loss = loss + cfg.mu * F.mse_loss(self.proj(f), self.latents[idx])
        return loss

    def _next_pairs(self, batch: int) -> Tensor:
        """The next mini-batch of an endlessly cycled, reshuffled pass over the pairs."""
        if not self._order:
            assert self.latents is not None
            n = self.latents.shape[0]
            self._order = torch.randperm(n, generator=self._pair_order).tolist()
        take, self._order = self._order[:batch], self._order[batch:]
        return torch.tensor(take, device=self.ctx.device)

    def _cosine(self, embedding: Tensor) -> Tensor:
        if self.etf_t is None:
            raise ConfigError("fedktl: no ETF held yet (the set-up arrives with the first task)")
        return F.normalize(embedding.float(), dim=1) @ self.etf_t.T

    # ----- knowledge out, prediction, state -------------------------------------------------
    def reply_payloads(self) -> dict[str, Payload]:
        """Unit-norm prototypes of the classes this device holds (one pass over the training
        split, so each sample is added once; noised first under hyper.dp)."""
        clip = UNIT_CLIP if self.dp_clip() > 0 else 0.0
        stats = unit_embedding_sums(self.ctx.model, self.ctx.train, self.ctx.num_classes, clip)
        self.release([stats], 1)
        return {"protos": unit_prototypes(stats, self.config.proto_encoding)}

    def scores(self, x: Tensor) -> Tensor:
        """Cosines with the ETF vectors (no scale, no margin); logits before any set-up."""
        if self.etf_t is None:
            out: Tensor = self.ctx.model(x)
            return out
        return self._cosine(self.ctx.model.forward_features(x))

    def head_spec(self) -> HeadSpec:
        """The export's cosine head over the ETF vectors."""
        if self.etf_t is None:
            return HeadSpec(type="logits", prototypes=None, valid=None)
        return HeadSpec(type="cosine", prototypes=self.etf_t.cpu(), valid=None)

    def random_streams(self) -> dict[str, torch.Generator]:
        """The batch order's and the pairs' order."""
        return super().random_streams() | {"fedktl_pairs": self._pair_order}

    def extra_state(self) -> dict[str, Tensor]:
        """The set-up survives restarts: it is sent to each agent once."""
        if self.setup is None:
            return {}
        return {STATE_PREFIX + k: v for k, v in self.setup.items()}

    def load_extra_state(self, state: dict[str, Tensor]) -> None:
        """Restore the set-up (checked against this model)."""
        super().load_extra_state(state)
        held = {
            k.removeprefix(STATE_PREFIX): v for k, v in state.items() if k.startswith(STATE_PREFIX)
        }
        if set(held) == set(SETUP_KEYS):
            self._hold(held, "checkpoint.extra")


def _pairs_age(task: Task) -> int | None:
    """Rounds between the server phase that made the task's pairs and this task. Pairs are made
    from earlier uploads, so a round at or after the task's own is a replay or a forgery."""
    pairs = task.payloads.get("pairs")
    if not isinstance(pairs, ImageVectorPairs):
        return None  # absent (round 1), or the wrong kind: receive() says which
    if pairs.round >= task.round:
        raise ValidationError(
            "payloads.pairs.round", f"< the task's round {task.round}", pairs.round
        )
    return task.round - pairs.round
