"""Tools a user or maintainer of moefuse runs from the checkout, each with ``--help``; they import the installed
``moefuse`` (``pip install -e .``) and nothing from ``tests/``.

Tuning and the data behind launch rules: ``tune_experts.py`` (rewrites the tile table), ``sweep_router.py``,
``sweep_finalize.py``. Checks: ``sass.py`` (compiles kernels for sm_90 offline, no GPU; ``--check`` runs in the
tests), ``sanitize.py`` (every stage under compute-sanitizer), ``gpu_integration.py`` (transformers and
torch.compile on a GPU). Measurements: ``error_table.py`` (the error table ``tests/tolerances.py`` is set from),
``cold_start.py``, ``host_profile.py``, ``bench_parallel.py`` (torchrun). Nsight Compute exports read into tables:
``ncu_table.py``, ``ncu_source.py``.

A package only so that ``research/`` can import ``scripts.sass``'s compile helpers (``python -m research.<probe>``
from the repository root); the tools themselves run as files: ``python scripts/<tool>.py``.
"""
