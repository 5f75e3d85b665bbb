"""The protocol's own field checks, and the limits they enforce.

Each check takes (name, value) and returns the value or raises a ValueError naming the
field; the general checks and the message style are base/fieldcheck.py's (the sampler
parameters use them too). The request types (requests.py) declare their fields with them.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from ..chat import check_messages
from ...base.fieldcheck import integer as _int, real as _num, show as _show, string as _str, string_list as _str_list
from ...sampling.params import wire_names


MAX_PROMPT_BYTES = 1 << 20  # infer/prefill prompt (UTF-8 bytes); tokenized on the reader thread (engine/prepare.py)
MAX_MESSAGES = 1024  # chat turns in one infer/prefill: each costs a template turn and two special tokens
MAX_TEMPLATE_BYTES = 64 << 10  # chatTemplate text (llama.cpp matches it against its built-in ones)
MAX_STOPS, MAX_STOP_BYTES = 64, 4096  # stop strings: every generated piece is searched for each
MAX_LOGIT_BIAS = 16384  # logit_bias entries: the engine builds the sequence's bias arrays from them
MAX_SCORE_BYTES = 4 << 20  # score text
MAX_GRAMMAR_BYTES = 128 << 10  # grammar text, checked here only (grammar/grammars/limits.py checks its other limits)
MAX_NUMBER_DIGITS = 18  # integral digits of a bounded JSON number: 10**18 - 1 fits an i64
MAX_THREADS = 512  # GGML_MAX_N_THREADS in ggml.h: the CPU threadpool's fixed arrays


def build_name(name: str, v: Any) -> str:
    """A build name: one path component under builds/, never a path to import code from."""
    v = _str(True)(name, v)
    if not _NAME_RE.fullmatch(v):
        raise ValueError(f"{name}: must be a build name under builds/ (letters, digits, '.', '_', '-'; "
                         f"no path), got {_show(v)}")
    return v


def grammar_id(name: str, v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise ValueError(f"{name}: must be a string or an integer, got {_show(v)}")
    return str(v)


def stops(name: str, v: Any) -> list[str]:
    v = _str_list(name, v)
    if len(v) > MAX_STOPS:
        raise ValueError(f"{name}: {len(v)} strings, the limit is {MAX_STOPS}")
    for s in v:
        if len(s) > MAX_STOP_BYTES // 4 and len(s.encode("utf-8", "surrogatepass")) > MAX_STOP_BYTES:
            raise ValueError(f"{name}: a string of {len(s.encode('utf-8', 'surrogatepass'))} bytes, "
                             f"the limit is {MAX_STOP_BYTES}")
    return v


MAX_RPC_SERVERS = 16  # GGML_RPC_MAX_SERVERS in ggml-rpc.h


def endpoints(name: str, v: Any) -> tuple[str, ...]:
    """rpcServers: distinct "host:port" strings (rpc/wire.py parses them)."""
    from ...rpc.wire import parse_endpoint

    if not isinstance(v, list) or not v:
        raise ValueError(f"{name}: must be a non-empty list of \"host:port\" strings, got {_show(v)}")
    if len(v) > MAX_RPC_SERVERS:
        raise ValueError(f"{name}: at most {MAX_RPC_SERVERS} workers, got {len(v)}")
    for item in v:
        try:
            parse_endpoint(item)
        except ValueError as e:
            raise ValueError(f"{name}: {_show(item)}: {e}") from None
    if len(set(v)) != len(v):
        raise ValueError(f"{name}: a worker is listed twice")
    return tuple(v)


def shares(name: str, v: Any) -> tuple[float, ...]:
    """tensorSplit: the share of the offloaded layers per device (normalised by llama.cpp)."""
    if not isinstance(v, list) or not v or len(v) > MAX_RPC_SERVERS:
        raise ValueError(f"{name}: must be a list of 1..{MAX_RPC_SERVERS} numbers, got {_show(v)}")
    out = [_num(0.0)(name, x) for x in v]
    if not any(out):
        raise ValueError(f"{name}: at least one share must be > 0")
    return tuple(out)


MAX_CAPTURE_NODES = 64  # capture: node names per request (each is looked for on every decode's ask)
CAPTURE_TOKENS = ("last", "generated", "all")
CAPTURE_DTYPES = ("float32", "float16")
#: captureTokens when not given: what a researcher reads from each kind of request
#: (docs/ACTIVATIONS.md): the state each generated token was sampled from; every token
#: of a scored text; a prefilled prompt's summary at its last token
CAPTURE_DEFAULT = {"infer": "generated", "score": "all", "prefill": "last"}


def node_names(name: str, v: Any) -> tuple[str, ...]:
    """capture: graph node names (checked against the model's graph by the handler)."""
    v = _str_list(name, v)
    if not v:
        raise ValueError(f"{name}: must name at least one graph node (or leave it out)")
    if len(v) > MAX_CAPTURE_NODES:
        raise ValueError(f"{name}: {len(v)} nodes, the limit is {MAX_CAPTURE_NODES}")
    return tuple(dict.fromkeys(v))


def patches(name: str, v: Any) -> Any:
    """patch: activation patching's entries (activations/patch_wire.py, loaded when first used)."""
    from ...activations import patch_wire
    return patch_wire.patches(name, v)


def cvec(check_name: str) -> Callable[[str, Any], Any]:
    """A control-vector field's check, from activations/wire.py (loaded when first used)."""
    def check(name: str, v: Any) -> Any:
        from ...activations import wire as cvec_wire
        return getattr(cvec_wire, check_name)(name, v)
    return check


_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
SEQ = _int(0, (1 << 31) - 1)  # bounded: an event's seq_id must stay encodable (1e20 crashed encode)


def sampler_fields() -> tuple[str, ...]:
    """infer's sampler fields: the wire name of every parameter in the step registry now,
    a step registered after this module was imported (`serve --steps`) included."""
    return wire_names()


def messages(name: str, v: Any) -> Any:
    """check_messages, and the prompt's size limit over all the contents (they are
    formatted and tokenized like a prompt) and on their number."""
    if isinstance(v, list) and len(v) > MAX_MESSAGES:
        raise ValueError(f"{name}: {len(v)} messages, the limit is {MAX_MESSAGES}")
    messages = check_messages(name, v)
    if sum(len(m.content) for m in messages) * 4 > MAX_PROMPT_BYTES:  # UTF-8: at most 4 bytes a char
        n = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in messages)
        if n > MAX_PROMPT_BYTES:
            raise ValueError(f"{name}: {n} bytes of content, the limit is {MAX_PROMPT_BYTES}")
    return messages


