"""FedKD hyperparameters (Wu et al. 2022, "Communication-efficient federated learning via
knowledge distillation"; see docs/algorithms/baselines.md).

Like FML, each device co-trains its private model (the mentor, never sent) with a copy of one
small shared model (the mentee, ``shared_model``), and only the mentee is averaged. FedKD's
distillation is adaptive: with ``L_t`` the cross-entropy of each model,

    L_mentor = L_t^t + (KL(p_s || p_t) + MSE(h_t, W_h h_s)) / (L_t^t + L_t^s)
    L_mentee = L_t^s + (KL(p_t || p_s) + MSE(h_t, W_h h_s)) / (L_t^t + L_t^s)

so both models distil strongly where their predictions are already right and weakly where they
are wrong; ``h`` are the models' features and ``W_h`` a local linear map between them.

Training defaults are HtFLlib's (``clientkd``): plain SGD at lr 0.01 for all three parts,
batch 10, one local epoch, gradient norms clipped at 10. The exchanged mentee travels
SVD-compressed both ways (the paper's §3.3, ``protocol.contract.lowrank``): at training round t the
factors keep ``svd_energy(t)`` of each matrix's squared norm, ramping linearly from
``svd_energy_start`` (0.95) to ``svd_energy_end`` (0.98) over the run's rounds, as in the paper
and HtFLlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from protocol.algorithms.base import HTFLLIB_TRAINING, register_config
from protocol.algorithms.fml import CLIENT0_ARCH, SharedModelConfig

__all__ = ["FedKDConfig"]


@register_config("fedkd")
@dataclass(frozen=True)
class FedKDConfig(SharedModelConfig):
    """FedKD: adaptive mutual distillation (logits and hidden features) between the private
    mentor and the shared mentee; only the mentee is averaged."""

    hidden_loss: bool = True  # the MSE(h_t, W_h h_s) term (the paper's hidden-state loss)
    wh_lr: float = 0.0  # W_h's learning rate; 0: same as lr (HtFLlib)
    svd: bool = True  # SVD-compress the mentee on the wire, both ways
    svd_energy_start: float = 0.95  # T_start: share of the squared norm kept in round 1
    svd_energy_end: float = 0.98  # T_end: kept from round svd_rounds + 1 on
    svd_rounds: int = 0  # rounds of the ramp; 0 = the run's rounds (the coordinator fills it)

    DP_SGD: ClassVar[bool] = False  # see dp_uncovered

    def dp_uncovered(self) -> str:
        """The adaptive weight mixes the batch into every sample's gradient."""
        return (
            "fedkd's loss weights every sample by its batch's mean loss, so a sample's gradient "
            "is not its own and DP-SGD cannot bound it"
        )

    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        **SharedModelConfig.LIMITS,
        "svd_energy_start": (1e-3, 1.0),
        "svd_energy_end": (1e-3, 1.0),
        "svd_rounds": (0, 1_000_000),
    }
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "htfllib": {
            **HTFLLIB_TRAINING,
            "shared_lr": 0.01,
            "svd_energy_start": 0.95,
            "svd_energy_end": 0.98,
            "kl_reduction": "elementwise_mean",
            "shared_model": CLIENT0_ARCH,
            "grad_clip": 10.0,
        }
    }

    def svd_energy(self, round_: int) -> float:
        """The energy kept in training round ``round_`` (1-based): linear from start to end."""
        span = max(self.svd_rounds, 1)
        frac = min(max(round_ - 1, 0) / span, 1.0)
        return self.svd_energy_start + frac * (self.svd_energy_end - self.svd_energy_start)
