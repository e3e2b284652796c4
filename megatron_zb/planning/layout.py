"""Which transformer layers each pipeline stage holds, for every placement (no torch needed).

A placement has ``p * v`` stages (``v = 1`` plain, ``v`` chunks interleaved, ``v = 2`` for the V);
the layers are split over the stages in stage order by :func:`layers_per_stage` -- the rule
``pretrain_gpt_zb.py`` uses (its ``check_layers``; ``megatron_zb.model.gpt_chunks`` imports both
splits from here): with one of Megatron's uneven-split flags :func:`pipeline_split` (on a V any
layer count splits, the first and last stage taking what the flags say), otherwise
:func:`split_layers` (even, or with ``--allow-padding-num-layers`` fewer on the first/last
stage). A plan therefore describes the model the trainer would build. Stage 0 also holds the embedding, the last stage the
final norm, the output layer and the loss. Which rank runs a stage comes from the schedule
library's placement (:class:`megatron_zb.schedules.Placement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from megatron_zb.schedules import Placement

__all__ = ["LayerSplit", "StageShape", "layers_per_stage", "pipeline_split", "split_layers", "stage_shapes"]


def split_layers(num_layers: int, num_stages: int, *, allow_padding: bool = False) -> list[int]:
    """Transformer layers per stage: even, or (``allow_padding``) fewer on the first/last stage.

    With ``allow_padding`` every middle stage gets ``ceil(num_layers / num_stages)`` layers and
    the first and last stages share the rest, the last (which also carries the output layer and
    the loss) taking the smaller half, e.g. ``split_layers(10, 4, allow_padding=True) == [2, 3, 3, 2]``,
    ``split_layers(7, 2, allow_padding=True) == [4, 3]``.

    Raises:
        ValueError: ``num_layers`` is not divisible by ``num_stages`` and ``allow_padding`` is
            False, or even with padding the first or last stage would get no layer.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages: every stage needs a layer")
    per, rem = divmod(num_layers, num_stages)
    if rem == 0:
        return [per] * num_stages
    if not allow_padding:
        raise ValueError(f"{num_layers} layers do not divide evenly over {num_stages} stages; "
                         f"pass allow_padding=True to give the first/last stages fewer layers")
    per += 1
    deficit = per * num_stages - num_layers
    first, last = per - deficit // 2, per - (deficit - deficit // 2)
    if num_stages == 1 or first < 1 or last < 1:
        left = num_layers - per * (num_stages - 2)
        raise ValueError(f"cannot split {num_layers} layers over {num_stages} stages with padding only on the "
                         f"first/last stage: the middle stages take {per} each, leaving {left} "
                         f"for the first and last stage (each needs at least one)")
    return [first] + [per] * (num_stages - 2) + [last]


