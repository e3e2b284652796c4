"""A CPU test double of Transformer Engine's delayed weight gradients. NOT Transformer Engine.

Transformer Engine cannot run on this project's CPU machines. This module reproduces, in plain
PyTorch on CPU, the part of TE's behaviour megatron-zb's Transformer Engine route relies on, so
that the route's code (:mod:`megatron_zb.runtime.te_route`) runs here exactly as it would on TE
modules. It lives in ``tests/`` and is never shipped.

Written from Transformer Engine's source, NVIDIA/TransformerEngine at tag **v2.18**, and checked
against tags v2.3, v2.7 and v2.8 for the parts that changed (``tests/runtime/test_te_source.py`` checks
the lines it relies on in each released wheel):

* ``transformer_engine/pytorch/module/_common.py`` -- ``WeightGradStore``: a ``queue.Queue``
  (``context``) when constructed with ``delay_wgrad_compute=True``; ``put(tensor_list, func)``;
  ``pop()`` runs the oldest ``func(*tensor_list)`` and returns ``(result, tensor_list)``,
  raising on an empty queue; ``delay_wgrad_compute()``. (:class:`WeightGradStore`)
* ``transformer_engine/pytorch/module/linear.py`` -- ``_linear_backward``: the input gradient is
  computed in the backward; the weight-gradient GEMM (``dw = dy^T x``, the bias gradient fused
  into it when the bias is applied inside the module, writing into ``main_grad`` with
  ``accumulate = fuse_wgrad_accumulation and not is_first_microbatch`` when fusing) is either
  run now or, with delaying on, put into the store as ``put([inputmat_total, grad_output],
  wgrad_gemm)`` -- the backward then returns no weight gradient and no bias gradient. With
  ``fuse_wgrad_accumulation`` and a weight carrying megatron-core DDP's
  ``grad_added_to_main_grad``, the flag is set and a dummy weight gradient returned
  (``get_dummy_wgrad``). ``return_bias=True`` returns the bias to the caller instead of adding
  it (``apply_bias = bias and not return_bias``). (:class:`_LinearFunction`, :class:`Linear`)
* ``transformer_engine/pytorch/module/base.py`` -- ``TransformerEngineBaseModule.backward_dw``:
  pops one entry; without ``fuse_wgrad_accumulation`` *assigns* ``weight.grad = wgrad``
  (v2.3-v2.7: only when ``weight.grad is None``); when ``use_bias`` and ``bias.grad is None``
  assigns ``bias.grad = bgrad.to(dtype)`` -- which fails when ``bgrad`` is ``None``, i.e. for a
  bias whose gradient the backward computed (returned to the caller, row-parallel unfused, FP8);
  then calls the hooks registered with
  ``register_wgrad_accumulation_and_reduce_hooks`` (v2.7+). ``need_backward_dw()`` (v2.10+)
  says whether delaying is on. (:meth:`Linear.backward_dw`)
* ``transformer_engine/pytorch/module/layernorm_linear.py`` -- the same, with the layer norm
  (``layer_norm_weight``, ``layer_norm_bias``) inside the module, its gradients computed in the
  backward; the delayed GEMM's input is the normalised activation. Here the norm is a separate
  autograd node (``torch.nn.functional.layer_norm`` / ``rms_norm``) in front of the linear
  function; its gradients are computed in B either way. (:class:`LayerNormLinear`)

and megatron-core 0.16.1's wrappers (``megatron/core/extensions/transformer_engine.py``):
``TEColumnParallelLinear``, ``TERowParallelLinear``, ``TELayerNormColumnParallelLinear`` -- their
constructor keywords (plus those a later release adds, taken from
``megatron_compat.te.TE_WRAPPER_KEYWORDS``: 0.19's ``name``, accepted and unused), ``fuse_wgrad_accumulation=config.gradient_accumulation_fusion``,
``delay_wgrad_compute=config.delay_wgrad_compute``, ``return_bias = skip_bias_add and bias``,
``is_first_microbatch`` (True for the module's first forward), ``forward`` returning
``(output, bias or None)``, and ``backward_dw()`` that calls TE's only when
``config.delay_wgrad_compute``. :func:`gpt_layer_spec` is megatron-core's own
``get_gpt_layer_with_transformer_engine_spec()`` built with these classes
(:class:`DoubleTESpecProvider`; core attention is megatron-core's local ``DotProductAttention``).

Also: TE's FP8 / debug bias path (the bias gradient in the backward, ``bias=None`` to the delayed
GEMM; ``Linear.fp8``, :class:`FP8Linear`, :func:`gpt_layer_spec_fp8`), the row-parallel
``gemm_bias_unfused_add``, ``module/grouped_linear.py``'s ``GroupedLinear`` at v2.8 and v2.18
(:class:`GroupedLinear`, returning its B-time buffer; :class:`GroupedLinearTE27`, v2.3-v2.7,
returning ``None``) and megatron-core's ``TEFusedMLP`` over TE's op fuser
(:class:`TEFusedMLP`, which never queues).

Not reproduced: quantisation itself (the FP8 flavour computes in fp32), userbuffers, CUDA
graphs, tensor parallelism (the wrappers refuse a tensor-parallel group larger than one), a GPT
built with grouped experts; :class:`LayerNormMLP` keeps only what the route sees of
``LayerNormMLP``: two entries per backward, both popped by one ``backward_dw()``.
"""

