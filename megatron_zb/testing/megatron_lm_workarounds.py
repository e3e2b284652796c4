"""What NVIDIA Megatron-LM core_v0.16.1's own training loop needs to run on a CPU-only torch.

Test code (the harness of :mod:`megatron_zb.testing.megatron_lm`), not the product's run path.
:func:`apply_workarounds` is called inside each rank process *before* Megatron-LM's
``pretrain_gpt.py`` runs; it changes nothing in Megatron-LM's files (they are never copied or
edited), only module attributes seen from outside, the way a user's launcher would.

Each workaround names the Megatron-LM / megatron-core file and line (or function) it answers, at
tag core_v0.16.1 (commit 55ac708) and megatron-core 0.16.1: review them at each upgrade, like
``megatron_zb/megatron_compat.py``. The measured facts behind them are in
``../shared/notes/megatron-lm-loop-on-cpu.md``. megatron-core's *own* CUDA assumptions are not
here: they belong to the product's CPU shim (``megatron_zb/platform/cpu_shim.py``; e.g.
``rerun_state_machine._reduce_any``'s ``device="cuda"`` is in its ``CUDA_FACTORY_MODULES``).

Not answered here (answered by installing packages, the ``test`` extras of setup.py; ``regex`` is a
default dependency):
``megatron/training/yaml_arguments.py`` imports ``yaml`` (pyyaml),
``megatron/training/tokenizer/gpt2_tokenization.py`` imports ``regex``, ``megatron/rl/__init__.py``
(reached from ``megatron/training/training.py``) imports ``pydantic``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

__all__ = ["SITES", "TRAINING_MODULES", "apply_workarounds", "check_sites", "is_applied", "override_transformer_config"]

TRAINING_MODULES: tuple[str, ...] = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.checkpointing",
)
"""Megatron-LM modules whose module-global ``torch`` is replaced by a CPU stand-in (see
:func:`_answer_cuda_queries`)."""

SITES: tuple[tuple[str, int, str], ...] = (
    # (file, line, text on that line): every line of Megatron-LM core_v0.16.1 / megatron-core 0.16.1 that a
    # workaround here, or a recorder of megatron_lm_main.py, answers. tests/test_megatron_lm_harness.py
    # checks each still says that text: after an upgrade a mismatch names the workaround to review.
    ("megatron/training/initialize.py", 25, "batch_invariant_kernels import enable_batch_invariant_mode"),
    ("megatron/core/transformer/custom_layers/batch_invariant_kernels.py", 15, "import triton"),
    ("megatron/training/initialize.py", 62, "assert torch.cuda.is_available()"),
    ("megatron/training/initialize.py", 319, "device_count = torch.cuda.device_count()"),
    ("megatron/training/initialize.py", 331, "torch.cuda.set_device(args.local_rank)"),
    ("megatron/training/initialize.py", 360, "if device_count > 0:"),
    ("megatron/training/initialize.py", 422, "if torch.cuda.device_count() > 0:"),
    ("megatron/training/training.py", 1325, "torch.cuda.Stream()"),
    ("megatron/training/training.py", 1344, "torch.cuda.current_stream().wait_stream(ddp_stream)"),
    ("megatron/training/training.py", 806, "device='cuda'"),
    ("megatron/training/training.py", 812, "device='cuda'"),
    ("megatron/training/training.py", 1816, "device='cuda'"),
    ("megatron/training/training.py", 2072, "device='cuda'"),
    ("megatron/training/training.py", 2373, "device='cuda'"),
    ("megatron/training/training.py", 3149, "device='cuda'"),
    ("megatron/training/training.py", 3225, "device='cuda'"),
    ("megatron/training/training.py", 3227, "device='cuda'"),
    ("megatron/training/training.py", 3406, "device='cuda'"),
    ("megatron/training/training.py", 3409, "device='cuda'"),
    ("megatron/training/utils.py", 117, "device='cuda'"),
    ("megatron/training/checkpointing.py", 315, "device='cuda'"),
    ("megatron/training/utils.py", 534, '.cuda(non_blocking=True)'),
    ("megatron/training/training.py", 3112, ").cuda()"),
    ("megatron/training/training.py", 1258, "model_module.cuda(torch.cuda.current_device())"),
    ("megatron/training/initialize.py", 192, "compile_helpers()"),
    ("megatron/core/datasets/utils.py", 25, 'command = ["make", "-C"'),
    ("megatron/training/initialize.py", 224, "fused_kernels.load(args)"),
    ("megatron/training/initialize.py", 228, "fused_kernels.load(args)"),
    ("megatron/legacy/fused_kernels/__init__.py", 59, '"/bin/nvcc", "-V"'),
    ("megatron/training/training.py", 138, "from megatron.training.initialize import set_jit_fusion_options"),
    ("megatron/training/training.py", 792, "set_jit_fusion_options()"),
    ("megatron/training/training.py", 1773, "def training_log("),
    ("megatron/training/training.py", 1603, "def train_step("),
    ("megatron/training/training.py", 2795, ") = train_step("),
    ("megatron/training/training.py", 2417, "def train("),
    ("megatron/training/training.py", 1031, "= train("),
    ("megatron/training/arguments.py", 1306, "def core_transformer_config_from_args(args, config_class=None):"),
    ("megatron/training/arguments.py", 1324, "kw_args['deallocate_pipeline_outputs'] = True"),
)


def check_sites(megatron_lm_dir: str | Path) -> list[str]:
    """The :data:`SITES` whose line no longer holds the expected text (``megatron/core/...`` is read
    from the installed megatron-core, the rest from ``megatron_lm_dir``); empty when all match."""
    import megatron.core

    core_root = Path(megatron.core.__file__).resolve().parents[2]
    wrong = []
    for path, line, text in SITES:
        root = core_root if path.startswith("megatron/core/") else Path(megatron_lm_dir)
        try:
            found = (root / path).read_text().splitlines()[line - 1]
        except (OSError, IndexError):
            found = "<missing>"
        if text not in found:
            wrong.append(f"{path}:{line}: expected {text!r}, found {found.strip()!r}")
    return wrong


_TRAINING_PREFIX = "megatron.training."
_BATCH_INVARIANT = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
_applied = False


def is_applied() -> bool:
    """True once :func:`apply_workarounds` ran in this process."""
    return _applied


def apply_workarounds(megatron_lm_dir: str | Path) -> None:
    """Make Megatron-LM's training package (from ``megatron_lm_dir``) run on this CPU-only process.

    Puts ``megatron_lm_dir`` first on ``sys.path`` (``megatron`` is a namespace package:
    ``megatron.core`` stays the installed wheel, ``megatron.training`` comes from there), installs
    megatron-zb's CPU shim, then applies every workaround below. Idempotent. Raises
    ``RuntimeError`` when CUDA is available (nothing here is meant for a GPU).
    """
    global _applied
    if _applied:
        return
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("the Megatron-LM CPU workarounds are for CPU-only torch builds; CUDA is available")
    path = str(Path(megatron_lm_dir).resolve())
    if path not in sys.path:
        sys.path.insert(0, path)
    import megatron_zb  # noqa: F401  (the product's CPU shim for megatron-core)

    _stub_batch_invariant_kernels()
    for name in ("megatron.training.training", *TRAINING_MODULES):
        importlib.import_module(name)
    _answer_cuda_queries()
    _cuda_methods_from_training()
    _skip_dataset_helpers_build()
    _skip_fused_kernels_load()
    _skip_jit_warmup()
    _applied = True


# ---------------------------------------------------------------------- imports
def _stub_batch_invariant_kernels() -> None:
    """megatron/training/initialize.py:25 imports megatron-core's
    ``transformer/custom_layers/batch_invariant_kernels.py``, which imports ``triton`` at top level
    (line 15; no triton on a CPU machine). Without triton, that module is replaced by a stub whose
    ``enable_batch_invariant_mode`` (initialize.py:123, ``--batch-invariant-mode``) raises."""
    if importlib.util.find_spec("triton") is not None or _BATCH_INVARIANT in sys.modules:
        return

    def needs_triton(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("--batch-invariant-mode needs triton (a GPU); the Megatron-LM CPU harness stubs it")

    stub = types.ModuleType(_BATCH_INVARIANT, "megatron_zb Megatron-LM CPU harness stub (no triton)")
    stub.enable_batch_invariant_mode = needs_triton  # type: ignore[attr-defined]
    stub.set_batch_invariant_mode = needs_triton  # type: ignore[attr-defined]
    stub.disable_batch_invariant_mode = lambda *a, **k: None  # type: ignore[attr-defined]
    stub.is_batch_invariant_mode_enabled = lambda: False  # type: ignore[attr-defined]
    sys.modules[_BATCH_INVARIANT] = stub


# ---------------------------------------------------------------------- CUDA queries and devices
def _answer_cuda_queries() -> None:
    """Inside :data:`TRAINING_MODULES` only, ``torch`` is a stand-in (the product shim's
    ``cpu_torch_stand_in``) whose ``torch.cuda`` answers:

    * ``is_available() -> True``: initialize.py:62 ``assert torch.cuda.is_available()``;
    * ``device_count() -> 1``: initialize.py:319 ``device_count`` *silently* gates
      ``mpu.initialize_model_parallel`` (line 360) and ``set_device`` (line 330), and line 422 gates
      ``model_parallel_cuda_manual_seed`` -- with 0 there is no parallel state and no RNG tracker;
    * ``set_device(...)``: nothing (initialize.py:331);
    * ``Stream()``, ``current_stream()``, ``stream(s)``: one synchronous CPU stream (training.py:1325-1344,
      ``get_model`` with ``--overlap-grad-reduce``: DDP is built on a side stream);

    and whose tensor factories put ``device="cuda"`` on CPU: training.py:806/812 (start-up
    timestamps), 1816/2072 (``total_loss_dict``), 2373/3149 (exit duration), 3225-3227 (eval iters),
    3406-3409 (do-train/valid/test flags); utils.py:117-208 (``calc_params_l2_norm``);
    checkpointing.py:315 (``read_metadata``'s ``iters_cuda``); initialize.py:475-512 (JIT warm-up,
    skipped anyway). Every other attribute is the real ``torch`` / ``torch.cuda``.
    """
    from megatron_zb.platform.cpu_shim import cpu_torch_stand_in
    import torch

    def set_device(device: Any) -> None:
        """Nothing to select: one CPU."""

    stand_in = cpu_torch_stand_in(is_available=lambda: True, device_count=lambda: 1, set_device=set_device)
    for name in TRAINING_MODULES:
        module = sys.modules[name]
        if module.__dict__.get("torch") is not torch:
            raise RuntimeError(f"Megatron-LM CPU harness: {name}.torch is not the torch module; Megatron-LM changed?")
        module.torch = stand_in


def _cuda_methods_from_training() -> None:
    """``.cuda()`` called from Megatron-LM's training package returns the CPU object:

    * ``Tensor.cuda``: utils.py:534-556 (``get_batch_on_this_tp_rank``, every micro batch),
      training.py:3112 (``evaluate``). Through the product shim's caller prefixes
      (``allow_tensor_cuda_from``): it judges the caller inside its own wrapper, which a second
      wrapper here would hide.
    * ``Module.cuda``: training.py:1258 (``get_model``: ``model_module.cuda(torch.cuda.current_device())``)
      is a no-op when called from ``megatron.training.*``; from anywhere else it is torch's.
    """
    import torch

    from megatron_zb.platform.cpu_shim import allow_tensor_cuda_from

    allow_tensor_cuda_from(_TRAINING_PREFIX)
    real_cuda = torch.nn.Module.cuda
    if getattr(real_cuda, "_megatron_lm_harness", False):
        return

    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        """``Module.cuda``; called from Megatron-LM's training package on CPU it keeps the module where it is."""
        if sys._getframe(1).f_globals.get("__name__", "").startswith(_TRAINING_PREFIX):
            return self
        return real_cuda(self, device)

    cuda._megatron_lm_harness = True  # type: ignore[attr-defined]
    cuda.__wrapped__ = real_cuda  # type: ignore[attr-defined]
    torch.nn.Module.cuda = cuda  # type: ignore[method-assign]


