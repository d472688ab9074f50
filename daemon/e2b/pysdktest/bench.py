# Sandbox.create() + commands.run('true') through E2B's Python SDK
# (unmodified, the venv make deps makes here): p50/p95 over N (50) at
# concurrency C (10), printed as JSON in sdktest/bench.mjs's shape. Needs
# E2B_API_KEY (in E2B's format: the SDK's key check stays on),
# E2B_API_URL, E2B_SANDBOX_URL; BENCH_N, BENCH_C and BENCH_TEMPLATE (base)
# change the run.
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from e2b import Sandbox

n = int(os.environ.get("BENCH_N", "50"))
c = int(os.environ.get("BENCH_C", "10"))
template = os.environ.get("BENCH_TEMPLATE", "base")
# The SDK's request timeout (60 s by default): longer under emulated KVM.
request_timeout = float(os.environ.get("BENCH_REQUEST_TIMEOUT_S", "60"))

lock = threading.Lock()
create, run, total = [], [], []
failures = 0


def one(_):
    global failures
    try:
        t0 = time.perf_counter()
        sbx = Sandbox.create(template, timeout=600, request_timeout=request_timeout)
        t1 = time.perf_counter()
        try:
            r = sbx.commands.run("true", request_timeout=request_timeout, timeout=0)
            if r.exit_code != 0:
                raise RuntimeError(f"exit {r.exit_code}")
            t2 = time.perf_counter()
        finally:
            sbx.kill()
        with lock:
            create.append((t1 - t0) * 1000)
            run.append((t2 - t1) * 1000)
            total.append((t2 - t0) * 1000)
    except Exception as e:  # counted, and the run goes on
        with lock:
            failures += 1
        print(repr(e), file=sys.stderr)


def pct(s, p):
    return s[min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1)]


def summary(xs):
    s = sorted(xs)
    return {k: round(v, 1) for k, v in {"p50": pct(s, 50), "p95": pct(s, 95), "min": s[0], "max": s[-1]}.items()}


start = time.perf_counter()
with ThreadPoolExecutor(max_workers=min(c, n)) as ex:
    list(ex.map(one, range(n)))
wall = time.perf_counter() - start
print(json.dumps({
    "n": n, "concurrency": c, "template": template, "ok": len(total), "failures": failures,
    "wall_ms": round(wall * 1000),
    "create_ms": summary(create) if total else None,
    "run_ms": summary(run) if total else None,
    "total_ms": summary(total) if total else None,
}, indent=2))
sys.exit(1 if failures else 0)