from __future__ import annotations

import queue
from typing import Any, Callable, Optional

import torch

TE_VERSION = "2.18"
"""The Transformer Engine release this double follows (see the module docstring)."""

CALLS = {"backward_dw": 0, "queued": 0}
"""Per process: ``backward_dw()`` calls that popped an entry, entries put into a store."""

_LIVE: list["Linear"] = []  # every double built in this process (to check queues are empty)


class WeightGradStore:
    """TE's ``WeightGradStore`` (``module/_common.py``)."""

    def __init__(self, delay_wgrad_compute: bool = False, ub_bulk_wgrad: bool = False) -> None:
        if delay_wgrad_compute:
            self.context: queue.Queue | None = queue.Queue()
            assert ub_bulk_wgrad is False, "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"
            self.enabled = True
        else:
            self.context = None
            self.enabled = False

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def enable_delay_wgrad_compute(self) -> None:
        self.enabled = True

    def disable_delay_wgrad_compute(self) -> None:
        self.enabled = False

    def put(self, tensor_list: list[torch.Tensor], func: Callable[..., Any]) -> None:
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        self.context.put([tensor_list, func])
        CALLS["queued"] += 1

    def pop(self) -> tuple[Any, list[torch.Tensor]]:
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        raise RuntimeError("Pop empty queue.")


