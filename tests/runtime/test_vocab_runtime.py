"""The runtime runs vocabulary-parallel schedules (1f1b-vocab-1/2, zb-h1-vocab-1/2, zbv-vocab-1/2,
interleaved-1f1b-vocab-1, interleaved-zb-vocab-2) on real megatron-core GPT chunks over real gloo processes: the word embedding and the output layer sliced over
the pipeline ranks (megatron_zb/model/vocab_parallel.py), their IF/S/T/IB passes and collectives run
by megatron_zb/runtime/vocab_runtime.py.

Compared with megatron-core's own 1F1B (``forward_backward_pipelining_without_interleaving``) on the
same model (the same weights: the slices are drawn from the same seeds), one iteration: the losses and
every parameter's gradient (the slices' gathered over the pipeline group, under megatron-core's
names) within ``REL`` of the largest magnitude of megatron-core's tensor. Not bitwise: the cross
entropy's sum over the vocabulary is a sum of per-slice partial sums reduced over the ranks (another
association order; with one barrier also the paper's rescaled softmax), and the output layer's GEMMs
have other shapes; the loss's last bits move, and every gradient behind it.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

import megatron_zb  # noqa: F401  (CPU shim)
from megatron_zb.testing import run_distributed
from megatron_zb.testing.tiny_gpt import TinyGPT, run_step
from harness.vocab_gpt import run_in_turn, run_vocab_step, run_vocab_steps

# megatron-core's import-time notices (the argument tests import it into this process).
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

REL = 5e-6  # largest error / largest reference magnitude, per tensor (fp32; measured worst 1.0e-6)
LINEARS_PER_LAYER = 4  # qkv, proj, fc1, fc2: the linear route's W entries per layer and microbatch


def _assert_close(ref: dict, got: dict, *, what: str) -> None:
    assert len(got["losses"]) == len(ref["losses"]) > 0, what
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(float(a) - float(b)) <= REL * abs(float(b)), f"{what}: loss {a} != {b}"
    assert got["grads"].keys() == ref["grads"].keys(), f"{what}: {set(got['grads']) ^ set(ref['grads'])}"
    for n, g in ref["grads"].items():
        assert got["grads"][n].shape == g.shape, f"{what}: {n} differs between replicas"  # (merge stacks them)
        err = (got["grads"][n] - g).abs().max().item()
        assert err <= REL * g.abs().max().item(), f"{what}: gradient of {n}: error {err:.3g}"


def _deferred(cfg: TinyGPT, schedule: str, *, defer_t_weight: bool = False) -> int:
    """W entries a run executes: none for (interleaved) 1F1B (fused BW, T's weight gradient in T); for the
    split-backward schedules every transformer linear's and, with ``defer_t_weight``, each rank's T weight
    gradient (queued for the rank's W of the microbatch; by default T runs it)."""
    if schedule.startswith(("1f1b", "interleaved-1f1b")):
        return 0
    return (LINEARS_PER_LAYER * cfg.num_layers + (cfg.pp if defer_t_weight else 0)) * cfg.num_microbatches


@pytest.fixture(scope="module")
def pp2_reference() -> dict:
    return TinyGPT.merge(run_distributed(partial(run_step, TinyGPT(pp=2), schedule=None), world_size=2, timeout=90))


@pytest.mark.parametrize("schedule", ["1f1b-vocab-1", "1f1b-vocab-2", "zb-h1-vocab-1", "zb-h1-vocab-2",
                                      "interleaved-1f1b-vocab-1", "interleaved-zb-vocab-2"])
def test_pp2_vocab_schedules_match_megatron_1f1b(pp2_reference, schedule):
    """The plain placement, and the interleaved one with 2 chunks per rank (the same 8 layers in 4 stages of
    2: stage 0, the embedding's, is chunk 0 of rank 0, the last stage 3 chunk 1 of rank 1)."""
    cfg = TinyGPT(pp=2)
    got = TinyGPT.merge(run_distributed(partial(run_vocab_step, cfg, schedule=schedule, defer_t_weight=True),
                                        world_size=2, timeout=90))
    _assert_close(pp2_reference, got, what=schedule)
    assert got["w_deferred"] == _deferred(cfg, schedule, defer_t_weight=True), "T's weight gradient in the W (ZB-H1)"


def test_pp2_with_megatron_core_ddp_chunks_second_iteration():
    """The chunks wrapped in megatron-core DDP (gradients in ``main_grad``, gradient sync held back by
    ``no_sync`` and finished by ``finalize_model_grads``); the slices outside it (DP=1). The second
    call of the same runtime object (its process groups, store and plans reused) on the same data
    gives the first call's gradients again."""
    cfg = TinyGPT(pp=2, ddp=True)
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=2, timeout=90))
    got = TinyGPT.merge(run_distributed(partial(run_vocab_step, cfg, schedule="zb-h1-vocab-1", iterations=2),
                                        world_size=2, timeout=90))
    _assert_close(ref, got, what="zb-h1-vocab-1 with DDP")


