"""The layer route table and the weight-gradient store's parameter bookkeeping.

Store unit tests use real tensors and plain Python callables as W work (the store only calls
them). The route tests use megatron-core's real ``ColumnParallelLinear`` and real GPT chunks in
gloo processes.
"""

from __future__ import annotations

import importlib
from functools import partial

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.megatron_compat import LINEAR_AUTOGRAD_FUNCTION, LINEAR_CTX_FIELDS
from megatron_zb.runtime import (ROUTES, LayerRoute, ModuleRoute, WeightGradStore, WeightGradStoreError,
                                 current_store, install_routes, uninstall_routes)
from megatron_zb.runtime.routes import get_route
from megatron_zb.testing import run_distributed


@pytest.fixture
def routes_restored():
    """Leave the routes as installed (or not) as before the test."""
    before = {r.name: r.installed for r in ROUTES}
    yield
    for r in ROUTES:
        if before[r.name]:
            r.install()
        else:
            r.uninstall()


# ---------------------------------------------------------------------- the table
def test_every_row_names_a_real_megatron_core_object_and_says_how_b_queues_w():
    assert [r.name for r in ROUTES] == ["linear", "transformer-engine"]
    for r in ROUTES:
        assert len(r.b_queues_w) > 20
        if isinstance(r, LayerRoute):  # object routes replace something megatron-core really has
            assert r.module.startswith("megatron.core.") and r.attribute
            assert getattr(importlib.import_module(r.module), r.attribute) is not None
    assert isinstance(get_route("transformer-engine"), ModuleRoute)  # TE: hooks, nothing replaced
    linear = get_route("linear")
    assert (linear.module, linear.attribute) == LINEAR_AUTOGRAD_FUNCTION
    with pytest.raises(KeyError, match="no layer route named 'te'"):
        get_route("te")


def test_install_and_uninstall_are_idempotent(routes_restored):
    from megatron.core.tensor_parallel import layers

    uninstall_routes()
    uninstall_routes()
    original = layers.LinearWithGradAccumulationAndAsyncCommunication
    assert original.__module__ == "megatron.core.tensor_parallel.layers"
    install_routes()
    replacement = layers.LinearWithGradAccumulationAndAsyncCommunication
    assert replacement is not original and issubclass(replacement, original)
    assert replacement is get_route("linear").replacement
    install_routes()
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is replacement  # not wrapped twice
    uninstall_routes()
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is original
    uninstall_routes()
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is original
    assert not get_route("linear").installed


def test_uninstall_refuses_to_undo_a_foreign_replacement(routes_restored):
    from megatron.core.tensor_parallel import layers

    uninstall_routes()
    original = layers.LinearWithGradAccumulationAndAsyncCommunication
    install_routes()
    foreign = type("Foreign", (original,), {})
    layers.LinearWithGradAccumulationAndAsyncCommunication = foreign
    try:
        with pytest.raises(RuntimeError, match="replaced by something else"):
            uninstall_routes()
        assert layers.LinearWithGradAccumulationAndAsyncCommunication is foreign
    finally:
        layers.LinearWithGradAccumulationAndAsyncCommunication = get_route("linear").replacement
        uninstall_routes()
    assert layers.LinearWithGradAccumulationAndAsyncCommunication is original


# ---------------------------------------------------------------------- the store
def _adder(p: torch.Tensor, log: list[str], tag: str):
    def fn() -> None:
        log.append(tag)
        p.grad = torch.ones_like(p) if p.grad is None else p.grad + 1

    return fn


def test_store_is_current_only_inside_its_b_window():
    a, b = WeightGradStore(), WeightGradStore()
    assert current_store() is None
    with a.deferring(0, 0):
        assert current_store() is a and a.is_deferring
        with pytest.raises(WeightGradStoreError, match="B of stage 1 microbatch 0 started while B of stage 0 "
                                                       "microbatch 0 is open"):
            with b.deferring(1, 0):
                pass
        assert current_store() is a
    assert current_store() is None and not a.is_deferring
    with pytest.raises(WeightGradStoreError, match="outside a B pass"):
        a.put(lambda: None, params=())
    a.run(0, 0)  # empty queue of that B
    b.assert_empty()


