"""Reading a JSON file a user hands over (an export's config.json) with the guards a hostile file needs.

`read_json(file)` refuses, each in one line naming the file: a file over MAX_CONFIG_BYTES, text that
is not UTF-8 JSON, JSON nested more than MAX_JSON_DEPTH levels (json recurses once per level, so a
deeper file would otherwise end in a RecursionError), and an integer of more digits than Python
converts. store/export.py's `read_config_json` applies the same limits to an export dir's config.json.
"""

import json
import sys
from pathlib import Path
from typing import Any

from vitmask.config import MAX_CONFIG_BYTES, MAX_YAML_DEPTH
from vitmask.errors import UserError

MAX_JSON_DEPTH = MAX_YAML_DEPTH  # nested objects and lists (a config.json vitmask writes has 5)


def read_json(file: Path, fix: str) -> Any:
    """The parsed JSON of `file`, or a UserError "`file` ...; `fix`" for anything wrong with it."""
    try:
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise UserError(f"{file} is {size:,} bytes, more than a config.json may be ({MAX_CONFIG_BYTES:,}); {fix}")
        value = json.loads(file.read_text())
    except RecursionError:
        raise UserError(f"{file} is nested more than {MAX_JSON_DEPTH} levels deep; {fix}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{file} cannot be read as JSON ({str(e).splitlines()[0][:120]}); {fix}") from None
    except ValueError:  # Python's limit on converting text to integers
        raise UserError(f"{file} holds an integer of more than {sys.get_int_max_str_digits()} digits; {fix}") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise UserError(f"{file} is nested more than {MAX_JSON_DEPTH} levels deep; {fix}")
    return value


def json_depth(value: Any) -> int:
    """How deep objects and lists nest in parsed JSON (a number or a string is 0), counted without
    recursion, and no deeper than MAX_JSON_DEPTH + 1."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # deeper is refused anyway: no need to walk on
            todo.extend((child, depth + 1) for child in children)
    return deepest
