"""Continuous batching over the cache facade and the model.

One scheduler step:

1. take new requests, aborts and cross-thread calls from the inbox;
   ``cache.events.set_step(step)``; ``cache.poll()`` (commit finished transfers);
2. build one batch: a decode token for every decoding request, then prefill chunks of requests
   still prefilling, then admit waiting requests while the chunked-prefill token budget and
   ``max_running_requests`` allow. Admission is one ``cache.admit`` (match → lock → alloc →
   load_back, all or nothing): the prefix hit (L1, plus L2 loaded back) is reused, and so is
   the start of a cached L1 page after it (partial last-page reuse: its KV is copied into the
   request's first own page, ``Scheduler._admit``); pages for the rest of the prompt and every
   output token are reserved up front (so a running request never runs out of KV room);
3. one model forward over the batch; a request whose prefix is being loaded back from L2
   contributes its ``LoadHandle.wait_layer`` as a layer hook, so layer *l* attends as soon as
   layer *l* of the prefix is in L1 while later layers still load;
4. sample, stream the new tokens, and finish requests: ``insert`` the sequence (prompt + output,
   full pages) into the tree, free the request's leftover pages, ``unlock``.

Aborted requests (client gone) free their own pages and unlock without inserting. The
scheduler runs in one background thread (:meth:`Scheduler.start`); :meth:`submit`,
:meth:`abort` and :meth:`call` are thread-safe; everything touching the cache runs on the
scheduler thread. An exception inside a step is logged with its traceback and fails the
affected requests — it is never swallowed silently.
"""

from engine.runtime.scheduler.core import Scheduler
from engine.runtime.scheduler.params import (
                                     Callback,
                                     FinishReason,
                                     RequestOutput,
                                     SamplingParams,
                                     SchedulerConfig,
)
from engine.runtime.scheduler.stats import Histogram, SchedulerMetrics

__all__ = ["Callback", "FinishReason", "Histogram", "RequestOutput", "SamplingParams",
           "Scheduler", "SchedulerConfig", "SchedulerMetrics"]