class _LinearFunction(torch.autograd.Function):
    """TE's ``_Linear`` (``module/linear.py``) for one non-quantised GEMM on CPU."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, inp: torch.Tensor, bias: Optional[torch.Tensor],
                module: "Linear", is_first_microbatch: Optional[bool]) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        ctx.weight_object = weight  # TE keeps the Python object to set grad_added_to_main_grad on
        ctx.module, ctx.is_first_microbatch = module, is_first_microbatch
        ctx.use_bias = bias is not None
        ctx.fp8 = module.fp8
        ctx.wgrad_store = module.wgrad_store if module.wgrad_store.delay_wgrad_compute() else None
        return torch.nn.functional.linear(inp, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inp, weight = ctx.saved_tensors
        module, weight_object = ctx.module, ctx.weight_object
        dgrad = grad_output.matmul(weight)
        x = inp.reshape(-1, inp.shape[-1])
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        fuse = module.fuse_wgrad_accumulation
        main_grad = weight_object.main_grad if fuse else None
        if ctx.is_first_microbatch is not None:
            accumulate = fuse and not ctx.is_first_microbatch
        else:
            accumulate = fuse
        use_bias = ctx.use_bias
        # grad_output_preprocess: under FP8 (and TE's debug mode) the bias gradient is computed now
        grad_bias = dy.sum(dim=0) if (use_bias and ctx.fp8) else None
        gemm_bias = use_bias and grad_bias is None and not ctx.fp8  # "bias": bias if (grad_bias is None and not fp8)

        def wgrad_gemm(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
            dw = dy.t().matmul(x)
            db = dy.sum(dim=0) if gemm_bias else None
            if fuse:  # the GEMM writes into main_grad (accumulating after the first microbatch)
                if accumulate:
                    main_grad.add_(dw)
                else:
                    main_grad.copy_(dw)
                dw = main_grad
            return dw, db

        wgrad = None
        if ctx.wgrad_store is not None and ctx.wgrad_store.delay_wgrad_compute():
            ctx.wgrad_store.put([x, dy], wgrad_gemm)
        else:
            wgrad, grad_bias_ = wgrad_gemm(x, dy)
            if grad_bias is None:
                grad_bias = grad_bias_
        if fuse and hasattr(weight_object, "grad_added_to_main_grad"):  # megatron-core DDP
            weight_object.grad_added_to_main_grad = True
            wgrad = torch.zeros(main_grad.shape, dtype=weight_object.dtype, device=main_grad.device)
        elif fuse:
            wgrad = None
        if not use_bias:
            grad_bias = None
        return wgrad, dgrad, grad_bias, None, None


class Linear(torch.nn.Module):
    """TE's ``te.pytorch.Linear`` (``module/linear.py`` + ``module/base.py``), CPU, no parallelism.

    ``hooks_api``: whether ``register_wgrad_accumulation_and_reduce_hooks`` exists (TE >= 2.7);
    ``assign_weight_grad_always``: TE >= 2.8 assigns ``weight.grad`` in ``backward_dw`` even
    when it is set (v2.3-v2.7: only when it is ``None``);
    ``fp8``: the bias path of TE's FP8 backward (also its debug mode): ``grad_output_preprocess``
    computes the bias gradient in the backward and the weight-gradient GEMM gets ``bias=None``,
    so a delayed entry returns ``bgrad = None`` (no quantisation is reproduced: the numbers are
    fp32 as without FP8). ``parallel_mode="row"`` with an applied bias: TE adds the bias after
    the autograd function (``gemm_bias_unfused_add``), so its gradient also comes in the backward.
    """

    hooks_api = True
    assign_weight_grad_always = True
    fp8 = False

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None, return_bias: bool = False,
                 fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False,
                 params_dtype: torch.dtype = torch.float32, parallel_mode: Optional[str] = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.gemm_bias_unfused_add = parallel_mode == "row" and self.apply_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype))
        (init_method or (lambda w: torch.nn.init.normal_(w, mean=0.0, std=0.023)))(self.weight.data)
        self.weight_names = ["weight"]
        self.bias_names = ["bias"] if bias else []
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=params_dtype))
        else:
            self.register_parameter("bias", None)
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks: list[Callable[[], None]] = []
        if delay_wgrad_compute:  # TE >= 2.8: megatron-core DDP's delay_wgrad_compute hooks these in backward_dw
            for name in self.weight_names + self.bias_names:
                getattr(self, name).skip_backward_post_hook = True
        _LIVE.append(self)

    def _linear(self, inp: torch.Tensor, is_first_microbatch: Optional[bool]) -> Any:
        bias = self.bias if (self.apply_bias and not self.gemm_bias_unfused_add) else None
        out = _LinearFunction.apply(self.weight, inp, bias, self, is_first_microbatch)
        if self.gemm_bias_unfused_add:
            out = out + self.bias
        if self.return_bias:
            return out, self.bias
        return out

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> Any:
        return self._linear(inp, is_first_microbatch)

    # -- module/base.py
    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        (wgrad, bgrad), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            if self.assign_weight_grad_always or self.weight.grad is None:
                self.weight.grad = wgrad.to(self.weight.dtype)
        if self.use_bias:
            if self.bias.grad is None:
                self.bias.grad = bgrad.to(self.bias.dtype)  # AttributeError for a returned bias
        CALLS["backward_dw"] += 1
        if self.hooks_api:
            for hook in self.wgrad_accumulation_and_reduce_hooks:
                hook()


class LayerNormLinear(Linear):
    """TE's ``te.pytorch.LayerNormLinear``: a norm (LayerNorm or RMSNorm) in front of :class:`Linear`."""

    def __init__(self, in_features: int, out_features: int, *, eps: float = 1e-5, normalization: str = "LayerNorm",
                 **kwargs: Any) -> None:
        super().__init__(in_features, out_features, **kwargs)
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {normalization!r}: LayerNorm or RMSNorm")
        self.eps, self.normalization = eps, normalization
        dtype = self.weight.dtype
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(in_features, dtype=dtype))
        if normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(in_features, dtype=dtype))
        else:
            self.register_parameter("layer_norm_bias", None)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> Any:
        shape = (self.in_features,)
        if self.normalization == "LayerNorm":
            ln_out = torch.nn.functional.layer_norm(inp, shape, self.layer_norm_weight, self.layer_norm_bias, self.eps)
        else:
            ln_out = torch.nn.functional.rms_norm(inp, shape, self.layer_norm_weight, self.eps)
        return self._linear(ln_out, is_first_microbatch)


