"""The Transformer Engine route, verified by contract on CPU.

Transformer Engine does not run here. ``tests/te_double.py`` reproduces, on CPU, what the route
relies on in TE's source (v2.18, checked against v2.3 and v2.7; see its docstring) and
megatron-core's TE wrappers; GPT chunks are built from megatron-core's own
``get_gpt_layer_with_transformer_engine_spec()`` with the double's classes, and run through the
same runtime code as TE modules (:mod:`megatron_zb.runtime.te_route`).

* every schedule family with TE's delayed weight gradients gives the gradients of the
  non-delayed path -- megatron-core's own 1F1B with delaying off -- bit for bit (fp32), and
  ``backward_dw()`` really ran once per module and microbatch;
* the same with megatron-core DDP (``main_grad``) and with ``gradient_accumulation_fusion``;
  and for TE 2.3-2.6 (no hooks API, ``weight.grad`` assigned only when empty);
* a schedule whose W's leave their B's order, or a split schedule on TE modules built without
  delaying, is refused before anything runs.

The same checks with real Transformer Engine modules on a GPU are in ``tests/runtime/test_te_real.py``
(``scripts/gpu_selftest.sh``); their count check, :func:`~megatron_zb.testing.tiny_gpt.check_te_run`,
runs here on the double.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from functools import partial

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
import te_double
from megatron_zb.runtime import WeightGradStore, WeightGradStoreError
from megatron_zb.runtime.routes import backward_window, check_schedule, install_routes
from megatron_zb.schedules import Action, Op, Schedule, ScheduleError
from megatron_zb.schedules.order import w_order_matches_b
from megatron_zb.schedules.registry import build_schedule, schedule_names
from megatron_zb.testing import run_distributed
from megatron_zb.testing.distributed import device_from_env
from megatron_zb.testing.tiny_gpt import TinyGPT, assert_bitwise_equal, check_te_run, run_step

SPEC = "te_double:gpt_layer_spec"
TE_SPEC = "megatron_zb.runtime.te_route:te_layer_spec"
TINY = dict(pp=2, num_layers=4, hidden=32, heads=4, seq=16, vocab=64, num_microbatches=4)
TE_MODULES_PER_LAYER = 4  # linear_qkv, linear_proj, linear_fc1, linear_fc2
FAMILIES = ["1f1b", "zb-h1", "zb", "zb-2p", "zbv", "interleaved-zb"]


# ---------------------------------------------------------------------- helpers (rank side)
def _run(cfg: TinyGPT, **kwargs) -> dict:
    """:func:`run_step` plus what the TE double saw in this rank."""
    before = dict(te_double.CALLS)
    out = run_step(cfg, **kwargs)
    out["backward_dw"] = te_double.CALLS["backward_dw"] - before["backward_dw"]
    out["te_queued"] = te_double.CALLS["queued"] - before["queued"]
    out["te_queues_empty"] = te_double.queues_empty()
    return out


def _merged(cfg: TinyGPT, schedule, **kwargs) -> dict:
    ranks = run_distributed(partial(_run, cfg, schedule=schedule, **kwargs), world_size=cfg.pp, timeout=120)
    out = TinyGPT.merge(ranks)
    for key in ("backward_dw", "te_queued"):
        out[key] = sum(r[key] for r in ranks)
    out["te_queues_empty"] = all(r["te_queues_empty"] for r in ranks)
    return out


def _assert_bitwise(ref: dict, got: dict, what: str) -> None:
    assert_bitwise_equal(ref, got, what=what)



@pytest.fixture(scope="module")
def reference() -> dict:
    """megatron-core's own 1F1B, PP=2, the double with delaying off: the non-delayed path."""
    ref = _merged(TinyGPT(**TINY, layer_spec=SPEC), None)
    assert ref["backward_dw"] == 0 and ref["te_queued"] == 0  # nothing was delayed
    return ref


