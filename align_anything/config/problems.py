"""How a pydantic `ValidationError` becomes the lines of one `ConfigError`: each problem with
its full key path (`dpo.loss_weights`, `data.path.0.weight`), the value given (unless it may
hold a secret) and, for an unknown key, the nearest known one ("did you mean").
"""

from __future__ import annotations

import re
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from align_anything.config.run import TASK_SECTIONS, RunConfig
from align_anything.config.sections import RewardSection, RolloutSection
from align_anything.errors import did_you_mean


def _unmatched_union_members(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the "wrong type" errors of union members the value did not take when another member
    took it: for `data.path=[{...}]` the list member's errors about the entries are the news,
    not that the list is no string. (pydantic reports every member's errors.)"""
    members: dict[tuple, set[str]] = {}  # key before the member's tag -> members with depth
    for item in items:
        loc = [str(p) for p in item["loc"]]
        for index, part in enumerate(loc):
            if _UNION_TAG.match(part) and len(loc) > index + 1:
                members.setdefault(tuple(loc[:index]), set()).add(part)
    kept = []
    for item in items:
        loc = [str(p) for p in item["loc"]]
        tag = len(loc) - 1
        taken = members.get(tuple(loc[:tag]), set())
        if loc and _UNION_TAG.match(loc[tag]) and taken - {loc[tag]}:
            continue  # this member's type did not fit; another member's entries are reported
        kept.append(item)
    return kept


def format_validation_error(err: ValidationError, raw: dict[str, Any]) -> list[str]:
    """One line per problem of `err`; `raw` is the data validated (for the values given)."""
    lines = []
    for item in _unmatched_union_members(err.errors()):
        # pydantic adds the union member name for `int | Literal["auto"]` ("int",
        # "literal['auto']", "list[str]") and validator names to the location; drop them.
        loc = [str(p) for p in item["loc"] if not _UNION_TAG.match(str(p))]
        key = ".".join(loc)
        if item["type"] == "extra_forbidden":
            section, _, name = key.rpartition(".")
            candidates = _known_keys(section)
            prefix = f"{section}." if section else ""
            hint = did_you_mean(name, candidates)
            hint = hint.replace("'", f"'{prefix}", 1) if hint else ""
            lines.append(f"{key}: unknown key{hint}")
            continue
        if not loc:
            lines.append(item["msg"].removeprefix("Value error, "))
            continue
        given = _lookup(raw, loc)
        message = item["msg"].removeprefix("Value error, ")
        if loc[:3] in _UNSHOWN_VALUES:  # it may hold a secret: the message says which entry
            lines.append(f"{key}: {message}")
            continue
        lines.append(f"{key}: {message} (given: {given!r})")
    return sorted(set(lines), key=lines.index)


# Keys whose given values an error never repeats: a URL may carry credentials, and a token
# given where its variable's name belongs is a token.
_UNSHOWN_VALUES = (
    ["reward", "remote", "urls"], ["reward", "remote", "headers_env"],
    ["rollout", "vllm", "server_url"], ["rollout"],  # a section-level error shows the URL too
)  # fmt: skip

_UNION_TAG = re.compile(
    r"^(int|str|float|bool|none)$|^(literal|list|dict|tuple|set|function-[a-z]+)\["
)


def _known_keys(section: str) -> list[str]:
    model: type[BaseModel] | None = RunConfig
    for part in section.split(".") if section else []:
        if part.isdigit():  # an entry of a list of sections (`data.path.0`)
            continue
        field = model.model_fields.get(part) if model else None
        annotation = field.annotation if field else None
        model = _section_model(annotation, part)
    if model is None:
        return []
    return [
        k
        for k in model.model_fields
        if k not in ("explicit_keys", "override_notes", "deepspeed_source")
    ]


def _section_model(annotation: Any, name: str) -> type[BaseModel] | None:
    if name in TASK_SECTIONS:
        return TASK_SECTIONS[name]
    if name == "reward":
        return RewardSection
    if name == "rollout":
        return RolloutSection
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    # `str | list[DataSource]`: the section model inside a union or a list.
    for member in get_args(annotation):
        found = _section_model(member, name)
        if found is not None:
            return found
    return None


def _lookup(raw: dict[str, Any], loc: list[str]) -> Any:
    node: Any = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
