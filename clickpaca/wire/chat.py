"""Chat messages -> prompt text, through llama.cpp's own chat templates.

`infer` and `prefill` accept `messages` (a list of {role, content}) instead of `prompt`.
The text is made by `llama_chat_apply_template` from the generated bindings, so a
conversation is formatted exactly as llama.cpp's own tools format it for the same model.
That function knows a fixed list of templates, chosen by built-in name (`gemma`,
`chatml`, `llama3`, ...) or detected from a template's text; it runs no Jinja. The
template is the model's own (GGUF metadata `tokenizer.chat_template`) unless the
request names one in `chatTemplate`, which base models such as the default Gemma 3 270M
need: they have none.

A held sequence continues with more messages: only the new turns are formatted and
appended after what it holds (a prefill of the first turns with
`addGenerationPrompt: false`, then an `infer` with the next ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant")
FIELD = "messages"


class ChatError(ValueError):
    """A conversation that cannot be formatted; the message names the field."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


def check_messages(name: str, value: Any) -> tuple[Message, ...]:
    """Validate the wire form: a non-empty list of {role, content} with known roles."""
    if not isinstance(value, list):
        raise ValueError(f"{name}: must be a list of {{role, content}} objects")
    if not value:
        raise ValueError(f"{name}: must not be empty")
    out = []
    for i, m in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where}: must be an object with role and content")
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise ValueError(f"{where}.{extra[0]}: unknown field (a message has role and content)")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ValueError(f"{where}.role: missing or not a string (one of {', '.join(ROLES)})")
        if role not in ROLES:
            shown = role if len(role) <= 40 else role[:37] + "..."
            raise ValueError(f"{where}.role: unknown role {shown!r} (one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise ValueError(f"{where}.content: missing or not a string")
        if "\x00" in content:
            raise ValueError(f"{where}.content: must not contain a NUL character")
        out.append(Message(role, content))
    return tuple(out)


def builtin_templates(nat) -> list[str]:
    """The template names this llama.cpp build knows (llama_chat_builtin_templates)."""
    ffi, lib = nat.ffi, nat.lib
    n = lib.llama_chat_builtin_templates(ffi.NULL, 0)
    names = ffi.new(f"const char *[{n}]")
    lib.llama_chat_builtin_templates(names, n)
    return [ffi.string(names[i]).decode() for i in range(n)]


def model_template(model) -> str | None:
    """The model's own template text from its GGUF metadata, or None."""
    ffi = model.nat.ffi
    ptr = model.nat.lib.llama_model_chat_template(model.ptr, ffi.NULL)
    return None if ptr == ffi.NULL else ffi.string(ptr).decode("utf-8", "replace")


def resolve_template(model, chat_template: str | None) -> str:
    """The template to use: the request's `chatTemplate`, else the model's own."""
    if chat_template is not None:
        if "\x00" in chat_template:
            raise ChatError("chatTemplate: must not contain a NUL character")
        return chat_template
    own = model_template(model)
    if own is None:
        raise ChatError(
            f"{FIELD}: the model has no chat template in its GGUF metadata (a base model?); "
            "send chatTemplate with a built-in name such as gemma or chatml, or template text")
    return own


def apply(nat, template: str, messages: tuple[Message, ...] | list[Message],
          add_generation_prompt: bool, field: str = "chatTemplate") -> str:
    """llama_chat_apply_template over the messages; a clear error if the template is unknown."""
    ffi, lib = nat.ffi, nat.lib
    keep = []  # the C strings must outlive the call
    chat = ffi.new(f"struct llama_chat_message[{len(messages)}]")
    for i, m in enumerate(messages):
        role, content = ffi.new("char[]", m.role.encode()), ffi.new("char[]", m.content.encode())
        keep += [role, content]
        chat[i].role, chat[i].content = role, content
    tmpl = ffi.new("char[]", template.encode())
    cap = 2 * sum(len(m.content.encode()) + len(m.role) for m in messages) + 256
    for _ in range(2):
        buf = ffi.new(f"char[{cap}]")
        n = lib.llama_chat_apply_template(tmpl, chat, len(messages), add_generation_prompt, buf, cap)
        if n < 0:
            names = ", ".join(builtin_templates(nat))
            shown = template if len(template) <= 40 else template[:37] + "..."
            raise ChatError(f"{field}: llama.cpp does not know the template {shown!r} "
                            f"(it formats only built-in templates: {names}; or template text "
                            "it recognises as one of them)")
        if n <= cap:
            return ffi.buffer(buf, n)[:].decode("utf-8", "replace")
        cap = n + 1
    raise ChatError(f"{field}: the formatted conversation kept growing")  # pragma: no cover


def format_messages(model, chat_template: str | None, messages,
                    add_generation_prompt: bool) -> str:
    """The prompt text for these messages, with the request's template or the model's."""
    template = resolve_template(model, chat_template)
    return apply(model.nat, template, list(messages), add_generation_prompt,
                 field="chatTemplate" if chat_template is not None else FIELD)
