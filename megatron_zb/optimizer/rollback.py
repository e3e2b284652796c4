"""Undoing one optimizer step: exact snapshots and the in-place inversion of Adam / AdamW.

Two ways to take back an update that a post-validated step applied too early
(:mod:`megatron_zb.optimizer.post_validation`):

* :class:`ExactSnapshot` -- copy every parameter the inner ``torch.optim`` optimizer is about to
  update, and its state (``exp_avg``, ``exp_avg_sq``, ``step``, ...), *before* the step; restore
  them bit for bit. Works for any optimizer whose state is tensors and plain values. Costs one
  copy of the optimizer's parameters plus one copy of its state per step (see
  :func:`snapshot_nbytes`).
* :func:`invert_adam_step_` -- recompute the pre-step parameter and moments from the post-step
  values, the gradient that was used and the step's hyper-parameters. Stores nothing besides
  a flag per parameter (did it have optimizer state before the step?); exact up to fp32
  round-off (see the function's docstring for the error bound).

Both act on a ``torch.optim.Optimizer`` (the *inner* optimizer of a megatron-core
``MegatronOptimizer``: its params are the fp32 main params / main-param shards).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = [
    "ExactSnapshot",
    "InPlaceRecord",
    "check_adam_invertible",
    "group_hyperparams",
    "invert_adam_step_",
    "snapshot_nbytes",
    "stepped_params",
]


def group_hyperparams(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyper-parameters of each param group (every key but ``params``), as plain dict copies."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def stepped_params(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Per param group, the params ``optimizer.step()`` will update now (those with a ``.grad``)."""
    return [[p for p in g["params"] if p.grad is not None] for g in optimizer.param_groups]


# ---------------------------------------------------------------------- exact snapshots
def _clone_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in state.items()}


@dataclass
class ExactSnapshot:
    """Bitwise copy of what one ``optimizer.step()`` may change: the updated params and their state.

    Take it with :meth:`capture` right before the step; :meth:`restore` writes the copies back
    into the *same* tensors (params are restored with ``copy_``, so views -- e.g. the
    distributed optimizer's fp32 shards of a model param -- are restored through the view;
    state tensors are ``copy_``-ed in place), and removes state that the step created for a
    param that had none (torch's Adam initialises its state lazily at the first step).
    """

    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    param_copies: list[torch.Tensor]
    state_copies: list[dict[str, Any] | None]

    @classmethod
    def capture(cls, optimizer: torch.optim.Optimizer) -> "ExactSnapshot":
        """Copy the params that have a grad (the ones the step updates) and their optimizer state."""
        params = [p for group in stepped_params(optimizer) for p in group]
        param_copies = [p.detach().clone() for p in params]
        state_copies = [(_clone_state(optimizer.state[p]) if len(optimizer.state.get(p, {})) else None)
                        for p in params]
        return cls(optimizer, params, param_copies, state_copies)

    @torch.no_grad()
    def restore(self) -> None:
        """Put every captured param and its state back exactly as they were at :meth:`capture`."""
        opt_state = self.optimizer.state
        for p, saved_p, saved in zip(self.params, self.param_copies, self.state_copies):
            p.copy_(saved_p)
            if saved is None:
                opt_state.pop(p, None)
                continue
            cur = opt_state[p]
            for k in [k for k in cur if k not in saved]:
                del cur[k]
            for k, v in saved.items():
                old = cur.get(k)
                if torch.is_tensor(v) and torch.is_tensor(old) and old.shape == v.shape and old.dtype == v.dtype:
                    old.copy_(v)
                else:
                    cur[k] = v.clone() if torch.is_tensor(v) else copy.deepcopy(v)

    @property
    def nbytes(self) -> int:
        """Bytes held by the copies (params + state tensors)."""
        n = sum(t.numel() * t.element_size() for t in self.param_copies)
        for saved in self.state_copies:
            if saved:
                n += sum(v.numel() * v.element_size() for v in saved.values() if torch.is_tensor(v))
        return n


def snapshot_nbytes(optimizer: torch.optim.Optimizer, *, all_params: bool = False) -> int:
    """What :meth:`ExactSnapshot.capture` would hold now, without copying (for logs and docs).

    ``all_params``: count every param of the optimizer, not only those with a ``.grad`` now.
    """
    n = 0
    groups = [g["params"] for g in optimizer.param_groups] if all_params else stepped_params(optimizer)
    for group in groups:
        for p in group:
            n += p.numel() * p.element_size()
            n += sum(v.numel() * v.element_size() for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v))
    return n


