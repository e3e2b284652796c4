"""The CPU shim: megatron-core's own pipeline / tensor-parallel paths run on CPU and are exact.

Distributed parts run in harness processes (gloo on 127.0.0.1); results are compared here.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

import megatron_zb  # noqa: F401  (installs the CPU shim)
from megatron_zb.model import build_gpt_chunks, cpu_gpt_config, named_global_parameters
from megatron_zb.platform import CPU_SHIM_ACTIVE, install_cpu_shim
from megatron_zb.testing import init_parallel_state, run_distributed
from megatron_zb.testing.tiny_gpt import TinyGPT, forward_step, full_tensor

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = "CUDA|NVIDIA driver"
"""What ``Tensor.cuda()`` raises without CUDA: a CPU build of torch names CUDA; a CUDA build on a
machine without a GPU (e.g. the Python 3.12 venv of scripts/test_py312.sh) names the NVIDIA driver."""
NUM_LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 8, 64, 4, 32, 128
MICRO_BATCH, NUM_MICROBATCHES, SEED = 2, 4, 1234


# ---------------------------------------------------------------------- in this process
def test_shim_is_active_idempotent_and_scoped():
    import megatron.core.pipeline_parallel.schedules as schedules

    assert CPU_SHIM_ACTIVE and install_cpu_shim() and install_cpu_shim()
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert schedules.torch.distributed is torch.distributed  # everything else is the real torch
    with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
        torch.ones(1).cuda()  # outside megatron-core, .cuda() still fails as on any CPU build
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_shim_changes_nothing_when_cuda_is_available():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "orig = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,\n"
        "        torch.cuda.manual_seed, torch.Tensor.cuda, torch.Tensor.type)\n"
        "import megatron_zb\n"
        "from megatron_zb.platform import cpu_shim\n"
        "assert megatron_zb.platform.CPU_SHIM_ACTIVE is False and not cpu_shim.is_installed()\n"
        "assert (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.get_rng_state,\n"
        "        torch.cuda.manual_seed, torch.Tensor.cuda, torch.Tensor.type) == orig\n"
        "import importlib\n"
        "for name in cpu_shim.shim_modules()[0]:\n"
        "    assert importlib.import_module(name).torch is torch, name\n"
        "from megatron.core.tensor_parallel import random\n"
        "from megatron.core.transformer.torch_norm import WrappedTorchNorm\n"
        "assert random._set_cuda_rng_state.__module__ == random.__name__\n"
        "assert WrappedTorchNorm.__new__.__module__ == 'megatron.core.transformer.torch_norm'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)



def test_megatron_core_import_notice_of_torch_is_dropped_without_cuda(tmp_path):
    """With ``CUDA_HOME`` set and no GPU, torch's ``cpp_extension._find_cuda_home()`` logs "No CUDA
    runtime is found" (a CUDA build of torch does so when megatron-core 0.19's ``import megatron.core``
    imports ``torch.utils.cpp_extension``): after ``import megatron_zb`` that one notice is dropped;
    another warning of the same logger is not."""
    code = ("import logging, megatron_zb, megatron.core, torch.utils.cpp_extension as ext\n"
            "ext._find_cuda_home()\n"
            "logging.getLogger('torch.utils.cpp_extension').warning('another notice')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_HOME=str(tmp_path)))
    assert res.returncode == 0, res.stderr
    assert "another notice" in res.stderr and "No CUDA runtime" not in res.stderr, res.stderr


def test_tensor_cuda_callers_can_be_widened_by_prefix():
    from megatron_zb.platform import cpu_shim

    code = "def move(t):\n    return t.cuda()\n"
    caller: dict[str, object] = {"__name__": "megatron_zb_test_caller.mod"}
    exec(compile(code, "<megatron_zb_test_caller>", "exec"), caller)
    t = torch.ones(2)
    with pytest.raises((AssertionError, RuntimeError), match=NO_CUDA):
        caller["move"](t)  # type: ignore[operator]
    cpu_shim.allow_tensor_cuda_from("megatron_zb_test_caller.")
    assert "megatron_zb_test_caller." in cpu_shim.tensor_cuda_callers()
    assert caller["move"](t) is t  # type: ignore[operator]
    with pytest.raises(ValueError):
        cpu_shim.allow_tensor_cuda_from("")


def test_cpu_torch_stand_in_overrides_only_its_own_torch_cuda():
    from megatron_zb.platform.cpu_shim import cpu_torch_stand_in

    stand_in = cpu_torch_stand_in(device_count=lambda: 1)
    assert stand_in.cuda.device_count() == 1 and torch.cuda.device_count() == 0
    assert stand_in.zeros(2, device="cuda").device.type == "cpu"
    stream = stand_in.cuda.Stream()
    assert stand_in.cuda.current_stream() is stream
    with stand_in.cuda.stream(stream):
        stream.wait_stream(stand_in.cuda.current_stream())
    assert stand_in.nn is torch.nn and stand_in.cuda.is_available is torch.cuda.is_available


def _rerun_reduce_any() -> tuple[bool, tuple[bool, ...], str]:
    """megatron-core's ``RerunStateMachine._reduce_any`` (``device="cuda"``; Megatron-LM calls it every step)."""
    import megatron.core.tensor_parallel.data as tp_data
    from megatron.core.rerun_state_machine import RerunStateMachine

    machine = RerunStateMachine()
    device = tp_data.torch.tensor([1], device="cuda").device.type  # broadcast_data's size buffer (TP > 1)
    return machine._reduce_any(True), machine._reduce_any([False, True]), device


