#!/usr/bin/env python3
"""Plots the end-to-end and growth benchmarks from their CSV files.

    python3 benches/plot.py [--dir target/bench] [--out docs] [--e2e-name benchmarks.png]

Reads e2e.csv and growth.csv (either may be missing) from the repository's
target/bench, where `cargo bench -p benches` writes them, and writes
docs/benchmarks.png (throughput, latency, and CPU per request, the app's and
PostgreSQL's) and docs/benchmarks-growth.png. Needs matplotlib.
"""

import argparse
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The repository's root: the defaults are its target/bench and docs, wherever this runs.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Rows shown, in this order, with short labels.
E2E_ROWS = [
    ("bare", "bare app"),
    ("passthrough", "layer, no key"),
    ("memory", "MemoryStore\nnew keys"),
    ("lease", "lease\nnew keys"),
    ("lease_shared", "lease, shared\nclaims"),
    ("lease_batched", "lease, batched\nclaims"),
    ("lease_unbatched", "lease,\nbatching off"),
    ("http_floor_lease", "floor (h)\nover HTTP"),
    ("floor_lease", "floor (h)"),
    ("floor_lease_nonotify", "floor (h)\nno pg_notify"),
    ("peer", "peer (k)\nnew keys"),
    ("tx", "transactional\nnew keys"),
    ("http_floor_tx", "floor (i)\nover HTTP"),
    ("floor_tx", "floor (i)"),
    ("replay", "replays"),
    ("replay_shared", "replays,\nshared claims"),
    ("replay_batched", "replays,\nbatched claims"),
    ("replay_unbatched", "replays,\nbatching off"),
    ("http_floor_replay", "floor (j)\nover HTTP"),
    ("floor_replay", "floor (j)"),
    ("peer_replay", "peer (l)\nreplays"),
    ("floor_select", "SELECT\nby PK"),
    ("http_floor_select", "SELECT by PK\nover HTTP"),
    ("dup", "duplicates"),
]

LAYER_ROWS = {
    "passthrough",
    "memory",
    "lease",
    "lease_shared",
    "lease_batched",
    "lease_unbatched",
    "tx",
    "replay",
    "replay_shared",
    "replay_batched",
    "replay_unbatched",
    "dup",
}
PALETTE = ["#9ecae1", "#4292c6", "#08306b", "#6a51a3", "#238b45"]


def color_of(conc, c):
    return PALETTE[sorted(conc).index(c) % len(PALETTE)]


def read(path):
    if not os.path.exists(path):
        return None
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_e2e(rows, out):
    by = {(r["row"], int(r["concurrency"])): r for r in rows}
    present = [(k, label) for k, label in E2E_ROWS if any(key[0] == k for key in by)]
    conc = sorted({int(r["concurrency"]) for r in rows})
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(15, 13), sharex=True)
    width = 0.8 / len(conc)
    for i, c in enumerate(conc):
        xs, rps, lo, hi, p50, p99, app, pg = [], [], [], [], [], [], [], []
        for x, (k, _) in enumerate(present):
            r = by.get((k, c))
            if r is None:
                continue
            xs.append(x + (i - (len(conc) - 1) / 2) * width)
            v = float(r["rps"])
            rps.append(v)
            lo.append(v - float(r.get("rps_min") or v))
            hi.append(float(r.get("rps_max") or v) - v)
            p50.append(float(r["p50_ms"]))
            p99.append(float(r["p99_ms"]))
            app.append(float(r.get("app_cpu_us_per_req") or 0))
            pg.append(float(r.get("pg_cpu_us_per_req") or 0))
        color = color_of(conc, c)
        ax1.bar(xs, rps, width, yerr=[lo, hi], capsize=2, label=f"concurrency {c}", color=color)
        ax2.bar(xs, p99, width, color=color, label=f"p99, concurrency {c}")
        ax2.scatter(xs, p50, marker="_", s=120, color="#d94801", zorder=3,
                    label="p50" if i == 0 else None)
        ax3.bar(xs, app, width, color=color, label=f"app, concurrency {c}")
        ax3.bar(xs, pg, width, bottom=app, color=color, hatch="//", edgecolor="white",
                label="PostgreSQL (hatched)" if i == 0 else None)
    ax1.set_yscale("log")
    ax1.set_ylabel("requests/s (log; bars: median of the rounds, whiskers: min–max)")
    ax1.grid(axis="y", which="both", alpha=0.3)
    ax1.legend(loc="upper right")
    ax1.set_title("End to end over loopback: the layer (shaded), the bare app, and the database floor")
    ax2.set_yscale("log")
    ax2.set_ylabel("latency, ms (log; bars p99, dashes p50)")
    ax2.grid(axis="y", which="both", alpha=0.3)
    ax2.legend(loc="upper left", fontsize=8, ncol=2)
    ax3.set_ylabel("CPU µs per request (app, load generator included; PostgreSQL hatched)")
    ax3.grid(axis="y", alpha=0.3)
    ax3.legend(loc="upper right", fontsize=8, ncol=2)
    ax3.set_xticks(range(len(present)))
    ax3.set_xticklabels([label for _, label in present], fontsize=8)
    for x, (k, _) in enumerate(present):
        if k in LAYER_ROWS:
            for ax in (ax1, ax2, ax3):
                ax.axvspan(x - 0.45, x + 0.45, color="#fee6ce", alpha=0.5, zorder=0)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def human(n):
    n = int(n)
    if n >= 1_000_000:
        return f"{n / 1_000_000:.3g} M"
    if n >= 1000:
        return f"{n / 1000:.3g} k"
    return str(n)


