"""Type stubs of the extension (`python/src/*.rs`)."""

from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, ClassVar, TypedDict, final

from typing_extensions import Self, Unpack

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

_Message = dict[str, Any]
"""An OpenAI chat message: ``role``, ``content``, and ``tool_calls``, ``tool_call_id`` or
``reasoning_content`` where they apply."""

class _Sampling(TypedDict, total=False):
    """A turn's sampling parameters; unnamed ones are greedy decoding of up to 256 tokens."""

    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    ignore_eos: bool
    stop: str | list[str]
    stop_token_ids: list[int]
    logit_bias: dict[int, float]

@final
class TurnStats:
    """A turn's numbers (times in seconds)."""

    prompt_tokens: int
    reused_tokens: int
    reused_from_host_tokens: int
    reused_from_store_tokens: int
    prefilled_tokens: int
    recomputed_tokens: int
    output_tokens: int
    ttft: float
    latency: float
    queue_time: float

@final
class EngineStats:
    """The engine's totals since it started, and its state now."""

    steps: int
    turns_finished: int
    prefilled_tokens: int
    generated_tokens: int
    recomputed_tokens: int
    reused_device_tokens: int
    reused_host_tokens: int
    reused_store_tokens: int
    shared_tokens: int
    drafted_tokens: int
    accepted_tokens: int
    device_slots_used: int
    device_slots_total: int
    host_bytes_used: int
    conversations: int
    in_flight: int

@final
class Reply:
    """A whole reply."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: TurnStats
    message: _Message | None

@final
class TurnStream:
    """A running turn: iterate it (``for`` or ``async for``) for the reply's text; dropping
    it unread, or ``cancel()``, cancels the turn."""

    text: str
    tokens: list[int]
    finish_reason: str | None
    """``stop``, ``stop_string``, ``length``, ``context_full``, ``cancelled``, ``failed``;
    ``None`` while the turn runs."""
    stats: TurnStats | None
    message: _Message | None
    def __iter__(self) -> Iterator[str]: ...
    def __next__(self) -> str: ...
    def __aiter__(self) -> AsyncIterator[str]: ...
    async def __anext__(self) -> str: ...
    def cancel(self) -> None: ...
    async def acancel(self) -> None: ...
    def wait(self, timeout: float | None = None) -> str: ...

@final
class Conversation:
    """A conversation whose KV the engine keeps between turns, called from blocking code."""

    id: int
    def send(
        self, content: str | list[_Message] | list[int], **sampling: Unpack[_Sampling]
    ) -> TurnStream: ...
    def ask(
        self, content: str | list[_Message] | list[int], **sampling: Unpack[_Sampling]
    ) -> Reply: ...
    def fork(self, turns: int | None = None) -> Conversation: ...
    def messages(self) -> list[_Message]: ...
    def tokens(self) -> list[int]: ...
    def set_name(self, name: str) -> None: ...
    def pin(self, pinned: bool = True) -> None: ...
    def expect_resume(self, seconds: float) -> None: ...
    def detach(self) -> None: ...
    def close(self) -> None: ...

@final
class AsyncConversation:
    """A conversation, called from ``asyncio``."""

    id: int
    async def send(
        self, content: str | list[_Message] | list[int], **sampling: Unpack[_Sampling]
    ) -> TurnStream: ...
    async def ask(
        self, content: str | list[_Message] | list[int], **sampling: Unpack[_Sampling]
    ) -> Reply: ...
    async def fork(self, turns: int | None = None) -> AsyncConversation: ...
    async def messages(self) -> list[_Message]: ...
    async def tokens(self) -> list[int]: ...
    async def set_name(self, name: str) -> None: ...
    async def pin(self, pinned: bool = True) -> None: ...
    async def expect_resume(self, seconds: float) -> None: ...
    async def detach(self) -> None: ...
    async def close(self) -> None: ...

@final
class Engine:
    """A model and its engine, called from blocking code. The keyword arguments are the
    flags of ``pensieve-server --help`` (``store="dir"``, ``device_tokens=4096``,
    ``mode="stateless"``, ...)."""

    def __new__(cls, model: str = "default", **options: Any) -> Self: ...
    def open(
        self,
        *,
        system: str | None = None,
        name: str | None = None,
        messages: list[_Message] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Conversation: ...
    def resume(self, name: str) -> Conversation: ...
    def stored_conversations(self) -> list[str]: ...
    def stats(self) -> EngineStats: ...
    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: list[int]) -> str: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

@final
class AsyncEngine:
    """A model and its engine, called from ``asyncio`` (loading it blocks)."""

    def __new__(cls, model: str = "default", **options: Any) -> Self: ...
    async def open(
        self,
        *,
        system: str | None = None,
        name: str | None = None,
        messages: list[_Message] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> AsyncConversation: ...
    async def resume(self, name: str) -> AsyncConversation: ...
    async def stored_conversations(self) -> list[str]: ...
    def stats(self) -> EngineStats: ...
    def tokenize(self, text: str, add_special: bool = True) -> list[int]: ...
    def detokenize(self, tokens: list[int]) -> str: ...
    async def shutdown(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

def serve(*args: str, **options: Any) -> None:
    """Runs the OpenAI-compatible server until SIGINT or SIGTERM; the keyword arguments are
    the flags of ``pensieve-server --help``."""

class PensieveError(Exception):
    kind: ClassVar[str | None]

class InvalidInputError(PensieveError): ...
class NotFoundError(PensieveError): ...
class ConflictError(PensieveError): ...
class CapacityError(PensieveError): ...
class UnavailableError(PensieveError): ...
class ModelError(PensieveError): ...
class IoError(PensieveError): ...
class InternalError(PensieveError): ...
