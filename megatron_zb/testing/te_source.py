"""Transformer Engine's released source, read against what the TE route relies on.

The route (:mod:`megatron_zb.runtime.te_route`) and its CPU test double (``tests/te_double.py``)
follow TE's code; this module checks that code itself, for each release in
:data:`TE_SOURCE_VERSIONS`. The ``transformer-engine`` wheel of a release is pure Python
(``transformer_engine/pytorch/module/*.py`` inside, ~0.5-1 MB); its modules are *parsed*
(``ast``) and searched, never imported -- importing needs TE's CUDA extension. Nothing of TE is
copied into this project: the wheels are downloaded from the public registry into a cache
directory (:func:`wheel_path`).

Each :class:`Fact` names one line (or construct) of TE the route relies on, where it is, and
whether it holds; :func:`check_release` returns them all for one wheel. Used by
``tests/runtime/test_te_source.py`` and ``scripts/check_te_source.py``.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TE_SOURCE_VERSIONS", "Fact", "WheelUnavailable", "check_release", "default_cache_dir", "wheel_path"]

TE_SOURCE_VERSIONS: tuple[str, ...] = ("2.3.0", "2.7.0", "2.8.0", "2.10.0", "2.18.0", "2.20.2")
"""The TE releases checked (docs/transformer_engine.md names the same list): the oldest the
route supports, the first with the hooks API, the first whose GroupedLinear returns its B-time
buffer, the first with ``need_backward_dw``, the release the test double follows, and the newest
release when this list was written."""

_MODULE = "transformer_engine/pytorch/module/"


class WheelUnavailable(RuntimeError):
    """The wheel is neither in the cache directory nor downloadable here."""


@dataclass(frozen=True)
class Fact:
    """One thing the route relies on in one TE release."""

    name: str
    where: str  # file (and class.method) inside the wheel
    holds: bool
    detail: str = ""


# ---------------------------------------------------------------------- the wheels
def default_cache_dir() -> Path:
    """``$MEGATRON_ZB_TE_WHEELS``, else ``~/.cache/megatron-zb/te-wheels``."""
    env = os.environ.get("MEGATRON_ZB_TE_WHEELS")
    return Path(env) if env else Path.home() / ".cache" / "megatron-zb" / "te-wheels"


def wheel_path(version: str, cache_dir: Path | None = None, *, download: bool = True, timeout_s: float = 120.0) -> Path:
    """The ``transformer-engine==version`` wheel in ``cache_dir``, downloaded there first when
    missing and ``download`` (``pip download --no-deps``; one request to the package index).
    Raises :class:`WheelUnavailable` (one line) when it cannot be had."""
    cache = cache_dir or default_cache_dir()
    name = f"transformer_engine-{version}-py3-none-any.whl"
    path = cache / name
    if path.is_file():
        return path
    if not download:
        raise WheelUnavailable(f"{name} is not in {cache}")
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "0",
           "--timeout", "15", "--disable-pip-version-check", "-q", "-d", str(cache), f"transformer-engine=={version}"]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise WheelUnavailable(f"{name} is not in {cache} and pip download took over {timeout_s:.0f} s") from None
    if res.returncode != 0 or not path.is_file():
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelUnavailable(f"{name} is not in {cache} and pip download failed ({last})")
    return path


# ---------------------------------------------------------------------- reading the source
class _Source:
    """The parsed modules of one wheel."""

    def __init__(self, wheel: Path) -> None:
        self._zip = zipfile.ZipFile(wheel)
        self._trees: dict[str, tuple[str, ast.Module]] = {}

    def module(self, name: str) -> tuple[str, ast.Module]:
        if name not in self._trees:
            text = self._zip.read(_MODULE + name).decode()
            self._trees[name] = (text, ast.parse(text))
        return self._trees[name]

    def method(self, module: str, cls: str, func: str) -> ast.FunctionDef | None:
        _, tree = self.module(module)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == func:
                        return item
        return None


def _src(node: ast.AST) -> str:
    return ast.unparse(node)


def _pop_targets(fn: ast.FunctionDef) -> list[ast.AST]:
    """The assignment targets of every ``... = self.wgrad_store.pop()`` in ``fn``."""
    return [t for n in ast.walk(fn) if isinstance(n, ast.Assign) and _src(n.value) == "self.wgrad_store.pop()"
            for t in n.targets]


def _pops_per_call(body: list[ast.stmt]) -> int | None:
    """How many ``self.wgrad_store.pop()`` every path through ``body`` runs (``None``: paths differ)."""
    count = 0
    for stmt in body:
        if isinstance(stmt, ast.Assign) and _src(stmt.value) == "self.wgrad_store.pop()":
            count += 1
        elif isinstance(stmt, ast.With):
            inner = _pops_per_call(stmt.body)
            if inner is None:
                return None
            count += inner
        elif isinstance(stmt, ast.If):
            a, b = _pops_per_call(stmt.body), _pops_per_call(stmt.orelse)
            if a is None or a != b:
                return None
            count += a
    return count


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


# ---------------------------------------------------------------------- the facts
def _queue_facts(src: _Source) -> list[Fact]:
    where = "module/_common.py WeightGradStore"
    init = src.method("_common.py", "WeightGradStore", "__init__")
    put = src.method("_common.py", "WeightGradStore", "put")
    pop = src.method("_common.py", "WeightGradStore", "pop")
    init_s, put_s = (_src(init) if init else ""), (_src(put) if put else "")
    returns = [_src(n.value) for n in ast.walk(pop) if isinstance(n, ast.Return) and n.value] if pop else []
    return [
        Fact("the queue is a queue.Queue in .context (te_queued_wgrad reads its qsize)", where + ".__init__",
             "self.context = queue.Queue()" in init_s),
        Fact("put appends [tensor_list, func]", where + ".put", "self.context.put([tensor_list, func])" in put_s),
        Fact("pop runs the oldest entry and returns (func(*tensor_list), tensor_list)", where + ".pop",
             "self.context.get()" in (_src(pop) if pop else "") and "(func(*tensor_list), tensor_list)" in returns,
             f"returns {returns}"),
    ]


def _backward_dw_facts(src: _Source, version: tuple[int, ...]) -> list[Fact]:
    where = "module/base.py TransformerEngineBaseModule.backward_dw"
    fn = src.method("base.py", "TransformerEngineBaseModule", "backward_dw")
    if fn is None:
        return [Fact("backward_dw exists", where, False)]
    text = _src(fn)
    targets = _pop_targets(fn)
    bgrad = None
    if targets and isinstance(targets[0], ast.Tuple) and isinstance(targets[0].elts[0], ast.Tuple) \
            and len(targets[0].elts[0].elts) >= 2:
        bgrad = _src(targets[0].elts[0].elts[1])
    guard = next((m for m in re.finditer(r"if (\w+)\.grad is None:\s+\1\.grad = (\w+)\.to\(", text)
                  if m.group(2) == bgrad), None)
    hooks = "wgrad_accumulation_and_reduce_hook" in text
    facts = [
        Fact("one pop per call, unpacked as ((wgrad, bgrad, ...), tensor_list)", where, bgrad is not None,
             f"bias gradient named {bgrad!r}"),
        Fact("the bias guard: bias.grad = bgrad.to(...) only when bias.grad is None (bgrad may be None: the "
             "route's placeholder)", where, guard is not None,
             guard.group(0).split(":")[0] if guard else "no guard found"),
        Fact("weight.grad is assigned (not added) without fused accumulation", where,
             bool(re.search(r"weight_tensor\.grad = wgrad\.to\(", text))),
    ]
    if version >= (2, 7):
        facts.append(Fact("the wgrad accumulation and reduce hooks run after the assignments (TE >= 2.7)", where,
                          hooks))
    else:
        facts.append(Fact("no hooks API before TE 2.7 (the route settles directly)", where, not hooks))
    return facts


_FP8_BIAS = re.compile(r"bias if \(grad_bias is None and not [\w.]*fp8\) else None")


def _fp8_bias_facts(src: _Source) -> list[Fact]:
    facts = []
    for module in ("linear.py", "layernorm_linear.py"):
        text, _ = src.module(module)
        facts.append(Fact("the delayed GEMM gets bias=None when the bias gradient was computed in B (FP8, debug)",
                          f"module/{module}", bool(_FP8_BIAS.search(text))))
    text, _ = src.module("linear.py")
    facts.append(Fact("a row-parallel applied bias is added outside the GEMM (gemm_bias_unfused_add)",
                      "module/linear.py", "self.gemm_bias_unfused_add = True" in text
                      and "if self.gemm_bias_unfused_add:" in text))
    return facts


def _grouped_facts(src: _Source, version: tuple[int, ...]) -> list[Fact]:
    where = "module/grouped_linear.py _GroupedLinear.backward"
    text, tree = src.module("grouped_linear.py")
    returns_buffer, nulled = False, False
    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple):
            returns_buffer |= any(isinstance(e, ast.Starred) and _src(e.value) == "wgrad_list" for e in node.value.elts)
        if isinstance(node, ast.If) and "delay_wgrad_compute()" in _src(node.test):
            nulled |= any(isinstance(s, ast.Assign) and _src(s).startswith("wgrad_list = [None] *") for s in node.body)
    expect_buffer = version >= (2, 8)
    return [
        Fact("the backward returns *wgrad_list to autograd as the weight gradients", where, returns_buffer),
        Fact("the non-fused buffer is torch.empty (uninitialised until the delayed GEMM fills it)", where,
             "torch.empty(" in text and re.search(r"wgrad_store\.put\(\[[^\]]*wgrad_\w+\]", text) is not None),
        Fact("a delayed backward returns " + ("the B-time buffer (TE >= 2.8: the route drops it)" if expect_buffer
                                              else "None for the weights (TE < 2.8)"),
             where, nulled != expect_buffer, f"'wgrad_list = [None] * ...' under delay_wgrad_compute(): {nulled}"),
    ]


def _mlp_and_weight_facts(src: _Source) -> list[Fact]:
    facts = []
    fn = src.method("layernorm_mlp.py", "LayerNormMLP", "backward_dw")
    pops = _pops_per_call(fn.body) if fn else 0
    facts.append(Fact("LayerNormMLP.backward_dw pops two entries (fc2's, then fc1's)",
                      "module/layernorm_mlp.py LayerNormMLP.backward_dw", pops == 2, f"{pops} pop(s)"))
    for module in ("linear.py", "layernorm_linear.py"):
        text, _ = src.module(module)
        facts.append(Fact("weight_names lists the weights backward_dw assigns (te_delayed_weight_params)",
                          f"module/{module}", "self.weight_names = [" in text))
    text, _ = src.module("layernorm_mlp.py")
    facts.append(Fact("LayerNormMLP's weights are fc1_weight and fc2_weight", "module/layernorm_mlp.py",
                      '"fc1_weight"' in text and '"fc2_weight"' in text))
    text, _ = src.module("grouped_linear.py")
    facts.append(Fact("GroupedLinear's weights are weight<i>", "module/grouped_linear.py", 'f"weight{i}"' in text))
    for module, cls in (("linear.py", "Linear"), ("layernorm_linear.py", "LayerNormLinear"),
                        ("layernorm_mlp.py", "LayerNormMLP"), ("grouped_linear.py", "GroupedLinear")):
        init = src.method(module, cls, "__init__")
        ok = init is not None and any(a.arg == "delay_wgrad_compute" for a in init.args.args + init.args.kwonlyargs)
        facts.append(Fact(f"{cls} takes delay_wgrad_compute", f"module/{module} {cls}.__init__", ok))
    return facts


def check_release(version: str, wheel: Path) -> list[Fact]:
    """Every :class:`Fact` for the TE release ``version`` read from ``wheel``."""
    src, v = _Source(wheel), _version(version)
    return (_queue_facts(src) + _backward_dw_facts(src, v) + _fp8_bias_facts(src) + _grouped_facts(src, v)
            + _mlp_and_weight_facts(src))
