"""patches/: each patch applies to the installed megatron-core 0.16.1 and routes it into megatron-zb.

A copy of the installed ``megatron`` package gets the patch; a subprocess imports the copy and
runs megatron-core's own ``get_forward_backward_func()`` call site with and without
``MEGATRON_ZB_SCHEDULE``: same loss and gradients, and W really deferred when it is set.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))

CHECK = r"""
import json, sys
from functools import partial
import torch
import megatron.core, megatron_zb
from megatron_zb.testing import run_distributed
from megatron_zb.testing.tiny_gpt import TinyGPT, run_step_with_env

assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__
cfg = TinyGPT(pp=2)
ref = run_distributed(partial(run_step_with_env, cfg, env={"MEGATRON_ZB_SCHEDULE": None}, schedule=None),
                      world_size=2, timeout=120)
got = run_distributed(partial(run_step_with_env, cfg, env={"MEGATRON_ZB_SCHEDULE": "zb-h1"}, schedule=None),
                      world_size=2, timeout=120)
ref, got = TinyGPT.merge(ref), TinyGPT.merge(got)
print(json.dumps({
    "files": sorted({r for r in [megatron.core.__file__]}),
    "num_losses": [len(ref["losses"]), len(got["losses"])],
    "losses_equal": all(torch.equal(a, b) for a, b in zip(ref["losses"], got["losses"])),
    "grads_equal": ref["grads"].keys() == got["grads"].keys() and all(torch.equal(got["grads"][k], v) for k, v in ref["grads"].items()),
    "w_deferred_ref": ref["w_deferred"], "w_deferred_got": got["w_deferred"],
}))
"""


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_patch_applies_and_routes_megatron_core_into_megatron_zb(tmp_path, patch):
    import megatron

    src = Path(megatron.__path__[0])
    dst = tmp_path / "site" / "megatron"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(patch)], cwd=dst.parent, check=True,
                   capture_output=True, text=True, timeout=60)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(dst.parent), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", CHECK, str(dst.parent)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_losses"] == [4, 4], result  # every microbatch's loss, in both runs
    assert result["losses_equal"] and result["grads_equal"], result
    assert result["w_deferred_ref"] == 0 and result["w_deferred_got"] > 0, result
