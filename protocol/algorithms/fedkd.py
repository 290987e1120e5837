"""FedKD hyperparameters (Wu et al. 2022, "Communication-efficient federated learning via
knowledge distillation"; see docs/baselines.md).

Like FML, each device co-trains its private model (the mentor, never sent) with a copy of one
small shared model (the mentee, ``shared_model``), and only the mentee is averaged. FedKD's
distillation is adaptive: with ``L_t`` the cross-entropy of each model,

    L_mentor = L_t^t + (KL(p_s || p_t) + MSE(h_t, W_h h_s)) / (L_t^t + L_t^s)
    L_mentee = L_t^s + (KL(p_t || p_s) + MSE(h_t, W_h h_s)) / (L_t^t + L_t^s)

so both models distil strongly where their predictions are already right and weakly where they
are wrong; ``h`` are the models' features and ``W_h`` a local linear map between them.

Training defaults are HtFLlib's (``clientkd``): plain SGD at lr 0.01 for all three parts,
batch 10, one local epoch, gradient norms clipped at 10. The paper's SVD compression of the
exchanged mentee (energy 0.95 -> 0.98) is not built (docs/baselines.md says what it needs).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.algorithms.base import register_config
from protocol.algorithms.fml import SharedModelConfig

__all__ = ["FedKDConfig"]


@register_config("fedkd")
@dataclass(frozen=True)
class FedKDConfig(SharedModelConfig):
    """FedKD: adaptive mutual distillation (logits and hidden features) between the private
    mentor and the shared mentee; only the mentee is averaged."""

    hidden_loss: bool = True  # the MSE(h_t, W_h h_s) term (the paper's hidden-state loss)
    wh_lr: float = 0.0  # W_h's learning rate; 0: same as lr (HtFLlib)
