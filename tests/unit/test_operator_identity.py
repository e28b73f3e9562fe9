"""The operator names itself without the password database: in a container whose user
has no passwd entry (the image's 65532, or any runAsUser) it still starts."""

from __future__ import annotations

import pwd
from typing import NoReturn

import pytest
from kopf._core.engines.peering import detect_own_id

from pdserve.operator.identity import own_identity

NAMES = ("LOGNAME", "USER", "LNAME", "USERNAME", "POD_ID", "POD_NAME")


@pytest.fixture(autouse=True)
def user_without_passwd_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a container's numeric user sees: no name in the environment, none in
    /etc/passwd (getpwuid raises KeyError)."""

    def missing(uid: int) -> NoReturn:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", missing)


def test_kopf_alone_cannot_name_such_a_user() -> None:
    with pytest.raises((KeyError, OSError)):
        detect_own_id(manual=False)


def test_the_operator_takes_its_pods_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "pdserve-operator-7d9f-abcde")
    assert own_identity() == "pdserve-operator-7d9f-abcde"


def test_outside_a_pod_the_operator_names_its_host() -> None:
    assert own_identity().startswith("pdserve-operator@")
