"""The ``__main__`` of each rank that :func:`harness.megatron_lm.run_megatron_lm` starts.

Run as a script (``python .../megatron_lm_main.py <pretrain_gpt.py arguments>``): it applies the CPU
workarounds, installs the recorders, runs the plugin step, then executes Megatron-LM's unmodified
``pretrain_gpt.py`` *inside this ``__main__`` module*. Its top level imports only the standard
library and does nothing else, because dist-checkpointing's results process (spawn start method)
re-imports this file as ``__mp_main__``: it must stay cheap there and must not start training.

Configuration comes from the environment (set by the launcher): ``MEGATRON_LM_DIR``,
``MEGATRON_ZB_MLM_OUT`` (folder for the records), ``MEGATRON_ZB_MLM_PLUGIN`` (code, or
``module:function``), ``MEGATRON_ZB_MLM_PARAMS`` (``1``: save parameters after training),
``MEGATRON_ZB_MLM_SCRIPT_EDIT`` (JSON ``[[old, new], ...]`` applied to ``pretrain_gpt.py``'s text) and
torchrun's ``RANK`` etc.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
# Running a file puts its folder first on sys.path: this package's modules must not shadow top-level names.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def install_recorders(out: str, rank: int, params: bool) -> None:
    """Record what Megatron-LM's loop computes, from outside its files.

    * ``megatron.training.training.training_log`` (training.py:1773; ``train`` calls it by its module
      name every iteration): its ``loss_dict`` and ``grad_norm`` arguments, exactly (``float.hex``),
      one JSON line per iteration in ``<out>/record_rank<rank>.jsonl``, with the name of the
      ``forward_backward_func`` that ``train_step`` (training.py:1603) received for that iteration,
      and with multi-token prediction each depth's loss this rank summed over the iteration's micro
      batches (``"mtp_<k> loss"``, megatron-core's ``MTPLossLoggingHelper`` tracker before
      ``training_log`` reduces it over the ranks and divides by the micro batches).
    * with ``params``: ``megatron.training.training.train`` (training.py:2417, called by ``pretrain``):
      after it returns, every parameter of every model chunk (distributed-optimizer parameter
      gathers forced to finish first) to ``<out>/params_rank<rank>.pt``.
    """
    training = sys.modules["megatron.training.training"]
    real_log, real_step = training.training_log, training.train_step
    log_signature, step_signature = inspect.signature(real_log), inspect.signature(real_step)
    path = os.path.join(out, f"record_rank{rank}.jsonl")
    used: dict[str, str] = {}

    def train_step(*args: Any, **kwargs: Any) -> Any:
        func = step_signature.bind(*args, **kwargs).arguments["forward_backward_func"]
        used["forward_backward"] = f"{func.__module__}.{getattr(func, '__qualname__', type(func).__qualname__)}"
        return real_step(*args, **kwargs)

    def training_log(*args: Any, **kwargs: Any) -> Any:
        bound = log_signature.bind(*args, **kwargs).arguments
        norm = bound.get("grad_norm")
        losses = {key: float(value).hex() for key, value in bound["loss_dict"].items()}
        losses.update(_mtp_losses())
        record = {"iteration": int(bound["iteration"]), "losses": losses,
                  "grad_norm": None if norm is None else float(norm).hex(),
                  "forward_backward": used.get("forward_backward", "")}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return real_log(*args, **kwargs)

    training.train_step, training.training_log = train_step, training_log
    if params:
        real_train = training.train

        def train(forward_step_func: Any, model: list[Any], *args: Any, **kwargs: Any) -> Any:
            result = real_train(forward_step_func, model, *args, **kwargs)
            _save_params(model, os.path.join(out, f"params_rank{rank}.pt"))
            return result

        training.train = train


def _mtp_losses() -> dict[str, str]:
    """``{"mtp_<k> loss": hex}`` of this rank's multi-token prediction tracker (empty without MTP)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values", tracker.get("values"))  # megatron-core 0.19 / 0.16.1
    return {} if values is None else {f"mtp_{k + 1} loss": float(v).hex() for k, v in enumerate(values.tolist())}


