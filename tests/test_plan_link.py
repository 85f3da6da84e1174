"""The planner picks by link (issue 51): ``accel-flatshard plan --link RATE[:LATENCY]`` against the bench's rows.

``tests/data/link_bench_rows.json``: our engines' rows of ``make bench-link`` (benchmarks/link_bench.py: llama-27M,
per-rank batch 2 x seq 128, AdamW, fp32, gloo, 2 machines of 1 or 2 ranks joined by a tc-shaped veth, unshaped and
1 / 10 Gbit/s).  The planner gets one compute figure per topology, the unshaped FULL_SHARD step (``--compute_ms``);
everything else is its model (``accel_flatshard/plan/link.py``): each predicted step within 25% of the measured
median, the recommendation among the measured engines the fastest measured (or within 5% of it), the bytes across
machines within 10% of the veth's counter (which adds TCP/IP headers), and the command line's reason line.
"""
from __future__ import annotations

import functools
import json
import os

import pytest
import torch

from accel_flatshard.core.options import FlatShardOptions
from accel_flatshard.plan import Config, Planner
from accel_flatshard.plan.link import Link, parse_link, plan_link
from accel_flatshard.tools.plan_cli import main as plan_main

ROWS = json.load(open(os.path.join(os.path.dirname(__file__), "data", "link_bench_rows.json")))["rows"]
SEQ, BATCH = 128, 2
UNSHAPED = Link(1e15)  # (the bench's unshaped veth: its cost is in the measured compute)
# benchmarks/link_bench.py MODELS, built as benchmarks/bench.py build_model builds them
LLAMA = {"llama-27M": dict(num_hidden_layers=6, hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                           vocab_size=8192),
         "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      vocab_size=256)}


def llama(name: str = "llama-27M", seq: int = SEQ) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    kw = LLAMA[name]
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        max_position_embeddings=seq, num_key_value_heads=kw["num_attention_heads"], use_cache=False, **kw))


def tiny() -> torch.nn.Module:  # (the command line's model: module:function)
    return llama("tiny", 16)


def _meta_llama() -> torch.nn.Module:
    with torch.device("meta"):
        return llama()


def _batch(n: int) -> dict:
    return {k: torch.zeros(n, SEQ, dtype=torch.long) for k in ("input_ids", "labels")}


OPTIONS = FlatShardOptions(auto_wrap="transformer")  # (bench.py: ours wraps each decoder layer)


@functools.lru_cache(maxsize=None)
def _planner(topology: str, accumulate: int) -> Planner:
    machines, per_machine = map(int, topology.split("x"))
    return Planner(_meta_llama, OPTIONS, machines * per_machine, BATCH * accumulate, _batch, "cpu",
                   num_machines=machines, tokens=SEQ)


def _launched(accumulate: int) -> Config:
    return Config(OPTIONS, BATCH, "no_sync" if accumulate > 1 else "none")


def _matches(engine: str, cfg: Config, per_machine: int) -> bool:
    """The bench's engine (benchmarks/patches.py) is this candidate."""
    parts, o = set(engine.split("+")[1:]), cfg.options
    return (o.reshard_after_forward == ("noreshard" not in parts)
            and (o.fsdp_group_size or 0) == (per_machine if "hybrid" in parts else 0)
            and o.node_local_backward_gather == ("hpz" in parts)
            and o.quantized_all_gather == o.quantized_reduce == ("int8" in parts))


def _phases():
    """Per (topology, accumulate, rate): the measured rows and the planner's rows for them."""
    out = []
    for key in sorted({(r["topology"], r["accumulate"]) for r in ROWS}):
        rows = [r for r in ROWS if (r["topology"], r["accumulate"]) == key]
        compute = next(r["median_s"] for r in rows if r["rate_gbit"] == 0 and r["engine"] == "ours")
        per_machine = int(key[0].split("x")[1])
        for rate in sorted({r["rate_gbit"] for r in rows}):
            link = Link(rate * 1e9) if rate else UNSHAPED
            planned = plan_link(_planner(*key), _launched(key[1]), link, compute)
            measured = [(r, next(p for p in planned if _matches(r["engine"], p.cfg, per_machine)))
                        for r in rows if r["rate_gbit"] == rate]
            out.append((key, rate, measured))
    return out


@pytest.fixture(scope="module")
def phases():
    return _phases()


def _print(phases) -> None:
    print("\n  topology acc rate    engine             measured s  predicted s    MB across meas / planned")
    for (topology, acc), rate, measured in phases:
        for r, p in measured:
            print(f"  {topology:8} {acc:3} {rate or 'unshaped':>7} {r['engine']:18} {r['median_s']:10.3f} "
                  f"{p.step_s:11.3f} {p.step_s / r['median_s'] - 1:+6.0%}  {r['cross_mb']:8.1f} / "
                  f"{p.across_bytes / 1e6:.1f}")


