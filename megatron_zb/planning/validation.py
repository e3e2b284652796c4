"""Print the planner's validation against the zero-bubble paper (the tables of docs/planning.md).

Usage: ``python -m megatron_zb.planning.validation COSTS.json THROUGHPUT.json`` with the paper's
Table 9 costs and Table 4 throughput (``tests/data/zb_paper_costs.json``,
``tests/data/zb_paper_throughput.json``). Settings: the paper's Table 3 shapes on A100s, fp16,
first/last stage one layer fewer (``--allow-padding-num-layers``, as the paper's implementation),
vocabulary 32000 (not stated by the paper; its implementation's example tokenizer), the default
hardware efficiencies.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .flops import p2p_time_ms, stage_costs
from .hardware import resolve_hardware
from .layout import LayerSplit, stage_shapes
from .model import make_model, make_parallel
from .planner import plan

VOCAB = 32000


def _setting(md: dict, m: int):
    model = make_model(num_layers=md["layers"], hidden_size=md["hidden"], num_attention_heads=md["heads"],
                       seq_length=md["seq"], micro_batch_size=md["b"], vocab_size=VOCAB, precision="fp16")
    return model, make_parallel(model, pp=md["p"], num_microbatches=m, allow_padding_num_layers=True)


def costs_table(costs: dict) -> list[str]:
    """Estimated / published T_F, T_B, T_W (middle stage) and T_comm, per Table 9 row."""
    hw = resolve_hardware(gpu="A100")
    out = ["| model | m | T_F est / paper | T_B est / paper | T_W est / paper | T_comm est / paper |",
           "| --- | --- | --- | --- | --- | --- |"]
    for row in costs["rows"]:
        model, par = _setting(costs["models"][row["model"]], row["m"])
        shapes = stage_shapes(num_layers=model.num_layers, pp=par.pp, placement="plain",
                              split=LayerSplit(allow_padding=True))
        mid = stage_costs(model, par, hw, shapes)[par.pp // 2]
        cells = [f"{e:.2f} / {row[k]:.2f} = **{e / row[k]:.3f}**" for e, k in
                 ((mid.f.time_ms, "TF"), (mid.b.time_ms, "TB"), (mid.w.time_ms, "TW"))]
        tc = p2p_time_ms(model, par, hw)
        cells.append(f"{tc:.3f} / {row['Tcomm']:.3f} = {tc / row['Tcomm']:.2f}")
        out.append(f"| {row['model']} | {row['m']} | " + " | ".join(cells) + " |")
    return out


def throughput_table(tp: dict) -> list[str]:
    """Predicted vs Table 4 throughput (samples/s/GPU), ZB-2p/1F1B ratios, peak memory."""
    hw = resolve_hardware(gpu="A100")
    out = ["| model | GPUs | m | 1F1B pred / paper | ZB-1p pred / paper | ZB-2p pred / paper | ZB-2p/1F1B pred "
           "| paper | diff | peak GiB 1F1B / ZB-1p / ZB-2p |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in tp["throughput_samples_per_gpu_per_s"]:
        model, par = _setting(tp["models"][row["model"]], row["m"])
        fam = {f.name: f for f in plan(model=model, parallel=par, hardware=hw,
                                       schedules=["1f1b", "zb-1p", "zb-2p"]).families}
        pred = fam["zb-2p"].throughput / fam["1f1b"].throughput
        paper = row["ZB-2p"] / row["1F1B"]
        cells = [f"{fam[n].throughput:.3f} / {row[k]}" for n, k in (("1f1b", "1F1B"), ("zb-1p", "ZB-1p"),
                                                                   ("zb-2p", "ZB-2p"))]
        mem = " / ".join(f"{fam[n].peak_memory_gib:.1f}" for n in ("1f1b", "zb-1p", "zb-2p"))
        out.append(f"| {row['model']} | {row['gpus']} | {row['m']} | " + " | ".join(cells)
                   + f" | {pred:.3f} | {paper:.3f} | {pred - paper:+.3f} | {mem} |")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.splitlines()[2], file=sys.stderr)
        return 2
    costs, tp = (json.loads(Path(p).read_text()) for p in argv)
    print("\n".join(costs_table(costs)))
    print()
    print("\n".join(throughput_table(tp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
