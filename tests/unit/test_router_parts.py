"""Parts of the router that need no worker: reading relayed SSE streams, goodput
against the pool's SLOs, a request's one outcome however it ends, EndpointSlices and
kubeconfigs, and what the router loads."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from pdserve.protocol import codec
from pdserve.protocol.api_errors import APIError
from pdserve.protocol.routing import KubernetesDiscovery, Slo
from pdserve.protocol.sse import choice_token_count
from pdserve.workers.router.kubernetes import (
    EndpointSliceSource,
    KubeAccess,
    KubeConfigError,
    load_access,
    ready_urls,
)
from pdserve.workers.router.metrics import RouterMetrics, meets_slo
from pdserve.workers.router.outcome import RequestOutcome, counted
from pdserve.workers.router.routed import Routed
from pdserve.workers.router.sse import TokenStream, error_event


def chunk(text: str, index: int = 0, **extra: Any) -> bytes:
    body = {"choices": [{"index": index, "text": text, "finish_reason": None, **extra}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def test_token_times_survive_events_split_across_reads() -> None:
    stream = (
        b"".join([chunk("a"), chunk("b", token_ids=[7, 8]), chunk(""), b": keep-alive\n\n"])
        + b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\ndata: [DONE]\n\n'
    )
    tokens = TokenStream()
    for index in range(0, len(stream), 7):  # reads that cut events anywhere
        tokens.feed(stream[index : index + 7], float(index))
    assert len(tokens.token_times) == 4  # one, two (token_ids), one (empty text), none
    assert tokens.done and tokens.error is None
    assert tokens.token_times == sorted(tokens.token_times)


def test_choices_are_streams_of_their_own() -> None:
    tokens = TokenStream()
    for step in range(3):  # n = 2: each step sends a chunk of each choice
        tokens.feed(chunk("a", index=0) + chunk("b", index=1), float(step))
    tokens.feed(chunk("c", index=1, token_ids=[4, 5]), 3.0)
    assert tokens.streams == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0, 3.0]]


def test_events_holding_python_s_nan_and_infinity_still_count() -> None:
    # Python's encoder writes a -inf log-probability as -Infinity, which strict JSON
    # parsers refuse: its token still counts.
    tokens = TokenStream()
    tokens.feed(chunk("a", logprobs={"token_logprobs": [float("-inf")]}), 1.0)
    tokens.feed(chunk("b", logprobs={"token_logprobs": [float("nan")]}), 2.0)
    assert b"-Infinity" in chunk("a", logprobs={"token_logprobs": [float("-inf")]})
    assert tokens.streams == [[1.0, 2.0]]


def test_an_echoed_prompt_is_no_generated_token() -> None:
    prompt = {"tokens": ["p", "q", "r"], "token_logprobs": [None, -1.0, -2.0]}
    first = {"tokens": ["p", "q", "r", "a"], "token_logprobs": [None, -1.0, -2.0, -0.5]}
    # With logprobs the first chunk lists the prompt's 3 tokens before the first
    # generated one; without, its text is the prompt and one token.
    listed = TokenStream(echo_tokens=3)
    listed.feed(chunk("pqra", logprobs=first) + chunk("b", logprobs={"tokens": ["b"]}), 1.0)
    assert listed.streams == [[1.0, 1.0]]
    plain = TokenStream(echo_tokens=3)
    plain.feed(chunk("pqra") + chunk("b"), 1.0)
    assert plain.streams == [[1.0, 1.0]]
    # max_tokens 0: the prompt scored, nothing generated.
    scored = TokenStream(echo_tokens=3, generates=False)
    scored.feed(chunk("pqr", logprobs=prompt, finish_reason="length"), 1.0)
    assert scored.streams == [] and scored.token_times == []


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_token_events_count_alike_in_any_layout(separators: tuple[str, str]) -> None:
    """Plain token events (read without parsing) and listing or finishing ones (parsed)
    count as the protocol's counting says, compact or spaced, text or chat."""
    delta = {"role": "assistant", "content": "hi"}
    choices = [
        ({"index": 0, "text": "a", "logprobs": None, "finish_reason": None}, 1),
        ({"index": 2, "delta": delta, "logprobs": None, "finish_reason": None}, 1),
        ({"index": 0, "text": "", "finish_reason": None}, 1),
        ({"index": 0, "text": "", "finish_reason": "stop"}, 0),
        ({"index": 0, "text": "ab", "token_ids": [1, 2], "finish_reason": None}, 2),
        ({"index": 0, "text": "[x]", "finish_reason": None}, 1),
        ({"index": 0, "text": "a", "logprobs": {"tokens": ["a", "b"]}, "finish_reason": None}, 2),
    ]
    for choice, count in choices:
        body = {"id": "c", "object": "text_completion", "choices": [choice]}
        event = b"data: " + json.dumps(body, separators=separators).encode() + b"\n\n"
        tokens = TokenStream()
        tokens.feed(event, 1.0)
        assert len(tokens.token_times) == count, choice
        assert list(tokens.choices) == [choice["index"]]
    two = {"choices": [{"index": 0, "text": "a", "finish_reason": None},
                       {"index": 1, "text": "b", "finish_reason": None}]}  # fmt: skip
    tokens = TokenStream()
    tokens.feed(b"data: " + json.dumps(two, separators=separators).encode() + b"\n\n", 1.0)
    assert tokens.streams == [[1.0], [1.0]]