def test_link_forms_and_refusals(capsys):
    assert parse_link("1gbit") == Link(1e9)
    assert parse_link("10gbit:0.2ms") == Link(10e9, 0.2e-3)
    assert parse_link(" 400MBIT:50us ") == Link(400e6, pytest.approx(50e-6))
    assert parse_link("2.5gbit:1s") == Link(2.5e9, 1.0)
    for bad in ("1gbps", "gbit", "10gbit:3", "10gbit:", "0gbit", "-1gbit", "1gbit:0.2ms:1"):
        with pytest.raises(ValueError, match="--link"):
            parse_link(bad)
        # (refused before the model is built or traced)
        assert plan_main(["--model", "no.such:model", f"--link={bad}"]) == 1
        assert "--link" in capsys.readouterr().err
    assert plan_main(["--model", "no.such:model", "--compute_ms", "100"]) == 1
    assert "--compute_ms" in capsys.readouterr().err


@pytest.mark.ci
def test_predicted_step_within_25_percent_of_the_measured(phases):
    _print(phases)
    worst = max(((r, p) for _, _, measured in phases for r, p in measured),
                key=lambda rp: abs(rp[1].step_s / rp[0]["median_s"] - 1))
    r, p = worst
    assert abs(p.step_s / r["median_s"] - 1) <= 0.25, (r, p.step_s, p.compute_s, p.wire_s)


@pytest.mark.ci
def test_recommendation_is_the_measured_fastest(phases):
    # (at each link rate; the unshaped phase is the compute reference, where the configurations differ by noise)
    for key, rate, measured in [phase for phase in phases if phase[1]]:
        picked = min(measured, key=lambda rp: rp[1].step_s)[0]
        fastest = min(r["median_s"] for r, _ in measured)
        assert picked["median_s"] <= 1.05 * fastest, (key, rate, picked["engine"], [
            (r["engine"], r["median_s"], p.step_s) for r, p in measured])


@pytest.mark.ci
def test_bytes_across_within_10_percent_of_the_veth_counter(phases):
    for key, rate, measured in phases:
        for r, p in measured:
            assert abs(p.across_bytes / 1e6 / r["cross_mb"] - 1) <= 0.10, (key, rate, r["engine"], p.across_bytes)


@pytest.mark.ci
def test_cli_link_prints_the_table_and_reason(capsys):
    argv = ["--model", f"{os.path.abspath(__file__)}:tiny", "--seq_len", "16", "--batch_size", "2", "--device",
            "cpu", "--num_processes", "4", "--num_machines", "2", "--use_fsdp", "--fsdp_auto_wrap_policy",
            "TRANSFORMER_BASED_WRAP", "--link", "1gbit:0.1ms", "--compute_ms", "20"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "over a 1 Gbit/s, latency 0.1 ms link between 2 machines (2 ranks each)" in out
    for name in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD (group 2: a machine)", "FULL_SHARD + hpZ + int8"):
        assert f" {name} " in out
    reason = next(line for line in out.splitlines() if line.startswith("recommended: "))
    assert "MB across machines per step" in reason and "predicted" in reason
    assert plan_main(argv + ["--json"]) == 0
    link = json.loads(capsys.readouterr().out)["link"]
    assert link["recommended"]["name"] == link["candidates"][0]["name"]
    assert {c["name"] for c in link["candidates"] if c["lossy"]} == {c["name"] + " + int8" for c in
                                                                     link["candidates"] if not c["lossy"]}


def test_one_machine_is_refused(capsys):
    assert plan_main(["--model", f"{os.path.abspath(__file__)}:tiny", "--seq_len", "16", "--device", "cpu",
                      "--num_processes", "2", "--use_fsdp", "--link", "1gbit"]) == 1
    assert "--num_machines" in capsys.readouterr().err


@pytest.mark.ci  # (the ci stage has built the 2 x 2 planner for the rows above: 15 s less in make test)
def test_a_shard_group_inside_a_machine_sends_nothing_across():
    rows = plan_link(_planner("2x2", 1), _launched(1), Link(1e9), 1.0)
    hybrid = next(r for r in rows if r.name.startswith("HYBRID_SHARD") and not r.lossy)
    # (only the replicas' all-reduce crosses: each rank's shard of the gradients, both ranks of the machine)
    assert {kind for (kind, where), n in hybrid.sent.items() if where == "inter" and n} == {"replica all-reduce"}
