"""Pretrained image generators for the server (FedKTL): one interface, several file formats.

A :class:`Generator` exposes ``z_dim``, ``w_dim`` (H, the latent the server's transformer
targets), ``img_channels``, ``img_resolution``, ``sample_w(n, rng)`` (valid latents, i.e. the
mapping network applied to Gaussian noise, or plain Gaussian noise for a Gaussian prior) and
``synthesize(w)``, which returns images **in [0, 1]** whatever the network's native range
(StyleGAN-like generators emit [-1, 1]; the rescale happens here, once).

Loaders, all for local files (nothing is downloaded):

* :func:`load_torchscript`: a scripted module with ``synthesis(w)``, optional ``mapping(z)``
  and the attributes ``z_dim, w_dim, img_channels, img_resolution`` (optional
  ``output_range``, default (-1, 1)).
* :func:`load_onnx`: a JSON manifest naming ``synthesis`` (and optionally ``mapping``) ONNX
  files plus the dimensions, run with onnxruntime on CPU.
* :func:`load_entry_point`: ``"pkg.module:factory"`` building a module of the same convention,
  plus a state dict read with ``torch.load(..., weights_only=True)``.
* :func:`bundled`: ``"cppn"`` (procedural, untrained, for tests) and ``"dcgan_face"`` (the
  DCGAN face generator in the ``gan-face-generate`` wheel).

Every loader validates the generator (:func:`validate_generator`: output shape, finite values,
range) and records the SHA-256 of each file it read in ``Generator.files``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.gen_nets import CPPNGenerator, DCGANGenerator
from models.seeding import blank
from protocol.errors import ConfigError

__all__ = [
    "DCGAN_FACE_PACKAGE",
    "Generator",
    "GeneratorError",
    "adapt_images",
    "bundled",
    "bundled_unavailable",
    "list_bundled",
    "load_entry_point",
    "load_onnx",
    "load_torchscript",
    "save_onnx_generator",
    "sha256_file",
    "validate_generator",
]

Fn = Callable[[Tensor], Tensor]
_ENTRY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_DIMS = ("z_dim", "w_dim", "img_channels", "img_resolution")


class GeneratorError(ConfigError):
    """A generator file is missing, malformed or produced invalid images."""


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class Generator:
    """A frozen image generator behind two callables on CPU float32 tensors.

    Attributes:
        synthesis: Latents ``[n, w_dim]`` -> images ``[n, C, R, R]`` in ``output_range``.
        mapping: Noise ``[n, z_dim]`` -> latents ``[n, w_dim]``, or None for a Gaussian prior.
        z_dim: Noise size.
        w_dim: Latent size H.
        img_channels: Output channels.
        img_resolution: Output side length R.
        output_range: ``(lo, hi)`` of ``synthesis``'s native output.
        latent_std: Standard deviation of the Gaussian prior when ``mapping`` is None.
        files: ``{path: sha256}`` of every file the generator was loaded from.
        module: The torch module behind the callables, if any (kept for ``.to()``/inspection).
    """

    synthesis: Fn
    mapping: Fn | None
    z_dim: int
    w_dim: int
    img_channels: int
    img_resolution: int
    output_range: tuple[float, float] = (-1.0, 1.0)
    latent_std: float = 1.0
    files: dict[str, str] = field(default_factory=dict)
    module: nn.Module | None = None

    @torch.no_grad()
    def sample_w(self, n: int, rng: torch.Generator | None = None) -> Tensor:
        """``n`` valid latents ``[n, w_dim]``: ``mapping(z)``, ``z ~ N(0, I)``."""
        z = torch.randn(n, self.z_dim, generator=rng)
        return self.latent_std * z if self.mapping is None else self.mapping(z)

    @torch.no_grad()
    def synthesize_raw(self, w: Tensor) -> Tensor:
        """Images in the network's native ``output_range`` (unclamped)."""
        return self.synthesis(w.detach().float().cpu())

    def synthesize(self, w: Tensor) -> Tensor:
        """Latents ``[n, w_dim]`` -> images ``[n, C, R, R]`` in [0, 1] (clamped)."""
        lo, hi = self.output_range
        return ((self.synthesize_raw(w) - lo) / (hi - lo)).clamp_(0.0, 1.0)


