"""The figures of docs/figures/ (issue 47, ``make docs-figures``): ``accel-flatshard plan --plot`` (its module,
accel_flatshard/tools/plan_plot.py), the step timeline's trace parsing and drawing (tools/step_timeline.py) and the bench
figure (benchmarks/bench_plot.py), each on tiny inputs.  matplotlib is in the test extra: nothing here is skipped."""
from __future__ import annotations

import json
import sys

import pytest

from launch_helpers import CPU_FSDP_YAML, REPO

from accel_flatshard.tools.plan_cli import main as plan_main

sys.path[:0] = [str(REPO / "tools"), str(REPO / "benchmarks")]
import bench_plot  # noqa: E402  (benchmarks/bench_plot.py)
import step_timeline  # noqa: E402  (tools/step_timeline.py)
from step_timeline import Bar  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    return path.exists() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG


# ---------------------------------------------------------------------- accel-flatshard plan --plot
def test_plan_plot_writes_a_png_for_a_small_model_function(tmp_path, capsys):
    out = tmp_path / "plan.png"
    status = plan_main(["--model", "tests/plan_rows.py:toy", "--make_batch", "tests/plan_rows.py:toy_cli_batch",
                        "--batch_size", "4", "--use_fsdp", "--num_processes", "2", "--fsdp_auto_wrap_policy",
                        "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block,Scale", "--device",
                        "cpu", "--plot", str(out)])
    assert status == 0, capsys.readouterr().err
    assert _is_png(out)


