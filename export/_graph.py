"""ONNX graph plumbing: join/split trunk and head, tidy opsets, metadata, checker.

Every call into ``onnx`` that can reject a model is wrapped here and re-raised as
:class:`~protocol.errors.ExportError`, so callers see one error type.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import onnx
import onnx.utils
import onnx.version_converter
from onnx import ModelProto, compose

from protocol.errors import ExportError

__all__ = [
    "BATCH_DIM",
    "FEATURES",
    "HEAD_PREFIX",
    "INPUT",
    "OUTPUTS",
    "check_model",
    "join",
    "name_batch_dim",
    "prune_opsets",
    "read_metadata",
    "save_atomic",
    "set_metadata",
    "split",
    "strip_debug_info",
    "toposort",
]

INPUT = "input"
FEATURES = "features"
OUTPUTS = ("scores", "label")
BATCH_DIM = "batch"
# Head nodes and initializers carry this prefix so that they can never collide with trunk
# names and remain recognisable in a merged graph.
HEAD_PREFIX = "head/"


def name_batch_dim(model: ModelProto) -> None:
    """Name dimension 0 of every graph input and output ``batch`` (dynamo calls it ``s77``)."""
    for value in (*model.graph.input, *model.graph.output):
        shape = value.type.tensor_type.shape
        if len(shape.dim) > 0 and not shape.dim[0].HasField("dim_value"):
            shape.dim[0].dim_param = BATCH_DIM


def join(trunk: ModelProto, head: ModelProto) -> ModelProto:
    """One graph ``input -> trunk -> features -> head -> scores, label``.

    The head's opset and IR version are aligned to the trunk's first: quantisation and fp16
    tools may rewrite the trunk's, and ``onnx.compose`` refuses to merge mismatched models.
    """
    trunk_opset = _default_opset(trunk)
    if _default_opset(head) != trunk_opset:
        try:
            head = onnx.version_converter.convert_version(head, trunk_opset)
        except Exception as exc:  # the C++ converter raises RuntimeError/ValidationError
            raise ExportError(f"cannot convert the head to opset {trunk_opset}: {exc}") from exc
    ir_version = max(trunk.ir_version, head.ir_version)
    trunk.ir_version = head.ir_version = ir_version
    _merge_opsets(trunk, head)
    for part in (trunk, head):
        # Graph inputs and outputs must not also appear in value_info: `features` would clash
        # in the merge, and add_prefix renames value_info entries, so the Extractor's copies of
        # `scores`/`label` came out as `head/scores`/`head/label` in every variant.
        io_names = {v.name for v in (*part.graph.input, *part.graph.output)}
        kept = [v for v in part.graph.value_info if v.name not in io_names]
        del part.graph.value_info[:]
        part.graph.value_info.extend(kept)
    if not any(n.name.startswith(HEAD_PREFIX) for n in head.graph.node):
        head = compose.add_prefix(head, HEAD_PREFIX, rename_inputs=False, rename_outputs=False)
    try:
        merged = compose.merge_models(trunk, head, io_map=[(FEATURES, FEATURES)])
    except Exception as exc:  # onnx.compose raises ValueError / checker errors
        raise ExportError(f"cannot join trunk and head graphs: {exc}") from exc
    merged.graph.name = "edgefl"
    _check_io(merged)
    return merged


def _check_io(model: ModelProto) -> None:
    """Every file of a bundle has the same signature, so that a deployment can swap them."""
    inputs = [v.name for v in model.graph.input]
    outputs = [v.name for v in model.graph.output]
    if inputs != [INPUT] or outputs != list(OUTPUTS):
        raise ExportError(
            f"joined graph has inputs {inputs} and outputs {outputs}; "
            f"expected [{INPUT!r}] and {list(OUTPUTS)}"
        )


def toposort(model: ModelProto) -> None:
    """Reorder nodes topologically (the fp16 converter appends its input Casts at the end)."""
    nodes = list(model.graph.node)
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    order: list[int] = []
    state = [0] * len(nodes)  # 0 unvisited, 1 on the stack, 2 placed
    for root in range(len(nodes)):
        stack = [(root, False)]
        while stack:
            i, expanded = stack.pop()
            if expanded:
                if state[i] != 2:
                    state[i] = 2
                    order.append(i)
                continue
            if state[i]:
                continue
            state[i] = 1
            stack.append((i, True))
            # Inputs without a producer are graph inputs, initializers or outer-scope names.
            deps = (producer[x] for x in nodes[i].input if x in producer)
            stack.extend((d, False) for d in deps if state[d] == 0)
    del model.graph.node[:]
    model.graph.node.extend(nodes[i] for i in order)


def split(model: ModelProto) -> tuple[ModelProto, ModelProto]:
    """The trunk (``input -> features``) and head (``features -> scores, label``) of a join."""
    try:
        extractor = onnx.utils.Extractor(model)
        trunk = extractor.extract_model([INPUT], [FEATURES])
        head = extractor.extract_model([FEATURES], list(OUTPUTS))
    except Exception as exc:  # KeyError/ValueError when the tensors are absent
        raise ExportError(
            f"model is not an edgefl export (no {INPUT!r} -> {FEATURES!r} -> {OUTPUTS} path): {exc}"
        ) from exc
    for part in (trunk, head):
        part.ir_version = model.ir_version
        del part.metadata_props[:]
    return trunk, head


def prune_opsets(model: ModelProto) -> None:
    """One import per domain, and none that no node uses.

    ``compose.merge_models`` repeats the default domain (which ORT's quantiser rejects), and
    ORT's optimiser adds a dozen unused domains (``org.pytorch.aten``, ...) that runtimes other
    than ORT (TensorRT, OpenVINO) may refuse.
    """
    used = {n.domain for n in model.graph.node}
    for fn in model.functions:
        used.add(fn.domain)
        used.update(n.domain for n in fn.node)
    versions: dict[str, int] = {}
    for entry in model.opset_import:
        domain = "" if entry.domain == "ai.onnx" else entry.domain
        if domain in used or domain == "":
            versions[domain] = max(versions.get(domain, 0), int(entry.version))
    del model.opset_import[:]
    for domain, version in versions.items():
        model.opset_import.add(domain=domain, version=version)


def strip_debug_info(model: ModelProto) -> None:
    """Drop per-node debug metadata (dynamo records Python stack traces with the build
    machine's file paths and the fx graph: bytes and paths that do not belong in a deployment)."""
    for fn_nodes in (model.graph.node, *(f.node for f in model.functions)):
        for node in fn_nodes:
            del node.metadata_props[:]
            node.doc_string = ""


def set_metadata(model: ModelProto, metadata: Mapping[str, str]) -> None:
    """Replace ``metadata_props`` with ``metadata`` (sorted keys, str values)."""
    del model.metadata_props[:]
    for key in sorted(metadata):
        entry = model.metadata_props.add()
        entry.key, entry.value = key, str(metadata[key])


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file (weights are not loaded)."""
    try:
        model = onnx.load(os.fspath(path), load_external_data=False)
    except Exception as exc:  # DecodeError, OSError
        raise ExportError(f"{path}: not a readable ONNX model: {exc}") from exc
    return {p.key: p.value for p in model.metadata_props}


def check_model(path: str | os.PathLike[str]) -> None:
    """``onnx.checker.check_model(full_check=True)`` (strict shape inference included)."""
    try:
        onnx.checker.check_model(os.fspath(path), full_check=True)
    except Exception as exc:  # ValidationError, InferenceError, OSError
        raise ExportError(f"{path}: ONNX checker rejected the model: {_short(exc)}") from exc


def save_atomic(model: ModelProto, path: str | os.PathLike[str]) -> Path:
    """Write ``model`` to a temporary file beside ``path`` then ``os.replace`` it."""
    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        onnx.save_model(model, tmp)
        # mkstemp creates 0600; a deployed model must be readable like any file written here.
        Path(tmp).chmod(0o666 & ~_umask())
        Path(tmp).replace(dest)
    except Exception as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ExportError(f"cannot write {dest}: {_short(exc)}") from exc
    return dest


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: restore at once
    os.umask(mask)
    return mask


def _default_opset(model: ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    raise ExportError("model imports no default-domain opset")


def _merge_opsets(trunk: ModelProto, head: ModelProto) -> None:
    """Give the head every non-default opset import the trunk has, at the trunk's version."""
    versions = {o.domain: o.version for o in trunk.opset_import}
    for entry in head.opset_import:
        if entry.domain in versions:
            entry.version = versions[entry.domain]


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