def _parsed_counts(stream: bytes) -> tuple[dict[int, int], bool, bool]:
    """What a stream carries, every event parsed: tokens by choice, [DONE], an error."""
    counts: dict[int, int] = {}
    done = error = False
    for line in stream.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            continue
        try:
            event = codec.loads(payload)
        except ValueError:
            continue
        if isinstance(event, dict) and "error" in event:
            error = True
        elif isinstance(event, dict):
            for choice in event.get("choices") or ():
                index = choice.get("index", 0)
                counts[index] = counts.get(index, 0) + choice_token_count(choice)
    return counts, done, error


def _events(separators: tuple[str, str]) -> list[bytes]:
    def event(body: Any) -> bytes:
        return b"data: " + json.dumps(body, separators=separators).encode() + b"\n\n"

    def one(**choice: Any) -> bytes:
        return event({"id": "c", "object": "text_completion", "choices": [choice]})

    return [
        one(index=0, text="a", finish_reason=None),
        one(index=1, text="b", logprobs=None, finish_reason=None),
        one(index=0, delta={"content": "hi"}, finish_reason=None),
        one(index=0, text="", finish_reason=None),
        one(index=0, text="ab", token_ids=[1, 2], finish_reason=None),  # several tokens
        one(index=0, text="abc", logprobs={"tokens": ["a", "b", "c"]}, finish_reason=None),
        one(index=0, text="x", logprobs={"content": [{"token": "x"}]}, finish_reason=None),
        one(index=0, text='"choices": [] and "error"', finish_reason=None),
        one(index=2, text="[", finish_reason="length"),
        one(index=0, text="", finish_reason="stop"),
        event({"choices": [{"index": 0, "text": "a", "finish_reason": None},
                           {"index": 1, "text": "b", "finish_reason": None}]}),
        event({"choices": [], "usage": {"completion_tokens": 9}}),
        event({"choices": [], "usage": None, "extra": {"choices": [{"index": 0}]}}),
        event({"object": "x", "choices": [{"index": 0, "text": "y", "finish_reason": None}],
               "usage": {"completion_tokens": 1}}),
        one(index=0, text="]", finish_reason=None),  # a bracket in the text
        one(index=1, delta={"role": "assistant", "content": "x"}, finish_reason=None),
        b": a comment\n\n",
        # Lines ended by CRLF, or with white space around them.
        event({"choices": [{"index": 0, "text": "r", "finish_reason": None}]})[:-2] + b"\r\n\r\n",
        b"  " + one(index=1, text="s", finish_reason=None)[:-2] + b" \n \t\n",
        b"data: not json\n\n",
        event({"error": {"message": "failed mid-stream", "code": "worker_failed"}}),
        b"data: [DONE]\n\n",
    ]  # fmt: skip


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_reading_the_bytes_counts_as_parsing_every_event(separators: tuple[str, str]) -> None:
    """Token events read without parsing them count exactly as parsing each event
    would: multi-token events, usage and error events, cut by reads anywhere."""
    events = _events(separators)
    for start in range(len(events)):
        stream = b"".join(events[start:] + events[:start])
        counts, done, error = _parsed_counts(stream)
        for step in (1, 5, 64, len(stream)):
            tokens = TokenStream()
            for at in range(0, len(stream), step):
                tokens.feed(stream[at : at + step], 0.0)
            assert {i: len(t) for i, t in tokens.choices.items() if t} == {
                i: n for i, n in counts.items() if n
            }, (start, step)
            assert (tokens.done, tokens.error is not None) == (done, error)


