"""clickpaca.grammar.json_keys: the tokens that would close a key already present are banned.

Pure: a small vocabulary of bytes and multi-byte pieces (quotes with keys, separators,
escapes, closers before a key); the ban found through the index is checked against
running the lexer over every token of the vocabulary (hypothesis over JSON prefixes).
"""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from clickpaca.grammar.json_keys import KeyIndex, KeyTracker, decode_key

MULTI = [b'"a"', b'"a":', b'"a": ', b'a"', b'a":', b'b"', b'", "', b'", "a', b'", "a"', b'}, "a"',
         b'}, "b":', b'\\u0061"', b'\\u00', b'61"', b'"ab"', b'ab"', b'"', b'": ', b', "', b'{"a": 1, "a"',
         b'\xc3', b'\xa9"', b'\xc3\xa9"', b'"\xc3\xa9"', b'\\"', b'\\""', b'\\\\"', b'[{"a"', b'}]',
         b'\xffspecial"a"']
VOCAB = [bytes([i]) for i in range(128)] + [b"\xc3", b"\xa9"] + MULTI
INDEX = KeyIndex(VOCAB)
TOK = {p: i for i, p in enumerate(VOCAB)}


def tracker(prefix: bytes) -> KeyTracker:
    k = KeyTracker(INDEX)
    for b in prefix:
        k.push(b if b < 128 else TOK[bytes([b])])
    return k


def repeats_after(prefix: bytes, token: int) -> bool:
    """The oracle: the lexer run over the prefix, then the token (no index)."""
    k = tracker(prefix)
    k.banned()  # catch up
    before = k.repeats
    k.push(token)
    k.banned()
    return k.repeats > before


def banned(prefix: bytes) -> set[int]:
    return set(tracker(prefix).banned().tolist())


def names(ids) -> set[bytes]:
    return {VOCAB[i] for i in ids}


def test_decode_key():
    assert decode_key(b"a") == "a" and decode_key(b"\\u0061") == "a" and decode_key(b"\\") is None


def test_a_key_being_written_cannot_close_as_one_present():
    got = names(banned(b'{"a": 1, "'))
    assert {b'a"', b'a":', b'\\u0061"'} <= got
    assert b'b"' not in got and b'ab"' not in got and b'"' not in got
    # written so far "a": only the closing quote would repeat it
    assert b'"' in names(banned(b'{"a": 1, "a')) and b'b"' not in names(banned(b'{"a": 1, "a'))
    # nothing to ban where no key is present, or inside a nested object's fresh keys
    assert banned(b'{"') == set() and banned(b'{"a": {"') == set()


def test_whole_keys_in_one_token_and_after_closers():
    assert {b'"a"', b'"a":', b'"a": '} <= names(banned(b'{"a": 1, '))
    assert b'"b"' not in names(banned(b'{"a": 1, ')) and b'"a"' not in names(banned(b'{"b": 1, '))
    # a value string: "a" there is a value, not a key
    assert b'"a"' not in names(banned(b'{"a": '))
    # closing the value and writing the key in one token
    assert {b'", "a', b'", "a"'} & names(banned(b'{"a": "x')) == {b'", "a"'}
    # closing a nested object and repeating a key of the outer one
    assert b'}, "a"' in names(banned(b'{"a": {"b": 1'))
    assert b'}, "b":' not in names(banned(b'{"a": {"b": 1'))
    # within one token
    assert b'{"a": 1, "a"' in names(banned(b'['))


def test_escapes_and_split_characters():
    assert b'\\u0061"' in names(banned(b'{"a": 1, "'))      # the key a, spelled escaped
    assert b'61"' in names(banned(b'{"a": 1, "\\u00'))       # inside the escape
    assert b'\xa9"' in names(banned(b'{"\xc3\xa9": 1, "\xc3'))  # inside a UTF-8 character
    assert b'\\"' not in names(banned(b'{"a": 1, "a'))        # an escaped quote closes nothing
    assert b'\\""' not in names(banned(b'{"a": 1, "a')) and b'\\""' in names(banned(b'{"a\\"": 1, "a'))


def test_specials_write_nothing():
    k = tracker(b'{"a": 1, ')
    assert TOK[b'\xffspecial"a"'] not in k.banned().tolist()


PREFIXES = st.recursive(
    st.sampled_from(['1', '"x"', '"a"', 'null']),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]"),
        st.lists(st.tuples(st.sampled_from(["a", "b", "ab", "é", 'a"', "a\\"]), inner), max_size=3)
        .map(lambda kv: "{" + ", ".join(json.dumps(k, ensure_ascii=False) + ": " + v for k, v in kv) + "}")),
    max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(text=PREFIXES, cut=st.floats(0, 1))
def test_ban_is_exactly_the_tokens_that_repeat_a_key(text, cut):
    """At any place of a JSON text, the ban is the set of tokens whose bytes, run through
    the lexer from there, close a key the object already holds."""
    raw = text.encode()
    prefix = raw[:int(len(raw) * cut)]
    if any(repeats_after(prefix[:i], prefix[i]) for i in range(len(prefix)) if prefix[i] < 128):
        return  # the text itself repeats a key: not a state the ban lets happen
    want = {t for t in range(len(VOCAB)) if repeats_after(prefix, t)}
    assert banned(prefix) == want, (prefix, names(banned(prefix) ^ want))


def test_ban_clears_bits_counts_and_notes_exhaustion():
    k = tracker(b'{"a": 1, ')
    row = np.zeros((len(VOCAB) + 31) // 32, dtype=np.int32)
    bits = row.view(np.uint32)
    for t in (TOK[b'"a"'], TOK[b'"b"'[:1]], TOK[b'"a":']):
        bits[t >> 5] |= np.uint32(1 << (t & 31))
    k.ban(row)
    left = [t for t in range(len(VOCAB)) if bits[t >> 5] >> np.uint32(t & 31) & 1]
    assert left == [TOK[b'"']] and k.acted == 1 and not k.exhausted
    only = np.zeros_like(row)
    only.view(np.uint32)[TOK[b'"a"'] >> 5] |= np.uint32(1 << (TOK[b'"a"'] & 31))
    k.ban(only)
    assert not only.any() and k.exhausted and k.acted == 2


def test_rollback_and_fork():
    k = tracker(b'{"a": 1, ')
    f = k.fork()
    k.rollback(len(b'"a": 1, '))  # back to '{'
    assert TOK[b'"a"'] not in k.banned().tolist() and TOK[b'"a"'] in f.banned().tolist()
