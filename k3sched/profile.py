"""The measured-profile document (``schedule.profile``): :class:`Profile`, what the cost model
reads of a profile YAML, and :func:`load_profile`, which checks the YAML strictly ([Note: profile
document]) before anything uses it. What each field replaces in the analytic model is described in
the module docstring of :mod:`k3sched.cost`; ``runtime.measure.write_profile`` and ``k3sched
calibrate`` write such files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, ValidationError, create_model

from .yamlfile import ConfigError, read_text_file, show_value, yaml_load
from .tasks import FWD_KINDS, LANE_OF, LANES, Kind

@dataclass
class Profile:
    """Measured per-kind durations (µs per task, one core), per-lane bandwidths (GB/s), per-lane
    latency (µs per call) and link efficiency (achieved / configured link rate)."""

    durations_us: dict[str, float] = field(default_factory=dict)
    bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    source: str = ""
    saved_bytes: dict[str, int | tuple[int, int]] = field(default_factory=dict)
    latency_us: dict[str, float] = field(default_factory=dict)
    link_efficiency: dict[str, float] = field(default_factory=dict)
    overhead_us: dict[str, float] = field(default_factory=dict)
    """Per communication kind: the fixed host-side cost (routing bookkeeping, permutes, buffers)
    that replaces ``hardware.launch_us`` in its duration (the wire time comes on top)."""
    comm_cpu_ns_per_byte: float | None = None
    """Fitted CPU cost of a transferred byte (replaces ``hardware.comm_cpu_ns_per_byte``)."""
    layer_us: list[float] = field(default_factory=list)
    """Measured time of each model layer per micro-batch (compute plus exposed EP), for
    ``parallel.layer_split: profile`` ([Note: profile split] in k3sched/rebalance.py); empty: none."""
    embed_us: float = 0.0
    head_us: float = 0.0
    p2p_us: float = 0.0
    """Measured embedding, head (forward and backward) and exposed P2P receive time per micro-batch."""
    time_cv: dict[str, float] = field(default_factory=dict)
    """Per compute kind: std / mean of its measured cost (replaces ``hardware.task_time_cv`` for the
    kind; [Note: task-time spread] in k3sched/variability.py)."""
    per_expert_us: dict[str, float] = field(default_factory=dict)
    """Per expert kind: the part of its ``durations_us`` (measured with all ``model.experts`` on one
    rank) that each local expert costs whatever its tokens ([Note: per-expert cost] in k3sched/cost.py)."""


PROFILE_FORMAT = "k3sched.profile/1"
_MAX_PROFILE_BYTES = 16 << 20
_MAX_US = 1e9  # µs: about 17 minutes for one task or one call
_MAX_SAVED = 1 << 50  # bytes of one activation set (1 PiB)
_KINDS = tuple(k.value for k in Kind)
_DX_SAVED = ("attn.dx", "expert.dx", "shared.dx", "mlp.dx", "head.dx")  # CostModel.grad_out_bytes kinds
_FWD_SAVED = tuple(k.value for k in Kind if k in FWD_KINDS)
_SAVED_KINDS = _FWD_SAVED + _DX_SAVED
_COMM_KINDS = tuple(k.value for k in Kind if LANE_OF[k] != "compute")
EXPERT_OPS = (Kind.EXPERT_FWD.value, Kind.EXPERT_DX.value, Kind.EXPERT_DW.value)
"""The kinds a profile's ``per_expert_us`` may name ([Note: per-expert cost] in k3sched/cost.py)."""
# [Note: profile document] A profile YAML is checked strictly and in full before the cost model
# uses it (ConfigError naming the file, the key path, the value and what is allowed): only the
# keys below; each section a mapping (a null or a list is an error, leave it out instead); names
# are task kinds (k3sched.tasks.Kind values), communication kinds (off the compute lane: the only
# ones with an overhead) or lanes; numbers are finite, never booleans or strings, within the
# ranges below; ``saved_bytes`` holds integers: N or [w, x] for forward kinds, N for the dX kinds
# whose output gradient the cost model keeps. Section: (names, what they are, low, low open?,
# high, unit).
_PROFILE_MAPS: dict[str, tuple[tuple[str, ...], str, float, bool, float, str]] = {
    "durations_us": (_KINDS, "task kind", 0.0, False, _MAX_US, "µs per task"),
    "bandwidth_gbps": (LANES, "lane", 0.0, True, 1e6, "GB/s"),
    "latency_us": (LANES, "lane", 0.0, False, _MAX_US, "µs per call"),
    "link_efficiency": (LANES, "lane", 0.0, True, 1.0, "achieved / configured link rate"),
    "overhead_us": (_COMM_KINDS, "communication kind", 0.0, False, _MAX_US, "µs per task"),
    "time_cv": (_KINDS, "task kind", 0.0, False, 10.0, "std / mean of the task's cost"),
    "per_expert_us": (EXPERT_OPS, "MoE expert kind", 0.0, False, _MAX_US, "µs per local expert"),
}
_CPU_NS = (0.0, False, 1e6)


def _finite(low: float, low_open: bool, high: float) -> Any:
    return Annotated[float, Field(**({"gt": low} if low_open else {"ge": low}), le=high, allow_inf_nan=False)]


def _span(low: float, low_open: bool, high: float) -> str:
    return f"{'>' if low_open else '>='} {low:g} and <= {high:g}"