# ---------------------------------------------------------------------- the wrappers' signatures
def _source_keywords(cls_name: str) -> set[str]:
    """Keyword-only parameters of ``cls_name.__init__`` in the installed megatron-core's
    ``extensions/transformer_engine.py``, read from its source (without TE the classes are stubs)."""
    import ast
    import importlib.util

    path = importlib.util.find_spec("megatron.core.extensions.transformer_engine").origin
    tree = ast.parse(open(path).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.kwonlyargs}


@pytest.mark.parametrize("cls", [te_double.TEColumnParallelLinear, te_double.TERowParallelLinear,
                                 te_double.TELayerNormColumnParallelLinear], ids=lambda c: c.__name__)
def test_double_wrappers_take_the_installed_megatron_core_keywords(cls):
    """The double's wrappers accept every keyword of the installed megatron-core's wrappers (its
    own keyword-only parameters plus ``megatron_compat.te.te_wrapper_keywords()``) and no other."""
    import inspect

    from megatron_zb.megatron_compat.te import te_wrapper_keywords

    params = inspect.signature(cls.__init__).parameters.values()
    own = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert own | set(te_wrapper_keywords()) == _source_keywords(cls.__name__)
    with pytest.raises(TypeError, match="unexpected keyword argument 'not_a_megatron_keyword'"):
        cls(8, 8, config=None, init_method=None, bias=True, skip_bias_add=False, is_expert=False,
            **({"input_is_parallel": True} if "input_is_parallel" in own else {"gather_output": False}),
            not_a_megatron_keyword=1)


# ---------------------------------------------------------------------- every schedule family
@pytest.mark.parametrize("schedule", FAMILIES)
def test_delayed_te_gradients_equal_the_non_delayed_path_bitwise(reference, schedule):
    got = _merged(TinyGPT(**TINY, layer_spec=SPEC, delay_wgrad=True), schedule)
    _assert_bitwise(reference, got, schedule)
    m, te_modules = TINY["num_microbatches"], TE_MODULES_PER_LAYER * TINY["num_layers"]
    assert got["te_queued"] == got["backward_dw"] == m * te_modules, "one delayed W per TE module and microbatch"
    assert got["te_queues_empty"]
    check_te_run(got, te_modules=te_modules, microbatches=m, split=schedule != "1f1b")


def test_te_run_check_fails_on_what_it_guards():
    """The shared count check refuses a run that deferred only the output layer's W, one that
    left a queued entry, and one that saw the wrong number of delayed modules."""
    good = {"te_delayed_modules": 16, "w_deferred": 4 * 17, "te_queued_left": 0}
    check_te_run(good, te_modules=16, microbatches=4, split=True)
    for bad in ({"w_deferred": 4}, {"te_queued_left": 1}, {"te_delayed_modules": 15}):
        with pytest.raises(AssertionError):
            check_te_run({**good, **bad}, te_modules=16, microbatches=4, split=True)


def test_fp8_gemm_bias_gradients_computed_in_b_with_ddp():
    """TE's FP8 (and debug) backward computes linear_qkv's GEMM-internal bias gradient in B and
    gives the delayed GEMM ``bias=None``; ``backward_dw`` then assigns ``bgrad`` (None) to an
    empty ``bias.grad``. With megatron-core DDP, zb-2p equals megatron-core's 1F1B without
    delaying, bitwise (the double's FP8 flavour keeps fp32 numbers)."""
    base = dict(TINY, ddp=True)
    ref = _merged(TinyGPT(**base, layer_spec="te_double:gpt_layer_spec_fp8"), None)
    got = _merged(TinyGPT(**base, layer_spec="te_double:gpt_layer_spec_fp8", delay_wgrad=True), "zb-2p")
    _assert_bitwise(ref, got, "FP8 flavour, DDP")
    assert got["backward_dw"] == TINY["num_microbatches"] * TE_MODULES_PER_LAYER * TINY["num_layers"]
    assert any(n.endswith("linear_qkv.bias") for n in got["grads"])  # a GEMM-internal bias was there
    check_te_run(got, te_modules=TE_MODULES_PER_LAYER * TINY["num_layers"], microbatches=TINY["num_microbatches"],
                 split=True)