# ---------------------------------------------------------------------- build steps
def _skip_dataset_helpers_build() -> None:
    """initialize.py:179-192 ``_compile_dependencies`` runs megatron-core's
    ``datasets/utils.py:20 compile_helpers`` (``make -C .../megatron/core/datasets``); the wheel ships
    the built ``helpers_cpp`` extension but no Makefile, so ``make`` fails and it calls
    ``sys.exit(1)``. When ``helpers_cpp`` imports there is nothing to build: ``compile_helpers``
    does nothing (otherwise it is left alone and fails as before)."""
    from megatron.core.datasets import utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


def _skip_fused_kernels_load() -> None:
    """initialize.py:224/228 ``fused_kernels.load(args)`` (megatron/legacy/fused_kernels/__init__.py:17)
    runs ``$CUDA_HOME/bin/nvcc -V`` (line 59; ``CUDA_HOME`` is None on CPU: TypeError). At this tag it
    builds no kernel (it only queries nvcc and creates a ``build`` folder inside Megatron-LM's tree,
    which must stay untouched): a no-op here."""
    from megatron.legacy import fused_kernels

    fused_kernels.load = lambda args: None


def _skip_jit_warmup() -> None:
    """training.py:792 ``set_jit_fusion_options()`` (imported by name at training.py:138;
    initialize.py:439) warms up the bias-GeLU / bias-dropout-add fusions on ``device="cuda"`` tensors,
    then torch.compiles them on CPU (about 17 s). The run's own first iteration compiles whatever
    fusion its flags enable (none with :data:`~megatron_zb.testing.megatron_lm.CPU_FLAGS`): skipped."""
    training = sys.modules["megatron.training.training"]
    training.set_jit_fusion_options = lambda: None


# ---------------------------------------------------------------------- plugin-step helpers (not applied by default)
def override_transformer_config(**fields: Any) -> None:
    """For a plugin step: every ``TransformerConfig`` Megatron-LM builds from its arguments gets ``fields``.

    Wraps megatron/training/arguments.py:1306 ``core_transformer_config_from_args`` (which, line
    1324, always sets ``deallocate_pipeline_outputs=True``), in that module and in every module that
    already imported it by name; ``pretrain_gpt.py`` and ``gpt_builders.py``, imported later, get the
    wrapper. E.g. ``override_transformer_config(deallocate_pipeline_outputs=False)``: the workaround
    of issue 22 for a runtime that does not pseudo-free stage outputs.
    """
    from megatron.training import arguments

    real = arguments.core_transformer_config_from_args

    def core_transformer_config_from_args(args: Any, config_class: Any = None) -> Any:
        config = real(args) if config_class is None else real(args, config_class)
        for name, value in fields.items():
            if not hasattr(config, name):
                raise AttributeError(f"{type(config).__name__} has no field {name!r}")
            setattr(config, name, value)
        return config

    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "core_transformer_config_from_args", None) is real:
            module.core_transformer_config_from_args = core_transformer_config_from_args
