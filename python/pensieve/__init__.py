"""pensieve: stateful multi-turn LLM inference.

An engine keeps each conversation's KV state across turns (on the device, in host memory, in a
store on disk or Redis), so a new turn computes only its new tokens. ``Engine`` and
``Conversation`` are called from blocking code, ``AsyncEngine`` and ``AsyncConversation`` from
``asyncio``; both drive the same engine, which runs on a thread of its own. ``serve`` runs the
OpenAI-compatible server.

>>> import pensieve
>>> engine = pensieve.Engine()                       # the default model, tiered cache
>>> chat = engine.open(system="Be brief.")
>>> for piece in chat.send("What is the capital of France?"):
...     print(piece, end="")
"""

from ._native import (
    AsyncConversation,
    AsyncEngine,
    CapacityError,
    ConflictError,
    Conversation,
    Engine,
    EngineStats,
    InternalError,
    InvalidInputError,
    IoError,
    ModelError,
    NotFoundError,
    PensieveError,
    Reply,
    TurnStats,
    TurnStream,
    UnavailableError,
    serve,
)

__all__ = [
    "AsyncConversation",
    "AsyncEngine",
    "CapacityError",
    "ConflictError",
    "Conversation",
    "Engine",
    "EngineStats",
    "InternalError",
    "InvalidInputError",
    "IoError",
    "ModelError",
    "NotFoundError",
    "PensieveError",
    "Reply",
    "TurnStats",
    "TurnStream",
    "UnavailableError",
    "serve",
]
