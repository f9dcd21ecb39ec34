"""`NativeOptions`: defaults, validation, the environment variables that fill it, the native policy it steers
(chunking, copy engine, bulk reducers) and the check that every rank holds equal options."""

from __future__ import annotations

import dataclasses
import re

import pytest
from locations import REPO

from ep_moe import Buffer, Config
from ep_moe import config as config_module
from ep_moe.config import DEFAULT_NUM_SMS, NATIVE_OPTION_VARIABLES, NativeOptions
from ep_moe.distributed import run_distributed
from ep_moe.native import policy

TODAY = dict(dispatch_chunks=64, combine_chunks=128, min_chunk_rows=16, dispatch_push_fraction=1 / 3,
             combine_push_fraction=1 / 3, dispatch_copy_engine="auto", combine_copy_engine="auto",
             dispatch_copy_engine_shares=(6, 5, 4, 3, 2, 1), dispatch_copy_engine_fp8_shares=(3, 2, 1),
             combine_copy_engine_shares=(2, 5, 6, 5, 3, 2, 1), dispatch_copy_engine_streams=1,
             combine_copy_engine_streams=1, dispatch_copy_engine_flag_stream=True,
             combine_copy_engine_flag_stream=False, combine_bulk_reduce="auto", expert_major_fused=True)


# ------------------------------------------------------------------------------------------ defaults
def test_defaults_are_the_kernels_tuned_values():
    assert dataclasses.asdict(NativeOptions()) == TODAY
    assert NativeOptions.from_env({}) == NativeOptions()
    assert Config() == Config(num_sms=24, native=None) and DEFAULT_NUM_SMS == 24 and Buffer.num_sms == 24
    assert NATIVE_OPTION_VARIABLES == tuple("EP_MOE_NATIVE_" + name.upper() for name in TODAY)


def test_bounds_are_the_kernels_constants():
    kernels = (REPO / "ep_moe/native/kernels/kernels.h").read_text()
    constant = {name: int(value) for name, value in re.findall(r"constexpr int (\w+) = (\d+);", kernels)}
    assert config_module.MAX_CHUNKS_PER_PAIR == constant["kMaxChunks"]
    assert config_module.MAX_COPY_ENGINE_CHUNKS == constant["kMaxCopyEngineChunks"]
    assert config_module.MAX_COPY_ENGINE_STREAMS == constant["kMaxCopyStreams"]
    launcher = (REPO / "ep_moe/native/jit/intranode.py").read_text()  # the copy-engine launch checks each share
    assert f"1 <= share <= {config_module.MAX_COPY_ENGINE_SHARE}" in launcher


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
    "expert_major_fused": (1, "off", None),
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


def test_config_and_buffer_arguments(solo_group, monkeypatch):
    with pytest.raises(ValueError, match="'native'"):
        Config(native={"dispatch_chunks": 32})
    for bad in (0, 2.0, None):
        with pytest.raises(ValueError, match="'num_sms'"):
            Config(num_sms=bad)
    mine = NativeOptions(combine_chunks=32)
    buffer = Buffer(solo_group, backend="torch", native_options=mine)
    assert buffer.native_options is mine
    buffer.destroy()
    with pytest.raises(ValueError, match="'native_options'"):
        Buffer(solo_group, backend="torch", native_options={"combine_chunks": 32})
    monkeypatch.setenv("EP_MOE_NATIVE_COMBINE_CHUNKS", "32")
    from_env = Buffer(solo_group, backend="torch")  # no options: the environment's, read once here
    assert from_env.native_options == mine
    from_env.destroy()
    monkeypatch.setenv("EP_MOE_NATIVE_COMBINE_CHUNK", "32")
    with pytest.raises(ValueError, match="EP_MOE_NATIVE_COMBINE_CHUNKS"):
        Buffer(solo_group, backend="torch")


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
    assert policy.copy_engine_shares(fp8, "dispatch", fp8=True) == [2, 1]
    assert policy.copy_engine_shares(fp8, "dispatch") == [6, 5, 4, 3, 2, 1]


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


# ------------------------------------------------------------------------------------------ policy
def test_chunk_counts_follow_the_kernels():
    # rows of a pair -> chunks: at most 64 (dispatch) / 128 (combine), each of at least 16 rows
    cases = {("dispatch", 4096): 64, ("dispatch", 4097): 64, ("combine", 4096): 128, ("dispatch", 510): 32,
             ("combine", 512): 32, ("dispatch", 17): 2, ("dispatch", 8): 1, ("combine", 0): 0, ("dispatch", 0.4): 0}
    for (op, rows), chunks in cases.items():
        assert policy.num_chunks(NativeOptions(), op, rows) == chunks, (op, rows)
    fine = NativeOptions(min_chunk_rows=1)
    assert policy.num_chunks(fine, "dispatch", 40) == 40 and policy.num_chunks(fine, "dispatch", 200) == 50
    few = NativeOptions(dispatch_chunks=8, combine_chunks=4)
    assert policy.num_chunks(few, "dispatch", 4096) == 8 and policy.num_chunks(few, "combine", 4096) == 4
    assert policy.chunks_per_pair(few, "combine") == 4 and policy.push_fraction(few, "dispatch") == 1 / 3
    with pytest.raises(ValueError, match="'op'"):
        policy.num_chunks(few, "gather", 10)


