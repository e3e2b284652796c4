"""Device lint: every tensor the runtime, the optimizer wrapper and the trainer allocate names its device.

On a GPU, a tensor created without ``device=`` lands on the CPU, and the first time it meets a
CUDA tensor (``cpu_counter += cuda_count``, a collective on an NCCL group) the run fails. On a
CPU machine nothing fails -- every tensor is on the CPU, and the meta device does not raise for
mixed CPU/meta arithmetic either -- so this static check is the guard (docs/runtime.md,
"Devices").

The rule, checked with :mod:`ast` on every module under :data:`LINTED_PACKAGES`:

* A call of a torch *allocating factory* (:data:`FACTORIES`: ``torch.zeros``, ``torch.tensor``,
  ``torch.empty``, ``torch.arange``, ...) must pass ``device=`` -- not ``device=None`` (the
  default device) and not a literal CPU device (``"cpu"``, ``torch.device("cpu")``): a tensor
  pinned to the CPU is a design decision and goes in :data:`ALLOWED` with its reason.
* ``*_like`` factories and ``Tensor.new_*`` methods take the device of their argument: fine.
* Host-memory constructors (:data:`HOST_FACTORIES`: ``torch.from_numpy``, ``torch.frombuffer``,
  ``torch.from_file``) create CPU tensors by nature; they pass only when the very next call is
  ``.to(device=...)`` (the keyword is required: ``.to(x)`` may be a dtype).
* Legacy typed constructors (``torch.Tensor(...)``, ``torch.FloatTensor(...)``, ...) always fail:
  they cannot allocate on a GPU.
* A factory used without being called (``make = torch.zeros if z else torch.empty``) fails: the
  lint cannot see the device of the later call. Call the factory directly.

Aliases are followed (``import torch as th``, ``from torch import zeros as z``). What the lint
cannot prove: that the *value* passed as ``device=`` is the right device at run time (only that
the author chose one), nor anything about code outside :data:`LINTED_PACKAGES`.

Run by hand: ``python tests/harness/device_lint.py`` (exit status 1 on findings).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

__all__ = ["ALLOWED", "FACTORIES", "HOST_FACTORIES", "LINTED_PACKAGES", "Finding", "LintResult",
           "lint_file", "lint_packages", "main"]

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Packages (paths relative to the repository root) whose tensors must follow the model's device.
LINTED_PACKAGES: tuple[str, ...] = ("megatron_zb/runtime", "megatron_zb/optimizer", "megatron_zb/training")

#: torch functions that allocate new memory on the default device unless told ``device=``.
FACTORIES: frozenset[str] = frozenset({
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "asarray", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor",
    "sparse_coo_tensor", "sparse_csr_tensor", "tril_indices", "triu_indices", "hann_window",
    "hamming_window", "bartlett_window", "blackman_window", "kaiser_window",
})

#: torch functions that wrap host memory: CPU by nature, fine only when moved at once.
HOST_FACTORIES: frozenset[str] = frozenset({"from_numpy", "frombuffer", "from_file"})

#: Legacy typed constructors: CPU-only allocations that cannot take a GPU device.
LEGACY_CONSTRUCTORS: frozenset[str] = frozenset({
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
    "ShortTensor", "IntTensor", "LongTensor", "BoolTensor",
})

#: Calls where the CPU is right by design: (file, enclosing function, factory) -> reason.
#: Every entry must still match a call (``LintResult.stale_allowed``), so the list cannot rot.
ALLOWED: dict[tuple[str, str, str], str] = {
    # The lm-loss sums are host-side float64 bookkeeping: each report is moved with
    # .to("cpu", float64) before it is added, and the totals are read with float().
    ("megatron_zb/training/gpt_step.py", "sum_lm_loss", "torch.zeros"): "host float64 loss total",
    ("megatron_zb/training/evaluation.py", "evaluate", "torch.zeros"): "host float64 loss total (sum_lm_loss)",
    # A value of a state dict *being loaded*: torch's Optimizer.load_state_dict moves `step` to the
    # parameter's device itself when the group is fused or capturable, and keeps it on the CPU
    # otherwise -- as torch's Adam creates it.
    ("megatron_zb/training/adam_repair.py", "_restore_zero_steps", "torch.tensor"):
        "optimizer state-dict value; load_state_dict places it",
    # torch's Adam hosts `step` on the CPU on purpose unless the group is fused or capturable
    # (torch/optim/adam.py, _init_group); adam_step puts it on the parameter's device then.
    ("megatron_zb/training/adam_repair.py", "adam_step", "torch.tensor"): "torch Adam's CPU-hosted step",
}


@dataclass(frozen=True)
class Finding:
    """One allocation the rule refuses.

    Attributes:
        path: file, relative to the repository root (``/`` separators).
        line: 1-based line of the call.
        function: dotted name of the enclosing function or class (``<module>`` at top level).
        factory: the callee as ``torch.<name>``.
        problem: what is wrong, in words.
    """

    path: str
    line: int
    function: str
    factory: str
    problem: str

    @property
    def key(self) -> tuple[str, str, str]:
        """The :data:`ALLOWED` key this finding matches."""
        return (self.path, self.function, self.factory)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.factory} in {self.function}: {self.problem}"


@dataclass(frozen=True)
class LintResult:
    """Findings of one lint run, split by the allow-list.

    Attributes:
        findings: every finding, allowed or not, in file and line order.
        refused: the findings not covered by the allow-list (the ones to fix).
        stale_allowed: allow-list keys that no finding matched any more (remove them).
    """

    findings: tuple[Finding, ...]
    refused: tuple[Finding, ...]
    stale_allowed: tuple[tuple[str, str, str], ...]

    @property
    def ok(self) -> bool:
        """True when nothing is refused and no allow-list entry is stale."""
        return not self.refused and not self.stale_allowed


def _torch_aliases(tree: ast.AST) -> tuple[set[str], dict[str, str]]:
    """Names bound to the torch module, and names bound to torch functions (local -> torch name)."""
    modules: set[str] = set()
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name == "torch")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            functions.update((a.asname or a.name, a.name) for a in node.names)
    return modules, functions


def _cpu_literal(node: ast.expr) -> bool:
    """``"cpu"`` / ``"cpu:0"`` or ``torch.device("cpu")``: a device pinned in the source."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split(":")[0] == "cpu"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "device":
        return bool(node.args) and _cpu_literal(node.args[0])
    return False


