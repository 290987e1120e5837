"""The model registry: one decorated entrypoint per architecture, looked up by name.

Modelled on timm's ``_registry`` (module-level dicts, a ``register_model`` decorator, fnmatch
listing), with three deliberate differences: a duplicate name raises instead of overwriting, an
unknown name raises :class:`~protocol.errors.ConfigError` listing the close matches, and the
common constructor arguments travel as one typed :class:`ModelArgs` instead of ``**kwargs``.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from models._classifier import Classifier
from protocol.errors import ConfigError

__all__ = [
    "ModelArgs",
    "ModelCfg",
    "create_model",
    "is_model",
    "list_models",
    "model_entrypoint",
    "model_info",
    "register_model",
]


@dataclass(frozen=True, slots=True)
class ModelCfg:
    """Static metadata of one registered architecture (timm's ``PretrainedCfg``, reduced).

    Attributes:
        name: Registry name, e.g. ``"resnet18"``.
        family: Architecture family, e.g. ``"mlp"``, ``"cnn"``, ``"resnet"``.
        input_size: Default input size ``(h, w)`` used when ``create_model`` gets none.
        in_chans: Number of input channels the architecture is usually used with.
        min_input_size: Smallest side length (pixels) the network can process.
        fixed_size: True when the built network is tied to its ``input_size`` (a flatten whose
            width depends on it); other networks pool globally and accept any size
            ``>= min_input_size``.
        mean: Default per-channel normalisation mean, or None for no normalisation.
        std: Default per-channel normalisation std, or None for no normalisation.
        description: One line for listings and docs.
        module: Python module that registered the entrypoint.
        onnx_opset: ONNX opset the architecture is exported with.
    """

    name: str
    family: str
    input_size: tuple[int, int] = (32, 32)
    in_chans: int = 3
    min_input_size: int = 1
    fixed_size: bool = False
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    description: str = ""
    module: str = ""
    onnx_opset: int = 17

    def supports(self, size: int | tuple[int, int]) -> bool:
        """Whether the architecture can be built for (and run on) images of this size."""
        h, w = _as_size(size)
        return min(h, w) >= self.min_input_size


@dataclass(frozen=True, slots=True)
class ModelArgs:
    """The constructor arguments every entrypoint receives, validated by :func:`create_model`.

    Attributes:
        num_classes: Output classes of the head; 0 means no head (``nn.Identity``).
        in_chans: Input channels (1 for greyscale, 3 for RGB).
        input_size: Input ``(h, w)``; fixed-size networks size their flatten from it.
        feature_dim: When set, the extractor ends in ``Linear(native, feature_dim)``.
        mean: Per-channel mean applied as the first op of ``forward_features``, or None.
        std: Per-channel std applied with ``mean``, or None.
        feature_act: Optional activation after the projection (``"relu"``), or None.
    """

    num_classes: int
    in_chans: int = 3
    input_size: tuple[int, int] = (32, 32)
    feature_dim: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    feature_act: str | None = None

    def classifier(self, trunk: Any, trunk_dim: int) -> Classifier:
        """Wrap ``trunk`` (images -> ``[B, trunk_dim]``) into a :class:`Classifier`."""
        return Classifier(
            trunk,
            trunk_dim,
            num_classes=self.num_classes,
            feature_dim=self.feature_dim,
            in_chans=self.in_chans,
            input_size=self.input_size,
            mean=self.mean,
            std=self.std,
            feature_act=self.feature_act,
        )


EntryFn = Callable[..., Classifier]
_F = TypeVar("_F", bound=EntryFn)

_model_entrypoints: dict[str, EntryFn] = {}
_model_cfgs: dict[str, ModelCfg] = {}
_family_to_models: dict[str, list[str]] = {}


def register_model(
    *,
    family: str,
    input_size: int | tuple[int, int] = 32,
    in_chans: int = 3,
    min_input_size: int = 1,
    fixed_size: bool = False,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    description: str = "",
    onnx_opset: int = 17,
) -> Callable[[_F], _F]:
    """Register the decorated entrypoint under its function name with its :class:`ModelCfg`.

    The entrypoint is called as ``fn(args: ModelArgs, **model_args)``; its own keyword
    parameters are the architecture-specific knobs (e.g. ``small_stem``).

    Raises:
        ConfigError: When the name is already registered.
    """

    def decorate(fn: _F) -> _F:
        name = fn.__name__
        if name in _model_entrypoints:
            raise ConfigError(
                f"model {name!r} registered twice ({_model_cfgs[name].module} and {fn.__module__})"
            )
        cfg = ModelCfg(
            name=name,
            family=family,
            input_size=_as_size(input_size),
            in_chans=in_chans,
            min_input_size=min_input_size,
            fixed_size=fixed_size,
            mean=None if mean is None else tuple(float(v) for v in mean),
            std=None if std is None else tuple(float(v) for v in std),
            description=description or (inspect.getdoc(fn) or "").split("\n")[0],
            module=fn.__module__,
            onnx_opset=onnx_opset,
        )
        _model_entrypoints[name] = fn
        _model_cfgs[name] = cfg
        _family_to_models.setdefault(family, []).append(name)
        return fn

    return decorate


def list_models(pattern: str = "*", *, family: str | None = None) -> list[str]:
    """Sorted registered names matching an fnmatch ``pattern``, optionally of one ``family``."""
    names = _model_entrypoints if family is None else _family_to_models.get(family, [])
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))


def is_model(name: str) -> bool:
    """Whether ``name`` is a registered architecture."""
    return name in _model_entrypoints


def model_info(name: str) -> ModelCfg:
    """The :class:`ModelCfg` of a registered architecture.

    Raises:
        ConfigError: For an unknown name; the message lists the closest registered names.
    """
    try:
        return _model_cfgs[name]
    except KeyError:
        raise _unknown(name) from None


def model_entrypoint(name: str) -> EntryFn:
    """The entrypoint function of a registered architecture (raises ConfigError if unknown)."""
    model_info(name)
    return _model_entrypoints[name]


def create_model(
    name: str,
    *,
    num_classes: int,
    in_chans: int = 3,
    feature_dim: int | None = None,
    input_size: int | tuple[int, int] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    feature_act: str | None = None,
    **model_args: Any,
) -> Classifier:
    """Build a freshly initialised classifier by registry name.

    Weights are random (the caller seeds torch); nothing is ever downloaded.

    Args:
        name: Registered architecture name (see :func:`list_models`).
        num_classes: Output classes of the head (0: no head).
        in_chans: Input channels, 1 or 3 usually.
        feature_dim: Federation-wide feature size; when set the extractor ends in a
            ``Linear(native, feature_dim)`` projection and the head is
            ``Linear(feature_dim, num_classes)``.
        input_size: Side length or ``(h, w)``; defaults to the architecture's ``input_size``.
        mean: Per-channel normalisation mean applied inside ``forward_features``; inputs to
            the model are always images in [0, 1]. Defaults to the cfg's mean (usually none).
        std: Per-channel normalisation std, given together with ``mean``.
        feature_act: ``"relu"`` to make the projected features non-negative, else None.
        **model_args: Architecture-specific keyword arguments of the entrypoint.

    Returns:
        The model, with ``model_name`` and ``create_kwargs`` set so that
        ``create_model(m.model_name, **m.create_kwargs)`` rebuilds the same architecture.

    Raises:
        ConfigError: Unknown name, unknown architecture argument or invalid value.
    """
    cfg = model_info(name)
    size = cfg.input_size if input_size is None else _as_size(input_size)
    args = ModelArgs(
        num_classes=_check_int("num_classes", num_classes, 0),
        in_chans=_check_int("in_chans", in_chans, 1),
        input_size=size,
        feature_dim=None if feature_dim is None else _check_int("feature_dim", feature_dim, 1),
        mean=_stats("mean", cfg.mean if mean is None else mean, in_chans),
        std=_stats("std", cfg.std if std is None else std, in_chans),
        feature_act=feature_act,
    )
    if (args.mean is None) != (args.std is None):
        raise ConfigError(f"{name}: mean and std must be given together")
    if not cfg.supports(size):
        raise ConfigError(
            f"{name}: input_size {size} is below the architecture's minimum {cfg.min_input_size} px"
        )
    fn = _model_entrypoints[name]
    try:
        inspect.signature(fn).bind(args, **model_args)
    except TypeError as exc:
        raise ConfigError(f"{name}: invalid model arguments {sorted(model_args)}: {exc}") from exc
    model = fn(args, **model_args)
    model.model_name = name
    model.create_kwargs = {
        "num_classes": args.num_classes,
        "in_chans": args.in_chans,
        "feature_dim": args.feature_dim,
        "input_size": args.input_size,
        "mean": args.mean,
        "std": args.std,
        "feature_act": args.feature_act,
        **model_args,
    }
    return model


def _unknown(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(_model_entrypoints), n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(
        f"unknown model {name!r}{hint} ({len(_model_entrypoints)} registered, see list_models())"
    )


def _as_size(size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        pair: tuple[int, ...] = (size, size)
    elif isinstance(size, Sequence) and len(size) == 2:
        pair = tuple(size)
    else:
        raise ConfigError(f"input_size: expected an int or (h, w), got {size!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair):
        raise ConfigError(f"input_size: expected positive ints, got {size!r}")
    return pair[0], pair[1]


def _check_int(field_name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{field_name}: expected an int >= {minimum}, got {value!r}")
    return value


def _stats(field_name: str, values: Sequence[float] | None, chans: int) -> tuple[float, ...] | None:
    if values is None:
        return None
    out = tuple(float(v) for v in values)
    # A 3-channel default applied to a greyscale input averages to one value: the usual
    # convention when an RGB-trained statistic meets a 1-channel dataset.
    if len(out) == 3 and chans == 1:
        out = (sum(out) / 3.0,)
    if len(out) == 1 and chans > 1:
        out = out * chans
    if len(out) != chans:
        raise ConfigError(f"{field_name}: expected 1 or {chans} values, got {len(out)}")
    if field_name == "std" and any(v <= 0.0 for v in out):
        raise ConfigError(f"std: expected positive values, got {out}")
    return out
