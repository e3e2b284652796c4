"""Vocabulary parallelism's layers (megatron_zb/model/vocab_parallel.py) on real gloo process groups.

* Against megatron-core, bitwise (``torch.equal``: exact equality, +0.0 == -0.0): the embedding
  (IF + its all-reduce, IB) against ``VocabParallelEmbedding`` and the output layer with the exact
  arithmetic (S, C0, T, C1, W) against ``ColumnParallelLinear`` + ``vocab_parallel_cross_entropy``,
  both on a tensor-parallel group holding the same slices, while ours runs on another group of the
  same ranks (the pipeline group's stand-in; megatron-core 0.16.1's cross entropy only reduces over
  ``parallel_state``'s TP group). Tied: one slice, both gradients. Also the embedding against the
  unsharded ``F.embedding`` (exact sum: one non-zero contributor per element).
* Against plain unsharded PyTorch (``F.cross_entropy`` on the whole padded vocabulary), within a
  relative tolerance, on the real pipeline group (PP=2, PP=4) and the model-parallel group (TP=2 x
  PP=2), for the exact arithmetic and the paper's rescaled one (Vocab-1 and Vocab-2). Not bitwise:
  the sum over the vocabulary is a sum of per-slice partial sums (another association order), the
  rescaled form exponentiates with the slice's maximum and multiplies by ``exp(m_i - m)``, and
  the GEMMs have other shapes (other blockings).
* Per-rank parameter bytes equal across ranks (max/min = 1.00), untied and tied.

No dropout: these layers have none (the embedding's dropout stays with the position embeddings on
the first stage, outside this module).
"""

from __future__ import annotations

import pytest
import torch

import megatron_zb  # noqa: F401  (installs the CPU shim)
from megatron_zb.model.vocab_parallel import VocabSlice, output_s, padded_vocab_size
from megatron_zb.testing import init_parallel_state, run_distributed

VOCAB, DIVISIBLE_BY, HIDDEN, SEQ, BATCH, SEED = 1000, 8, 32, 16, 2, 1234
STD = 0.5  # weights large enough that the softmax is peaked (the max-shift matters)
REL = 5e-6  # relative tolerance against unsharded PyTorch (fp32; measured worst 6.1e-7, ~5 ulp)


def _data(padded: int):
    """The same tokens, targets, output-layer input and upstream gradients on every rank."""
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    target = torch.randint(0, VOCAB, (SEQ, BATCH), generator=gen)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    grad_embedding = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    grad_loss = torch.rand(SEQ, BATCH, generator=gen) + 0.5
    full = torch.randn(padded, HIDDEN, generator=gen) * STD
    return tokens, target, x, grad_embedding, grad_loss, full


def _ours(group, vocab, weight, tokens, target, x, grad_embedding, grad_loss, *, exact=True, fuse=False,
          embed=True):
    """Every piece in order; returns (embedding, loss, input grad); weight gradients land in weight.grad."""
    from megatron_zb.model import vocab_parallel as vp

    emb = None
    if embed:
        partial, state = vp.embedding_if(tokens, weight, vocab)
        emb = vp.embedding_reduce(partial, group)
        vp.embedding_ib(state, grad_embedding, weight)()
    out = vp.output_s(x, weight, target, vocab, exact=exact, fuse_input_grad=fuse)
    loss = vp.output_c0(out, group).clone()
    grads = vp.output_t(out, grad_loss)
    dx = grads.input_grad if grads.reduced else vp.output_c1(grads.input_grad, group)
    grads.weight_grad()
    return emb, loss, dx


