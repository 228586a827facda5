"""GPU run of the whole layer: correctness on full model sizes, then the layer benchmark (DeepSeek-V3, or --models).

    python scripts/gpu_layer.py [--models deepseek-v3 kimi-k2] [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moefuse.bench import layer, report, timing  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["deepseek-v3"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    if not args.no_check:
        print(report.format_table(layer.check(), layer.CHECK_COLUMNS, "layer: checks"), flush=True)
    ceilings = timing.measure_ceilings()
    print(ceilings, flush=True)
    rows = layer.run(ceilings, quick=args.quick, models=tuple(args.models))
    print(report.format_table(rows, layer.COLUMNS, layer.TITLE), flush=True)


if __name__ == "__main__":
    main()
