"""`NativeOptions`: defaults, validation and the environment variables that fill it."""

from __future__ import annotations

import dataclasses
import re

import pytest
from locations import REPO

from ep_moe import Config, NativeOptions
from ep_moe import config as config_module
from ep_moe.config import DEFAULT_NUM_SMS, NATIVE_OPTION_VARIABLES

TODAY = dict(dispatch_chunks=64, combine_chunks=128, min_chunk_rows=16, dispatch_push_fraction=1 / 3,
             combine_push_fraction=1 / 3, dispatch_copy_engine="auto", combine_copy_engine="auto",
             dispatch_copy_engine_shares=(6, 5, 4, 3, 2, 1), dispatch_copy_engine_fp8_shares=(3, 2, 1),
             combine_copy_engine_shares=(2, 5, 6, 5, 3, 2, 1), dispatch_copy_engine_streams=1,
             combine_copy_engine_streams=1, dispatch_copy_engine_flag_stream=True,
             combine_copy_engine_flag_stream=False, combine_bulk_reduce="auto")


# ------------------------------------------------------------------------------------------ defaults
def test_defaults_are_the_kernels_tuned_values():
    assert dataclasses.asdict(NativeOptions()) == TODAY
    assert NativeOptions.from_env({}) == NativeOptions()
    assert Config().num_sms == DEFAULT_NUM_SMS == 24
    assert NATIVE_OPTION_VARIABLES == tuple("EP_MOE_NATIVE_" + name.upper() for name in TODAY)


def test_bounds_are_the_kernels_constants():
    kernels = (REPO / "ep_moe/native/csrc/kernels.h").read_text()
    constant = {name: int(value) for name, value in re.findall(r"constexpr int (\w+) = (\d+);", kernels)}
    assert config_module.MAX_CHUNKS_PER_PAIR == constant["kMaxChunks"]
    assert config_module.MAX_COPY_ENGINE_CHUNKS == constant["kMaxCopyEngineChunks"]
    assert config_module.MAX_COPY_ENGINE_STREAMS == constant["kMaxCopyStreams"]
    binding = (REPO / "ep_moe/native/csrc/binding.cpp").read_text()
    assert f"shares[k] <= {config_module.MAX_COPY_ENGINE_SHARE}" in binding


# ------------------------------------------------------------------------------------------ validation
BAD_VALUES = {
    "dispatch_chunks": (0, 257, 2.0, True, "64"),
    "combine_chunks": (0, -1, 300, None),
    "min_chunk_rows": (0, 1.5, False),
    "dispatch_push_fraction": (0, 1, 1.5, -0.1, float("nan"), "0.3", True),
    "combine_push_fraction": (0.0, 1.0, None),
    "dispatch_copy_engine": ("1", "0", "yes", "AUTO", True, None),
    "combine_copy_engine": ("sometimes", 1),
    "dispatch_copy_engine_shares": ((), (0,), (1025,), (1,) * 17, (1.5, 2), "6,5", 6, (True,)),
    "dispatch_copy_engine_fp8_shares": ([], [2000]),
    "combine_copy_engine_shares": ((2, -5),),
    "dispatch_copy_engine_streams": (0, 5, "1"),
    "combine_copy_engine_streams": (0, 4.0),
    "dispatch_copy_engine_flag_stream": (1, 0, "on", None),
    "combine_copy_engine_flag_stream": ("False",),
    "combine_bulk_reduce": ("1", "bulk", False),
}


def test_every_field_is_validated():
    assert set(BAD_VALUES) == {f.name for f in dataclasses.fields(NativeOptions)}
    for name, values in BAD_VALUES.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"ep_moe\.NativeOptions: argument '{name}' must be .*, got "):
                NativeOptions(**{name: value})
    edges = NativeOptions(dispatch_chunks=1, combine_chunks=256, min_chunk_rows=1, dispatch_push_fraction=0.01,
                          dispatch_copy_engine="on", combine_copy_engine="off", dispatch_copy_engine_shares=[1024],
                          combine_copy_engine_shares=list(range(1, 17)), dispatch_copy_engine_streams=4,
                          combine_bulk_reduce="on")
    assert edges.dispatch_copy_engine_shares == (1024,)  # lists become tuples: the options stay hashable
    assert edges.combine_copy_engine_shares == tuple(range(1, 17)) and hash(edges) != hash(NativeOptions())
    with pytest.raises(dataclasses.FrozenInstanceError):
        edges.dispatch_chunks = 2