def pipeline_split(*, num_layers: int, stage_to_rank: Sequence[int], first_stage_layers: int | None = None,
                   last_stage_layers: int | None = None, account_for_embedding: bool = False,
                   account_for_loss: bool = False) -> list[int]:
    """Transformer layers per stage for Megatron's uneven-split flags, stage order.

    * ``first_stage_layers`` / ``last_stage_layers`` (``--decoder-first/last-pipeline-num-layers``):
      plain and interleaved placements follow megatron-core (``get_num_layers_to_build``): the
      count is that of the first (last) *pipeline rank*, split evenly over its model chunks; the
      other ranks share the remaining layers evenly. In a placement whose first and last stage
      sit on the same rank (V) the counts are those of the first (embedding) and last (loss)
      *stage*, and the other stages share the rest evenly -- so any layer count has a split
      (e.g. 7 layers over the 4 stages of a PP=2 V: ``first_stage_layers=1`` gives ``[1, 2, 2, 2]``).
    * ``account_for_embedding`` / ``account_for_loss``: the embedding (loss) counts as one layer of
      the first (last) stage; ``num_layers + embedding + loss`` must divide evenly over the stages
      (as megatron-core's virtual stages), and the first (last) stage builds one layer fewer.

    Raises:
        ValueError: the counts do not add up (the message says which and how).
    """
    s2r = [int(r) for r in stage_to_rank]
    num_stages = len(s2r)
    uneven = first_stage_layers is not None or last_stage_layers is not None
    if uneven and (account_for_embedding or account_for_loss):
        raise ValueError("the first/last stage layer counts cannot be combined with accounting for the "
                         "embedding or loss in the split (megatron-core does not support it either)")
    if not uneven:
        total = num_layers + int(account_for_embedding) + int(account_for_loss)
        if total % num_stages:
            raise ValueError(f"{num_layers} layers + {total - num_layers} (embedding/loss) = {total} do not divide "
                             f"evenly over {num_stages} pipeline stages")
        counts = [total // num_stages] * num_stages
        counts[0] -= int(account_for_embedding)
        counts[-1] -= int(account_for_loss)
        if min(counts) < 0:
            raise ValueError(f"{total // num_stages} layer(s) per stage leave none for the embedding or loss")
        return counts
    if num_stages > 1 and s2r[0] == s2r[-1]:  # V-like: the counts are per stage
        units = [[s] for s in range(num_stages)]
    else:  # megatron-core: per pipeline rank, split evenly over the rank's chunks
        units = [[s for s in range(num_stages) if s2r[s] == r] for r in sorted(set(s2r))]
    fixed = {0: first_stage_layers, len(units) - 1: last_stage_layers}
    fixed = {u: n for u, n in fixed.items() if n is not None}
    if any(n < 0 for n in fixed.values()):
        raise ValueError(f"layer counts must be >= 0, got {sorted(fixed.values())}")
    rest = num_layers - sum(fixed.values())
    middle = [u for u in range(len(units)) if u not in fixed]
    what = "stage" if len(units) == num_stages else "pipeline rank"
    if rest < 0 or (not middle and rest) or (middle and rest % len(middle)):
        raise ValueError(f"{num_layers} layers minus the first/last {what}'s {sum(fixed.values())} leave {rest}, "
                         f"which do not divide evenly over the other {len(middle)} {what}(s)")
    per_unit = [fixed.get(u, rest // len(middle) if middle else 0) for u in range(len(units))]
    counts = [0] * num_stages
    for unit, n in zip(units, per_unit):
        if n % len(unit):
            raise ValueError(f"{n} layers of a pipeline rank do not divide evenly over its {len(unit)} model chunks")
        for s in unit:
            counts[s] = n // len(unit)
    return counts


@dataclass(frozen=True)
class LayerSplit:
    """The flags that decide how many layers each stage holds (Megatron's names in brackets).

    Attributes:
        allow_padding: ``--allow-padding-num-layers`` (even split otherwise).
        first_stage_layers: ``--decoder-first-pipeline-num-layers``.
        last_stage_layers: ``--decoder-last-pipeline-num-layers``.
        account_for_embedding: ``--account-for-embedding-in-pipeline-split``.
        account_for_loss: ``--account-for-loss-in-pipeline-split``.
    """

    allow_padding: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False

    @property
    def uneven(self) -> bool:
        """Whether an uneven-split flag is set (then :func:`pipeline_split` decides)."""
        return (self.first_stage_layers is not None or self.last_stage_layers is not None
                or self.account_for_embedding or self.account_for_loss)

    @property
    def flag(self) -> str:
        """The first uneven-split flag set (for error messages), else ``--num-layers``."""
        for value, flag in ((self.first_stage_layers is not None, "--decoder-first-pipeline-num-layers"),
                            (self.last_stage_layers is not None, "--decoder-last-pipeline-num-layers"),
                            (self.account_for_embedding, "--account-for-embedding-in-pipeline-split"),
                            (self.account_for_loss, "--account-for-loss-in-pipeline-split")):
            if value:
                return flag
        return "--num-layers"


def layers_per_stage(num_layers: int, stage_to_rank: Sequence[int], split: LayerSplit = LayerSplit()) -> list[int]:
    """Transformer layers per stage (stage order) as ``pretrain_gpt_zb.py`` builds them: the one rule.

    Raises:
        ValueError: the layers do not split (the message of :func:`pipeline_split` or
            :func:`split_layers`).
    """
    if split.uneven:
        return pipeline_split(num_layers=num_layers, stage_to_rank=stage_to_rank,
                              first_stage_layers=split.first_stage_layers, last_stage_layers=split.last_stage_layers,
                              account_for_embedding=split.account_for_embedding, account_for_loss=split.account_for_loss)
    return split_layers(num_layers, len(stage_to_rank), allow_padding=split.allow_padding)


@dataclass(frozen=True)
class StageShape:
    """What one pipeline stage holds.

    Attributes:
        stage: stage index (0 = embedding side).
        rank: pipeline rank running the stage.
        num_layers: transformer layers in the stage.
        embedding: whether the stage holds the input embedding (stage 0).
        loss: whether the stage holds the final norm, output layer and loss (last stage).
    """

    stage: int
    rank: int
    num_layers: int
    embedding: bool
    loss: bool


def stage_shapes(*, num_layers: int, pp: int, placement: Placement | str, chunks: int = 1,
                 split: LayerSplit = LayerSplit()) -> list[StageShape]:
    """Per-stage contents for ``placement`` on ``pp`` ranks (``chunks`` per rank if interleaved).

    Raises:
        ValueError: the layers cannot be split over the placement's stages (message from
            :func:`layers_per_stage`).
    """
    ranks = Placement(placement).stage_to_rank(pp, chunks)
    layers = layers_per_stage(num_layers, ranks, split)
    last = len(ranks) - 1
    return [StageShape(stage=s, rank=r, num_layers=n, embedding=s == 0, loss=s == last)
            for s, (r, n) in enumerate(zip(ranks, layers))]