# ---------------------------------------------------------------------- against megatron-core
def _rank_against_megatron_tp() -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy

    from megatron_zb.model import cpu_gpt_config
    from megatron_zb.model import vocab_parallel as vp

    n = dist.get_world_size()
    init_parallel_state(tensor_model_parallel_size=n)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    group = dist.new_group(list(range(n)))  # the slices' pipeline group: same ranks, its own communicator
    padded = padded_vocab_size(VOCAB, divisible_by=DIVISIBLE_BY)
    vocab = VocabSlice.of_group(padded, group)
    assert (vocab.start, vocab.end) == (dist.get_rank() * padded // n, (dist.get_rank() + 1) * padded // n)
    tokens, target, x, g_emb, g_loss, full = _data(padded)
    config = cpu_gpt_config(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=n,
                            perform_initialization=False)
    rows = full[vocab.start:vocab.end]

    def megatron(tied: bool):
        emb = VocabParallelEmbedding(padded, HIDDEN, init_method=None, config=config, tp_group=tp_group)
        col = ColumnParallelLinear(HIDDEN, padded, config=config, init_method=None, bias=False, gather_output=False,
                                   skip_weight_param_allocation=tied, tp_group=tp_group)
        with torch.no_grad():
            emb.weight.copy_(rows)
            if not tied:
                col.weight.copy_(rows)
        x_ref = x.clone().requires_grad_()
        e = emb(tokens)
        logits, _ = col(x_ref, weight=emb.weight if tied else None)
        loss = vocab_parallel_cross_entropy(logits, target)
        torch.autograd.backward([e, loss], [g_emb, g_loss])
        return e, loss, x_ref.grad, emb.weight.grad, None if tied else col.weight.grad

    checks = {}
    # untied: embedding and output layer each with its own slice
    e_ref, loss_ref, dx_ref, demb_ref, dout_ref = megatron(tied=False)
    w_emb = torch.nn.Parameter(rows.clone())
    w_out = torch.nn.Parameter(rows.clone())
    partial, state = vp.embedding_if(tokens, w_emb, vocab)
    e = vp.embedding_reduce(partial, group)
    vp.embedding_ib(state, g_emb, w_emb)()
    _, loss, dx = _ours(group, vocab, w_out, tokens, target, x, g_emb, g_loss, embed=False)
    checks["embedding"] = torch.equal(e, e_ref)
    checks["embedding_unsharded"] = torch.equal(e, F.embedding(tokens, full))
    checks["embedding_wgrad"] = torch.equal(w_emb.grad, demb_ref)
    full_w = full.clone().requires_grad_()
    F.embedding(tokens, full_w).backward(g_emb)
    checks["embedding_wgrad_unsharded"] = torch.equal(w_emb.grad, full_w.grad[vocab.start:vocab.end])
    checks["loss"] = torch.equal(loss, loss_ref)
    checks["input_grad"] = torch.equal(dx, dx_ref)
    checks["output_wgrad"] = torch.equal(w_out.grad, dout_ref)
    # tied: one slice serves both; IB's and W's gradients accumulate into it
    e_ref, loss_ref, dx_ref, dtied_ref, _ = megatron(tied=True)
    w = torch.nn.Parameter(rows.clone())
    e, loss, dx = _ours(group, vocab, w, tokens, target, x, g_emb, g_loss)
    checks["tied"] = all(torch.equal(a, b) for a, b in ((e, e_ref), (loss, loss_ref), (dx, dx_ref), (w.grad, dtied_ref)))
    return checks


@pytest.mark.parametrize("world_size", [2, 4])
def test_bitwise_against_megatron_core_tensor_parallel(world_size):
    results = run_distributed(_rank_against_megatron_tp, world_size=world_size, timeout=120)
    for rank, checks in enumerate(results):
        assert all(checks.values()), f"rank {rank}: not equal: {[k for k, ok in checks.items() if not ok]}"


# ---------------------------------------------------------------------- against unsharded PyTorch
def _close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |ours - ref| relative to the largest |ref|."""
    return float((ours - ref).abs().max() / ref.abs().max())


def _rank_against_unsharded(tp: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from megatron_zb.model import derive_seed
    from megatron_zb.model import vocab_parallel as vp

    world = dist.get_world_size()
    init_parallel_state(tensor_model_parallel_size=tp, pipeline_model_parallel_size=world // tp)
    group = (parallel_state.get_model_parallel_group() if tp > 1
             else parallel_state.get_pipeline_model_parallel_group())
    padded = padded_vocab_size(VOCAB, divisible_by=DIVISIBLE_BY)
    tokens, target, x, g_emb, g_loss, _ = _data(padded)
    init = lambda t: torch.nn.init.normal_(t, mean=0.0, std=STD)  # noqa: E731
    untied = vp.VocabParallelSlices(padded_size=padded, hidden_size=HIDDEN, group=group, tied=False, seed=SEED,
                                    init_method=init)
    tied = vp.VocabParallelSlices(padded_size=padded, hidden_size=HIDDEN, group=group, tied=True, seed=SEED,
                                  init_method=init)
    vocab = untied.vocab
    pp_rank, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    out = {"slice_index_ok": vocab.index == pp_rank * tp + tp_rank}

    def master(key: str) -> torch.Tensor:  # the whole matrix, drawn here as the docstring says
        torch.manual_seed(derive_seed(SEED, key))
        return init(torch.empty(padded, HIDDEN))

    w_emb, w_out = master("word_embeddings"), master("output_layer")
    out["init_ok"] = (torch.equal(untied.word_embeddings, w_emb[vocab.start:vocab.end])
                      and torch.equal(untied.output_weight, w_out[vocab.start:vocab.end])
                      and torch.equal(tied.output_layer_weight, w_emb[vocab.start:vocab.end]))

    def reference(weight_out: torch.Tensor, weight_emb: torch.Tensor | None):
        x_ref = x.clone().requires_grad_()
        w = weight_out.clone().requires_grad_()
        logits = x_ref @ w.t()
        loss = F.cross_entropy(logits.view(-1, padded), target.view(-1), reduction="none").view(SEQ, BATCH)
        outputs, grads = [loss], [g_loss]
        if weight_emb is not None:  # tied: the same leaf
            outputs.append(F.embedding(tokens, w))
            grads.append(g_emb)
        torch.autograd.backward(outputs, grads)
        return loss.detach(), x_ref.grad, w.grad[vocab.start:vocab.end]

    loss_ref, dx_ref, dw_ref = reference(w_out, None)
    for name, exact, fuse in (("exact", True, False), ("vocab2", False, False), ("vocab1", False, True)):
        untied.output_weight.grad = None
        _, loss, dx = _ours(group, vocab, untied.output_weight, tokens, target, x, g_emb, g_loss, exact=exact,
                            fuse=fuse, embed=False)
        out[name] = (_close(loss, loss_ref), _close(dx, dx_ref), _close(untied.output_weight.grad, dw_ref))
    loss_ref, dx_ref, dw_ref = reference(w_emb, w_emb)
    _, loss, dx = _ours(group, vocab, tied.word_embeddings, tokens, target, x, g_emb, g_loss, exact=False, fuse=True)
    out["tied_vocab1"] = (_close(loss, loss_ref), _close(dx, dx_ref), _close(tied.word_embeddings.grad, dw_ref))
    for name, module in (("untied", untied), ("tied", tied)):
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
        everyone = [None] * world
        dist.all_gather_object(everyone, nbytes)
        out[f"bytes_{name}"] = everyone
    return out


@pytest.mark.parametrize("tp,world_size", [(1, 2), (1, 4), (2, 4)], ids=["pp2", "pp4", "tp2xpp2"])
def test_against_unsharded_pytorch_and_equal_parameter_bytes(tp, world_size):
    results = run_distributed(_rank_against_unsharded, world_size=world_size, kwargs=dict(tp=tp), timeout=120)
    padded = padded_vocab_size(VOCAB, divisible_by=DIVISIBLE_BY)
    for rank, r in enumerate(results):
        assert r["slice_index_ok"] and r["init_ok"], f"rank {rank}: {r}"
        for name in ("exact", "vocab2", "vocab1", "tied_vocab1"):
            assert max(r[name]) < REL, f"rank {rank} {name}: relative errors (loss, dx, dW) {r[name]}"
    bytes_untied, bytes_tied = results[0]["bytes_untied"], results[0]["bytes_tied"]
    assert max(bytes_untied) / min(bytes_untied) == 1.0 and max(bytes_tied) / min(bytes_tied) == 1.0
    assert bytes_untied[0] == 2 * bytes_tied[0] == 2 * padded // world_size * HIDDEN * 4


# ---------------------------------------------------------------------- pure
def test_padding_and_slices():
    # Megatron-LM's rows, a multiple of divisible_by x TP, whatever the slices
    assert padded_vocab_size(1000, divisible_by=8) == 1000
    assert padded_vocab_size(128256, divisible_by=128) == 128256
    assert padded_vocab_size(1001, divisible_by=8, tp=2) == 1008
    assert padded_vocab_size(8200, divisible_by=128) == 8320  # not 256 x 33 = 8448 at PP=2 (before issue 41)
    sl = VocabSlice(padded_size=1024, index=3, num_slices=4)
    assert (sl.start, sl.end, sl.size) == (768, 1024, 256)
    # uneven: 1000 rows in 3 slices of 334, 333, 333, contiguous
    thirds = [VocabSlice(padded_size=1000, index=i, num_slices=3) for i in range(3)]
    assert [(v.start, v.end, v.size) for v in thirds] == [(0, 334, 334), (334, 667, 333), (667, 1000, 333)]
    assert not thirds[0].even and sl.even
    assert thirds[1].describe() == "3 slices of 334 or 333 rows" and sl.describe() == "4 slices of 256 rows"
    with pytest.raises(ValueError, match="cannot give each of 3 slices a row"):
        VocabSlice(padded_size=2, index=0, num_slices=3)
    with pytest.raises(ValueError, match="needs exact=False"):
        output_s(torch.zeros(1, 1, 2), torch.zeros(4, 2), torch.zeros(1, 1, dtype=torch.long), sl, exact=True,
                 fuse_input_grad=True)
