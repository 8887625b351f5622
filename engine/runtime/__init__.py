"""The serving runtime: the model (``model/``), tokenizer, continuous-batching scheduler
(``scheduler/``) and the HTTP server (``serving/``).

It sits on top of the cache stack and the parallel layer. A new endpoint goes in ``serving/``, a
new model preset or architecture in ``model/``.
"""