@pytest.mark.parametrize("fusion", [False, True], ids=["ddp", "ddp-fused-accumulation"])
def test_ddp_main_grad_with_and_without_fused_accumulation(fusion):
    """megatron-core DDP: TE's weight gradient lands in main_grad (added by the route after W, or
    accumulated by the fused GEMM into main_grad, the first microbatch overwriting it)."""
    base = dict(TINY, ddp=True, gradient_accumulation_fusion=fusion)
    ref = _merged(TinyGPT(**base, layer_spec=SPEC), None)
    got = _merged(TinyGPT(**base, layer_spec=SPEC, delay_wgrad=True), "zb-2p")
    _assert_bitwise(ref, got, f"DDP fusion={fusion}")
    assert got["backward_dw"] > 0 and got["te_queues_empty"]
    check_te_run(got, te_modules=TE_MODULES_PER_LAYER * TINY["num_layers"], microbatches=TINY["num_microbatches"],
                 split=True)


def test_te_2_3_without_hooks_api(reference):
    """TE 2.3-2.6: no register_wgrad_accumulation_and_reduce_hooks, weight.grad only assigned when empty."""
    got = _merged(TinyGPT(**TINY, layer_spec="te_double:gpt_layer_spec_te23", delay_wgrad=True), "zb")
    _assert_bitwise(reference, got, "TE 2.3 flavour")
    assert got["backward_dw"] == TINY["num_microbatches"] * TE_MODULES_PER_LAYER * TINY["num_layers"]


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["ddp", "distopt"])
def test_dp_overlapped_reduce_sees_te_weights_ready_after_their_last_w(distributed_optimizer):
    """PP=2 x DP=2, --overlap-grad-reduce (and the distributed optimizer): the store entries of the
    TE route name their module's parameters, so megatron-zb's GradSync reports TE weights ready
    after their last W; three iterations with Adam equal megatron-core's 1F1B without delaying."""
    from dataclasses import replace

    from harness.dp_overlap import DPCase, assert_equal_runs, merge, run_dp_iterations

    cfg = TinyGPT(**dict(TINY, dp=2), layer_spec=SPEC)
    case = DPCase(overlap_grad_reduce=True, overlap_param_gather=distributed_optimizer,
                  use_distributed_optimizer=distributed_optimizer)
    ref = merge(run_distributed(partial(run_dp_iterations, cfg, case, schedule=None), world_size=4, timeout=300))
    got = merge(run_distributed(partial(run_dp_iterations, replace(cfg, delay_wgrad=True), case, schedule="zb"),
                                world_size=4, timeout=300))
    assert_equal_runs(ref, got, bitwise=True, what=f"TE double, zb, DP overlap, distopt={distributed_optimizer}")
    for dp, r in got.items():
        for pp, reports in r["reports"].items():
            for rep in reports[1:]:  # megatron-core launches from its second iteration on
                assert len(rep.launches) == rep.num_buckets, (dp, pp)


# ---------------------------------------------------------------------- refusals
def _w_out_of_order(name: str = "zb-h1", p: int = 2, m: int = 4) -> Schedule:
    """``name`` with the last stage's W of microbatch 0 moved to the end of its rank's list."""
    s = build_schedule(name, num_ranks=p, num_microbatches=m)
    last = s.num_stages - 1
    acts = s.ranks[s.stage_to_rank[last]]
    w0 = next(a for a in acts if a.op is Op.W and a.stage == last and a.mb == 0)
    acts.remove(w0)
    acts.append(w0)
    s.name = f"{name} with W(0) last"
    return s


def test_order_breaking_schedule_is_refused_before_running():
    schedule = _w_out_of_order()
    with pytest.raises(ScheduleError, match=r"first-in first-out") as err:
        _merged(TinyGPT(**TINY, layer_spec=SPEC, delay_wgrad=True), schedule)
    msg = str(err.value)
    assert "transformer-engine route" in msg and "stage 1 (rank 1): W #0 is for microbatch 1" in msg