def test_rerun_state_machine_reduces_on_cpu():
    [(one, many, device)] = run_distributed(_rerun_reduce_any, world_size=1, timeout=60)
    assert one is True and many == (False, True) and device == "cpu"


# ---------------------------------------------------------------------- p2p sends and pseudo-freed outputs
def _send_then_pseudo_free(numel: int, trials: int) -> list[bool]:
    """Rank 0 sends a stage output with megatron-core's ``P2PCommunicator`` as its interleaved schedule
    does with ``overlap_p2p_comm`` (Megatron-LM's default with virtual stages): the send is started,
    the output pseudo-freed (``deallocate_output_tensor``), new tensors allocated (they may take the
    freed memory), and only then the send waited on. Rank 1 posts its receive after that; per trial,
    whether it received the values sent."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    init_parallel_state(pipeline_model_parallel_size=2)
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                 batch_p2p_comm=False, overlap_p2p_comm=True)
    comm = P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(), config=config)
    received = []
    for trial in range(trials):
        expected = torch.arange(numel, dtype=torch.float32) + trial
        if dist.get_rank() == 0:
            output = expected.clone().requires_grad_() * 1.0  # a stage output: not a view, has a grad_fn
            _, handles = comm.send_forward_recv_forward(output, recv_prev=False, tensor_shape=(numel,),
                                                        overlap_p2p_comm=True)
            deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
            reused = [torch.full((numel,), float("nan")) for _ in range(4)]  # held till the wait
            dist.barrier()
            handles["send_next"].wait()
            reused.clear()
        else:
            dist.barrier()
            got, handles = comm.send_forward_recv_forward(None, recv_prev=True, tensor_shape=(numel,),
                                                          overlap_p2p_comm=True)
            handles["recv_prev"].wait()
            received.append(torch.equal(got, expected))
    return received


def test_a_pseudo_freed_output_is_still_sent_whole():
    """megatron-core frees the output's storage before the send completes; on CUDA the caching allocator
    keeps a block in use by the NCCL stream, on CPU the shim gives each send its own view (without it,
    measured: every trial received other values)."""
    from megatron.core.pipeline_parallel import p2p_communication

    assert all(hasattr(getattr(p2p_communication, name), "__wrapped__") for name in ("_p2p_ops", "_batched_p2p_ops"))
    _, received = run_distributed(_send_then_pseudo_free, world_size=2, args=(1 << 16, 3), timeout=60)
    assert received == [True] * 3


# ---------------------------------------------------------------------- RNG tracker
def _rng_tracker() -> dict[str, object]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("megatron.core.tensor_parallel.random").addHandler(handler)

    init_parallel_state(seed=SEED)  # torch.manual_seed + model_parallel_cuda_manual_seed
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        forked = torch.rand(4)
    restored = torch.equal(torch.get_rng_state(), before)
    with get_cuda_rng_tracker().fork():
        forked_again = torch.rand(4)  # the tracker's stream continues
    default = torch.rand(4)
    model_parallel_cuda_manual_seed(SEED, force_reset_rng=True)
    with get_cuda_rng_tracker().fork():
        forked_reseeded = torch.rand(4)
    return dict(forked=forked, forked_again=forked_again, default=default, restored=restored,
                forked_reseeded=forked_reseeded, warnings=records)


def test_rng_tracker_forks_the_cpu_generator():
    [r] = run_distributed(_rng_tracker, world_size=1, timeout=60)
    assert r["restored"], "fork() must restore the default generator"
    assert not torch.equal(r["forked"], r["default"]) and not torch.equal(r["forked"], r["forked_again"])
    assert torch.equal(r["forked"], r["forked_reseeded"]), "the tracker stream must be reproducible from the seed"
    assert r["warnings"] == []


# ---------------------------------------------------------------------- model runs
def _train_step(*, tp: int, pp: int, sequence_parallel: bool = False, tied: bool = False, ddp: bool = False,
                distributed_optimizer: bool = False) -> dict[str, object]:
    """One step of megatron-core's own schedule on this rank; returns full (TP-gathered) tensors."""
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    init_parallel_state(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=SEED)
    config = cpu_gpt_config(num_layers=NUM_LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, sequence_parallel=sequence_parallel)
    [chunk] = build_gpt_chunks(config=config, vocab_size=VOCAB, max_sequence_length=SEQ,
                               stage_to_rank=list(range(pp)), seed=SEED,
                               share_embeddings_and_output_weights=tied)
    model = chunk.module
    if ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer))
    forward_backward = get_forward_backward_func()
    data = TinyGPT(num_microbatches=NUM_MICROBATCHES, micro_batch=MICRO_BATCH, seq=SEQ, vocab=VOCAB).microbatches()
    losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(data), model=[model],
                              num_microbatches=NUM_MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH)
    out: dict[str, object] = {"schedule": forward_backward.__name__,
                              "losses": [d["lm loss"] for d in losses]}
    if ddp:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        finalize_model_grads([model])
        out["grads"] = {n: full_tensor(p.main_grad, p) for n, p in named_global_parameters(chunk)}
        # Adam (the distributed optimizer supports nothing else) with a large eps: the first step
        # is then ~lr*g instead of ~lr*sign(g), so TP rounding of tiny grads cannot flip an update.
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=0.01, adam_eps=1.0, clip_grad=1.0,
                            use_distributed_optimizer=distributed_optimizer), [model])
        out["optimizer"] = sorted({type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])})
        _, out["grad_norm"], _ = opt.step()
        out["params"] = {n: full_tensor(p, p) for n, p in named_global_parameters(chunk)}
    else:
        out["grads"] = {n: full_tensor(p.grad, p) for n, p in named_global_parameters(chunk)}
    return out


