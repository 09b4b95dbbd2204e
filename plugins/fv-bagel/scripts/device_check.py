"""One prepared device check of fv-bagel (for a session that has a GPU): the tiny card on ``--device``
with its row-invariant math and with SDPA math, every task, the interleave gate with all four tasks
mixed, batched parity, and KV pages back after; prints one JSON line and exits non-zero on a failure.

    python plugins/fv-bagel/scripts/device_check.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()

    import fv_core
    from fv_core import ImagePart
    from fv_core.parity import assert_interleave_parity, check_batched_parity
    from fv_core.runtime import Engine

    picture = ImagePart(np.random.default_rng(0).random((40, 56, 3)).astype(np.float32))
    report: dict = {"device": args.device}
    failed = False
    for exact in (True, False):
        model = fv_core.load("bagel-tiny", device=args.device)
        model.instance.exact = exact
        mode = "exact" if exact else "sdpa"
        start = time.perf_counter()
        outs = {
            "chat": model.generate(task="chat", parts=[picture], prompt="what is this?", max_tokens=8).text,
            "t2i": float(model.generate(task="t2i", prompt="a red cat", num_inference_steps=4).image.mean()),
            "edit": float(model.generate(task="edit", parts=[picture], prompt="blue", num_inference_steps=3).image.mean()),
            "think": float(model.generate(task="think-t2i", prompt="a cat", num_inference_steps=3, max_tokens=4).image.mean()),
        }  # fmt: skip
        report[f"{mode}_seconds"] = round(time.perf_counter() - start, 3)
        report[f"{mode}_outputs"] = outs

        def items(model=model):
            asks = [("chat", {"prompt": "hi", "max_tokens": 4}), ("t2i", {"prompt": "a cat", "num_inference_steps": 3}),
                    ("think-t2i", {"prompt": "a dog", "num_inference_steps": 2, "max_tokens": 3}),
                    ("edit", {"prompt": "red", "num_inference_steps": 2})]  # fmt: skip
            return [
                model.job(
                    model.prepare(p, task=t, request_id=f"d{i}", parts=[picture] if t == "edit" else [])
                )
                for i, (t, p) in enumerate(asks)
            ]

        for name, check in (
            ("interleave", lambda items=items: assert_interleave_parity(Engine, items)),
            ("batched", lambda items=items, exact=exact: check_batched_parity(Engine, items, tol=0.0 if exact else 1e-3)),
        ):  # fmt: skip
            try:
                report[f"{mode}_{name}_max_abs"] = check().max_abs
            except AssertionError as exc:
                report[f"{mode}_{name}_error"], failed = str(exc)[:500], True
        report[f"{mode}_pages_in_use"] = model.instance.kv_pool.used_pages
        failed |= model.instance.kv_pool.used_pages != 0
    print(json.dumps(report))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
