"""`ep_moe.compat.deep_ep` as a package: ``deep_ep.utils`` from a DeepEP checkout, ``deep_ep._C`` the shim's.

A fake checkout (written here) holds ``deep_ep/utils`` modules that import ``deep_ep._C`` the way DeepEP's do,
and a ``deep_ep/__init__.py`` and ``deep_ep/buffers`` that raise when imported: they must never be used. The same
holds in a process started by ``python -m ep_moe.compat.deep_ep --deep-ep PATH`` and in the process it spawns.
DeepEP's own utils are imported too where ``EP_MOE_DEEP_EP_CHECKOUT`` names a DeepEP checkout (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ep_moe.compat.deep_ep as compat

_NEVER = "raise ImportError('the checkout\\'s {} was imported')\n"

_FAKE = {
    "deep_ep/__init__.py": _NEVER.format("deep_ep/__init__.py"),
    "deep_ep/buffers/__init__.py": _NEVER.format("deep_ep/buffers"),
    "deep_ep/buffers/elastic.py": _NEVER.format("deep_ep/buffers/elastic.py"),
    "deep_ep/include.py": _NEVER.format("deep_ep/include.py"),
    "deep_ep/utils/__init__.py": "from .event import EventHandle\n",
    "deep_ep/utils/event.py": "from deep_ep._C import EventHandle\n\n\nclass EventOverlap:\n    pass\n",
    "deep_ep/utils/comm.py": textwrap.dedent("""
        import torch.distributed as dist

        import deep_ep._C as _C


        def comm_of(group):
            # DeepEP's route when torch's communicator cannot be reused: all-gather ids, create a communicator.
            ids = [None] * group.size()
            dist.all_gather_object(ids, _C.get_local_nccl_unique_id(), group)
            return _C.create_nccl_comm(ids[0], group.size(), group.rank())
        """),
    "deep_ep/utils/envs.py": textwrap.dedent("""
        import deep_ep._C as _C
        from deep_ep._C import EventHandle

        from .comm import comm_of

        MARK = "fake envs"


        def get_physical_domain_size(group):
            return _C.get_physical_domain_size(comm_of(group))


        def get_logical_domain_size(group, allow_hybrid_mode=True):
            return _C.get_logical_domain_size(comm_of(group), allow_hybrid_mode)
        """),
}


def write_fake_checkout(root: Path) -> Path:
    """A DeepEP-shaped checkout at ``root`` (see the module docstring); returns ``root``."""
    for rel, text in _FAKE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "tests").mkdir(exist_ok=True)
    return root


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    return write_fake_checkout(tmp_path / "DeepEP")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """Every test starts and ends with no deep_ep imported and the variable unset."""
    monkeypatch.delenv(compat.ENV_DEEP_EP_PATH, raising=False)
    compat.uninstall()
    yield
    compat.uninstall()
    for name in [n for n in sys.modules if n == "deep_ep" or n.startswith("deep_ep.")]:
        del sys.modules[name]


def test_utils_from_checkout(checkout: Path):
    compat.install(utils_from=str(checkout))
    import deep_ep
    import deep_ep._C
    import deep_ep.buffers.elastic
    import deep_ep.utils.envs as envs
    from deep_ep import utils

    assert deep_ep is compat and deep_ep.ElasticBuffer is compat.ElasticBuffer and deep_ep.Buffer is compat.Buffer
    assert envs.MARK == "fake envs" and Path(envs.__file__) == checkout / "deep_ep" / "utils" / "envs.py"
    assert utils is sys.modules["deep_ep.utils"] and utils.__path__ == [str(checkout / "deep_ep" / "utils")]
    assert deep_ep._C is compat._C and sys.modules["deep_ep._C"] is compat._C
    assert envs._C.EventHandle is compat.EventHandle and envs.EventHandle is compat.EventHandle
    assert utils.EventHandle is compat.EventHandle and utils.event.EventOverlap is not compat.EventOverlap
    assert deep_ep._C.Config is compat.Config and deep_ep._C.topk_idx_t is torch.int64
    assert deep_ep.buffers.elastic is compat  # the checkout's buffers (which raise) are not used
    with pytest.raises(ModuleNotFoundError):
        import deep_ep.include  # noqa: F401 -- only deep_ep.utils comes from the folder


def test_deep_ep_folder_and_variable(checkout: Path, monkeypatch):
    compat.install(utils_from=str(checkout / "deep_ep"))  # the deep_ep folder itself
    import deep_ep.utils.envs as envs

    assert envs.MARK == "fake envs"
    compat.uninstall()
    assert not [n for n in sys.modules if n.startswith("deep_ep")]
    monkeypatch.setenv(compat.ENV_DEEP_EP_PATH, str(checkout))  # read when install runs
    compat.install()
    import deep_ep.utils.envs as again

    assert again is not envs and again.MARK == "fake envs"
    with pytest.raises(FileNotFoundError, match="deep_ep/utils/__init__.py"):
        compat.install(utils_from=str(checkout / "tests"))


def test_switching_folders_and_back(checkout: Path, tmp_path: Path):
    other = write_fake_checkout(tmp_path / "Other")
    (other / "deep_ep" / "utils" / "envs.py").write_text("MARK = 'other envs'\n")
    compat.install(utils_from=str(checkout))
    import deep_ep.utils.envs

    assert deep_ep.utils.envs.MARK == "fake envs"
    compat.install(utils_from=str(other))  # the first folder's modules are dropped
    assert "deep_ep.utils.envs" not in sys.modules
    import deep_ep.utils.envs

    assert deep_ep.utils.envs.MARK == "other envs"
    compat.install()  # no folder: deep_ep.utils is the shim, as before
    import deep_ep.utils

    assert deep_ep.utils is compat and deep_ep.utils.EventOverlap is compat.EventOverlap
    compat.uninstall()
    assert "__path__" not in vars(compat) and not [f for f in sys.meta_path if isinstance(f, compat._UtilsFinder)]


def test_c_stand_in(checkout: Path, monkeypatch, solo_group):
    c = compat._C
    unique = c.get_local_nccl_unique_id()
    assert isinstance(unique, bytes) and len(unique) == 128
    comm = c.create_nccl_comm(unique, 4, 1)
    assert c.get_physical_domain_size(comm) == (1, 4)
    assert c.get_logical_domain_size(comm) == (1, 4)
    monkeypatch.setenv("EP_MOE_SCALEOUT_RANKS", "2")
    assert c.get_logical_domain_size(comm) == (2, 2)
    assert c.get_logical_domain_size(comm, False) == (1, 4)
    c.destroy_nccl_comm(comm)
    c.destroy_nccl_comm(comm)  # twice: harmless (DeepEP's handles destroy in __del__)
    with pytest.raises(NotImplementedError, match="neither one of the stand-in"):
        c.get_physical_domain_size(comm)
    with pytest.raises(AttributeError, match="no compiled DeepEP extension"):
        c.init_jit  # noqa: B018
    assert not hasattr(c, "ElasticBuffer")
    monkeypatch.delenv("EP_MOE_SCALEOUT_RANKS")
    # Through utils written like DeepEP's (the all-gather route of a gloo group, which has no NCCL communicator).
    compat.install(utils_from=str(checkout))
    import deep_ep.utils.envs as envs

    assert envs.get_physical_domain_size(solo_group) == (1, 1)
    assert envs.get_logical_domain_size(solo_group) == (1, 1)


_PROGRAM = textwrap.dedent("""
    import json
    import sys

    import torch.multiprocessing as mp

    import deep_ep
    import deep_ep.utils.envs as envs


    def report():
        import deep_ep
        import deep_ep.utils.envs as envs
        return {"deep_ep": deep_ep.__name__, "elastic": deep_ep.ElasticBuffer.__module__, "envs": envs.__file__,
                "mark": envs.MARK, "c_event": deep_ep._C.EventHandle is deep_ep.EventHandle,
                "buffers": sys.modules["deep_ep.buffers"] is deep_ep}


    def child(index, path):
        with open(f"{path}.{index}", "w") as f:
            json.dump(report(), f)


    if __name__ == "__main__":
        with open(sys.argv[1], "w") as f:
            json.dump(report(), f)
        mp.spawn(child, args=(sys.argv[1],), nprocs=1)
