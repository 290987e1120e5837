"""amqtt plugins that give the embedded broker a provisioned fleet's rules.

Loaded by dotted path from :class:`coordinator.broker.embedded.EmbeddedBroker` when it runs on a
broker
directory of ``coordinator provision``. The TLS handshake already demands a certificate of the
fleet's CA that the CRL does not revoke (:func:`mutual_tls_context`); the plugins then do what
Mosquitto's ``use_identity_as_username`` and ``acl_file`` do:

* :class:`CertificateIdentityAuth`: a client without a verified certificate, or with one the
  CRL on disk revokes now (:class:`Revocations`), is refused; its username becomes the
  certificate's CN (whatever the CONNECT packet claimed); a client id first used by another
  certificate is refused (no device can take over, and cut, another's session); a last will
  on a topic that user may not publish to is refused at connect (amqtt publishes wills
  without asking the topic plugins).
* :class:`FleetAclTopics`: every subscribe, publish and delivery is checked against the
  ``acl`` file (:class:`coordinator.broker.acl.Acl`).

This module imports amqtt: import it only where the embedded broker runs.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session
from cryptography import x509
from cryptography.x509.oid import NameOID

from coordinator.broker.acl import Acl

__all__ = [
    "CertificateIdentityAuth",
    "FleetAclTopics",
    "Revocations",
    "certificate_cn",
    "mutual_tls_context",
    "peer_certificate",
]


def mutual_tls_context(cafile: str, certfile: str, keyfile: str, crlfile: str) -> ssl.SSLContext:
    """A server context that requires a client certificate of the CA, checked against the CRL."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cafile)
    ctx.load_cert_chain(certfile, keyfile)
    ctx.load_verify_locations(crlfile)  # a PEM CRL file is accepted here
    ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    ctx.verify_mode = ssl.CERT_REQUIRED  # amqtt's own context only asks (CERT_OPTIONAL)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def peer_certificate(session: Session) -> x509.Certificate | None:
    """The client's verified certificate, or None without one."""
    tls = session.ssl_object
    der = tls.getpeercert(binary_form=True) if tls is not None else None
    return x509.load_der_x509_certificate(der) if der else None


def certificate_cn(cert: x509.Certificate) -> str | None:
    """The certificate's common name, or None without a non-empty one."""
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = names[0].value if names else None
    return value if isinstance(value, str) and value else None


class Revocations:
    """The serial numbers a CRL file revokes, read again whenever the file changes, so that
    ``coordinator provision revoke`` takes effect at the next connection without a restart
    (the TLS context read the CRL only when the listener started)."""

    def __init__(self, path: Path, log: logging.Logger) -> None:
        self.path = path
        self.log = log
        self._stamp: tuple[int, int] | None = None
        self._serials: frozenset[int] = frozenset()

    def revoked(self, serial: int) -> bool:
        """Whether ``serial`` is revoked by the CRL as it is on disk now."""
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                crl = x509.load_pem_x509_crl(self.path.read_bytes())
                self._serials = frozenset(entry.serial_number for entry in crl)
                self._stamp = stamp
        except (OSError, ValueError) as exc:  # being rewritten: keep the last good list
            self.log.error("CRL %s unreadable, keeping the previous one: %s", self.path, exc)
        return serial in self._serials


class CertificateIdentityAuth(BaseAuthPlugin):  # type: ignore[misc]  # amqtt is untyped
    """Username = certificate CN; no certificate, a revoked one, or a will the ACL forbids:
    refused."""

    @dataclass
    class Config:
        acl_file: str = ""
        crl_file: str = ""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.acl = Acl.read(Path(self.config.acl_file))
        self.revocations = Revocations(Path(self.config.crl_file), self.context.logger)
        self.owners: dict[str, str] = {}  # client id -> the CN that first used it

    async def authenticate(self, *, session: Session) -> bool | None:
        cert = peer_certificate(session)
        cn = certificate_cn(cert) if cert is not None else None
        log = self.context.logger
        if cert is None or cn is None:
            log.warning("refused %s: no verified client certificate", session.client_id)
            return False
        if self.revocations.revoked(cert.serial_number):
            log.warning("refused %s: certificate %x is revoked", cn, cert.serial_number)
            return False
        owner = self.owners.setdefault(session.client_id, cn)
        if owner != cn:  # taking over another device's session (and cutting its connection)
            log.warning("refused %s: client id %r belongs to %s", cn, session.client_id, owner)
            return False
        session.username = cn  # use_identity_as_username: the CONNECT's name counts for nothing
        will = session.will_topic if session.will_flag else None
        if will is not None and not self.acl.allows(cn, "write", will):
            log.warning("refused %s: last will on %s is not %s's to publish", cn, will, cn)
            return False
        return True


class FleetAclTopics(BaseTopicPlugin):  # type: ignore[misc]  # amqtt is untyped
    """Subscribe = read (the filter must be covered), publish = write, delivery = read."""

    @dataclass
    class Config:
        acl_file: str = ""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.acl = Acl.read(Path(self.config.acl_file))

    async def topic_filtering(
        self, *, session: Session | None = None, topic: str | None = None, action: Any = None
    ) -> bool | None:
        user = session.username if session is not None else None
        if not user or not topic:
            return False
        if action == Action.PUBLISH:
            return self.acl.allows(user, "write", topic)
        return self.acl.allows(user, "read", topic, is_filter=action == Action.SUBSCRIBE)
