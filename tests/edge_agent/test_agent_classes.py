"""Class meaning: local labels mapped onto the federation's classes by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_agent.cli import main
from edge_agent.data import load_dataset
from edge_agent.factory import AgentOptions, build_agent, map_classes
from protocol.errors import ConfigError
from protocol.transport.base import MemoryBroker, MemoryTransport

DIGITS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def image_folder(root: Path, classes: dict[str, int]) -> Path:
    image = pytest.importorskip("PIL.Image")
    for c, (name, n) in enumerate(classes.items()):
        (root / name).mkdir(parents=True)
        for i in range(n):
            image.new("L", (8, 8), color=20 * c + i).save(root / name / f"{i}.png")
    return root


def test_an_image_folder_is_numbered_by_the_federations_names(tmp_path: Path) -> None:
    # A device with three of the ten classes: ImageFolder numbers them eight=0, five=1, zero=2
    # and counts 3 classes; mapped by name they are 8, 5 and 0 of 10.
    folder = image_folder(tmp_path / "imgs", {"zero": 2, "five": 3, "eight": 4})
    local = load_dataset(str(folder))
    assert local.class_names == ("eight", "five", "zero") and local.num_classes == 3
    mapped = map_classes(local, DIGITS)
    assert mapped.num_classes == 10 and mapped.class_names == DIGITS
    assert np.bincount(mapped.y, minlength=10).tolist() == [2, 0, 0, 0, 0, 3, 0, 0, 4, 0]
    assert (mapped.x == local.x).all()


def test_the_agent_registers_the_federations_numbering(tmp_path: Path) -> None:
    folder = image_folder(tmp_path / "imgs", {"zero": 5, "five": 5, "eight": 5})
    opts = AgentOptions(
        device_id="dev1",
        model="mlp_s",
        feature_dim=16,
        data=str(folder),
        state_dir=tmp_path / "state",
        device="cpu",
        classes=DIGITS,
    )
    agent = build_agent(opts, MemoryTransport(MemoryBroker(), "dev1"))
    assert agent.ctx.num_classes == 10
    present = {c for c, n in enumerate(agent.ctx.class_counts) if n}
    assert present <= {0, 5, 8} and len(present) >= 2  # the 80/20 split keeps most of them
    assert agent.settings.class_names == DIGITS  # the checkpoint and export name them


def test_a_class_the_federation_does_not_declare_is_a_one_line_error(
    tmp_path: Path, capsys
) -> None:
    folder = image_folder(tmp_path / "imgs", {"zero": 2, "cat": 2})
    with pytest.raises(ConfigError, match=r"classes \['cat'\] are not among"):
        map_classes(load_dataset(str(folder)), DIGITS)
    names = tmp_path / "classes.txt"
    names.write_text("\n".join(DIGITS) + "\n")
    argv = ["--broker", "127.0.0.1:1", "--data", str(folder), "--classes", f"@{names}"]
    assert main([*argv, "--model", "mlp_s", "--connect-retry", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edge-agent: error: data imagefolder:imgs: classes ['cat']"), err
    assert main([*argv[:-1], "zero,,one"]) == 2
    assert "expected class names" in capsys.readouterr().err


def test_an_agent_without_classes_adopts_the_runs_and_its_own_list_wins() -> None:
    from edge_agent.cli import build_parser
    from edge_agent.joining import adopt
    from protocol.contract.messages import CoordinatorState

    state = CoordinatorState(
        state="running", run_id="r", algorithm="fedavg", round=0, total_rounds=1, classes=[*DIGITS]
    )
    bare = build_parser().parse_args(["--broker", "h"])
    assert adopt(bare, state)[:2] == ("fedavg", DIGITS)
    own = build_parser().parse_args(["--broker", "h", "--classes", "a,b", "--algorithm", "fd"])
    assert adopt(own, state)[:2] == ("fd", ("a", "b"))
    unnamed = CoordinatorState(state="running", run_id="r", algorithm="fd", round=0, total_rounds=1)
    assert adopt(bare, unnamed)[:2] == ("fd", ())
