"""One module per L3 backend (memory, file, mooncake), each implementing
:class:`engine.storage.backend.StorageBackend`. A new backend is a module here plus an entry in
``engine.storage.config.BackendKind``.
"""
