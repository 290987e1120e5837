"""Secure by default: a broker off this machine only with TLS client authentication and
signing, unless ``--insecure``; a loopback broker and the in-process commands need no flag;
each command says its mode in one start-up line.

The refusals happen before any connection (the broker addresses are unroutable TEST-NET ones:
a connection attempt would hang, not fail), with exit code 2 and the flags that fix them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from protocol.errors import ConfigError
from protocol.security.credentials import Credentials
from protocol.security.mode import connection_mode, is_loopback
from protocol.transport.address import parse_broker
from tests.helpers_runtime import clean_env

FAR_HOST = "192.0.2.1"  # TEST-NET-1: never routed
FAR = parse_broker(FAR_HOST)
MTLS = {"ca": Path("ca.crt"), "cert": Path("dev.crt"), "key": Path("dev.key")}


def test_loopback_hosts() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", FAR_HOST, "broker.local"))


def test_a_far_broker_needs_tls_client_authentication_and_signing() -> None:
    with pytest.raises(ConfigError) as refused:
        connection_mode(FAR, Credentials(), signing=False, insecure=False)
    message = str(refused.value)
    assert "without TLS client authentication and signing" in message
    assert all(flag in message for flag in ("--kit", "--credentials", "--insecure"))
    # half of it is still a refusal, naming the half that is missing
    with pytest.raises(ConfigError, match="without signing:"):
        connection_mode(FAR, Credentials(**MTLS), signing=False, insecure=False)
    keys_off = Credentials(**MTLS, signing_key=Path("signing.key"))
    with pytest.raises(ConfigError, match=r"without signing \(--no-signing\)"):
        connection_mode(FAR, keys_off, signing=False, insecure=False)
    server_tls_only = Credentials(ca=Path("ca.crt"), username="u", password="p")
    with pytest.raises(ConfigError, match="without TLS client authentication:"):
        connection_mode(FAR, server_tls_only, signing=True, insecure=False)


def test_the_modes_and_their_lines() -> None:
    secure = connection_mode(FAR, Credentials(**MTLS), signing=True, insecure=False)
    assert secure.name == "secure" and secure.line.startswith("security: secure (")
    local = connection_mode(parse_broker("127.0.0.1"), Credentials(), signing=False, insecure=False)
    assert local.name == "loopback" and "127.0.0.1 is on this machine" in local.line
    anyway = connection_mode(FAR, Credentials(), signing=False, insecure=True)
    assert anyway.name == "insecure" and "--insecure" in anyway.line and "forge" in anyway.line
    # --insecure is a permission, never a downgrade
    assert connection_mode(FAR, Credentials(**MTLS), signing=True, insecure=True).name == "secure"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv],
        check=False,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_edge_agent_refuses_a_far_anonymous_broker_before_connecting() -> None:
    result = _run(
        "edge_agent.cli", "--broker", f"{FAR_HOST}:1883", "--id", "d1", "--connect-retry", "0"
    )
    assert result.returncode == 2, result.stderr
    assert "refusing to connect to the broker at 192.0.2.1" in result.stderr
    assert "--insecure" in result.stderr and "--kit" in result.stderr
    assert "unreachable" not in result.stderr  # no connection was tried


def test_edge_agent_with_insecure_goes_on_and_says_so(tmp_path: Path) -> None:
    # the data fails to load after the mode is decided: proof that it went past the refusal
    result = _run(
        "edge_agent.cli",
        "--broker",
        f"{FAR_HOST}:1883",
        "--id",
        "d1",
        "--insecure",
        "--data",
        str(tmp_path / "missing.npz"),
        "--state-dir",
        str(tmp_path / "state"),
    )
    assert result.returncode == 2, result.stderr
    assert "security: insecure (--insecure: broker 192.0.2.1 without" in result.stderr
    assert "missing.npz" in result.stderr


def test_edge_agent_on_loopback_needs_no_flag(tmp_path: Path) -> None:
    result = _run(
        "edge_agent.cli",
        "--broker",
        "127.0.0.1:9",
        "--id",
        "d1",
        "--data",
        str(tmp_path / "missing.npz"),
        "--state-dir",
        str(tmp_path / "state"),
    )
    assert "security: loopback (broker 127.0.0.1 is on this machine" in result.stderr
    assert "missing.npz" in result.stderr


def test_serve_refuses_a_far_anonymous_broker_before_connecting(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = _run("coordinator.cli", "serve", "--broker", FAR_HOST, "--run-dir", str(run_dir))
    assert result.returncode == 2, result.stderr
    assert "refusing to connect to the broker at 192.0.2.1" in result.stderr
    assert "--insecure" in result.stderr and "--kit" in result.stderr
    assert not run_dir.exists()


def test_serve_refuses_an_exposed_anonymous_embedded_broker(tmp_path: Path) -> None:
    result = _run(
        "coordinator.cli", "serve", "--listen", "0.0.0.0", "--run-dir", str(tmp_path / "r")
    )
    assert result.returncode == 2, result.stderr
    assert "refusing to run the embedded broker on 0.0.0.0 without authentication" in result.stderr
    assert "--broker-dir" in result.stderr and "--insecure" in result.stderr


def test_serves_decision_with_insecure_and_on_loopback() -> None:
    from coordinator.commands.serve import _security_mode
    from coordinator.config import RunConfig

    args = argparse.Namespace(insecure=True)
    far = RunConfig(broker=f"{FAR_HOST}:1883")
    assert _security_mode(args, far, Credentials(), signing=False).name == "insecure"
    embedded = _security_mode(argparse.Namespace(insecure=False), RunConfig(), Credentials(), False)
    assert embedded.name == "loopback" and "embedded broker on 127.0.0.1" in embedded.line


def test_ingest_worker_refuses_a_far_anonymous_broker(tmp_path: Path) -> None:
    result = _run(
        "coordinator.cli", "ingest-worker", "--run-dir", str(tmp_path), "--broker", FAR_HOST
    )
    assert result.returncode == 2, result.stderr
    assert "refusing to connect to the broker at 192.0.2.1" in result.stderr


def test_serve_passes_insecure_on_to_the_workers_it_spawns() -> None:
    from coordinator.commands.serve import _worker_options
    from coordinator.config import RunConfig

    args = argparse.Namespace(kit=None, credentials=None, insecure=True, no_signing=False)
    assert "--insecure" in _worker_options(args, RunConfig(ingest_workers=2))


def test_websockets_are_judged_as_tcp_ws_plain_and_wss_tls() -> None:
    signed_mtls = Credentials(**MTLS)
    # ws:// is plain: the kit's TLS files would go unused, so the pair is refused outright
    with pytest.raises(ConfigError, match=r"ws:// is a plain connection.*use wss://192\.0\.2\.1"):
        connection_mode(
            parse_broker("ws://192.0.2.1:8080"), signed_mtls, signing=True, insecure=True
        )
    with pytest.raises(ConfigError, match=r"mqtt:// is a plain connection.*use mqtts://"):
        connection_mode(parse_broker("mqtt://192.0.2.1"), signed_mtls, signing=True, insecure=True)
    # wss:// without a client certificate is TLS without client authentication: refused
    with pytest.raises(ConfigError, match=r"wss://192\.0\.2\.1:443/mqtt without TLS client"):
        connection_mode(
            parse_broker("wss://192.0.2.1"), Credentials(), signing=True, insecure=False
        )
    wss = connection_mode(
        parse_broker("wss://192.0.2.1"), signed_mtls, signing=True, insecure=False
    )
    assert wss.name == "secure"
    local = connection_mode(
        parse_broker("ws://localhost:9001"), Credentials(), signing=False, insecure=False
    )
    assert local.name == "loopback" and "ws://localhost:9001/mqtt is on this machine" in local.line
    anyway = connection_mode(
        parse_broker("ws://192.0.2.1"), Credentials(), signing=False, insecure=True
    )
    assert anyway.name == "insecure" and "ws://192.0.2.1:80/mqtt" in anyway.line


def test_edge_agent_refuses_a_far_websockets_broker_without_a_kit() -> None:
    result = _run(
        "edge_agent.cli", "--broker", "wss://192.0.2.1/mqtt", "--id", "d1", "--connect-retry", "0"
    )
    assert result.returncode == 2, result.stderr
    assert "refusing to connect to the broker at wss://192.0.2.1:443/mqtt" in result.stderr
    assert "unreachable" not in result.stderr  # no connection was tried