_Bytes = Annotated[int, Field(ge=0, le=_MAX_SAVED)]
_ProfileDoc = create_model(
    "_ProfileDoc",
    __config__=ConfigDict(strict=True, extra="forbid"),
    format=(Literal[PROFILE_FORMAT], PROFILE_FORMAT),
    source=(str, ""),
    **{name: (dict[Literal[names], _finite(low, low_open, high)], {})  # type: ignore[valid-type]
       for name, (names, _, low, low_open, high, _) in _PROFILE_MAPS.items()},
    comm_cpu_ns_per_byte=(_finite(*_CPU_NS), None),
    layer_us=(Annotated[list[_finite(0.0, False, _MAX_US)], Field(max_length=4096)], []),  # type: ignore[valid-type]
    embed_us=(_finite(0.0, False, _MAX_US), 0.0),
    head_us=(_finite(0.0, False, _MAX_US), 0.0),
    p2p_us=(_finite(0.0, False, _MAX_US), 0.0),
    saved_bytes=(dict[Literal[_SAVED_KINDS],  # type: ignore[valid-type]
                      Union[_Bytes, Annotated[list[_Bytes], Field(min_length=2, max_length=2)]]], {}),
)
"""The profile YAML as a strict pydantic model ([Note: profile document])."""


def load_profile(path: str | Path) -> Profile:
    """Read a measured profile YAML (see the module docstring and [Note: profile document]).
    Raises ConfigError, one line naming the file, the key path, the value and what is allowed."""
    p = Path(path)
    where = f"schedule.profile: {p}"
    try:
        text = read_text_file(p, "profile", _MAX_PROFILE_BYTES)
        data = yaml_load(text, str(p))
    except ConfigError as e:
        raise ConfigError(f"schedule.profile: {e}") from None
    keys = list(_ProfileDoc.model_fields)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping (got {show_value(data)}); allowed: keys {', '.join(keys)}")
    try:
        doc = _ProfileDoc.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{where}: {_profile_error(err, data)}") from None
    saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in doc.saved_bytes.items()}
    for k, v in saved.items():
        if isinstance(v, tuple) and k in _DX_SAVED:
            raise ConfigError(f"{where}: saved_bytes: {k} must be one number of bytes (got {list(v)}); allowed: "
                              f"[w, x] pairs only for forward kinds ({', '.join(_FWD_SAVED)})")
    return Profile(dict(doc.durations_us), dict(doc.bandwidth_gbps), str(p), saved, dict(doc.latency_us),
                   dict(doc.link_efficiency), dict(doc.overhead_us), doc.comm_cpu_ns_per_byte,
                   layer_us=[float(x) for x in doc.layer_us], embed_us=float(doc.embed_us),
                   head_us=float(doc.head_us), p2p_us=float(doc.p2p_us), time_cv=dict(doc.time_cv),
                   per_expert_us=dict(doc.per_expert_us))


def _got(value: Any) -> str:
    text = show_value(value)
    return text + " (a YAML boolean)" if isinstance(value, bool) else text


def _profile_error(err: ValidationError, data: dict) -> str:
    """One line for the first error of a profile document: key path, value, what is allowed."""
    e = err.errors()[0]
    loc = e["loc"]
    section = loc[0]
    keys = ", ".join(_ProfileDoc.model_fields)
    if e["type"] == "extra_forbidden":
        return f"unknown key {show_value(section)}; allowed: {keys}"
    raw = data.get(section)
    if section in _PROFILE_MAPS or section == "saved_bytes":
        names, what = ((_SAVED_KINDS, "task kind with saved bytes") if section == "saved_bytes"
                       else _PROFILE_MAPS[section][:2])
        if len(loc) == 1:
            return (f"{section} must be a mapping of {what}: number (got {show_value(raw)}); allowed: a mapping "
                    f"(leave {section} out when nothing is measured)")
        name = loc[1]
        if len(loc) > 2 and loc[2] == "[key]":
            if what == "lane":
                return f"{section}: unknown lane {show_value(name)}; lanes: {', '.join(names)}"
            if name not in _KINDS:
                return f"{section}: unknown task kind {show_value(name)}; allowed: {what}s: {', '.join(names)}"
            return f"{section}: {name} is not a {what}; allowed: {', '.join(names)}"
        value = _got(raw.get(name) if isinstance(raw, dict) else e.get("input"))
        if section == "saved_bytes":
            return (f"saved_bytes: {name} must be bytes N or [w, x] (got {value}); allowed: integers "
                    f">= 0 and <= 2^50")
        _, _, low, low_open, high, unit = _PROFILE_MAPS[section]
        return (f"{section}: {name} must be a finite number {_span(low, low_open, high)} (got {value}); "
                f"allowed: {unit}, a finite number {_span(low, low_open, high)}")
    if section in ("layer_us", "embed_us", "head_us", "p2p_us"):
        what = ("a list of at most 4096 finite numbers >= 0 and <= 1e9, one per model layer"
                if section == "layer_us" else "a finite number >= 0 and <= 1e9")
        return f"{section}: {e['msg']} (got {_got(data.get(section))}); allowed: µs per micro-batch, {what}"
    if section == "comm_cpu_ns_per_byte":
        return (f"comm_cpu_ns_per_byte must be a finite number {_span(*_CPU_NS)} (got {_got(data.get(section))}); "
                f"allowed: ns of CPU per byte sent or received")
    if section == "format":
        return f"format: unknown profile format (got {show_value(data.get(section))}); allowed: {PROFILE_FORMAT}"
    return f"{section}: {e['msg']} (got {show_value(data.get(section))}); allowed: a string"
