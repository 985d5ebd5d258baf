"""Load job specs from YAML, reporting every problem as `FILE:LINE:COL: field.path: message`.

The YAML is composed once into a node tree (which keeps line/column marks) and then constructed
into plain Python data for pydantic. Each pydantic error's `loc` is walked down the node tree to
find where it belongs: the value node for a bad value, the key node for an unknown key, the
enclosing mapping for a missing key.

Numbers: PyYAML follows YAML 1.1, where `1e-3` (no dot) and `1.0e3` (unsigned exponent) are
strings. The loader adds a resolver for those spellings so they are floats, as in YAML 1.2 and
JSON. Validation is strict everywhere else: a quoted `"1e-3"` or `steps: "ten"` is an error,
never silently converted.
"""

from __future__ import annotations

import datetime
import difflib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from parashift.models import resolve_section
from parashift.specs.base import FieldIssues, Loc
from parashift.specs.models import MODEL_SECTIONS, JobSpec
from pydantic import BaseModel, ValidationError

ROOT = "(root)"
JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec file; `line` and `column` are 1-based."""

    file: str
    line: int
    column: int
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {self.path}: {self.message}"


class SpecError(Exception):
    """A spec file that is not a valid job spec; `issues` says where and why."""

    def __init__(self, issues: list[SpecIssue]) -> None:
        self.issues = sorted(issues, key=lambda issue: (issue.file, issue.line, issue.column))
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """One `FILE:LINE:COL: field.path: message` line per issue."""
        return [str(issue) for issue in self.issues]

    def __reduce__(self) -> tuple[type[SpecError], tuple[list[SpecIssue]]]:
        return (SpecError, (self.issues,))


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as `1e-3` and `1.0e3` as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate the job spec at `path`; raise SpecError on any problem."""
    return parse_spec(read_source(path), str(path))


def read_source(path: str | Path) -> str:
    """The UTF-8 text of a spec-language file (a job spec, a pool file); SpecError, at the
    file's first line or the undecodable byte, when it cannot be read."""
    file = str(path)
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise SpecError([SpecIssue(file, 1, 1, ROOT, "no such file")]) from None
    except IsADirectoryError:
        raise SpecError([SpecIssue(file, 1, 1, ROOT, "is a directory, not a spec file")]) from None
    except OSError as error:
        reason = (error.strerror or str(error)).lower()
        raise SpecError([SpecIssue(file, 1, 1, ROOT, f"cannot read file: {reason}")]) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line_start = raw.rfind(b"\n", 0, error.start) + 1
        line = raw.count(b"\n", 0, error.start) + 1
        column = len(raw[line_start : error.start].decode("utf-8", errors="replace")) + 1
        message = f"not valid UTF-8: byte 0x{raw[error.start]:02x} cannot be decoded (save the file as UTF-8)"
        raise SpecError([SpecIssue(file, line, column, ROOT, message)]) from None


M = typing.TypeVar("M", bound=BaseModel)


def parse_document(text: str, source: str, model: type[M]) -> M:
    """Validate the YAML `text` as `model` (a section of the spec language: a job spec, a pool
    file), every problem a SpecError line at its place in `source`."""
    return _validated(text, source, model)[1]


def _validated(text: str, source: str, model: type[M]) -> tuple[yaml.MappingNode, M]:
    root, data = _read_yaml(text.removeprefix("\ufeff"), source)
    try:
        return root, model.model_validate(data)
    except ValidationError as error:
        raise SpecError(_issues_from(error, root, source, model)) from None


def parse_spec(text: str, source: str) -> JobSpec:
    """Validate the YAML `text` as a job spec, and read what its model refers to (a checkpoint
    folder's config: models.resolve_section); `source` names it in error messages."""
    root, spec = _validated(text, source, JobSpec)
    try:
        return resolve_model(spec)
    except FieldIssues as issues:
        raise SpecError([_issue(source, _locate(root, ("model", *loc), at_key=False), _dotted(("model", *loc)), message)
                         for loc, message in issues.issues]) from None


