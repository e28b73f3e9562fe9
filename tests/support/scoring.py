"""The reference for log-probabilities: Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

# float32 on both sides: logits agree within 2e-4 (see test_engine_parity), so a
# log-softmax, which subtracts a log-sum-exp of them, within twice that.
LOGPROB_ATOL = 5e-4


@functools.cache
def reference_model(model_dir: Path) -> torch.nn.Module:
    """The checkpoint loaded by transformers, in float32 (loaded once per process)."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


def reference_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Transformers' log-softmax at every position of `tokens` [len, vocab]: row i is
    the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
