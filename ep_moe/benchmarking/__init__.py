"""Helpers of ``ep-moe bench`` (`ep_moe.cli.bench`): byte and floor accounting, timing loops, workloads,
result checks, fingerprints and the checks of every call made with them (verification), and the report. Each
module has one job; none of them starts processes."""
