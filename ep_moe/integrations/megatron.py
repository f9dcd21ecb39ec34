"""Megatron-core integration: ep_moe as the token dispatcher of Megatron's `MoELayer`.

Three ways to plug in (the README's "Megatron-core" section has examples):

1. A built model: ``install_ep_moe_dispatcher(model, backend="auto")`` replaces ``token_dispatcher`` on
   every ``MoELayer`` (and, where Megatron's router cannot run, makes the routers portable).
2. Layer specs: ``ep_moe_spec(spec)`` returns a copy of a Megatron ``ModuleSpec`` in which every
   ``MoELayer`` is an `EpMoELayer`, which builds `EpMoETokenDispatcher` itself.
3. Megatron's own flex dispatcher (``moe_token_dispatcher_type="flex"``,
   ``moe_flex_dispatcher_backend="deepep"``) on ep_moe through ``ep_moe.compat.deep_ep``.

`EpMoETokenDispatcher` implements the six-method ``MoETokenDispatcher`` interface of megatron-core
>= 0.13. Megatron's router hands over a dense ``routing_map [T, E]`` bool and ``probs [T, E]``; they are
turned into ``topk_idx [T, K]`` int64 / ``topk_weights [T, K]`` fp32 (K = ``moe_router_topk``) and go
through `ep_moe.TokenDispatcher` (differentiable ``ep_moe.dispatch`` / ``ep_moe.combine``). The probs
travel with the tokens and come back per expert row as ``permuted_probs``: Megatron's experts apply
them, so combine only returns rows to their sources and sums.

Importing this module raises ``ImportError`` when megatron-core is missing or older than 0.13.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import inspect
import logging
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ep_moe import Buffer, TokenDispatcher, permute

log = logging.getLogger("ep_moe")

MIN_MEGATRON_CORE = (0, 13)
"""The six-method ``MoETokenDispatcher`` interface appeared in megatron-core 0.13."""

TESTED_MEGATRON_CORE = {"0.13.1": "CPU (gloo, 2 ranks)", "0.14.0": "CPU (gloo, 2 ranks)",
                        "0.15.0": "CPU (gloo, 2 ranks)", "0.16.1": "CPU (gloo, 2 ranks; CI)",
                        "0.19.2": "GPU (2 x H200, NCCL)"}


def _parse_version(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def megatron_core_version() -> str | None:
    """The installed megatron-core's version string, or None when it is not importable."""
    try:
        package_info = importlib.import_module("megatron.core.package_info")
    except ImportError:
        return None
    return str(getattr(package_info, "__version__", "unknown"))


def _require_megatron_core() -> str:
    version = megatron_core_version()
    if version is None:
        raise ImportError("ep_moe.integrations.megatron needs megatron-core >= 0.13, which is not installed "
                          "(pip install 'megatron-core>=0.13'; on CPU pin torch in the same line)")
    parsed = _parse_version(version)
    if parsed and parsed < MIN_MEGATRON_CORE:
        raise ImportError(f"ep_moe.integrations.megatron needs megatron-core >= 0.13 (the six-method "
                          f"MoETokenDispatcher interface); found megatron-core {version}")
    return version


MEGATRON_CORE_VERSION = _require_megatron_core()

from megatron.core.transformer.moe import moe_layer as _moe_layer_module  # noqa: E402
from megatron.core.transformer.moe import moe_utils as _moe_utils  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher  # noqa: E402

_SIX_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                "token_combine", "combine_postprocess")
_missing = [m for m in _SIX_METHODS if not hasattr(MoETokenDispatcher, m)]
if _missing:
    raise ImportError(f"ep_moe.integrations.megatron: megatron-core {MEGATRON_CORE_VERSION}'s MoETokenDispatcher "
                      f"lacks {_missing}; megatron-core >= 0.13 is needed")

