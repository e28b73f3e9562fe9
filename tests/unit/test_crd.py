"""The generated CRD: up to date, structural, and in agreement with the models."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.operator import api, crd
from pdserve.operator import cli as operator_cli

ROOT = Path(__file__).resolve().parents[2]
# The one checked-in copy: Helm installs it (crds/) and deploy/ includes it.
CHECKED_IN = ROOT / "charts" / "pdserve" / "crds" / "servingpool.yaml"
EXAMPLES = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))

Schema = dict[str, Any]


def version() -> Schema:
    versions: list[Schema] = crd.crd()["spec"]["versions"]
    assert len(versions) == 1
    return versions[0]


def schema() -> Schema:
    root: Schema = version()["schema"]["openAPIV3Schema"]
    return root


def walk(node: Schema, path: str = "") -> Iterator[tuple[str, Schema]]:
    """Every schema node with its path (properties, items, map values)."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_checked_in_crd_is_up_to_date() -> None:
    assert CHECKED_IN.read_text() == crd.crd_yaml(), "run `make crd`"
    copies = [p for p in ROOT.glob("**/servingpool.yaml") if ".venv" not in p.parts]
    assert copies == [CHECKED_IN]


def test_crd_command_writes_the_same_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    operator_cli.register(parser.add_subparsers())
    target = tmp_path / "crd.yaml"
    args = parser.parse_args(["crd", "-o", str(target)])
    assert args.handler(args) == 0
    assert target.read_text() == CHECKED_IN.read_text()
    args = parser.parse_args(["crd"])
    assert args.handler(args) == 0
    assert capsys.readouterr().out == CHECKED_IN.read_text()


def test_names_and_subresources() -> None:
    spec = crd.crd()["spec"]
    assert crd.crd()["metadata"]["name"] == "servingpools.pdserve.dev"
    assert spec["group"] == "pdserve.dev"
    assert spec["names"]["kind"] == "ServingPool"
    assert spec["names"]["plural"] == "servingpools"
    assert spec["names"]["shortNames"] == ["sp"]
    assert spec["scope"] == "Namespaced"
    assert version()["name"] == "v1alpha1"
    assert version()["subresources"] == {"status": {}}  # and no scale: two roles


def test_printer_columns() -> None:
    columns = {c["name"]: c["jsonPath"] for c in version()["additionalPrinterColumns"]}
    assert columns["Model"] == ".spec.model.name"
    assert columns["Prefill"] == ".status.prefill.summary"
    assert columns["Decode"] == ".status.decode.summary"
    assert columns["Phase"] == ".status.phase"
    assert columns["Age"] == ".metadata.creationTimestamp"
    # Every column points at a field the schema has (else kubectl shows nothing).
    for path in columns.values():
        if path.startswith(".metadata"):
            continue
        node = schema()
        for part in path.strip(".").split("."):
            node = node["properties"][part]


def test_schema_is_structural() -> None:
    for path, node in walk(schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not {"$ref", "$defs", "title", "const", "propertyNames"} & node.keys(), path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), path
        if node.get("type") == "object" and path != ".metadata":
            assert "properties" in node or "additionalProperties" in node, path
            assert not ("properties" in node and "additionalProperties" in node), path
        assert "x-kubernetes-preserve-unknown-fields" not in node, path


def test_cel_inputs_are_bounded() -> None:
    # Unbounded lists, maps and strings make the API server's CEL cost estimate explode.
    for path, node in walk(schema()):
        kind = node.get("type")
        if kind == "array":
            assert "maxItems" in node, path
        elif kind == "object" and "additionalProperties" in node:
            assert "maxProperties" in node, path
        elif kind == "string" and path.startswith(".spec") and "enum" not in node:
            assert "maxLength" in node, path


def test_exclusive_bounds_are_openapi_v3_flags() -> None:
    percentile = schema()["properties"]["spec"]["properties"]["slo"]["properties"]["ttft"]
    node = percentile["properties"]["percentile"]
    assert node["minimum"] == 0 and node["exclusiveMinimum"] is True
    assert node["maximum"] == 100 and node["default"] == 95.0


def test_quantities_are_int_or_string() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    requests = spec["decode"]["properties"]["resources"]["properties"]["requests"]
    value = requests["additionalProperties"]
    assert value["x-kubernetes-int-or-string"] is True
    assert value["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert value["pattern"] == api.QUANTITY_PATTERN


def test_every_rule_carries_a_message_from_the_api() -> None:
    messages = {value.message for value in vars(api).values() if isinstance(value, api.Rule)}
    found = [
        rule for _, node in walk(schema()) for rule in node.get("x-kubernetes-validations", [])
    ]
    assert {rule["message"] for rule in found} == messages
    for rule in found:
        assert rule["rule"] and rule["message"]


def apply_defaults(node: Schema, value: Any) -> Any:
    """What the API server's structural defaulting does to `value`."""
    if isinstance(value, dict) and "properties" in node:
        out = dict(value)
        for name, prop in node["properties"].items():
            if name not in out and "default" in prop:
                out[name] = prop["default"]
        return {k: apply_defaults(node["properties"].get(k, {}), v) for k, v in out.items()}
    if isinstance(value, list) and "items" in node:
        return [apply_defaults(node["items"], v) for v in value]
    return value


def without_empty(value: Any) -> Any:
    if isinstance(value, dict):
        pairs = ((k, without_empty(v)) for k, v in value.items())
        return {k: v for k, v in pairs if v not in ([], {})}
    if isinstance(value, list):
        return [without_empty(v) for v in value]
    return value


MINIMAL = {"model": {"name": "m", "path": "/m"}, "image": "pdserve:1"}


@pytest.mark.parametrize(
    "spec",
    [MINIMAL, *(yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES)],
    ids=["minimal", *(p.stem for p in EXAMPLES)],
)
def test_schema_defaults_match_the_models(spec: dict[str, Any]) -> None:
    spec_schema = schema()["properties"]["spec"]
    defaulted = apply_defaults(spec_schema, spec)
    assert without_empty(defaulted) == without_empty(api.dump(api.parse_spec(spec)))


def test_nested_defaults_are_written_as_empty_objects() -> None:
    for path, node in walk(schema()["properties"]["spec"]):
        if node.get("type") == "object" and "default" in node:
            assert node["default"] == {}, path
