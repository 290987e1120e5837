"""``protocol.security.credentials``: kit, credentials file and ``EDGEFL_*`` variables, in that
order of
precedence from lowest to highest; precise errors for what is named but missing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from coordinator.ops.provision import ProvisionSpec, provision
from protocol.errors import ConfigError
from protocol.security.credentials import ENV, load_credentials
from protocol.security.keys import KeyDirectory, load_signer
from protocol.security.kit import read_kit


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("creds") / "fleet"
    provision(out, ProvisionSpec(federation="lab", devices=("dev-1",)))
    return out


@pytest.fixture
def kit(fleet: Path) -> Path:
    return fleet / "devices" / "dev-1"


def write(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_nothing_given_is_anonymous_plain_tcp() -> None:
    creds = load_credentials(env={})
    assert creds.transport_options() == {"username": None, "password": None, "tls": None}
    assert creds.describe() == "no credentials (anonymous, plain TCP)"


def test_a_kit_gives_tls_files_and_signing_keys(kit: Path) -> None:
    creds = load_credentials(kit=kit, env={})
    tls = creds.transport_options()["tls"]
    assert (tls.ca_certs, tls.certfile, tls.keyfile) == tuple(
        str((kit / f).resolve()) for f in ("ca.crt", "device.crt", "device.key")
    )
    assert creds.signing_key == (kit / "signing.key").resolve()
    assert creds.kit is not None and creds.kit.id == "dev-1" and creds.kit.federation == "lab"
    assert load_signer(creds.signing_key, "dev-1").key_id == "dev-1"


def test_environment_beats_file_beats_kit(kit: Path, tmp_path: Path) -> None:
    # Prepare: the kit gives every path; the file a user, password and another CA
    other_ca = write(tmp_path / "other-ca.crt", "not parsed here", 0o644)
    env_ca = write(tmp_path / "env-ca.crt", "not parsed here", 0o644)
    creds_file = write(
        tmp_path / "creds.toml",
        '[mqtt]\nusername = "file-user"\npassword = "file-secret"\n[tls]\nca = "other-ca.crt"\n',
    )
    # Execute / Assert: file over kit
    creds = load_credentials(kit=kit, credentials_file=creds_file, env={})
    assert (creds.username, creds.password, creds.ca) == ("file-user", "file-secret", other_ca)
    assert creds.cert == (kit / "device.crt").resolve()  # the file left it to the kit
    # environment over file, value by value; kit and file may come from variables too
    env = {
        ENV["kit"]: str(kit),
        ENV["credentials"]: str(creds_file),
        ENV["password"]: "env-secret",
        ENV["ca"]: str(env_ca),
    }
    creds = load_credentials(env=env)
    assert (creds.username, creds.password, creds.ca) == ("file-user", "env-secret", env_ca)
    assert creds.sources["password"] == ENV["password"]
    assert creds.sources["username"] == f"{ENV['credentials']} {creds_file}"
    assert creds.sources["cert"] == f"kit {kit.resolve()}"


def test_flags_name_the_kit_and_file_before_the_variables(kit: Path, tmp_path: Path) -> None:
    env = {ENV["kit"]: str(tmp_path / "missing-kit")}
    assert load_credentials(kit=kit, env=env).kit is not None  # --kit wins: the variable unused


def test_secrets_never_show(tmp_path: Path) -> None:
    creds = load_credentials(env={ENV["username"]: "u", ENV["password"]: "hunter2-secret"})
    assert "hunter2-secret" not in repr(creds) and "hunter2-secret" not in creds.describe()
    assert creds.transport_options()["password"] == "hunter2-secret"


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"kit": "nokit"}, r"--kit .*nokit: no such kit directory"),
        ({"env": {ENV["kit"]: "nokit"}}, rf"{ENV['kit']} .*nokit: no such kit directory"),
        (
            {"credentials_file": "none.toml"},
            r"--credentials .*none\.toml: no such credentials file",
        ),
        ({"env": {ENV["ca"]: "gone.crt"}}, rf"{ENV['ca']}: .*gone\.crt does not exist"),
        ({"env": {ENV["credentials"]: "c.toml"}}, rf"{ENV['credentials']} .*c\.toml: no such"),
    ],
)
def test_a_named_file_that_is_missing_is_a_precise_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: dict, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        load_credentials(**{"env": {}, **given})


def test_broken_kits_and_files_are_refused(kit: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"not a kit \(no kit\.json"):
        read_kit(tmp_path)
    broken = tmp_path / "kit"
    broken.mkdir()
    (broken / "kit.json").write_text((kit / "kit.json").read_text())
    with pytest.raises(ConfigError, match=r"kit\.json ca: .*ca\.crt does not exist"):
        read_kit(broken)
    bad = write(tmp_path / "bad.toml", '[mqtt]\nuser = "x"\n')
    with pytest.raises(ConfigError, match=r"unknown section or key in \[mqtt\]"):
        load_credentials(credentials_file=bad, env={})
    half = write(tmp_path / "half.toml", '[tls]\nca = "bad.toml"\ncert = "bad.toml"\n')
    with pytest.raises(ConfigError, match="certificate without a key"):
        load_credentials(credentials_file=half, env={})
    with pytest.raises(ConfigError, match="expected an Ed25519 key"):
        load_signer(kit / "device.key", "dev-1")  # the TLS key (EC) is no signing key


def test_a_password_file_others_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loose = write(tmp_path / "c.toml", '[mqtt]\npassword = "p"\n', 0o644)
    with caplog.at_level(logging.WARNING, logger="edgefl.credentials"):
        load_credentials(credentials_file=loose, env={})
    assert "readable by other users (mode 644): chmod 600 it" in caplog.text


def test_the_verify_keys_follow_their_directory_while_the_run_goes_on(tmp_path: Path) -> None:
    """A device added (`provision add`) is verified and a revoked one refused without a
    restart; a key file caught half-written keeps the previous keys."""
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from coordinator.ops import pki
    from protocol.contract.codec import Envelope, encode
    from protocol.contract.messages import Status
    from protocol.security.signing import SignatureError, Verifier

    # Prepare: a directory with one device key, a verifier that checks it on every lookup
    keys = tmp_path / "verify"
    keys.mkdir()
    signers = {}
    for device in ("dev-a", "dev-b"):
        private = ed25519.Ed25519PrivateKey.generate()
        (tmp_path / f"{device}.key").write_bytes(pki.pem_private(private))
        signers[device] = load_signer(tmp_path / f"{device}.key", device)
        (tmp_path / f"{device}.pub").write_bytes(pki.pem_public(private.public_key()))
    (keys / "dev-a.pub").write_bytes((tmp_path / "dev-a.pub").read_bytes())
    directory = KeyDirectory(keys, interval=0.0)
    verifier = Verifier(directory)

    def frame(device: str) -> bytes:
        env = Envelope(body=Status(state="online"), sender=device, federation="lab")
        return signers[device].sign(encode(env))

    assert verifier.verify(frame("dev-a")).sender == "dev-a"
    with pytest.raises(SignatureError):
        verifier.verify(frame("dev-b"))
    # Execute + Assert: dev-b provisioned, then dev-a revoked
    (keys / "dev-b.pub").write_bytes((tmp_path / "dev-b.pub").read_bytes())
    assert verifier.verify(frame("dev-b")).sender == "dev-b"
    (keys / "dev-a.pub").unlink()
    with pytest.raises(SignatureError):
        verifier.verify(frame("dev-a"))
    # a file being written (not yet a key) keeps the keys held; the failed reload is tried
    # again at the next check, which finds it complete
    (keys / "dev-c.pub").write_bytes(b"-----BEGIN PUBLIC")
    assert sorted(directory) == ["dev-b"]
    (keys / "dev-c.pub").write_bytes((tmp_path / "dev-a.pub").read_bytes())
    assert sorted(directory) == ["dev-b", "dev-c"]