def test_a_read_of_whole_events_counts_as_reading_it_line_by_line() -> None:
    """A read that is whole `data:` events (parsed without a loop over its lines) counts
    as the same bytes fed a byte at a time: payloads that are no JSON object alone,
    [DONE] amid events, NaN, stray white space and other lines among them."""
    whole = [
        chunk("a"),
        chunk("b", token_ids=[1, 2]),
        chunk("c", index=1),
        chunk("d", logprobs={"token_logprobs": [float("-inf")]}),
        chunk("", finish_reason="stop"),
        b"data: 1,2\n\n",
        b'data: {"choices": [{"index": 0, "text": "q"}]},[2\n\n',
        b"data: 3]\n\n",
        b"data: [DONE]\n\n",
        b'data:  {"choices": [{"index": 0, "text": "w"}]} \n\n',
        b'data: {"choices": [{"index": 0, "text": "v"}]}\x0c\n\n',
        b'data: {"error": {"message": "failed"}}\n\n',
        b": a comment\n\n",
        b'data: {"choices": [{"index": 0,\n"text": "m"}]}\n\n',  # JSON only across lines
        b"data: \n\n",
    ]
    for first in range(len(whole)):
        for size in (1, 2, 3, 5):
            read = b"".join(whole[first : first + size])
            at_once, byte_by_byte = TokenStream(), TokenStream()
            at_once.feed(read, 1.0)
            for at in range(len(read)):
                byte_by_byte.feed(read[at : at + 1], 1.0)
            assert at_once.choices == byte_by_byte.choices, read
            assert (at_once.done, at_once.error) == (byte_by_byte.done, byte_by_byte.error)


def test_a_stream_ended_by_an_error_event() -> None:
    tokens = TokenStream()
    tokens.feed(chunk("a") + error_event("the worker failed", "worker_failed"), 1.0)
    assert tokens.error == "the worker failed" and tokens.done
    event = json.loads(error_event("x", "worker_failed").split(b"\n\n")[0][6:])
    assert event == {
        "error": {"message": "x", "type": "server_error", "param": None, "code": "worker_failed"}
    }


def test_goodput_holds_requests_to_ttft_and_tpot() -> None:
    slo = Slo(ttft_seconds=1.0, itl_seconds=0.1)
    assert meets_slo(slo, 0.0, [[0.9, 0.95, 1.05]], 1.05, None)
    assert not meets_slo(slo, 0.0, [[1.1, 1.2]], 1.2, None)  # first token late
    assert not meets_slo(slo, 0.0, [[0.5, 0.9, 1.3]], 1.3, None)  # TPOT 0.4 s
    # Choices stream side by side: each within the ITL target, though their tokens
    # interleave; one late choice fails the mean TPOT.
    assert meets_slo(slo, 0.0, [[0.9, 0.95, 1.0], [0.9, 0.95, 1.0], [0.92, 0.97]], 1.0, None)
    assert not meets_slo(slo, 0.0, [[0.9, 1.0], [0.9, 1.9]], 1.9, None)
    # An answer sent whole: it had TTFT + ITL x (tokens - 1) to arrive.
    assert meets_slo(slo, 0.0, [], 1.35, 5)
    assert not meets_slo(slo, 0.0, [], 1.45, 5)
    assert meets_slo(Slo(), 0.0, [], 100.0, 5)


def endpoint(address: str, **conditions: bool) -> dict[str, Any]:
    return {"addresses": [address], "conditions": conditions}


Ending = Callable[[RequestOutcome], None]


def _ended_with_response(status: int) -> Ending:
    def end(outcome: RequestOutcome) -> None:
        outcome.answered(web.Response(status=status))

    return end


def _raised(error: BaseException) -> Ending:
    def end(_: RequestOutcome) -> None:
        raise error

    return end


def _left_after_the_end(outcome: RequestOutcome) -> None:
    outcome.stream = TokenStream()
    outcome.stream.feed(chunk("a") + b"data: [DONE]\n\n", 1.0)
    raise asyncio.CancelledError


