"""Model registry and every network of edgefl.

``create_model(name, num_classes=..., in_chans=..., feature_dim=..., input_size=...)`` builds a
:class:`Classifier` with the split interface (``forward_features``, ``forward_head``,
``num_features``, ``get_classifier``, ``reset_classifier``). Every model module is imported
here so that registration never depends on import order.
"""

from models import resnet, small, tv_nets  # noqa: F401  (registers the entrypoints)
from models._classifier import Classifier, Normalize
from models._registry import (
    ModelArgs,
    ModelCfg,
    create_model,
    is_model,
    list_models,
    model_entrypoint,
    model_info,
    register_model,
)
from models.families import family_members, family_models, list_families

__all__ = [
    "Classifier",
    "ModelArgs",
    "ModelCfg",
    "Normalize",
    "create_model",
    "family_members",
    "family_models",
    "is_model",
    "list_families",
    "list_models",
    "model_entrypoint",
    "model_info",
    "register_model",
]
