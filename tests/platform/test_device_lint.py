"""The device lint (harness.device_lint) on the package, and the rule on small sources.

``test_package_allocations_name_their_device`` is the guard of docs/runtime.md "Devices": every
torch allocation under runtime/, optimizer/ and training/ names its device, or is in the
allow-list with its reason. It is a static check run on CPU: it proves that a device was chosen,
not that the chosen device is right at run time on a GPU.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from harness.device_lint import ALLOWED, LINTED_PACKAGES, REPO_ROOT, lint_file, lint_packages

def test_package_allocations_name_their_device():
    result = lint_packages()
    refused = [str(f) for f in result.refused]
    assert not refused, "tensor allocations without a device (pass the model's device):\n" + "\n".join(refused)


def test_allow_list_entries_still_match_a_call():
    assert not lint_packages().stale_allowed, "remove these ALLOWED entries: the call is gone"


def test_allow_list_is_short_and_explained():
    assert len(ALLOWED) <= 8
    for (path, function, factory), reason in ALLOWED.items():
        assert any(path.startswith(p + "/") for p in LINTED_PACKAGES), path
        assert factory.startswith("torch.") and function and reason.strip()


def test_every_linted_package_exists_and_is_scanned():
    for pkg in LINTED_PACKAGES:
        assert (REPO_ROOT / pkg / "__init__.py").is_file(), pkg


# ====================================================================== the rule on small sources
def _problems(tmp_path: Path, source: str) -> list[tuple[int, str, str]]:
    f = tmp_path / "m.py"
    f.write_text(textwrap.dedent(source))
    return [(x.line, x.factory, x.problem) for x in lint_file(f, root=tmp_path)]


@pytest.mark.parametrize("call", [
    "torch.zeros(2)", "torch.tensor([1.0], dtype=torch.float64)", "torch.empty(3, 4)", "torch.full((2,), 1.0)",
    "torch.arange(4)", "torch.as_tensor([1])", "torch.randn(2)", "torch.linspace(0, 1, 5)", "torch.eye(3)",
    "torch.zeros(2, device=None)", "torch.zeros(2, device='cpu')", "torch.zeros(2, device=torch.device('cpu'))",
    "torch.zeros(2, **kw)",
])
def test_allocations_without_a_device_are_found(tmp_path, call):
    [(line, factory, _)] = _problems(tmp_path, f"import torch\ndef f(dev, kw):\n    return {call}\n")
    assert line == 3 and factory == "torch." + call.split("(")[0].split(".")[1]


@pytest.mark.parametrize("call", [
    "torch.zeros(2, device=dev)", "torch.tensor([1.0], device=x.device)", "torch.zeros_like(x)",
    "torch.empty_like(x, dtype=torch.int)", "x.new_zeros(3)", "x.new_tensor([1])", "torch.stack([x, x])",
    "torch.from_numpy(a).to(device=dev)", "isinstance(x, torch.Tensor)", "torch.zeros(2, device='cuda')",
])
def test_allocations_with_a_device_pass(tmp_path, call):
    assert _problems(tmp_path, f"import torch\ndef f(dev, x, a):\n    return {call}\n") == []


def test_aliases_references_host_memory_and_legacy_constructors(tmp_path):
    src = """\
        import torch as th
        from torch import zeros as z, from_numpy
        def f(a, dev):
            make = th.zeros if a else th.empty
            return z(2), from_numpy(a), from_numpy(a).to(th.float32), th.FloatTensor(2), th.Tensor(3)
        """
    found = {(line, factory) for line, factory, _ in _problems(tmp_path, src)}
    assert found == {(4, "torch.zeros"), (4, "torch.empty"), (5, "torch.zeros"), (5, "torch.from_numpy"),
                     (5, "torch.FloatTensor"), (5, "torch.Tensor")}
    assert len(_problems(tmp_path, src)) == 7  # both from_numpy calls on line 5


def test_findings_name_the_enclosing_function_and_stale_entries_are_reported(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("import torch\nclass C:\n    def g(self):\n        return torch.ones(1)\n")
    allowed = {("pkg/m.py", "C.g", "torch.ones"): "host", ("pkg/m.py", "gone", "torch.zeros"): "was here"}
    result = lint_packages(["pkg"], root=tmp_path, allowed=allowed)
    assert [str(f).split(":")[:2] for f in result.findings] == [["pkg/m.py", "4"]]
    assert result.refused == () and result.stale_allowed == (("pkg/m.py", "gone", "torch.zeros"),)
    assert not result.ok