def test_store_runs_each_w_entry_and_reports_a_params_last_w():
    """Stage 0 runs 3 W's (params w0, w1), stage 1 runs 2 (param v): each stage's params are
    reported once, right after that stage's last W, and remaining_w counts down to 0."""
    w0, w1, v = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    log: list[str] = []
    done: list[tuple[list[str], tuple[torch.Tensor, ...]]] = []
    store = WeightGradStore()
    store.on_params_done = lambda params: done.append((list(log), params))
    store.begin_iteration({0: 3, 1: 2})
    for mb in range(3):
        with store.deferring(0, mb):
            store.put(_adder(w0, log, f"w0.{mb}"), params=(w0,))
            store.put(_adder(w1, log, f"w1.{mb}"), params=(w1,))
    assert store.remaining_w(w0) == 3 and store.remaining_w(v) is None
    store.run(0, 0)
    assert log == ["w0.0", "w1.0"] and store.remaining_w(w0) == 2 and done == []
    for mb in range(2):
        with store.deferring(1, mb):
            store.put(_adder(v, log, f"v.{mb}"), params=(v,))
    store.run(1, 0)
    store.run(0, 1)
    assert done == [] and store.remaining_w(w1) == 1 and store.remaining_w(v) == 1
    store.run(0, 2)
    assert len(done) == 1
    seen, params = done[0]
    assert seen[-2:] == ["w0.2", "w1.2"] and params[0] is w0 and params[1] is w1 and len(params) == 2
    assert store.remaining_w(w0) == 0 and store.remaining_w(v) == 1
    store.run(1, 1)
    assert len(done) == 2 and done[1][1] == (v,) and done[1][1][0] is v
    assert torch.equal(w0.grad, torch.full((2,), 3.0)) and torch.equal(v.grad, torch.full((2,), 2.0))
    assert store.executed == 8
    store.assert_empty()


def test_store_refuses_w_beyond_the_announced_count_and_hook_without_counts():
    p = torch.nn.Parameter(torch.zeros(1))
    store = WeightGradStore()
    store.begin_iteration({0: 1})
    for mb in range(2):
        with store.deferring(0, mb):
            store.put(_adder(p, [], ""), params=(p,))
    store.run(0, 0)
    with pytest.raises(WeightGradStoreError, match="W of stage 0 microbatch 1 is one more W than begin_iteration"):
        store.run(0, 1)
    assert p.grad is not None and float(p.grad) == 1.0  # the refused W did not run
    with pytest.raises(WeightGradStoreError, match="iteration started with weight gradients still pending for "
                                                   r"\(stage 0, microbatch 1\)"):
        store.begin_iteration({0: 1})
    store.clear()
    store.on_params_done = lambda params: None
    with store.deferring(0, 0):
        store.put(_adder(p, [], ""), params=(p,))
    with pytest.raises(WeightGradStoreError, match="on_params_done set but no W count for stage 0"):
        store.run(0, 0)


def test_store_runs_a_group_layer_major_and_each_gradient_in_microbatch_order():
    """Four micro batches queue, per B: layer A's entry (weight w, bias b), layer B's (v), then another entry
    into w alone (a weight used twice). Micro batch 0's W runs alone (not the stage's last: nothing is
    reported); then 1, 2, 3 as one group: A's layer (its two entries, which share w) for micro batches 1, 2,
    3, then B's -- so w receives A.1, C.1, A.2, C.2, A.3, C.3, the order of the W's one by one. Being the
    stage's last W, with per-entry reports, each parameter is reported right after its last entry: b after
    A.3, w after C.3, v after B.3."""
    w, b, v = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    log: list[str] = []
    done: list[tuple[str, set[int]]] = []
    store = WeightGradStore()
    store.on_params_done = lambda params: done.append((log[-1], {id(p) for p in params}))
    store.report_per_entry = True
    store.begin_iteration({0: 4})
    for mb in range(4):
        with store.deferring(0, mb):
            store.put(_adder(w, log, f"A.{mb}"), params=(w, b))
            store.put(_adder(v, log, f"B.{mb}"), params=(v,))
            store.put(_adder(w, log, f"C.{mb}"), params=(w,))
    assert store.run_group(0, (0,)) == 3 and done == []
    log.clear()
    assert store.run_group(0, (1, 2, 3)) == 9
    assert log == ["A.1", "C.1", "A.2", "C.2", "A.3", "C.3", "B.1", "B.2", "B.3"]
    assert done == [("A.3", {id(b)}), ("C.3", {id(w)}), ("B.3", {id(v)})]
    assert torch.equal(w.grad, torch.full((2,), 8.0)) and store.executed == 12 and store.remaining_w(w) == 0
    store.assert_empty()
    with pytest.raises(WeightGradStoreError, match="W of stage 0 microbatch 0 has nothing to run"):
        store.run_group(0, (0,))