def test_pp2_dp2_the_slices_gradients_are_reduced_by_their_ddp():
    """PP=2 x DP=2: every data-parallel replica's slices end with the same (reduced) gradients, those of
    megatron-core's 1F1B with DDP (each replica reads its own micro batches)."""
    cfg = TinyGPT(pp=2, dp=2, ddp=True)
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=4, timeout=120))
    got = TinyGPT.merge(run_distributed(partial(run_vocab_step, cfg, schedule="zb-h1-vocab-1"), world_size=4,
                                        timeout=120))
    _assert_close(ref, got, what="PP=2 x DP=2 zb-h1-vocab-1")


def test_pp4_vocab_schedules_match_megatron_1f1b():
    cfg = TinyGPT(pp=4, num_microbatches=8)
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=4, timeout=120))
    for schedule in ("1f1b-vocab-1", "zb-h1-vocab-2"):
        got = TinyGPT.merge(run_distributed(partial(run_vocab_step, cfg, schedule=schedule), world_size=4,
                                            timeout=120))
        _assert_close(ref, got, what=f"PP=4 {schedule}")
        assert got["w_deferred"] == _deferred(cfg, schedule)


def test_forward_only_gives_megatron_cores_losses(pp2_reference):
    """Evaluation (``forward_only``): IF, the forwards and S run, the forward barrier computes the loss;
    no gradient, no W."""
    got = run_distributed(partial(run_vocab_step, TinyGPT(pp=2), schedule="zb-h1-vocab-1", forward_only=True),
                          world_size=2, timeout=90)
    assert got[0]["losses"] == [] and len(got[1]["losses"]) == len(pp2_reference["losses"])
    for a, b in zip(got[1]["losses"], pp2_reference["losses"]):
        assert abs(float(a) - float(b)) <= REL * abs(float(b)), (a, b)
    assert all(r["with_grad"] == 0 and r["w_deferred"] == 0 for r in got), got


def test_tied_slices_match_megatron_cores_tied_embeddings():
    """Tied: one slice per rank serves the embedding and the output layer (IB's and T's weight gradients
    both add into it), against megatron-core's tied model, whose two copies' gradients its
    ``finalize_model_grads`` sums over the embedding group (DDP)."""
    cfg = TinyGPT(pp=2, ddp=True, model_options={"share_embeddings_and_output_weights": True})
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=2, timeout=90))
    got = TinyGPT.merge(run_distributed(partial(run_vocab_step, cfg, schedule="zb-h1-vocab-2", tied=True),
                                        world_size=2, timeout=90))
    _assert_close(ref, got, what="tied zb-h1-vocab-2")
    assert torch.equal(got["grads"]["embedding.word_embeddings.weight"], got["grads"]["output_layer.weight"])


def test_the_slices_and_a_vocabulary_parallel_schedule_need_each_other():
    """Refused by name, before anything runs."""
    from megatron_zb.runtime import get_forward_backward_func
    from megatron_zb.runtime.vocab_runtime import VocabParallelModel

    with pytest.raises(ValueError, match="holds vocabulary-parallel passes"):
        get_forward_backward_func("zb-h1-vocab-1")
    with pytest.raises(ValueError, match="needs a schedule with vocabulary-parallel passes"):
        get_forward_backward_func("1f1b", vocab_parallel=VocabParallelModel(torch.nn.Module()))


