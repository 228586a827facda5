"""GPU benchmarks: one module per stage, each exposing ``cases()`` and ``run(case)``; ``moefuse bench`` drives them."""
