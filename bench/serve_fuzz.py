"""Fuzz: schemathesis-generated requests against the server's own OpenAPI schema.

Positive (schema-valid) and negative (schema-violating) cases for every
operation, with and without the API key, against a live server on the tiny
Wan card. Counts responses by status; the goal is 0 responses >= 500.
Writes bench/results/serve_fuzz.json. Run: ``python -m bench.serve_fuzz``.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.serving.support import ServerThread, tiny_deploy, wan_host

API_KEY = "fuzz-key"
EXAMPLES = {GenerationMode.POSITIVE: 700, GenerationMode.NEGATIVE: 700}
# Small limits: every request the server accepts is a cheap job.
LIMITS = {
    "max_frames": 5,
    "max_height": 32,
    "max_width": 32,
    "max_steps": 4,  # the tiny card's default, so omitted steps are accepted
    "max_queue": 8,
    "max_running": 4,
}


def fuzz(schema, url: str, mode: GenerationMode, counts: collections.Counter, failures: list) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    calls = [0]

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case) -> None:
        calls[0] += 1
        headers = auth if calls[0] % 10 else {"Authorization": "Bearer wrong"}  # every 10th: a bad key
        response = case.call(base_url=url, headers=headers, timeout=60)
        counts[(mode.value, case.operation.label, response.status_code)] += 1
        if response.status_code >= 500 and len(failures) < 20:
            failures.append(
                {
                    "operation": case.operation.label,
                    "status": response.status_code,
                    "request": case.as_curl_command(),
                    "body": response.text[:500],
                }
            )

    one()


def main() -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("FV_CACHE_DIR", tempfile.mkdtemp(prefix="fv-cache-"))
    deploy = tiny_deploy(tempfile.mkdtemp(prefix="fv-serve-fuzz-"), **LIMITS)
    counts: collections.Counter = collections.Counter()
    failures: list[dict] = []
    start = time.perf_counter()
    with ServerThread(deploy, wan_host(), api_key=API_KEY) as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
        for mode in EXAMPLES:
            fuzz(schema, server.url, mode, counts, failures)
    by_status: collections.Counter = collections.Counter()
    by_operation: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (_, operation, status), n in counts.items():
        by_status[str(status)] += n
        by_operation[operation][str(status)] += n
    total = sum(counts.values())
    result = {
        "benchmark": "serve_fuzz",
        "tool": f"schemathesis {schemathesis.__version__}",
        "requests": total,
        "responses_5xx": sum(n for s, n in by_status.items() if int(s) >= 500),
        "by_status": dict(sorted(by_status.items())),
        "by_operation": {op: dict(sorted(c.items())) for op, c in sorted(by_operation.items())},
        "examples_per_mode": {m.value: n for m, n in EXAMPLES.items()},
        "limits": LIMITS,
        "wall_s": round(time.perf_counter() - start, 1),
        "failures": failures,
    }
    out = Path(__file__).parent / "results" / "serve_fuzz.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "by_operation"}, indent=2))


if __name__ == "__main__":
    main()
