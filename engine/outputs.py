"""What the engine hands back to its callers, one object per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvconnector.params import KVTransferParams

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Set on the prefill side when the request finished with KV held for a decode node.
    kv_transfer_params: KVTransferParams | None = None