def test_copy_engine_per_op_settings():
    options = NativeOptions(dispatch_copy_engine_streams=2, combine_copy_engine_streams=3,
                            combine_copy_engine_flag_stream=True, dispatch_copy_engine_flag_stream=False)
    assert policy.copy_engine_streams(options, "dispatch") == 2 and policy.copy_engine_streams(options, "combine") == 3
    assert policy.copy_engine_flag_stream(options, "combine") and not policy.copy_engine_flag_stream(options, "dispatch")
    assert policy.copy_engine_shares(options, "combine") == [2, 5, 6, 5, 3, 2, 1]
    assert policy.copy_engine_shares(options, "combine", fp8=True) == [2, 5, 6, 5, 3, 2, 1]  # FP8: dispatch only
    assert policy.copy_engine_shares(options, "dispatch", fp8=True) == [3, 2, 1]


def test_copy_engine_choice():
    auto = NativeOptions()
    counts = [[4096, 4090], [4085, 4096]]  # DeepEP's workload on 2 ranks: ~58.6 MB per pair at 14 KB rows
    assert policy.prefix_matrix(counts) == [4096, 4090, 8181, 8186]
    assert policy.prefix_matrix([[1, 2, 3], [4, 5, 6], [0, 0, 1]]) == [1, 2, 3, 5, 7, 9, 5, 7, 10]
    # combine, auto: large pairs (>= 16 MiB) on 2 ranks only; small pairs, one rank or more ranks keep pushers
    assert policy.wanted(auto, counts, 14336)
    assert not policy.wanted(auto, [[128, 128], [128, 128]], 14336)
    assert not policy.wanted(auto, [[512, 512], [512, 512]], 14336)  # 7.3 MB
    assert policy.wanted(auto, [[2048, 2048], [2048, 2048]], 14336)  # 29 MB
    pair = policy.AUTO_MIN_PAIR_BYTES // 1024
    assert policy.wanted(auto, [[0, pair], [0, 0]], 1024) and not policy.wanted(auto, [[0, pair - 1], [0, 0]], 1024)
    assert not policy.wanted(auto, [[4096]], 14336)
    assert not policy.wanted(auto, [[4096] * 4 for _ in range(4)], 14336)
    # cached dispatch, auto: also every peer must receive nearly all (>= 90 %) of every source's tokens
    assert policy.wanted_for_dispatch(auto, counts, [4096, 4096], 14336)
    assert not policy.wanted_for_dispatch(auto, counts, [4096, 4096], 14336, cached=False)  # fresh: pushers
    assert not policy.wanted_for_dispatch(auto, [[4096, 2048], [4085, 4096]], [4096, 4096], 14336)
    assert policy.wanted_for_dispatch(auto, [[4096, 3687], [3687, 4096]], [4096, 4096], 14336)  # 90.0 %
    assert not policy.wanted_for_dispatch(auto, [[4096, 3686], [3687, 4096]], [4096, 4096], 14336)
    assert not policy.wanted_for_dispatch(auto, [[512, 512], [512, 512]], [512, 512], 14336)
    # forced, per op
    combine_on = NativeOptions(combine_copy_engine="on")
    assert policy.wanted(combine_on, [[128, 128], [128, 128]], 14336) and not policy.wanted(combine_on, [[5]], 16)
    assert not policy.wanted_for_dispatch(combine_on, [[4096, 2048], [4085, 4096]], [4096, 4096], 14336)
    dispatch_on = NativeOptions(dispatch_copy_engine="on", combine_copy_engine="off")
    assert policy.wanted_for_dispatch(dispatch_on, [[4096, 2048], [4085, 4096]], [4096, 4096], 14336)
    assert policy.wanted_for_dispatch(dispatch_on, counts, [4096, 4096], 14336, cached=False)
    assert not policy.wanted_for_dispatch(dispatch_on, [[4096]], [4096], 14336)  # one rank: nothing to copy
    assert not policy.wanted(dispatch_on, counts, 14336)


def test_bulk_reduce_choice():
    assert policy.bulk_reduce(NativeOptions(), copy_engine=True)
    assert not policy.bulk_reduce(NativeOptions(), copy_engine=False)
    for mode, expected in (("on", True), ("off", False)):
        for carried in (True, False):
            assert policy.bulk_reduce(NativeOptions(combine_bulk_reduce=mode), copy_engine=carried) is expected


# ------------------------------------------------------------------------------------------ every rank alike
def _check_worker(rank: int, world: int) -> list[str]:
    """Equal options pass; then rank 1 differs in one field, then ranks 0 and 2 in another (errors, by rank)."""
    policy.check_same_on_every_rank(NativeOptions(combine_chunks=32))
    messages = []
    for differing in ({1: dict(combine_copy_engine_shares=(4, 2))},
                      {0: dict(dispatch_push_fraction=0.5), 2: dict(dispatch_push_fraction=0.25)}):
        try:
            policy.check_same_on_every_rank(NativeOptions(**differing.get(rank, {})))
            messages.append("")
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def test_options_must_be_equal_on_every_rank():
    results = run_distributed(_check_worker, 3, timeout_s=60, join_timeout_s=300)
    shares, fraction = results[0]
    assert all(r == [shares, fraction] for r in results), results  # every rank raises the same error
    assert shares == ("ep_moe.NativeOptions: field 'combine_copy_engine_shares' must be equal on every rank of "
                      "the group, got (2, 5, 6, 5, 3, 2, 1) on ranks 0, 2; (4, 2) on rank 1")
    assert "field 'dispatch_push_fraction'" in fraction
    assert "0.5 on rank 0; 0.3333333333333333 on rank 1; 0.25 on rank 2" in fraction
