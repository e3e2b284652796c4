"""Vocabulary parallelism: the input embedding and the output layer (with its cross entropy) split
evenly over the ranks of one process group -- the pipeline ranks x tensor ranks of a model replica --
as the pieces a pipeline schedule places (Yeung et al., "Balancing Pipeline Parallelism with
Vocabulary Parallelism", MLSys 2025). docs/vocab_parallel.md has the picture and what is tested.

The vocabulary is padded as Megatron-LM pads it (:func:`padded_vocab_size`) and each of the ``n``
ranks of the group holds a slice of its rows, as even as they go (:class:`VocabSlice`; slice ``i`` is
group rank ``i``). Per microbatch, with ``[s, b, h]`` the output layer's input and ``V_i = V/n``:

* **IF** (input forward): :func:`embedding_if` looks up this slice's tokens (others masked to 0),
  then :func:`embedding_reduce` all-reduces (SUM) the partial embeddings. *Exact*: each element has
  exactly one non-zero contributor, and ``x + 0.0 == x`` in floating point, so the sum is the
  unsharded lookup in any summation order (+0.0 for -0.0 at most, which compares equal).
* **IB** (input backward): the embedding's gradient, broadcast from the first stage's rank
  (:func:`broadcast_from`), gives this slice's weight gradient: :func:`embedding_ib` returns it as a
  :class:`WeightGrad` (all of IB is weight-gradient work; the scheduler may defer it like a W).
* **S**: :func:`output_s`, local: logits ``X W_i^T``, their row maximum (and, rescaled, the local
  sum-exp, the local softmax and Vocab-2's partial input gradient).
* **C0**: :func:`output_c0`, the forward barrier over the group: all-reduce MAX of the row maxima,
  then all-reduce SUM of the target logits and the sum-exp (and Vocab-2's input gradient). Gives
  the per-token loss on every rank.
* **T**: :func:`output_t`, local: the softmax gradient (megatron-core's arithmetic), the input
  gradient's part (the B side) and the weight gradient ``dY_i^T X`` as a :class:`WeightGrad` (W).
* **C1**: :func:`output_c1`, the backward barrier (Vocab-1 only): all-reduce SUM of the partial input
  gradients. Vocab-2 (``fuse_input_grad``) computes them in S and reduces them in C0: no C1.

Two arithmetics (``exact`` of :func:`output_s`): ``exact=True`` is megatron-core's vocab-parallel
cross entropy (``VocabParallelCrossEntropy``, reused): the exponentials wait for the global maximum,
so C0 also runs that elementwise pass; bitwise equal to megatron-core on a tensor-parallel group of
the same slices. ``exact=False`` is the paper's: S exponentiates with the local maximum and C0
rescales by ``exp(m_i - m)`` -- a different rounding (tested within a relative tolerance), needed
for Vocab-2. The input ``X``, the per-token loss gradient and the embedding gradient reach the other
ranks by :func:`broadcast_from`; the runtime owns that and the placement of every piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

from megatron_zb.megatron_compat import vocab_parallel_cross_entropy_math
from megatron_zb.model.gpt_chunks import derive_seed
from megatron_zb.planning.model import padded_vocab_size  # noqa: F401 (this module's name for it)

__all__ = ["EmbeddingState", "OutputGrads", "OutputState", "VocabParallelSlices", "VocabSlice", "WeightGrad",
           "broadcast_from", "embedding_if", "embedding_ib", "embedding_reduce", "output_c0", "output_c1",
           "output_s", "output_t", "padded_vocab_size"]


# ---------------------------------------------------------------------- slices and weights
@dataclass(frozen=True, slots=True)
class VocabSlice:
    """Rows ``[start, end)`` of a ``padded_size``-row vocabulary: slice ``index`` of ``num_slices``, the
    rows split as evenly as they go -- ``padded_size // num_slices`` each, one more for the first
    ``padded_size % num_slices`` slices (equal slices when ``num_slices`` divides ``padded_size``)."""

    padded_size: int
    index: int
    num_slices: int

    def __post_init__(self) -> None:
        if self.padded_size < self.num_slices or not 0 <= self.index < self.num_slices:
            raise ValueError(f"VocabSlice: {self.padded_size} rows cannot give each of {self.num_slices} slices a "
                             f"row (or index {self.index} is out of range)")

    @classmethod
    def of_group(cls, padded_size: int, group: Any) -> "VocabSlice":
        """This rank's slice: the group rank's (``dist.get_rank(group)``) of ``group.size()``."""
        return cls(padded_size=padded_size, index=dist.get_rank(group), num_slices=dist.get_world_size(group))

    @property
    def even(self) -> bool:
        """Whether every slice holds the same rows (``num_slices`` divides ``padded_size``)."""
        return self.padded_size % self.num_slices == 0

    @property
    def size(self) -> int:
        """Rows of this slice."""
        return self.padded_size // self.num_slices + (self.index < self.padded_size % self.num_slices)

    @property
    def start(self) -> int:
        """First row of the slice."""
        return self.index * (self.padded_size // self.num_slices) + min(self.index, self.padded_size % self.num_slices)

    @property
    def end(self) -> int:
        """One past the last row of the slice."""
        return self.start + self.size

    def describe(self) -> str:
        """``"2 slices of 192 rows"``, or uneven ``"2 slices of 150 or 149 rows"`` (the start-up line's words)."""
        base = self.padded_size // self.num_slices
        rows = f"{base}" if self.even else f"{base + 1} or {base}"
        return f"{self.num_slices} slices of {rows} rows"


class VocabParallelSlices(torch.nn.Module):
    """This rank's slice of the word embedding and of the output layer (``[V/n, h]`` each; one
    parameter serves both when ``tied``): every rank of ``group`` holds the same number of bytes.

    With ``seed``, each weight is megatron's CPU initialisation of the whole ``[V, h]`` matrix (fp32
    master drawn under ``derive_seed(seed, "word_embeddings")`` / ``"output_layer"``, as
    :func:`~megatron_zb.model.build_gpt_chunks` does, cast to ``params_dtype``), sliced: the same
    values for any ``n`` at a given ``padded_size``. ``output_init_method`` defaults to
    ``init_method``; ``seed=None`` leaves the weights uninitialised. The parameters carry megatron's
    tensor-parallel attributes (``dim=0``: each slice counted once in the grad norm over the
    model-parallel group; not tested yet) and ``is_embedding_or_output_parameter`` (``--decoupled-lr``).
    """

    def __init__(self, *, padded_size: int, hidden_size: int, group: Any, tied: bool, seed: int | None,
                 init_method: Callable[[torch.Tensor], Any],
                 output_init_method: Callable[[torch.Tensor], Any] | None = None,
                 params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.vocab = VocabSlice.of_group(padded_size, group)
        self.group = group
        self.tied = tied

        def weight(key: str, init: Callable[[torch.Tensor], Any]) -> torch.nn.Parameter:
            param = torch.nn.Parameter(torch.empty(self.vocab.size, hidden_size, dtype=params_dtype))
            if seed is not None:
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    torch.manual_seed(derive_seed(seed, key))
                    master = torch.empty(padded_size, hidden_size, dtype=torch.float32)
                    init(master)
                    param.copy_(master.to(params_dtype)[self.vocab.start:self.vocab.end])
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
            param.is_embedding_or_output_parameter = True
            return param

        self.word_embeddings = weight("word_embeddings", init_method)
        self.output_weight = None if tied else weight("output_layer", output_init_method or init_method)

    @property
    def output_layer_weight(self) -> torch.nn.Parameter:
        """The output layer's weight slice (the word embedding's when tied)."""
        return self.word_embeddings if self.output_weight is None else self.output_weight

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict[str, Any]:
        """megatron-core dist-checkpointing view of the slices: each a ``ShardedTensor`` of the whole
        ``[V_pad, h]`` matrix, this rank's rows ``[start, end)`` (dim 0 in ``num_slices`` parts), under
        megatron-core ``GPTModel``'s keys -- ``embedding.word_embeddings.weight`` (tied: the only one) and
        ``output_layer.weight`` -- so a checkpoint holds the matrices a run without vocabulary
        parallelism holds (same padded vocabulary). Replica id: the data-parallel rank (rank 0 writes).
        ``sharded_offsets`` / ``metadata``: megatron-core's signature; must be empty / are unused."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        if sharded_offsets:
            raise ValueError("VocabParallelSlices.sharded_state_dict: sharded_offsets are not supported")
        replica = parallel_state.get_data_parallel_rank(with_context_parallel=True)

        def sharded(key: str, param: torch.nn.Parameter) -> Any:
            if self.vocab.even:  # a regular grid: dim 0 in num_slices parts
                return ShardedTensor.from_rank_offsets(f"{prefix}{key}", param,
                                                       (0, self.vocab.index, self.vocab.num_slices), replica_id=replica)
            # uneven slices: megatron-core's irregular sharding (no grid; torch DCP checks the coverage)
            return ShardedTensor(f"{prefix}{key}", param, param.dtype, tuple(param.shape),
                                 (self.vocab.padded_size, *param.shape[1:]), (self.vocab.start, *[0] * (param.dim() - 1)),
                                 None, replica_id=replica)

        sd = {"word_embeddings": sharded("embedding.word_embeddings.weight", self.word_embeddings)}
        if self.output_weight is not None:
            sd["output_weight"] = sharded("output_layer.weight", self.output_weight)
        return sd


class WeightGrad:
    """One microbatch's weight gradient of a slice, deferred: ``compute()`` returns it; calling the
    object adds it to ``weight.main_grad`` (megatron-core DDP) or ``weight.grad`` and drops what it
    held (a ``store.put(fn, params=(weight,))`` entry of the runtime)."""

    def __init__(self, weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
        self.weight, self._compute = weight, compute

    def compute(self) -> torch.Tensor:
        """The gradient ``[V/n, h]`` (runs the GEMM / scatter-add)."""
        if self._compute is None:
            raise RuntimeError("WeightGrad already ran")
        return self._compute()

    def __call__(self) -> None:
        from megatron_zb.model.grad_accumulation import add_weight_grad

        grad = self.compute()
        self._compute = None
        add_weight_grad(self.weight, grad)


def broadcast_from(tensor: torch.Tensor, src: int, group: Any) -> torch.Tensor:
    """Collective: broadcast ``tensor`` in place from group rank ``src`` (the output layer's input
    and the per-token loss gradient from the last stage's rank, the embedding's gradient from the
    first stage's). Returns ``tensor``."""
    dist.broadcast(tensor, src=dist.get_global_rank(group, src), group=group)
    return tensor


# ---------------------------------------------------------------------- input embedding: IF, IB
@dataclass(slots=True)
class EmbeddingState:
    """What IB needs of one microbatch's IF: slice-local token ids and where they are valid."""

    local_ids: torch.Tensor
    """``[b, s]`` token id - slice start (0 where outside the slice)."""
    in_slice: torch.Tensor
    """``[b, s]`` bool, True where the token's row is in this slice."""


@torch.no_grad()
def embedding_if(tokens: torch.Tensor, weight: torch.Tensor, vocab: VocabSlice) -> tuple[torch.Tensor, EmbeddingState]:
    """IF, local: this slice's rows of the word embedding ``[b, s, h]`` (zeros for other tokens),
    masked exactly as megatron-core's ``VocabParallelEmbedding``."""
    outside = (tokens < vocab.start) | (tokens >= vocab.end)
    local_ids = tokens - vocab.start
    local_ids[outside] = 0
    partial = F.embedding(local_ids, weight)
    partial[outside, :] = 0.0
    return partial, EmbeddingState(local_ids=local_ids, in_slice=~outside)


def embedding_reduce(partial: torch.Tensor, group: Any) -> torch.Tensor:
    """IF's collective: all-reduce SUM of the partial embeddings over ``group`` (in place; exact,
    see the module docstring). Every rank gets the embedding; only the first stage's uses it."""
    dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
    return partial


def embedding_ib(state: EmbeddingState, grad_output: torch.Tensor, weight: torch.Tensor) -> WeightGrad:
    """IB: the slice's word-embedding gradient from the embedding's gradient ``[b, s, h]`` (the same
    on every rank: :func:`broadcast_from` the first stage's), accumulated row by row in token order
    over this slice's tokens only -- the sums megatron-core's embedding backward makes."""

    def compute() -> torch.Tensor:
        grad = torch.zeros_like(weight)
        keep = state.in_slice.reshape(-1)
        grad.index_add_(0, state.local_ids.reshape(-1)[keep], grad_output.reshape(-1, weight.shape[1])[keep])
        return grad

    return WeightGrad(weight, compute)


# ---------------------------------------------------------------------- output layer: S, C0, T, C1
@dataclass(slots=True)
class OutputState:
    """One microbatch of the output layer between its pieces (fp32 statistics, ``[s, b]`` each)."""

    x: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    vocab: VocabSlice
    exact: bool
    fuse_input_grad: bool
    probs: torch.Tensor
    """``[s, b, V/n]`` fp32: the logits after S (exact), else ``exp(Y - m_i) / s_i``; the softmax after C0/T."""
    logits_max: torch.Tensor
    target_mask: torch.Tensor | None = None
    masked_target_1d: torch.Tensor | None = None
    predicted: torch.Tensor | None = None
    sum_exp: torch.Tensor | None = None
    share: torch.Tensor | None = None
    """Rescaled: this slice's share of the softmax mass, ``s_i exp(m_i - m) / s`` (set by C0)."""
    input_grad: torch.Tensor | None = None
    """Vocab-2: ``P_i W_i`` after S, ``(softmax - onehot) W`` summed over the group after C0."""
    target_rows: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    """``[s, b]`` per-token cross entropy (after C0), on every rank."""


@torch.no_grad()
def output_s(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab: VocabSlice, *, exact: bool = True,
             fuse_input_grad: bool = False) -> OutputState:
    """S, local: logits ``x [s, b, h] @ weight^T`` (the GEMM in their dtype, e.g. bf16), cast to fp32 as
    megatron-core's cross entropy casts them, and their row maximum; rescaled
    (``exact=False``) also the local sum-exp, target logit and softmax; Vocab-2 (``fuse_input_grad``,
    rescaled only) also ``softmax_i W_i`` and the target rows ``W_i[target]``. ``target``: ``[s, b]``."""
    if fuse_input_grad and exact:
        raise ValueError("fuse_input_grad (Vocab-2) needs exact=False: the input gradient is formed before the "
                         "global maximum is known, from the locally normalised softmax (the paper's rescaling)")
    vpce = vocab_parallel_cross_entropy_math()
    logits, logits_max = vpce.calculate_logits_max(torch.matmul(x, weight.t()))
    state = OutputState(x=x, weight=weight, target=target, vocab=vocab, exact=exact, fuse_input_grad=fuse_input_grad,
                        probs=logits, logits_max=logits_max)
    if not exact:
        _exponentiate(state)
        state.probs.div_(state.sum_exp.unsqueeze(-1))
        if fuse_input_grad:
            state.input_grad = state.probs.to(weight.dtype).matmul(weight)
            state.target_rows = weight[state.masked_target_1d].view(state.input_grad.shape)
            state.target_rows[state.target_mask] = 0.0
    return state


def _exponentiate(state: OutputState) -> None:
    """megatron-core's ``calculate_predicted_logits``: ``probs <- exp(logits - logits_max)``, the
    sum-exp and the target logit (0 outside this slice)."""
    (state.target_mask, state.masked_target_1d, state.predicted, state.sum_exp,
     state.probs) = vocab_parallel_cross_entropy_math().calculate_predicted_logits(
        state.probs, state.target, state.logits_max, state.vocab.start, state.vocab.end)


@torch.no_grad()
def output_c0(state: OutputState, group: Any) -> torch.Tensor:
    """C0, the forward barrier: all-reduce MAX of the row maxima (exact in any order), then

    * exact: exponentiate with the global maximum, all-reduce SUM the target logits (exact: one
      non-zero contributor) and then the sum-exp -- megatron-core's three all-reduces, in its order;
    * rescaled: shift the local statistics to the global maximum, one all-reduce SUM of
      ``[target logit, s_i exp(m_i - m)]``; Vocab-2 then all-reduce SUM ``share_i P_i W_i - W_i[target]``.

    Returns (and keeps) the per-token loss ``log(sum-exp) - target logit`` ``[s, b]``, on every rank."""
    vpce = vocab_parallel_cross_entropy_math()
    if state.exact:
        dist.all_reduce(state.logits_max, op=dist.ReduceOp.MAX, group=group)
        _exponentiate(state)
        dist.all_reduce(state.predicted, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(state.sum_exp, op=dist.ReduceOp.SUM, group=group)
        state.probs, state.loss = vpce.calculate_cross_entropy_loss(state.probs, state.predicted, state.sum_exp)
        return state.loss
    global_max = state.logits_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    shift = state.logits_max - global_max  # <= 0
    predicted = torch.where(state.target_mask, 0.0, state.predicted + shift)
    local_sum = state.sum_exp * torch.exp(shift)
    sums = torch.stack([predicted, local_sum])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    state.predicted, state.sum_exp = sums[0], sums[1]
    state.share = local_sum / state.sum_exp
    if state.fuse_input_grad:
        state.input_grad.mul_(state.share.unsqueeze(-1).to(state.input_grad.dtype)).sub_(state.target_rows)
        state.target_rows = None
        dist.all_reduce(state.input_grad, op=dist.ReduceOp.SUM, group=group)
    state.loss = torch.log(state.sum_exp) - state.predicted
    return state.loss


class OutputGrads(NamedTuple):
    """What T returns. ``input_grad`` ``[s, b, h]`` is this slice's part (C1 sums it) unless
    ``reduced`` (Vocab-2: already complete); ``weight_grad`` is the deferred W."""

    input_grad: torch.Tensor
    reduced: bool
    weight_grad: WeightGrad


@torch.no_grad()
def output_t(state: OutputState, grad_loss: torch.Tensor) -> OutputGrads:
    """T, local: the logits' gradient ``(softmax - onehot) * grad_loss`` (megatron-core's
    ``prepare_gradient_calculation_operands`` / ``calculate_gradients``, in place on the softmax),
    cast to the weight's dtype; the input gradient (B side: ``dY_i W_i``, or Vocab-2's
    ``grad_loss * input_grad``) and the weight gradient ``dY_i^T X`` as a :class:`WeightGrad` (W).
    ``grad_loss``: ``[s, b]``, d(final loss)/d(per-token loss), the same on every rank."""
    if state.loss is None:
        raise RuntimeError("output_t before output_c0: the softmax needs the reduced statistics")
    vpce = vocab_parallel_cross_entropy_math()
    softmax = state.probs if state.exact else state.probs.mul_(state.share.unsqueeze(-1))
    grad_2d, arange_1d, update, grad_input = vpce.prepare_gradient_calculation_operands(softmax, state.target_mask)
    grad_logits = vpce.calculate_gradients(grad_2d, arange_1d, state.masked_target_1d, update, grad_input, grad_loss)
    dy = grad_logits.to(state.x.dtype)
    x, weight = state.x, state.weight
    if state.fuse_input_grad:
        input_grad, reduced = (state.input_grad * grad_loss.unsqueeze(-1)).to(x.dtype), True
    else:
        input_grad, reduced = dy.matmul(weight), False
    state.probs = state.input_grad = None  # the softmax lives on as dy, until W

    def compute() -> torch.Tensor:
        return dy.reshape(-1, dy.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))

    return OutputGrads(input_grad, reduced, WeightGrad(weight, compute))


def output_c1(input_grad: torch.Tensor, group: Any) -> torch.Tensor:
    """C1, the backward barrier (Vocab-1): all-reduce SUM of the slices' input gradients ``[s, b, h]``
    (in place), as megatron-core's column-parallel linear reduces its input gradient. Only the last
    stage's rank uses the result."""
    dist.all_reduce(input_grad, op=dist.ReduceOp.SUM, group=group)
    return input_grad
