"""Which transformer layers each pipeline stage holds, for every placement (no torch needed).

A placement has ``p * v`` stages (``v = 1`` plain, ``v`` chunks interleaved, ``v = 2`` for the V);
the layers are split over the stages in stage order by :func:`split_layers` -- the rule
``pretrain_gpt_zb.py`` uses (``megatron_zb.model.gpt_chunks`` imports it from here), so a plan
describes the model the trainer would build. Stage 0 also holds the embedding, the last stage the
final norm, the output layer and the loss. Which rank runs a stage comes from the schedule
library's placement (:class:`megatron_zb.schedules.Placement`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_zb.schedules import Placement, interleaved_placement, plain_placement, v_placement


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


def stage_to_rank(placement: Placement | str, pp: int, chunks: int) -> list[int]:
    """The schedule library's ``stage_to_rank`` for ``placement`` (``chunks`` only for interleaved)."""
    placement = Placement(placement)
    if placement == Placement.PLAIN:
        return plain_placement(pp)
    if placement == Placement.INTERLEAVED:
        return interleaved_placement(pp, chunks)
    return v_placement(pp)


def stage_shapes(*, num_layers: int, pp: int, placement: Placement | str, chunks: int = 1,
                 allow_padding: bool = False) -> list[StageShape]:
    """Per-stage contents for ``placement`` on ``pp`` ranks (``chunks`` per rank if interleaved).

    Raises:
        ValueError: the layers cannot be split over the placement's stages (message from
            :func:`split_layers`).
    """
    ranks = stage_to_rank(placement, pp, chunks)
    layers = split_layers(num_layers, len(ranks), allow_padding=allow_padding)
    last = len(ranks) - 1
    return [StageShape(stage=s, rank=r, num_layers=n, embedding=s == 0, loss=s == last)
            for s, (r, n) in enumerate(zip(ranks, layers))]
