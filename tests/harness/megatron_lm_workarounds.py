"""What NVIDIA Megatron-LM's own training loop (core_v0.16.1, core_v0.19.0) needs to run on a CPU-only torch.

Test code (the harness of :mod:`harness.megatron_lm`), not the product's run path.
:func:`apply_workarounds` is called inside each rank process *before* Megatron-LM's
``pretrain_gpt.py`` runs; it changes nothing in Megatron-LM's files (they are never copied or
edited), only module attributes seen from outside, the way a user's launcher would.

Which Megatron-LM release goes with the installed megatron-core is
``megatron_compat.megatron_lm_tag()`` (0.16.1 -> core_v0.16.1, 0.19.x -> core_v0.19.0); what differs
between the two is one row each of :data:`RELEASES`. Each workaround names the Megatron-LM /
megatron-core file and line it answers at core_v0.16.1 (commit 55ac708) with megatron-core 0.16.1
in its docstring; the row's ``sites`` list the lines of each release (core_v0.19.0: commit 5be9626,
megatron-core 0.19.2). Review them at each upgrade, like ``megatron_zb/megatron_compat/__init__.py``. The
measured facts behind them are in ``../shared/notes/megatron-lm-loop-on-cpu.md``. megatron-core's
*own* CUDA assumptions are not here: they belong to the product's CPU shim
(``megatron_zb/platform/cpu_shim.py``; e.g. ``rerun_state_machine._reduce_any``'s ``device="cuda"``
is in its ``CUDA_FACTORY_MODULES``).

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
from typing import Any, NamedTuple

__all__ = ["RELEASES", "HarnessRelease", "apply_workarounds", "check_sites", "harness_release", "is_applied",
           "override_transformer_config"]


class HarnessRelease(NamedTuple):
    """What the workarounds need to know about one Megatron-LM release (a row of :data:`RELEASES`)."""

    sites: tuple[tuple[str, int, str], ...]
    """(file, line, text on that line): every line of this Megatron-LM release / its megatron-core that a
    workaround here, or a recorder of megatron_lm_main.py, answers. tests/megatron_lm/test_megatron_lm_harness.py (and
    :func:`apply_workarounds`, before anything runs) checks each still says that text: after an upgrade a
    mismatch names the workaround to review."""
    training_modules: tuple[str, ...]
    """Megatron-LM modules whose module-global ``torch`` is replaced by a CPU stand-in
    (:func:`_answer_cuda_queries`)."""
    tensor_cuda_callers: tuple[str, ...]
    """Module prefixes whose ``Tensor.cuda()`` returns the CPU tensor (:func:`_cuda_methods_from_training`)."""
    triton_stub: bool
    """Whether megatron-core's ``batch_invariant_kernels`` imports triton unguarded (:func:`_stub_batch_invariant_kernels`)."""
    legacy_fused_kernels: bool
    """Whether ``initialize`` loads ``megatron.legacy.fused_kernels`` (:func:`_skip_fused_kernels_load`)."""