def test_split_schedule_on_te_modules_built_without_delay_is_refused():
    with pytest.raises(ScheduleError, match=r"built without delay_wgrad_compute.*te_route.enable_delayed_wgrad"):
        _merged(TinyGPT(**TINY, layer_spec=SPEC), "zb-h1")


# ---------------------------------------------------------------------- the route, one process
def _chunk(cls=te_double.Linear, **kwargs) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(cls(8, 8, **kwargs), cls(8, 8, **kwargs), te_double.LayerNormMLP(8, 16, **{
        k: v for k, v in kwargs.items() if k == "delay_wgrad_compute"}))


def _grads(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.main_grad if hasattr(p, "main_grad") else p.grad).clone() for n, p in chunk.named_parameters()}


def _backward(chunk: torch.nn.Sequential, mb: int, skip_last: bool = False) -> torch.Tensor:
    x = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(mb))
    h = x
    for i, m in enumerate(chunk):
        if skip_last and i == len(chunk) - 1:
            break
        h = m(h)
        h = h[0] + h[1] if isinstance(h, tuple) else h  # a returned bias is added by the caller
    return (h * h).sum()


BIAS_KINDS = {  # how the bias's gradient is computed, as TE does it (te_double.Linear)
    "no-bias": dict(bias=False),
    "bias-in-gemm": dict(bias=True),  # by the delayed GEMM, in W
    "returned-bias": dict(bias=True, return_bias=True),  # by autograd in B (megatron-core's skip_bias_add)
    "row-unfused-bias": dict(bias=True, parallel_mode="row"),  # in B: TE's gemm_bias_unfused_add
    "fp8-bias": dict(bias=True, fp8=True),  # in B: FP8 / debug grad_output_preprocess, bias=None to the GEMM
}


@pytest.mark.parametrize("cls", [te_double.Linear, te_double.TE23Linear], ids=["te2.18", "te2.3"])
@pytest.mark.parametrize("bias", list(BIAS_KINDS))
def test_w_runs_backward_dw_of_exactly_the_modules_that_queued(cls, bias):
    """Every way TE computes a bias gradient -- in W by the delayed GEMM, or in B (returned
    bias, row-parallel unfused add, FP8 / debug) -- lands where the non-delayed path puts it."""
    install_routes()
    kw = dict(BIAS_KINDS[bias])
    if kw.pop("fp8", False):
        cls = type(cls.__name__ + "FP8", (cls,), {"fp8": True})
    ref = _chunk(cls, **kw)
    for mb in range(3):
        _backward(ref, mb, skip_last=(mb == 1)).backward()
    chunk = _chunk(cls, delay_wgrad_compute=True, **kw)
    store = WeightGradStore()
    store.begin_iteration({0: 3})
    for mb in range(3):  # B, B, B; microbatch 1 does not use the MLP module
        with backward_window(store=store, deferred=True, chunk=chunk, stage=0, microbatch=mb):
            _backward(chunk, mb, skip_last=(mb == 1)).backward()
    assert [len(store._queues[(0, mb)]) for mb in range(3)] == [3, 2, 3]
    calls = te_double.CALLS["backward_dw"]
    for mb in range(3):
        store.run(0, mb)
    assert te_double.CALLS["backward_dw"] - calls == 8  # LayerNormMLP: one call pops its two entries
    assert te_double.queues_empty(chunk)
    got, want = _grads(chunk), _grads(ref)
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n], want[n]), n


def test_fused_bw_runs_the_queued_work_right_after_the_backward():
    install_routes()
    ref, chunk = _chunk(), _chunk(delay_wgrad_compute=True)
    _backward(ref, 0).backward()
    store = WeightGradStore()
    with backward_window(store=store, deferred=False, chunk=chunk, stage=0, microbatch=0):
        _backward(chunk, 0).backward()
    assert store.pending() == [] and te_double.queues_empty(chunk)
    for n, g in _grads(ref).items():
        assert torch.equal(_grads(chunk)[n], g), n


