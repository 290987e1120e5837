"""Named heterogeneous model families: which architecture each client of a fleet gets.

Client ``i`` gets ``members[i % len(members)]`` (the specs' "architecture number i mod X").
"""

from __future__ import annotations

from models._registry import is_model
from protocol.errors import ConfigError

__all__ = ["FAMILIES", "family_members", "family_models", "list_families"]

FAMILIES: dict[str, tuple[str, ...]] = {
    # CPU-friendly toy fleet of fedvtc.md §10.1 (client k gets kind k mod 5), good at 8×8/28×28.
    "tiny": ("mlp_s", "cnn_t1", "cnn_t2", "mlp_m", "cnn_t3"),
    # The same five kinds in felo_velo.md §9's order.
    "tiny_felo": ("mlp_s", "mlp_m", "cnn_t1", "cnn_t2", "cnn_t3"),
    "homo_mlp": ("mlp_m",),
    # McMahan et al.'s FedAvg CNN ("same" padding, flatten 3136 at 28x28), not HtFLlib's
    # FedAvgCNN: that one is unpadded (flatten 1024 at 28x28) and is our cnn4 (homo_cnn4)
    "homo_cnn2": ("cnn2",),
    "homo_cnn4": ("cnn4",),
    # HtFLlib's heterogeneous CNNs for 1-channel 28x28 images (models/hcnn.py; features the
    # 512-d ReLU output before its head): "HCNNs8" of its system/main.py, in its order, with
    # CNN(num_cov=2, hidden_dims=[]) = FedAvgCNN(dim=1024) as cnn4.
    "hcnns8": (
        "hcnn1",
        "cnn4",
        "hcnn1_512",
        "hcnn2_512",
        "hcnn1_1024",
        "hcnn2_1024",
        "hcnn1_1024_512",
        "hcnn2_1024_512",
    ),
    # Four of them (HCNNs8 without the [512] and [1024, 512] hidden stacks), in HCNNs8's order:
    # one and two convolutions, each without and with a 1024-unit hidden layer.
    "htfl_cnn": ("hcnn1", "cnn4", "hcnn1_1024", "hcnn2_1024"),
    # FedKTL's CPU fleet "HtFE-tiny" (fedktl.md §10) and FedType's toy private pool (§10).
    "ktl_tiny": ("mlp_m", "mlp_l", "cnn_gap", "cnn_t4"),
    "fedtype_tiny": ("mlp_xl", "mlp_w", "cnn_fc", "cnn_bn3"),
    # FedKTL scenarios (fedktl.md §5.4).
    "htfe2": ("cnn4", "resnet18"),
    "htfe3": ("resnet10", "resnet18", "resnet34"),
    "htfe4": ("cnn4", "googlenet", "mobilenet_v2", "resnet18"),
    "htfe8": (
        "cnn4",
        "googlenet",
        "mobilenet_v2",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
    ),
    "htfe9": (
        "resnet4",
        "resnet6",
        "resnet8",
        "resnet10",
        "resnet18",
        "resnet34",
        "resnet50",
        "resnet101",
        "resnet152",
    ),
    # FedVTC (fedvtc.md §5.2): five uniform clusters.
    "fedvtc": ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152"),
    # Felo/Velo (felo_velo.md §5.1).
    "felo": ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26"),
    "felo_extreme": ("resnet10", "resnet18", "resnet26", "resnet34", "resnet50"),
    "homo_resnet18": ("resnet18",),
    # FedType private pool, ResNet part (fedtype.md §5; the released code's pool).
    "fedtype_resnet": ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152"),
}


def list_families() -> list[str]:
    """Sorted names of the known families."""
    return sorted(FAMILIES)


def family_members(family: str) -> tuple[str, ...]:
    """The architectures of ``family``, in assignment order.

    Raises:
        ConfigError: Unknown family.
    """
    try:
        return FAMILIES[family]
    except KeyError:
        raise ConfigError(
            f"unknown model family {family!r}; known: {', '.join(list_families())}"
        ) from None


def family_models(family: str, num_clients: int) -> list[str]:
    """Architecture name of each of ``num_clients`` clients, assigned round-robin.

    Raises:
        ConfigError: Unknown family, a member that is not registered, or num_clients < 1.
    """
    members = family_members(family)
    if not isinstance(num_clients, int) or num_clients < 1:
        raise ConfigError(f"num_clients: expected an int >= 1, got {num_clients!r}")
    missing = [m for m in members if not is_model(m)]
    if missing:
        raise ConfigError(f"family {family!r} names unregistered models {missing}")
    return [members[i % len(members)] for i in range(num_clients)]