MAX_LENS_TOP = 64  # lens.top: tokens per layer and position (each a dict in the event)
MAX_LENS_LAYERS = 1024  # lens.layers: entries (checked against the model's layers by the handler)


def lens(name: str, v: Any) -> tuple[tuple[int, ...] | str, int]:
    """lens: {layers: [..] | "all", top: k} as (layers, top); the layers are checked
    against the model by the handler (activations/lens.layers_of). docs/ACTIVATIONS.md."""
    if not isinstance(v, dict):
        raise ValueError(f'{name}: must be an object {{layers: [..] | "all", top: k}}, got {_show(v)}')
    extra = sorted(set(v) - {"layers", "top"})
    if extra:
        raise ValueError(f"{name}: unknown field {extra[0]!r} (it has layers and top)")
    layers = v.get("layers", "all")
    if layers != "all":
        if (not isinstance(layers, list) or not layers or len(layers) > MAX_LENS_LAYERS
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
            raise ValueError(f'{name}: layers must be "all" or a non-empty list of layer numbers, got {_show(layers)}')
        layers = tuple(layers)
    top = v.get("top", 5)
    if not isinstance(top, int) or isinstance(top, bool) or not 1 <= top <= MAX_LENS_TOP:
        raise ValueError(f"{name}: top must be an integer 1..{MAX_LENS_TOP}, got {_show(top)}")
    return layers, top
