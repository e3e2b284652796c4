"""The linear route keeps megatron-core's tensor-parallel overlap, and its cached dummy weight
gradient is never written to nor taken for a real gradient (issue 30).

Real megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` layers (column, row, column,
row) inside megatron-core DDP, TP=2 in two gloo processes, with and without sequence parallelism
(with it also ``gradient_accumulation_fusion``, through the CPU fallback kernels). A recorder
wraps what the linear autograd function issues: ``torch.distributed``'s collectives and
megatron-core's ``tensor_parallel.layers`` aliases of them (the returned work's ``wait()`` too),
and ``torch.matmul`` / ``Tensor.matmul`` -- every GEMM of megatron-core's backward, of the route
and of the fused-accumulation fallback. It records the order in which work is *issued*; the
collectives of the mapping functions between layers (megatron-core's ``mappings`` aliases) are
not recorded. On CPU gloo runs collectives on its own threads; whether they overlap with the GEMMs
on a GPU (NCCL streams, ``CUDA_DEVICE_MAX_CONNECTIONS=1``) is not observable here.
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.runtime import linear_route
from megatron_zb.runtime.linear_route import DUMMY_WGRADS, dummy_wgrad, check_device_max_connections
from megatron_zb.testing import run_distributed

S, B = 8, 2  # sequence length and micro batch of the layer stack's input
COLUMNS = ("l1", "l3")  # the column-parallel layers: the ones whose backward communicates
W_QUEUE = ("l4", "l3", "l2", "l1")  # a W runs its B's entries in backward order


# ---------------------------------------------------------------------- the recorder
class _Work:
    """A collective's work handle whose ``wait()`` is recorded."""

    def __init__(self, work: Any, events: list[tuple], label: tuple) -> None:
        self._work, self._events, self._label = work, events, label

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        self._events.append(("wait",) + self._label)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _Recorder:
    """Records collectives (op, layer) and GEMMs (dgrad / wgrad, layer) while ``on``.

    A collective's layer is told by its input's last dimension (the layer's input width); a GEMM
    is a ``dgrad`` when its right operand is a layer's weight, a ``wgrad`` when it yields a
    weight-shaped matrix.
    """

    def __init__(self, layers: dict[str, Any]) -> None:
        self.events: list[tuple] = []
        self.on = False
        self._ptr = {m.weight.data_ptr(): n for n, m in layers.items()}
        self._shape = {tuple(m.weight.shape): n for n, m in layers.items()}
        self._width = {m.input_size: n for n, m in layers.items() if n in COLUMNS}
        self._undo: list[tuple[Any, str, Any]] = []

    def _gemm(self, orig: Any) -> Any:
        def matmul(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = orig(a, b, *args, **kwargs)
            if self.on:
                if b.data_ptr() in self._ptr:
                    self.events.append(("dgrad", self._ptr[b.data_ptr()]))
                elif out.dim() == 2 and tuple(out.shape) in self._shape:
                    self.events.append(("wgrad", self._shape[tuple(out.shape)]))
                else:
                    self.events.append(("gemm", tuple(out.shape)))
            return out

        return matmul

    def _collective(self, op: str, orig: Any, input_index: int) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            work = orig(*args, **kwargs)
            if not self.on:
                return work
            label = (op, self._width.get(args[input_index].shape[-1], "?"))
            self.events.append(("launch",) + label + (work is not None,))
            return _Work(work, self.events, label) if work is not None else None

        return collective

    def _patch(self, owner: Any, name: str, make: Any) -> None:
        orig = getattr(owner, name)
        self._undo.append((owner, name, orig))
        setattr(owner, name, make(orig))

    def __enter__(self) -> "_Recorder":
        import torch.distributed as dist
        from megatron.core.tensor_parallel import layers

        self._patch(torch.Tensor, "matmul", self._gemm)
        self._patch(torch, "matmul", self._gemm)
        for owner, name, op, idx in ((dist, "all_reduce", "all_reduce", 0),
                                     (dist, "reduce_scatter_tensor", "reduce_scatter", 1),
                                     (dist, "all_gather_into_tensor", "all_gather", 1),
                                     (layers, "dist_reduce_scatter_func", "reduce_scatter", 1),
                                     (layers, "dist_all_gather_func", "all_gather", 1)):
            self._patch(owner, name, partial(self._collective, op, input_index=idx))
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)

    def take(self) -> list[tuple]:
        out, self.events = self.events, []
        return out


