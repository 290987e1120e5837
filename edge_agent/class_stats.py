"""Class-wise statistics of a model over local data (prototypes, feature and logit means)."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from edge_agent.dp import clip_rows
from edge_agent.trainer import TensorData
from models import Classifier
from protocol.contract.arrays import Encoding
from protocol.contract.payloads import LabelledVectors, PrototypeSet
from protocol.errors import ValidationError

__all__ = [
    "ClassMeans",
    "ClassReservoir",
    "class_feature_sums",
    "class_output_sums",
    "class_prototypes",
    "merge_prototypes",
    "prototype_scores",
    "prototype_table",
]


class ClassMeans:
    """Per-class sums and counts of vectors (features, logits), turned into per-class means or a
    :class:`PrototypeSet`."""

    def __init__(self, num_classes: int, dim: int, device: torch.device, clip: float = 0.0) -> None:
        self.sums = torch.zeros(num_classes, dim, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.long, device=device)
        # > 0: each vector is clipped to this L2 norm as it is added (hyper.dp.clip), which
        # bounds a sample's contribution to its class's sum (edge_agent.dp)
        self.clip = clip

    def add(self, features: Tensor, y: Tensor) -> None:
        """Count ``features`` ([B, D], detached) under their labels ``y`` ([B])."""
        vectors = features.float()
        if self.clip > 0:
            vectors = clip_rows(vectors, self.clip)
        self.sums.index_add_(0, y, vectors)
        self.counts += torch.bincount(y, minlength=self.counts.shape[0])

    def reset(self, clip: float = 0.0) -> None:
        """Forget everything counted; clip what comes next to ``clip`` (0: not at all)."""
        self.sums.zero_()
        self.counts.zero_()
        self.clip = clip

    def present(self) -> Tensor:
        """The ids of the classes counted at least once, ascending."""
        return (self.counts > 0).nonzero().flatten()

    def means(self, present: Tensor) -> Tensor:
        """The mean vector of each class in ``present`` (:meth:`present`)."""
        return self.sums[present] / self.counts[present].unsqueeze(1).float()

    def prototypes(self, encoding: Encoding = "raw") -> PrototypeSet:
        """The mean feature of every class counted at least once."""
        present = self.present()
        return PrototypeSet(
            class_ids=present.cpu().numpy(),
            vectors=self.means(present).cpu().numpy(),
            counts=self.counts[present].cpu().numpy(),
            encoding=encoding,
        )


class ClassReservoir:
    """A uniform sample of at most ``size`` vectors of each class from a stream of batches
    (reservoir sampling, Algorithm R), drawn with its own generator so that sampling does not
    move any other random stream."""

    def __init__(self, num_classes: int, size: int, generator: torch.Generator) -> None:
        self.size, self.generator = size, generator
        self.seen = [0] * num_classes
        self.kept: list[list[Tensor]] = [[] for _ in range(num_classes)]

    def add(self, vectors: Tensor, y: Tensor) -> None:
        """Offer ``vectors`` ([B, D], detached) under their labels ``y`` ([B])."""
        for vector, label in zip(vectors.float().cpu(), y.tolist(), strict=True):
            seen, kept = self.seen[label], self.kept[label]
            self.seen[label] += 1
            if seen < self.size:
                kept.append(vector.clone())
                continue
            j = int(torch.randint(seen + 1, (1,), generator=self.generator))
            if j < self.size:
                kept[j] = vector.clone()

    def reset(self) -> None:
        """Forget everything offered."""
        self.seen = [0] * len(self.seen)
        self.kept = [[] for _ in self.kept]

    def payload(self, dim: int, encoding: Encoding = "raw") -> LabelledVectors:
        """The kept vectors with their labels, class by class."""
        labels = [c for c, kept in enumerate(self.kept) for _ in kept]
        rows = [v for kept in self.kept for v in kept]
        vectors = torch.stack(rows) if rows else torch.zeros(0, dim)
        return LabelledVectors(
            labels=torch.tensor(labels, dtype=torch.int32).numpy(),
            vectors=vectors.numpy(),
            encoding=encoding,
        )


@torch.no_grad()
def class_feature_sums(
    model: Classifier, data: TensorData, num_classes: int, batch_size: int = 256, clip: float = 0.0
) -> ClassMeans:
    """Per-class sums and counts of the features of ``data`` (eval mode, whole local set, each
    feature clipped to ``clip`` when it is > 0)."""
    return class_output_sums(model, data, num_classes, batch_size, clip, logits=False)[0]


@torch.no_grad()
def class_output_sums(
    model: Classifier,
    data: TensorData,
    num_classes: int,
    batch_size: int = 256,
    clip: float = 0.0,
    *,
    logits: bool = True,
) -> list[ClassMeans]:
    """Per-class sums and counts of the features of ``data`` and, with ``logits``, of the
    logits (eval mode, one pass over the whole local set, each vector clipped to ``clip`` when
    it is > 0): each sample is added once to each sum."""
    was_training = model.training
    model.eval()
    dev = data.x.device
    sums = [ClassMeans(num_classes, model.num_features, dev, clip)]
    if logits:
        sums.append(ClassMeans(num_classes, num_classes, dev, clip))
    for x, y in data.batches(batch_size, None, shuffle=False):
        features = model.forward_features(x)
        sums[0].add(features, y)
        if logits:
            sums[1].add(model.forward_head(features), y)
    model.train(was_training)
    return sums


def class_prototypes(
    model: Classifier,
    data: TensorData,
    num_classes: int,
    batch_size: int = 256,
    encoding: Encoding = "raw",
) -> PrototypeSet:
    """Mean feature per class present in ``data`` (eval mode, whole local set)."""
    return class_feature_sums(model, data, num_classes, batch_size).prototypes(encoding)


def prototype_table(
    protos: PrototypeSet, num_classes: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Dense ``[C, D]`` table and ``[C]`` validity mask from a sparse prototype set."""
    table = torch.zeros(num_classes, protos.dim, device=device)
    valid = torch.zeros(num_classes, dtype=torch.bool, device=device)
    if protos.class_ids.size:
        # copies: a received set's arrays are read-only views of the frame
        ids = torch.tensor(protos.class_ids, dtype=torch.long, device=device)
        table[ids] = torch.tensor(protos.vectors, device=device)
        valid[ids] = True
    return table, valid


