"""The compatibility matrix runner: launch, compare, classify every cell (used by the script and the tests).

A cell is (schedule family, feature). :func:`run_matrix` launches one
:func:`~megatron_zb.testing.run_distributed` per (feature, placement group) running the
reference and every selected family of that placement in the same processes
(:func:`megatron_zb.testing.compat_rank.run_arms`; the V placement's reference, the unpipelined
model, needs its own launch at PP=1; with ``together=True`` one launch runs every feature of the
same world size in turn), then compares each family's results with the reference's
(:func:`compare`). A cell's status is exactly one of

* ``equal (bitwise)`` -- every loss, gradient copy, parameter and step result identical;
* ``equal (<= rtol, reason)`` -- within the feature's :class:`~.compat_features.Tolerance` for
  that placement (relative to the largest magnitude of each reference tensor); ``equal (<= rtol;
  after a step <= after_step, reason)`` where the tolerance is looser for what follows an optimizer
  step (later gradients, the parameters) than for the loss curve and the first gradients;
* ``refused: message`` -- set-up raised a clear error on every rank before anything ran;
* ``FAILED: ...`` -- anything else (a difference beyond the tolerance, an error while running,
  or a vacuous run: no W deferred by a split-backward schedule, no rollback under
  post-validation, no overflow under fp16, another number of deferred W computations than the
  feature's :attr:`~.compat_features.Feature.same_w_as` column for the same family, plus its
  :attr:`~.compat_features.Feature.w_offset` per microbatch).

A feature with ``same_w_as`` brings that feature's launches along (:func:`plan_launches`), so
the count is always checked; the extra column is not reported unless selected.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable

import torch

from ..schedules.ir import Placement
from .compat_features import FAMILIES, Feature, ModelShape, Tolerance
from .compat_rank import FP16_INITIAL_SCALE, REFERENCE, ArmResult, GroupSpec, run_specs

__all__ = ["Cell", "Launch", "classify", "compare", "merge_ranks", "plan_launches", "run_launches", "run_matrix"]


@dataclass(frozen=True)
class Cell:
    """The outcome of one (family, feature) cell.

    Attributes:
        family, feature: the cell's row and column.
        kind: ``"bitwise"``, ``"tolerance"``, ``"refused"`` or ``"failed"``.
        status: the full status text (see the module docstring).
        max_rel: the largest relative difference seen (0.0 when bitwise; None if not compared); with a
            tolerance's ``after_step``, the largest among the losses and the first iteration's gradients.
        tolerance: the accepted tolerance (kind ``"tolerance"`` only).
        max_rel_after_step: with a tolerance's ``after_step``: the largest relative difference among the
            later gradients and the parameters (else None).
    """

    family: str
    feature: str
    kind: str
    status: str
    max_rel: float | None = None
    tolerance: Tolerance | None = None
    max_rel_after_step: float | None = None

    @property
    def ok(self) -> bool:
        return self.kind != "failed"


@dataclass(frozen=True)
class Launch:
    """One ``run_distributed`` call: each of ``specs`` in turn, in the same ``world_size`` processes."""

    specs: tuple[GroupSpec, ...]
    world_size: int

    @property
    def label(self) -> str:
        first = self.specs[0]
        names = "+".join(s.feature.name for s in self.specs)
        arms = ",".join(dict.fromkeys(a for s in self.specs for a in s.arms))
        return f"{names} / {first.placement} (PP={first.pp}, {self.world_size} ranks: {arms})"


def plan_launches(features: Iterable[Feature], families: Iterable[str], model: ModelShape, *,
                  together: bool = False) -> list[Launch]:
    """The launches that cover ``features`` x ``families`` (each placement group with its reference),
    and those of every ``same_w_as`` feature not among ``features`` (after them).

    ``together``: features of equal world size share one launch per placement group (fewer
    process start-ups: the test suite's budget); an error in one of them then fails all of that
    launch's cells. Default: one launch per feature and placement group.
    """
    from .compat_features import feature as feature_named

    wanted = set(families)
    features = list(features)
    names = {f.name for f in features}
    features += [feature_named(n) for n in dict.fromkeys(f.same_w_as for f in features if f.same_w_as)
                 if n not in names]
    single: list[Launch] = []
    for f in features:
        for placement, fams in FAMILIES.items():
            arms = tuple(n for n in fams if n in wanted)
            if not arms:
                continue
            if placement == Placement.V:  # the reference is the unpipelined model: PP=1, same TP and DP
                single.append(Launch((GroupSpec(f, model, placement, (REFERENCE,), 1),), f.world_size(1)))
                single.append(Launch((GroupSpec(f, model, placement, arms, model.pp),), f.world_size(model.pp)))
            else:
                single.append(Launch((GroupSpec(f, model, placement, (REFERENCE, *arms), model.pp),),
                                     f.world_size(model.pp)))
    if not together:
        return single
    groups: dict[tuple, list[GroupSpec]] = {}
    for launch in single:
        [spec] = launch.specs
        groups.setdefault((spec.placement, spec.pp, launch.world_size), []).append(spec)
    return [Launch(tuple(specs), world_size) for (_, _, world_size), specs in groups.items()]


def merge_ranks(per_rank: list[dict[str, ArmResult]], arm: str) -> dict[str, Any]:
    """One arm's results of every rank, in one dict (keys carry the TP/DP rank: nothing overwrites)."""
    results = [r[arm] for r in per_rank]
    merged: dict[str, Any] = {"refused": results[0].refused, "losses": {}, "grads": {}, "params": {},
                              "steps": [r.steps for r in results], "order": [r.order for r in results],
                              "w_deferred": sum(r.w_deferred for r in results),
                              "rollbacks": sum(r.rollbacks for r in results)}
    for r in results:
        for key in ("losses", "grads", "params"):
            dup = merged[key].keys() & getattr(r, key).keys()
            if dup:
                raise RuntimeError(f"{arm}: two ranks returned {key} {sorted(dup)[:3]}")
            merged[key].update(getattr(r, key))
    return merged


def _rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max|got - ref| / max|ref|`` in float64 (the absolute difference when ref is all zero)."""
    diff = (got.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff


def _vacuous(family: str, feature: Feature, got: dict[str, Any], ref: dict[str, Any],
             w_baseline: int | None) -> str | None:
    """Why a cell proves nothing (a check that the feature's mechanism actually ran), or None."""
    from ..schedules.registry import get_spec

    if get_spec(family).split_backward and got["w_deferred"] == 0:
        return "the split-backward schedule deferred no weight gradient"
    if feature.same_w_as and got["w_deferred"] != w_baseline:
        return (f"{got['w_deferred']} deferred weight-gradient computations, {w_baseline} in the same family's "
                f"{feature.same_w_as!r} cell")
    if feature.post_validation and got["rollbacks"] == 0:
        return "post-validation never rolled back (the forced clip did not happen)"
    if feature.precision == "fp16":
        steps, prev, halved = ref["steps"][0], FP16_INITIAL_SCALE, False
        for ok, scale in steps:
            halved |= not ok and scale == prev / 2
            prev = scale
        if not halved:
            return f"fp16: no skipped step with a halved loss scale in the reference ({steps})"
    return None


_AFTER_STEP = ("grads after a step", "params")
"""The comparison's categories that follow an optimizer step (:attr:`~.compat_features.Tolerance.after_step`)."""


def compare(family: str, feature: Feature, placement: Placement, ref: dict[str, Any], got: dict[str, Any], *,
            w_baseline: int | None = None) -> Cell:
    """Classify one cell from the merged results of the reference and the family (module docstring);
    ``w_baseline``: the ``w_deferred`` of the same family's ``feature.same_w_as`` cell."""
    def cell(kind: str, status: str, max_rel: float | None = None, tol: Tolerance | None = None,
             after: float | None = None) -> Cell:
        return Cell(family, feature.name, kind, status, max_rel, tol, after)

    if got["refused"]:
        return cell("refused", f"refused: {got['refused']}")
    if ref["refused"]:
        return cell("failed", f"FAILED: the reference was refused: {ref['refused']}")
    steps = {tuple(s) for s in got["steps"]} | {tuple(s) for s in ref["steps"]}
    if len(steps) != 1:
        return cell("failed", f"FAILED: step results (update_successful, loss scale) differ: {sorted(steps)}")
    worst: dict[str, tuple[float, str]] = {}  # category -> (largest relative difference, where)
    for key in ("losses", "grads", "params"):
        if got[key].keys() != ref[key].keys():
            extra = sorted(got[key].keys() ^ ref[key].keys(), key=str)[:3]
            return cell("failed", f"FAILED: {key} differ in their keys, e.g. {extra}")
        for k, r in ref[key].items():
            a = torch.stack(got[key][k]) if key == "losses" else got[key][k]
            b = torch.stack(r) if key == "losses" else r
            if a.shape != b.shape or a.dtype != b.dtype:
                return cell("failed", f"FAILED: {key} {k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            if not torch.equal(a, b):
                rel = _rel_diff(a, b)
                category = "grads after a step" if key == "grads" and k[0] > 0 else key
                if rel >= worst.get(category, (0.0, ""))[0]:
                    worst[category] = (rel, f"{k}")
    why = _vacuous(family, feature, got, ref, w_baseline)
    if why:
        return cell("failed", f"FAILED: vacuous: {why}")
    if not worst:
        return cell("bitwise", "equal (bitwise)", 0.0)
    largest = max(rel for rel, _ in worst.values())
    tol = feature.tolerance.get(placement)
    if tol is not None and tol.after_step is not None:
        late = max((rel for c, (rel, _) in worst.items() if c in _AFTER_STEP), default=0.0)
        early = max((rel for c, (rel, _) in worst.items() if c not in _AFTER_STEP), default=0.0)
        if early <= tol.rtol and late <= tol.after_step:
            return cell("tolerance", f"equal (<= {tol.rtol:g}; after a step <= {tol.after_step:g}, {tol.reason})",
                        early, tol, late)
    elif tol is not None and largest <= tol.rtol:
        return cell("tolerance", f"equal (<= {tol.rtol:g}, {tol.reason})", largest, tol)
    allowed = "bitwise required" if tol is None else f"tolerance {tol.rtol:g}" + (
        f", after a step {tol.after_step:g}" if tol.after_step is not None else "")
    where = "; ".join(f"{key} {rel:.3g} at {at}" for key, (rel, at) in worst.items())
    return cell("failed", f"FAILED: max relative difference ({allowed}): {where}", largest, tol)


def _run_launch(launch: Launch, timeout: float) -> list[list[dict[str, ArmResult]]]:
    """Per rank, per spec of ``launch``: the arms' results (``timeout`` seconds per spec)."""
    from .distributed import run_distributed

    return run_distributed(partial(run_specs, launch.specs), world_size=launch.world_size,
                           timeout=timeout * len(launch.specs))


def run_launches(launches: list[Launch], *, timeout: float = 300.0, progress: Callable[[str], None] | None = None
                 ) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[tuple[str, str], str]]:
    """Run ``launches``; return ``(results, errors)`` keyed by ``(feature, arm)`` where the
    reference arm is ``"ref:<placement>"`` (merged results; the error text of a failed launch).

    ``progress`` gets one line per launch (index, label, elapsed and estimated remaining seconds).
    """
    results: dict[tuple[str, str], dict[str, Any]] = {}
    errors: dict[tuple[str, str], str] = {}
    t0 = time.monotonic()
    for i, launch in enumerate(launches):
        keys = [{arm: (spec.feature.name, f"ref:{spec.placement}" if arm == REFERENCE else arm) for arm in spec.arms}
                for spec in launch.specs]
        try:
            per_rank = _run_launch(launch, timeout)
            for j, spec_keys in enumerate(keys):
                for arm, key in spec_keys.items():
                    results[key] = merge_ranks([r[j] for r in per_rank], arm)
        except Exception as e:  # noqa: BLE001 -- reported in every cell of the launch
            first = next((ln for ln in str(e).splitlines() if ln.strip()), "")
            for spec_keys in keys:
                for key in spec_keys.values():
                    errors[key] = f"{type(e).__name__}: {first}"
        if progress is not None:
            elapsed = time.monotonic() - t0
            eta = elapsed / (i + 1) * (len(launches) - i - 1)
            progress(f"[{i + 1}/{len(launches)}] {launch.label}: {elapsed:.0f} s elapsed, ~{eta:.0f} s left")
    return results, errors


def classify(features: list[Feature], families: list[str], results: dict[tuple[str, str], dict[str, Any]],
             errors: dict[tuple[str, str], str], model: ModelShape = ModelShape()) -> list[Cell]:
    """The cells of ``features`` x ``families`` from :func:`run_launches`' output, in table order
    (``model``: the launches' shape, for a feature's :attr:`~.compat_features.Feature.w_offset`)."""
    cells = []
    for f in features:
        for placement, names in FAMILIES.items():
            for family in (n for n in names if n in families):
                refkey, famkey = (f.name, f"ref:{placement}"), (f.name, family)
                basekey = (f.same_w_as, family) if f.same_w_as else None
                err = errors.get(famkey) or errors.get(refkey) or (basekey and errors.get(basekey))
                if err:
                    cells.append(Cell(family, f.name, "failed", f"FAILED: error while running: {err}"))
                else:
                    base = results[basekey]["w_deferred"] if basekey else None
                    if base and f.w_offset:  # per microbatch of every iteration and TP x DP replica
                        base += f.w_offset * f.iterations * model.num_microbatches * f.tp * f.dp
                    cells.append(compare(family, f, placement, results[refkey], results[famkey], w_baseline=base))
    return cells


def run_matrix(*, features: list[Feature], families: list[str], model: ModelShape = ModelShape(),
               timeout: float = 300.0, together: bool = False,
               progress: Callable[[str], None] | None = None) -> list[Cell]:
    """Run and classify every cell of ``features`` x ``families`` (see the module docstring;
    ``together``: see :func:`plan_launches`).

    A launch that raises makes each of its cells ``FAILED`` with the error; the others still run.
    """
    launches = plan_launches(features, families, model, together=together)
    results, errors = run_launches(launches, timeout=timeout, progress=progress)
    return classify(features, families, results, errors, model)
