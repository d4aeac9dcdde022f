"""tool_choice "required" and a named function, enforced with xgrammar structural tags in the
model's own call format, so the parser that reads "auto" replies reads these too.

    required, hermes:   <tool_call>\\n{"name": "get_weather", "arguments": <schema>}\\n</tool_call>
                        (\\n<tool_call> ... </tool_call>)*   one or more, nothing else
    named f:            the same with f only, exactly once

The tag is a plain dict in xgrammar's structural-tag JSON, so this module imports nothing
heavy; StructuredOutputManager compiles it (a bad parameters schema is a 400 there).
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.tool_calling.parsers import CallFormat

# Whitespace runs allowed inside the arguments: enough for JSON as models write it, and a
# small model cannot spend its max_tokens on spaces.
MAX_WHITESPACE = 2


def _tag(fmt: CallFormat, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    schema: dict[str, Any] = parameters if parameters else {"type": "object"}
    # The begin string writes the name inside a JSON string: escape it as JSON would.
    quoted = json.dumps(name)[1:-1]
    return {"type": "tag", "begin": fmt.begin.format(name=quoted),
            "content": {"type": "json_schema", "json_schema": schema,
                        "max_whitespace_cnt": MAX_WHITESPACE},
            "end": fmt.end}


def tool_call_tag(fmt: CallFormat, functions: list[dict[str, Any]], *, parallel: bool
                  ) -> dict[str, Any]:
    """A structural tag for one call (parallel false) or several of `functions`
    ({"name", "parameters"} each) in format fmt, and no other text."""
    calls = {"type": "tags_with_separator",
             "tags": [_tag(fmt, f["name"], f.get("parameters")) for f in functions],
             "separator": fmt.separator, "at_least_one": True, "stop_after_first": not parallel}
    elements = [e for e in ({"type": "const_string", "value": fmt.prefix} if fmt.prefix else None,
                            calls,
                            {"type": "const_string", "value": fmt.suffix} if fmt.suffix else None)
                if e is not None]
    fmt_obj = elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
    return {"type": "structural_tag", "format": fmt_obj}