def test_tp2_pp2_vocab_schedules_match_megatron_1f1b():
    """TP=2 x PP=2 (4 processes): the slices over megatron-core's model-parallel group (slice ``pp_rank x TP +
    tp_rank``), every pass's collective over it; X and dL/dloss broadcast from the last stage's tensor rank 0,
    the embedding's gradient from the first stage's. Against megatron-core's 1F1B with TP=2 on the same model
    (the chunks' gradients gathered over the tensor group; sequence-parallel norm gradients, which differ per
    tensor rank before megatron-core's all-reduce, compared rank by rank), all in one launch:

    * no sequence parallelism: two barriers (``zb-h1-vocab-1``, megatron-core's arithmetic) and one
      (``zb-h1-vocab-2``, the input gradient formed by every tensor rank of the last stage from C0's sum);
    * sequence parallelism (``zb-h1-vocab-1``): the last stage's stand-in output layer all-gathers X's rows
      over the tensor group (its backward takes the rank's rows of X's gradient); the first stage's embedding
      gets IF's whole sum and scatters it itself (learned position embedding), or -- with RoPE, where
      megatron-core's word embedding reduce-scatters -- the stand-in returns the rank's rows."""
    cfg = TinyGPT(pp=2, tp=2, num_layers=4, hidden=32, seq=16)
    sp = dataclasses.replace(cfg, sequence_parallel=True)
    rope = dataclasses.replace(sp, model_options={"position_embedding_type": "rope"})
    runs = [(cfg, "zb-h1-vocab-1"), (cfg, "zb-h1-vocab-2"), (sp, "zb-h1-vocab-1"), (rope, "zb-h1-vocab-1")]
    calls = []
    for c in (cfg, sp, rope):
        calls.append(partial(run_step, c, schedule=None))
        calls += [partial(run_vocab_step, c, schedule=s) for cc, s in runs if cc is c]
    per_rank = run_distributed(partial(run_in_turn, calls), world_size=4, timeout=240)
    merged = [TinyGPT.merge([r[i] for r in per_rank]) for i in range(len(calls))]
    refs = [i for i, call in enumerate(calls) if call.func is run_step]
    for i, call in enumerate(calls):
        if call.func is run_step:
            continue
        c, schedule = call.args[0], call.keywords["schedule"]
        ref = merged[max(j for j in refs if j < i)]
        what = f"TP=2 x PP=2 {schedule}" + (" SP" if c.sequence_parallel else "") + (" RoPE" if c is rope else "")
        _assert_close(ref, merged[i], what=what)
        # summed over the ranks: each tensor rank runs its stage's linears' W and its own T weight gradient
        assert merged[i]["w_deferred"] == c.tp * _deferred(c, schedule), what


@pytest.mark.parametrize("schedule,defer", [("zbv-vocab-1", False), ("zbv-vocab-2", True)])
def test_pp2_zbv_vocab_schedules_match_megatron_1f1b(pp2_reference, schedule, defer):
    """The V placement: rank 0 holds stage 0 and the last stage 3 (chunks built as megatron-core's V:
    ``placement_for``), so X and dL/dloss are broadcast from rank 0 and the embedding's gradient too; each
    rank's T weight gradient runs in T, or (``defer_t_weight``) in its first W of the microbatch after T."""
    cfg = TinyGPT(pp=2)
    got = TinyGPT.merge(run_distributed(partial(run_vocab_step, cfg, schedule=schedule, defer_t_weight=defer),
                                        world_size=2, timeout=90))
    _assert_close(pp2_reference, got, what=schedule)
    assert got["w_deferred"] == _deferred(cfg, schedule, defer_t_weight=defer), "T's weight gradient in T or W"


FAMILY_SCHEDULES = [f"{base}-vocab-{v}" for base in ("zb", "zb-1p", "zb-2p", "v-half", "v-min") for v in (1, 2)]


def test_pp2_family_vocab_schedules_match_megatron_1f1b(pp2_reference):
    """The searched families' vocabulary forms (schedules/generators/vocab_family.py: greedy on the plain
    placement, the memory-controllable V's), one iteration each; all ten in one pair of processes (the
    parallel state rebuilt between them) to start the processes once."""
    cfg = TinyGPT(pp=2)
    per_rank = run_distributed(partial(run_vocab_steps, cfg, schedules=FAMILY_SCHEDULES), world_size=2, timeout=180)
    for schedule in FAMILY_SCHEDULES:
        got = TinyGPT.merge([r[schedule] for r in per_rank])
        _assert_close(pp2_reference, got, what=schedule)
        assert got["w_deferred"] == _deferred(cfg, schedule), schedule


