"""How the coordinator reaches its workers: the `WorkerPool` interface and its in-process pool, the worker processes
(ZeroMQ + msgpack), and `LocalEngine` (the coordinator over in-process workers, driven synchronously)."""