def validate_generator(gen: Generator, n: int = 2, seed: int = 0) -> None:
    """Run ``synthesize_raw(sample_w(n))`` and check shapes, finiteness and range.

    The raw output must stay within ``output_range`` widened by half its width on each side:
    StyleGAN outputs legitimately overshoot [-1, 1] a little, but a [0, 255] generator declared
    as [-1, 1] must fail here rather than produce saturated images later.

    Raises:
        GeneratorError: On any violation.
    """
    w = gen.sample_w(n, torch.Generator().manual_seed(seed))
    if tuple(w.shape) != (n, gen.w_dim):
        raise GeneratorError(f"generator latents: expected [{n}, {gen.w_dim}], got {list(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise GeneratorError("generator latents contain NaN or inf")
    x = gen.synthesize_raw(w)
    expected = (n, gen.img_channels, gen.img_resolution, gen.img_resolution)
    if tuple(x.shape) != expected:
        raise GeneratorError(f"generator images: expected {list(expected)}, got {list(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise GeneratorError("generator images contain NaN or inf")
    lo, hi = gen.output_range
    slack = 0.5 * (hi - lo)
    if hi <= lo or float(x.min()) < lo - slack or float(x.max()) > hi + slack:
        raise GeneratorError(
            f"generator images span [{float(x.min()):.3g}, {float(x.max()):.3g}], "
            f"far outside the declared output_range {gen.output_range}"
        )


def _dims(source: Mapping[str, Any] | nn.Module, where: str) -> dict[str, Any]:
    dims: dict[str, int] = {}
    for name in _DIMS:
        value = source.get(name) if isinstance(source, Mapping) else getattr(source, name, None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GeneratorError(f"{where}: {name} must be a positive int, got {value!r}")
        dims[name] = value
    return dims


def _range(value: object, where: str) -> tuple[float, float]:
    if value is None:
        return (-1.0, 1.0)
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise GeneratorError(f"{where}: output_range must be [lo, hi], got {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if not hi > lo:
        raise GeneratorError(f"{where}: output_range needs lo < hi, got {value!r}")
    return lo, hi


def _from_module(module: nn.Module, files: dict[str, str], where: str) -> Generator:
    """Wrap a module of the convention (``synthesis``, optional ``mapping``, dims)."""
    synthesis = getattr(module, "synthesis", None)
    if not callable(synthesis):
        raise GeneratorError(f"{where}: the module has no synthesis(w) method")
    mapping = getattr(module, "mapping", None)
    gen = Generator(
        synthesis=synthesis,
        mapping=mapping if callable(mapping) else None,
        output_range=_range(getattr(module, "output_range", None), where),
        files=files,
        module=module.eval(),
        **_dims(module, where),
    )
    validate_generator(gen)
    return gen


def _existing(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise GeneratorError(f"{what}: no such file {str(p)!r}")
    return p


def load_torchscript(path: str | Path) -> Generator:
    """Load a TorchScript generator file (see the module docstring for the convention)."""
    p = _existing(path, "torchscript generator")
    try:
        # torch >= 2.9 flags TorchScript as deprecated; it is still the format StyleGAN
        # conversions produce (fedktl.md §9.1), so the warning is not the user's concern.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            module = torch.jit.load(str(p), map_location="cpu")  # type: ignore[no-untyped-call]
    except (RuntimeError, ValueError) as exc:
        raise GeneratorError(f"{p}: not a loadable TorchScript file: {exc}") from exc
    return _from_module(module, {str(p): sha256_file(p)}, str(p))


def load_entry_point(
    entry: str,
    weights: str | Path | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    state_key: str | None = None,
) -> Generator:
    """Build ``entry`` (``"pkg.module:factory"``) and load ``weights`` into it.

    Args:
        entry: Module path and attribute, imported with importlib (never evaluated).
        weights: A ``torch.save``d state dict (read with ``weights_only=True``), or None.
        kwargs: Keyword arguments for the factory (plain JSON-like values).
        state_key: Key of the state dict inside the saved dict (e.g. ``"netG_state_dict"``).
    """
    if not _ENTRY_RE.match(entry):
        raise GeneratorError(f"entry point must look like 'pkg.module:callable', got {entry!r}")
    module_name, attr = entry.split(":")
    try:
        factory: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise GeneratorError(f"entry point {entry!r} cannot be resolved: {exc}") from exc
    module = factory(**dict(kwargs or {}))
    if not isinstance(module, nn.Module):
        raise GeneratorError(f"{entry} returned {type(module).__name__}, not an nn.Module")
    files: dict[str, str] = {}
    if weights is not None:
        p = _existing(weights, "generator weights")
        _load_state(module, p, state_key)
        files[str(p)] = sha256_file(p)
    return _from_module(module, files, entry)


def _load_state(module: nn.Module, path: Path, state_key: str | None) -> None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise GeneratorError(f"{path}: not a weights-only torch file: {exc}") from exc
    if state_key is not None:
        if not isinstance(state, dict) or state_key not in state:
            raise GeneratorError(f"{path}: no {state_key!r} entry")
        state = state[state_key]
    if not isinstance(state, dict):
        raise GeneratorError(f"{path}: expected a state dict, got {type(state).__name__}")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise GeneratorError(f"{path}: state dict does not fit the module: {exc}") from exc


def load_onnx(manifest: str | Path) -> Generator:
    """Load a generator from a JSON manifest and its ONNX file(s), run with onnxruntime.

    Manifest keys: ``z_dim``, ``w_dim``, ``img_channels``, ``img_resolution``, ``synthesis``
    (file name relative to the manifest), optional ``mapping`` (None/absent: Gaussian prior),
    ``output_range`` (default [-1, 1]) and ``latent_std`` (default 1).
    """
    mp = _existing(manifest, "generator manifest")
    try:
        spec = json.loads(mp.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GeneratorError(f"{mp}: unreadable JSON manifest: {exc}") from exc
    if not isinstance(spec, dict):
        raise GeneratorError(f"{mp}: the manifest must be a JSON object")
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise GeneratorError("ONNX generators need onnxruntime: pip install edgefl[cpu]") from exc
    files = {str(mp): sha256_file(mp)}

    def session(key: str) -> Fn:
        p = _existing(mp.parent / str(spec[key]), f"{mp}: {key}")
        files[str(p)] = sha256_file(p)
        try:
            sess = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise GeneratorError(f"{p}: onnxruntime cannot load it: {exc}") from exc
        name = sess.get_inputs()[0].name
        return lambda t: torch.from_numpy(sess.run(None, {name: t.numpy()})[0])

    if "synthesis" not in spec:
        raise GeneratorError(f"{mp}: missing 'synthesis' file name")
    gen = Generator(
        synthesis=session("synthesis"),
        mapping=session("mapping") if spec.get("mapping") else None,
        output_range=_range(spec.get("output_range"), str(mp)),
        latent_std=float(spec.get("latent_std", 1.0)),
        files=files,
        **_dims(spec, str(mp)),
    )
    validate_generator(gen)
    return gen


class _Method(nn.Module):
    """Exposes one method of a generator module as ``forward`` for ONNX export."""

    def __init__(self, module: nn.Module, method: str) -> None:
        super().__init__()
        self.inner = module
        self.method = method

    def forward(self, x: Tensor) -> Tensor:
        return getattr(self.inner, self.method)(x)  # type: ignore[no-any-return]


def _export_legacy(module: nn.Module, args: tuple[Tensor, ...], path: str, **kwargs: Any) -> None:
    # The TorchScript-based exporter needs only ``onnx`` (no onnxscript) and handles these
    # small static graphs; torch >= 2.9 marks it deprecated, which is not the caller's concern.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, args, path, dynamo=False, **kwargs)


def save_onnx_generator(module: nn.Module, directory: str | Path, opset: int = 17) -> Path:
    """Export a generator module of the convention to ``directory`` for :func:`load_onnx`.

    Writes ``synthesis.onnx``, ``mapping.onnx`` (when the module has ``mapping``) and
    ``generator.json``; returns the manifest path.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    dims = _dims(module, type(module).__name__)
    module = module.eval()
    spec: dict[str, Any] = {**dims, "output_range": list(getattr(module, "output_range", (-1, 1)))}
    parts = {"synthesis": dims["w_dim"]}
    if callable(getattr(module, "mapping", None)):
        parts["mapping"] = dims["z_dim"]
    for method, width in parts.items():
        _export_legacy(
            _Method(module, method),
            (torch.zeros(2, width),),
            str(out / f"{method}.onnx"),
            input_names=["input"],
            output_names=["output"],
            dynamic_axes={"input": {0: "n"}, "output": {0: "n"}},
            opset_version=opset,
        )
        spec[method] = f"{method}.onnx"
    manifest = out / "generator.json"
    manifest.write_text(json.dumps(spec, indent=2))
    return manifest


DCGAN_FACE_PACKAGE = "gan_face_generate"  # the wheel's package (its weights are in it)
_DCGAN_FACE_MISSING = (
    "the 'dcgan_face' generator needs the gan-face-generate wheel: "
    "pip install --no-deps gan-face-generate (scripts/setup.sh installs it)"
)


def _cppn(**kwargs: Any) -> Generator:
    return _from_module(CPPNGenerator(**kwargs), {}, "bundled cppn")


def _dcgan_face_dir() -> Path | None:
    """The installed wheel's package directory, which holds its weights (None: not installed)."""
    spec = importlib.util.find_spec(DCGAN_FACE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def bundled_unavailable(name: str) -> str | None:
    """Why the bundled generator ``name`` cannot load on this machine (None: it can)."""
    return _DCGAN_FACE_MISSING if name == "dcgan_face" and _dcgan_face_dir() is None else None


def _dcgan_face() -> Generator:
    package = _dcgan_face_dir()
    if package is None:
        raise GeneratorError(_DCGAN_FACE_MISSING)
    weights = package / "weights.tar"
    module = blank(DCGANGenerator)  # its weights are loaded next
    _load_state(module, _existing(weights, "gan-face-generate weights"), "netG_state_dict")
    return _from_module(module, {str(weights): sha256_file(weights)}, "bundled dcgan_face")


_BUNDLED: dict[str, Callable[..., Generator]] = {"cppn": _cppn, "dcgan_face": _dcgan_face}


def list_bundled() -> list[str]:
    """Names accepted by :func:`bundled`."""
    return sorted(_BUNDLED)


def bundled(name: str, **kwargs: Any) -> Generator:
    """A generator shipped with edgefl: ``"cppn"`` (kwargs: w_dim, img_channels,
    img_resolution, z_dim, hidden, seed) or ``"dcgan_face"`` (no kwargs)."""
    try:
        make = _BUNDLED[name]
    except KeyError:
        raise GeneratorError(
            f"unknown bundled generator {name!r}; known: {', '.join(list_bundled())}"
        ) from None
    return make(**kwargs)


def adapt_images(images: Tensor, channels: int, size: int | tuple[int, int]) -> Tensor:
    """Fit generated images in [0, 1] to a client's input spec (fedktl.md §3.4, §9 item 12).

    Resize the shorter side to ``size`` (bilinear, antialiased), centre-crop, and convert
    RGB -> grey with ITU-R 601 luma for 1-channel clients (grey -> RGB by repetition).
    """
    h, w = (size, size) if isinstance(size, int) else size
    src_h, src_w = images.shape[-2:]
    scale = max(h / src_h, w / src_w)
    new = (max(h, round(src_h * scale)), max(w, round(src_w * scale)))
    x = F.interpolate(images, size=new, mode="bilinear", align_corners=False, antialias=True)
    top, left = (new[0] - h) // 2, (new[1] - w) // 2
    x = x[..., top : top + h, left : left + w]
    if channels == 1 and x.shape[1] == 3:
        luma = torch.tensor([0.299, 0.587, 0.114], dtype=x.dtype).view(1, 3, 1, 1)
        x = (x * luma).sum(dim=1, keepdim=True)
    elif channels == 3 and x.shape[1] == 1:
        x = x.repeat(1, 3, 1, 1)
    elif channels != x.shape[1]:
        raise GeneratorError(f"cannot convert {x.shape[1]}-channel images to {channels}")
    return x.clamp(0.0, 1.0)