def test_pp4_zbv_vocab_matches_megatron_1f1b():
    cfg = TinyGPT(pp=4, num_microbatches=8)
    ref = TinyGPT.merge(run_distributed(partial(run_step, cfg, schedule=None), world_size=4, timeout=120))
    got = TinyGPT.merge(run_distributed(partial(run_vocab_step, cfg, schedule="zbv-vocab-1"), world_size=4,
                                        timeout=120))
    _assert_close(ref, got, what="PP=4 zbv-vocab-1")
    assert got["w_deferred"] == _deferred(cfg, "zbv-vocab-1")


def test_check_vocab_schedule_takes_plain_v_and_interleaved_placements_only():
    """The runtime runs the passes on the plain, the V and the interleaved placement; another placement (here
    two contiguous stages per rank) is refused by name (no process group needed); T's weight gradient goes to
    the rank's first W of the microbatch after T."""
    import dataclasses

    from megatron_zb.runtime.vocab_runtime import check_vocab_schedule, t_weight_stages
    from megatron_zb.schedules.ir import Op
    from megatron_zb.schedules.registry import build_schedule

    ilv = build_schedule("interleaved-zb-vocab-1", num_ranks=2, num_microbatches=4, num_chunks=2)
    assert list(ilv.stage_to_rank) == [0, 1, 0, 1]
    check_vocab_schedule(ilv)   # interleaved: accepted
    check_vocab_schedule(build_schedule("interleaved-1f1b-vocab-2", num_ranks=2, num_microbatches=3, num_chunks=3))
    other = dataclasses.replace(ilv, stage_to_rank=[0, 0, 1, 1], name="contiguous")
    with pytest.raises(ValueError, match="'contiguous': the runtime runs vocabulary passes on the plain, the V and "
                                         "the interleaved placement only"):
        check_vocab_schedule(other)
    zbv = build_schedule("zbv-vocab-2", num_ranks=2, num_microbatches=4)
    check_vocab_schedule(zbv)   # V: accepted
    check_vocab_schedule(build_schedule("zb-h1-vocab-1", num_ranks=2, num_microbatches=4))  # plain: accepted
    for sched, stages in ((zbv, lambda r: {r, 3 - r}), (ilv, lambda r: {r, r + 2})):
        for r, acts in enumerate(sched.ranks):
            pairs = t_weight_stages(acts)
            assert sorted(pairs) == list(range(4)) and set(pairs.values()) <= stages(r)
            for mb, stage in pairs.items():
                t_at = next(i for i, a in enumerate(acts) if a.op is Op.T and a.mb == mb)
                w_at = next(i for i, a in enumerate(acts) if a.op is Op.W and a.mb == mb and a.stage == stage)
                assert w_at > t_at and not any(a.op is Op.W and a.mb == mb for a in acts[t_at:w_at])


# ---------------------------------------------------------------------------- pretrain_gpt_zb.py
TRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
         "--tokenizer-type", "NullTokenizer", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "6", "--lr", "2e-3", "--mock-data", "--num-workers", "0", "--log-interval", "1",
         "--eval-interval", "3", "--eval-iters", "1", "--distributed-backend", "gloo",
         "--pipeline-model-parallel-size", "2",
         "--pipeline-timeout-seconds", "60", "--distributed-timeout-minutes", "2"]
"""A PP=2 run whose padded vocabulary (101 ids -> 128) is the same with and without vocabulary parallelism
(padded by 64 x TP either way, docs/vocab_parallel.md "Slices"): the same model either way. Dropout
off (not Megatron-LM's default): on the V each rank builds other layers, and megatron-core draws each
rank's dropout masks from its own stream in execution order, so the V's masks are not 1F1B's (as in
docs/megatron_lm.md's V section); every case uses the same flags, so all compare the same model."""


@pytest.fixture(scope="module")
def megatron_core_run(tmp_path_factory):
    """``--use-megatron-core-schedule`` on ``TRAIN`` plus the tying flags, in ``world`` ranks: run once per
    (world, tying) in this module, shared by the cases that compare with it."""
    from harness.trainer_run import in_process

    runs: dict[tuple[int, tuple[str, ...]], dict] = {}

    def get(world: int, tying: list[str]) -> dict:
        key = (world, tuple(tying))
        if key not in runs:
            runs[key] = in_process(tmp_path_factory.mktemp("ref"), "ref", world,
                                   TRAIN + tying + ["--use-megatron-core-schedule"])
        return runs[key]
    return get