# 0.15 renamed the constructor's process-group argument from ``model_comm_pgs`` to ``pg_collection``.
_GROUPS_KWARG = ("pg_collection" if "pg_collection" in inspect.signature(MoETokenDispatcher.__init__).parameters
                 else "model_comm_pgs")


def _default_groups() -> Any:
    """Megatron's process groups from its global ``parallel_state`` (what ``MoELayer`` falls back to)."""
    for name in ("get_default_pg_collection", "get_default_model_comm_pgs"):
        factory = getattr(_moe_utils, name, None)
        if factory is not None:
            return factory()
    raise RuntimeError(f"megatron-core {MEGATRON_CORE_VERSION}: pass pg_collection (no default process groups)")


def _quantization_alignment(config: Any) -> int:
    """Rows per expert must be a multiple of this when Megatron pads routing for FP8/FP4 GEMMs."""
    if not getattr(config, "moe_router_padding_for_quantization", False):
        return 1
    align = getattr(_moe_utils, "get_align_size_for_quantization", None)
    if align is not None:
        return int(align(config))
    fp8_utils = importlib.import_module("megatron.core.fp8_utils")
    return int(fp8_utils.get_fp8_align_size(config.fp8_recipe))


def flex_deepep_config() -> dict[str, Any]:
    """``TransformerConfig`` keywords that select Megatron's flex dispatcher with its DeepEP backend (run it
    on ep_moe with ``ep_moe.compat.deep_ep``); the keyword changed in megatron-core 0.16."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    if "moe_flex_dispatcher_backend" in names:
        return {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep"}
    return {"moe_token_dispatcher_type": "flex", "moe_enable_deepep": True}


# ------------------------------------------------------------------------------------------ buffers
_buffers: dict[tuple[Any, str], Buffer] = {}


def get_ep_buffer(group: dist.ProcessGroup, backend: str = "auto") -> Buffer:
    """The `ep_moe.Buffer` of ``group`` for ``backend`` ("auto" | "native" | "torch"), made on first use
    and shared by every layer (creating it is collective over ``group``).

    It skips value checks (``check_inputs=False``): expert ids come from Megatron's router through
    `routing_map_to_topk`, in range by construction, and each check would cost a host sync per layer.
    To check routing maps anyway, pass ``buffer=Buffer(group, check_inputs=True)`` to the dispatcher."""
    key = (group, backend)
    buffer = _buffers.get(key)
    if buffer is None:
        buffer = Buffer(group=group, backend=backend, check_inputs=False)
        _buffers[key] = buffer
    return buffer


def destroy_ep_buffers() -> None:
    """Destroy the buffers made by `get_ep_buffer` (e.g. before ``destroy_process_group``)."""
    while _buffers:
        _, buffer = _buffers.popitem()
        buffer.destroy()


# ------------------------------------------------------------------------------------------ routing
def routing_map_to_topk(routing_map: Tensor, probs: Tensor, topk: int, check: bool = True
                        ) -> tuple[Tensor, Tensor]:
    """Turn Megatron's dense routing into top-k form.

    Args:
        routing_map: ``[T, E]`` bool, the experts each token goes to (at most ``topk`` per row).
        probs: ``[T, E]`` routing probabilities (any float dtype; zero where not routed).
        topk: K, the width of the result (``config.moe_router_topk``).
        check: raise if a row selects more than ``topk`` experts (one host sync on GPU).

    Returns:
        ``topk_idx [T, K]`` int64 (selected expert ids in increasing order, then -1) and
        ``topk_weights [T, K]`` fp32 (the probs of those experts, 0 for -1), differentiable in ``probs``.
        On CUDA with the JIT kernels (fp32 or bf16 probs; `ep_moe.permute.kernel_implementation` chooses) one
        kernel each way (forward, gradient); elsewhere torch ops, with the same results.
    """
    if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
        raise ValueError(f"routing_map must be a [T, E] bool tensor, got {routing_map.dtype} of shape "
                         f"{tuple(routing_map.shape)}")
    if probs.shape != routing_map.shape:
        raise ValueError(f"probs must have routing_map's shape {tuple(routing_map.shape)}, got {tuple(probs.shape)}")
    if check and routing_map.numel() and int(routing_map.sum(dim=1).max()) > topk:
        raise ValueError(f"routing_map selects more than moe_router_topk={topk} experts for some token")
    how = permute.kernel_implementation(routing_map)  # while torch.compile traces: the torch ops
    if how == "jit" and not torch.compiler.is_compiling() and probs.device == routing_map.device and probs.dtype in (torch.float32, torch.bfloat16):
        return _RoutingMapToTopk.apply(routing_map.contiguous(), probs.contiguous(), topk)
    return _routing_map_to_topk_torch(routing_map, probs, topk)


def _routing_map_to_topk_torch(routing_map: Tensor, probs: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    num_experts = routing_map.shape[1]
    width = min(topk, num_experts)
    expert_ids = torch.arange(num_experts, device=routing_map.device)
    key = torch.where(routing_map, expert_ids, num_experts)  # unselected experts sort last
    chosen = torch.topk(key, width, dim=1, largest=False, sorted=True).values
    valid = chosen < num_experts
    topk_idx = torch.where(valid, chosen, -1)
    weights = probs.gather(1, chosen.clamp(max=num_experts - 1)).float()
    topk_weights = torch.where(valid, weights, torch.zeros_like(weights))
    if width < topk:  # fewer experts than K: pad with "no expert"
        pad = topk - width
        topk_idx = torch.nn.functional.pad(topk_idx, (0, pad), value=-1)
        topk_weights = torch.nn.functional.pad(topk_weights, (0, pad), value=0.0)
    return topk_idx.contiguous(), topk_weights.contiguous()


class _RoutingMapToTopk(torch.autograd.Function):
    """`routing_map_to_topk` in one JIT kernel; the gradient puts each weight's gradient (rounded to the probs'
    dtype) at its expert, zero elsewhere, in one kernel."""

    @staticmethod
    def forward(ctx, routing_map: Tensor, probs: Tensor, topk: int) -> tuple[Tensor, Tensor]:
        topk_idx, topk_weights = _exchange_ops().routing_map_to_topk(routing_map, probs, topk)
        ctx.mark_non_differentiable(topk_idx)
        ctx.save_for_backward(topk_idx)
        ctx.num_experts, ctx.dtype = probs.shape[1], probs.dtype
        return topk_idx, topk_weights

    @staticmethod
    def backward(ctx, grad_idx, grad_weights):
        (topk_idx,) = ctx.saved_tensors
        if grad_weights is None or not ctx.needs_input_grad[1]:
            return None, None, None
        grad = _exchange_ops().routing_map_to_topk_backward(grad_weights.float().contiguous(), topk_idx,
                                                            ctx.num_experts, ctx.dtype)
        return None, grad, None


def _exchange_ops():
    """The generic expert-major ops (`ep_moe.native.jit.expert_major_exchange`)."""
    from ep_moe.native.jit import expert_major_exchange

    return expert_major_exchange


# ------------------------------------------------------------------------------------------ dispatcher
class EpMoETokenDispatcher(MoETokenDispatcher):
    """Megatron ``MoETokenDispatcher`` backed by `ep_moe.TokenDispatcher`.

    Args:
        num_local_experts, local_expert_indices, config: as for Megatron's dispatchers.
        pg_collection: Megatron's process groups (``.ep``, ``.expt_tp``, ``.tp_ep`` are read); megatron-core
            < 0.15 calls it ``model_comm_pgs`` (accepted too). Default: Megatron's global groups.
        backend: the `ep_moe.Buffer` backend, "auto" (native kernels over NVLink where they run, else
            torch.distributed), "native" or "torch".
        num_sms: SMs for this layer's dispatch and combine (0 = the buffer's default).
        buffer: use this `ep_moe.Buffer` (over the EP group) instead of the shared one.

    Stage by stage (T tokens here, N rows received, M expert rows, L local experts):
    ``dispatch_preprocess`` flattens ``[S, B, H]`` to ``[T, H]`` and converts the routing;
    ``token_dispatch`` sends the tokens and groups the received (token, expert) pairs by local expert;
    ``dispatch_postprocess`` returns ``(tokens [M, H], tokens_per_expert [L] CPU int64,
    permuted_probs [M])``; ``combine_preprocess`` is the identity; ``token_combine`` sums each row's
    local experts (fp32) and returns rows to their sources, summing there; ``combine_postprocess``
    restores the input shape (and adds overlapped shared experts' output).
    Expert tensor parallelism (``expert_tensor_parallel_size`` > 1) and drop-and-pad
    (``moe_pad_expert_input_to_capacity``) are not supported; capacity-factor token dropping is.
    """

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config: Any,
                 pg_collection: Any = None, *, model_comm_pgs: Any = None, backend: str = "auto",
                 num_sms: int = 0, buffer: Buffer | None = None) -> None:
        groups = pg_collection if pg_collection is not None else model_comm_pgs
        if groups is None:
            groups = _default_groups()
        super().__init__(config, **{_GROUPS_KWARG: groups})
        if self.tp_size != 1:
            raise ValueError(f"EpMoETokenDispatcher: expert tensor parallelism is not supported "
                             f"(expert_tensor_parallel_size must be 1, got {self.tp_size})")
        if getattr(config, "moe_pad_expert_input_to_capacity", False):
            raise ValueError("EpMoETokenDispatcher: moe_pad_expert_input_to_capacity (drop-and-pad) is not "
                             "supported; use moe_expert_capacity_factor without padding, or no capacity")
        num_experts = config.num_moe_experts
        if num_experts is None or num_experts % self.ep_size:
            raise ValueError(f"EpMoETokenDispatcher: num_moe_experts ({num_experts}) must be divisible by "
                             f"the expert-parallel size {self.ep_size}")
        ep_rank = dist.get_rank(self.ep_group)
        expected = list(range(ep_rank * num_local_experts, (ep_rank + 1) * num_local_experts))
        if num_local_experts != num_experts // self.ep_size or list(local_expert_indices) != expected:
            raise ValueError(f"EpMoETokenDispatcher: rank {ep_rank} of the EP group must hold experts {expected} "
                             f"(E / EP contiguous), got {list(local_expert_indices)}")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = num_experts
        self.router_topk = config.moe_router_topk
        if buffer is None:
            buffer = get_ep_buffer(self.ep_group, backend)
        elif buffer.group_size != self.ep_size:
            raise ValueError(f"EpMoETokenDispatcher: buffer spans {buffer.group_size} ranks, the EP group "
                             f"{self.ep_size}")
        self.buffer = buffer
        self.dispatcher = TokenDispatcher(buffer, num_experts, expert_alignment=_quantization_alignment(config),
                                          num_sms=num_sms)
        self.hidden_shape: torch.Size | None = None
        self._topk_idx: Tensor | None = None
        self._probs_dtype = torch.float32
        self._tokens_per_expert: Tensor | None = None
        self._ctx = None

    # ----------------------------------------------------------------- dispatch
    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor
                            ) -> tuple[Tensor, Tensor]:
        """``hidden_states [S, B, H]`` (or ``[T, H]``), ``routing_map [T, E]`` bool, ``probs [T, E]`` ->
        ``(hidden [T, H], topk_weights [T, K] fp32)``; the top-k expert ids are kept for `token_dispatch`."""
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, self.hidden_shape[-1])
        self._probs_dtype = probs.dtype
        check = self.buffer.check_inputs and not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())
        self._topk_idx, topk_weights = routing_map_to_topk(routing_map, probs, self.router_topk, check)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden.view(self.hidden_shape))
        return hidden, topk_weights

    def token_dispatch(self, hidden_states: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
        """Send the tokens to their experts' ranks: ``(expert_input [M, H], expert_probs [M] fp32)``,
        rows grouped by local expert."""
        expert_input, expert_probs, tokens_per_expert, self._ctx = self.dispatcher.dispatch(
            hidden_states, self._topk_idx, probs)
        self._topk_idx = None
        self._tokens_per_expert = tokens_per_expert
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(expert_input)
        return expert_input, expert_probs

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(tokens [M, H], tokens_per_expert [L] CPU int64, permuted_probs [M])`` in the router's
        probs dtype."""
        host = self._ctx.tokens_per_expert_host if self._ctx is not None else None
        # From the host copy the dispatcher got with the count exchange when there is one (no host sync).
        tokens_per_expert = host if host is not None else self._tokens_per_expert.to(device="cpu", dtype=torch.int64)
        self._tokens_per_expert = None
        return hidden_states, tokens_per_expert, probs.to(self._probs_dtype)

    # ----------------------------------------------------------------- combine
    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        """Identity: the experts' rows are already in the order `token_combine` expects."""
        return hidden_states

    def token_combine(self, hidden_states: Tensor) -> Tensor:
        """``[M, H]`` expert outputs (probs applied by the experts) -> ``[T, H]``."""
        if self._ctx is None:
            raise RuntimeError("EpMoETokenDispatcher.token_combine called without a matching token_dispatch")
        combined = self.dispatcher.combine(hidden_states, self._ctx)
        self._ctx = None
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(combined)
            self.shared_experts.post_forward_comm()
        return combined

    def combine_postprocess(self, hidden_states: Tensor) -> Tensor:
        """``[T, H]`` -> the layer input's shape (plus the overlapped shared experts' output)."""
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output


# ------------------------------------------------------------------------------------------ router
class PortableTopKRouter(TopKRouter):
    """Megatron's ``TopKRouter`` with a plain-torch gating GEMM on the parameters' own device.

    Megatron's ``gating`` moves the weights to CUDA and, in 0.16 without TransformerEngine, calls an
    undefined ``te_general_gemm``; this router computes the same logits (in ``moe_router_dtype``) with
    ``torch.nn.functional.linear``, on CPU and GPU, with or without TransformerEngine.
    """

    def gating(self, input: Tensor) -> Tensor:  # noqa: A002 (Megatron's argument name)
        bias = getattr(self, "bias", None)  # routers before 0.15 have no bias
        if self.weight.device != input.device:  # Megatron creates router weights on CPU
            self.weight.data = self.weight.data.to(input.device)
            if bias is not None:
                bias.data = bias.data.to(input.device)
        router_dtype = getattr(self.config, "moe_router_dtype", None)
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router_dtype, input.dtype)
        bias = bias.to(dtype) if bias is not None else None
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)