class LayerNormMLP(Linear):
    """TE's ``te.pytorch.LayerNormMLP`` reduced to what the route sees: one module, two GEMMs
    (``fc1_weight``, ``fc2_weight``; no norm, no bias), one store; a backward puts two entries
    (fc2's, then fc1's) and ``backward_dw()`` pops both and assigns ``fc2_weight.grad`` and
    ``fc1_weight.grad`` (``module/layernorm_mlp.py``)."""

    def __init__(self, hidden: int, ffn_hidden: int, *, delay_wgrad_compute: bool = False) -> None:
        torch.nn.Module.__init__(self)
        self.use_bias, self.return_bias, self.fuse_wgrad_accumulation = False, False, False
        self.fc1_weight = torch.nn.Parameter(torch.randn(ffn_hidden, hidden) * 0.02)
        self.fc2_weight = torch.nn.Parameter(torch.randn(hidden, ffn_hidden) * 0.02)
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks = []
        _LIVE.append(self)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        h = _LinearFunction.apply(self.fc1_weight, inp, None, self, is_first_microbatch)
        return _LinearFunction.apply(self.fc2_weight, torch.nn.functional.gelu(h), None, self, is_first_microbatch)

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        (fc2_wgrad, _), _ = self.wgrad_store.pop()
        (fc1_wgrad, _), _ = self.wgrad_store.pop()
        self.fc2_weight.grad = fc2_wgrad
        self.fc1_weight.grad = fc1_wgrad
        CALLS["backward_dw"] += 1
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class TE23Linear(Linear):
    """:class:`Linear` as TE 2.3-2.6: no hooks API (2.7 has it), ``weight.grad`` assigned only when
    ``None`` (to 2.7)."""

    hooks_api = False
    assign_weight_grad_always = False
    register_wgrad_accumulation_and_reduce_hooks = None  # type: ignore[assignment]  # absent before 2.7


class FP8Linear(Linear):
    """:class:`Linear` with TE's FP8 (or debug-mode) bias path: bias gradient in B, ``bgrad=None`` in W."""

    fp8 = True