# ---------------------------------------------------------------------- the TP=2 run
def _stack(config: Any) -> torch.nn.Module:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init = partial(torch.nn.init.normal_, std=0.5)

    class Stack(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = config
            self.l1 = ColumnParallelLinear(8, 12, config=config, init_method=init, bias=True, gather_output=False)
            self.l2 = RowParallelLinear(12, 14, config=config, init_method=init, bias=True, input_is_parallel=True,
                                        skip_bias_add=False)
            self.l3 = ColumnParallelLinear(14, 20, config=config, init_method=init, bias=True, gather_output=False)
            self.l4 = RowParallelLinear(20, 16, config=config, init_method=init, bias=True, input_is_parallel=True,
                                        skip_bias_add=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.gelu(self.l1(x)[0])
            h = self.l3(self.l2(h)[0])[0]
            return self.l4(torch.nn.functional.gelu(h))[0]

    return Stack()


def _variant(sp: bool, fusion: bool) -> dict[str, Any]:
    """megatron-core's backward (reference), then the route's B's and W's, over two microbatches."""
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_zb.runtime import WeightGradStore, install_routes, uninstall_routes

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                               tensor_model_parallel_size=2, sequence_parallel=sp,
                               gradient_accumulation_fusion=fusion)
    stack = _stack(config)
    stack.l2.weight.zero_out_wgrad = True  # its dummy is the zero-filled one, which DDP adds
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=stack)
    layers = {n: getattr(stack, n) for n in ("l1", "l2", "l3", "l4")}
    g = torch.Generator().manual_seed(11 + (dist.get_rank() if sp else 0))  # SP: each rank its sequence shard
    seq = S // 2 if sp else S
    xs = [torch.randn(seq, B, 8, generator=g) for _ in range(2)]
    gys = [torch.randn(S // 2 if sp else S, B, 16, generator=g) for _ in range(2)]
    params = dict(stack.named_parameters())

    def grads(xis: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {n: p.main_grad.clone() for n, p in params.items()}
        out.update({f"x{i}": xi.grad.clone() for i, xi in enumerate(xis)})
        return out

    rec = _Recorder(layers)
    with rec:
        uninstall_routes()  # megatron-core's own backward: the reference
        xis = [x.clone().requires_grad_(True) for x in xs]
        for i, (xi, gy) in enumerate(zip(xis, gys)):
            out = model(xi)
            rec.on = i == 0
            out.backward(gy)
            rec.on = False
        ref = grads(xis)
        mcore = rec.take()
        model.zero_grad_buffer()

        install_routes()
        DUMMY_WGRADS.clear()
        store = WeightGradStore()
        xis = [x.clone().requires_grad_(True) for x in xs]
        grad_none_after_b, b_events, w_events = [], [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for mb, (xi, gy) in enumerate(zip(xis, gys)):
                out = model(xi)
                with store.deferring(0, mb):
                    rec.on = True
                    out.backward(gy)
                    rec.on = False
                b_events.append(rec.take())
                grad_none_after_b.append(all(p.grad is None for p in params.values()))
                if mb == 0:  # mark the uninitialised dummies: a NaN reaching a gradient or overwritten shows
                    buffers = DUMMY_WGRADS.buffers(zero=False) + DUMMY_WGRADS.buffers(zero=True)
                    for buf in DUMMY_WGRADS.buffers(zero=False):
                        buf.data.fill_(float("nan"))  # .data: not an in-place write the guard checks
            for mb in range(2):
                rec.on = True
                store.run(0, mb)
                rec.on = False
                w_events.append(rec.take())
        store.assert_empty()
        got = grads(xis)
        uninstall_routes()
    empty, zero = DUMMY_WGRADS.buffers(zero=False), DUMMY_WGRADS.buffers(zero=True)
    return {
        "mcore": mcore, "b": b_events, "w": w_events, "ref": ref, "got": got,
        "grad_none_after_b": grad_none_after_b,
        "buffers_once": [id(b) for b in empty + zero] == [id(b) for b in buffers],
        "buffer_shapes": sorted(tuple(b.shape) for b in empty + zero),
        "weight_shapes": sorted(tuple(m.weight.shape) for m in layers.values()),
        "nan_buffers_intact": [bool(b.isnan().all()) for b in empty],
        "zero_buffers": [(tuple(b.shape), bool((b == 0).all())) for b in zero],
        "route_warnings": [str(w.message) for w in caught if "megatron-zb linear route" in str(w.message)],
    }


def _tp2_variants() -> list[dict[str, Any]]:
    from megatron_zb.runtime.wgrad_kernels import install_megatron_fallback
    from megatron_zb.testing import init_parallel_state

    install_megatron_fallback()
    init_parallel_state(tensor_model_parallel_size=2, seed=5)
    return [_variant(sp=False, fusion=False), _variant(sp=True, fusion=True)]


@pytest.fixture(scope="module")
def tp2() -> list[list[dict[str, Any]]]:
    """Per rank: [TP=2 without SP, TP=2 with SP and fused accumulation]."""
    return run_distributed(_tp2_variants, world_size=2, timeout=120)


def _before(events: list[tuple], *chain: tuple) -> None:
    """Each event of ``chain`` occurs once in ``events``, in this order."""
    where = []
    for ev in chain:
        hits = [i for i, e in enumerate(events) if e == ev]
        assert len(hits) == 1, (ev, events)
        where.append(hits[0])
    assert where == sorted(where), (chain, events)


# ---------------------------------------------------------------------- order
@pytest.mark.parametrize("variant", [0, 1], ids=["tp2", "tp2-sp"])
def test_megatron_core_hides_each_collective_behind_a_gemm(tp2, variant):
    """What the route keeps, read from megatron-core's own backward (routes uninstalled): SP's
    all-gather launched before the input-gradient GEMM and waited after it; the all-reduce /
    reduce-scatter launched before the weight-gradient GEMM and waited after it."""
    for rank in tp2:
        ev = rank[variant]["mcore"]
        for layer in COLUMNS:
            if variant:
                _before(ev, ("launch", "all_gather", layer, True), ("dgrad", layer), ("wait", "all_gather", layer),
                        ("launch", "reduce_scatter", layer, True), ("wgrad", layer),
                        ("wait", "reduce_scatter", layer))
            else:
                _before(ev, ("dgrad", layer), ("launch", "all_reduce", layer, True), ("wgrad", layer),
                        ("wait", "all_reduce", layer))


@pytest.mark.parametrize("variant", [0, 1], ids=["tp2", "tp2-sp"])
def test_b_launches_the_input_gradient_collective_after_its_gemm_and_waits_last(tp2, variant):
    """B: megatron-core's collective, launched async right after the input-gradient GEMM; no
    weight-gradient GEMM and no all-gather in B (they are W's)."""
    op = "reduce_scatter" if variant else "all_reduce"
    for rank in tp2:
        for ev in rank[variant]["b"]:
            assert not any(e[0] == "wgrad" or e[1:2] == ("all_gather",) for e in ev), ev
            assert [e for e in ev if e[0] == "dgrad"] == [("dgrad", n) for n in W_QUEUE], ev
            for layer in COLUMNS:
                _before(ev, ("dgrad", layer), ("launch", op, layer, True), ("wait", op, layer))


@pytest.mark.parametrize("variant", [0, 1], ids=["tp2", "tp2-sp"])
def test_w_launches_each_sp_all_gather_before_the_previous_entrys_gemm(tp2, variant):
    """W runs the weight-gradient GEMMs in the queue's order; with SP each column layer's input
    all-gather is launched (async) before the GEMM of the entry queued before it and waited
    after that GEMM, just before its own. Without SP, W communicates nothing."""
    for rank in tp2:
        for ev in rank[variant]["w"]:
            assert [e for e in ev if e[0] in ("wgrad", "dgrad")] == [("wgrad", n) for n in W_QUEUE], ev
            if not variant:
                assert [e for e in ev if e[0] != "wgrad"] == [], ev
                continue
            assert len(ev) == len(W_QUEUE) + 2 * len(COLUMNS), ev
            for layer, previous in (("l3", "l4"), ("l1", "l2")):
                _before(ev, ("launch", "all_gather", layer, True), ("wgrad", previous),
                        ("wait", "all_gather", layer), ("wgrad", layer))


# ---------------------------------------------------------------------- results and the dummy
@pytest.mark.parametrize("variant", [0, 1], ids=["tp2", "tp2-sp"])
def test_gradients_bitwise_equal_to_megatron_core(tp2, variant):
    """main_grad of every weight and bias and both microbatches' input gradients: bitwise equal
    to megatron-core's non-split backward, and finite (the NaN-marked dummies reached nothing)."""
    for rank in tp2:
        r = rank[variant]
        assert r["ref"].keys() == r["got"].keys() and len(r["ref"]) == 8 + 2
        for name, want in r["ref"].items():
            assert torch.equal(r["got"][name], want), name
            assert torch.isfinite(r["got"][name]).all() and want.abs().sum() > 0, name


@pytest.mark.parametrize("variant", [0, 1], ids=["tp2", "tp2-sp"])
def test_cached_dummy_is_allocated_once_never_written_and_never_kept(tp2, variant):
    """One dummy per weight shape (all differ here; l2's is the zero-filled one), the same
    tensors in both microbatches' B's; after each B no parameter keeps a ``.grad`` (DDP's hook
    dropped the alias autograd handed it); the NaN-marked dummies are all NaN at the end and the
    zero-filled one all zero: nothing wrote into them."""
    for rank in tp2:
        r = rank[variant]
        assert r["buffer_shapes"] == r["weight_shapes"] and r["buffers_once"]
        assert r["grad_none_after_b"] == [True, True]
        assert r["nan_buffers_intact"] == [True, True, True]
        assert r["zero_buffers"] == [((14, 6), True)]


def test_no_device_max_connections_warning_on_cpu(tp2):
    for rank in tp2:
        for r in rank:
            assert r["route_warnings"] == []


# ---------------------------------------------------------------------- unit checks
def test_a_write_into_a_kept_dummy_is_refused():
    """A dummy kept as ``.grad`` and summed into in place (what ``AccumulateGrad`` does when
    ``.grad`` was not cleared) is caught at the next B, not handed out again."""
    w = torch.nn.Parameter(torch.zeros(3, 2))
    w.grad_added_to_main_grad = False
    DUMMY_WGRADS.clear()
    first = dummy_wgrad(w)
    assert dummy_wgrad(w).data_ptr() == first.data_ptr() and len(DUMMY_WGRADS.buffers(zero=False)) == 1
    w.zero_out_wgrad = True
    zero = dummy_wgrad(w)
    assert zero.data_ptr() != first.data_ptr() and not zero.count_nonzero()
    w.grad = zero
    w.grad += torch.ones(3, 2)
    with pytest.raises(RuntimeError, match=r"cached dummy weight gradient \(3, 2\) torch.float32 was written to"):
        dummy_wgrad(w)
    DUMMY_WGRADS.clear()


def test_device_max_connections_checked_on_cuda_only(monkeypatch):
    monkeypatch.setattr(linear_route, "_warned_max_connections", False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not check_device_max_connections(torch.device("cpu"))
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        assert not check_device_max_connections(torch.device("cuda"))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.warns(UserWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert check_device_max_connections(torch.device("cuda", 0))
    assert not check_device_max_connections(torch.device("cuda", 0))  # once per process, as megatron-core


def test_a_failing_apex_import_is_tried_once(monkeypatch):
    """Every W of a CUDA run asks for the fused kernels; without apex the failing import (milliseconds,
    a search of sys.path) is tried once per process, not once per W."""
    import builtins

    from megatron_zb.runtime import wgrad_kernels

    tries = []
    real_import = builtins.__import__

    def counting_import(name, *args, **kwargs):
        if name == "fused_weight_gradient_mlp_cuda":
            tries.append(name)
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    wgrad_kernels.fused_kernels.cache_clear()
    monkeypatch.setattr(builtins, "__import__", counting_import)
    try:
        first, second = wgrad_kernels.fused_kernels(), wgrad_kernels.fused_kernels()
    finally:
        wgrad_kernels.fused_kernels.cache_clear()
    assert isinstance(first, wgrad_kernels.MatmulWgradKernels) and second is first
    assert tries == ["fused_weight_gradient_mlp_cuda"]