def _needs_portable_router() -> bool:
    """Megatron's own gating needs CUDA, and (in some versions) TransformerEngine."""
    if not torch.cuda.is_available():
        return True
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        return True
    return False


# ------------------------------------------------------------------------------------------ plugging in
def _moe_layers(model: torch.nn.Module | Iterable[torch.nn.Module]) -> Iterator[MoELayer]:
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                yield module


def use_portable_routers(model: torch.nn.Module | Iterable[torch.nn.Module]) -> int:
    """Make every plain ``TopKRouter`` of a built model a `PortableTopKRouter` (same parameters; only
    ``gating`` differs). For megatron-core < 0.16, whose ``MoESubmodules`` has no router to put in a spec.
    Returns how many routers changed."""
    count = 0
    for layer in _moe_layers(model):
        if type(layer.router) is TopKRouter:
            layer.router.__class__ = PortableTopKRouter
            count += 1
    return count


def install_ep_moe_dispatcher(model: torch.nn.Module | Iterable[torch.nn.Module], backend: str = "auto", *,
                              num_sms: int = 0, portable_router: bool | None = None) -> int:
    """Replace ``token_dispatcher`` on every ``MoELayer`` of a built model with `EpMoETokenDispatcher`.

    Args:
        model: a module, or a list of model chunks (virtual pipeline stages).
        backend: the `ep_moe.Buffer` backend ("auto", "native", "torch").
        num_sms: SMs per dispatch/combine (0 = the buffer's default).
        portable_router: turn the layers' ``TopKRouter``s into `PortableTopKRouter` (same parameters).
            Default: when Megatron's own gating cannot run here (no CUDA or no TransformerEngine).

    Returns the number of layers changed (raises ``ValueError`` if the model has none). Every rank must
    call it in the same order (the buffers are made collectively).
    """
    if portable_router is None:
        portable_router = _needs_portable_router()
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    count = 0
    for layer in _moe_layers(chunks):
        old = layer.token_dispatcher
        groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
        new = EpMoETokenDispatcher(layer.num_local_experts, layer.local_expert_indices, layer.config,
                                   groups, backend=backend, num_sms=num_sms)
        if old.shared_experts is not None:
            new.set_shared_experts(old.shared_experts)
        layer.token_dispatcher = new
        count += 1
    if count == 0:
        raise ValueError("install_ep_moe_dispatcher: the model has no megatron MoELayer")
    if portable_router:
        use_portable_routers(chunks)
    return count


