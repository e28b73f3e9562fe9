"""Streamed text and stop strings: a client never sees part of a stop string."""

from __future__ import annotations

from pdserve.workers.server.text_stream import TextStream


class CharDetokenizer:
    """Token id -> one character (chr), for tests."""

    def add(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


def feed(stream: TextStream, text: str) -> list[str]:
    pieces = []
    for char in text:
        delta = stream.add((ord(char),))
        pieces.append(delta.text)
        if delta.stopped:
            break
    return pieces


def test_text_without_stops_streams_as_it_comes() -> None:
    stream = TextStream(CharDetokenizer(), ())
    assert feed(stream, "hello") == ["h", "e", "l", "l", "o"]


def test_stop_string_ends_the_text_and_is_not_sent() -> None:
    stream = TextStream(CharDetokenizer(), ("END",))
    pieces = feed(stream, "abENxEND tail")
    assert "".join(pieces) == "abENx"
    assert stream.stopped


def test_possible_stop_prefix_is_held_back_then_released() -> None:
    stream = TextStream(CharDetokenizer(), ("STOP",))
    pieces = feed(stream, "aST")
    assert "".join(pieces) == "a"  # "ST" may begin STOP
    assert stream.add((ord("x"),)).text == "STx"


def test_stop_string_can_be_included() -> None:
    stream = TextStream(CharDetokenizer(), ("!",), include_stop=True)
    assert "".join(feed(stream, "hi! more")) == "hi!"


def test_flush_releases_held_text_at_the_end() -> None:
    stream = TextStream(CharDetokenizer(), ("STOP",))
    pieces = feed(stream, "abST")
    assert stream.flush() == "ST"
    assert "".join(pieces) + "ST" == "abST"


def test_a_stop_string_split_over_many_tokens_after_a_long_text() -> None:
    stream = TextStream(CharDetokenizer(), ("<|end|>", "xyz"))
    pieces = feed(stream, "a" * 5000 + "<|en" + "d|> ignored")
    assert "".join(pieces) == "a" * 5000
    assert stream.stopped and stream.flush() == ""


def test_stop_strings_count_once_min_tokens_are_out() -> None:
    stream = TextStream(CharDetokenizer(), ("x",), min_tokens=3)
    assert "".join(feed(stream, "axbxc")) == "axb"
    assert stream.stopped
