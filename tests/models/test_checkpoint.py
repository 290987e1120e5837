"""Agent checkpoints: round trip, weights_only loading, precise errors."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from models import Classifier, create_model
from models.checkpoint import (
    FORMAT,
    Checkpoint,
    CheckpointError,
    HeadSpec,
    ModelSpec,
    build_model,
    file_sha256,
    load_checkpoint,
    save_checkpoint,
)

META = {
    "algorithm": "fedproto",
    "round": 7,
    "federation": "fleet-a",
    "run_id": "r1",
    "device_id": "dev-3",
    "class_names": [f"c{i}" for i in range(10)],
    "toolkit_version": "0.1.0",
    "metrics": {"acc": 0.91, "loss": 0.3},
}


def _model(**kw: Any) -> Classifier:
    torch.manual_seed(0)
    args = {"num_classes": 10, "in_chans": 1, "input_size": 8, **kw}
    return create_model("cnn_t1", **args)


def _proto_head(d: int) -> HeadSpec:
    valid = torch.ones(10, dtype=torch.bool)
    valid[4] = False
    return HeadSpec("prototype", torch.randn(10, d), valid)


def _save(tmp_path: Path, obj: object, name: str = "ck.pt") -> Path:
    path = tmp_path / name
    torch.save(obj, path)
    return path


def _raw(tmp_path: Path) -> dict[str, Any]:
    model = _model()
    return Checkpoint.from_model(model, _proto_head(model.num_features), META).to_dict()


def test_round_trip_restores_weights_head_and_meta(tmp_path: Path) -> None:
    model = _model(mean=[0.5], std=[0.25])
    head = _proto_head(model.num_features)
    extra = {"generator.weight": torch.randn(3, 4)}
    path = save_checkpoint(
        tmp_path / "sub" / "ck.pt", Checkpoint.from_model(model, head, META, extra)
    )
    ckpt = load_checkpoint(path)
    assert ckpt.model_spec.name == "cnn_t1"
    assert ckpt.model_spec.input_size == (8, 8)
    assert ckpt.model_spec.mean == (0.5,) and ckpt.model_spec.std == (0.25,)
    assert ckpt.meta["round"] == 7 and ckpt.meta["class_names"][3] == "c3"
    assert ckpt.head.type == "prototype"
    assert ckpt.head.prototypes is not None and head.prototypes is not None
    assert torch.equal(ckpt.head.prototypes, head.prototypes)
    assert ckpt.head.valid is not None and not bool(ckpt.head.valid[4])
    assert torch.equal(ckpt.extra["generator.weight"], extra["generator.weight"])
    rebuilt = build_model(ckpt)
    x = torch.rand(5, 1, 8, 8)
    with torch.no_grad():  # same outputs: the normalisation (not in the state dict) survived
        assert torch.allclose(rebuilt(x), model.eval()(x))
    assert not rebuilt.training


def test_file_holds_only_weights_only_types(tmp_path: Path) -> None:
    model = _model()
    path = save_checkpoint(tmp_path / "ck.pt", Checkpoint.from_model(model, HeadSpec("logits")))
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert raw["format"] == FORMAT
    assert set(raw) == {"format", "model", "state_dict", "head", "meta", "extra"}
    assert raw["head"] == {"type": "logits"}
    assert raw["model"]["input_size"] == [8, 8]


def test_save_is_atomic_and_leaves_no_temporaries(tmp_path: Path) -> None:
    model = _model()
    ckpt = Checkpoint.from_model(model, HeadSpec("logits"))
    save_checkpoint(tmp_path / "ck.pt", ckpt)
    save_checkpoint(tmp_path / "ck.pt", ckpt)  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_file_sha256_matches_hashlib(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"edgefl" * 1000)
    assert file_sha256(path) == hashlib.sha256(b"edgefl" * 1000).hexdigest()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "absent.pt", r"checkpoint not found: .*absent\.pt"),
        (lambda p: p, r"checkpoint is not a file"),
        (lambda p: _write(p / "rand.pt", bytes(range(256)) * 4), r"not a torch\.save archive"),
        (lambda p: _write(p / "empty.pt", b""), r"not a torch\.save archive"),
    ],
)
def test_unreadable_files_give_precise_errors(tmp_path: Path, make: Any, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(make(tmp_path))


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_truncated_checkpoint_is_reported(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path / "ck.pt", Checkpoint.from_model(_model(), HeadSpec("logits")))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt, truncated"):
        load_checkpoint(path)


def test_pickled_module_is_refused_not_executed(tmp_path: Path) -> None:
    path = _save(tmp_path, {"format": FORMAT, "model": torch.nn.Linear(2, 2)})
    with pytest.raises(CheckpointError, match=r"pickled Python object \(torch\.nn\..*Linear\)"):
        load_checkpoint(path)


def test_wrong_format_tag(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    raw["format"] = "something/2"
    with pytest.raises(
        CheckpointError, match=r"format tag is 'something/2', expected " + re.escape(repr(FORMAT))
    ):
        load_checkpoint(_save(tmp_path, raw))


def test_plain_state_dict_is_not_a_checkpoint(tmp_path: Path) -> None:
    path = _save(tmp_path, _model().state_dict())
    with pytest.raises(CheckpointError, match="format tag is None"):
        load_checkpoint(path)


@pytest.mark.parametrize("key", ["model", "state_dict", "head", "meta"])
def test_missing_top_level_key(tmp_path: Path, key: str) -> None:
    raw = _raw(tmp_path)
    del raw[key]
    with pytest.raises(CheckpointError, match=f"missing key '{key}'"):
        load_checkpoint(_save(tmp_path, raw))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda r: r["model"].pop("num_classes"), r"\.model: missing key 'num_classes'"),
        (lambda r: r["model"].update(num_classes="10"), r"\.model\.num_classes: expected int"),
        (lambda r: r["model"].update(num_classes=True), r"\.model\.num_classes: expected int"),
        (lambda r: r["model"].update(input_size=[8]), r"\.model\.input_size: expected \[h, w\]"),
        (
            lambda r: r["model"].update(in_chans=0),
            r"\.model\.in_chans: expected an int >= 1, got 0",
        ),
        (lambda r: r["model"].update(mean=[0.5, "x"]), r"\.model\.mean\[1\]: expected float"),
        (lambda r: r["model"].update(std=[float("nan")]), r"\.model\.std\[0\]: expected a finite"),
        (lambda r: r["state_dict"].update(bad=[1.0]), r"\.state_dict\['bad'\]: expected a tensor"),
        (lambda r: r["head"].update(type="knn"), r"head\.type: expected one of"),
        (lambda r: r["head"].pop("valid"), r"\.head: missing key 'valid'"),
        (
            lambda r: r["head"].update(prototypes=torch.zeros(10)),
            r"head\.prototypes: .*float tensor \[C, D\], got tensor float32 \[10\]",
        ),
        (lambda r: r["head"].update(valid=torch.ones(10)), r"head\.valid: expected a bool tensor"),
        (lambda r: r["head"].update(valid=torch.zeros(10, dtype=torch.bool)), r"no class is valid"),
        (
            lambda r: r["head"].update(prototypes=torch.randn(9, 128), valid=torch.ones(9).bool()),
            r"9 rows but model\.num_classes is 10",
        ),
        (lambda r: r["meta"].update(round="7"), r"\.meta\.round: expected int"),
        (lambda r: r["meta"].update(class_names=[1, 2]), r"class_names: expected a list of str"),
        (lambda r: r["meta"]["metrics"].update(acc="high"), r"metrics\.acc: expected a float"),
    ],
)
def test_wrong_types_name_the_key(tmp_path: Path, edit: Any, message: str) -> None:
    raw = _raw(tmp_path)
    edit(raw)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(_save(tmp_path, raw))


def test_architecture_mismatch_lists_keys(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    sd = raw["state_dict"]
    sd["head.weight"] = torch.zeros(10, 99)
    del sd["trunk.0.bias"]
    sd["extra_layer.weight"] = torch.zeros(1)
    ckpt = load_checkpoint(_save(tmp_path, raw))
    with pytest.raises(CheckpointError) as info:
        build_model(ckpt)
    text = str(info.value)
    assert "does not match cnn_t1(num_classes=10" in text
    assert "1 missing (trunk.0.bias)" in text
    assert "1 unexpected (extra_layer.weight)" in text
    assert "head.weight: checkpoint [10, 99] vs model [10, 128]" in text


def test_unknown_architecture(tmp_path: Path) -> None:
    raw = _raw(tmp_path)
    raw["model"]["name"] = "cnn_t1_typo"
    with pytest.raises(CheckpointError, match=r"model 'cnn_t1_typo' cannot be built: .*unknown"):
        build_model(load_checkpoint(_save(tmp_path, raw)))


def test_headspec_validation() -> None:
    with pytest.raises(CheckpointError, match="takes no prototypes"):
        HeadSpec("logits", torch.zeros(2, 2))
    with pytest.raises(CheckpointError, match="NaN or infinite"):
        HeadSpec("cosine", torch.full((2, 2), float("nan")))
    head = HeadSpec("cosine", torch.randn(3, 4, dtype=torch.float64))
    assert head.prototypes is not None and head.prototypes.dtype == torch.float32
    mask = head.valid_mask()
    assert mask is not None and bool(mask.all()) and head.num_classes == 3


def test_model_spec_from_hand_built_model_is_refused() -> None:
    model = _model()
    model.model_name = None
    with pytest.raises(CheckpointError, match=r"only models built with models\.create_model"):
        ModelSpec.from_model(model)