def plot_growth(rows, out):
    phases = ("before", "during", "after")
    sized = [r for r in rows if not r["test"].startswith(phases)]
    purge = [r for r in rows if r["test"].startswith(phases)]
    tests = [t for t in ("new keys: claim", "new keys: completion", "replays: claim",
                         "replays: SELECT by primary key")
             if any(r["test"] == t for r in sized)]
    panels = len(tests) + (1 if purge else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4.8), squeeze=False)
    sizes = sorted({int(r["table_rows"]) for r in sized})
    conc = sorted({int(r["concurrency"]) for r in sized})
    for ax, test in zip(axes[0], tests):
        for c in conc:
            pts = {int(r["table_rows"]): r for r in sized
                   if r["test"] == test and int(r["concurrency"]) == c}
            xs = [i for i, n in enumerate(sizes) if n in pts]
            color = color_of(conc, c)
            ax.plot(xs, [float(pts[sizes[i]]["p99_ms"]) for i in xs], marker="o",
                    color=color, label=f"c={c} p99")
            ax.plot(xs, [float(pts[sizes[i]]["p50_ms"]) for i in xs], marker=".",
                    linestyle="--", color=color, label=f"c={c} p50")
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([human(n) for n in sizes])
        ax.set_xlabel("rows in the table")
        ax.set_ylabel("latency, ms")
        ax.set_ylim(bottom=0)
        ax.set_title(test)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if purge:
        ax = axes[0][-1]
        labels = [r["test"].replace(" the purge: ", "\n") for r in purge]
        xs = range(len(purge))
        ax.bar([x - 0.2 for x in xs], [float(r["p50_ms"]) for r in purge], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [float(r["p99_ms"]) for r in purge], 0.4, label="p99")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("latency, ms")
        ax.set_ylim(bottom=0)
        ax.set_title(f"purge of expired rows, c={purge[0]['concurrency']}\n"
                     f"({human(purge[0]['table_rows'])} rows before)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default=os.path.join(ROOT, "target", "bench"))
    parser.add_argument("--out", default=os.path.join(ROOT, "docs"))
    parser.add_argument("--e2e-name", default="benchmarks.png",
                        help="the end-to-end plot's file name in --out")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    e2e = read(os.path.join(args.dir, "e2e.csv"))
    if e2e:
        plot_e2e(e2e, os.path.join(args.out, args.e2e_name))
    growth = read(os.path.join(args.dir, "growth.csv"))
    if growth:
        plot_growth(growth, os.path.join(args.out, "benchmarks-growth.png"))
    if not e2e and not growth:
        raise SystemExit(f"no e2e.csv or growth.csv in {args.dir}")


if __name__ == "__main__":
    main()