_DISPATCHER_NAMES = ("MoEAllGatherTokenDispatcher", "MoEAlltoAllTokenDispatcher", "MoEFlexTokenDispatcher")


@contextlib.contextmanager
def _moe_layer_builds(factory: Any) -> Iterator[None]:
    """While ``MoELayer.__init__`` runs, let each of its dispatcher names build ``factory`` instead, so no
    Megatron dispatcher (whose constructors need CUDA) is made and then thrown away."""
    saved = {name: getattr(_moe_layer_module, name) for name in _DISPATCHER_NAMES
             if hasattr(_moe_layer_module, name)}
    try:
        for name in saved:
            setattr(_moe_layer_module, name, factory)
        yield
    finally:
        for name, cls in saved.items():
            setattr(_moe_layer_module, name, cls)


class EpMoELayer(MoELayer):
    """Megatron's ``MoELayer`` with `EpMoETokenDispatcher` as its token dispatcher, whatever
    ``config.moe_token_dispatcher_type`` says. For layer specs: ``ModuleSpec(module=EpMoELayer,
    submodules=MoESubmodules(...), params={"ep_moe_backend": "auto"})`` (or use `ep_moe_spec`).

    Args (beyond ``MoELayer``'s): ep_moe_backend: the `ep_moe.Buffer` backend; ep_moe_num_sms: SMs per
    dispatch/combine (0 = default); ep_moe_portable_router: make a plain ``TopKRouter`` a
    `PortableTopKRouter`.
    """

    def __init__(self, *args: Any, ep_moe_backend: str = "auto", ep_moe_num_sms: int = 0,
                 ep_moe_portable_router: bool = False, **kwargs: Any) -> None:
        factory = functools.partial(EpMoETokenDispatcher, backend=ep_moe_backend, num_sms=ep_moe_num_sms)
        with _moe_layer_builds(factory):
            super().__init__(*args, **kwargs)
        if ep_moe_portable_router and type(self.router) is TopKRouter:  # < 0.15: no router in MoESubmodules
            self.router.__class__ = PortableTopKRouter
        if not isinstance(self.token_dispatcher, EpMoETokenDispatcher):  # a Megatron that builds it elsewhere
            old = self.token_dispatcher
            groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
            self.token_dispatcher = factory(self.num_local_experts, self.local_expert_indices, self.config, groups)
            if old.shared_experts is not None:
                self.token_dispatcher.set_shared_experts(old.shared_experts)


