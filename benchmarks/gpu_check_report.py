"""gpu_check.sh's report: what comes back from a GPU run, in at most two files (standard library only).

The device machine returns at most 8 files of at most 16 MiB each from ``$OUT``, plus the last 12,000
characters of the output.  So the parts write their logs and traces to a work folder, and this script puts
exactly two files into ``$OUT``:

* ``summary.txt``: self-contained: the environment line, the expected wall time, the archive's contents, and
  every part's verdict with its figures (the indented check lines of its log; the last lines of a failed one).
  This script prints it, last in gpu_check.sh's output, so the output's tail is the summary too; when it would
  not fit in the 12,000 characters, the passing parts' parity rows are folded into a count (then, if needed,
  passing parts show their verdicts only), and the printed summary says so.
* ``gpu_check_logs.tar.gz``: every log and trace of the work folder, at most ``--max-archive-mib`` (15 MiB, under
  the 16 MiB limit).  When it would be larger, traces (``*.json``) are left out, largest first, and then logs are
  cut to their last MiB; the summary and a ``LEFT_OUT.txt`` in the archive say what was dropped.

    python3 benchmarks/gpu_check_report.py --work WORK --out OUT --expected "..."
"""
from __future__ import annotations

import argparse
import io
import sys
import tarfile
from pathlib import Path
from typing import Dict, List, Tuple

ARCHIVE = "gpu_check_logs.tar.gz"
SUMMARY = "summary.txt"
MAX_LINE = 400  # characters of one figure line in the summary
MAX_PART_LINES = 60
MAX_STDOUT_SUMMARY = 11_000  # the output's last 12,000 characters come back: the summary must fit in them


def read_verdicts(work: Path) -> List[Dict[str, str]]:
    """``verdicts.tsv``: one line per part: name, verdict, seconds, timeout (tab-separated), in run order."""
    rows = []
    path = work / "verdicts.tsv"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, verdict, seconds, timeout = (line.split("\t") + ["", "", ""])[:4]
        rows.append({"name": name, "verdict": verdict, "seconds": seconds, "timeout": timeout})
    return rows


def figures(log: str, failed: bool) -> List[str]:
    """The lines of a part's log that carry its checks and numbers: the indented ones, the section headers and
    the verdict lines; for a failed part also its last 20 lines (the traceback)."""
    lines = log.splitlines()
    keep = [ln for ln in lines if ln.startswith("  ") or ln.startswith("[") or "PASS" in ln or "FAIL" in ln
            or "SKIP" in ln or "not measured" in ln]
    keep = keep[:MAX_PART_LINES]
    if failed:
        tail = [ln for ln in lines[-20:] if ln not in keep]
        keep += ["  -- last lines of the log:"] + [f"  | {ln}" for ln in tail]
    return [ln if len(ln) <= MAX_LINE else ln[:MAX_LINE] + " ..." for ln in keep]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def build_archive(work: Path, target: Path, max_bytes: int) -> Tuple[int, List[str], List[str]]:
    """Write ``target`` from every file under ``work``; returns (size, names in it, what was left out or cut)."""
    files = sorted(p for p in work.rglob("*") if p.is_file())
    traces = sorted((p for p in files if p.suffix == ".json"), key=lambda p: p.stat().st_size, reverse=True)
    dropped: List[Path] = []
    cut = False
    while True:
        left_out = [f"{p.relative_to(work)} ({p.stat().st_size / 2**20:.1f} MiB, a trace: left out to fit)" for p in dropped]
        if cut:
            left_out.append("logs over 1 MiB cut to their last MiB")
        with tarfile.open(target, "w:gz", compresslevel=6) as tar:
            names = []
            for p in files:
                if p in dropped:
                    continue
                data = p.read_bytes()
                if cut and len(data) > 2**20:
                    data = b"[cut: first bytes left out to fit the archive]\n" + data[-2**20:]
                _add(tar, f"gpu_check/{p.relative_to(work)}", data)
                names.append(str(p.relative_to(work)))
            if left_out:
                _add(tar, "gpu_check/LEFT_OUT.txt", ("\n".join(left_out) + "\n").encode())
        size = target.stat().st_size
        if size <= max_bytes:
            return size, names, left_out
        if len(dropped) < len(traces):
            dropped.append(traces[len(dropped)])
        elif not cut:
            cut = True
        else:
            return size, names, left_out + ["STILL OVER THE LIMIT"]


def _is_parity_row(line: str) -> bool:
    return line.rstrip().endswith("PASS") and ("max|dloss|" in line or "losses [" in line)


def fold_parity_rows(lines: List[str], part: str) -> List[str]:
    """A passing part's parity rows (``... max|dloss|=... PASS``) as one line that counts them."""
    rows = [ln for ln in lines if _is_parity_row(ln)]
    if not rows:
        return lines
    kept = [ln for ln in lines if not _is_parity_row(ln)]
    return [f"  {len(rows)} parity rows PASS (each in {part}.log of the archive and in summary.txt)"] + kept


def summary_text(work: Path, rows: List[Dict[str, str]], expected: str, archive: Tuple[int, List[str], List[str]],
                 level: int = 0) -> str:
    """``level`` 0: everything; 1: passing parts' parity rows folded into a count; 2: passing parts' verdicts
    only (the output's tail must hold the summary: gpu_check.sh prints the shortest level that fits)."""
    env = (work / "environment.log").read_text().strip() if (work / "environment.log").exists() else "?"
    overall = "PASS" if rows and all(r["verdict"].startswith(("PASS", "SKIP (1 GPU")) for r in rows) else "FAIL"
    size, names, left_out = archive
    out = [f"gpu_check summary: {overall}", f"environment: {env}", f"expected wall time: {expected}",
           f"archive: {ARCHIVE}, {size / 2**10:.0f} KiB, {len(names)} files"
           + (f"; left out: {'; '.join(left_out)}" if left_out else "; nothing left out")]
    for r in rows:
        timing = f" ({r['seconds']} s of a {r['timeout']} s timeout)" if r["timeout"] else ""
        out.append(f"== {r['name']}: {r['verdict']}{timing}")
        log = work / f"{r['name']}.log"
        failed = not r["verdict"].startswith(("PASS", "SKIP"))
        if log.exists() and (failed or level < 2):
            lines = figures(log.read_text(errors="replace"), failed)
            out += fold_parity_rows(lines, r["name"]) if level == 1 and not failed else lines
    out.append(f"gpu_check: {overall}")
    return "\n".join(out) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="where the parts wrote their logs and traces")
    p.add_argument("--out", type=Path, required=True, help="what comes back: the archive and summary.txt")
    p.add_argument("--expected", default="?", help="the expected wall time line (gpu_check.sh computes it)")
    p.add_argument("--max-archive-mib", type=float, default=15.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = read_verdicts(args.work)
    archive = build_archive(args.work, args.out / ARCHIVE, int(args.max_archive_mib * 2**20))
    text = summary_text(args.work, rows, args.expected, archive)
    (args.out / SUMMARY).write_text(text)  # (the file comes back whole)
    for level in (0, 1, 2):  # the output: the most complete level that fits in its tail
        shown = summary_text(args.work, rows, args.expected, archive, level)
        if len(shown) <= MAX_STDOUT_SUMMARY:
            break
    print(shown + ("" if level == 0 else f"(shortened to fit the output's tail; whole in {SUMMARY})\n"), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
