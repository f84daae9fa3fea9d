#!/usr/bin/env python3
"""What a retrying client lives through, end to end.

Runs the payments demo (two processes on a PostgreSQL of their own) and drives it with
Python `requests` and urllib3's `Retry`, configured as careful API clients configure
them: POST retried on connect errors, read timeouts and 409/502/503, `Retry-After`
honoured, a 2 s read timeout, one key per payment. Optionally breaks something while
the payments run: the database restarts, or a demo process is killed with SIGKILL and
started again.

It checks what must hold, and exits non-zero if it does not:
  - nothing lost: every payment ends 201, and its key's charge and payment exist once;
  - nothing run twice: one charge per key (the provider's own count);
  - no call ends on a status the retry policy treats as final while its body says to
    retry (a 500 saying "retry with the same key", say).
It reports, and never asserts, the clients' time to a 201: p50 and p99 for fast
payments, their concurrent duplicates, and slow payments (a handler longer than the
read timeout).

    retrying_clients.py --demo target/debug/examples/payments [--scenario none|db-restart|kill]
                        [--mode lease|transactional] [--wait-ms N] [--payments N]
                        [--spread-s S] [--slow-ms N] [--json]
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

READ_TIMEOUT = 2.0
CONNECT_TIMEOUT = 1.0
# Statuses the clients retry; any other non-2xx status ends a call.
RETRIED = (409, 502, 503)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_as_postgres():
    """The prefix that runs a PostgreSQL binary as `postgres` when this runs as root."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def pg_bin(name):
    for version in sorted(os.listdir("/usr/lib/postgresql"), reverse=True):
        path = f"/usr/lib/postgresql/{version}/bin/{name}"
        if os.path.exists(path):
            return path
    found = shutil.which(name)
    if not found:
        sys.exit(f"{name} not found: install PostgreSQL's server package")
    return found


class Database:
    """A PostgreSQL cluster of its own, in a temporary directory, on a free port."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ti-clients-pg-")
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
        subprocess.run(
            run_as_postgres()
            + [pg_bin("initdb"), "-D", self.data, "-U", "postgres", "--auth=trust", "-N"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        self.start()

    @property
    def url(self):
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def ctl(self, *args, check=True):
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        return subprocess.run(
            run_as_postgres()
            + [pg_bin("pg_ctl"), "-D", self.data, "-l", os.path.join(self.dir, "log"),
               "-o", options, "-w", *args],
            check=check,
            stdout=subprocess.DEVNULL,
        )

    def start(self):
        self.ctl("start")

    def stop(self, mode="fast"):
        self.ctl("stop", "-m", mode)

    def psql(self, sql):
        out = subprocess.run(
            ["psql", self.url, "-At", "-c", sql], check=True, capture_output=True, text=True
        )
        return out.stdout.strip()

    def close(self):
        self.ctl("stop", "-m", "immediate", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


class Demo:
    """One payments demo process."""

    def __init__(self, binary, database_url, mode, wait_ms, port=None):
        self.binary, self.database_url, self.mode, self.wait_ms = binary, database_url, mode, wait_ms
        self.port = port or free_port()
        self.process = None
        self.start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self):
        self.process = subprocess.Popen(
            [self.binary, "--addr", f"127.0.0.1:{self.port}", "--database-url", self.database_url,
             "--mode", self.mode, "--wait-ms", str(self.wait_ms)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{self.url}/stats", timeout=1).read()
                return
            except OSError:
                if self.process.poll() is not None:
                    sys.exit(f"the demo exited with {self.process.returncode} on start")
                time.sleep(0.05)
        sys.exit("the demo did not come up")

    def kill(self):
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def close(self):
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


def session():
    """A client as the docs recommend (docs/clients.md): POST retried, Retry-After honoured."""
    retry = Retry(
        total=30,
        connect=15,
        read=6,
        status=30,
        other=3,
        allowed_methods=None,  # POST too: the key makes it safe to repeat
        status_forcelist=RETRIED,
        backoff_factor=0.1,
        backoff_max=2,
        respect_retry_after_header=True,
        raise_on_status=False,
    )
    s = requests.Session()
    s.mount("http://", HTTPAdapter(max_retries=retry))
    return s


def says_retry(body):
    return "retry" in body.lower()


class Payment:
    def __init__(self, kind, key, delay_ms, amount, target):
        self.kind, self.key, self.delay_ms = kind, key, delay_ms
        # `target`: the demo process the first call goes to (later ones go round).
        self.amount, self.target = amount, target
        self.seconds = None
        self.calls = 0
        self.ended_on = []  # (status, says retry) of calls that did not end 201


def pay(payment, urls, settle_until):
    """Sends the payment until it gets a 201: each call is one `requests` call, which
    retries by itself; a call that ends otherwise is recorded, then the payment is sent
    again (a careful client's settle loop)."""
    s = session()
    body = {"amount": payment.amount, "currency": "EUR", "delay_ms": payment.delay_ms}
    started = time.monotonic()
    while time.monotonic() < settle_until:
        url = urls[(payment.target + payment.calls) % len(urls)]
        payment.calls += 1
        try:
            r = s.post(
                f"{url}/payments",
                json=body,
                headers={"Idempotency-Key": payment.key},
                timeout=(CONNECT_TIMEOUT, READ_TIMEOUT),
            )
        except requests.RequestException as e:
            payment.ended_on.append((type(e).__name__, False))
            continue
        if r.status_code == 201:
            payment.seconds = time.monotonic() - started
            return
        retry = says_retry(r.text)
        payment.ended_on.append((r.status_code, retry))
        if r.status_code not in RETRIED and r.status_code < 500 and not retry:
            # Refused for good: a client would not send it again.
            return
        time.sleep(0.2)


def percentile(values, p):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--demo", required=True)
    parser.add_argument("--scenario", choices=["none", "db-restart", "kill"], default="none")
    parser.add_argument("--mode", choices=["lease", "transactional"], default="lease")
    parser.add_argument("--wait-ms", type=int, default=0)
    parser.add_argument("--payments", type=int, default=60)
    parser.add_argument("--spread-s", type=float, default=6.0,
                        help="the payments start evenly over this many seconds")
    parser.add_argument("--slow-ms", type=int, default=3000,
                        help="the slow payments' handler time, past the 2 s read timeout")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    db = Database()
    demos = []
    try:
        demos = [Demo(args.demo, db.url, args.mode, args.wait_ms) for _ in range(2)]
        urls = [d.url for d in demos]
        # Fast payments (0-300 ms), each with a concurrent duplicate; slow ones (3 s, past
        # the read timeout).
        payments, duplicates = [], []
        for i in range(args.payments):
            slow = i % 6 == 5
            delay = args.slow_ms if slow else rng.randint(0, 300)
            key = f"{args.scenario}-{args.mode}-{i}"
            p = Payment("slow" if slow else "fast", key, delay, 1000 + i, i)
            payments.append(p)
            if not slow:
                duplicates.append(Payment("duplicate", key, delay, 1000 + i, i + 1))
        everyone = payments + duplicates
        settle_until = time.monotonic() + 120
        fault = threading.Thread(target=break_something, args=(args.scenario, db, demos))
        # Payments start evenly over `--spread-s`, each fast one's duplicate 50 ms after
        # it; the fault comes 2 s in, while payments of every kind are on their way.
        gap = args.spread_s / len(payments)
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(everyone)) as pool:
            futures = []
            if args.scenario != "none":
                fault.start()
            by_key = {d.key: d for d in duplicates}
            for i, p in enumerate(payments):
                time.sleep(max(0.0, started + i * gap - time.monotonic()))
                futures.append(pool.submit(pay, p, urls, settle_until))
                if p.key in by_key:
                    time.sleep(0.05)
                    futures.append(pool.submit(pay, by_key[p.key], urls, settle_until))
            for f in futures:
                f.result()
        if fault.ident:
            fault.join()

        report = summarise(args, everyone, db)
    finally:
        for d in demos:
            d.close()
        db.close()
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    sys.exit(0 if report["ok"] else 1)


