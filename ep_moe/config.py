"""Settings of dispatch and combine: `Config` (per call) and `NativeOptions` (the native kernels' settings,
per `Buffer`, or per call through ``Config.native``)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

DEFAULT_NUM_SMS = 24
"""SMs of a dispatch or combine when nothing else decides: ``Buffer.num_sms`` (a call without a `Config`) and
a layer whose backend takes no tuned count (`ep_moe.tuning.layer_plans` has the whole order)."""

# The bounds the kernels are compiled with (ep_moe/native/kernels/kernels.h).
MAX_CHUNKS_PER_PAIR = 256  # kMaxChunks: flag slots per source-destination pair
MAX_COPY_ENGINE_CHUNKS = 16  # kMaxCopyEngineChunks: chunks per pair of a copy-engine call
MAX_COPY_ENGINE_SHARE = 1024  # the binding's bound on one relative chunk size
MAX_COPY_ENGINE_STREAMS = 4  # kMaxCopyStreams: side streams of one copy-engine call

MODES = ("auto", "on", "off")
ENV_PREFIX = "EP_MOE_NATIVE_"
RENAMED_VARIABLES = {"EP_MOE_DISPATCH_PUSH_FRACTION": "EP_MOE_NATIVE_DISPATCH_PUSH_FRACTION",
                     "EP_MOE_COMBINE_PUSH_FRACTION": "EP_MOE_NATIVE_COMBINE_PUSH_FRACTION"}


@dataclass(frozen=True)
class NativeOptions:
    """Settings of the native kernels (the torch backend ignores them), frozen and checked on construction.

    Every rank of a group must hold equal options: every rank decides its path from them and from the counts all
    ranks share. The native backend checks that once per distinct value (a `ValueError` naming the field and the
    ranks). `from_env` fills the fields from ``EP_MOE_NATIVE_<FIELD>`` variables.

    Attributes:
        One comment per field below; each field's values, default and variable are in docs/configuration.md,
        section "Native kernel options", and what each does inside the kernels in docs/native.md.

    Raises:
        ValueError: naming the field and what it must be, for a bad value.
    """

    # Most flag-published chunks the rows of one source-destination pair are cut into (more start the receiver
    # sooner, fewer cost fewer handshakes); ints in [1, MAX_CHUNKS_PER_PAIR].
    dispatch_chunks: int = 64
    combine_chunks: int = 128
    # Rows a chunk holds at least, unless the pair has fewer (int >= 1).
    min_chunk_rows: int = 16
    # Share of the call's SMs that push rows over NVLink (at least one block, and one left for the others); in (0, 1).
    dispatch_push_fraction: float = 1 / 3
    combine_push_fraction: float = 1 / 3
    # "auto", "on" (whenever the host knows the layout) or "off": whether rows travel by the copy engine instead of
    # pusher blocks (ep_moe.native.policy).
    dispatch_copy_engine: str = "auto"
    combine_copy_engine: str = "auto"
    # Relative sizes of the chunks a copy-engine call cuts each pair's rows into: 1 to MAX_COPY_ENGINE_CHUNKS ints
    # in [1, MAX_COPY_ENGINE_SHARE] (a list is taken as a tuple). The fp8 field: a dispatch of FP8 rows.
    dispatch_copy_engine_shares: tuple[int, ...] = (6, 5, 4, 3, 2, 1)
    dispatch_copy_engine_fp8_shares: tuple[int, ...] = (3, 2, 1)
    combine_copy_engine_shares: tuple[int, ...] = (2, 5, 6, 5, 3, 2, 1)
    # Side streams a copy-engine call spreads its chunks over, round robin; ints in [1, MAX_COPY_ENGINE_STREAMS].
    dispatch_copy_engine_streams: int = 1
    combine_copy_engine_streams: int = 1
    # Whether a copy-engine call writes its chunks' flags on a stream of their own (bool).
    dispatch_copy_engine_flag_stream: bool = True
    combine_copy_engine_flag_stream: bool = False
    # "auto" (when the copy engine carries the combine), "on" or "off": whether the combine's reducers load rows by
    # bulk copies into shared memory.
    combine_bulk_reduce: str = "auto"
    # Whether the expert-major dispatch and combine at EP >= 2 fold their permute and reduce into the kernels (rows
    # left in the receive buffer, rows summed as they go out; the same results); False: the rank-major kernels with
    # a separate permute and reduce. Read from the buffer's options (the expert-major calls pass no config.native).
    expert_major_fused: bool = True

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, list) and field.name.endswith("_shares"):
                value = tuple(value)
                object.__setattr__(self, field.name, value)
            expected, accepts = _RULES[field.name]
            if not accepts(value):
                raise ValueError(f"ep_moe.NativeOptions: argument '{field.name}' must be {expected}, "
                                 f"got {value!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> NativeOptions:
        """Options whose fields come from ``environ`` (default `os.environ`) where set, else the defaults.

        Field ``f`` is read from ``EP_MOE_NATIVE_<F>`` (`NATIVE_OPTION_VARIABLES`): ints and floats as
        written, bools as ``1``/``0``/``true``/``false``/``on``/``off``, modes as ``auto``/``on``/``off``
        (or ``1``/``0``), shares as comma-separated ints. ``EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_SHARES`` sets
        the BF16/FP32 dispatch's shares only (it no longer sets the FP8 dispatch's too): those have their
        own variable, ``EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_FP8_SHARES``.

        Raises `ValueError` naming the variable and the field for a bad value, for an ``EP_MOE_NATIVE_*``
        variable that names no field (with the closest known name), and for the renamed
        ``EP_MOE_DISPATCH_PUSH_FRACTION`` / ``EP_MOE_COMBINE_PUSH_FRACTION``.
        """
        environ = os.environ if environ is None else environ
        for old, new in RENAMED_VARIABLES.items():
            if old in environ:
                raise ValueError(f"ep_moe.NativeOptions: environment variable {old} was renamed to {new}")
        for name in environ:
            if name.startswith(ENV_PREFIX) and name not in NATIVE_OPTION_VARIABLES:
                closest = difflib.get_close_matches(name, NATIVE_OPTION_VARIABLES, n=1, cutoff=0.0)
                raise ValueError(f"ep_moe.NativeOptions: unknown environment variable {name} (did you mean "
                                 f"{closest[0]}?); ep_moe.config.NATIVE_OPTION_VARIABLES lists the known ones")
        values = {}
        for field in fields(cls):
            variable = ENV_PREFIX + field.name.upper()
            if variable not in environ:
                continue
            raw = environ[variable]
            expected, accepts = _RULES[field.name]
            value = _parse(raw, field.default)
            if value is None or not accepts(value):
                raise ValueError(f"ep_moe.NativeOptions: environment variable {variable} (field "
                                 f"'{field.name}') must be {expected}{_ENV_SPELLING[type(field.default)]}, "
                                 f"got {raw!r}")
            values[field.name] = value
        return cls(**values)


NATIVE_OPTION_VARIABLES = tuple(ENV_PREFIX + field.name.upper() for field in fields(NativeOptions))
"""The environment variables `NativeOptions.from_env` reads, one per field, in field order."""


def _int_in(low: int, high: int | None = None) -> tuple[str, Callable[[object], bool]]:
    def accepts(value: object) -> bool:
        return (isinstance(value, int) and not isinstance(value, bool) and value >= low
                and (high is None or value <= high))

    return (f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"), accepts


def _fraction() -> tuple[str, Callable[[object], bool]]:
    return "a float in (0, 1)", lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < 1


def _mode() -> tuple[str, Callable[[object], bool]]:
    return "'auto', 'on' or 'off'", lambda v: isinstance(v, str) and v in MODES


def _flag() -> tuple[str, Callable[[object], bool]]:
    return "a bool", lambda v: isinstance(v, bool)


def _shares() -> tuple[str, Callable[[object], bool]]:
    one_share = _int_in(1, MAX_COPY_ENGINE_SHARE)[1]
    def accepts(value: object) -> bool:
        fits = isinstance(value, tuple) and 1 <= len(value) <= MAX_COPY_ENGINE_CHUNKS
        return fits and all(map(one_share, value))

    return f"a tuple of 1 to {MAX_COPY_ENGINE_CHUNKS} ints in [1, {MAX_COPY_ENGINE_SHARE}]", accepts


def _rules() -> dict[str, tuple[str, Callable[[object], bool]]]:
    """What each field must be (for messages) and the test of a value."""
    rules = {"min_chunk_rows": _int_in(1), "dispatch_copy_engine_fp8_shares": _shares(),
             "combine_bulk_reduce": _mode(), "expert_major_fused": _flag()}
    for op in ("dispatch", "combine"):
        rules.update({f"{op}_chunks": _int_in(1, MAX_CHUNKS_PER_PAIR), f"{op}_push_fraction": _fraction(),
                      f"{op}_copy_engine": _mode(), f"{op}_copy_engine_shares": _shares(),
                      f"{op}_copy_engine_streams": _int_in(1, MAX_COPY_ENGINE_STREAMS),
                      f"{op}_copy_engine_flag_stream": _flag()})
    return rules


_RULES = _rules()

# How a variable spells each kind of value (after what the field must be).
_ENV_SPELLING = {int: "", float: "", str: " (or 1 / 0 for on / off)", bool: " (1, 0, true, false, on or off)",
                 tuple: ", written as comma-separated ints"}
_TRUE, _FALSE = ("1", "true", "on"), ("0", "false", "off")


def _parse(raw: str, like: object) -> object | None:
    """``raw`` as a value of the type of ``like`` (a field's default), or None when it does not parse."""
    text = raw.strip().lower()
    try:
        if isinstance(like, bool):
            return True if text in _TRUE else False if text in _FALSE else None
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
        if isinstance(like, tuple):
            return tuple(int(part) for part in text.split(","))
    except ValueError:
        return None
    return {"1": "on", "0": "off"}.get(text, text)  # a mode


@dataclass(frozen=True)
class Config:
    """Settings of one dispatch or combine call (DeepEP passes one per call).

    Args:
        num_sms: streaming multiprocessors the native kernels may use (int >= 1; at least 2 are used).
        native: the native kernels' settings for this call; None: the buffer's (`Buffer.native_options`).
            Every rank must pass equal values in the same call; a value new to the buffer is checked across
            the ranks on its first use (which must not be inside a CUDA-graph capture).

    Raises:
        ValueError: ``num_sms`` is not an int >= 1, or ``native`` is not a `NativeOptions` or None.
    """

    num_sms: int = DEFAULT_NUM_SMS
    native: NativeOptions | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_sms, int) or isinstance(self.num_sms, bool) or self.num_sms < 1:
            raise ValueError(f"ep_moe.Config: argument 'num_sms' must be an int >= 1, got {self.num_sms!r}")
        if self.native is not None and not isinstance(self.native, NativeOptions):
            raise ValueError(f"ep_moe.Config: argument 'native' must be an ep_moe.NativeOptions or None, got "
                             f"{type(self.native).__name__}")
