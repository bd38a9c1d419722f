"""The chunked LM-head losses equal the plain full-logits computation (values and gradients of
the hidden states and the head), whatever the chunking; no call of the head ever sees more
than a chunk of tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages.common import fused_loss
from stages.common.fused_loss import linear_cross_entropy_sum, token_logprobs

V, H = 97, 16


class CountingHead(torch.nn.Linear):
    """A linear head that records the most rows it was ever applied to at once."""

    def __init__(self, dtype=torch.float32):
        super().__init__(H, V, bias=False, dtype=dtype)
        self.max_rows = 0

    def forward(self, x):
        self.max_rows = max(self.max_rows, x.reshape(-1, H).shape[0])
        return super().forward(x)


def _inputs(shape, dtype, seed=0, ignored=0.3):
    g = torch.Generator().manual_seed(seed)
    head = CountingHead(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.5)
    hidden = (torch.randn(*shape, H, generator=g) * 2).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V, shape, generator=g)
    targets[torch.rand(shape, generator=g) < ignored] = -100
    return head, hidden, targets


def _grads(loss, hidden, head):
    hidden.grad, head.weight.grad = None, None
    loss.backward()
    return hidden.grad.clone(), head.weight.grad.clone()


# chunk sizes: one token, dividing the token count, not dividing it, exactly it, beyond it
@pytest.mark.parametrize("chunk", [1, 6, 7, 24, 100])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_linear_cross_entropy_equals_plain_values_and_grads(chunk, dtype, tol):
    head, hidden, targets = _inputs((2, 12), dtype)
    plain = F.cross_entropy(head(hidden).float().view(-1, V), targets.view(-1), ignore_index=-100,
                            reduction="sum")
    g_plain = _grads(plain, hidden, head)
    head.max_rows = 0
    fused = linear_cross_entropy_sum(hidden, head, targets, chunk)
    g_fused = _grads(fused, hidden, head)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain, atol=tol, rtol=tol)
    for a, b in zip(g_fused, g_plain):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    assert head.max_rows <= chunk  # the forward and the recomputation both stayed chunked


@pytest.mark.parametrize("chunk", [1, 5, 24])
def test_fully_ignored_tokens_give_zero_loss_and_zero_grads(chunk):
    head, hidden, targets = _inputs((2, 12), torch.float32, ignored=1.1)
    loss = linear_cross_entropy_sum(hidden, head, targets, chunk)
    g_hidden, g_head = _grads(loss, hidden, head)
    assert loss.item() == 0.0
    assert not g_hidden.any() and not g_head.any()


@pytest.mark.parametrize("chunk", [1, 7, 100])
@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.3, 5.0)])
def test_token_logprobs_equal_log_softmax_gather_and_entropy(chunk, temperature, softcap):
    head, hidden, targets = _inputs((3, 9), torch.float32, ignored=0.0)
    z = head(hidden).float()
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    want_lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_ent = -(logp_all.exp() * logp_all).sum(-1)
    weights = torch.linspace(-1, 1, targets.numel()).view(targets.shape)  # a loss that weighs every token
    g_plain = _grads((want_lp * weights).sum(), hidden, head)
    head.max_rows = 0
    lp, ent = token_logprobs(hidden, head, targets, chunk, temperature=temperature, softcap=softcap,
                             with_entropy=True)
    g_chunked = _grads((lp * weights).sum(), hidden, head)
    assert lp.shape == targets.shape and ent.shape == targets.shape
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_chunked, g_plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert head.max_rows <= chunk


def test_token_logprobs_without_grad_and_without_entropy():
    head, hidden, targets = _inputs((2, 5), torch.float32, ignored=0.0)
    with torch.no_grad():
        lp, ent = token_logprobs(hidden, head, targets, 3)
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, torch.log_softmax(head(hidden), -1).gather(-1, targets[..., None])[..., 0])


@pytest.mark.parametrize("fn", [linear_cross_entropy_sum, token_logprobs])
def test_a_chunk_of_zero_tokens_is_refused(fn):
    head, hidden, targets = _inputs((1, 4), torch.float32, ignored=0.0)
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        fn(hidden, head, targets, 0)


def test_hidden_and_targets_of_different_lengths_are_refused():
    head, hidden, targets = _inputs((1, 4), torch.float32)
    with pytest.raises(ValueError, match="hidden has 4 tokens, targets 3"):
        linear_cross_entropy_sum(hidden, head, targets[:, :3], 2)


def test_head_calls_fix_the_number_of_head_calls_whatever_the_tokens():
    """Under ZeRO-3 each head call is a collective: with `head_calls` the head runs exactly that
    often, forward and recomputing backward, also on a rank with fewer (or no) tokens; the
    values are those of the natural chunking."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 16)
    calls = []
    head.register_forward_pre_hook(lambda m, i: calls.append(i[0].shape[0]))
    h = torch.randn(5, 8, requires_grad=True)
    t = torch.randint(0, 16, (5,))
    natural, _ = token_logprobs(h, head, t, 2)
    calls.clear()
    padded, _ = token_logprobs(h, head, t, 2, head_calls=5)
    assert calls == [2, 2, 1, 0, 0]
    torch.testing.assert_close(padded, natural)
    calls.clear()
    padded.sum().backward()
    assert sorted(calls) == [0, 0, 1, 2, 2]  # recomputed in backward (last chunk first), the empty ones too
    calls.clear()
    none = torch.randn(0, 8, requires_grad=True)
    loss = linear_cross_entropy_sum(none, head, torch.zeros(0, dtype=torch.long), 4, head_calls=2)
    loss.backward()
    assert float(loss) == 0.0 and calls == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="need 3 chunks"):
        token_logprobs(h, head, t, 2, head_calls=2)


