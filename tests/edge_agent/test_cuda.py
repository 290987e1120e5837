"""The CUDA paths, run for real where torch sees a GPU (skipped elsewhere, CI included).

Mixed-precision training in the one loop, whole simulated runs with the agents and the
coordinator's server-side training on the GPU, and the ONNX bundle of a GPU-trained model
checked by onnxruntime (on its CUDA provider where the installed onnxruntime has one).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from coordinator.sim.simulate import simulate
from edge_agent.trainer import TensorData, train_epochs
from models import create_model
from protocol.algorithms.local import LocalConfig
from tests.helpers_runtime import FLEET, run_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Recorder:
    """Cross-entropy; keeps the dtype of the logits each step computed."""

    def __init__(self) -> None:
        self.dtypes: set[torch.dtype] = set()

    def step_loss(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> Tensor:
        self.dtypes.add(logits.dtype)
        return F.cross_entropy(logits, y)

    def after_step(self, x: Tensor, y: Tensor, features: Tensor, logits: Tensor) -> None:
        return None


def separable(device: torch.device) -> TensorData:
    """Three classes told apart by which band of rows is bright."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(96) % 3
    x = torch.rand(96, 1, 8, 8, generator=g) * 0.2
    for c in range(3):
        x[y == c, :, 2 * c : 2 * c + 2, :] += 0.8
    return TensorData(x.to(device), y.to(device))


@pytest.mark.parametrize("amp", [True, False])
def test_training_on_cuda_learns_and_autocasts_only_with_mixed_precision(amp: bool) -> None:
    # Prepare
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = create_model("cnn_t2", num_classes=3, in_chans=1, feature_dim=16, input_size=8).to(dev)
    data = separable(dev)
    cfg = LocalConfig(batch_size=16, lr=0.05, local_epochs=30, mixed_precision=amp)
    hooks = Recorder()
    # Execute
    stats = train_epochs(net, data, cfg, hooks, generator=torch.Generator().manual_seed(1))
    # Assert: autocast computes the logits in half precision, the weights stay float32 on the
    # GPU (GradScaler unscales into them), and the model learns the three classes
    assert hooks.dtypes == ({torch.float16} if amp else {torch.float32})
    assert all(p.dtype == torch.float32 and p.is_cuda for p in net.parameters())
    assert torch.isfinite(torch.tensor(stats.mean_loss))
    net.eval()
    with torch.no_grad():
        acc = (net(data.x).argmax(1) == data.y).float().mean().item()
    assert acc > 0.9


def _run(tmp_path: Path, algorithm: str, device: str, *, export: bool = False) -> list[dict]:
    cfg = run_config(tmp_path / device, algorithm, run_id=f"cuda-{algorithm}", server_device=device)
    return simulate(cfg, dataclasses.replace(FLEET, device=device, export=export)).metrics


@pytest.mark.parametrize("algorithm", ["fedproto", "fedtgp"])
def test_a_simulated_run_on_cuda_computes_what_the_cpu_run_computes(
    tmp_path: Path, algorithm: str
) -> None:
    # FedTGP also trains its prototype generator on the coordinator's device (server_device).
    # Same seed, same split: the two runs differ only in floating-point order, so each
    # agent's accuracies may move by a few test images, not more.
    gpu = _run(tmp_path, algorithm, "cuda")
    cpu = _run(tmp_path, algorithm, "cpu")
    assert [m["phase"] for m in gpu] == ["train", "train", "final"]
    for g, c in zip(gpu, cpu, strict=True):
        assert sorted(g["agents"]) == sorted(c["agents"]) == ["agent0", "agent1", "agent2"]
        for dev, a in g["agents"].items():
            assert a["acc_local"] == pytest.approx(c["agents"][dev]["acc_local"], abs=0.05)
            assert a["acc_global"] == pytest.approx(c["agents"][dev]["acc_global"], abs=0.05)


def test_a_gpu_trained_models_onnx_bundle_verifies_on_onnxruntime(tmp_path: Path) -> None:
    import onnxruntime as ort

    from export.bundle import export_bundle

    _run(tmp_path, "fedproto", "cuda", export=True)
    run_dir = tmp_path / "cuda" / "run"
    manifests = sorted((run_dir / "export").glob("*/manifest.json"))
    assert len(manifests) == 3  # every agent exported and verified its own model at the end
    # again on the GPU provider where this onnxruntime has one (onnxruntime-gpu)
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    ckpt = next((run_dir / "agents" / "agent0").glob("**/*.pt"))  # the final checkpoint
    manifest = export_bundle(ckpt, tmp_path / "bundle", providers=providers, verify=True)
    used = manifest.record("fp32").providers_used
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert used[0] == "CUDAExecutionProvider"
    else:
        assert used == ["CPUExecutionProvider"]
    assert json.loads((tmp_path / "bundle" / "manifest.json").read_text())["files"]