def test_returned_bias_would_break_te_backward_dw_without_the_route():
    """The double reproduces TE's backward_dw on a returned bias whose .grad is empty (megatron
    DDP clears it): bgrad is None. The route gives it a placeholder (tested above)."""
    m = te_double.Linear(4, 4, bias=True, return_bias=True, delay_wgrad_compute=True)
    out, _ = m(torch.randn(2, 4))
    out.sum().backward()
    m.bias.grad = None
    with pytest.raises(AttributeError):
        m.backward_dw()


def test_work_queued_outside_the_runtime_is_refused_and_clear_discards():
    install_routes()
    chunk = _chunk(delay_wgrad_compute=True)
    _backward(chunk, 0).backward()  # e.g. megatron-core's own schedule on a delayed model
    store = WeightGradStore()
    with pytest.raises(WeightGradStoreError, match=r"holds 1 queued weight gradient\(s\) but megatron-zb queued 0"):
        with backward_window(store=store, deferred=True, chunk=chunk, stage=0, microbatch=0):
            pass
    store.clear()
    chunk = _chunk(delay_wgrad_compute=True)
    with backward_window(store=store, deferred=True, chunk=chunk, stage=0, microbatch=0):
        _backward(chunk, 0).backward()
    assert not te_double.queues_empty(chunk)
    store.clear()  # a failed iteration: the TE queues are emptied with the store
    assert te_double.queues_empty(chunk)
    with backward_window(store=store, deferred=True, chunk=chunk, stage=0, microbatch=0):
        _backward(chunk, 1).backward()
    store.run(0, 0)
    assert te_double.queues_empty(chunk)


def test_check_schedule_names_the_problem():
    install_routes()
    good = build_schedule("zb-h1", num_ranks=2, num_microbatches=4)
    delayed, undelayed = _chunk(delay_wgrad_compute=True), _chunk()
    check_schedule(good, [delayed])
    check_schedule(build_schedule("1f1b", num_ranks=2, num_microbatches=4), [undelayed])  # no split: fine
    check_schedule(_w_out_of_order(), [torch.nn.Linear(2, 2)])  # no TE module: any order
    with pytest.raises(ScheduleError, match="W #0 is for microbatch 1 but B #0 was for microbatch 0"):
        check_schedule(_w_out_of_order(), [delayed])
    with pytest.raises(ScheduleError, match=r"3 Transformer Engine module\(s\) \(e.g. 0\)"):
        check_schedule(good, [undelayed])


# ---------------------------------------------------------------------- schedule library
def test_every_library_schedule_keeps_w_in_b_order():
    for name in schedule_names():
        if name.endswith("-optimal"):
            continue  # needs the CP-SAT solver; checked by the distributed tests' callers when used
        for p, m in ((2, 1), (2, 4), (3, 5), (4, 8)):
            s = build_schedule(name, num_ranks=p, num_microbatches=m)
            assert w_order_matches_b(s) == [], (name, p, m)


def test_order_violation_reports_stage_rank_orders_and_position():
    (v,) = w_order_matches_b(_w_out_of_order())
    assert (v.stage, v.rank, v.position) == (1, 1, 0)
    assert v.b_order == (0, 1, 2, 3) and v.w_order == (1, 2, 3, 0)
    # a BW counts as both a B and a W at its position
    s = Schedule(2, [0], [[Action(Op.F, 0, 0), Action(Op.F, 1, 0), Action(Op.B, 0, 0), Action(Op.BW, 1, 0),
                           Action(Op.W, 0, 0)]])
    (v,) = w_order_matches_b(s)
    assert v.b_order == (0, 1) and v.w_order == (1, 0)


# ---------------------------------------------------------------------- the command line
TINY_ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "2", "--global-batch-size",
             "4", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--num-workers", "0", "--eval-iters", "0",
             "--distributed-backend", "gloo", "--pipeline-model-parallel-size", "2", "--schedule", "zb-h1"]