# ---------------------------------------------------------------------- the linear row, real megatron-core
def _column_parallel_linear_defers_its_weight_gradient() -> dict:
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig

    from megatron_zb.testing import init_parallel_state

    init_parallel_state(seed=7)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True)
    layer = ColumnParallelLinear(8, 6, config=config, init_method=torch.nn.init.normal_, bias=True,
                                 gather_output=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 8, generator=g)
    gy = torch.randn(4, 2, 6, generator=g)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        return xi, out

    uninstall_routes()  # megatron-core's own backward: the reference
    xi, out = step()
    out.backward(gy)
    ref = {"x": xi.grad.clone(), "w": layer.weight.grad.clone(), "b": layer.bias.grad.clone()}
    layer.zero_grad(set_to_none=True)

    install_routes()
    xi, out = step()
    ctx_fields = {f: hasattr(out.grad_fn, f) for f in LINEAR_CTX_FIELDS}
    store = WeightGradStore()
    done: list[tuple[torch.Tensor, ...]] = []
    store.on_params_done = done.append
    store.begin_iteration({0: 1})
    with store.deferring(0, 0):
        out.backward(gy)
    after_b = {"w_grad_is_none": layer.weight.grad is None, "x": xi.grad.clone(), "b": layer.bias.grad.clone(),
               "remaining_w": store.remaining_w(layer.weight), "remaining_bias": store.remaining_w(layer.bias),
               "pending": store.pending(), "done": len(done)}
    store.run(0, 0)
    return {"ref": ref, "ctx_fields": ctx_fields, "after_b": after_b, "w": layer.weight.grad.clone(),
            "done": [[p is layer.weight for p in params] for params in done], "executed": store.executed}


def test_linear_route_queues_the_weight_gradient_with_its_parameter():
    [r] = run_distributed(_column_parallel_linear_defers_its_weight_gradient, world_size=1, timeout=90)
    assert all(r["ctx_fields"].values()), r["ctx_fields"]  # megatron-core still sets what the route reads
    b = r["after_b"]
    assert b["w_grad_is_none"] and b["pending"] == [(0, 0)] and b["done"] == 0
    assert b["remaining_w"] == 1 and b["remaining_bias"] is None  # the bias gradient is not deferred
    assert torch.equal(b["x"], r["ref"]["x"]) and torch.equal(b["b"], r["ref"]["b"])
    assert torch.equal(r["w"], r["ref"]["w"])
    assert r["done"] == [[True]] and r["executed"] == 1


# ---------------------------------------------------------------------- the hook in a real schedule
def _params_done_in_a_v_schedule() -> dict:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.testing.tiny_gpt import TinyGPT, build, forward_backward

    cfg = TinyGPT(pp=2)
    chunks, modules = build(cfg, "zbv")
    fb = get_forward_backward_func("zbv")
    store = fb.store
    events: list[tuple] = []
    run = store.run

    def logged_run(stage: int, microbatch: int) -> int:
        events.append(("W", stage))
        return run(stage, microbatch)

    store.run = logged_run  # type: ignore[method-assign]
    stage_of = {id(p): c.plan.stage for c in chunks for p in c.module.parameters()}
    store.on_params_done = lambda params: events.append(("done", sorted({stage_of[id(p)] for p in params}),
                                                          {id(p) for p in params}, [store.remaining_w(p)
                                                                                     for p in params]))
    forward_backward(fb, modules, cfg.microbatches(), seq=cfg.seq, micro_batch=cfg.micro_batch)
    linear = {c.plan.stage: {id(m.weight) for m in c.module.modules()
                             if isinstance(m, (ColumnParallelLinear, RowParallelLinear))} for c in chunks}
    return {"events": [e[:2] + (e[2] == linear[e[1][0]], e[3]) if e[0] == "done" else e for e in events],
            "stages": sorted(linear), "m": cfg.num_microbatches}


