"""clickpaca.engine.text without a model: UTF-8 assembly of token bytes, stop strings in pieces."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.engine.text import StopMatcher, Utf8Assembler, _incomplete_tail


def split_at(data, cuts):
    cuts = sorted(set(c for c in cuts if 0 < c < len(data)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def assemble(chunks) -> tuple[list[str], str]:
    a = Utf8Assembler()
    pieces = [a.feed(c) for c in chunks]
    return pieces, a.flush()


def is_valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")  # lone surrogates cannot be encoded
        return True
    except UnicodeEncodeError:
        return False


# ------------------------------------------------------------------ Utf8Assembler

def test_split_characters_held_back():
    data = "é€😀".encode()  # 2 + 3 + 4 bytes
    pieces, tail = assemble([bytes([b]) for b in data])
    assert pieces == ["", "é", "", "", "€", "", "", "", "😀"] and tail == ""


def test_held_bytes_come_with_the_completing_token():
    a = Utf8Assembler()
    assert a.feed(b"ab\xe2\x82") == "ab"
    assert a.pending == b"\xe2\x82"
    assert a.feed(b"\xacc") == "€c"
    assert a.pending == b""


def test_incomplete_tail_counts():
    assert _incomplete_tail(b"") == 0
    assert _incomplete_tail(b"a") == 0
    assert _incomplete_tail(b"\xc3") == 1
    assert _incomplete_tail(b"a\xc3\xa9") == 0
    assert _incomplete_tail(b"\xe2\x82") == 2
    assert _incomplete_tail(b"\xf0\x9f\x98") == 3
    assert _incomplete_tail(b"\xf0\x9f\x98\x80") == 0
    assert _incomplete_tail(b"\x80\x80\x80\x80") == 0  # stray continuation bytes: not held
    assert _incomplete_tail(b"\xff") == 0  # never a lead byte


def test_invalid_bytes_become_replacement_chars():
    pieces, tail = assemble([b"a\xff", b"\x80b", b"\xc3"])
    assert "".join(pieces) == "a\ufffd\ufffdb"
    assert tail == "\ufffd"  # an incomplete character at the end
    a = Utf8Assembler()
    assert a.flush() == ""


@settings(max_examples=500, deadline=None)
@given(st.text(), st.lists(st.integers(0, 400), max_size=40))
def test_any_split_of_valid_utf8_gives_the_text(text, cuts):
    data = text.encode("utf-8", "surrogatepass")
    if not is_valid_text(text):
        return
    pieces, tail = assemble(split_at(data, cuts))
    assert "".join(pieces) + tail == text
    assert tail == ""  # nothing is left over from valid text
    for p in pieces:
        assert is_valid_text(p)
        assert "\ufffd" not in p or "\ufffd" in text


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1))
def test_one_byte_at_a_time(text):
    if not is_valid_text(text):
        return
    data = text.encode()
    pieces, tail = assemble([data[i:i + 1] for i in range(len(data))])
    assert "".join(pieces) + tail == text
    # each character comes out whole, with the byte that completes it
    assert [p for p in pieces if p] == list(text)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64), st.lists(st.integers(0, 64), max_size=20))
def test_invalid_bytes_never_raise(data, cuts):
    pieces, tail = assemble(split_at(data, cuts))
    for p in pieces + [tail]:
        assert isinstance(p, str) and is_valid_text(p)
    # the same text as decoding all the bytes at once
    assert "".join(pieces) + tail == data.decode("utf-8", "replace")


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=20), st.binary(max_size=8), st.text(max_size=20), st.lists(st.integers(0, 200), max_size=10))
def test_valid_text_around_junk_survives(before, junk, after, cuts):
    if not (is_valid_text(before) and is_valid_text(after)):
        return
    data = before.encode() + junk + after.encode()
    pieces, tail = assemble(split_at(data, cuts))
    out = "".join(pieces) + tail
    assert out.startswith(before)
    assert out == data.decode("utf-8", "replace")


# ------------------------------------------------------------------ StopMatcher

def first_hit(stops, pieces):
    m = StopMatcher(stops)
    for i, p in enumerate(pieces):
        s = m.feed(p)
        if s is not None:
            return i, s
    return None


def test_stop_split_across_pieces():
    assert first_hit(["five"], ["one, two, three, f", "i", "ve, six"]) == (2, "five")
    assert first_hit(["five"], ["fi", "", "ve"]) == (2, "five")
    assert first_hit(["\n\n"], ["a\n", "\nb"]) == (1, "\n\n")
    assert first_hit(["abc"], ["a", "b", "c"]) == (2, "abc")


def test_stop_in_one_piece_and_no_false_positive():
    assert first_hit(["END"], ["the END"]) == (0, "END")
    assert first_hit(["END"], ["E", "N", "D"[:0], "d"]) is None
    assert first_hit(["five"], ["fi", "x", "ve"]) is None
    assert first_hit(["ab"], ["a", "", "a", "c", "b"]) is None


def test_no_stops():
    assert first_hit(None, ["anything"]) is None
    assert first_hit([], ["anything"]) is None
    assert first_hit([""], ["anything"]) is None  # empty stops are ignored


def test_longest_stop_decides_the_tail():
    assert first_hit(["x", "hello world"], ["hello", " wor", "ld"]) == (2, "hello world")


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="abc\n", max_size=30), st.lists(st.integers(0, 30), max_size=10),
       st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_found_exactly_when_the_text_contains_it(text, cuts, stops):
    pieces = split_at(text, cuts)
    hit = first_hit(stops, pieces)
    # the first piece after which the text so far contains a stop string
    expect = None
    for i in range(len(pieces)):
        so_far = "".join(pieces[:i + 1])
        if any(s in so_far for s in stops):
            expect = i
            break
    if expect is None:
        assert hit is None
    else:
        assert hit is not None and hit[0] == expect
        i, s = hit
        assert s in stops and s in "".join(pieces[:i + 1])
