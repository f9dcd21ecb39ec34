"""The calibration file reaches the trainer's plans: the SM counts a rank of ``ep-moe train`` computes before it
builds the model (`ep_moe.train.parallel.layer_num_sms`, which makes its `PlanCache` with no rates given) follow
the file found where `cache_path` says (``$EP_MOE_CACHE_DIR/calibration.json``, read when planning, not at
import); the cache records where its rates came from. A file that cannot be used (another format version, no
entry for this machine, damaged) gives the datasheet plan and one warning naming the file and why; named
explicitly (``load_rates(path=...)``), it raises a `ValueError` naming the file and the problem."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from locations import RECIPES

from ep_moe.train import parallel
from ep_moe.train.recipe_schema import load_recipe
from ep_moe.tuning import plan_layer
from ep_moe.tuning.calibration import (
    CACHE_VERSION,
    CalibrationFileError,
    cache_key,
    cache_path,
    load_rates,
    save_rates,
)
from ep_moe.tuning.layer_plans import recipe_layers
from ep_moe.tuning.machine_topology import detect_topology
from ep_moe.tuning.rates import KernelFit, Rates

RECIPE = RECIPES / "small-gpu-ep2.yaml"
# The trainer consults the tuner only for a backend that takes an SM count (the native one); a stand-in
# buffer naming it lets a CPU machine take that path (the native Buffer needs a GPU).
NATIVE_BUFFER = SimpleNamespace(backend_name="native")
# Per-SM rates far from the datasheet's (180 read, 48 write, 45 peer write GB/s), in both directions.
SLOW_SMS = Rates(nvlink_gbs=360.0, sm_read_gbs=60.0, sm_write_gbs=16.0, sm_peer_write_gbs=15.0,
                 dispatch=KernelFit(overhead_us=40.0), combine=KernelFit(overhead_us=30.0), measured=True,
                 source="measured on a GPU with slow SMs")
FAST_SMS = Rates(nvlink_gbs=360.0, sm_read_gbs=400.0, sm_write_gbs=110.0, sm_peer_write_gbs=100.0,
                 measured=True, source="measured on a GPU with fast SMs")


@pytest.fixture(autouse=True)
def _a_rank_of_two(monkeypatch, tmp_path):
    """The environment a rank of a 2-process run sees (torchrun's sizes), with no SM overrides and the cache
    folder in ``tmp_path``."""
    for var in ("EP_MOE_NUM_SMS", "EP_MOE_PLAN", "EP_MOE_CALIBRATION", "EP_MOE_NIC_GBPS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("EP_MOE_CACHE_DIR", str(tmp_path / "cache"))


def trainer_plans(monkeypatch) -> tuple[list[int], parallel.PlanCache]:
    """The SM count of each MoE layer as the trainer decides it for the recipe, and the `PlanCache` it built."""
    built = []

    class Recorded(parallel.PlanCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(parallel, "PlanCache", Recorded)
    counts = parallel.layer_num_sms(load_recipe(str(RECIPE)), NATIVE_BUFFER)
    assert len(built) == 1
    return counts, built[0]


def shape_and_ranks():
    shape, ep, moe_layers = recipe_layers(load_recipe(str(RECIPE)).to_dict())
    assert ep == 2 and len(moe_layers) == 4
    return shape, ep


def model_plan(cache: parallel.PlanCache, rates: Rates):
    """What the bandwidth model plans for the recipe's layers with exactly ``rates``."""
    shape, ep = shape_and_ranks()
    return plan_layer(shape, cache.topology_for(ep), rates, cache.policy)


def check_plan(counts: list[int], cache: parallel.PlanCache, rates: Rates) -> None:
    shape, ep = shape_and_ranks()
    expected = model_plan(cache, rates)
    plan = cache.plan(shape, 0, ep)
    assert counts == [expected.num_sms] * 4
    assert plan.num_sms == expected.num_sms
    assert plan.predicted_dispatch_us == pytest.approx(expected.predicted_dispatch_us)
    assert plan.predicted_combine_us == pytest.approx(expected.predicted_combine_us)


def test_the_trainers_plan_follows_the_calibration_file(monkeypatch, tmp_path):
    assert not cache_path().exists()
    datasheet_counts, cache = trainer_plans(monkeypatch)
    assert cache.to_dict()["rates_source"].startswith("datasheet defaults")
    datasheet = model_plan(cache, Rates.defaults(detect_topology()))
    check_plan(datasheet_counts, cache, Rates.defaults(detect_topology()))

    written = save_rates(detect_topology(), SLOW_SMS)
    assert written == tmp_path / "cache" / "calibration.json"
    slow_counts, cache = trainer_plans(monkeypatch)
    check_plan(slow_counts, cache, SLOW_SMS)
    source = cache.to_dict()["rates_source"]
    assert source.startswith("measured on a GPU with slow SMs") and f"cached in {written}" in source
    # Slower SMs need more of them to keep up with the same link.
    assert slow_counts[0] > datasheet_counts[0]
    shape, ep = shape_and_ranks()
    assert cache.plan(shape, 0, ep).predicted_us > datasheet.predicted_us

    # Another folder (the path is looked up when planning) holding another calibration: another plan.
    monkeypatch.setenv("EP_MOE_CACHE_DIR", str(tmp_path / "other"))
    other = save_rates(detect_topology(), FAST_SMS)
    assert other == tmp_path / "other" / "calibration.json"
    fast_counts, cache = trainer_plans(monkeypatch)
    check_plan(fast_counts, cache, FAST_SMS)
    assert cache.to_dict()["rates_source"].startswith("measured on a GPU with fast SMs")
    assert fast_counts[0] < datasheet_counts[0] < slow_counts[0]


def _calibrated_file() -> tuple[Path, dict]:
    path = save_rates(detect_topology(), SLOW_SMS)
    return path, json.loads(path.read_text())


def _entry(data: dict) -> dict:
    return data["entries"][cache_key(detect_topology(), "native")]


def _other_version(data):
    data["version"] = CACHE_VERSION + 1
    return data


def _other_driver(data):
    key = cache_key(detect_topology(), "native")
    entry = data["entries"].pop(key)
    entry["hardware"] += "-another-driver"
    data["entries"][key + "-another-driver"] = entry
    return data


def _string_rate(data):
    _entry(data)["rates"]["sm_peer_write_gbs"] = "fast"
    return data


def _fit_not_an_object(data):
    _entry(data)["rates"]["dispatch"] = 0.8
    return data


def _measured_not_a_bool(data):
    _entry(data)["rates"]["measured"] = "yes"
    return data


def _no_rates(data):
    del _entry(data)["rates"]
    return data


def _entry_not_an_object(data):
    data["entries"][cache_key(detect_topology(), "native")] = [1, 2]
    return data


def _entries_a_list(data):
    data["entries"] = list(data["entries"].values())
    return data


# (how the file's JSON is changed, words the reason must hold)
STALE = {"another format version": (_other_version, f"format version {CACHE_VERSION + 1}"),
         "another driver": (_other_driver, "no entry for this machine")}
# (how the file's text is changed, words the reason must hold)
CUT = {"truncated JSON": (lambda text: text[:len(text) // 2], "not valid JSON"),
       "empty": (lambda text: "", "not valid JSON")}
DAMAGED = {"a rate that is a string": (_string_rate, "'sm_peer_write_gbs' must be a number"),
           "a fit that is a number": (_fit_not_an_object, "'dispatch'"),
           "measured not a bool": (_measured_not_a_bool, "'measured' must be true or false"),
           "an entry without rates": (_no_rates, "no 'rates' object"),
           "an entry that is a list": (_entry_not_an_object, "no 'rates' object"),
           "entries that are a list": (_entries_a_list, "not a calibration cache")}


@pytest.mark.parametrize("case", [*STALE, *CUT, *DAMAGED])
def test_an_unusable_file_gives_the_datasheet_plan_and_says_so_once(monkeypatch, caplog, case):
    datasheet_counts, datasheet_cache = trainer_plans(monkeypatch)
    path, data = _calibrated_file()
    if case in CUT:
        change, why = CUT[case]
        path.write_text(change(path.read_text()))
    else:
        change, why = {**STALE, **DAMAGED}[case]
        path.write_text(json.dumps(change(data), indent=2))
    caplog.set_level(logging.WARNING, logger="ep_moe")

    counts, cache = trainer_plans(monkeypatch)
    assert counts == datasheet_counts
    check_plan(counts, cache, Rates.defaults(detect_topology()))
    source = cache.to_dict()["rates_source"]
    assert source.startswith(f"datasheet defaults (calibration {path} ignored: ") and why in source
    lines = [r.getMessage() for r in caplog.records if r.name == "ep_moe"]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"ep_moe: calibration {path} ignored: ") and why in lines[0]
    assert lines[0].endswith("; using datasheet rates")

    # The same file named by the caller is refused, naming the file and the problem.
    with pytest.raises(CalibrationFileError, match=re.escape(why)) as caught:
        load_rates(detect_topology(), "native", path)
    assert isinstance(caught.value, ValueError) and str(path) in str(caught.value)


def test_a_named_file_that_is_missing_is_refused_and_the_default_one_is_optional(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="ep_moe")
    missing = tmp_path / "nowhere" / "calibration.json"
    with pytest.raises(ValueError, match=re.escape(f"calibration {missing}: does not exist")):
        load_rates(detect_topology(), "native", missing)
    assert not cache_path().exists()
    assert load_rates(detect_topology()).source.startswith("datasheet defaults")
    assert not [r for r in caplog.records if r.name == "ep_moe"]


def test_a_named_file_gives_its_rates(tmp_path):
    path = save_rates(detect_topology(), FAST_SMS, path=tmp_path / "named.json")
    rates = load_rates(detect_topology(), "native", path)
    assert rates.sm_peer_write_gbs == FAST_SMS.sm_peer_write_gbs and rates.measured
    assert rates.source == f"{FAST_SMS.source}; cached in {path}"
