"""The library's errors: a client's mistake, and an engine that can serve no more.

``InvalidRequest`` is what a caller did wrong (sampling parameters out of range, a prompt too long
or malformed, an id in use): the HTTP ingress answers it with a 400. It is a ``ValueError``, so code
that catches those keeps working; any other exception out of the engine is the server's fault (500).
"""


class InvalidRequest(ValueError):
    """A request the engine refuses as given; the message names the offending value, ``param`` (when
    known) the field holding it, which the HTTP ingress reports as the OpenAI error's ``param``.
    ``param`` lives in the instance's ``__dict__``, which pickling keeps (a replica's error crosses Ray)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDead(RuntimeError):
    """The engine failed in a way it cannot recover from (e.g. a tensor-parallel worker died under a step,
    so even aborting its requests fails): every request it held gets this error, and every later one at
    once; the serving layer answers 503 and routes elsewhere while the replica is replaced (its health
    check fails). vLLM calls the same state ``EngineDeadError``."""
