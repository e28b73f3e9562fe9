"""The pool's trusted internal path, piece by piece: worker URLs, the prefill peer
allow-list (literal addresses and names that resolve), credentials (on the internal
endpoints, and on a pool worker's client endpoints) and client keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from aiohttp.typedefs import Middleware

from pdserve.base.credentials import write_new_credential
from pdserve.protocol.api_errors import APIError
from pdserve.protocol.internal import (
    CredentialError,
    InternalAuth,
    PrefillAllowList,
    parse_worker_url,
    read_credential,
)
from pdserve.workers.router import auth
from pdserve.workers.router.auth import ApiKeyError, ApiKeys, read_keys


@pytest.mark.parametrize(
    "url",
    [
        "http://user:secret@10.0.0.1:8000",
        "http://10.0.0.1:8000/pd/prefill",
        "http://10.0.0.1:8000?x=1",
        "file:///etc/passwd",
        "http://:8000",
        "http://10.0.0.1:99999",
    ],
)
def test_only_plain_worker_urls_parse(url: str) -> None:
    with pytest.raises(ValueError, match="not a worker URL"):
        parse_worker_url(url)


def test_worker_urls_are_normalised() -> None:
    assert parse_worker_url("http://10.0.0.1:8000/").url == "http://10.0.0.1:8000"
    assert parse_worker_url("http://[fd00::1]:8000").url == "http://[fd00::1]:8000"
    assert parse_worker_url("http://Worker.local").url == "http://worker.local:80"


def admit(allow: PrefillAllowList, url: str) -> str | int:
    try:
        return asyncio.run(allow.admit(url))
    except APIError as refused:
        return refused.status


def test_a_prefill_url_must_name_one_of_the_pools_prefill_workers() -> None:
    allow = PrefillAllowList(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    assert admit(allow, "http://127.0.0.1:8002/") == "http://127.0.0.1:8002"
    assert admit(allow, "http://127.0.0.1:8003") == 403  # another port of the same host
    assert admit(allow, "https://127.0.0.1:8001") == 403
    assert admit(allow, "http://169.254.169.254:8001") == 403
    assert admit(allow, "http://127.0.0.1:8001/../admin") == 403
    assert admit(PrefillAllowList([]), "http://127.0.0.1:8001") == 403


def test_a_peer_named_by_dns_stands_for_the_addresses_it_resolves_to() -> None:
    # As a headless Service's name stands for its ready pods.
    allow = PrefillAllowList(["http://localhost:8001"])
    assert admit(allow, "http://127.0.0.1:8001") == "http://127.0.0.1:8001"
    assert admit(allow, "http://127.0.0.2:8001") == 403
    assert admit(allow, "http://127.0.0.1:8002") == 403


def test_credentials_are_checked_in_constant_time_and_files_validated(tmp_path: Path) -> None:
    credential = write_new_credential(tmp_path / "credential")
    assert (tmp_path / "credential").stat().st_mode & 0o777 == 0o600
    assert read_credential(tmp_path / "credential") == credential
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(CredentialError, match="at least 16"):
        read_credential(tmp_path / "short")
    auth = InternalAuth(credential)

    def request(header: str | None) -> object:
        headers = {"Authorization": header} if header else {}
        return make_mocked_request("POST", "/pd/prefill", headers=headers)

    assert auth.holds(request(f"Bearer {credential}"))  # type: ignore[arg-type]
    assert not auth.holds(request(f"Bearer {credential}x"))  # type: ignore[arg-type]
    assert not auth.holds(request(None))  # type: ignore[arg-type]
    with pytest.raises(APIError) as refused:
        auth.require(request("Bearer nope"), "/pd/prefill")  # type: ignore[arg-type]
    assert refused.value.status == 401
    with pytest.raises(APIError) as refused:
        InternalAuth(None).require(request(f"Bearer {credential}"), "x")  # type: ignore[arg-type]
    assert refused.value.status == 403  # a worker without a credential trusts nobody


def status_through(guard: Middleware, path: str, token: str | None = None) -> int:
    """The status a request gets through `guard` (200: it reached the handler)."""

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def through() -> web.StreamResponse:
        return await guard(make_mocked_request("POST", path, headers=headers), handler)

    try:
        answer = asyncio.run(through())
    except APIError as refused:
        return refused.status
    return answer.status


CLIENT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize")
OPEN_PATHS = ("/health", "/ready", "/load", "/metrics", "/openapi.json")


def test_a_pool_worker_serves_its_client_endpoints_to_the_router_only(tmp_path: Path) -> None:
    credential = write_new_credential(tmp_path / "credential")
    guard = InternalAuth(credential).middleware()
    for path in CLIENT_PATHS:
        assert status_through(guard, path) == 401, path
        assert status_through(guard, path, "x" * 43) == 401, path
        assert status_through(guard, path, credential) == 200, path
    for path in OPEN_PATHS:  # probes, the router's load poll, Prometheus
        assert status_through(guard, path) == 200, path
    # A pool that allows direct clients: its workers' client endpoints are open, the
    # internal ones are not.
    opened = InternalAuth(credential, allow_direct_clients=True).middleware()
    for path in CLIENT_PATHS:
        assert status_through(opened, path) == 200, path
    assert status_through(opened, "/pd/prefill") == 401
    # A worker alone (no credential, not in a pool) serves anyone.
    alone = InternalAuth(None).middleware()
    assert [status_through(alone, path) for path in CLIENT_PATHS] == [200] * len(CLIENT_PATHS)
    assert status_through(alone, "/pd/prefill") == 403


def test_client_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# clients\nkey-one\n\n  key-two  \n")
    assert read_keys(path) == ("key-one", "key-two")
    keys = ApiKeys(path)
    keys.check(
        make_mocked_request("GET", "/v1/models", headers={"Authorization": "Bearer key-two"})
    )
    for headers in ({}, {"Authorization": "Bearer key-three"}, {"Authorization": "key-one"}):
        with pytest.raises(APIError) as refused:
            keys.check(make_mocked_request("GET", "/v1/models", headers=headers))
        assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
    with pytest.raises(ApiKeyError, match="cannot read API keys"):
        ApiKeys(tmp_path / "missing")


def test_the_key_file_says_which_keys_are_valid_whenever_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(auth, "CHECK_INTERVAL_S", 0.0)  # re-read at every request
    path = tmp_path / "keys"
    path.write_text("key-one\n")
    guard = ApiKeys(path).middleware()
    assert status_through(guard, "/v1/completions", "key-one") == 200
    # Emptied: no key is valid (the old ones are not kept in force). Each write
    # changes the file's size: the re-read does not hang on the clock's resolution.
    path.write_text("# revoked\n")
    assert status_through(guard, "/v1/completions", "key-one") == 401
    path.write_text("key-two\n")
    assert status_through(guard, "/v1/completions", "key-two") == 200
    assert status_through(guard, "/v1/completions", "key-one") == 401
    # Gone: none either, until it is back.
    path.unlink()
    assert status_through(guard, "/v1/completions", "key-two") == 401
    path.write_text("key-two\nkey-three\n")
    assert status_through(guard, "/v1/completions", "key-three") == 200
    # An empty file at start-up: every request is refused, none served.
    path.write_text("")
    empty = ApiKeys(path).middleware()
    assert status_through(empty, "/v1/completions") == 401
    assert status_through(empty, "/v1/completions", "") == 401


def test_workers_needs_a_key_the_probes_and_metrics_do_not(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("key-one\n")
    guard = ApiKeys(path).middleware()
    # /workers names the workers' internal addresses.
    for path_ in (*CLIENT_PATHS, "/workers"):
        assert status_through(guard, path_) == 401, path_
        assert status_through(guard, path_, "key-one") == 200, path_
    # Kubelet probes and Prometheus ask no key (as in vLLM); /metrics names no worker.
    for path_ in ("/health", "/ready", "/metrics"):
        assert status_through(guard, path_) == 200, path_
