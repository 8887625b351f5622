"""Load generator for the benchmark server: workloads, the async HTTP driver and the report.

``engine.loadgen.workloads`` (multiturn, agentic), ``engine.loadgen.trace`` (Mooncake traces:
JSONL parsing, the columnar :class:`~engine.loadgen.trace.Trace`, replay workloads),
``engine.loadgen.trace_arrow`` (traces as Parquet/Arrow files), ``engine.loadgen.driver``
(``run_load``), ``engine.loadgen.report`` (``summarize``).

The names below are imported on first use: reading a trace does not load the HTTP client.
"""

from __future__ import annotations

from engine.core.lazy import lazy_exports

_EXPORTS = {
    "LoadConfig": "engine.loadgen.driver",
    "LoadResult": "engine.loadgen.driver",
    "RequestRecord": "engine.loadgen.driver",
    "run_load": "engine.loadgen.driver",
    "summarize": "engine.loadgen.report",
    "summarize_result": "engine.loadgen.report",
    "read_trace": "engine.loadgen.trace",
    "trace_workload": "engine.loadgen.trace",
    "RequestSpec": "engine.loadgen.workloads",
    "Workload": "engine.loadgen.workloads",
    "agentic": "engine.loadgen.workloads",
    "multiturn": "engine.loadgen.workloads",
}
__getattr__, __all__ = lazy_exports("engine.loadgen", _EXPORTS)
