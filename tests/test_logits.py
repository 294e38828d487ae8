"""Chunked fp32 log-probs and entropy equal the whole-matrix computation, values and gradients."""

import pytest
import torch

from hybridflow.engine.logits import token_logprobs_and_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 37, 100])
def test_chunked_logprobs_and_entropy_equal_a_full_log_softmax_with_the_same_gradients(dtype, chunk_tokens):
    generator = torch.Generator().manual_seed(0)
    logits_NV = (torch.randn(37, 11, generator=generator) * 3).to(dtype).requires_grad_(True)
    next_ids_N = torch.randint(0, 11, (37,), generator=generator)
    weights_N = torch.arange(37, dtype=torch.float32)

    full_NV = torch.log_softmax(logits_NV.float(), dim=-1)
    want_lp = full_NV.gather(-1, next_ids_N[:, None])[:, 0]
    want_entropy = -(full_NV.exp() * full_NV).sum(-1)
    want_grad, = torch.autograd.grad((want_lp * weights_N).sum() + want_entropy.sum(), logits_NV)

    logprobs_N, entropy_N = token_logprobs_and_entropy(logits_NV, next_ids_N, chunk_tokens=chunk_tokens)
    assert logprobs_N.dtype == torch.float32 and entropy_N.dtype == torch.float32
    torch.testing.assert_close(logprobs_N, want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy_N, want_entropy, rtol=0, atol=1e-5)
    grad, = torch.autograd.grad((logprobs_N * weights_N).sum() + entropy_N.sum(), logits_NV)
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("chunk_tokens", [3, 100])
def test_a_temperature_gives_the_tempered_distributions_log_probs_entropy_and_gradients(chunk_tokens):
    generator = torch.Generator().manual_seed(1)
    logits_NV = (torch.randn(9, 13, generator=generator) * 3).requires_grad_(True)
    next_ids_N = torch.randint(0, 13, (9,), generator=generator)
    full_NV = torch.log_softmax(logits_NV / 0.6, dim=-1)
    want_lp = full_NV.gather(-1, next_ids_N[:, None])[:, 0]
    want_entropy = -(full_NV.exp() * full_NV).sum(-1)
    want_grad, = torch.autograd.grad(want_lp.sum() + want_entropy.sum(), logits_NV)
    logprobs_N, entropy_N = token_logprobs_and_entropy(logits_NV, next_ids_N, chunk_tokens=chunk_tokens,
                                                       temperature=0.6)
    torch.testing.assert_close(logprobs_N, want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy_N, want_entropy, rtol=0, atol=1e-5)
    grad, = torch.autograd.grad(logprobs_N.sum() + entropy_N.sum(), logits_NV)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"temperature must be > 0, got -1.0"):
        token_logprobs_and_entropy(logits_NV, next_ids_N, temperature=-1.0)


def test_entropy_is_skipped_when_not_asked_and_a_bad_chunk_size_is_refused():
    logits_NV = torch.randn(4, 6)
    logprobs_N, entropy_N = token_logprobs_and_entropy(logits_NV, torch.zeros(4, dtype=torch.long), want_entropy=False)
    assert entropy_N is None and logprobs_N.shape == (4,)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        token_logprobs_and_entropy(logits_NV, torch.zeros(4, dtype=torch.long), chunk_tokens=0)