@pytest.mark.parametrize(
    ("end", "outcome"),
    [
        (_ended_with_response(200), "ok"),
        (_ended_with_response(400), "invalid"),
        (_ended_with_response(429), "error"),  # every worker busy: not the client's fault
        (_ended_with_response(500), "error"),
        (_raised(APIError(503, "no worker")), "error"),
        (_raised(APIError(400, "bad")), "invalid"),
        (_raised(RuntimeError("a bug")), "error"),
        (_raised(asyncio.CancelledError()), "cancelled"),
        (_raised(ConnectionResetError()), "cancelled"),
        (_left_after_the_end, "ok"),
    ],
)
def test_a_routed_request_is_counted_once_however_it_ends(end: Ending, outcome: str) -> None:
    metrics = RouterMetrics("p")
    routed = Routed(
        path="/v1/completions", body=b"{}", stream=True, prompt_tokens=3, bucket="all",
        mode="colocated", request_id="r", reply_id="r", arrival=0.0, slo=Slo(),
    )  # fmt: skip
    try:
        with counted(metrics, routed) as record:
            end(record)
    except (APIError, RuntimeError, asyncio.CancelledError, ConnectionResetError):
        pass
    labels = {"pool": "p", "role": "router", "bucket": "all"}
    outcomes = {
        sample.labels["outcome"]: sample.value
        for family in metrics.requests.collect()
        for sample in family.samples
        if sample.name == "pdserve_router_requests_total"
    }
    assert outcomes == {outcome: 1.0}
    decisions = metrics.registry.get_sample_value(
        "pdserve_router_decisions_total", {**labels, "mode": "colocated"}
    )
    assert decisions == 1.0


def test_only_ready_endpoints_of_a_slice_get_traffic() -> None:
    endpoint_slice = {
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [
            endpoint("10.0.0.1", ready=True),
            endpoint("10.0.0.2", ready=False),
            endpoint("10.0.0.3", ready=False, terminating=True),
            endpoint("10.0.0.4"),  # unset: ready, as the API says
        ],
    }
    assert ready_urls(endpoint_slice, 9) == {"http://10.0.0.1:8000", "http://10.0.0.4:8000"}
    ipv6 = {"addressType": "IPv6", "endpoints": [endpoint("fd00::5", ready=True)]}
    assert ready_urls(ipv6, 8000) == {"http://[fd00::5]:8000"}
    assert ready_urls({"endpoints": None}, 8000) == frozenset()


def endpoint_slice(name: str, address: str, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "p-decode", **labels}},
        "endpoints": [endpoint(address, ready=True)],
    }


def test_only_the_endpointslice_controllers_slices_name_workers() -> None:
    config = KubernetesDiscovery.model_validate(
        {"kind": "kubernetes", "namespace": "ns", "port": 8000, "services": {"decode": "p-decode"}}
    )
    source = EndpointSliceSource(KubeAccess("https://api", False), config)
    # The API server is asked for the controller's slices only...
    assert "endpointslice.kubernetes.io/managed-by=endpointslice-controller.k8s.io" in (
        source._selector
    )
    found: dict[str, list[str]] = {}
    controller = {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
    # ...and a slice made by hand adds no worker, whatever else it says.
    for item in (
        endpoint_slice("p-decode-abc", "10.0.0.1", **controller),
        endpoint_slice("by-hand", "169.254.169.254"),
        endpoint_slice("mirrored", "10.9.9.9", **{
            "endpointslice.kubernetes.io/managed-by": "endpointslicemirroring-controller.k8s.io"
        }),
    ):  # fmt: skip
        source._event({"type": "ADDED", "object": item})
    source._report(lambda role, urls: found.__setitem__(role, urls))
    assert found == {"decode": ["http://10.0.0.1:8000"]}
    # A controller's slice relabelled by hand stops counting.
    source._event({"type": "MODIFIED", "object": endpoint_slice("p-decode-abc", "10.0.0.1")})
    source._report(lambda role, urls: found.__setitem__(role, urls))
    assert found == {"decode": []}


def test_kubeconfig_with_a_token_and_one_with_a_plugin(tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "apiVersion": "v1",
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.1:6443/"}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    access = load_access(path)
    assert access.server == "https://10.0.0.1:6443"
    assert access.headers() == {"Authorization": "Bearer t0ken"}
    config["users"][0]["user"] = {"exec": {"command": "aws"}}
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(KubeConfigError, match="not supported"):
        load_access(path)
    config["users"][0]["user"] = {"client-certificate-data": base64.b64encode(b"junk").decode()}
    config["clusters"][0]["cluster"]["certificate-authority-data"] = "bm90IGEgY2VydA=="
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(KubeConfigError, match="unusable certificates"):
        load_access(path)


def test_the_router_loads_no_torch() -> None:
    code = (
        "import sys, pdserve.workers.router.main, pdserve.workers.router.kubernetes;"
        "print(sorted(m for m in ('torch', 'numpy', 'nixl') if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]"
