"""TLS material of the scheduler: the public port's server credentials and the
client credentials of the channels to the workers (mutual TLS), and the
shared worker token sent on every worker call (when mutual TLS is off).

The files are read once, when the service starts; a certificate rotated on
disk takes effect at the next start (a rolling restart on Kubernetes).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import structlog

from common.worker_token import TokenFileError, read_token
from scheduler_service.config import SecurityConfig

logger = structlog.get_logger(__name__)


class TlsConfigError(RuntimeError):
    """A TLS file is missing, unreadable or empty."""


def read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsConfigError(f"cannot read the {what} {path}: {e.strerror or e}") from e
    if not data.strip():
        raise TlsConfigError(f"the {what} {path} is empty")
    return data


def public_server_credentials(config: SecurityConfig) -> grpc.ServerCredentials | None:
    """The public port's TLS credentials, or None to serve plaintext."""
    if not config.tls_cert:
        return None
    key = read_pem(config.tls_key or "", "TLS key (--tls-key)")
    cert = read_pem(config.tls_cert, "TLS certificate (--tls-cert)")
    return grpc.ssl_server_credentials([(key, cert)])


def worker_channel_credentials(
    config: SecurityConfig,
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """Credentials and extra channel options for the worker channels; (None, [])
    for plaintext. The scheduler presents its own certificate (mutual TLS) and
    trusts only workers whose certificate the given CA signed."""
    if not config.worker_tls_ca:
        return None, []
    creds = grpc.ssl_channel_credentials(
        root_certificates=read_pem(config.worker_tls_ca, "worker CA (--worker-tls-ca)"),
        private_key=read_pem(config.worker_tls_key or "", "worker TLS key (--worker-tls-key)"),
        certificate_chain=read_pem(
            config.worker_tls_cert or "", "worker TLS certificate (--worker-tls-cert)"
        ),
    )
    options = []
    if config.worker_tls_server_name:
        # Worker pods' DNS names vary; one certificate with a fixed name serves them all.
        options.append(("grpc.ssl_target_name_override", config.worker_tls_server_name))
    return creds, options


def worker_token(config: SecurityConfig) -> str | None:
    """The shared worker token (--worker-token-file), or None."""
    if not config.worker_token_file:
        return None
    try:
        return read_token(config.worker_token_file)
    except TokenFileError as e:
        raise TlsConfigError(str(e)) from e