def _is_moe_layer_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, MoELayer)


def _rewrite_moe_specs(spec: Any, layer_cls: type | None, params: dict[str, Any], portable_router: bool) -> Any:
    """A deep copy of ``spec`` with every MoE layer entry rewritten. Megatron describes modules as
    ``ModuleSpec(module=..., submodules=..., params=...)`` (<= 0.16) or ``functools.partial(cls,
    submodules=...)`` builders (0.19); both are handled, inside dataclasses, lists and tuples."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    found = 0
    seen: set[int] = set()

    def fix_router(submodules: Any) -> None:
        if portable_router and getattr(submodules, "router", None) is TopKRouter:
            submodules.router = PortableTopKRouter

    def visit(node: Any) -> Any:
        nonlocal found
        if id(node) in seen or isinstance(node, str | bytes | type | torch.Tensor):
            return node
        seen.add(id(node))
        if isinstance(node, ModuleSpec):
            node.submodules = visit(node.submodules)
            if _is_moe_layer_class(node.module):
                fix_router(node.submodules)
                if layer_cls is not None:
                    node.module = layer_cls
                    node.params = {**(node.params or {}), **params}
                found += 1
            return node
        if isinstance(node, functools.partial):
            args = tuple(visit(a) for a in node.args)
            keywords = {k: visit(v) for k, v in node.keywords.items()}
            func = node.func
            if _is_moe_layer_class(func):
                fix_router(keywords.get("submodules"))
                if layer_cls is not None:
                    func = layer_cls
                    keywords.update(params)
                found += 1
            return functools.partial(func, *args, **keywords)
        if isinstance(node, list):
            return [visit(item) for item in node]
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(visit(item) for item in node)
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                value = getattr(node, f.name)
                new = visit(value)
                if new is not value:
                    object.__setattr__(node, f.name, new)
            return node
        return node

    spec = visit(copy.deepcopy(spec))
    if not found:
        raise ValueError("the spec has no MoELayer (build it with num_experts set)")
    return spec


def ep_moe_spec(spec: Any, backend: str = "auto", *, num_sms: int = 0, portable_router: bool | None = None) -> Any:
    """A copy of a Megatron layer/block/MoE spec in which every ``MoELayer`` is an `EpMoELayer` (and, per
    ``portable_router``, as in `install_ep_moe_dispatcher`, routers are `PortableTopKRouter`).

    Example: ``GPTModel(config, ep_moe_spec(get_gpt_layer_local_spec(num_experts=8)), ...)``.
    Note: megatron-core 0.16's ``TransformerLayer`` hands ``pg_collection`` only to an ``MoELayer`` spec
    itself (it logs "Unknown MLP type" for a subclass), so there `EpMoELayer` uses Megatron's global
    parallel state; with a custom process-group collection, use `install_ep_moe_dispatcher`.
    """
    if portable_router is None:
        portable_router = _needs_portable_router()
    params = {"ep_moe_backend": backend, "ep_moe_num_sms": num_sms, "ep_moe_portable_router": portable_router}
    return _rewrite_moe_specs(spec, EpMoELayer, params, portable_router)


def with_portable_router(spec: Any) -> Any:
    """A copy of a Megatron spec whose MoE layers use `PortableTopKRouter` (their dispatcher unchanged).
    Where ``MoESubmodules`` has no router (< 0.16) this changes nothing: call `use_portable_routers` on
    the built model."""
    return _rewrite_moe_specs(spec, None, {}, True)


__all__ = [
    "MEGATRON_CORE_VERSION",
    "EpMoELayer",
    "EpMoETokenDispatcher",
    "PortableTopKRouter",
    "destroy_ep_buffers",
    "ep_moe_spec",
    "flex_deepep_config",
    "get_ep_buffer",
    "install_ep_moe_dispatcher",
    "megatron_core_version",
    "routing_map_to_topk",
    "use_portable_routers",
    "with_portable_router",
]