_TRAINING = "megatron/training/training.py"
_INIT = "megatron/training/initialize.py"
_DIST_UTILS = "megatron/training/models/dist_utils.py"
RELEASES: dict[str, HarnessRelease] = {
    "core_v0.16.1": HarnessRelease(
        sites=(
            (_INIT, 25, "batch_invariant_kernels import enable_batch_invariant_mode"),
            ("megatron/core/transformer/custom_layers/batch_invariant_kernels.py", 15, "import triton"),
            (_INIT, 62, "assert torch.cuda.is_available()"),
            (_INIT, 319, "device_count = torch.cuda.device_count()"),
            (_INIT, 331, "torch.cuda.set_device(args.local_rank)"),
            (_INIT, 360, "if device_count > 0:"),
            (_INIT, 422, "if torch.cuda.device_count() > 0:"),
            (_TRAINING, 1325, "torch.cuda.Stream()"),
            (_TRAINING, 1344, "torch.cuda.current_stream().wait_stream(ddp_stream)"),
            *((_TRAINING, line, "device='cuda'") for line in (806, 812, 1816, 2072, 2373, 3149, 3225, 3227, 3406,
                                                              3409)),
            ("megatron/training/utils.py", 117, "device='cuda'"),
            ("megatron/training/checkpointing.py", 315, "device='cuda'"),
            ("megatron/training/utils.py", 534, '.cuda(non_blocking=True)'),
            (_TRAINING, 3112, ").cuda()"),
            (_TRAINING, 1258, "model_module.cuda(torch.cuda.current_device())"),
            (_INIT, 192, "compile_helpers()"),
            ("megatron/core/datasets/utils.py", 25, 'command = ["make", "-C"'),
            (_INIT, 224, "fused_kernels.load(args)"),
            (_INIT, 228, "fused_kernels.load(args)"),
            ("megatron/legacy/fused_kernels/__init__.py", 59, '"/bin/nvcc", "-V"'),
            (_TRAINING, 138, "from megatron.training.initialize import set_jit_fusion_options"),
            (_TRAINING, 792, "set_jit_fusion_options()"),
            (_TRAINING, 1773, "def training_log("),
            (_TRAINING, 1603, "def train_step("),
            (_TRAINING, 2795, ") = train_step("),
            (_TRAINING, 2417, "def train("),
            (_TRAINING, 1031, "= train("),
            ("megatron/training/arguments.py", 1306, "def core_transformer_config_from_args(args, config_class=None):"),
            ("megatron/training/arguments.py", 1324, "kw_args['deallocate_pipeline_outputs'] = True"),
        ),
        training_modules=("megatron.training.initialize", "megatron.training.training", "megatron.training.utils",
                          "megatron.training.checkpointing"),
        tensor_cuda_callers=("megatron.training.",),
        triton_stub=True,
        legacy_fused_kernels=True,
    ),
    # core_v0.19.0: utils.py became the package megatron/training/utils/ (the CUDA tensors of
    # calc_params_l2_norm in common_utils.py), the model is built and wrapped in DDP (on a side stream)
    # by megatron/training/models/dist_utils.py, get_batch_on_this_tp_rank moved to megatron.core.utils
    # (the product shim's), pretrain_gpt.py's get_batch moves the batch with .cuda() itself (line 128:
    # run as the rank's __main__), megatron/legacy is gone (no fused_kernels.load), megatron-core 0.19
    # imports triton in a try (no stub), set_jit_fusion_options takes tp_size, and
    # core_transformer_config_from_args lives in argument_utils.py (arguments.py re-exports it).
    "core_v0.19.0": HarnessRelease(
        sites=(
            (_INIT, 66, "assert torch.cuda.is_available()"),
            (_INIT, 270, "device_count = torch.cuda.device_count()"),
            (_INIT, 282, "torch.cuda.set_device(args.local_rank)"),
            (_INIT, 281, "if device_count > 0:"),
            (_INIT, 447, "if torch.cuda.device_count() > 0:"),
            (_TRAINING, 1876, "torch.cuda.Stream()"),
            (_TRAINING, 1896, "torch.cuda.current_stream().wait_stream(ddp_stream)"),
            *((_TRAINING, line, "device='cuda'") for line in (1131, 1137, 2613, 2884, 3298, 4270, 4299, 4377, 4379,
                                                              4588, 4591, 4644, 4653)),
            *(("megatron/training/utils/common_utils.py", line, "device='cuda'") for line in (55, 60, 222, 223, 227)),
            ("megatron/training/checkpointing.py", 375, "device='cuda'"),
            ("pretrain_gpt.py", 128, ".cuda(non_blocking=True)"),
            (_TRAINING, 2311, ".cuda(non_blocking=True)"),
            (_TRAINING, 1818, "model_module.cuda(torch.cuda.current_device())"),
            (_DIST_UTILS, 174, "model_module.cuda(torch.cuda.current_device())"),
            (_DIST_UTILS, 303, "torch.cuda.Stream()"),
            (_DIST_UTILS, 366, "torch.cuda.current_stream().wait_stream(ddp_stream)"),
            (_INIT, 178, "compile_helpers()"),
            ("megatron/core/datasets/utils.py", 25, 'command = ["make", "-C"'),
            (_TRAINING, 150, "set_jit_fusion_options,"),
            (_TRAINING, 1117, "set_jit_fusion_options(tp_size=args.tensor_model_parallel_size)"),
            (_TRAINING, 2568, "def training_log("),
            (_TRAINING, 2336, "def train_step("),
            (_TRAINING, 3856, ") = train_step("),
            (_TRAINING, 3342, "def train("),
            (_TRAINING, 1423, "= train("),
            ("megatron/training/argument_utils.py", 277,
             "def core_transformer_config_from_args(args, config_class=None):"),
            ("megatron/training/argument_utils.py", 305, "kw_args['deallocate_pipeline_outputs'] = True"),
        ),
        training_modules=("megatron.training.initialize", "megatron.training.training",
                          "megatron.training.utils.common_utils", "megatron.training.checkpointing",
                          "megatron.training.models.dist_utils"),
        tensor_cuda_callers=("megatron.training.", "__main__"),
        triton_stub=False,
        legacy_fused_kernels=False,
    ),
}
"""Per Megatron-LM release (the tag of ``megatron_compat.MEGATRON_LM_TAGS``): what the workarounds answer."""