def _resolved(*flags: str):
    from megatron_zb.training.arguments import build_parser
    from megatron_zb.training.arguments.implementation import (resolve_gradient_accumulation_fusion,
                                                               resolve_transformer_impl)

    args = build_parser().parse_args(TINY_ARGV + list(flags))
    resolve_transformer_impl(args)
    resolve_gradient_accumulation_fusion(args)
    return args


def _no_te_no_cuda(monkeypatch) -> None:
    """This machine's situation anywhere: no Transformer Engine, no CUDA (hence no apex kernels)."""
    from megatron_zb.runtime import te_route

    monkeypatch.setattr(te_route, "transformer_engine_version", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _cpu_without_te_or_apex() -> None:
    import importlib.util

    from megatron_zb.runtime.te_route import transformer_engine_version

    if os.environ.get("MEGATRON_ZB_TEST_DEVICE", "cpu") != "cpu" or transformer_engine_version() is not None \
            or importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        pytest.skip("checks the CPU machine's defaults (no Transformer Engine, no apex, CPU device)")


def test_default_implementation_and_fusion_say_why(monkeypatch):
    _no_te_no_cuda(monkeypatch)
    args = _resolved()
    assert (args.transformer_impl, args.transformer_impl_reason) == (
        "local", "default: Transformer Engine is not installed")
    assert args.gradient_accumulation_fusion is False and args.wgrad_kernel.startswith("off")
    args = _resolved("--gradient-accumulation-fusion")
    assert args.wgrad_kernel == ("on: megatron-zb's matmul wgrad_gemm_accum_fp32/fp16 "
                                 "(fused_weight_gradient_mlp_cuda not importable)")
    assert _resolved("--no-gradient-accumulation-fusion").gradient_accumulation_fusion is False


@pytest.mark.parametrize("version, cuda, message", [
    (None, True, "transformer_engine needs Transformer Engine >= 2.3 (pip package transformer-engine with its "
                 "PyTorch extension); Transformer Engine is not installed"),
    ("2.2.1", True, "transformer_engine needs Transformer Engine >= 2.3 (pip package transformer-engine with its "
                    "PyTorch extension); found 2.2.1"),
    ("2.7.0", False, "transformer_engine needs CUDA, which is not available here"),
])
def test_transformer_engine_refused_when_missing_old_or_without_cuda(monkeypatch, version, cuda, message):
    from megatron_zb.runtime import te_route
    from megatron_zb.training.arguments import ArgumentError

    monkeypatch.setattr(te_route, "transformer_engine_version", lambda: version)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with pytest.raises(ArgumentError, match=r"^--transformer-impl: ") as err:
        _resolved("--transformer-impl", "transformer_engine")
    assert message in str(err.value)
    if version == "2.7.0":  # found, but no CUDA: the default is local, saying why
        args = _resolved()
        assert (args.transformer_impl, args.transformer_impl_reason) == ("local", "default: CUDA is not available")


def test_pretrain_without_transformer_engine_exits_2_with_one_line():
    import subprocess
    import sys
    import time

    _cpu_without_te_or_apex()
    root = str(Path(__file__).resolve().parents[2])
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "pretrain_gpt_zb.py", "--transformer-impl", "transformer_engine",
                          *TINY_ARGV], cwd=root, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=root, WORLD_SIZE="2"))
    elapsed = time.monotonic() - t0
    assert res.returncode == 2
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert errors == ["pretrain_gpt_zb.py: error: --transformer-impl: transformer_engine needs Transformer Engine "
                      ">= 2.3 (pip package transformer-engine with its PyTorch extension); Transformer Engine is "
                      "not installed; or use --transformer-impl local"], res.stderr
    assert "building model" not in res.stdout  # refused before any process group or model
    print(f"refused after {elapsed:.1f} s (interpreter, torch and megatron-core imports included)")


