"""MqttTransport over TLS with client certificates, against mosquitto (``require_certificate``)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Inbox

from coordinator.broker.embedded import MosquittoBroker, mosquitto_executable
from protocol.errors import ConnectError
from protocol.transport.lean_mqtt import LeanMqttTransport
from protocol.transport.paho import MqttTransport, TlsOptions

pytestmark = pytest.mark.network


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue(name: str, cn: str, cwd: Path, san: str | None = None) -> None:
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        f"/CN={cn}",
        cwd=cwd,
    )
    extra: list[str] = []
    if san:
        (cwd / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        extra = ["-extfile", f"{name}.ext"]
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        f"{name}.crt",
        "-days",
        "1",
        *extra,
        cwd=cwd,
    )


@pytest.fixture
def pki() -> Iterator[Path]:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    if mosquitto_executable() is None:
        pytest.skip("mosquitto is not installed")
    # not pytest's tmp_path: mosquitto drops to its own user and must read these files
    d = Path(tempfile.mkdtemp(prefix="edgefl-pki-"))
    d.chmod(0o755)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=edgefl-test-ca",
        cwd=d,
    )
    _issue("server", "localhost", d, san="IP:127.0.0.1,DNS:localhost")
    _issue("dev1", "dev1", d)
    for f in d.iterdir():
        f.chmod(0o644)  # test-only keys
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("kind", [MqttTransport, LeanMqttTransport], ids=["paho", "lean"])
def test_tls_with_client_certificates(
    pki: Path, kind: type[MqttTransport | LeanMqttTransport]
) -> None:
    conf = (
        f"cafile {pki / 'ca.crt'}\ncertfile {pki / 'server.crt'}\n"
        f"keyfile {pki / 'server.key'}\nrequire_certificate true\n"
        "use_identity_as_username true\n"
    )
    with MosquittoBroker(extra_config=conf) as broker:
        tls = TlsOptions(
            ca_certs=str(pki / "ca.crt"),
            certfile=str(pki / "dev1.crt"),
            keyfile=str(pki / "dev1.key"),
        )
        t = kind(client_id="dev1", port=broker.port, tls=tls, connect_timeout=5)
        got = Inbox()
        t.subscribe("secure/topic", got)
        t.connect()
        try:
            t.publish("secure/topic", b"over tls")
            assert got.wait(1)
            assert got.items[0][1] == b"over tls"
            # many records each way: partial TLS reads and writes on a non-blocking socket
            bulk = [bytes([i % 251]) * 40_000 for i in range(300)]
            for payload in bulk:
                t.publish("secure/topic", payload)
            assert got.wait(301, timeout=60)
            assert [p for _, p in got.items[1:]] == bulk
        finally:
            t.close()
        # without a client certificate the broker refuses the handshake
        anonymous = kind(
            client_id="anon",
            port=broker.port,
            connect_timeout=2,
            tls=TlsOptions(ca_certs=str(pki / "ca.crt")),
        )
        with pytest.raises(ConnectError, match=f"127.0.0.1:{broker.port}"):
            anonymous.connect()