def break_something(scenario, db, demos):
    time.sleep(2.0)
    if scenario == "db-restart":
        db.stop("fast")
        time.sleep(2.0)
        db.start()
    elif scenario == "kill":
        victim = demos[0]
        victim.kill()
        time.sleep(1.0)
        victim.start()


def summarise(args, everyone, db):
    keys = sorted({p.key for p in everyone})
    schema = "payments_demo"
    charges = int(db.psql(f"SELECT count(*) FROM {schema}.demo_psp_charges"))
    payments_recorded = int(db.psql(f"SELECT count(*) FROM {schema}.demo_payments"))
    lost = [p.key for p in everyone if p.seconds is None]
    final_with_retry = [
        (p.key, status) for p in everyone for status, retry in p.ended_on
        if isinstance(status, int) and status not in RETRIED and retry
    ]
    by_kind = {}
    for kind in ("fast", "duplicate", "slow"):
        times = [p.seconds for p in everyone if p.kind == kind and p.seconds is not None]
        by_kind[kind] = {
            "n": len(times),
            "p50": percentile(times, 50),
            "p99": percentile(times, 99),
            "max": max(times) if times else None,
        }
    ended = {}
    for p in everyone:
        for status, _ in p.ended_on:
            ended[str(status)] = ended.get(str(status), 0) + 1
    ok = not lost and charges == len(keys) and payments_recorded == len(keys) and not final_with_retry
    return {
        "scenario": args.scenario,
        "mode": args.mode,
        "wait_ms": args.wait_ms,
        "keys": len(keys),
        "charges": charges,
        "payments": payments_recorded,
        "lost": lost,
        "final_status_saying_retry": final_with_retry,
        "calls_not_ending_201": ended,
        "calls": sum(p.calls for p in everyone),
        "seconds_to_201": by_kind,
        "ok": ok,
    }


def print_report(r):
    def s(v):
        return "-" if v is None else f"{v:.2f}"

    print(f"scenario {r['scenario']}, {r['mode']} mode, wait {r['wait_ms']} ms: "
          f"{r['keys']} keys, {r['charges']} charges, {r['payments']} payments, "
          f"{r['calls']} calls")
    for kind, t in r["seconds_to_201"].items():
        print(f"  {kind:9} n={t['n']:3}  p50 {s(t['p50'])} s  p99 {s(t['p99'])} s  max {s(t['max'])} s")
    if r["calls_not_ending_201"]:
        print(f"  calls that did not end 201: {r['calls_not_ending_201']}")
    if r["lost"]:
        print(f"  LOST: {r['lost']}")
    if r["final_status_saying_retry"]:
        print(f"  ENDED ON A FINAL STATUS THAT SAYS RETRY: {r['final_status_saying_retry']}")
    if r["charges"] != r["keys"] or r["payments"] != r["keys"]:
        print("  CHARGES OR PAYMENTS DO NOT MATCH THE KEYS")
    print("  ok" if r["ok"] else "  FAILED")


if __name__ == "__main__":
    main()
