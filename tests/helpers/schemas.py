"""JSON Schemas whose every admitted output is short: whatever a random model picks, the
grammar ends well inside a small ``max_tokens``."""

from __future__ import annotations

from typing import Any

BOUNDED_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["id", "score"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99}, {"type": "null"}]},
    {"type": "object", "properties": {"inner": {
        "type": "object", "properties": {"x": {"type": "integer", "maximum": 9, "minimum": 0}},
        "required": ["x"], "additionalProperties": False}},
     "required": ["inner"], "additionalProperties": False},
]