# ---------------------------------------------------------------------- in-place Adam inversion
def check_adam_invertible(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``NotImplementedError`` unless :func:`invert_adam_step_` can undo ``optimizer``'s step.

    Supported: ``torch.optim.Adam`` and ``torch.optim.AdamW`` (what megatron-core builds when
    neither Transformer Engine nor apex is installed), without ``amsgrad`` (its running max
    forgets the previous value), ``capturable`` or ``differentiable``. apex / TE ``FusedAdam``
    use the same update rule but are not recognised here (never run on this project's CPU
    machines): use exact mode with them.
    """
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise NotImplementedError(
            f"in-place rollback inverts torch.optim.Adam / AdamW steps only, not {type(optimizer).__module__}."
            f"{type(optimizer).__qualname__}; use exact mode (PostValidationOptimizer(..., exact=True))")
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "capturable", "differentiable"):
            if group.get(flag, False):
                raise NotImplementedError(f"in-place rollback of Adam with {flag}=True is not supported; use exact mode")


@dataclass
class InPlaceRecord:
    """What in-place rollback keeps per step: the params stepped and whether each had state.

    ``had_state[i]`` is False when ``params[i]`` had no optimizer state before the step; its
    rollback then removes the state again (as if the step never happened), which is exact.
    """

    optimizer: torch.optim.Optimizer
    params: list[list[torch.Tensor]]  # per param group
    had_state: list[list[bool]]

    @classmethod
    def capture(cls, optimizer: torch.optim.Optimizer) -> "InPlaceRecord":
        params = stepped_params(optimizer)
        had = [[len(optimizer.state.get(p, {})) > 0 for p in group] for group in params]
        return cls(optimizer, params, had)

    @torch.no_grad()
    def invert(self, hyperparams: list[Mapping[str, Any]]) -> None:
        """Undo the step taken right after :meth:`capture`, with that step's ``hyperparams``.

        Each param's ``.grad`` must still hold the gradient the step used.
        """
        for group_params, group_had, hp in zip(self.params, self.had_state, hyperparams):
            for p, had in zip(group_params, group_had):
                if p.grad is None:
                    raise RuntimeError("in-place rollback needs the gradient the step used, but a param's .grad is None "
                                       "(was zero_grad() called before validation?)")
                invert_adam_step_(p, p.grad, self.optimizer.state[p], hp, had_state=had)


def _scalar(x: Any) -> float:
    return float(x.item()) if torch.is_tensor(x) else float(x)


@torch.no_grad()
def invert_adam_step_(param: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], hyperparams: Mapping[str, Any],
                      *, had_state: bool = True) -> None:
    """Undo one ``torch.optim.Adam`` / ``AdamW`` step of ``param`` in place.

    torch's (non-fused, non-amsgrad) step with gradient ``g`` (``-g`` with ``maximize``), step
    count ``t`` (after the increment), ``lr``, ``(b1, b2)``, ``eps`` and weight decay ``wd``::

        AdamW:  p <- p * (1 - lr*wd)               Adam:  g <- g + wd * p
        m <- m + (1-b1) (g - m)                    (torch: exp_avg.lerp_(g, 1-b1))
        v <- b2 v + (1-b2) g^2
        p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)

    is inverted from the post-step ``p, m, v``, the same ``g`` and hyper-parameters:

        p <- p + lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)   (the same denominator, recomputed
                                                                      from the same v: bit-identical)
        AdamW:  p <- p / (1 - lr*wd)               Adam:  g <- g + wd * p   (the restored p)
        m <- (m - (1-b1) g) / b1
        v <- max((v - (1-b2) g^2) / b2, 0)
        t <- t - 1

    If the param had no state before the step (``had_state=False``) the state is removed;
    if ``t`` was 1 (the moments were exactly zero), they are set to zero exactly. Otherwise the
    results carry the forward step's fp32 round-off, which cannot be undone: ``p`` is usually
    recovered exactly (the same fp32 ops with the opposite sign), else within 1-2 ulp; ``m``
    and ``v`` are computed in float64 from the post-step values, so their error is the forward
    update's rounding of the post-step value, half an ulp of ``|m| / b1`` and ``|v| / b2``
    (relative to the previous moment it grows when the step's gradient dominated the moment,
    where the subtraction cancels). Transient float64 copies of one param at a time are made.

    Args:
        param: the param the optimizer updated (fp32 main param).
        grad: the gradient that step used (before any clipping that a redo will apply).
        state: ``optimizer.state[param]`` (``step``, ``exp_avg``, ``exp_avg_sq``).
        hyperparams: the param group's values *at the step* (``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``maximize``, ``decoupled_weight_decay``).
        had_state: whether the param had optimizer state before the step.
    """
    if hyperparams.get("amsgrad", False):
        raise NotImplementedError("amsgrad steps cannot be inverted (the running max forgets its previous value)")
    step_t = state["step"]
    t = _scalar(step_t)
    if t < 1:
        raise RuntimeError(f"cannot invert an Adam step: the state's step count is {t}")
    m, v = state["exp_avg"], state["exp_avg_sq"]
    lr = _scalar(hyperparams["lr"])
    b1, b2 = (_scalar(b) for b in hyperparams["betas"])
    eps = float(hyperparams["eps"])
    wd = float(hyperparams.get("weight_decay", 0.0))
    decoupled = bool(hyperparams.get("decoupled_weight_decay", False))

    # Parameter: the same denominator torch used (same ops on the same v), the opposite sign.
    bias_correction1 = 1 - b1 ** t
    bias_correction2 = 1 - b2 ** t
    step_size = lr / bias_correction1
    denom = (v.sqrt() / (bias_correction2 ** 0.5)).add_(eps)
    param.addcdiv_(m, denom, value=step_size)
    if wd != 0 and decoupled:
        param.div_(1 - lr * wd)

    if not had_state:
        state.clear()
        return
    if t == 1:
        m.zero_()
        v.zero_()
    else:
        # In float64: the subtraction cancels when the step's gradient dominated the moment, so
        # no fp32 rounding is added to the one the forward update already made.
        g = grad.double()
        if hyperparams.get("maximize", False):
            g = g.neg_()
        if wd != 0 and not decoupled:
            g = g.add_(param.double(), alpha=wd)
        m.copy_(m.double().sub_(g, alpha=1 - b1).div_(b1))
        v.copy_(v.double().sub_(g.square_(), alpha=1 - b2).div_(b2).clamp_(min=0))
    if torch.is_tensor(step_t):
        step_t.sub_(1)
    else:
        state["step"] = step_t - 1