""")


def test_launcher_with_checkout(checkout: Path, tmp_path: Path):
    program = tmp_path / "program.py"
    program.write_text(_PROGRAM)
    marker = tmp_path / "report"
    env = dict(os.environ, EP_MOE_CACHE_DIR=str(tmp_path / "cache"))
    env.pop(compat.ENV_DEEP_EP_PATH, None)
    # The checkout's root on PYTHONPATH offers its own (raising) deep_ep package: the shim must still win,
    # in the spawned process too.
    env["PYTHONPATH"] = str(checkout)
    run = subprocess.run([sys.executable, "-m", "ep_moe.compat.deep_ep", "--deep-ep", str(checkout), str(program),
                          str(marker)], env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    expected = {"deep_ep": "ep_moe.compat.deep_ep", "elastic": "ep_moe.compat.deep_ep",
                "envs": str(checkout / "deep_ep" / "utils" / "envs.py"), "mark": "fake envs", "c_event": True,
                "buffers": True}
    assert json.loads(marker.read_text()) == expected
    assert json.loads((tmp_path / "report.0").read_text()) == expected  # the spawned process

    bad = subprocess.run([sys.executable, "-m", "ep_moe.compat.deep_ep", "--deep-ep", str(tmp_path / "nowhere"),
                          str(program), str(marker)], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no deep_ep/utils/__init__.py" in bad.stderr


@pytest.mark.skipif(not os.path.isdir(os.environ.get("EP_MOE_DEEP_EP_CHECKOUT", "")),
                    reason="EP_MOE_DEEP_EP_CHECKOUT does not name a DeepEP checkout")
def test_deepep_own_utils(solo_group):
    checkout = os.environ["EP_MOE_DEEP_EP_CHECKOUT"]
    compat.install(utils_from=checkout)
    import deep_ep
    import deep_ep.utils.comm
    import deep_ep.utils.envs as envs
    import deep_ep.utils.event
    import deep_ep.utils.gate
    import deep_ep.utils.math
    import deep_ep.utils.refs
    import deep_ep.utils.testing

    assert Path(envs.__file__).resolve() == Path(compat.deep_ep_folder(checkout), "utils", "envs.py").resolve()
    assert deep_ep.utils.event.EventHandle is compat.EventHandle and deep_ep.ElasticBuffer is compat.ElasticBuffer
    assert callable(envs.init_dist) and callable(deep_ep.utils.refs.dispatch)
    assert envs.get_physical_domain_size(solo_group) == (1, 1)
    assert envs.get_logical_domain_size(solo_group) == (1, 1)
    deep_ep.utils.comm.destroy_all_managed_nccl_comm()
