"""Prefill–decode disaggregation that moves only the missing KV (docs/pd.md).

* :mod:`.link` — the P/D link: two processes over ``torch.distributed`` point-to-point (a gloo
  group of two, no global process group), messages and per-layer page tensors.
* :mod:`.prefill` — the prefill worker: computes the asked suffix (reusing its own cache) and
  streams exactly those pages, layer by layer.
* :mod:`.decode` — the decode side: after its own admission (L1, then L2/L3 restore) asks the
  prefill worker for the rest and writes each layer into its page table as it arrives
  (:class:`~.decode.RemoteLoad`, a per-layer handle the scheduler waits on like a load-back).
* :mod:`.serve` — the worker engines and processes (``--disaggregation prefill|decode``).
* :mod:`.frontend` — ``--disaggregation pd``: an HTTP front end process forwarding to a decode
  worker process, with a prefill worker process behind it.

A new transport goes next to :mod:`.link` with the same four calls.
"""
