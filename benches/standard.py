#!/usr/bin/env python3
"""The standard rows of the end-to-end benchmark in three settings, and their table.

    python3 benches/standard.py [--out target/bench/standard] [--commit-delay-us 2000]
                                [--only local,remote,slow-commits] [--table-only] [--plot]

Runs `cargo bench -p benches --bench e2e` three times, with the rows

    lease, lease_unbatched, peer, floor_lease, http_floor_lease, floor_select,
    http_floor_select, replay, replay_unbatched

at the concurrencies of BENCH_CONCURRENCY (1, 16, 64 by default):

- local:         PostgreSQL on 127.0.0.1, connected directly;
- remote:        every connection through a proxy holding each direction 250 µs
                 (BENCH_DB_DELAY_US=250), a database 0.5 ms away;
- slow-commits:  every connection of the rows with `commit_delay` set to
                 --commit-delay-us and `commit_siblings = 0` (BENCH_COMMIT_DELAY_US):
                 each WAL flush waits that long first, the commits that arrive
                 meanwhile going with it, as on a slow disk.

Each run writes its CSV under --out/<setting>/e2e.csv and its tables to
--out/<setting>.txt. Then it prints one Markdown table of the three (req/s and p50
of each row, the ratios the targets are stated in, each taken within one run, and the
CPU each row spent a request in the app and in PostgreSQL) and writes it to
--out/standard.md. Every other BENCH_* variable (BENCH_SECS,
BENCH_REPEAT, BENCH_POOL_SIZE, ...) is passed on as it is. `--table-only` rebuilds the
table from CSVs already there; `--plot` draws each setting with benches/plot.py
(matplotlib) into docs/benchmarks-<setting>.png.
"""

import argparse
import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROWS = [
    ("lease", "(c) lease, default (batched)"),
    ("lease_unbatched", "(c-u) lease, batching off"),
    ("peer", "(k) peer, new keys"),
    ("floor_lease", "(h) floor: claim + completion"),
    ("http_floor_lease", "(h″) floor (h) in a bare handler, over HTTP"),
    ("floor_select", "(j′) floor: SELECT by primary key"),
    ("http_floor_select", "(j′ over HTTP) floor (j′) in a bare handler"),
    ("replay", "(e) replays, default (batched)"),
    ("replay_unbatched", "(e-u) replays, batching off"),
]


def settings(commit_delay_us):
    return [
        ("local", "local database", {}),
        ("remote", "0.5 ms away (BENCH_DB_DELAY_US=250)", {"BENCH_DB_DELAY_US": "250"}),
        (
            "slow-commits",
            f"slow commits (BENCH_COMMIT_DELAY_US={commit_delay_us})",
            {"BENCH_COMMIT_DELAY_US": str(commit_delay_us)},
        ),
    ]


def run(out, name, extra):
    env = dict(os.environ)
    env.setdefault("BENCH_ROWS", ",".join(r for r, _ in ROWS))
    env.update(extra)
    env["BENCH_OUT_DIR"] = os.path.join(out, name)
    os.makedirs(env["BENCH_OUT_DIR"], exist_ok=True)
    with open(os.path.join(out, f"{name}.txt"), "w") as log:
        proc = subprocess.run(
            ["cargo", "bench", "-p", "benches", "--bench", "e2e"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=sys.stderr,
            text=True,
        )
        log.write(proc.stdout)
    if proc.returncode != 0:
        sys.exit(f"{name}: cargo bench failed ({proc.returncode})")


def read(out, name):
    path = os.path.join(out, name, "e2e.csv")
    if not os.path.exists(path):
        return None
    rows = {}
    with open(path) as f:
        for r in csv.DictReader(f):
            rows[(r["row"], int(r["concurrency"]))] = r
    return rows


def ratio(a, b):
    return f"{a / b:.2f}×" if a and b else "—"


def table(out, commit_delay_us):
    lines = []
    for name, title, _ in settings(commit_delay_us):
        rows = read(out, name)
        if rows is None:
            continue
        cs = sorted({c for _, c in rows})
        def per_row(head, columns, cell):
            lines.append(f"| {head} | " + " | ".join(columns(c) for c in cs) + " |")
            lines.append("|---|" + "---:|" * len(cs))
            for row, label in ROWS:
                cells = []
                for c in cs:
                    r = rows.get((row, c))
                    cells.append(cell(r) if r else "—")
                lines.append(f"| {label} | " + " | ".join(cells) + " |")

        lines.append(f"**{title}**\n")
        per_row(
            "row",
            lambda c: f"c = {c}: req/s, p50 ms",
            lambda r: f"{float(r['rps']):.0f}, {float(r['p50_ms']):.2f}",
        )

        def rps(row, c):
            r = rows.get((row, c))
            return float(r["rps"]) if r else None

        def p50(row, c):
            r = rows.get((row, c))
            return float(r["p50_ms"]) if r else None

        ratios = [
            ("default lease ÷ floor (h)", lambda c: ratio(rps("lease", c), rps("floor_lease", c))),
            (
                "default lease ÷ lease unbatched",
                lambda c: ratio(rps("lease", c), rps("lease_unbatched", c)),
            ),
            (
                "default lease p50 ÷ floor (h) p50",
                lambda c: ratio(p50("lease", c), p50("floor_lease", c)),
            ),
            (
                "default lease ÷ (h″), over HTTP both",
                lambda c: ratio(rps("lease", c), rps("http_floor_lease", c)),
            ),
            (
                "default lease p50 ÷ (h″) p50, over HTTP both",
                lambda c: ratio(p50("lease", c), p50("http_floor_lease", c)),
            ),
            ("replay default ÷ floor (j′)", lambda c: ratio(rps("replay", c), rps("floor_select", c))),
            (
                "replay default ÷ (j′ over HTTP)",
                lambda c: ratio(rps("replay", c), rps("http_floor_select", c)),
            ),
            (
                "replay default ÷ replay unbatched",
                lambda c: ratio(rps("replay", c), rps("replay_unbatched", c)),
            ),
        ]
        for label, f in ratios:
            lines.append(f"| *{label}* | " + " | ".join(f(c) for c in cs) + " |")
        lines.append("")
        # Where the app, its HTTP client and PostgreSQL share the machine's CPUs, a
        # row's rate is bound by the CPU it spends a request, on both sides.
        per_row(
            "CPU a request, µs: app + PostgreSQL",
            lambda c: f"c = {c}",
            lambda r: f"{float(r['app_cpu_us_per_req']):.0f} + {float(r['pg_cpu_us_per_req']):.0f}",
        )
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(out, "standard.md"), "w") as f:
        f.write(text + "\n")
    print(text)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "target", "bench", "standard"))
    p.add_argument("--commit-delay-us", type=int, default=2000)
    p.add_argument("--only", default="local,remote,slow-commits")
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--plot", action="store_true")
    a = p.parse_args()
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    if not a.table_only:
        only = set(a.only.split(","))
        for name, title, extra in settings(a.commit_delay_us):
            if name in only:
                print(f"== {title}", file=sys.stderr, flush=True)
                run(out, name, extra)
    table(out, a.commit_delay_us)
    if a.plot:
        for name, _, _ in settings(a.commit_delay_us):
            if read(out, name) is not None:
                subprocess.run(
                    [
                        sys.executable,
                        os.path.join(ROOT, "benches", "plot.py"),
                        "--dir",
                        os.path.join(out, name),
                        "--e2e-name",
                        f"benchmarks-{name}.png",
                    ],
                    check=True,
                )


if __name__ == "__main__":
    main()