# ------------------------------------------------------------------------------------------ from_env
def test_from_env_reads_every_kind_of_value():
    env = {"EP_MOE_NATIVE_DISPATCH_CHUNKS": " 32 ", "EP_MOE_NATIVE_MIN_CHUNK_ROWS": "1",
           "EP_MOE_NATIVE_COMBINE_PUSH_FRACTION": "0.25", "EP_MOE_NATIVE_DISPATCH_COPY_ENGINE": "1",
           "EP_MOE_NATIVE_COMBINE_COPY_ENGINE": " OFF ", "EP_MOE_NATIVE_COMBINE_BULK_REDUCE": "0",
           "EP_MOE_NATIVE_COMBINE_COPY_ENGINE_SHARES": "1, 3,1", "EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_STREAMS": "3",
           "EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_FLAG_STREAM": "false", "EP_MOE_NATIVE_COMBINE_COPY_ENGINE_FLAG_STREAM": "On",
           "EP_MOE_OTHER": "not ours", "PATH": "/usr/bin"}
    options = NativeOptions.from_env(env)
    assert options == NativeOptions(dispatch_chunks=32, min_chunk_rows=1, combine_push_fraction=0.25,
                                    dispatch_copy_engine="on", combine_copy_engine="off", combine_bulk_reduce="off",
                                    combine_copy_engine_shares=(1, 3, 1), dispatch_copy_engine_streams=3,
                                    dispatch_copy_engine_flag_stream=False, combine_copy_engine_flag_stream=True)
    for text, flag in (("1", True), ("0", False), ("TRUE", True), ("off", False)):
        assert NativeOptions.from_env({"EP_MOE_NATIVE_COMBINE_COPY_ENGINE_FLAG_STREAM": text}) \
            .combine_copy_engine_flag_stream is flag
    assert NativeOptions.from_env({"EP_MOE_NATIVE_DISPATCH_COPY_ENGINE": "auto"}).dispatch_copy_engine == "auto"


def test_from_env_reads_the_fp8_shares_from_their_own_variable():
    plain = NativeOptions.from_env({"EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_SHARES": "4,3,2,1"})
    assert plain.dispatch_copy_engine_shares == (4, 3, 2, 1) and plain.dispatch_copy_engine_fp8_shares == (3, 2, 1)
    fp8 = NativeOptions.from_env({"EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_FP8_SHARES": "2,1"})
    assert fp8.dispatch_copy_engine_fp8_shares == (2, 1) and fp8.dispatch_copy_engine_shares == (6, 5, 4, 3, 2, 1)


BAD_ENV = {
    "EP_MOE_NATIVE_DISPATCH_CHUNKS": ("0", "-4", "many", "2.5", "257", ""),
    "EP_MOE_NATIVE_MIN_CHUNK_ROWS": ("0",),
    "EP_MOE_NATIVE_DISPATCH_PUSH_FRACTION": ("1.5", "0", "x", "nan"),
    "EP_MOE_NATIVE_COMBINE_COPY_ENGINE": ("sometimes", "2", ""),
    "EP_MOE_NATIVE_COMBINE_BULK_REDUCE": ("yes", "", "2"),
    "EP_MOE_NATIVE_COMBINE_COPY_ENGINE_SHARES": ("0", "", "1,,2", "2.5", ",".join(["1"] * 17), "2000"),
    "EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_FP8_SHARES": ("3;2",),
    "EP_MOE_NATIVE_COMBINE_COPY_ENGINE_STREAMS": ("0", "5", "two", ""),
    "EP_MOE_NATIVE_DISPATCH_COPY_ENGINE_FLAG_STREAM": ("yes", "2", ""),
}


def test_from_env_rejects_bad_values_naming_the_variable_and_field():
    for variable, values in BAD_ENV.items():
        field = variable.removeprefix("EP_MOE_NATIVE_").lower()
        for value in values:
            with pytest.raises(ValueError, match=rf"{variable} \(field '{field}'\) must be .*, got {value!r}"):
                NativeOptions.from_env({variable: value})


def test_from_env_rejects_unknown_and_renamed_variables():
    for typo, meant in (("EP_MOE_NATIVE_DISPATCH_CHUNK", "EP_MOE_NATIVE_DISPATCH_CHUNKS"),
                        ("EP_MOE_NATIVE_COMBINE_COPY_ENGINE_STREAM", "EP_MOE_NATIVE_COMBINE_COPY_ENGINE_STREAMS"),
                        ("EP_MOE_NATIVE_COMBINE_BULK_REDUCER", "EP_MOE_NATIVE_COMBINE_BULK_REDUCE")):
        with pytest.raises(ValueError, match=rf"unknown environment variable {typo} \(did you mean {meant}\?\)"):
            NativeOptions.from_env({typo: "1"})
    for op in ("DISPATCH", "COMBINE"):
        with pytest.raises(ValueError, match=f"EP_MOE_{op}_PUSH_FRACTION was renamed to "
                                             f"EP_MOE_NATIVE_{op}_PUSH_FRACTION"):
            NativeOptions.from_env({f"EP_MOE_{op}_PUSH_FRACTION": "0.25"})