def _merge(results: list[dict[str, object]], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r[key])  # type: ignore[arg-type]
    return merged


def test_pp2_1f1b_matches_pp1_bitwise():
    [ref] = run_distributed(partial(_train_step, tp=1, pp=1), world_size=1, timeout=60)
    ranks = run_distributed(partial(_train_step, tp=1, pp=2), world_size=2, timeout=60)
    assert ref["schedule"] == "forward_backward_no_pipelining"
    assert ranks[0]["schedule"] == "forward_backward_pipelining_without_interleaving"
    assert ranks[0]["losses"] == [] and len(ranks[1]["losses"]) == NUM_MICROBATCHES
    assert all(torch.equal(a, b) for a, b in zip(ranks[1]["losses"], ref["losses"]))
    grads = _merge(ranks, "grads")
    assert grads.keys() == ref["grads"].keys()
    differ = [n for n, g in ref["grads"].items() if not torch.equal(grads[n], g)]
    assert not differ, f"PP=2 gradients differ from PP=1 for {differ}"


def test_tp2_sequence_parallel_matches_tp1():
    """TP=2 + sequence parallel, DDP, finalize_model_grads, distributed optimizer with clipping."""
    [ref] = run_distributed(partial(_train_step, tp=1, pp=1, ddp=True), world_size=1, timeout=60)
    ranks = run_distributed(partial(_train_step, tp=2, pp=1, sequence_parallel=True, ddp=True,
                                    distributed_optimizer=True), world_size=2, timeout=60)
    assert ref["optimizer"] == ["FP32Optimizer"] and ranks[0]["optimizer"] == ["DistributedOptimizer"]
    for r in ranks:
        torch.testing.assert_close(torch.stack(r["losses"]), torch.stack(ref["losses"]), rtol=1e-5, atol=1e-6)
        assert abs(r["grad_norm"] - ref["grad_norm"]) < 1e-4 * ref["grad_norm"]
        for key in ("grads", "params"):
            assert r[key].keys() == ref[key].keys()
            for n, want in ref[key].items():
                torch.testing.assert_close(r[key][n], want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key} {n}: {m}")


