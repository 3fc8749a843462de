"""API key parsing and matching (scheduler_service/auth.py) and the security
flags' checks (scheduler_service/config.py)."""

from __future__ import annotations

import pytest

from scheduler_service.api.auth import ApiKeyFileError, key_matches, load_api_keys, presented_key
from scheduler_service.config import load_config


def test_key_file_skips_blanks_and_comments_and_strips(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ops keys\n\n  alpha  \nbeta\n#gamma\nalpha\n")
    digests = load_api_keys(str(path))
    assert len(digests) == 2  # alpha once, no comment
    assert key_matches("alpha", digests) and key_matches("beta", digests)
    for wrong in ("gamma", "#gamma", "alph", "alpha ", "", None):
        assert not key_matches(wrong, digests)


def test_an_empty_or_missing_key_file_is_an_error(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ApiKeyFileError, match="holds no key"):
        load_api_keys(str(empty))
    with pytest.raises(ApiKeyFileError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ((("authorization", "Bearer k1"),), "k1"),
        ((("authorization", "bearer   k1 "),), "k1"),
        ((("user-agent", "x"), ("authorization", "Bearer k2")), "k2"),
        ((("authorization", "k1"),), None),
        ((("authorization", "Basic k1"),), None),
        ((("authorization", "Bearer "),), None),
        ((), None),
        (None, None),
    ],
)
def test_presented_key(metadata, key):
    assert presented_key(metadata) == key


def test_security_flags_from_the_environment(tmp_path):
    cert, key, keys = (tmp_path / n for n in ("c.pem", "k.pem", "keys"))
    for f in (cert, key, keys):
        f.write_text("x")
    env = {
        "RADIXSERVE_TLS_CERT": str(cert),
        "RADIXSERVE_TLS_KEY": str(key),
        "RADIXSERVE_API_KEY_FILE": str(keys),
        "RADIXSERVE_WORKER_TLS_SERVER_NAME": "",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        cfg = load_config(["--worker", "grpc://127.0.0.1:1"])
    sec = cfg.security
    assert (sec.tls_cert, sec.tls_key, sec.api_key_file) == (str(cert), str(key), str(keys))
    assert sec.worker_tls_ca is None and sec.worker_tls_server_name is None


@pytest.mark.parametrize(
    "flags",
    [
        ["--tls-key", "KEY"],
        ["--worker-tls-cert", "KEY", "--worker-tls-key", "KEY"],
        ["--worker-tls-server-name", "w"],
        ["--api-key-file", "/nonexistent/keys"],
        ["--api-key-file", "."],  # a directory
    ],
)
def test_half_set_ups_and_unreadable_files_are_refused(tmp_path, flags, capsys):
    (tmp_path / "k.pem").write_text("x")
    flags = [str(tmp_path / "k.pem") if f == "KEY" else f for f in flags]
    with pytest.raises(SystemExit) as exit_:
        load_config(["--worker", "grpc://127.0.0.1:1", *flags])
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
