"""The job file: YAML read with a safe loader, checked key by key, loaded into dataclasses.

Every refusal names the key path, the value it got and the form it expected, so a user can fix
the file without reading this code. `--set a.b=value` overrides are applied to the raw mapping
before checking, so they get exactly the same checks as the file.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

import yaml

from mtplx.checks import (BOOL_VERIFY, boolean, check_fields, checks_of, integer, number, one_of, optional, setting,
                          string, string_list)
from mtplx.config import GGUF_MODES, ScheduleConfig, SpeculativeConfig
from mtplx.request import SamplingParams

from ..errors import JobError
from .columns import OUTPUT_COLUMN_NAMES
from .schema import INPUT_FORMATS, SHORTHAND, check_job_dict
from .template import parse_template


def pinned(check, default: Any = MISSING, *, default_factory: Any = MISSING):
    """A field that decides which rows exist or what text they get: it joins the job fingerprint
    (fingerprint.py), so a resume that changes it is refused. `check`: its job-file check."""
    return setting(check, default, default_factory=default_factory, pinned=True)


@dataclass
class ModelConfig:
    path: str = setting(string)  # pinned through the resolved directory and its files (fingerprint.model_parts)
    revision: Optional[str] = setting(optional(string), None)  # pinned as is (fingerprint.py)
    trust_remote_code: bool = setting(boolean, False)
    # a GGUF model: auto | dequantize | quantized (pinned: each mode resolves to its own directory)
    gguf_mode: str = setting(one_of(*GGUF_MODES), "auto")

    def __post_init__(self):
        check_fields(self, "model")


@dataclass
class InputConfig:
    path: str = pinned(string)
    format: str = pinned(one_of(*INPUT_FORMATS), "parquet")
    split: str = pinned(string, "train")
    id_column: Optional[str] = pinned(optional(string), None)  # None: a stable hash of the row content
    prompt_column: Optional[str] = pinned(optional(string), None)  # None: "prompt" unless a template or messages are used
    messages_column: Optional[str] = pinned(optional(string), None)
    template: Optional[str] = pinned(optional(string), None)
    chat_template: str = pinned(one_of("auto", "on", "off", aliases=BOOL_VERIFY), "auto")  # auto | on | off
    limit: Optional[int] = setting(optional(integer(1)), None)  # only the first N input rows (a CLI --limit wins)

    def __post_init__(self):
        check_fields(self, "input")
        problems = []
        if self.format == "openai-batch":
            # OpenAI Batch API request files: custom_id is the id, body.messages the prompt (openai_batch.py)
            self.id_column = self.id_column or "custom_id"
            self.messages_column = self.messages_column or "messages"
            if self.id_column != "custom_id" or self.messages_column != "messages":
                problems.append("input.format: openai-batch reads custom_id as the id and body.messages as the "
                                "prompt; remove input.id_column / input.messages_column")
            if self.prompt_column or self.template is not None:
                problems.append("input.format: openai-batch takes the prompt from body.messages; remove "
                                "input.prompt_column / input.template")
        if self.messages_column and (self.template is not None or self.prompt_column):
            problems.append("input.messages_column: give only one of messages_column, template, prompt_column")
        if self.template is not None and self.prompt_column:
            problems.append("input.template: give only one of template and prompt_column "
                            "(a template reads any columns by name: '{question}')")
        if self.template is not None:
            try:
                parse_template(self.template)
            except ValueError as e:
                problems.append(f"input.template: {e}, got {self.template!r}")
        if problems:
            raise ValueError("\n  ".join(problems))

    @property
    def prompt_mode(self) -> str:
        if self.messages_column:
            return "messages"
        return "template" if self.template is not None else "column"

    @property
    def prompt_field(self) -> str:
        return self.prompt_column or "prompt"


@dataclass
class GenerationConfig:
    max_tokens: int = pinned(integer(1), 256)
    temperature: float = pinned(number(0.0), 0.0)
    top_p: float = pinned(number(0.0, 1.0, lo_open=True), 1.0)
    top_k: int = pinned(integer(0), 0)
    seed: int = pinned(integer(0), 0)
    stop: List[str] = pinned(string_list, default_factory=list)
    n: int = pinned(integer(1), 1)

    def __post_init__(self):
        check_fields(self, "generation")

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop),
        )


@dataclass
class OutputConfig:
    dir: str = setting(string)
    shard_rows: int = setting(integer(1), 1000)
    keep_columns: List[str] = pinned(string_list, default_factory=list)  # they change the shard schema

    def __post_init__(self):
        check_fields(self, "output")


@dataclass
class OrderingConfig:
    """Pipeline-side scheduling knobs; they live under `schedule:` in the job file."""

    window_rows: int = setting(integer(1), 4096)  # rows ordered together; bounds memory, see ordering.py
    min_prefix_tokens: int = setting(integer(1), 16)  # shorter shared prefixes are not worth a prefill edge

    def __post_init__(self):
        check_fields(self, "schedule")


@dataclass
class ExecutorConfig:
    type: str = setting(one_of("local", "ray"), "local")
    address: Optional[str] = setting(optional(string), None)
    concurrency: int = setting(integer(1), 1)
    num_gpus: float = setting(number(0.0), 0)

    def __post_init__(self):
        check_fields(self, "executor")


@dataclass
class JobConfig:
    name: str
    model: ModelConfig
    input: InputConfig
    output: OutputConfig
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    ordering: OrderingConfig = field(default_factory=OrderingConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    def to_dict(self) -> Dict[str, Any]:
        """The job as a plain mapping in the job file's own shape (what `job.yaml` stores)."""
        out = {
            "name": self.name,
            "model": asdict(self.model),
            "speculative": asdict(self.speculative),
            "input": asdict(self.input),
            "generation": asdict(self.generation),
            "schedule": {**asdict(self.schedule), **asdict(self.ordering)},
            "output": asdict(self.output),
            "executor": asdict(self.executor),
        }
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# The job file's sections and each key's check, read off the fields above (`schedule:` holds the
# engine's ScheduleConfig and the pipeline's OrderingConfig).
SECTIONS = {
    "model": checks_of(ModelConfig),
    "speculative": checks_of(SpeculativeConfig),
    "input": checks_of(InputConfig),
    "generation": checks_of(GenerationConfig),
    "schedule": {**checks_of(ScheduleConfig), **checks_of(OrderingConfig)},
    "output": checks_of(OutputConfig),
    "executor": checks_of(ExecutorConfig),
}