def resolve_model(spec: JobSpec) -> JobSpec:
    """`spec` with its model section resolved (a checkpoint folder's config read): FieldIssues
    (paths within `model`) when the folder contradicts the spec or cannot be read."""
    try:
        section = resolve_section(spec.model)
    except FieldIssues:
        raise
    except Exception as error:  # unreadable folder, storage error: one line at init_from
        raise FieldIssues([(("init_from",), f"cannot read {getattr(spec.model, 'init_from', '')}: {error}")]) from None
    return spec if section is spec.model else spec.model_copy(update={"model": section})


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a job spec, for editors and `parashift schema`."""
    schema = JobSpec.model_json_schema()
    schema.pop("title", None)
    return {"$schema": JSON_SCHEMA_DIALECT, "title": "parashift job spec", **schema}


# ---- YAML -------------------------------------------------------------------------------------


def _read_yaml(text: str, source: str) -> tuple[yaml.MappingNode, Any]:
    """Compose and construct one YAML document that must be a mapping without duplicate keys."""
    loader: _Loader | None = None
    try:
        loader = _Loader(text)
        root = loader.get_single_node()
        if root is None:
            message = "empty spec: expected a mapping with at least 'name'"
            raise SpecError([SpecIssue(source, 1, 1, ROOT, message)])
        if not isinstance(root, yaml.MappingNode):
            got = "a list" if isinstance(root, yaml.SequenceNode) else f"the scalar {root.value!r}"
            message = f"a job spec must be a mapping of sections (name, model, data, ...), got {got}"
            raise SpecError([_issue(source, root.start_mark, ROOT, message)])
        duplicates = _duplicate_keys(root, (), source, set())
        if duplicates:
            raise SpecError(duplicates)
        return root, loader.construct_document(root)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        kind = "YAML error" if isinstance(error, yaml.constructor.ConstructorError) else "YAML syntax error"
        message = f"{kind}: {error.problem or error.context}"
        if error.context and error.problem and error.context_mark is not None:
            message = f"{kind}: {error.context} (line {error.context_mark.line + 1}), {error.problem}"
        if "'\\t'" in message:
            message += " (indent with spaces, not tabs)"
        if mark is None:
            raise SpecError([SpecIssue(source, 1, 1, ROOT, message)]) from None
        raise SpecError([_issue(source, mark, ROOT, message)]) from None
    except yaml.reader.ReaderError as error:
        line = text.count("\n", 0, error.position) + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        character = f"#x{error.character:04x}" if isinstance(error.character, int) else repr(error.character)
        message = f"character {character} is not allowed in YAML"
        raise SpecError([SpecIssue(source, line, column, ROOT, message)]) from None
    except yaml.YAMLError as error:
        raise SpecError([SpecIssue(source, 1, 1, ROOT, f"YAML error: {error}")]) from None
    except RecursionError:
        raise SpecError([SpecIssue(source, 1, 1, ROOT, "YAML nested too deeply")]) from None
    finally:
        if loader is not None:
            loader.dispose()


def _duplicate_keys(node: yaml.Node, loc: Loc, source: str, seen: set[int]) -> list[SpecIssue]:
    """A duplicate key is an error (PyYAML would silently keep the last one)."""
    if id(node) in seen:  # aliases share nodes, and may even nest
        return []
    seen.add(id(node))
    issues: list[SpecIssue] = []
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = key_node.value
            if key in first_line:
                message = f"duplicate key {key!r} (first defined at line {first_line[key]})"
                issues.append(_issue(source, key_node.start_mark, _dotted((*loc, key)), message))
            else:
                first_line[key] = key_node.start_mark.line + 1
            issues.extend(_duplicate_keys(value_node, (*loc, key), source, seen))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            issues.extend(_duplicate_keys(item, (*loc, index), source, seen))
    return issues


def _locate(root: yaml.Node, loc: Loc, *, at_key: bool) -> yaml.Mark:
    """The mark of the node `loc` names, or of the deepest node on its way that exists."""
    node = root
    for depth, part in enumerate(loc):
        if isinstance(node, yaml.MappingNode):
            pair = next(
                (
                    (key, value)
                    for key, value in reversed(node.value)  # merged (`<<`) pairs come first; last wins
                    if isinstance(key, yaml.ScalarNode) and key.value == str(part)
                ),
                None,
            )
            if pair is None:
                break
            if at_key and depth == len(loc) - 1:
                return pair[0].start_mark
            node = pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
        else:
            break
    return node.start_mark


def _issue(source: str, mark: yaml.Mark, path: str, message: str) -> SpecIssue:
    return SpecIssue(source, mark.line + 1, mark.column + 1, path, message)


# ---- pydantic errors -> issues ---------------------------------------------------------------


def _issues_from(error: ValidationError, root: yaml.Node, source: str,
                 model: type[BaseModel] = JobSpec) -> list[SpecIssue]:
    issues: list[SpecIssue] = []
    for detail in error.errors():
        loc = tuple(part for part in detail["loc"] if not (isinstance(part, str) and "[" in part))
        if detail["type"] == "model_family":  # the discriminator itself: point at `family:`
            family = detail["input"].get("family") if isinstance(detail["input"], dict) else None
            loc = (*loc, "family")
            names = ", ".join(repr(name) for name in MODEL_SECTIONS)
            detail = {**detail, "msg": f"must be one of {names}, got {_describe(family)}"}
        known = _known_keys(detail["loc"][:-1], model) if detail["type"] == "extra_forbidden" else []
        loc = _without_family_tag(loc)
        cause = detail.get("ctx", {}).get("error")
        if isinstance(cause, FieldIssues):
            for relative, message in cause.issues:
                full = (*loc, *relative)
                mark = _locate(root, full, at_key=cause.at_key)
                issues.append(_issue(source, mark, _dotted(full), message))
            continue
        at_key = detail["type"] == "extra_forbidden"
        issues.append(_issue(source, _locate(root, loc, at_key=at_key), _dotted(loc), _message(detail, loc, known)))
    return issues


def _without_family_tag(loc: Loc) -> Loc:
    """pydantic names the family a `model:` section was validated as (`model.llama.n_heads`);
    the file has no such key."""
    if len(loc) >= 2 and loc[0] == "model" and loc[1] in MODEL_SECTIONS:
        return (loc[0], *loc[2:])
    return loc


def _dotted(loc: Loc) -> str:
    return ".".join(str(part) for part in loc) or ROOT


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "tuple_type": "a list",
}
# Literal values people write for one the spec names differently: suggested by meaning, not
# by spelling ("gpu" is closest to "cpu").
_MEANT = {"gpu": "cuda", "gpus": "cuda", "nvidia": "cuda"}
_NUMBER = re.compile(r"^\s*[-+]?(\d[\d_]*(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*$")


def _message(detail: Any, loc: Loc, known: list[str]) -> str:
    """A human sentence for one pydantic error."""
    kind: str = detail["type"]
    value = detail.get("input")
    ctx: dict[str, Any] = detail.get("ctx", {})
    if kind == "missing":
        return f"missing required key {loc[-1]!r}"
    if kind == "extra_forbidden":
        message = f"unknown key {loc[-1]!r}"
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        if close:
            return f"{message}; did you mean {close[0]!r}?"
        return f"{message} (expected one of: {', '.join(known)})" if known else message
    if kind in _EXPECTED:
        message = f"expected {_EXPECTED[kind]}, got {_describe(value)}"
        if isinstance(value, str) and _NUMBER.match(value):
            message += " (write numbers without quotes)"
        return message
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        message = f"must be {ctx.get('expected')}, got {_describe(value)}"
        meant = _MEANT.get(str(value).lower())
        close = [meant] if meant in choices else difflib.get_close_matches(str(value), choices, n=1, cutoff=0.6)
        return f"{message}; did you mean {close[0]!r}?" if close else message
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        return str(ctx["error"])
    message = str(detail["msg"]).replace("Input should be", "must be", 1)
    message = message[:1].lower() + message[1:]
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of"):
        message += f", got {_describe(value)}"
    return message


def _known_keys(loc: Loc, model: type[BaseModel] = JobSpec) -> list[str]:
    """The field names of the model that `loc` (pydantic's, family tags included) points into
    (empty if it is not a model)."""
    current: Any = model
    for part in loc:
        if part in MODEL_SECTIONS and not (isinstance(current, type) and issubclass(current, BaseModel)):
            current = MODEL_SECTIONS[str(part)]  # the family `model:` was validated as
        elif isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            current = current.model_fields[str(part)].annotation
        elif isinstance(part, int) and typing.get_origin(current) is list:
            current = typing.get_args(current)[0]
        else:
            return []
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _describe(value: Any) -> str:
    if value is None:
        return "null (an empty value)"
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value!r}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, datetime.date):
        return f"date {value.isoformat()}"
    return type(value).__name__