def merge_prototypes(table: Tensor, valid: Tensor, protos: PrototypeSet) -> tuple[Tensor, Tensor]:
    """``table`` and its mask ``valid`` with the classes of the received ``protos`` replaced;
    the other classes keep their rows (a class nobody reported this round keeps its last
    prototype). A set of another dimension, or with a class id past the table, is refused."""
    c, dim = table.shape
    if protos.class_ids.size and (protos.dim != dim or int(protos.class_ids.max()) >= c):
        raise ValidationError(
            "payloads.protos", f"dim {dim}, ids < {c}", (protos.dim, protos.class_ids.tolist())
        )
    new, present = prototype_table(protos, c, table.device)
    return torch.where(present.unsqueeze(1), new, table), valid | present


def prototype_scores(
    features: Tensor,
    table: Tensor,
    valid: Tensor,
    head: Literal["prototype", "cosine"] = "prototype",
) -> Tensor:
    """Each class prototype's score for ``features``, what the export's ``head`` of that name
    computes: the negative squared distance (``prototype``) or the cosine similarity
    (``cosine``); invalid classes never win."""
    if head == "cosine":
        scores = F.normalize(features.float(), dim=1) @ F.normalize(table.float(), dim=1).T
    else:
        scores = -torch.cdist(features.float(), table.float()).pow(2)
    return scores.masked_fill(~valid.unsqueeze(0), -1e9)