class _GroupedLinearFunction(torch.autograd.Function):
    """TE's ``_GroupedLinear`` (``module/grouped_linear.py``, the per-GEMM-weights path) for
    non-quantised GEMMs on CPU."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, module: "GroupedLinear", m_splits: list[int],
                is_first_microbatch: Optional[bool], *params: torch.Tensor) -> torch.Tensor:
        n = module.num_gemms
        weights, biases = params[:n], (params[n:] if module.use_bias else (None,) * n)
        xs = torch.split(inp.reshape(-1, inp.shape[-1]), m_splits)
        out = torch.cat([torch.nn.functional.linear(x, w, b) for x, w, b in zip(xs, weights, biases)])
        ctx.save_for_backward(inp, *weights)
        ctx.weight_objects = weights
        ctx.module, ctx.m_splits, ctx.is_first_microbatch = module, m_splits, is_first_microbatch
        ctx.wgrad_store = module.wgrad_store if module.wgrad_store.delay_wgrad_compute() else None
        return out.view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inp, *weights = ctx.saved_tensors
        module, n, origin = ctx.module, ctx.module.num_gemms, ctx.weight_objects
        xs = torch.split(inp.reshape(-1, inp.shape[-1]), ctx.m_splits)
        dys = torch.split(grad_output.reshape(-1, grad_output.shape[-1]), ctx.m_splits)
        dgrad = torch.cat([dy.matmul(w) for dy, w in zip(dys, weights)]).view(inp.shape)
        fuse, use_bias = module.fuse_wgrad_accumulation, module.use_bias
        accumulate = fuse and not ctx.is_first_microbatch if ctx.is_first_microbatch is not None else fuse
        if fuse:
            wgrad_list = [w.main_grad for w in origin]
        else:  # TE: torch.empty (uninitialised); NaN here so that the garbage shows wherever it lands
            packed = torch.full((n, *weights[0].shape), float("nan"), dtype=weights[0].dtype,
                                device=weights[0].device)
            wgrad_list = [packed[i] for i in range(n)]

        def grouped_gemm_wgrad(xs, dys, grad_weights):
            for x, dy, gw in zip(xs, dys, grad_weights):
                dw = dy.t().matmul(x)
                gw.add_(dw) if accumulate else gw.copy_(dw)
            return None, [dy.sum(dim=0) if use_bias else None for dy in dys], None

        grad_biases = [None] * n
        delayed = ctx.wgrad_store is not None and ctx.wgrad_store.delay_wgrad_compute()
        if delayed:
            ctx.wgrad_store.put([xs, dys, wgrad_list], grouped_gemm_wgrad)
        else:
            _, grad_biases, _ = grouped_gemm_wgrad(xs, dys, wgrad_list)
        wgrads = []
        for w, g in zip(origin, wgrad_list):  # handle_custom_ddp_from_mcore
            if fuse and hasattr(w, "grad_added_to_main_grad"):
                w.grad_added_to_main_grad = True
                g = torch.zeros(w.main_grad.shape, dtype=w.dtype, device=w.main_grad.device)
            elif fuse:
                g = None
            wgrads.append(g)
        if delayed and not module.returns_wgrad_buffer:  # TE 2.3-2.7
            wgrads = [None] * n
        if delayed or not use_bias:
            grad_biases = [None] * n
        return (dgrad, None, None, None, *wgrads, *(grad_biases if use_bias else ()))


class GroupedLinear(torch.nn.Module):
    """TE's ``te.pytorch.GroupedLinear`` (MoE grouped GEMM; ``weight<i>``, ``bias<i>``), CPU.

    ``returns_wgrad_buffer``: TE >= 2.8 without ``fuse_wgrad_accumulation`` returns to
    autograd, in a delayed backward, the packed weight-gradient buffer it queued -- allocated
    with ``torch.empty`` and filled only by the delayed GEMM (TE 2.3-2.7 returned ``None``).
    ``backward_dw`` (TE 2.8) pops one entry, assigns ``weight<i>.grad`` from the filled buffer
    and, when ``bias<i>.grad`` is empty, the bias gradient.
    """

    returns_wgrad_buffer = True

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True,
                 fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False) -> None:
        super().__init__()
        self.num_gemms, self.use_bias = num_gemms, bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", torch.nn.Parameter(torch.randn(out_features, in_features) * 0.02))
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(out_features)))
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        self.wgrad_accumulation_and_reduce_hooks: list[Callable[[], None]] = []
        self.is_first_microbatch: Optional[bool] = None
        if delay_wgrad_compute:  # as TE >= 2.8
            for p in self.parameters():
                p.skip_backward_post_hook = True
        _LIVE.append(self)

    def _weights(self) -> list[torch.nn.Parameter]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _biases(self) -> list[torch.nn.Parameter]:
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)] if self.use_bias else []

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        return _GroupedLinearFunction.apply(inp, self, m_splits, self.is_first_microbatch,
                                            *self._weights(), *self._biases())

    register_wgrad_accumulation_and_reduce_hooks = Linear.register_wgrad_accumulation_and_reduce_hooks
    need_backward_dw = Linear.need_backward_dw

    def backward_dw(self) -> None:
        if not self.need_backward_dw():
            return
        (_, grad_biases_, _), tensor_list = self.wgrad_store.pop()
        wgrad_list = tensor_list[2]
        if not self.fuse_wgrad_accumulation:
            for w, g in zip(self._weights(), wgrad_list):
                w.grad = g.to(w.dtype)
        for b, g in zip(self._biases(), grad_biases_):
            if b.grad is None:
                b.grad = g.to(b.dtype)
        CALLS["backward_dw"] += 1
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class GroupedLinearTE27(GroupedLinear):
    """:class:`GroupedLinear` as TE 2.3-2.7: a delayed backward returns no weight gradient."""

    returns_wgrad_buffer = False


class TEFusedMLP(torch.nn.Module):
    """megatron-core's ``TEFusedMLP`` (``use_te_op_fuser``; ``extensions/transformer_engine.py``)
    reduced to what the route sees: TE modules ``linear_fc1`` (:class:`LayerNormLinear`) and
    ``linear_fc2`` (:class:`Linear`) built with ``delay_wgrad_compute`` whose own forward never
    runs -- TE's op fuser (``te.pytorch.ops.Sequential`` of ``LayerNorm``, ``BasicLinear``,
    ``Bias``, activation) runs their parameters instead, and ``BasicLinear`` has no wgrad store:
    every weight gradient is computed in the backward (here: autograd through
    ``torch.nn.functional``). Nothing is ever queued."""

    def __init__(self, hidden: int, ffn_hidden: int, *, delay_wgrad_compute: bool = False) -> None:
        super().__init__()
        self.linear_fc1 = LayerNormLinear(hidden, ffn_hidden, delay_wgrad_compute=delay_wgrad_compute)
        self.linear_fc2 = Linear(ffn_hidden, hidden, delay_wgrad_compute=delay_wgrad_compute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        h = torch.nn.functional.layer_norm(x, (fc1.in_features,), fc1.layer_norm_weight, fc1.layer_norm_bias, fc1.eps)
        h = torch.nn.functional.gelu(torch.nn.functional.linear(h, fc1.weight, fc1.bias))
        return torch.nn.functional.linear(h, fc2.weight, fc2.bias)


# ---------------------------------------------------------------------- megatron-core's wrappers
class _MegatronTEWrapper:
    """What megatron-core's TE wrappers add to a TE module (``extensions/transformer_engine.py``)."""

    def _megatron_init(self, config: Any, tp_group: Any) -> None:
        self.config = config
        self.is_first_microbatch = True
        size = 1 if tp_group is None else tp_group.size()
        if size != 1:
            raise NotImplementedError(f"the TE test double has no tensor parallelism (group of size {size})")
        for p in self.parameters():
            p.allreduce = True

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        first = None if self.config.disable_parameter_transpose_cache else self.is_first_microbatch
        out = super().forward(x, is_first_microbatch=first)
        self.is_first_microbatch = False
        if self.return_bias:
            return out
        return out, None

    def backward_dw(self) -> None:
        if self.config.delay_wgrad_compute:
            super().backward_dw()