def test_pp2_tied_embeddings_match_pp1():
    """Tied embeddings at PP=2: construction-time sync (``.cuda()`` + all-reduce) and the grad all-reduce."""
    [ref] = run_distributed(partial(_train_step, tp=1, pp=1, tied=True, ddp=True), world_size=1, timeout=60)
    ranks = run_distributed(partial(_train_step, tp=1, pp=2, tied=True, ddp=True), world_size=2, timeout=60)
    assert "output_layer.weight" not in ref["grads"]  # one shared parameter at PP=1
    emb = "embedding.word_embeddings.weight"
    torch.testing.assert_close(ranks[1]["grads"]["output_layer.weight"], ref["grads"][emb], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ranks[0]["grads"][emb], ref["grads"][emb], rtol=1e-5, atol=1e-7)
    assert torch.equal(ranks[0]["params"][emb], ranks[1]["params"]["output_layer.weight"])


# ---------------------------------------------------------------------- the harness itself
def _raise_in_rank_1() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("only rank 1 fails")
    dist.barrier()  # rank 0 waits for rank 1, which crashed: gloo fails fast ("closed by peer")
    return 0


def _rank_1_hangs() -> int:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(3600)
    return dist.get_rank()


def test_harness_reraises_the_rank_exception_with_its_traceback():
    with pytest.raises(KeyError, match="only rank 1 fails") as info:
        run_distributed(_raise_in_rank_1, world_size=2, timeout=30)
    assert "raised in rank 1" in "".join(info.value.__notes__)
    assert "_raise_in_rank_1" in str(info.value.__cause__)  # the rank's traceback


def test_harness_timeout_names_the_unfinished_rank_and_its_stack():
    from megatron_zb.testing import DistributedTimeout

    with pytest.raises(DistributedTimeout) as info:  # 10 s: rank 0 must finish first on a loaded machine
        run_distributed(_rank_1_hangs, world_size=2, timeout=10)
    assert info.value.ranks == [1]
    assert "rank(s) [1] did not finish" in str(info.value) and "_rank_1_hangs" in str(info.value)
