"""FedType hyperparameters (``shared/specs/fedtype.md``; see docs/algorithms/fedtype.md).

Only a small proxy model, identical on every device, travels: the global proxy down, the
trained proxy up, averaged by sample count exactly as FedAvg averages a model (so this config
extends :class:`FedAvgConfig`: same ``weights`` payload, same ``weight_encoding``). The private
model, of the device's own architecture, never leaves the device. Locally the two co-train:
forward KD (private -> proxy) and the uncertainty-based backward KD (proxy -> private) through
RAPS conformal sets calibrated on a held-out split of the device's training data.

Defaults are the spec's (paper where it says, decisions of §9 otherwise): Adam lr 1e-4, weight
decay 1e-4, batch 16, R = 5, theta 0.1, lambda 0.5, k_reg 5, Platt T0 1.3. The ablation arms of
§10 are values: ``bkd = "symmetric" | "topk"``, ``eta_mode = "one"``, ``g_fn = "constant"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from protocol.algorithms.base import register_config
from protocol.algorithms.fedavg import FedAvgConfig

__all__ = ["FedTypeConfig"]


@register_config("fedtype")
@dataclass(frozen=True)
class FedTypeConfig(FedAvgConfig):
    """FedType: a shared proxy averaged like FedAvg; private models co-trained on the device."""

    optimizer: Literal["sgd", "adam"] = "adam"
    lr: float = 1e-4  # both models; proxy_lr overrides the proxy's
    weight_decay: float = 1e-4  # [code]
    batch_size: int = 16
    local_epochs: int = 5  # R
    proxy_model: str = "resnet18"  # registry name, one for the whole fleet (models.proxy)
    proxy_lr: float = 0.0  # 0: same as lr
    # D_i': share of the device's training data held out for temperature, tau and Delta (never
    # trained on); 0.125 = the paper's 7:2:1 split with the test part already set aside
    val_fraction: float = 0.125
    kd_temperature: float = 1.0  # forward KD
    # conformal (RAPS) settings, App. F
    theta: float = 0.1  # miscoverage
    raps_lambda: float = 0.5
    raps_k_reg: int = 5
    platt_init: float = 1.3
    platt_lr: float = 0.01
    platt_iters: int = 10
    platt_tol: float = 0.01
    platt_batch: int = 32
    # the calibration function g of Eq. 7 (g2 = "constant" is the FedType_g=lambda arm)
    g_fn: Literal["piecewise_linear", "constant", "quadratic", "quadratic_linear"] = (
        "piecewise_linear"
    )
    calibrate_penalty: Literal["base", "g"] = "base"  # §9-8: tau from lambda, g only in Eq. 6
    # backward KD (§4.3): conformal (FedType), topk (FedType_TopK), symmetric (FedType_sym)
    bkd: Literal["conformal", "topk", "symmetric"] = "conformal"
    top_k: int = 3
    eta_mode: Literal["consensus", "one"] = "consensus"  # one: the FedType_eta=1 arm
    bkd_reduction: Literal["sum", "mean_over_set"] = "sum"
    bkd_form: Literal["printed", "pairwise"] = "printed"
    # RAPS randomisation u: each prediction set (S of the proxy, L of the private model) its own
    # draw ("independent"), or one u per sample shared by both ("shared")
    raps_draws: Literal["independent", "shared"] = "independent"
    # the authors' released code (spec §9-0), as an arm: its backward KD sends no gradient to
    # the private model (bkd_private = false), and it calibrates on the training split, holding
    # nothing out (calibration_split = "train"); the paper's: true and "held_out"
    bkd_private: bool = True
    calibration_split: Literal["held_out", "train"] = "held_out"
    # the proxy's FL algorithm (§3.4): fedprox adds mu/2 ||p - p_g||^2 to the proxy's loss
    proxy_fl: Literal["fedavg", "fedprox"] = "fedavg"
    prox_mu: float = 0.01
    aggregation_weights: Literal["samples", "uniform"] = "samples"  # §9-13
    # per-epoch coverage of the conformal sets on the device's test split (metrics only)
    measure_coverage: bool = True
    # at the end of the run, also export the proxy as its own bundle (export_dir/proxy)
    export_proxy: bool = False

    # sizes and iteration counts a task may ask of a device; val_fraction and theta
    # are checked below, (0, 1) exclusive
    LIMITS: ClassVar[dict[str, tuple[float, float]]] = {
        "raps_k_reg": (0, 100_000),
        "top_k": (1, 100_000),
        "platt_iters": (0, 100_000),
        "platt_batch": (1, 65_536),
    }
    DP_SGD: ClassVar[bool] = False  # see dp_uncovered

    def dp_uncovered(self) -> str:
        """The proxy's loss reads conformal sets calibrated on data outside DP-SGD."""
        return (
            "fedtype's proxy trains against conformal sets calibrated on the device's data "
            "outside DP-SGD's per-sample steps, so its weights are not DP-SGD's alone"
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.val_fraction < 1 or not 0 < self.theta < 1:
            raise ValueError("val_fraction and theta must be in (0, 1)")
        if self.raps_lambda < 0 or self.raps_k_reg < 0 or self.top_k < 1:
            raise ValueError("raps_lambda >= 0, raps_k_reg >= 0, top_k >= 1")
        if self.kd_temperature <= 0 or self.proxy_lr < 0 or self.prox_mu < 0:
            raise ValueError("kd_temperature > 0, proxy_lr >= 0, prox_mu >= 0")
        if self.platt_init <= 0 or self.platt_iters < 0 or self.platt_batch < 1:
            raise ValueError("platt_init > 0, platt_iters >= 0, platt_batch >= 1")
