"""Compatibility layers that let code written for other expert-parallel libraries run on ep_moe.

* `ep_moe.compat.deep_ep`: DeepEP's normal-mode Python API (``deep_ep.Buffer``, ``Config``,
  ``EventOverlap``, ...) on top of `ep_moe.Buffer`. Make ``import deep_ep`` resolve to it with
  ``ep_moe.compat.deep_ep.install()`` (this process), or run a program unmodified with
  ``python -m ep_moe.compat.deep_ep program.py ARGS`` (this process and the processes it spawns).

Nothing is imported here, so importing ``ep_moe.compat`` never changes ``sys.modules``.
"""
