"""Model registry and every network of edgefl.

``create_model(name, num_classes=..., in_chans=..., feature_dim=..., input_size=...)`` builds a
:class:`Classifier` with the split interface (``forward_features``, ``forward_head``,
``num_features``, ``get_classifier``, ``reset_classifier``). Every model module is imported
here so that registration never depends on import order.

Algorithm networks: :class:`VTCGenerator` (FedVTC), :class:`CVAE` (Velo), :func:`etf_matrix`,
:class:`ETFHead`, :class:`FeatureTransformer` (FedKTL), the proxies of :mod:`models.proxy`
(FedType) and the pretrained-generator loaders of :mod:`models.generators`.
"""

from models import hcnn, proxy, resnet, small, tv_nets  # noqa: F401  (registers the entrypoints)
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
from models.cvae import CVAE
from models.families import family_members, family_models, list_families
from models.generators import Generator, GeneratorError
from models.ktl import (
    ETFHead,
    FeatureTransformer,
    arcface_logits,
    attach_etf_head,
    etf_matrix,
    latent_projection,
)
from models.proxy import PROXY_MODELS
from models.vtc import VTCGenerator, vtc_for, vtc_widths

__all__ = [
    "CVAE",
    "PROXY_MODELS",
    "Classifier",
    "ETFHead",
    "FeatureTransformer",
    "Generator",
    "GeneratorError",
    "ModelArgs",
    "ModelCfg",
    "Normalize",
    "VTCGenerator",
    "arcface_logits",
    "attach_etf_head",
    "create_model",
    "etf_matrix",
    "family_members",
    "family_models",
    "is_model",
    "latent_projection",
    "list_families",
    "list_models",
    "model_entrypoint",
    "model_info",
    "register_model",
    "vtc_for",
    "vtc_widths",
]
