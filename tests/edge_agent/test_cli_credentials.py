"""The CLIs take credentials from kits, files and ``EDGEFL_*``, never from argv
values; each refusal happens before any data, model or broker is touched."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.cli import main as coordinator_main
from coordinator.ops.provision import ProvisionSpec, provision
from edge_agent.cli import build_parser
from edge_agent.cli import main as agent_main
from protocol.security.credentials import ENV


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "fleet"
    provision(out, ProvisionSpec(federation="lab", devices=("dev-1",)))
    return out


@pytest.fixture(autouse=True)
def _no_ambient_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)


def agent_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert agent_main(argv) == 2
    return capsys.readouterr().err


def test_a_password_on_the_command_line_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = agent_error(["--broker", "127.0.0.1:1", "--password", "s3cret"], capsys)
    assert "visible to every user in `ps`" in err and ENV["password"] in err
    assert "--password" not in build_parser().format_help()


def test_the_kit_names_id_and_federation_and_a_contradiction_is_refused(
    fleet: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kit = str(fleet / "devices" / "dev-1")
    assert "the kit" in agent_error(["--kit", kit, "--id", "dev-2"], capsys)
    assert "for 'lab'" in agent_error(["--kit", kit, "--federation", "other"], capsys)
    err = agent_error(["--kit", str(fleet / "coordinator")], capsys)
    assert "edge-agent needs a device kit" in err


def test_no_broker_and_no_kit_is_a_precise_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--broker: expected HOST[:PORT]" in agent_error([], capsys)


def test_a_missing_kit_from_the_environment_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(ENV["kit"], str(tmp_path / "nope"))
    assert f"{ENV['kit']} {tmp_path / 'nope'}: no such kit directory" in agent_error([], capsys)


def test_serve_refuses_a_device_kit_and_tls_without_a_broker(
    fleet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["serve", "--run-dir", str(tmp_path / "run"), "--algorithm", "fedavg"]
    assert coordinator_main([*run, "--kit", str(fleet / "devices" / "dev-1")]) == 2
    assert "needs the coordinator's kit" in capsys.readouterr().err
    monkeypatch.setenv(ENV["ca"], str(fleet / "ca" / "ca.crt"))
    assert coordinator_main(run) == 2
    assert "the embedded broker authenticates only a provisioned fleet" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # a refused start leaves nothing behind
    kit = ["--kit", str(fleet / "coordinator"), "--set", "run.federation=other"]
    assert coordinator_main([*run, *kit]) == 2
    assert "is for federation 'lab'" in capsys.readouterr().err
