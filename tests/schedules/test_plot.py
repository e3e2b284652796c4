"""Tests of the text timeline, the summary table, the matplotlib plot and the gallery script."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from megatron_zb.cli import Costs, build_and_simulate
from megatron_zb.schedules import CostModel, simulate
from megatron_zb.schedules.generators.baselines import one_f_one_b
from megatron_zb.schedules.generators.handcrafted import zb_h1
from megatron_zb.schedules.plot import OP_COLORS, plot_timeline, shade
from megatron_zb.schedules.registry import schedule_names
from megatron_zb.schedules.text import auto_width, summary_table, timeline_rows, timeline_text

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- text
def test_timeline_rows_of_zb_h1():
    res = simulate(zb_h1(num_ranks=2, num_microbatches=2), CostModel())
    # rank 0: F0 F1 . B0 W0 B1 W1 ; rank 1: . F0 B0 F1 B1 W0 W1
    assert timeline_rows(res) == ["FF.BWBW", ".FBFBWW"]
    assert timeline_rows(res, style="mb") == ["01.0011", ".001101"]


def test_timeline_quantisation_uses_column_midpoints():
    res = simulate(one_f_one_b(num_ranks=2, num_microbatches=2), CostModel())  # total time 9
    assert auto_width(res) == 9
    rows = timeline_rows(res, 3)  # columns of 3 time units, midpoints 1.5, 4.5, 7.5
    assert rows == ["FXX", "FF."]
    assert all(len(r) == 27 for r in timeline_rows(res, 27))
    with pytest.raises(ValueError):
        timeline_rows(res, 0)
    with pytest.raises(ValueError):
        timeline_rows(res, style="bogus")  # type: ignore[arg-type]


def test_auto_width_is_capped_and_follows_shortest_action():
    res = simulate(one_f_one_b(num_ranks=2, num_microbatches=2), CostModel(t_f=0.25, t_b=1, t_w=1))
    assert auto_width(res) == round(res.total_time / 0.25)
    big = simulate(one_f_one_b(num_ranks=2, num_microbatches=200), CostModel())
    assert auto_width(big) == 120


def test_timeline_text_has_legend_and_one_line_per_rank():
    res = simulate(one_f_one_b(num_ranks=3, num_microbatches=4), CostModel())
    text = timeline_text(res)
    lines = text.splitlines()
    assert lines[0].startswith("timeline: 1 column = 1 time units") and "X fused backward" in lines[0]
    assert [ln.split("|")[0].strip() for ln in lines[1:]] == ["rank 0", "rank 1", "rank 2"]
    assert "X" in lines[1] and "B" not in lines[1].split("|")[1]
    assert len(timeline_text(res, legend=False).splitlines()) == 3


def test_summary_table_numbers():
    res = simulate(one_f_one_b(num_ranks=4, num_microbatches=8), CostModel())
    table = summary_table(res, memory_unit="M_B")
    assert "bubble rate         0.2727 (27.27%)" in table
    assert "makespan            33" in table
    assert "isolated iteration  33" in table
    assert "peak memory         4 M_B" in table
    rows = [ln.split() for ln in table.splitlines() if ln.strip()[:1].isdigit()]
    assert [(r[0], r[-1]) for r in rows] == [("0", "4"), ("1", "3"), ("2", "2"), ("3", "1")]
    assert all(r[2] == "24" for r in rows)  # busy


# ---------------------------------------------------------------------------------- plot
def _has_color(img: np.ndarray, rgb: tuple[float, float, float], min_pixels: int = 50) -> bool:
    close = np.all(np.abs(img[..., :3] - np.asarray(rgb)) < 1.5 / 255, axis=-1)
    return int(close.sum()) >= min_pixels


def _hex(c: str) -> tuple[float, float, float]:
    return shade(c, 0, 1)


def test_png_shows_the_ops_present_in_their_colours(tmp_path):
    import matplotlib.image as mpimg
    out = tmp_path / "1f1b.png"
    res = simulate(one_f_one_b(num_ranks=3, num_microbatches=4), CostModel())
    res.schedule.name = "1f1b"
    plot_timeline(res, out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    img = mpimg.imread(out)
    assert img.shape[0] > 300 and img.shape[1] > 1000
    assert _has_color(img, _hex(OP_COLORS["F"])) and _has_color(img, _hex(OP_COLORS["BW"]))
    assert not _has_color(img, _hex(OP_COLORS["B"]), 1) and not _has_color(img, _hex(OP_COLORS["W"]), 1)


def test_second_chunk_is_a_lighter_shade(tmp_path):
    import matplotlib.image as mpimg
    for c in OP_COLORS.values():
        base, light = shade(c, 0, 2), shade(c, 1, 2)
        assert all(lt > b for lt, b in zip(light, base) if b < 1) and light != base
    assert len(set(OP_COLORS.values())) == 8   # F, B, W, BW and the four vocabulary passes
    _, res = build_and_simulate("interleaved-1f1b", pp=2, microbatches=4, chunks=2)
    out = tmp_path / "il.png"
    plot_timeline(res, out, title="my title")
    img = mpimg.imread(out)
    for op in ("F", "BW"):
        assert _has_color(img, shade(OP_COLORS[op], 0, 2)) and _has_color(img, shade(OP_COLORS[op], 1, 2))


def test_svg_output_is_valid_and_has_a_box_per_action(tmp_path):
    out = tmp_path / "deep" / "zb.svg"
    res = simulate(zb_h1(num_ranks=3, num_microbatches=3), CostModel())
    plot_timeline(res, out)
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    n_actions = sum(len(a) for a in res.schedule.ranks)
    paths = [e for e in root.iter() if e.tag.endswith("path")]
    assert len(paths) >= n_actions
    assert out.stat().st_size > 10_000


# ---------------------------------------------------------------------------------- gallery
def test_gallery_script_writes_images_and_page(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_gallery
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    done, missing = make_gallery.make(tmp_path, 3, 4, only=["1f1b", "zb-h1"])
    page = make_gallery.write_markdown(tmp_path, 3, 4, done, missing).read_text()
    assert [d["name"] for d in done] == ["1f1b", "zb-h1"] and not missing
    for name in ("1f1b", "zb-h1"):
        png = tmp_path / "gallery" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG"
        assert f"![{name} timeline, p=3, m=4](gallery/{name}.png)" in page
    for name in schedule_names():  # the table lists every registered schedule
        assert f"| `{name}` |" in page
    _, res = build_and_simulate("zb-h1", pp=3, microbatches=4, costs=Costs())
    assert f"Bubble rate {100 * res.bubble_rate:.2f}%" in page
    assert ('{"num_microbatches": m, "stage_to_rank": [...], '
            '"ranks": [[{"op": "F", "mb": 0, "stage": 0}, ...], ...]}') in page


def test_dp_reduce_is_drawn_only_when_modelled(tmp_path):
    import dataclasses

    import matplotlib.image as mpimg

    from megatron_zb.schedules.dp_reduce import DPReduceModel
    from megatron_zb.schedules.plot import REDUCE_COLOR
    sched = one_f_one_b(num_ranks=2, num_microbatches=2)
    with_dp = dataclasses.replace(CostModel(), dp_reduce=DPReduceModel(stage_bytes=4.0, bucket_bytes=1.0,
                                                                       bandwidth=1.0))
    for costs, name in ((CostModel(), "plain.png"), (with_dp, "dp.png")):
        plot_timeline(simulate(sched, costs), tmp_path / name)
    assert not _has_color(mpimg.imread(tmp_path / "plain.png"), _hex(REDUCE_COLOR), 1)
    assert _has_color(mpimg.imread(tmp_path / "dp.png"), _hex(REDUCE_COLOR))
