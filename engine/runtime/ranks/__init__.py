"""The ranks of a server and how they step together (docs/design.md, "The runtime's layers").

* :mod:`.groups` — every ``torch.distributed`` group, cut from the :class:`Topology` once;
* :mod:`.lockstep` — the one lockstep scheduler: rank 0 drains the intake and broadcasts it
  in one wire format, every rank applies it and runs the same step; one halt/flush protocol;
  one path that names a dead, hung or failed rank;
* :mod:`.pipeline` — what only a pipeline adds (stages, micro-batches, decision broadcast,
  the L3 hold);
* :mod:`.build` — ``build_rank(config, topology)``: one rank's model, cache and scheduler;
* :mod:`.worker` — the main of every rank process other than rank 0.

It sits above the scheduler and below serving (the HTTP engine) and the launcher, which starts
the rank processes. New parallel modes go here, not into serving.
"""