def _check_release_keywords(cls: type, extra: dict[str, Any]) -> None:
    """Refuse, as Python would, a keyword the installed megatron-core's wrappers do not take:
    the wrappers' keywords beyond 0.16.1's are :func:`megatron_compat.te.te_wrapper_keywords`
    (the double does not use them: TE's ``name`` serves its debug tools)."""
    from megatron_zb.megatron_compat.te import te_wrapper_keywords

    unknown = sorted(set(extra) - set(te_wrapper_keywords()))
    if unknown:
        raise TypeError(f"{cls.__name__}.__init__() got an unexpected keyword argument {unknown[0]!r}")


def _te_kwargs(config: Any, *, bias: bool, skip_bias_add: bool, init_method: Any,
               parallel_mode: str) -> dict[str, Any]:
    return dict(bias=bias, return_bias=skip_bias_add and bias, parallel_mode=parallel_mode,
                init_method=init_method if config.perform_initialization else (lambda w: None),
                fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
                delay_wgrad_compute=config.delay_wgrad_compute, params_dtype=config.params_dtype)


def _refuse_gather(gather_output: bool, skip_weight_param_allocation: bool) -> None:
    if gather_output or skip_weight_param_allocation:
        raise ValueError("Transformer Engine linear layers do not support gather_output / skip_weight_param_allocation")


class TEColumnParallelLinear(_MegatronTEWrapper, Linear):
    """megatron-core's ``TEColumnParallelLinear`` over the double."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, gather_output: bool,
                 bias: bool, skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group: Any = None, stride: int = 1,
                 **release_keywords: Any) -> None:
        _check_release_keywords(type(self), release_keywords)
        _refuse_gather(gather_output, skip_weight_param_allocation)
        Linear.__init__(self, input_size, output_size,
                        **_te_kwargs(config, bias=bias, skip_bias_add=skip_bias_add, init_method=init_method,
                                     parallel_mode="column"))
        self._megatron_init(config, tp_group)


class TERowParallelLinear(_MegatronTEWrapper, Linear):
    """megatron-core's ``TERowParallelLinear`` over the double."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, bias: bool,
                 input_is_parallel: bool, skip_bias_add: bool, is_expert: bool,
                 tp_comm_buffer_name: Optional[str] = None, tp_group: Any = None,
                 **release_keywords: Any) -> None:
        _check_release_keywords(type(self), release_keywords)
        if not input_is_parallel:
            raise ValueError("Transformer Engine linear layers do not support input_is_parallel = False")
        Linear.__init__(self, input_size, output_size,
                        **_te_kwargs(config, bias=bias, skip_bias_add=skip_bias_add, init_method=init_method,
                                     parallel_mode="row"))
        self._megatron_init(config, tp_group)


