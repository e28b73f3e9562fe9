"""The ServingPool CustomResourceDefinition, generated from the models in api.py.

Pydantic writes JSON Schema (draft 2020-12); the API server wants a structural
OpenAPI v3 schema. The translation inlines `$ref`s, drops titles, turns
`X | None` into an optional X, rewrites numeric exclusive bounds, keeps defaults
(a nested object's default becomes `{}`: the API server fills in the nested
defaults itself) and keeps the CEL rules and Kubernetes extensions as they are.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from pdserve.operator import api

HEADER = "# Generated from operator/api.py by `pdserve crd`: do not edit.\n"

Schema = dict[str, Any]

PRINTER_COLUMNS: tuple[Schema, ...] = (
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {
        "name": "Prefill",
        "type": "string",
        "jsonPath": ".status.prefill.summary",
        "description": "Ready/desired prefill workers",
    },
    {
        "name": "Decode",
        "type": "string",
        "jsonPath": ".status.decode.summary",
        "description": "Ready/desired decode workers",
    },
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "Rollout",
        "type": "string",
        "jsonPath": ".status.rollout.phase",
        "description": "The most pressing of the roles' rollouts",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Endpoint",
        "type": "string",
        "jsonPath": ".status.routerEndpoint",
        "priority": 1,
    },
)


def openapi_schema(model: type[BaseModel], *, defaults: bool = True) -> Schema:
    """The structural OpenAPI v3 schema of a model (defaults kept or dropped)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    definitions = raw.pop("$defs", {})
    return _convert(raw, definitions, defaults)


def _convert(node: Schema, definitions: Schema, defaults: bool) -> Schema:
    node = _resolve(node, definitions)
    out: Schema = {}
    for key, value in node.items():
        # Titles are noise; `additionalProperties: false` (extra="forbid") and
        # propertyNames are not allowed in a structural schema: the API server prunes
        # unknown fields instead.
        if key in ("title", "propertyNames") or (key == "additionalProperties" and not value):
            continue
        if key == "properties":
            out[key] = {k: _convert(v, definitions, defaults) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _convert(value, definitions, defaults)
        elif key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            # JSON Schema's numeric exclusive bound -> OpenAPI 3.0's flag on min/max.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    _fix_default(out, definitions, defaults)
    return dict(sorted(out.items()))


def _resolve(node: Schema, definitions: Schema) -> Schema:
    """Inline a $ref and collapse `X | None` (siblings such as description win)."""
    if node.get("x-kubernetes-int-or-string"):
        return node
    if "$ref" in node:
        target = definitions[node["$ref"].rsplit("/", 1)[-1]]
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return _resolve({**target, **siblings}, definitions)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o != {"type": "null"}]
        if len(options) != 1:
            raise ValueError(f"unions other than `X | None` have no structural schema: {node}")
        siblings = {k: v for k, v in node.items() if k != "anyOf"}
        return _resolve({**_resolve(options[0], definitions), **siblings}, definitions)
    return node


def _fix_default(node: Schema, definitions: Schema, defaults: bool) -> None:
    if "default" not in node:
        return
    value = node["default"]
    empty = value is None or value == [] or (value == {} and "properties" not in node)
    if not defaults or empty:
        del node["default"]
    elif not isinstance(value, dict) or "properties" not in node:
        node["default"] = _drop_empty(value)  # a null is "unset", never a valid value
    else:
        # A nested model's default equals its fields' defaults: say `{}` and let the
        # API server fill them in, unless the default differs from them.
        if _drop_empty(value) == _drop_empty(_apply_defaults(node, {})):
            node["default"] = {}


def _drop_empty(value: Any) -> Any:
    """A value without nulls, empty lists and empty maps (which all mean "unset")."""
    if isinstance(value, dict):
        pairs = ((k, _drop_empty(v)) for k, v in value.items())
        return {k: v for k, v in pairs if v not in (None, [], {})}
    if isinstance(value, list):
        return [_drop_empty(v) for v in value]
    return value


def _apply_defaults(node: Schema, value: dict[str, Any]) -> dict[str, Any]:
    """What the API server's defaulting makes of `value` (objects only)."""
    result = dict(value)
    for name, prop in node.get("properties", {}).items():
        if name not in result and "default" in prop:
            result[name] = prop["default"]
        if isinstance(result.get(name), dict) and "properties" in prop:
            result[name] = _apply_defaults(prop, result[name])
    return result


def root_schema() -> Schema:
    """The schema of a whole ServingPool object."""
    spec = openapi_schema(api.ServingPoolSpec)
    spec["description"] = "Desired state: the model, its workers, routing and targets."
    status = openapi_schema(api.ServingPoolStatus, defaults=False)
    return {
        "description": "A model served by prefill and decode workers behind a router.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
        "type": "object",
        **api.cel(api.NAME_RULE),
    }


def crd() -> Schema:
    """The CustomResourceDefinition as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{api.PLURAL}.{api.GROUP}",
            "labels": {"app.kubernetes.io/name": "pdserve"},
        },
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["pdserve"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    # No scale subresource: a pool scales two roles, not one number.
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": list(PRINTER_COLUMNS),
                    "schema": {"openAPIV3Schema": root_schema()},
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Writes repeated sub-schemas in full (no YAML anchors), as kubectl users expect."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    """The CRD as the YAML checked in at charts/pdserve/crds/servingpool.yaml."""
    body = yaml.dump(crd(), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)
    return HEADER + body