def _save_params(model: list[Any], path: str) -> None:
    """Every chunk's parameters (``chunk<i>.<name>``), after any pending parameter all-gather."""
    import torch
    from megatron.training import get_args
    from megatron.core.utils import unwrap_model  # Megatron-LM core_v0.16.1 re-exported it from megatron.training.utils

    args = get_args()
    tensors = {}
    for i, chunk in enumerate(model):
        if args.use_distributed_optimizer and args.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)  # the last step's gather is otherwise left pending
        for name, param in unwrap_model(chunk).named_parameters():
            tensors[f"chunk{i}.{name}"] = param.detach().clone()
    torch.save(tensors, path)


def run_plugin_step(spec: str) -> None:
    """Run the plugin step: ``module:function`` is imported and called; anything else is Python code."""
    from harness.megatron_lm import PLUGIN_CALLABLE

    if not spec.strip():
        return
    if PLUGIN_CALLABLE.match(spec):
        module_name, qualname = spec.split(":")
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
        target()
        return
    exec(compile(spec, "<megatron_zb plugin step>", "exec"), {"__name__": "__megatron_zb_plugin__"})


def edit_script(text: str, edits: str) -> str:
    """``text`` with the ``[[old, new], ...]`` replacements of ``edits`` (JSON; empty: none) applied
    in order; each ``old`` must occur exactly once."""
    for old, new in json.loads(edits) if edits else []:
        if text.count(old) != 1:
            raise ValueError(f"script edit: {old!r} occurs {text.count(old)} times in pretrain_gpt.py, not once")
        text = text.replace(old, new)
    return text


def main() -> None:
    """Workarounds, recorders, plugin step, then Megatron-LM's ``pretrain_gpt.py`` as this ``__main__``."""
    from harness.megatron_lm_workarounds import apply_workarounds

    folder = Path(os.environ["MEGATRON_LM_DIR"])
    apply_workarounds(folder)
    install_recorders(os.environ["MEGATRON_ZB_MLM_OUT"], int(os.environ["RANK"]),
                      os.environ.get("MEGATRON_ZB_MLM_PARAMS") == "1")
    run_plugin_step(os.environ.get("MEGATRON_ZB_MLM_PLUGIN", ""))
    script = folder / "pretrain_gpt.py"
    sys.argv = [str(script), *sys.argv[1:]]
    code = compile(edit_script(script.read_text(), os.environ.get("MEGATRON_ZB_MLM_SCRIPT_EDIT", "")), str(script),
                   "exec")
    exec(code, sys.modules["__main__"].__dict__)  # pretrain_gpt.py's `if __name__ == "__main__":` runs
    exit_without_teardown()


def exit_without_teardown() -> None:
    """Leave a rank that finished: the ``atexit`` handlers run as usual (logging, multiprocessing
    finalizers such as dist-checkpointing's manager), then the process exits with status 0 without the
    interpreter's C-level teardown (torch / gloo destructors: about 3 s per rank on the 2-core
    machine, with no Python frame running). Not when a non-daemon thread is still alive: then the
    normal exit, which waits for it as a user's process would, is kept (a leak shows as a timeout)."""
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def fail_fast(exc: BaseException) -> None:
    """Leave a rank that failed: print the traceback as Python would, then exit with status 1 at once,
    without ``atexit`` handlers or the interpreter's teardown (which can wait on peers that are
    blocked on this rank). The launcher notices the failure sooner and kills the rest of the run."""
    sys.excepthook(type(exc), exc, exc.__traceback__)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:
        if e.code not in (None, 0):
            raise  # Megatron-LM's own exit status (e.g. sys.exit(1) on a failed check), as a plain run
        exit_without_teardown()
    except BaseException as e:  # noqa: BLE001 -- every failure of the rank is reported the same way
        fail_fast(e)
