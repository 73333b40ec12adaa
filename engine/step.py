"""What crosses between the scheduler and the model groups in one step.

Lists are per sequence (rows are ragged: each has its own start position and token count).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from engine.config import SamplingParams


@dataclass(frozen=True)
class RowSampling:
    """How one sequence samples at the positions of this step."""

    request_id: str
    params: SamplingParams
    # Token ids held back (EOS, stop_token_ids) at step positions j < hold_back_until (min_tokens).
    held_back_ids: tuple[int, ...] = ()
    hold_back_until: int = 0


@dataclass
class DraftBatch:
    slots: list[int]  # [B] KV slot of each sequence in the draft model's cache
    starts: list[int]  # [B] cache position of pending[b][0]
    pending: list[list[int]]  # [B][>=1] draft-vocabulary tokens the draft cache has not seen yet
    num_drafts: list[int]  # [B] k_b >= 1 tokens to propose
    sampling: list[RowSampling]  # [B]


@dataclass
class DraftOutput:
    tokens: list[list[int]]  # [B][k_b] proposals, in the target's vocabulary
    probs: list[Tensor] | None = None  # [B] of [k_b, V_target]: draft distributions (probabilistic drafting)


@dataclass
class VerifyBatch:
    slots: list[int]  # [B]
    starts: list[int]  # [B] cache position of pending[b][0]
    pending: list[list[int]]  # [B][>=1] target tokens the target cache has not seen (the last committed)
    sampling: list[RowSampling]  # [B]


@dataclass
class VerifyOutput:
    tokens: list[list[int]]  # [B][1..k_b+1] tokens to append
    num_accepted: list[int] = field(default_factory=list)  # [B] accepted drafts
