"""Does the MXFP4 experts' time follow the SM clock? (GPU.)

The same plan timed again in the same process moves by up to 10% at 448-640 tokens (``research/mxfp4_spread.py``),
where bf16's and fp8's do not. MXFP4 decode is bound by issuing the unpacking, so its time should scale with the SM
clock, which the GPU lowers under power and heat; bf16's and fp8's are bound by DRAM and should not. This times
DeepSeek-V4-Flash's routed experts (one plan at 640 tokens) in MXFP4 and in bf16, alternately, twelve times each
(400 calls a time, so that a window holds several samples), while ``nvidia-smi`` samples the SM clock, the power
and the throttle reasons every 50 ms, and prints each time beside the mean clock of its window and the correlation
of time with 1 / clock per format. (Its first run timed each with ``sweep._time_us``, about 100 ms: one sample a
window, too coarse.)

    python -m research.mxfp4_clocks
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import tempfile
import time

import torch

from moefuse.bench import timing
from moefuse.config import preset
from moefuse.dispatch import moe_dispatch
from moefuse.experts import moe_experts, plan_block_m
from moefuse.layer import MoELayer

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def _samples(path: str) -> list[tuple[float, float, float, str]]:
    out = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            stamp = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((stamp, float(parts[1]), float(parts[2]), parts[4]))
        except (ValueError, IndexError):
            continue
    return out


def main() -> None:
    c = preset("deepseek-v4-flash")
    gen = torch.Generator("cuda").manual_seed(0)
    M = 640
    x = torch.randn(M, c.hidden_size, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.rand(M, c.num_experts, device="cuda", generator=gen).topk(c.top_k, dim=1).indices.int()
    calls = {}
    for quant in ("mxfp4", None):
        layer = MoELayer(c, device="cuda", quant=quant).init_random_(0)
        w1, w2 = layer.experts.weights()
        plan = moe_dispatch(ids, c.num_experts, plan_block_m(M, w1, c.top_k, x.dtype))
        calls[quant or "bf16"] = (lambda w1=w1, w2=w2, plan=plan:
                                  moe_experts(x, w1, w2, plan, swiglu_limit=c.swiglu_limit))
        del layer
    log = tempfile.NamedTemporaryFile(suffix=".csv", delete=False).name
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=open(log, "w"), stderr=subprocess.DEVNULL)
    windows = []
    try:
        time.sleep(0.3)
        for rep in range(12):
            for name, call in calls.items():
                start = time.time()
                us = timing.graph_time_us([call], replays=40)  # 0.5-2 s a window: several clock samples in each
                windows.append({"format": name, "rep": rep, "us": round(us, 1), "start": start, "end": time.time()})
        time.sleep(0.2)
    finally:
        smi.terminate()
        smi.wait()
    samples = _samples(log)
    for w in windows:
        inside = [s for s in samples if w["start"] <= s[0] <= w["end"]] or \
            [min(samples, key=lambda s: abs(s[0] - w["start"]))]
        w["sm_mhz"] = round(statistics.mean(s[1] for s in inside), 1)
        w["watts"] = round(statistics.mean(s[2] for s in inside), 1)
        w["throttle"] = sorted({s[3] for s in inside})
        w["samples"] = len(inside)
        print(json.dumps({k: v for k, v in w.items() if k not in ("start", "end")}), flush=True)
    for name in calls:
        mine = [w for w in windows if w["format"] == name]
        us, inv = [w["us"] for w in mine], [1.0 / w["sm_mhz"] for w in mine]
        corr = statistics.correlation(us, inv) if len(set(inv)) > 1 and len(set(us)) > 1 else float("nan")
        print(json.dumps({"format": name, "us_min": min(us), "us_max": max(us), "mhz_min": min(1 / v for v in inv),
                          "mhz_max": max(1 / v for v in inv), "corr_us_inv_clock": round(corr, 3)}), flush=True)


if __name__ == "__main__":
    main()