CHUNKS = ["--num-layers-per-virtual-pipeline-stage", "1"]
"""Megatron-LM's interleaving flag: 4 layers over PP=2 in chunks of 1 layer, 2 chunks per rank."""


@pytest.mark.parametrize("schedule,tying,world,own", [("zb-h1-vocab-1", [], 2, []),
                                                      ("1f1b-vocab-2", ["--untie-embeddings-and-output-weights"], 2, []),
                                                      ("zb-h1-vocab-2", [], 4, []),
                                                      ("zbv-vocab-1", [], 2, []),
                                                      ("zbv-vocab-2", ["--untie-embeddings-and-output-weights"], 2, []),
                                                      ("interleaved-zb-vocab-1", [], 2, CHUNKS)],
                         ids=["tied-zb-h1-vocab-1", "untied-1f1b-vocab-2", "dp2-tied-zb-h1-vocab-2", "tied-zbv-vocab-1",
                              "untied-zbv-vocab-2", "tied-interleaved-zb-vocab-1"])
def test_pretrain_enable_vocab_parallel_matches_megatron_core_1f1b(tmp_path, megatron_core_run, schedule, tying, world,
                                                                   own):
    """``pretrain_gpt_zb.py --enable-vocab-parallel --schedule ...`` (Adam, clipping, LR schedule:
    6 iterations, evaluation after iterations 3 and 6 and on the test set) against megatron-core's own 1F1B
    on the same model: the logged loss and grad norm of every iteration and every validation / test loss
    within a relative 1e-5 (measured worst: 5e-8, 1.5e-6 and 5e-8; not bitwise, see the module docstring).
    ``own``: flags of the vocabulary-parallel run only (the interleaved placement's chunks)."""
    from harness.trainer_run import in_process

    ref = megatron_core_run(world, tying)
    got = in_process(tmp_path, "vocab", world, TRAIN + tying + own + ["--schedule", schedule, "--enable-vocab-parallel"])
    if own:  # the interleaved placement: chunks 0 and 1 of rank r are stages r and r + 2
        assert "pipeline rank 0, stages [0, 2])" in got["log"] and "pipeline rank 1, stages [1, 3])" in got["log"]
    tied = ", tied" if not tying else ""
    assert f"> vocabulary parallelism: 2 slices of 64 rows (padded vocabulary 128){tied}\n" in got["log"]
    _assert_replanned_from_the_vocabulary_passes(got, schedule)
    want, have = ref["values"]["train"], got["values"]["train"]
    assert [r["iteration"] for r in have] == [r["iteration"] for r in want] == list(range(1, 7))
    for a, b in zip(have, want):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["iteration"], key, a[key], b[key])
    want_v, have_v = ref["values"]["valid"], got["values"]["valid"]
    assert len(have_v) == len(want_v) == 4  # iterations 3 and 6, then the final validation and test sets
    for a, b in zip(have_v, want_v):
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-5), (a, b)


def _assert_replanned_from_the_vocabulary_passes(got: dict, schedule: str) -> None:
    """The profiling window (iterations 2-3) timed every vocabulary pass on both ranks (IF, S, T, IB and the
    collectives: every cost > 0) and the schedule every rank ran afterwards is the generator's under those
    measured costs, valid."""
    from megatron_zb.schedules import CostModel
    from megatron_zb.schedules.registry import build_schedule
    from megatron_zb.schedules.costs import VocabCosts
    from megatron_zb.schedules.ir import validate

    assert f"re-planned '{schedule}' from the measured costs" in got["log"]
    assert "measured vocabulary passes per rank (ms, without their waits): T_IF=[" in got["log"]
    costs = got["costs"]
    assert costs is not None and costs["vocab"] is not None, "the re-plan had no vocabulary costs"
    vocab = costs["vocab"]
    for key in ("t_if", "t_s", "t_t", "t_ib"):
        assert len(vocab[key]) == 2 and all(v > 0 for v in vocab[key]), (key, vocab[key])
    assert vocab["t_collective"] > 0
    model = CostModel(**{**costs, "vocab": VocabCosts(**vocab)})
    limit = costs["memory_limit"] if costs["memory_limit"] is not None else got["memory_limit"]
    want = build_schedule(schedule, num_ranks=2, num_microbatches=got["m"], costs=model, memory_limit=limit)
    installed = got["installed"]
    validate(installed)
    assert installed.ranks == want.ranks and installed.vocab_barriers == want.vocab_barriers