def _train_fused(argv: list[str]) -> dict:
    """One rank of pretrain_gpt_zb.py's Trainer (2 iterations); what the start-up log said."""
    import contextlib
    import io

    import torch.distributed as dist

    from megatron_zb.training.pretrain import parse_and_validate
    from megatron_zb.training.trainer import Trainer

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(parse_and_validate(argv, dist.get_world_size()))
        try:
            assert trainer.run() == 0
            fused = [m.config.gradient_accumulation_fusion for m in trainer.model.gpt_models]
        finally:
            trainer.close()
    return {"log": out.getvalue(), "fused": fused}


def test_gradient_accumulation_fusion_flag_reaches_the_model_and_the_log():
    _cpu_without_te_or_apex()
    ranks = run_distributed(_train_fused, world_size=2, args=(TINY_ARGV + ["--gradient-accumulation-fusion"],),
                            timeout=240)
    assert all(r["fused"] == [True] for r in ranks)
    log = ranks[0]["log"]
    assert "> transformer implementation: local (default: Transformer Engine is not installed)" in log
    assert ("> gradient accumulation fusion: on: megatron-zb's matmul wgrad_gemm_accum_fp32/fp16 "
            "(fused_weight_gradient_mlp_cuda not importable)") in log


# ---------------------------------------------------------------------- GroupedLinear (MoE grouped GEMM)
GROUPED_SPLITS = [3, 1, 2]


def _grouped_main_grads(cls_name: str, fuse: bool, delay: bool) -> dict[str, torch.Tensor]:
    """One rank: megatron-core DDP around the GroupedLinear double (3 GEMMs, biases), three
    microbatches -- through the store and the route when ``delay`` -- and each ``main_grad``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    install_routes()
    torch.manual_seed(0)
    dev = device_from_env()  # megatron-core DDP puts main_grad on the GPU whenever CUDA is available
    grouped = getattr(te_double, cls_name)(3, 8, 4, fuse_wgrad_accumulation=fuse, delay_wgrad_compute=delay).to(dev)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, gradient_accumulation_fusion=fuse)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=grouped)
    ddp.zero_grad_buffer()
    store = WeightGradStore()
    for mb in range(3):
        x = torch.randn(sum(GROUPED_SPLITS), 8, generator=torch.Generator().manual_seed(mb)).to(dev).requires_grad_()
        window = backward_window(store=store, deferred=True, chunk=ddp, stage=0, microbatch=mb) if delay \
            else contextlib.nullcontext()
        with window:
            (ddp(x, GROUPED_SPLITS) ** 2).sum().backward()
    for mb in range(3):
        if delay:
            store.run(0, mb)
    assert te_double.queues_empty(grouped)
    return {n: p.main_grad.cpu().clone() for n, p in grouped.named_parameters()}


def _ddp_delay_wgrad_refusal() -> str:
    """One rank: megatron-core DDP built with ``delay_wgrad_compute=True`` around delayed TE
    modules; the route's schedule check's message."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    install_routes()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(delay_wgrad_compute=True),
                                  module=_chunk(delay_wgrad_compute=True, bias=True))
    try:
        check_schedule(build_schedule("zb-h1", num_ranks=1, num_microbatches=2), [ddp])
    except ScheduleError as err:
        return str(err)
    return "not refused"


def _ddp_rank_checks() -> dict:
    from megatron_zb.testing.distributed import init_parallel_state

    init_parallel_state()
    out: dict = {(cls, fuse, delay): _grouped_main_grads(cls, fuse, delay)
                 for cls in ("GroupedLinear", "GroupedLinearTE27") for fuse in (False, True) for delay in (False, True)}
    out["ddp_delay_wgrad_refusal"] = _ddp_delay_wgrad_refusal()
    return out


@pytest.fixture(scope="module")
def ddp_rank_checks() -> dict:
    """The megatron-core DDP checks of this file, in one process (one start-up)."""
    [out] = run_distributed(_ddp_rank_checks, world_size=1, timeout=120)
    return out


