"""Research probes: one-off measurements whose answers are recorded in ``research/README.md`` and
``docs/PERF-NOTES.md``. Not part of the library, not run by the default tests; run from the repository root as
``python -m research.<probe>``."""