@pytest.mark.parametrize("sp", [[], ["--sequence-parallel"]], ids=["tp", "tp-sp"])
def test_pretrain_enable_vocab_parallel_with_tensor_parallelism(tmp_path, sp):
    """``--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --enable-vocab-parallel --schedule
    zb-h1-vocab-1`` (tied; 4 processes; the slices over the model-parallel group: 4 slices of 32 rows), without
    and with ``--sequence-parallel``, against ``--use-megatron-core-schedule`` with TP=2 (and the same
    ``--sequence-parallel``) on the same model (101 ids padded to 128 both ways, by 32 x TP):
    the logged loss and grad norm of 3 iterations and the validation loss within a relative 1e-5."""
    from harness.trainer_run import in_process

    argv = [*TRAIN, "--make-vocab-size-divisible-by", "32", "--tensor-model-parallel-size", "2",
            "--train-iters", "3", "--eval-interval", "3", "--global-batch-size", "4", *sp]
    ref = in_process(tmp_path, "ref", 4, argv + ["--use-megatron-core-schedule"])
    got = in_process(tmp_path, "vocab", 4, argv + ["--schedule", "zb-h1-vocab-1", "--enable-vocab-parallel"])
    assert "> vocabulary parallelism: 4 slices of 32 rows (padded vocabulary 128), tied\n" in got["log"]
    want, have = ref["values"]["train"], got["values"]["train"]
    assert [r["iteration"] for r in have] == [r["iteration"] for r in want] == [1, 2, 3]
    for a, b in zip(have, want):
        for key in ("lm loss", "grad norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a["iteration"], key, a[key], b[key])
    want_v, have_v = ref["values"]["valid"], got["values"]["valid"]
    assert len(have_v) == len(want_v) == 3  # after iteration 3, then the final validation and test sets
    for a, b in zip(have_v, want_v):
        assert a["lm loss"] == pytest.approx(b["lm loss"], rel=1e-5), (a, b)


HALF = {"--bf16": ("torch.bfloat16", "torch.float32", []),
        "--fp16": ("torch.float16", "torch.float16", ["--initial-loss-scale", "4096"])}
"""The half-precision flags, the parameters' and the ``main_grad`` buffers' dtypes they give (Megatron-LM's
default: ``--accumulate-allreduce-grads-in-fp32`` with bf16 only) and their own flags (fp16: a loss scale that
does not overflow at once -- megatron's default 2^32 skips every step of a 2-iteration run, both ways)."""


@pytest.mark.parametrize("half", ["--bf16", "--fp16"])
def test_pretrain_enable_vocab_parallel_in_half_precision(tmp_path, half):
    """``--enable-vocab-parallel --schedule zb-h1-vocab-1`` (PP=2, tied) with ``--bf16`` / ``--fp16`` against
    ``--use-megatron-core-schedule`` with the same flag on the same model, 2 iterations: the slices hold half-precision
    parameters whose main copies in megatron-core's mixed-precision optimizer are fp32 (their ``main_grad`` in the
    chunks' dtype: fp32 with bf16, fp16 with fp16); iteration 1's loss equals megatron-core's bit for bit (the same half-precision logits: each is the same
    length-h dot product, its statistics in fp32); the grad norms within a relative ``2^-9`` (bf16's unit roundoff;
    fp16's is 2^-11) and iteration 2's loss within ``2^-12``. Not bitwise: megatron-core's output layer forms the input
    gradient in one GEMM over the whole vocabulary, rounded to half precision once; here each slice's part is rounded,
    then the parts are summed in half precision (C1, as megatron-core's tensor-parallel all-reduce does), another
    rounding of the gradient reaching the transformer layers (measured worst, grad norm: 4.7e-4 bf16, 1.4e-4 fp16;
    iteration 2's loss: 4.6e-5 bf16, 4.0e-6 fp16)."""
    from harness.trainer_run import in_process

    dtype, grad_dtype, own = HALF[half]
    argv = [*TRAIN, half, *own, "--train-iters", "2", "--eval-iters", "0"]
    ref = in_process(tmp_path, "ref", 2, argv + ["--use-megatron-core-schedule"])
    got = in_process(tmp_path, "vocab", 2, argv + ["--schedule", "zb-h1-vocab-1", "--enable-vocab-parallel"])
    assert got["vocab_dtypes"] == {"params": [dtype], "main_grad": [grad_dtype], "chunks_main_grad": [grad_dtype],
                                   "main_params": ["torch.float32"]}
    want, have = ref["values"]["train"], got["values"]["train"]
    assert [r["iteration"] for r in have] == [r["iteration"] for r in want] == [1, 2]
    assert not any(r["skipped"] for r in have + want)
    assert have[0]["lm loss"] == want[0]["lm loss"]
    assert have[1]["lm loss"] == pytest.approx(want[1]["lm loss"], rel=2 ** -12)
    for a, b in zip(have, want):
        assert a["grad norm"] == pytest.approx(b["grad norm"], rel=2 ** -9), (a["iteration"], a, b)


def test_enable_vocab_parallel_refusals_name_every_flag():
    """Before any process group: a vocabulary-parallel schedule needs the flag, the flag such a schedule,
    and what the runtime does not run with it yet is named in one line (overlapped parameter gathers, ...);
    tensor parallelism, with and without sequence parallelism, and half precision are accepted, and checkpoints
    and the distributed optimizer are not refused (tests/training/test_vocab_checkpoint.py)."""
    from megatron_zb.training.arguments import ArgumentError
    from megatron_zb.training.pretrain import parse_command_line

    with pytest.raises(ArgumentError, match="add --enable-vocab-parallel"):
        parse_command_line(TRAIN + ["--schedule", "1f1b-vocab-1"], world_size=2)
    with pytest.raises(ArgumentError) as e:  # a family with vocabulary forms: its two forms are named
        parse_command_line(TRAIN + ["--enable-vocab-parallel", "--schedule", "zb-h1"], world_size=2)
    assert "--enable-vocab-parallel: needs a schedule that places the vocabulary passes: --schedule zb-h1-vocab-2 " \
           "or zb-h1-vocab-1 ('zb-h1' places none)" in str(e.value)
    with pytest.raises(ArgumentError, match=r"--enable-vocab-parallel: needs a schedule that places the vocabulary"
                                            r".*zb-2p-vocab-1, .*v-min-vocab-2"):  # zb-h2 has none: every name
        parse_command_line(TRAIN + ["--enable-vocab-parallel", "--schedule", "zb-h2"], world_size=2)
    for name in ("zb-2p-vocab-1", "v-half-vocab-2"):      # the searched families' forms are accepted
        parse_command_line(TRAIN + ["--enable-vocab-parallel", "--schedule", name], world_size=2)
    with pytest.raises(ArgumentError) as e:
        parse_command_line(TRAIN + ["--enable-vocab-parallel", "--schedule", "1f1b-vocab-2",
                                   "--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
                                   "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
                           world_size=4)
    msg = str(e.value)
    for what in ("--overlap-param-gather",):
        assert what in msg, (what, msg)
    assert "--tensor-model-parallel-size" not in msg and "--sequence-parallel" not in msg and "--bf16" not in msg, msg
    for sp in ([], ["--sequence-parallel"]):
        ok = parse_command_line(TRAIN + ["--enable-vocab-parallel", "--schedule", "zb-h1-vocab-1",
                                         "--tensor-model-parallel-size", "2", *sp], world_size=4)
        assert ok.args.sequence_parallel == bool(sp)


def test_enable_vocab_parallel_is_refused_inside_megatron_lms_loop():
    """Megatron-LM's model provider builds the whole vocabulary layers: the flag its parser also gets
    (the zero-bubble group) is refused there, not ignored."""
    import argparse

    from megatron_zb.megatron_lm import add_flags, configure
    from megatron_zb.training.arguments import ArgumentError

    parser = argparse.ArgumentParser()
    add_flags(parser)
    args = parser.parse_args(["--enable-vocab-parallel", "--schedule", "1f1b-vocab-1"])
    with pytest.raises(ArgumentError, match="--enable-vocab-parallel: not supported inside Megatron-LM's loop"):
        configure(args)
    args = parser.parse_args(["--schedule", "zb-h1-vocab-2"])  # the schedule alone: refused by name too
    with pytest.raises(ArgumentError, match="--schedule: schedule 'zb-h1-vocab-2' holds vocabulary-parallel passes"):
        configure(args)