@pytest.fixture
def llama_dir(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, vocab_size=64,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(
        tmp_path / "model")
    return tmp_path / "model"


def test_plan_plot_writes_a_png_for_a_model_directory_with_a_measured_run(llama_dir, tmp_path, capsys):
    measured = tmp_path / "measured.json"  # (tests/scripts/plan_measure.py --curve's format)
    measured.write_text(json.dumps({"peak_bytes": [300_000, 290_000], "curve": [[100_000, 300_000, 120_000],
                                                                                [100_000, 290_000, 110_000]]}))
    out = tmp_path / "figures" / "plan.png"
    status = plan_main(["--model", str(llama_dir), "--config_file", str(CPU_FSDP_YAML), "--batch_size", "2",
                        "--seq_len", "16", "--device", "cpu", "--plot", str(out), "--measured", str(measured)])
    assert status == 0, capsys.readouterr().err
    assert _is_png(out)


def test_the_planned_curve_peaks_at_the_plans_peak_split_by_kind(llama_dir):
    """The plot's curve is the plan's own: its largest total is the predicted peak, split as the table splits it."""
    from accel_flatshard.plan import run
    from accel_flatshard.tools.plan_cli import build_parser, planned

    args, launch = build_parser().parse_known_args(["--model", str(llama_dir), "--config_file", str(CPU_FSDP_YAML),
                                                    "--batch_size", "2", "--seq_len", "16", "--device", "cpu"])
    planner, cfg = planned(args, launch)
    pred = run.predict(planner, cfg, curve=True)
    assert pred.curve and all(set(parts) == set(run.PARTS) for _, parts in pred.curve)
    assert max(sum(parts.values()) for _, parts in pred.curve) == pred.peak_bytes == planner.predict(cfg).peak_bytes
    assert {where.split(" ")[0] for where, _ in pred.curve} == {"forward", "backward", "optimizer"}


def test_plan_plot_without_matplotlib_names_the_docs_extra(llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (import matplotlib raises ImportError)
    status = plan_main(["--model", str(llama_dir), "--config_file", str(CPU_FSDP_YAML), "--seq_len", "16",
                        "--device", "cpu", "--plot", str(tmp_path / "plan.png")])
    assert status == 1 and "pip install 'accel_flatshard[docs]'" in capsys.readouterr().err


# ---------------------------------------------------------------------- the step timeline
def _x(name, ts, dur, ph="X"):
    return {"ph": ph, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}


SYNTHETIC_TRACE = {"traceEvents": [
    _x("ProfilerStep#1", 1000, 10000),
    _x("flatshard::forward", 1100, 3000),  # (the phase: its units' spans are drawn)
    _x("flatshard::all_gather[u0]", 1100, 200),
    _x("flatshard::sent[forward gather|64|0]", 1250, 0),
    _x("flatshard::wait_all_gather[u0]", 1400, 100),
    _x("flatshard::forward[u0]", 1500, 2000),
    _x("aten::mm", 1600, 500),
    _x("flatshard::backward", 5000, 4000),
    _x("flatshard::reduce_scatter[u0]", 7000, 300),
    _x("flatshard::wait_reduce_scatter[u0]", 8800, 200),
    _x("Optimizer.step#AdamW.step", 9200, 500),
    _x("flatshard::all_gather[u1]", 20000, 100),  # (after the step)
    _x("flatshard::all_gather[u1]", 1200, 0, ph="i"),  # (not a complete event)
]}


def test_timeline_rows_per_rank_and_stream_kind_from_a_chrome_trace():
    rows = step_timeline.timeline_rows(SYNTHETIC_TRACE, rank=1)
    assert rows == {
        (1, "compute"): [Bar(0.5, 2.0, "compute", "u0"), Bar(4.0, 2.0, "compute", "u0"), Bar(6.0, 2.0, "compute", ""),
                         Bar(8.2, 0.5, "optimizer", "")],
        (1, "all-gather"): [Bar(0.1, 0.4, "in flight", "u0"), Bar(0.1, 0.2, "issue", "u0"),
                            Bar(0.4, 0.1, "wait", "u0")],
        (1, "reduce-scatter"): [Bar(6.0, 2.0, "in flight", "u0"), Bar(6.0, 0.3, "issue", "u0"),
                                Bar(7.8, 0.2, "wait", "u0")],
    }


def test_timeline_plot_writes_a_png_from_trace_files(tmp_path):
    for rank in (0, 1):
        (tmp_path / f"flatshard_trace_rank{rank}.json").write_text(json.dumps(SYNTHETIC_TRACE))
    rows, step = step_timeline.rows_from_dir(str(tmp_path))
    assert step == "ProfilerStep#1" and rows[(0, "compute")] == rows[(1, "compute")]
    assert sorted(rows) == sorted((r, kind) for r in (0, 1) for kind in step_timeline.STREAMS)
    step_timeline.plot_timeline(rows, str(tmp_path / "timeline.png"), "synthetic, W=2")
    assert _is_png(tmp_path / "timeline.png")


def test_timeline_draws_the_step_whose_slowest_rank_was_fastest(tmp_path):
    """Of the steps every rank profiled, the least disturbed: the smallest duration of the slowest rank."""
    durations = {0: (9000, 5000, 6000), 1: (4000, 7000, 5500)}  # rank -> ProfilerStep#1..3 (us)
    for rank, steps in durations.items():
        events, t = [], 0
        for n, dur in enumerate(steps, 1):
            events += [_x(f"ProfilerStep#{n}", t, dur), _x(f"flatshard::forward[u{n}]", t + 10, 100)]
            t += dur
        (tmp_path / f"flatshard_trace_rank{rank}.json").write_text(json.dumps({"traceEvents": events}))
    rows, step = step_timeline.rows_from_dir(str(tmp_path))
    assert step == "ProfilerStep#3" and rows[(1, "compute")] == [Bar(0.01, 0.1, "compute", "u3")]


# ---------------------------------------------------------------------- the bench figure
BENCH_SAMPLE = {"argv": ["benchmarks/bench.py", "--quick"], "table": "", "results": [
    {"row": "llama-5M", "params": 5_000_000, "engines": ["ddp", "fsdp1", "fsdp2", "nocomm", "ours"],
     "times": [[1.0, 2.0, 1.0], [1.3, 2.6, 1.4], [1.5, 3.0, 1.6], [0.9, 1.8, 0.8], [1.1, 2.0, 1.0]],
     "sent_mb": [0.0, 0.0, 0.0, 0.0, 30.5]},
    {"row": "llama-40M", "params": 40_000_000, "engines": ["ddp", "fsdp1", "fsdp2", "nocomm", "ours"],
     "times": [[2.0, 2.0], [2.8, 2.8], [3.2, 3.2], [1.6, 1.6], [2.0, 1.9]],
     "sent_mb": [0.0, 0.0, 0.0, 0.0, 240.0]},
]}


def test_bench_ratios_are_medians_of_paired_steps_against_ddp():
    r = bench_plot.ratios(BENCH_SAMPLE["results"])
    assert [round(x, 3) for _, _, x in r["fsdp1"]] == [1.3, 1.4]
    assert [round(x, 3) for _, _, x in r["ours"]] == [1.0, 0.975]
    assert bench_plot.sent(BENCH_SAMPLE["results"]) == [(5_000_000, "llama-5M", 30.5), (40_000_000, "llama-40M", 240.0)]


def test_bench_plot_reads_a_json_sample_and_writes_a_png(tmp_path):
    sample = tmp_path / "bench.json"
    sample.write_text(json.dumps(BENCH_SAMPLE))
    assert bench_plot.main([str(sample), str(tmp_path / "bench.png")]) == 0
    assert _is_png(tmp_path / "bench.png")


LINK_SAMPLE = {"head": "tiny", "rows": [
    {"topology": "2x1", "accumulate": 1, "rate_gbit": rate, "engine": e, "median_s": t, "bound_s": b}
    for rate, e, t, b in ((0.0, "ddp", 0.9, 0.9), (1.0, "ddp", 1.4, 0.9), (10.0, "ddp", 1.0, 0.9),
                          (0.0, "ours", 1.1, 1.1), (1.0, "ours", 2.1, 1.2), (10.0, "ours", 1.2, 1.1))]}


def test_link_series_orders_rates_with_unshaped_last():
    series = bench_plot.link_series(LINK_SAMPLE["rows"])
    assert series[("2x1", 1)]["ddp"] == [(1.0, 1.4), (10.0, 1.0), (float("inf"), 0.9)]


def test_link_plot_reads_a_json_sample_and_writes_a_png(tmp_path):
    sample = tmp_path / "link.json"
    sample.write_text(json.dumps(LINK_SAMPLE))
    assert bench_plot.main(["--link", str(sample), str(tmp_path / "link.png")]) == 0
    assert (tmp_path / "link.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
