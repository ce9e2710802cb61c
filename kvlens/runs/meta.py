"""A run's metadata, `RunMeta`: what the loop records about a run, and what `run.json` holds.

`run.json` is `RunMeta.to_json()`; reading it back (`RunMeta.from_json`) validates every entry and
refuses a bad file with one sentence (a `KvlensError`) that names the file and the first bad entry.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from kvlens.errors import KvlensError
from kvlens.levels import RecordLevel

SCHEMA_VERSION = 1
TENSOR_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}(/[A-Za-z0-9_.-]{1,64}){0,4}")


class _Section(BaseModel):
    """A part of run.json: entries it does not declare are kept as they are."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)


class ModelInfo(_Section):
    """The model a run ran: its spec (name or path), shape (`LoadedModel.shape()`), device and dtype."""

    spec: str
    shape: dict[str, Any]
    device: str | None = None
    dtype: str | None = None


class PolicyInfo(_Section):
    """The compression policy: its registry name and its parameters."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class Budget(_Section):
    """The budget asked for (slots, or a share of the prompt; None: none) and the slots per KV head it
    gave."""

    requested: int | float | None = None
    slots: int | None = None


def _level(value: Any) -> RecordLevel:
    """A record level by name (`full`, its name in older runs, is `attention`)."""
    try:
        return RecordLevel.parse(str(value))
    except KvlensError:
        raise ValueError(f"has an unknown record level '{str(value)[:40]}'") from None


class Record(_Section):
    """What the run recorded: the level, the layers (None: all) and the recorded tensors' dtype."""

    level: Annotated[RecordLevel, BeforeValidator(_level)] = RecordLevel.SUMMARY
    layers: list[int] | None = None
    dtype: str = "float16"


class TensorInfo(BaseModel):
    """One recorded tensor's dtype and shape, as `tensors.safetensors` must hold it."""

    dtype: str
    shape: list[int]


class RunMeta(_Section):
    """A run's metadata, in run.json's order: settings, texts, metrics, what was recorded, the extra entries
    callers add (`command`, `made_in`), then what `Run.save` fills in (schema, version, tensors, decisions).
    Entries run.json has that no field declares are kept (`model_extra`) and written back."""

    mode: Literal["generate", "teacher"] = "generate"
    """`generate`: the run chose its tokens; `teacher`: it scored given ones (perplexity)."""
    model: ModelInfo
    """The model the run ran."""
    policy: PolicyInfo
    """The compression policy and its parameters."""
    storage: dict[str, Any] | None = None
    """How the cache stored keys and values (`Storage.describe()`); None in runs older than storage."""
    prefill_chunk: int | None = None
    """Tokens per prefill chunk (None: the prompt in one pass)."""
    budget: Budget = Field(default_factory=Budget)
    """The budget asked for and the slots it gave."""
    seed: int | None = None
    """The sampling seed."""
    temperature: float | None = None
    """The sampling temperature (0: greedy)."""
    top_p: float | None = None
    """The nucleus sampling share (1: all tokens)."""
    prompt: str = ""
    """The prompt (or prefilled text) decoded."""
    prompt_tokens: list[int]
    """The prompt's (or prefill's) token ids."""
    prompt_token_strings: list[str] = Field(default_factory=list)
    """The prompt's tokens as the tokenizer's strings."""
    tokens: list[int]
    """The generated (or scored) token ids."""
    token_strings: list[str] = Field(default_factory=list)
    """The generated (or scored) tokens as the tokenizer's strings."""
    text: str = ""
    """The generated (or scored) tokens decoded."""
    metrics: dict[str, Any] = Field(default_factory=dict)
    """The loop's metrics (nll, ppl, cache sizes, times) and any measured later (perturbation, memory)."""
    record: Record = Field(default_factory=Record)
    """What the run recorded."""
    command: str | None = None
    """The command line (or call) that made the run."""
    made_in: str | None = None
    """Where the run was made when not on the command line (`app`)."""
    schema_version: int = Field(default=SCHEMA_VERSION, alias="schema")
    """run.json's format version (`schema` in the file)."""
    kvlens_version: str | None = None
    """The kvlens that saved the run."""
    tensors: dict[str, TensorInfo] = Field(default_factory=dict)
    """The recorded tensors by name, as saved."""
    decisions: int | None = None
    """The rows of the saved decision table."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, validate_by_name=True)

    @field_validator("tensors", mode="before")
    @classmethod
    def _plain_names(cls, tensors: Any) -> Any:
        """Tensor names that are plain relative paths (no `..`, nothing absolute), checked before their
        entries."""
        for name in tensors if isinstance(tensors, dict) else ():
            if not isinstance(name, str) or not TENSOR_NAME.fullmatch(name) or ".." in name.split("/"):
                raise ValueError(f"names a tensor '{str(name)[:80]}' that is not a plain kvlens tensor name")
        return tensors

    def to_json(self) -> str:
        """run.json's text: the entries set (those a loaded run.json lacked stay out), NaN kept."""
        return json.dumps(self.model_dump(by_alias=True, exclude_unset=True), indent=1, allow_nan=True)

    @classmethod
    def from_json(cls, text: bytes | str, path: Path) -> RunMeta:
        """The metadata in run.json's `text` (read from `path`), validated; a `KvlensError` if it is bad."""
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise KvlensError(f"{path} is not valid JSON ({err.__class__.__name__}).") from err
        _readable(data, path)
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise KvlensError(_sentence(path, err)) from None


def _readable(data: Any, path: Path) -> None:
    """Refuse what no `RunMeta` of this kvlens can be read from: anything but a JSON object whose integer
    schema is this kvlens's or older."""
    if not isinstance(data, dict) or type(data.get("schema")) is not int:
        raise KvlensError(f"{path} is not a kvlens run manifest (no integer 'schema').")
    if data["schema"] > SCHEMA_VERSION:
        raise KvlensError(
            f"{path.parent} was written by a newer kvlens ({data.get('kvlens_version', '?')}, "
            f"schema {data['schema']}); upgrade kvlens to read it."
        )
    if data["schema"] < 1:
        raise KvlensError(f"{path} has an unknown schema version {data['schema']}.")


def _sentence(path: Path, err: ValidationError) -> str:
    """One sentence for the first thing wrong with run.json: a check's own words (which follow the path),
    or the bad entry's dotted name (`model.spec`, `tokens.3`)."""
    first = err.errors()[0]
    if first["type"] == "value_error":
        return f"{path} {first['ctx']['error']}."
    return f"{path} lacks a valid '{'.'.join(map(str, first['loc']))}' entry."
