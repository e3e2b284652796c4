"""Shared test fixtures: paper reference data and cost models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import settings

from megatron_zb.planning.memory import mem_w_ratio
from megatron_zb.schedules import CostModel

# Randomized tests are derandomized in CI (and whenever HYPOTHESIS_PROFILE=ci): the same examples
# on every run, so a landing never depends on a draw. Run `HYPOTHESIS_PROFILE=dev pytest ...` or
# pass `--hypothesis-seed N` to explore other draws locally.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

DATA = Path(__file__).parent / "data"


def paper_rows() -> list[dict]:
    """The zero-bubble paper's profiled rows (Tables 3, 5, 9), with the M_W / M_B ratio added."""
    d = json.loads((DATA / "zb_paper_costs.json").read_text())
    rows = []
    for row in d["rows"]:
        md = d["models"][row["model"]]
        h, a, s = md["hidden"], md["heads"], md["seq"]
        rows.append(dict(row, p=md["p"], mem_w_ratio=mem_w_ratio(hidden_size=h, num_attention_heads=a, seq_length=s)))
    return rows


def paper_costs(row: dict, memory_limit: float | None = None) -> CostModel:
    """Per-stage cost model of one paper row, memory in units of one stage's M_B."""
    return CostModel(t_f=row["TF"], t_b=row["TB"], t_w=row["TW"], t_comm=row["Tcomm"], mem_b=1.0,
                     mem_w=row["mem_w_ratio"], memory_limit=memory_limit)


@pytest.fixture(params=paper_rows(), ids=lambda r: f"{r['model']}-m{r['m']}")
def paper_row(request) -> dict:
    return request.param