def test_params_done_fires_once_per_chunk_after_its_last_w_with_its_linear_weights():
    ranks = run_distributed(_params_done_in_a_v_schedule, world_size=2, timeout=120)
    for r in ranks:
        events, m = r["events"], r["m"]
        for stage in r["stages"]:
            ws = [i for i, e in enumerate(events) if e == ("W", stage)]
            dones = [i for i, e in enumerate(events) if e[0] == "done" and e[1] == [stage]]
            assert len(ws) == m and len(dones) == 1, events
            assert dones[0] == ws[-1] + 1  # right after the stage's last W, before anything else
            _, _, exactly_its_linear_weights, remaining = events[dones[0]]
            assert exactly_its_linear_weights and set(remaining) == {0}


# ---------------------------------------------------------------------- multi-latent attention
def _mla_layer_defers_every_projection() -> dict:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_zb.testing.compat_features import MLA
    from megatron_zb.testing.tiny_gpt import TinyGPT, build

    cfg = TinyGPT(pp=1, num_layers=1, hidden=32, heads=4, seq=16, vocab=64, **MLA)
    [chunk], _ = build(cfg, None)
    model, [batch] = chunk.module, cfg.microbatches()[:1]
    attention = model.decoder.layers[0].self_attention
    projections = {n: m.weight for n, m in attention.named_children()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    norms = {n: m.weight for n, m in attention.named_children() if n in ("q_layernorm", "kv_layernorm")}

    def backward() -> None:
        model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]).float().mean().backward()

    uninstall_routes()  # megatron-core's own backward: the reference
    backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    install_routes()
    store = WeightGradStore()
    store.begin_iteration({0: 1})
    with store.deferring(0, 0):
        backward()
    after_b = {"projections": {n: (p.grad is None, store.remaining_w(p)) for n, p in projections.items()},
               "norms": {n: (p.grad is not None, store.remaining_w(p)) for n, p in norms.items()}}
    store.run(0, 0)
    same = {n: torch.equal(p.grad, ref[n]) for n, p in model.named_parameters()}
    return {"after_b": after_b, "same": same, "executed": store.executed}


def test_mla_projections_defer_their_weight_gradients_and_norms_do_not():
    """One MLA layer (q down/up, kv down/up, output projection; q/kv RMSNorm) in B under a store: every
    projection's weight has no gradient yet and one W pending; the q/kv layernorms' gradients came in B (no W);
    after the W every parameter's gradient equals megatron-core's own backward, bitwise."""
    [r] = run_distributed(_mla_layer_defers_every_projection, world_size=1, timeout=90)
    projections = r["after_b"]["projections"]
    assert set(projections) == {"linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                                "linear_proj"}
    assert all(v == (True, 1) for v in projections.values()), projections
    assert r["after_b"]["norms"] == {"q_layernorm": (True, None), "kv_layernorm": (True, None)}
    assert r["executed"] == 8  # 5 projections + fc1 + fc2 + the output layer
    assert all(r["same"].values()), [n for n, ok in r["same"].items() if not ok]


def test_the_runtime_loads_without_megatron_core():
    """``import megatron_zb.runtime`` (the executor, the routes, the linear route) loads torch but not
    megatron-core: the model marks its parameters through :mod:`megatron_zb.param_marks`, which both
    floors import, so a bad flag's one-line error is printed before megatron-core's import notices."""
    import subprocess
    import sys

    code = ("import sys, megatron_zb.runtime, megatron_zb.runtime.linear_route\n"
            "print(sorted(m for m in sys.modules if m == 'megatron.core' or m.startswith('megatron.core.'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])
