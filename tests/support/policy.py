"""Which pods a NetworkPolicy's rules name, as the API server selects them: each peer's
namespace and pod selectors are asked of the real API server (label selectors
evaluated by it, not here), so a test sees the peers an enforcer would."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from support.operator import Cluster, get_json

Pod = tuple[str, str]  # (namespace, name)

_OPERATORS = {"In": "in", "NotIn": "notin"}


def selector_flags(selector: Mapping[str, Any]) -> list[str]:
    """kubectl's `-l` for a LabelSelector ([] for the empty one, which selects all)."""
    terms = [f"{key}={value}" for key, value in (selector.get("matchLabels") or {}).items()]
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        if operator in _OPERATORS:
            terms.append(f"{key} {_OPERATORS[operator]} ({','.join(expression['values'])})")
        else:
            terms.append(key if operator == "Exists" else f"!{key}")
    return ["-l", ",".join(terms)] if terms else []


def peer_pods(cluster: Cluster, peer: Mapping[str, Any], namespace: str) -> set[Pod]:
    """The pods one peer of a rule names (`namespace`: the policy's)."""
    assert "ipBlock" not in peer, f"an ipBlock peer names addresses, not pods: {peer}"
    namespaces = [namespace]
    if "namespaceSelector" in peer:
        found = get_json(cluster, "namespaces", *selector_flags(peer["namespaceSelector"]))
        namespaces = [item["metadata"]["name"] for item in found["items"]]
    pods: set[Pod] = set()
    for name in namespaces:
        selector = selector_flags(peer.get("podSelector") or {})
        listed = get_json(cluster, "pods", "-n", name, *selector)
        pods |= {(name, item["metadata"]["name"]) for item in listed["items"]}
    return pods


def rule_pods(
    cluster: Cluster, policy: Mapping[str, Any], direction: str, port: str | int
) -> set[Pod]:
    """The pods the policy's `direction` (ingress or egress) rules admit on `port`."""
    namespace = policy["metadata"]["namespace"]
    side = "from" if direction == "ingress" else "to"
    pods: set[Pod] = set()
    for rule in policy["spec"].get(direction) or []:
        ports: Sequence[Mapping[str, Any]] = rule.get("ports") or []
        if ports and not any(p.get("port") == port for p in ports):
            continue
        assert side in rule, f"a {direction} rule without peers admits everything: {rule}"
        for peer in rule[side]:
            pods |= peer_pods(cluster, peer, namespace)
    return pods


def selected_pods(cluster: Cluster, policy: Mapping[str, Any]) -> set[Pod]:
    """The pods the policy applies to."""
    return peer_pods(cluster, {"podSelector": policy["spec"]["podSelector"]},
                     policy["metadata"]["namespace"])  # fmt: skip