def test_grouped_linear_b_time_buffer_never_reaches_main_grad(ddp_rank_checks):
    """TE >= 2.8's GroupedLinear without fused accumulation returns its packed weight-gradient
    buffer to autograd in a delayed backward, before the delayed GEMM fills it (the double fills
    it with NaN where TE leaves it uninitialised): megatron-core DDP's hook would add it to
    main_grad. Every flavour (TE 2.8+ / 2.3-2.7, fused or not) under megatron-core DDP gives the
    non-delayed main_grad bitwise."""
    runs = ddp_rank_checks
    for cls in ("GroupedLinear", "GroupedLinearTE27"):
        for fuse in (False, True):
            ref, got = runs[(cls, fuse, False)], runs[(cls, fuse, True)]
            assert ref.keys() == got.keys() and len(ref) == 6
            for n in ref:
                assert torch.isfinite(ref[n]).all(), (cls, fuse, n)
                assert torch.equal(got[n], ref[n]), (cls, fuse, n)


# ---------------------------------------------------------------------- refused: the op fuser, DDP's delay_wgrad_compute
def test_ddp_delay_wgrad_compute_is_refused_by_name(ddp_rank_checks):
    """megatron-core DDP's ``delay_wgrad_compute`` registers DDP's gradient hook for TE's
    delayed parameters (``skip_backward_post_hook``) in TE's ``backward_dw`` hook list instead
    of on their gradient accumulators; refused before anything runs."""
    msg = ddp_rank_checks["ddp_delay_wgrad_refusal"]
    assert msg.startswith("transformer-engine route: megatron-core DDP was built with "
                          "DistributedDataParallelConfig(delay_wgrad_compute=True)"), msg
    assert "build DDP with delay_wgrad_compute=False" in msg and "\n" not in msg


def _op_fused_chunk(cls: type = te_double.TEFusedMLP) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(te_double.Linear(8, 8, delay_wgrad_compute=True), cls(8, 16, delay_wgrad_compute=True))


def test_te_op_fuser_is_refused_by_name():
    install_routes()
    split, fused = (build_schedule(n, num_ranks=2, num_microbatches=4) for n in ("zb-h1", "1f1b"))
    for schedule in (split, fused):  # 1f1b too: the fused MLP's delayed modules would never queue
        with pytest.raises(ScheduleError, match=r"transformer-engine route: 1 module\(s\) \(e.g. 1\) run Transformer "
                                                r"Engine's op fuser \(use_te_op_fuser.*build the layer spec without "
                                                r"use_te_op_fuser"):
            check_schedule(schedule, [_op_fused_chunk()])
    plain = torch.nn.Sequential(te_double.TEFusedMLP(8, 16))  # no delaying, no split: megatron-core's own path
    check_schedule(fused, [plain])


@pytest.mark.parametrize("case", ["unknown-op-fuser", "delay-switched-off"])
def test_a_backward_that_reaches_delayed_weights_without_queuing_is_refused(case):
    """The per-module check: a backward that reaches the weights of a delayed TE module must
    queue its weight gradient -- else it computed it in B. Caught for an op-fuser module the
    name check does not know, and for a module whose delaying was switched off after it was
    built (TE's ``wgrad_store.disable_delay_wgrad_compute()``)."""
    install_routes()
    if case == "unknown-op-fuser":
        chunk = _op_fused_chunk(type("SomeFusedMLP", (te_double.TEFusedMLP,), {}))
        culprit = "1.linear_fc1"
        check_schedule(build_schedule("zb-h1", num_ranks=2, num_microbatches=4), [chunk])  # the name is not known
    else:
        chunk, culprit = _chunk(delay_wgrad_compute=True), "1"
    store = WeightGradStore()
    with backward_window(store=store, deferred=True, chunk=chunk, stage=0, microbatch=0):
        pass  # the route finds the chunk's delayed modules
    store.run(0, 0)
    if case == "delay-switched-off":
        chunk[1].wgrad_store.disable_delay_wgrad_compute()
    with pytest.raises(WeightGradStoreError, match=rf"module {culprit}: a backward reached its weights but queued no "
                                                   r"deferred weight gradient, so it computed them in the backward"):
        with backward_window(store=store, deferred=True, chunk=chunk, stage=0, microbatch=1):
            _backward(chunk, 1).backward()
