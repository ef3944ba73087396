"""A chat request's tool fields (``tools``, ``tool_choice``, ``parallel_tool_calls``)
parsed once into ``ToolCalling``, and the JSON schema a named or ``"required"`` tool choice
constrains the answer to (vLLM's ``_get_json_schema_from_tool``).

Errors are ``InvalidRequestError`` naming the field (``tools[2].function.name``,
``tool_choice``...): the protocol turns them into 400s.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import InvalidRequestError
from engine.structured.spec import StructuredOutput

# Bounds on what a request may define: every tool is rendered into the prompt, and a
# "required" tool choice compiles all their schemas into one grammar.
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 64 * 1024  # the whole ``tools`` array as compact JSON
NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
# A tool without ``parameters`` takes an empty object: ``{}`` (vLLM's intent; its schema
# lets other keys in, which a model may then fill until ``max_tokens``).
EMPTY_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Tool:
    """One function tool: ``definition`` is what the chat template gets (the client's
    ``{"type": "function", "function": {...}}``, known keys only); ``parameters`` its JSON
    schema (None: absent)."""

    name: str
    definition: dict[str, Any]
    parameters: dict[str, Any] | None = None

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters else EMPTY_PARAMETERS


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how the answer may call them. ``choice`` is ``"none"`` (the
    tools are in the prompt, the answer is content), ``"auto"`` (the node's
    ``--tool-call-parser`` finds calls in the text), ``"required"`` (the answer is a JSON
    array of calls) or ``"named"`` (the answer is the arguments of tool ``name``);
    ``parallel``: more than one call may be made."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]]:
        """The ``tools`` variable of the chat template (transformers' ``tools=``)."""
        return [copy.deepcopy(t.definition) for t in self.tools]

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    def structured_output(self) -> StructuredOutput | None:
        """The constraint of a named or "required" tool choice (None for the others)."""
        if self.choice == "named":
            assert self.name is not None
            i, tool = next((i, t) for i, t in enumerate(self.tools) if t.name == self.name)
            return StructuredOutput.json_schema(
                tool.arguments_schema, f"tools[{i}].function.parameters"
            )
        if self.choice == "required":
            schema = required_schema(self.tools, self.parallel)
            return StructuredOutput.json_schema(schema, "tools", derived=True)
        return None


def required_schema(tools: tuple[Tool, ...] | list[Tool], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema of a "required" tool choice: an array of at least one (with
    ``parallel`` false: exactly one) ``{"name": <a tool's name>, "parameters": <its
    schema>}``. Each tool's schema is kept whole where the array nests it, its local
    ``$ref``s (``#``, ``#/$defs/...``, ``#/properties/...``) re-pointed there
    (``_rebased``): a recursive schema, ``definitions`` and two tools' ``$defs`` of one
    name mean what they mean alone (vLLM hoists ``$defs`` to the top; a ``#`` then means
    the whole array). Unlike vLLM each item allows no other keys, so the array is exactly
    the calls (``"name"`` first: the order of its properties)."""
    items = []
    for i, t in enumerate(tools):
        at = f"#/items/anyOf/{i}/properties/parameters"
        items.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [t.name]},
                    "parameters": _rebased(t.arguments_schema, at),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Keywords whose value maps names to schemas, and those whose value is data (not a schema).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA = ("const", "enum", "default", "examples")


def _rebased(node: Any, base: str) -> Any:
    """A copy of schema ``node`` whose local ``$ref``s (``#`` and ``#/...``: pointers into
    the tool's schema) point under ``base``, where that schema now sits."""
    if isinstance(node, list):
        return [_rebased(x, base) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            out[key] = base + value[1:]
        elif key in _DATA:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(v, base) for name, v in value.items()}
        else:
            out[key] = _rebased(value, base)
    return out


def parse_tool_calling(body: dict[str, Any]) -> ToolCalling | None:
    """The request's tool calling (None: no tools, no tool choice). Raises
    ``InvalidRequestError`` naming the field."""
    _refuse_legacy(body)
    tools = _parse_tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice, name = _parse_choice(body.get("tool_choice"))
    if not tools:
        # vLLM's rules: "none" (or no choice) asks for nothing; "required" with an empty
        # list is "none" (OpenAI's behaviour); any other choice needs tools.
        if choice in (None, "none") or (choice == "required" and body.get("tools") == []):
            return None
        raise InvalidRequestError(
            "'tool_choice' needs 'tools': when using 'tool_choice', 'tools' must be set",
            "tool_choice",
        )
    if choice == "named" and not any(t.name == name for t in tools):
        raise InvalidRequestError(
            f"'tool_choice' names the function {name!r:.80}, which is not one of 'tools'",
            "tool_choice",
        )
    return ToolCalling(tuple(tools), choice or "auto", name, True if parallel is None else parallel)


def _refuse_legacy(body: dict[str, Any]) -> None:
    """OpenAI's older ``functions`` / ``function_call``: not supported (vLLM neither)."""
    if body.get("functions"):
        raise InvalidRequestError(
            "'functions' is not supported: use 'tools' (each {\"type\": \"function\", "
            '"function": {...}})',
            "functions",
        )
    if body.get("function_call") not in (None, "none"):
        raise InvalidRequestError(
            "'function_call' is not supported: use 'tool_choice'", "function_call"
        )


def _parse_tools(value: Any) -> list[Tool]:
    if value is None or value == []:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError("'tools' must be an array of tools", "tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequestError(
            f"'tools' may hold at most {MAX_TOOLS} tools, got {len(value)}", "tools"
        )
    try:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise InvalidRequestError(f"'tools' cannot be serialised: {e}", "tools") from None
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequestError(
            f"'tools' is {size} bytes as JSON; the tools may be at most {MAX_TOOLS_BYTES} bytes",
            "tools",
        )
    out: list[Tool] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        tool = _parse_tool(item, f"tools[{i}]")
        if tool.name in seen:
            raise InvalidRequestError(
                f"'tools[{i}].function.name': {tool.name!r} is defined twice",
                f"tools[{i}].function.name",
            )
        seen.add(tool.name)
        out.append(tool)
    return out


def _parse_tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict):
        raise InvalidRequestError(f"'{where}' must be an object", where)
    if item.get("type") != "function":
        raise InvalidRequestError(
            f"'{where}.type' must be 'function', got {item.get('type')!r:.40}", f"{where}.type"
        )
    fn = item.get("function")
    if not isinstance(fn, dict):
        raise InvalidRequestError(
            f"'{where}.function' must be an object with a 'name'", f"{where}.function"
        )
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidRequestError(
            f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', "
            f"got {name!r:.80}",
            f"{where}.function.name",
        )
    definition: dict[str, Any] = {"name": name}
    desc = fn.get("description")
    if desc is not None:
        if not isinstance(desc, str):
            raise InvalidRequestError(
                f"'{where}.function.description' must be a string", f"{where}.function.description"
            )
        definition["description"] = desc
    params = fn.get("parameters")
    if params is not None:
        at = f"{where}.function.parameters"
        if not isinstance(params, dict):
            raise InvalidRequestError(f"'{at}' must be a JSON schema (an object)", at)
        if params.get("type", "object") != "object":
            raise InvalidRequestError(
                f"'{at}' must describe an object (its 'type' is 'object'), got "
                f"{params.get('type')!r:.40}",
                at,
            )
        definition["parameters"] = params
    strict = fn.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise InvalidRequestError(
                f"'{where}.function.strict' must be a boolean", f"{where}.function.strict"
            )
        definition["strict"] = strict
    return Tool(name, {"type": "function", "function": definition}, params or None)


def _parse_choice(value: Any) -> tuple[str | None, str | None]:
    """``(choice, name)``: None (absent), "none", "auto", "required" or "named"."""
    if value is None:
        return None, None
    if isinstance(value, str):
        if value not in CHOICES:
            raise InvalidRequestError(
                f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got "
                f"{value!r:.40}",
                "tool_choice",
            )
        return value, None
    usage = '{"type": "function", "function": {"name": "my_function"}}'
    if not isinstance(value, dict) or value.get("type") != "function":
        raise InvalidRequestError(
            f"'tool_choice' must be 'none', 'auto', 'required' or {usage}", "tool_choice"
        )
    fn = value.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            f"'tool_choice' names no function; correct usage: {usage}", "tool_choice"
        )
    return "named", name