class TELayerNormColumnParallelLinear(_MegatronTEWrapper, LayerNormLinear):
    """megatron-core's ``TELayerNormColumnParallelLinear`` over the double."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, init_method: Callable, gather_output: bool,
                 bias: bool, skip_bias_add: bool, is_expert: bool, skip_weight_param_allocation: bool = False,
                 tp_comm_buffer_name: Optional[str] = None, tp_group: Any = None, stride: int = 1,
                 **release_keywords: Any) -> None:
        _check_release_keywords(type(self), release_keywords)
        _refuse_gather(gather_output, skip_weight_param_allocation)
        LayerNormLinear.__init__(self, input_size, output_size, eps=config.layernorm_epsilon,
                                 normalization=config.normalization,
                                 **_te_kwargs(config, bias=bias, skip_bias_add=skip_bias_add,
                                              init_method=init_method, parallel_mode="column"))
        self._megatron_init(config, tp_group)


FLAVOURS: dict[str, dict[str, Any]] = {
    "te2.18": {},
    "te2.3": {"hooks_api": False, "assign_weight_grad_always": False,
              "register_wgrad_accumulation_and_reduce_hooks": None},
    "fp8": {"fp8": True},
}
"""Class attributes of each flavour of the double (see :class:`Linear`)."""


def _spec_provider(flavour: str) -> type:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    attrs = FLAVOURS[flavour]

    def flavoured(cls: type) -> type:
        return type(cls.__name__ + flavour, (cls,), dict(attrs)) if attrs else cls

    class DoubleTESpecProvider(LocalSpecProvider):
        """megatron-core's ``TESpecProvider`` with the double's classes (and local attention)."""

        def column_parallel_linear(self) -> type:
            return flavoured(TEColumnParallelLinear)

        def row_parallel_linear(self) -> type:
            return flavoured(TERowParallelLinear)

        def fuse_layernorm_and_linear(self) -> bool:
            return True

        def column_parallel_layer_norm_linear(self) -> type:
            return flavoured(TELayerNormColumnParallelLinear)

        def core_attention(self) -> type:
            return DotProductAttention

        def grouped_mlp_modules(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the TE test double has no grouped MLP")

    return DoubleTESpecProvider


def gpt_layer_spec(*, flavour: str = "te2.18") -> Any:
    """megatron-core's ``get_gpt_layer_with_transformer_engine_spec()`` built from the double
    (``flavour``: a key of :data:`FLAVOURS`)."""
    from megatron.core.models.gpt import gpt_layer_specs

    missing = object()
    saved = getattr(gpt_layer_specs, "TESpecProvider", missing)
    gpt_layer_specs.TESpecProvider = _spec_provider(flavour)
    try:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    finally:
        if saved is missing:
            del gpt_layer_specs.TESpecProvider
        else:
            gpt_layer_specs.TESpecProvider = saved


def gpt_layer_spec_te23() -> Any:
    """:func:`gpt_layer_spec` in the TE 2.3-2.7 flavour."""
    return gpt_layer_spec(flavour="te2.3")


def gpt_layer_spec_fp8() -> Any:
    """:func:`gpt_layer_spec` in the FP8 flavour (bias gradients in B, see :class:`Linear`)."""
    return gpt_layer_spec(flavour="fp8")


def queues_empty(module: Optional[torch.nn.Module] = None) -> bool:
    """Whether every double in ``module`` (default: built in this process) has an empty queue."""
    mods = _LIVE if module is None else [m for m in module.modules() if isinstance(m, (Linear, GroupedLinear))]
    return all(m.wgrad_store.context is None or m.wgrad_store.context.empty() for m in mods)
