"""Tool calls written as XML, the way Qwen3-Coder writes them (``--tool-call-parser
qwen3_coder``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    2
    </parameter>
    </function>
    </tool_call>

A parameter's value is text: it becomes the JSON value the tool's schema declares for that
argument (a string stays a string; any other type is read as JSON, and stays the text when it
does not parse). The arguments are built as a JSON object one whole parameter at a time, so a
stream sends ``{`` with the name, then each parameter once its value has ended, then ``}``, and
what it sent always joins into the final arguments: a value is never sent half-read, because
its type decides how it is written.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ArgTypes", "arg_types", "xml_call"]

ArgTypes = Mapping[str, Mapping[str, Any]]
"""Per function name, per argument name, that argument's JSON schema."""

_FUNCTION = "<function="
_PARAMETER = "<parameter="
_VALUE_ENDS = ("</parameter>", _PARAMETER, "</function>")
"""A value ends at its closing tag, or (the model forgot it) where the next parameter or the
function's end begins."""


def arg_types(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The argument schemas of OpenAI-style tool definitions (``{"type": "function",
    "function": {"name", "parameters"}}``)."""
    types: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties")
        if isinstance(fn.get("name"), str) and isinstance(props, Mapping):
            types[fn["name"]] = props
    return types


def _declared(schema: Any) -> set[str]:
    """The JSON types a property's schema allows (its ``type``, or those of its ``anyOf`` /
    ``oneOf`` branches); empty when it declares none."""
    if not isinstance(schema, Mapping):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            out |= _declared(branch)
    return out


def convert(value: str, schema: Any) -> Any:
    """``value`` as the JSON value ``schema`` asks for. An argument that declares no type, or
    only ``string``, keeps its text: the model writes strings bare, so ``42`` there is text."""
    if not _declared(schema) - {"string"}:
        return value
    try:
        return json.loads(value)
    except ValueError:
        # Python spellings of the literals are common in this format (``True``, ``None``).
        literal = {"true": True, "false": False, "none": None, "null": None}
        return literal.get(value.strip().lower(), value)


def _trim(value: str) -> str:
    """The value without the one newline that follows its opening tag and the one before its
    closing tag (the format's layout, not the value)."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _member(key: str, value: Any) -> str:
    return f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


def xml_call(
    text: str, i: int, types: ArgTypes, final: bool
) -> tuple[str | None, str, int | None] | None:
    """The call whose ``<function=NAME>`` starts at ``text[i]`` (after whitespace): its name
    (None until its tag is complete), its arguments' JSON text so far and the index after its
    ``</function>`` (None while the text ends inside it). None when ``text[i:]`` is not a
    function tag at all."""
    i = len(text) - len(text[i:].lstrip())
    rest = text[i:i + len(_FUNCTION)]
    if not _FUNCTION.startswith(rest):
        return None
    close = text.find(">", i)
    if len(rest) < len(_FUNCTION) or close < 0:
        return None, "", None
    name = text[i + len(_FUNCTION):close].strip()
    schemas = types.get(name, {})
    members: list[str] = []
    j = close + 1
    while True:
        k = len(text) - len(text[j:].lstrip())
        if text.startswith("</function>", k):
            return name, "{" + ", ".join(members) + "}", k + len("</function>")
        if not text.startswith(_PARAMETER, k):
            # The text ends inside a tag, or holds what this format never writes here: a
            # complete answer closes what it has; a growing one waits.
            return name, "{" + ", ".join(members) + ("}" if final else ""), None
        key_end = text.find(">", k)
        if key_end < 0:
            return name, "{" + ", ".join(members) + ("}" if final else ""), None
        key = text[k + len(_PARAMETER):key_end].strip()
        ends = [e for e in (text.find(m, key_end + 1) for m in _VALUE_ENDS) if e >= 0]
        if not ends:
            if final:  # cut short: the value as far as it goes
                members.append(_member(key, convert(_trim(text[key_end + 1:]), schemas.get(key))))
                return name, "{" + ", ".join(members) + "}", None
            return name, "{" + ", ".join(members), None
        end = min(ends)
        members.append(_member(key, convert(_trim(text[key_end + 1:end]), schemas.get(key))))
        j = end + len("</parameter>") if text.startswith("</parameter>", end) else end
