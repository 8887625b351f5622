"""Load generator for the benchmark server: workloads, the async HTTP driver and the report.

``engine.loadgen.workloads`` (multiturn, agentic), ``engine.loadgen.trace`` (Mooncake replay),
``engine.loadgen.driver`` (``run_load``), ``engine.loadgen.report`` (``summarize``).
"""

from engine.loadgen.driver import LoadConfig, LoadResult, RequestRecord, run_load
from engine.loadgen.report import summarize, summarize_result
from engine.loadgen.trace import read_trace, trace_workload
from engine.loadgen.workloads import RequestSpec, Workload, agentic, multiturn

__all__ = ["LoadConfig", "LoadResult", "RequestRecord", "RequestSpec", "Workload", "agentic",
           "multiturn", "read_trace", "run_load", "summarize", "summarize_result",
           "trace_workload"]