def _device_problem(call: ast.Call) -> str | None:
    """Why ``call``'s ``device=`` does not name a device (``None``: it does)."""
    device = next((k.value for k in call.keywords if k.arg == "device"), None)
    if device is None:
        if any(k.arg is None for k in call.keywords):
            return "device may hide in **kwargs: pass device= explicitly"
        return "no device=: allocates on the default device (the CPU)"
    if isinstance(device, ast.Constant) and device.value is None:
        return "device=None is the default device (the CPU)"
    if _cpu_literal(device):
        return "pinned to the CPU: allow-list it with the reason, or pass the model's device"
    return None


class _Visitor(ast.NodeVisitor):
    """Collects the findings of one module (see the module docstring for the rule)."""

    def __init__(self, path: str, tree: ast.AST) -> None:
        self.path = path
        self.modules, self.functions = _torch_aliases(tree)
        self.parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        self.scope: list[str] = []
        self.findings: list[Finding] = []

    def _torch_name(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.modules:
            return node.attr
        if isinstance(node, ast.Name) and node.id in self.functions:
            return self.functions[node.id]
        return None

    def _add(self, node: ast.expr, name: str, problem: str) -> None:
        function = ".".join(self.scope) or "<module>"
        self.findings.append(Finding(self.path, node.lineno, function, f"torch.{name}", problem))

    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Name(self, node: ast.Name) -> None:
        self._reference(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._reference(node)
        self.generic_visit(node)

    def _reference(self, node: ast.Name | ast.Attribute) -> None:
        """A factory named anywhere: called (check the call) or only referenced (refused)."""
        name = self._torch_name(node)
        if name is None or name not in FACTORIES | HOST_FACTORIES | LEGACY_CONSTRUCTORS:
            return
        parent = self.parents.get(node)
        if not (isinstance(parent, ast.Call) and parent.func is node):
            if name not in LEGACY_CONSTRUCTORS:  # torch.Tensor in annotations / isinstance is fine
                self._add(node, name, "referenced, not called: the lint cannot see its device; call it directly")
            return
        if name in LEGACY_CONSTRUCTORS:
            self._add(node, name, "legacy constructor: CPU only; use torch.empty(..., device=...)")
        elif name in HOST_FACTORIES:
            self._host(parent, name)
        else:
            problem = _device_problem(parent)
            if problem is not None:
                self._add(node, name, problem)

    def _host(self, call: ast.Call, name: str) -> None:
        """``torch.from_numpy(a)`` passes only as ``torch.from_numpy(a).to(device=...)``."""
        attr = self.parents.get(call)
        to_call = self.parents.get(attr) if isinstance(attr, ast.Attribute) and attr.attr == "to" else None
        if not (isinstance(to_call, ast.Call) and to_call.func is attr):
            self._add(call, name, "host memory: follow it with .to(device=...)")
        elif _device_problem(to_call) is not None:
            self._add(call, name, "host memory: its .to(...) must name device= (not the CPU)")


def lint_file(path: Path, *, root: Path = REPO_ROOT) -> list[Finding]:
    """The findings of one Python file (``path`` is reported relative to ``root``)."""
    rel = path.resolve().relative_to(root.resolve()).as_posix()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    visitor = _Visitor(rel, tree)
    visitor.visit(tree)
    return sorted(visitor.findings, key=lambda f: f.line)


def _python_files(packages: Iterable[str], root: Path) -> Iterator[Path]:
    for pkg in packages:
        yield from sorted((root / pkg).rglob("*.py"))


def lint_packages(packages: Iterable[str] = LINTED_PACKAGES, *, root: Path = REPO_ROOT,
                  allowed: Mapping[tuple[str, str, str], str] = ALLOWED) -> LintResult:
    """Lint every module under ``packages`` and split the findings by ``allowed``."""
    findings = tuple(f for path in _python_files(packages, root) for f in lint_file(path, root=root))
    matched = {f.key for f in findings}
    return LintResult(findings=findings,
                      refused=tuple(f for f in findings if f.key not in allowed),
                      stale_allowed=tuple(sorted(k for k in allowed if k not in matched)))


def main(argv: list[str] | None = None) -> int:
    """Print the findings (allowed ones marked) and stale allow-list entries; 1 if any is refused."""
    packages = tuple(argv if argv else sys.argv[1:]) or LINTED_PACKAGES
    result = lint_packages(packages)
    for f in result.findings:
        print(f"{f}{'  [allowed: ' + ALLOWED[f.key] + ']' if f.key in ALLOWED else ''}")
    for key in result.stale_allowed:
        print(f"stale allow-list entry (no such call any more): {key}")
    print(f"{len(result.refused)} refused, {len(result.findings) - len(result.refused)} allowed, "
          f"{len(result.stale_allowed)} stale")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
