"""FedKTL, server half (``shared/specs/fedktl.md`` §3; see docs/algorithms/fedktl.md).

Before round 1 (:meth:`FedKTLStrategy.plan`) the pretrained generator is loaded and validated,
and the set-up (ETF ``[K, C]``, fixed projection h') is drawn from the run seed; its SHA-256
goes into every task's config. Each agent receives the set-up in its first task only: an agent
counts as holding it once one of its replies was accepted (durable, so neither a coordinator
nor an agent restart sends it again). Each round, the agents' unit-norm prototypes become the
training set of the feature transformer F and the centroid table (``server_train``); the
synced centroids of every class seen so far are the next round's latents, and the generator
turns them into one image per class, converted to each agent's registered input spec.

In a buffered run each prototype weighs its reply's staleness weight in the centroids' means
and in F's training loss.

F, the centroids, the set-up, its holders and the generator's identity are the durable state:
a restarted coordinator continues with them, and refuses to continue with another generator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.class_stats import screen_metrics, weighted_pairs
from coordinator.strategies.base import (
    AgentInfo,
    PhaseHooks,
    ServerContext,
    Step,
    Strategy,
    register_strategy,
)
from protocol.algorithms.fedktl import SETUP_KEYS, FedKTLConfig, setup_digest
from protocol.contract.messages import Reply
from protocol.contract.payloads import ImageVectorPairs, Payload, PrototypeSet, TensorMap
from protocol.errors import AdmissionError, ConfigError, ValidationError

if TYPE_CHECKING:  # torch only on the server's training path
    from models.generators import Generator

__all__ = ["FedKTLStrategy"]

UNIT_TOL = 1e-3  # prototypes are unit vectors (float32 rounding, f16 transport aside)
SETUP_SEED_SALT = 0x4B544C  # "KTL": the set-up's seed differs from the run's other draws
# the controls' draws (spec §10) differ from the set-up's and from each other
DERANGEMENT_SALT, NOISE_SALT, RANDOM_LATENT_SALT = 0x4B4431, 0x4B4432, 0x4B4433


@register_strategy("fedktl")
class FedKTLStrategy(Strategy[FedKTLConfig]):
    """Prototypes up, generator-made image-vector pairs down."""

    stale_replies = "weighted"  # staleness weights in the centroids' means and F's loss

    admission_rules = True

    def __init__(self, config: FedKTLConfig, *, num_classes: int, seed: int = 0) -> None:
        super().__init__(config, num_classes=num_classes, seed=seed)
        self.setup: TensorMap | None = None
        self.holders: dict[str, int] = {}  # device -> round whose reply proved it holds the set-up
        self.aligner: TensorMap | None = None  # F + centroid table + valid mask
        self.generator_id = ""  # SHA-256 of the generator (its file)
        self.pairs_round = 0  # round whose server phase made the current centroids
        self._gen: Generator | None = None
        self._asked_sha256 = config.setup_sha256  # the user's (normally empty), never replaced
        # this step's (vectors, ids, staleness weights)
        self._uploads: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._images: Any = None  # torch [C', ch, R, R] in [0, 1] of the current centroids
        self._pairs: dict[tuple[int, int, int], ImageVectorPairs] = {}
        self._random_w: np.ndarray | None = None  # control random_latents: [C, H], drawn once
        # control derangement: one cyclic order of the classes for the whole run
        self._cycle = np.random.default_rng([DERANGEMENT_SALT, seed % 2**32]).permutation(
            num_classes
        )

    # ----- before round 1 -------------------------------------------------------------------
    def plan(self, rounds: int) -> list[Step]:
        """Load and validate the generator and draw the set-up: a bad generator is an error
        here, before any agent is contacted."""
        self._ready()
        return super().plan(rounds)

    def _ready(self) -> Generator:
        if self._gen is not None:
            return self._gen
        from coordinator.strategies.fedktl.server import (
            generator_identity,
            load_generator,
            make_setup,
        )

        gen = load_generator(self.config)
        identity = generator_identity(gen)
        if self.generator_id and self.generator_id != identity:
            raise ConfigError(self._other_generator(identity))
        self._gen, self.generator_id = gen, identity
        if self.setup is None:
            k = self.config.etf_size(self.num_classes)
            tensors = make_setup(
                self.num_classes, k, self.config.feature_dim, gen.w_dim, self.seed ^ SETUP_SEED_SALT
            )
            self._use_setup(TensorMap(tensors))
        return gen

    def _other_generator(self, identity: str) -> str:
        return (
            f"generator: this run's durable state was made with the generator {self.generator_id}"
            f", the configured {self.config.generator!r} is {identity}; a resumed run continues "
            "with its own generator (F and the centroids live in its latent space)"
        )

    def _use_setup(self, setup: TensorMap) -> None:
        """Hold ``setup`` and put its digest and sizes into the config every task carries."""
        etf, weight = setup.tensors["etf"], setup.tensors["proj.weight"]
        digest = setup_digest(setup.tensors)
        if self._asked_sha256 not in ("", digest):
            raise ConfigError(
                f"setup_sha256: the config names {self._asked_sha256}, the run's set-up is "
                f"{digest} (leave it empty: the coordinator fills it)"
            )
        self.setup = setup
        self.config = self.config.replace(
            setup_sha256=digest, etf_dim=int(etf.shape[0]), latent_dim=int(weight.shape[0])
        )

    def admit(self, agent: AgentInfo, fleet: list[AgentInfo]) -> None:
        """Images are made grey or RGB: refuse other channel counts at registration."""
        channels = agent.register.input_spec.channels
        if channels not in (1, 3):
            raise AdmissionError(
                agent.device_id, f"FedKTL sends grey or RGB images; the agent takes {channels}"
            )

    def phase_hooks(self) -> dict[str, PhaseHooks]:
        """Training rounds: prototypes up, pairs down; ``final``: the set-up to any agent that
        never received it."""
        return {
            "train": PhaseHooks(
                self.send_setup_and_pairs,
                self.check_upload,
                self.collect_uploads,
                self.train_aligner,
            ),
            "final": PhaseHooks(configure=self.send_setup),
        }

    # ----- what each agent receives ---------------------------------------------------------
    def send_setup(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The set-up until the agent holds it."""
        self._ready()
        out: dict[str, Payload] = {}
        if agent.device_id not in self.holders and self.setup is not None:
            out["setup"] = self.setup
        return out

    def send_setup_and_pairs(self, step: Step, agent: AgentInfo) -> dict[str, Payload]:
        """The set-up until the agent holds it, and the latest pairs, converted to the agent's
        input spec."""
        out = self.send_setup(step, agent)
        if self._latents() is not None:
            spec = agent.register.input_spec
            out["pairs"] = self._pairs_for(spec.channels, spec.height, spec.width)
        return out

    def _latents(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Classes ever synced and their centroids ``[C', H]``, or None before any (control
        ``random_latents``: every class and its random latent once a server phase ran)."""
        if self.config.control == "random_latents":
            if self.pairs_round == 0:
                return None
            if self._random_w is None:
                from coordinator.strategies.fedktl.server import random_latents

                seed = (self.seed ^ RANDOM_LATENT_SALT) % 2**63
                self._random_w = random_latents(self._ready(), self.num_classes, seed)
            return np.arange(self.num_classes), self._random_w
        if self.aligner is None:
            return None
        from coordinator.strategies.fedktl.server import VALID_KEY

        valid = self.aligner.tensors[VALID_KEY].astype(bool)
        if not valid.any():
            return None
        return np.flatnonzero(valid), self.aligner.tensors["centroids.weight"][valid]

    def _pairs_for(self, channels: int, height: int, width: int) -> ImageVectorPairs:
        key = (channels, height, width)
        if key not in self._pairs:
            from coordinator.strategies.fedktl.server import (
                deranged_rows,
                matched_noise,
                synthesize,
                to_input_spec,
            )

            latents = self._latents()
            assert latents is not None  # configure checked
            if self._images is None:  # once per round, shared by every input spec
                self._images = synthesize(self._ready(), latents[1])
            images = to_input_spec(self._images, channels, height, width)
            vectors = latents[1]
            if self.config.control == "noise_images":
                draw = [NOISE_SALT, self.seed % 2**32, self.pairs_round, *key]
                images = matched_noise(images, np.random.default_rng(draw))
            elif self.config.control == "derangement":
                vectors = vectors[deranged_rows(latents[0], self._cycle)]
            self._pairs[key] = ImageVectorPairs(
                images,
                vectors,
                class_ids=latents[0],  # the classes, also under the derangement control
                round=self.pairs_round,
                encoding=self.config.pair_encoding,
            )
        return self._pairs[key]

    # ----- what each agent sends ------------------------------------------------------------
    def check_upload(self, step: Step, agent: AgentInfo, reply: Reply) -> None:
        """Unit-norm K-dim prototypes of classes the agent registered (ids are distinct by
        the payload's own check)."""
        k = self.config.etf_size(self.num_classes)
        protos = self.check_prototypes(agent, reply, "protos", k)
        norms = np.linalg.norm(protos.vectors, axis=1)
        if np.abs(norms - 1.0).max(initial=0.0) > UNIT_TOL:
            raise ValidationError(
                "reply.payloads.protos.vectors", "unit L2 norms", norms.round(4).tolist()
            )

    # ----- the round's server work ----------------------------------------------------------
    def collect_uploads(
        self, step: Step, replies: list[tuple[AgentInfo, Reply]]
    ) -> dict[str, float]:
        """Collect the round's prototypes, each with its reply's staleness weight; every
        replier has proved it holds the set-up."""
        sets, weights = [], []
        for agent, reply in replies:
            self.holders.setdefault(agent.device_id, step.round)
            protos = reply.payloads.get("protos")
            if isinstance(protos, PrototypeSet):
                sets.append(protos)
                weights.append(self.reply_weight(reply))
        screen = self.config.upload_screen
        vectors, labels, rows, screened = weighted_pairs(sets, weights, screen)
        self._uploads = [(vectors, labels, rows)] if labels.size else []
        return {"ktl_agents_with_setup": float(len(self.holders))} | screen_metrics(
            screen, screened
        )

    def train_aligner(self, step: Step, ctx: ServerContext) -> dict[str, float]:
        """Align F and the centroids on this round's prototypes; the pairs follow from them."""
        if not self._uploads:
            return {}
        if self.config.control == "random_latents":  # the uploads are ignored: no F, no Cent
            count = sum(len(c) for _, c, _ in self._uploads)
            self._uploads, self._images, self._pairs = [], None, {}
            self.pairs_round = step.round
            return {"ktl_prototypes": float(count)}
        from coordinator.strategies.fedktl.server import align

        vectors = np.concatenate([v for v, _, _ in self._uploads])
        labels = np.concatenate([c for _, c, _ in self._uploads])
        weights = np.concatenate([w for _, _, w in self._uploads])
        self.aligner, metrics = align(
            self.aligner,
            vectors,
            labels,
            num_classes=self.num_classes,
            gen=self._ready(),
            cfg=self.config,
            ctx=ctx,
            weights=weights,
        )
        self._uploads, self._images, self._pairs = [], None, {}
        self.pairs_round = step.round
        return metrics

    # ----- durable state --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Payload]:
        """Set-up, its holders, F with the centroids, and the generator's identity."""
        out: dict[str, Payload] = {
            "holders": TensorMap({d: np.array([r]) for d, r in self.holders.items()}),
            "generator": TensorMap(
                {
                    "sha256": np.frombuffer(bytes.fromhex(self.generator_id), np.uint8),
                    "pairs_round": np.array([self.pairs_round]),
                }
            ),
        }
        if self.setup is not None:
            out["setup"] = self.setup
        if self.aligner is not None:
            out["aligner"] = self.aligner
        return out

    def load_state_dict(self, state: dict[str, Payload]) -> None:
        """Restore; a stored generator identity must match the configured generator's."""
        gen, holders = state.get("generator"), state.get("holders")
        if isinstance(gen, TensorMap) and "sha256" in gen.tensors:
            self.generator_id = bytes(gen.tensors["sha256"].astype(np.uint8)).hex()
            self.pairs_round = int(gen.tensors["pairs_round"][0])
        if isinstance(holders, TensorMap):
            self.holders = {d: int(r[0]) for d, r in holders.tensors.items()}
        setup, aligner = state.get("setup"), state.get("aligner")
        if isinstance(setup, TensorMap) and set(setup.tensors) == set(SETUP_KEYS):
            self._use_setup(setup)
        self.aligner = aligner if isinstance(aligner, TensorMap) else None
        self._uploads, self._images, self._pairs = [], None, {}
        if self._gen is not None and self.generator_id:
            from coordinator.strategies.fedktl.server import generator_identity

            if generator_identity(self._gen) != self.generator_id:
                raise ConfigError(self._other_generator(generator_identity(self._gen)))
        else:
            self._ready()
