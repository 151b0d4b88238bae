"""The GPU suites' verdicts (bench/gpu_check.sh, issue 26), from the files the steps leave:

    python -m bench.gpu_summary tests DIR      # DIR/junit-*.xml -> per file, per kernel switch
    python -m bench.gpu_summary without DIR    # the switches whose tests did not all pass
    python -m bench.gpu_summary winners DIR    # DIR/kernels.json: each passing switch vs default
    python -m bench.gpu_summary spec DIR       # DIR/spec.json (bench.gpu_spec): RESULTS' table

Every kernel behind a KernelConfig switch is known here by the tests that exercise it (SWITCH_TESTS,
patterns over "file::test[params]"); every other GPU test is on the default path. `tests` writes
DIR/switches.json: per switch its passed and failed counts and a verdict (passed, FAILED, or not
run: a switch none of whose tests ran is never called good). `winners` compares each switch's
benchmark rows with the default kernel's rows of the same op and shape; a switch that passed its
tests and is faster at every shape (by more than the 3% that two timings of one kernel differ)
is named a winner, to become the KernelConfig default.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET

SWITCH_TESTS = {
    "prefill=fa2": r"^test_cuda_prefill_fa2\.py::.*\[fa2",
    "prefill=fa3": r"^test_cuda_prefill_fa2\.py::.*\[fa3",
    "decode=split": r"^test_cuda_flash_decode\.py::",
    "marlin=pipeline": r"^test_cuda_marlin\.py::.*-pipelined\]",
    "fp8=cutlass": r"cutlass|^test_cuda_fp8\.py::test_fp8_linear_matches_cpu\[True",
    "fp8_gemv=on": r"^test_cuda_fp8_gemv\.py::",
    "sampling=fused": r"^test_cuda_fused_sampling\.py::",
    "moe=fused": r"^test_cuda_moe\.py::",
    "graphs_lora=on": r"^test_cuda_graphs_verify_lora\.py::test_(lora_linear_slots|adapter_rows)",
    # the runner's replay test covers both (verify graphs over adapter slots): credited here
    "graphs_verify=on": (r"^test_cuda_graphs_verify_lora\.py::"
                         r"test_(verify_steps|runner_replays|runner_hands_over|head_targets)"),
    "graphs_parallel=on": r"^test_cuda_(tensor|pipeline)_parallel\.py::test_graphs_parallel_",
}
NOISE = 0.03    # two timings of one kernel differ by about this much


def read_junit(path: str):
    """(test id, outcome) for each test case: outcome passed, failed, error or skipped."""
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        test_id = f"{module}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        yield test_id, outcome


def switch_of(test_id: str) -> str | None:
    for switch, pattern in SWITCH_TESTS.items():
        if re.search(pattern, test_id):
            return switch
    return None


def tally(results) -> dict:
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for _, outcome in results:
        counts[outcome] += 1
    return counts


def verdict(counts: dict) -> str:
    if counts["failed"] or counts["error"]:
        return "FAILED"
    return "passed" if counts["passed"] else "not run"


def tests(folder: str) -> dict:
    files = sorted(glob.glob(os.path.join(folder, "junit-*.xml")))
    per_switch = {s: [] for s in SWITCH_TESTS}
    print(f"{'test file':<34} {'passed':>6} {'failed':>6} {'errors':>6} {'skipped':>7}")
    failures = []
    for path in files:
        try:
            results = list(read_junit(path))
        except (ET.ParseError, OSError) as e:
            print(f"{os.path.basename(path):<34} unreadable ({e}): the step did not finish")
            continue
        c = tally(results)
        name = os.path.basename(path)[len("junit-"):-len(".xml")]
        print(f"{name:<34} {c['passed']:>6} {c['failed']:>6} {c['error']:>6} {c['skipped']:>7}")
        for test_id, outcome in results:
            s = switch_of(test_id)
            if s:
                per_switch[s].append((test_id, outcome))
            if outcome in ("failed", "error"):
                failures.append(f"{outcome.upper()} {test_id}")
    if failures:
        print(f"-- {len(failures)} failing (first 30):")
        for line in failures[:30]:
            print("  " + line[:170])
    summary = {}
    print(f"-- kernel switches:\n{'switch':<18} {'passed':>6} {'failed':>6}  verdict")
    for s, results in per_switch.items():
        c = tally(results)
        summary[s] = dict(passed=c["passed"], failed=c["failed"] + c["error"],
                          verdict=verdict(c))
        print(f"{s:<18} {c['passed']:>6} {c['failed'] + c['error']:>6}  {summary[s]['verdict']}")
    with open(os.path.join(folder, "switches.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def is_default(switch: str) -> bool:
    from pyx.kernel_config import KernelConfig
    key, value = switch.split("=")
    return getattr(KernelConfig(), key) == value


def not_passed(folder: str) -> list[str]:
    """The switches off the default path whose tests did not all pass (or did not run)."""
    try:
        with open(os.path.join(folder, "switches.json")) as f:
            summary = json.load(f)
    except OSError:
        summary = {}                     # no verdicts: no switch is trusted
    return sorted(s for s in SWITCH_TESTS
                  if not is_default(s) and summary.get(s, {}).get("verdict") != "passed")


def baseline_variant(op: str, variant: str, group: list[dict]) -> str | None:
    """The default kernel's row a switch's row is compared with (same op and shape: `group`)."""
    if op in ("decode_attention", "prefill_attention"):
        return next((r["variant"] for r in group if r.get("switch") is None), None)
    if op == "qgemm":
        # the default FP8 path dequantizes at load and then is the bf16 GEMM
        return {"fp8-cutlass": "bf16", "fp8-gemv": "bf16"}.get(variant)
    if op == "sample_fused" and variant.startswith("fused "):
        return "op-by-op " + variant[len("fused "):]
    if op == "moe" and variant.startswith("grouped "):
        return "per-expert " + variant[len("grouped "):]
    return None


def winners(folder: str) -> dict:
    with open(os.path.join(folder, "kernels.json")) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("time_us")]
    passed = set(SWITCH_TESTS) - set(not_passed(folder))
    times = {(r["op"], r["shape"], r["variant"]): r["time_us"] for r in rows}
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["op"], r["shape"]), []).append(r)
    ratios: dict[str, list] = {}
    for r in rows:
        s = r.get("switch")
        base = (baseline_variant(r["op"], r["variant"], groups[(r["op"], r["shape"])])
                if s else None)
        ref = times.get((r["op"], r["shape"], base))
        if ref:
            ratios.setdefault(s, []).append((ref / r["time_us"], r["shape"], r["variant"]))
    result = {}
    print(f"{'switch':<16} {'tests':<8} {'rows':>4} {'geomean':>8} {'worst':>6}  verdict")
    for s in sorted(ratios):
        speedups = [x for x, _, _ in ratios[s]]
        geo = math.exp(sum(map(math.log, speedups)) / len(speedups))
        worst = min(ratios[s])
        # the former defaults (decode=simple, ...) have no tests of their own here
        tested = "passed" if s in passed else "FAILED" if s in SWITCH_TESTS else "n/a"
        win = tested == "passed" and worst[0] > 1 + NOISE
        mixed = tested == "passed" and not win and geo > 1 + NOISE
        result[s] = dict(geomean=geo, worst=worst[0], worst_at=f"{worst[1]} {worst[2]}",
                         tests=tested, winner=win)
        why = ("WINNER: faster at every shape" if win else
               f"mixed: slower at {worst[1]}" if mixed else
               "tests failed" if tested == "FAILED" else "not faster")
        print(f"{s:<16} {tested:<8} {len(speedups):>4} {geo:>7.2f}x {worst[0]:>5.2f}x  {why}")
    with open(os.path.join(folder, "winners.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def spec(folder: str) -> list[str]:
    """bench.gpu_spec's rows as the Markdown table bench/RESULTS.md takes, one line a row, and a
    line naming the rows whose greedy tokens were not the expected ones."""
    with open(os.path.join(folder, "spec.json")) as f:
        rows = json.load(f)["rows"]
    if not rows:
        return ["FAILED: spec.json has no rows (the step ended before its first)"]
    first = rows[0]
    lines = [f"speculative decoding: {first['device']}; target "
             f"{first['target_bytes_per_step'] / 1e9:.2f} GB a step, draft {first['draft_bytes_per_step'] / 1e9:.2f} GB; draft agreement "
             f"{first['draft_agreement']}, prompt edits {first['edit_rate']}; {first['gen_len']} "
             f"tokens out",
             "| B | method | graphs_verify | decode tok/s | vs none | vs bound (bound tok/s) "
             "| acceptance | tokens/verify | graph replays: decode + verify / steps "
             "| greedy tokens as expected |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"] or 0, METHOD_ORDER.index(r["method"]),
                                         r["graphs_verify"])):
        method = r["method"] + (f" k={r['k']}" if r["method"] != "none" else "")
        if "error" in r:         # the engine failed: no figures, the error instead
            lines.append(f"| - | {method} | {r['graphs_verify']} | FAILED: "
                         f"{r['error'][:150]} | | | | | | |")
            continue
        vs_none = f"{r['vs_none']:.2f}x" if "vs_none" in r else ""
        acc = f"{100 * r['acceptance']:.1f} %" if "acceptance" in r else ""
        tpv = f"{r['tokens_per_verify']:.2f}" if "tokens_per_verify" in r else ""
        g = r.get("graph_replays")
        graphs = (f"{g.get('1', 0)} + {g.get(str(r['k'] + 1), 0)} / {r['decode_steps']}"
                  if g is not None else "no graphs")
        setting = r["graphs_verify"] if r["method"] != "none" else ""
        lines.append(f"| {r['batch']} | {method} | {setting} | {r['decode_tok_s']:.1f} | {vs_none} | {r['vs_bound']:.2f} "
                     f"({r['bound_tok_s']:.0f}) | {acc} | {tpv} | {graphs} "
                     f"| {r['expected_tokens']}/{r['tokens']} |")
    wrong = [r for r in rows if "error" not in r and r["expected_tokens"] != r["tokens"]]
    failed = [f"{r['method']} graphs_verify {r['graphs_verify']}" for r in rows if "error" in r]
    if wrong or failed:
        lines.append("FAILED: " + "; ".join(
            (["greedy tokens not the expected count in " + ", ".join(
                f"B={r['batch']} {r['method']} graphs_verify {r['graphs_verify']}"
                for r in wrong)] if wrong else [])
            + (["no figures from " + ", ".join(failed)] if failed else [])))
    return lines


METHOD_ORDER = ("none", "ngram", "draft_model")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["tests", "without", "winners", "spec"])
    ap.add_argument("dir")
    args = ap.parse_args(argv)
    if args.action == "tests":
        summary = tests(args.dir)
        return 0 if all(v["verdict"] != "FAILED" for v in summary.values()) else 1
    if args.action == "without":
        print(",".join(not_passed(args.dir)))
        return 0
    if args.action == "spec":
        lines = spec(args.dir)
        print("\n".join(lines))
        return 1 if lines[-1].startswith("FAILED") else 0
    winners(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
