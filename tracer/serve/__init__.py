"""``mlx-tracer serve``: an OpenAI-compatible HTTP server on the compiled
continuous-batching loop.

One engine thread owns the model and every MLX call
(:class:`~.worker.EngineWorker`); an async Starlette front end
(:func:`~.app.create_app`, run by uvicorn) checks requests, hands them to the
engine thread and streams each request's events back from its own queue.

    from mlx_tracer import Generator
    from mlx_tracer.runtime.prefix_cache import PrefixCache
    from mlx_tracer.serve import BackgroundServer, EngineWorker, create_app

    gen = Generator.load(prefix_cache=PrefixCache(256 << 20))  # the engine looks prompts up and stores rows
    worker = EngineWorker(gen, "SmolLM2-135M-Instruct").start()
    with BackgroundServer(create_app(worker)) as server:
        ...  # an OpenAI client with base_url=server.url + "/v1"
    worker.stop()

A model sharded over ``mlx.launch``'s ranks is served by rank 0 with
``EngineWorker(Leader(gen), ...)`` while the other ranks run ``follow(gen)``
(:mod:`.ranks`).

Needs the ``serve`` extra (``pip install 'mlx-tracer[serve]'``: starlette, uvicorn).
"""

from .worker import EngineWorker  # noqa: E402  (no HTTP library needed)

__all__ = ["BackgroundServer", "EngineWorker", "create_app"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "BackgroundServer":
        from .server import BackgroundServer

        return BackgroundServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