# -- the chunk math through torch.compile (RING_COMPILE_LOSS): what runs on a GPU by default ---------
@pytest.fixture
def compiled_math(monkeypatch):
    """The compiled path on CPU: aot_eager traces the same graphs (forward and backward) as
    inductor does on a GPU, without code generation."""
    monkeypatch.setenv("RING_COMPILE_LOSS", "on")
    monkeypatch.setenv("RING_COMPILE_BACKEND", "aot_eager")


@pytest.mark.parametrize("chunk", [5, 24])
def test_compiled_cross_entropy_equals_eager(compiled_math, monkeypatch, chunk):
    head, hidden, targets = _inputs((2, 12), torch.float32)
    compiled = linear_cross_entropy_sum(hidden, head, targets, chunk)
    g_compiled = _grads(compiled, hidden, head)
    assert (fused_loss._ce_sum_math, "aot_eager") in fused_loss._compiled  # it did go through torch.compile
    monkeypatch.setenv("RING_COMPILE_LOSS", "off")
    eager = linear_cross_entropy_sum(hidden, head, targets, chunk)
    g_eager = _grads(eager, hidden, head)
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature,softcap,with_entropy", [(1.0, None, True), (0.7, 5.0, True), (1.3, None, False)])
def test_compiled_token_logprobs_equal_eager(compiled_math, monkeypatch, temperature, softcap, with_entropy):
    head, hidden, targets = _inputs((3, 9), torch.float32, ignored=0.0)
    weights = torch.linspace(-1, 1, targets.numel()).view(targets.shape)

    def run():
        lp, ent = token_logprobs(hidden, head, targets, 7, temperature=temperature, softcap=softcap,
                                 with_entropy=with_entropy)
        loss = (lp * weights).sum() + (ent.sum() if with_entropy else 0.0)
        return lp.detach(), ent, _grads(loss, hidden, head)

    lp_c, ent_c, g_c = run()
    assert (fused_loss._logprob_math, "aot_eager") in fused_loss._compiled
    monkeypatch.setenv("RING_COMPILE_LOSS", "off")
    lp_e, ent_e, g_e = run()
    torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent_c.detach(), ent_e.detach(), atol=1e-5, rtol=1e-5)
    else:
        assert ent_c is None and ent_e is None
    for a, b in zip(g_c, g_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_an_unknown_loss_compile_mode_is_refused(monkeypatch):
    monkeypatch.setenv("RING_COMPILE_LOSS", "yes")
    head, hidden, targets = _inputs((1, 4), torch.float32)
    with pytest.raises(ValueError, match="RING_COMPILE_LOSS='yes'.*auto, on, off"):
        linear_cross_entropy_sum(hidden, head, targets, 2)