def _abspath_if_local(p: str) -> str:
    # Keeps known model names and hub ids as they are; a local path is pinned so that
    # `resume RUN_DIR` works from any working directory.
    if any(ch in p for ch in "*?["):
        return os.path.abspath(os.path.expanduser(p))
    expanded = os.path.expanduser(p)
    return os.path.abspath(expanded) if os.path.exists(expanded) else p


def path_note(p: str) -> str:
    """A job path for a message; a relative one names the base it was looked up from."""
    if os.path.isabs(os.path.expanduser(p)):
        return repr(p)
    return f"{p!r} (relative to the working directory {os.getcwd()}, as every path in a job file is)"


def build_job(raw: Any, default_name: str = "job") -> JobConfig:
    s = check_job_dict(raw, SECTIONS, default_name)
    name = s["name"]
    problems = []
    try:
        inp = InputConfig(**s["input"])
        inp.path = _abspath_if_local(inp.path)
    except ValueError as e:
        problems.append(str(e))
    sched = dict(s["schedule"])
    if sched.get("calibration"):
        sched["calibration"] = os.path.abspath(os.path.expanduser(sched["calibration"]))
    ordering = OrderingConfig(**{k: sched.pop(k) for k in ("window_rows", "min_prefix_tokens") if k in sched})
    output = OutputConfig(**{"dir": f"runs/{name}", **s["output"]})
    output.dir = os.path.abspath(os.path.expanduser(output.dir))
    reserved = set(OUTPUT_COLUMN_NAMES)
    for col in output.keep_columns:
        if col in reserved:
            problems.append(f"output.keep_columns: {col!r} clashes with an output column; rename it in the input")
    try:
        spec = SpeculativeConfig(**s["speculative"])
        for key in ("mtp_head", "draft_model"):  # resolved as input.path is
            if getattr(spec, key):
                setattr(spec, key, _abspath_if_local(getattr(spec, key)))
    except ValueError as e:
        problems.append(str(e))
        spec = None
    try:
        schedule = ScheduleConfig(**sched)
    except ValueError as e:
        problems.append(str(e))
        schedule = None
    if problems:
        raise JobError("invalid job:\n  " + "\n  ".join(problems))
    model = ModelConfig(**s["model"])
    model.path = _abspath_if_local(model.path)
    return JobConfig(
        name=name,
        model=model,
        input=inp,
        output=output,
        speculative=spec,
        generation=GenerationConfig(**s["generation"]),
        schedule=schedule,
        ordering=ordering,
        executor=ExecutorConfig(**s["executor"]),
    )


def section_config(cls, section: str, value: Any):
    """`value` as the `cls` of the job file's `section:` (e.g. GenerationConfig, "generation"),
    checked as the job file is: a mapping key by key (unknown keys named), an instance field by
    field. For settings given in Python rather than in a job file (MTPLXPredictor)."""
    if isinstance(value, cls):
        check_fields(value, section)  # fields may have been set after construction
        return value
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"{section}: expected a {cls.__name__} or a dict of its fields, got {type(value).__name__}")
    return cls(**check_job_dict({section: value or {}}, {section: checks_of(cls)})[section])


def parse_override(text: str) -> tuple:
    """`a.b.c=value` into (["a", "b", "c"], value), the value read as a YAML scalar or list."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise JobError(f"--set {text!r}: expected key.path=value, e.g. generation.max_tokens=64")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise JobError(f"--set {text!r}: the value is not valid YAML ({e.problem})")
    return key.strip().split("."), parsed


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            elif not isinstance(child, dict):
                if depth == 0 and key in SHORTHAND:
                    child = node[key] = {SHORTHAND[key]: child}
                else:
                    where = ".".join(keys[: depth + 1])
                    raise JobError(f"--set {text!r}: {where} is {child!r}, not a mapping")
            node = child
        node[keys[-1]] = value
    return raw


def read_job_file(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise JobError(f"job file {str(p)!r}: cannot read it ({e.strerror})")
    except UnicodeDecodeError:
        raise JobError(f"job file {str(p)!r}: not UTF-8 text")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise JobError(f"job file {str(p)!r}: not valid YAML{where}: {getattr(e, 'problem', e)}")
    return raw if raw is not None else {}


def load_job(path: Union[str, os.PathLike], overrides: Sequence[str] = ()) -> JobConfig:
    raw = read_job_file(path)
    if isinstance(raw, dict):
        raw = apply_overrides(raw, overrides)
    try:
        return build_job(raw, default_name=Path(path).stem)
    except JobError as e:
        raise JobError(f"{path}: {e}") from None