def harness_release() -> tuple[str, HarnessRelease]:
    """The Megatron-LM tag that goes with the installed megatron-core and its :data:`RELEASES` row."""
    from megatron_zb.megatron_compat import megatron_lm_tag

    tag = megatron_lm_tag()
    return tag, RELEASES[tag]


def check_sites(megatron_lm_dir: str | Path) -> list[str]:
    """The sites of the installed release's :data:`RELEASES` row whose line no longer holds the
    expected text (``megatron/core/...`` is read from the installed megatron-core, the rest from
    ``megatron_lm_dir``); empty when all match."""
    import megatron.core

    core_root = Path(megatron.core.__file__).resolve().parents[2]
    wrong = []
    for path, line, text in harness_release()[1].sites:
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
    megatron-zb's CPU shim, then applies the workarounds of the installed megatron-core's release
    (:func:`harness_release`). Idempotent. Raises ``RuntimeError`` when CUDA is available (nothing
    here is meant for a GPU) or when a site of that release does not say what its workaround
    expects -- e.g. core_v0.16.1's training files beside megatron-core 0.19 -- naming the first.
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
    from megatron_zb.megatron_compat import megatron_core_version

    tag, release = harness_release()
    wrong = check_sites(megatron_lm_dir)
    if wrong:
        raise RuntimeError(f"Megatron-LM at {path} is not {tag}, the release that goes with megatron-core "
                           f"{megatron_core_version()} ({len(wrong)} workaround sites differ; first: {wrong[0]}); "
                           f"set MEGATRON_LM_DIR to a {tag} checkout")
    if release.triton_stub:
        _stub_batch_invariant_kernels()
    for name in ("megatron.training.training", *release.training_modules):
        importlib.import_module(name)
    _answer_cuda_queries(release.training_modules)
    _cuda_methods_from_training(release.tensor_cuda_callers)
    _skip_dataset_helpers_build()
    if release.legacy_fused_kernels:
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
def _answer_cuda_queries(training_modules: tuple[str, ...]) -> None:
    """Inside ``training_modules`` only (a :data:`RELEASES` row's), ``torch`` is a stand-in (the product shim's
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
    for name in training_modules:
        module = sys.modules[name]
        if module.__dict__.get("torch") is not torch:
            raise RuntimeError(f"Megatron-LM CPU harness: {name}.torch is not the torch module; Megatron-LM changed?")
        module.torch = stand_in


def _cuda_methods_from_training(tensor_cuda_callers: tuple[str, ...]) -> None:
    """``.cuda()`` called from Megatron-LM's training package returns the CPU object:

    * ``Tensor.cuda``: utils.py:534-556 (``get_batch_on_this_tp_rank``, every micro batch),
      training.py:3112 (``evaluate``); at core_v0.19.0 also ``pretrain_gpt.py``'s own ``get_batch``
      (line 128), which runs as the rank's ``__main__``. From the modules of
      ``tensor_cuda_callers`` (a :data:`RELEASES` row's), through the product shim's caller prefixes
      (``allow_tensor_cuda_from``): it judges the caller inside its own wrapper, which a second
      wrapper here would hide.
    * ``Module.cuda``: training.py:1258 (``get_model``: ``model_module.cuda(torch.cuda.current_device())``)
      is a no-op when called from ``megatron.training.*``; from anywhere else it is torch's.
    """
    import torch

    from megatron_zb.platform.cpu_shim import allow_tensor_cuda_from

    allow_tensor_cuda_from(*tensor_cuda_callers)
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
    initialize.py:439; core_v0.19.0: training.py:1117, with ``tp_size=``) warms up the bias-GeLU / bias-dropout-add fusions on ``device="cuda"`` tensors,
    then torch.compiles them on CPU (about 17 s). The run's own first iteration compiles whatever
    fusion its flags enable (none with :data:`~harness.megatron_lm.CPU_FLAGS`): skipped."""
    training = sys.modules["megatron.training.training"]
    training.set_jit_fusion_options = lambda *args, **kwargs: None


# ---------------------------------------------------------------------- plugin-step helpers (not applied by default)
def override_transformer_config(**fields: Any) -> None:
    """For a plugin step: every ``TransformerConfig`` Megatron-LM builds from its arguments gets ``fields``.

    Wraps megatron/training/arguments.py:1306 ``core_transformer_config_from_args`` (which, line
    1324, always sets ``deallocate_pipeline_outputs=True``; core_v0.19.0: argument_utils.py:277 and
    305, re-exported by arguments.py), in that module and in every module that
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

    from megatron_zb.megatron_lm.rebind import Rebinds

    Rebinds().everywhere(real, core_transformer_config_from_args)   # this process only: never restored
