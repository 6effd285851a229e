"""The recurrent layers' chunked forms against their definitions, token by token: Gated DeltaNet
(models/gated_deltanet.py), Mamba-2 (models/mamba2.py) and Kimi Delta Attention (models/kda.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3srv.models.gated_deltanet import chunked_delta_rule, l2_normalize, recurrent_step


def _inputs(seed: int, heads: int, length: int, dk: int, dv: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(heads, length, dk, generator=g, dtype=dtype)) * dk**-0.5
    k = l2_normalize(torch.randn(heads, length, dk, generator=g, dtype=dtype))
    v = torch.randn(heads, length, dv, generator=g, dtype=dtype)
    # decays from nearly none to strong (log space), write strengths in (0, 1)
    decay = -torch.rand(heads, length, generator=g, dtype=dtype) * 4
    beta = torch.rand(heads, length, generator=g, dtype=dtype)
    state = torch.randn(heads, dk, dv, generator=g, dtype=dtype)
    return state, q, k, v, decay, beta


def _by_definition(state, q, k, v, decay, beta):
    """S_t = e^g_t S_{t-1} + k_t u_t^T with u_t = beta_t (v_t - e^g_t S_{t-1}^T k_t); o_t = S_t^T q_t."""
    s = state.clone()
    out = []
    for t in range(q.shape[1]):
        s = s * decay[:, t].exp()[:, None, None]
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hkv,hk->hv", s, k[:, t]))
        s = s + k[:, t, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[:, t]))
    return torch.stack(out, dim=1), s


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    heads=st.integers(1, 3),
    length=st.integers(1, 40),
    chunk=st.sampled_from([1, 3, 4, 16, 64]),
    dims=st.sampled_from([(4, 4), (8, 5), (3, 7)]),
)
def test_chunked_form_equals_the_definition(seed, heads, length, chunk, dims):
    state, q, k, v, decay, beta = _inputs(seed, heads, length, *dims)
    ref_out, ref_state = _by_definition(state, q, k, v, decay, beta)
    s = state.clone()
    out = chunked_delta_rule(s, q, k, v, decay, beta, chunk=chunk)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, ref_state, atol=1e-10, rtol=1e-10)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), heads=st.integers(1, 3))
def test_recurrent_step_is_one_token_of_the_definition(seed, batch, heads):
    per_seq = [_inputs(seed + i, heads, 1, 6, 5) for i in range(batch)]
    states = torch.stack([p[0] for p in per_seq])
    q, k, v, decay, beta = (torch.stack([p[j][:, 0] for p in per_seq]) for j in range(1, 6))
    out = recurrent_step(states, q, k, v, decay, beta)
    for i, p in enumerate(per_seq):
        ref_out, ref_state = _by_definition(*p)
        torch.testing.assert_close(out[i], ref_out[:, 0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(states[i], ref_state, atol=1e-12, rtol=1e-12)


def test_float32_chunks_stay_close_over_a_long_prompt():
    """4,096 tokens in float32 through 64-token chunks: the state carried across 64 chunks
    stays within float32 noise of the float64 definition."""
    state, q, k, v, decay, beta = _inputs(5, 2, 4096, 16, 16)
    decay = decay / 40  # slow decay: the state remembers far back
    ref_out, ref_state = _by_definition(state, q, k, v, decay, beta)
    s = state.float()
    out = chunked_delta_rule(s, *(x.float() for x in (q, k, v, decay, beta)))
    torch.testing.assert_close(out.double(), ref_out, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(s.double(), ref_state, atol=2e-4, rtol=1e-4)


# Mamba-2's chunked scan (models/mamba2.py) against its definition, the same way.
def _ssm_inputs(seed: int, heads: int, length: int, head_dim: int, state: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, length, head_dim, generator=g, dtype=torch.float64)
    dt = torch.rand(heads, length, generator=g, dtype=torch.float64) * 0.5 + 1e-3
    a = -torch.rand(heads, generator=g, dtype=torch.float64) * 4
    b = torch.randn(heads, length, state, generator=g, dtype=torch.float64)
    c = torch.randn(heads, length, state, generator=g, dtype=torch.float64)
    s0 = torch.randn(heads, head_dim, state, generator=g, dtype=torch.float64)
    return s0, x, dt, a, b, c


def _ssm_by_definition(s0, x, dt, a, b, c):
    """S_t = exp(dt_t a) S_{t-1} + dt_t x_t b_t^T; y_t = S_t c_t."""
    s, out = s0.clone(), []
    for t in range(x.shape[1]):
        s = s * (dt[:, t] * a).exp()[:, None, None] + (dt[:, t, None] * x[:, t])[..., None] * b[:, t, None, :]
        out.append(torch.einsum("hpn,hn->hp", s, c[:, t]))
    return torch.stack(out, dim=1), s


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), heads=st.integers(1, 3), length=st.integers(1, 40),
       chunk=st.sampled_from([1, 3, 4, 16, 64]), dims=st.sampled_from([(4, 4), (8, 5), (3, 7)]))
def test_mamba2_chunked_scan_equals_the_definition(seed, heads, length, chunk, dims):
    from r3srv.models.mamba2 import chunked_scan

    s0, x, dt, a, b, c = _ssm_inputs(seed, heads, length, *dims)
    ref_out, ref_state = _ssm_by_definition(s0, x, dt, a, b, c)
    s = s0.clone()
    torch.testing.assert_close(chunked_scan(s, x, dt, a, b, c, chunk=chunk), ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, ref_state, atol=1e-10, rtol=1e-10)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), heads=st.integers(1, 3))
def test_mamba2_step_is_one_token_of_the_definition(seed, batch, heads):
    from r3srv.models.mamba2 import ssm_step

    per_seq = [_ssm_inputs(seed + i, heads, 1, 6, 5) for i in range(batch)]
    states = torch.stack([p[0] for p in per_seq])
    x, dt, b, c = (torch.stack([p[j][:, 0] for p in per_seq]) for j in (1, 2, 4, 5))
    a = per_seq[0][3]
    per_seq = [(p[0], p[1], p[2], a, p[4], p[5]) for p in per_seq]  # one decay per layer
    out = ssm_step(states, x, dt, a, b, c)
    for i, p in enumerate(per_seq):
        ref_out, ref_state = _ssm_by_definition(*p)
        torch.testing.assert_close(out[i], ref_out[:, 0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(states[i], ref_state, atol=1e-12, rtol=1e-12)


# Several sequences padded into one batch (models/recurrent.py's scan groups), with snapshots
# captured mid-span: each equals its own run of the definition.
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4),
       chunk=st.sampled_from([1, 4, 64]), kind=st.sampled_from(["delta", "mamba2"]))
def test_padded_batches_with_captures_equal_each_sequence(seed, lengths, chunk, kind):
    from r3srv.models.mamba2 import chunked_scan

    width = max(lengths)
    g = torch.Generator().manual_seed(seed)
    if kind == "delta":
        seqs = [_inputs(seed + i, 2, n, 4, 3) for i, n in enumerate(lengths)]
        definition, scan = _by_definition, chunked_delta_rule
        # state, then per-token inputs with tokens on dim 1; padding: zeros (beta = 0, g = 0)
        padded = [torch.stack([torch.nn.functional.pad(s[j], (0, 0, 0, width - n) if s[j].dim() == 3
                                                       else (0, width - n)) for s, n in zip(seqs, lengths)])
                  for j in range(1, 6)]
        args = padded
    else:
        seqs = [_ssm_inputs(seed + i, 2, n, 4, 3) for i, n in enumerate(lengths)]
        a = seqs[0][3]
        seqs = [(s[0], s[1], s[2], a, s[4], s[5]) for s in seqs]
        definition, scan = _ssm_by_definition, chunked_scan
        pad = [torch.stack([torch.nn.functional.pad(s[j], (0, 0, 0, width - n) if s[j].dim() == 3
                                                    else (0, width - n)) for s, n in zip(seqs, lengths)])
               for j in (1, 2, 4, 5)]
        args = [pad[0], pad[1], a, pad[2], pad[3]]
    state = torch.stack([s[0] for s in seqs])
    positions = [int(torch.randint(1, n + 1, (1,), generator=g)) for n in lengths]
    targets = [torch.empty_like(state[0]) for _ in lengths]
    out = scan(state, *args, chunk=chunk, captures=[(b, p, t) for b, (p, t) in enumerate(zip(positions, targets))])
    for b, (s, n, p) in enumerate(zip(seqs, lengths, positions)):
        ref_out, ref_state = definition(*s)
        torch.testing.assert_close(out[b, :, :n], ref_out, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(state[b], ref_state, atol=1e-10, rtol=1e-10)  # padding left it alone
        prefix = [x[:, :p] if x.dim() >= 2 and x.shape[1] == n and x is not s[0] else x for x in s]
        torch.testing.assert_close(targets[b], definition(*prefix)[1], atol=1e-10, rtol=1e-10)


def test_scan_groups_bound_the_padding():
    from r3srv.models.recurrent import _scan_groups
    from r3srv.ops import cpu, cuda

    lengths = [40, 3, 38, 5, 2, 39, 4, 20]
    factor = cuda.SCAN_PAD_FACTOR
    groups = _scan_groups(list(range(len(lengths))), lengths, factor)
    assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
    for group in groups:
        longest = max(lengths[i] for i in group)
        assert len(group) == 1 or len(group) * longest <= factor * sum(lengths[i] for i in group)
    # longest first; the 2-token one would pad 8 x 40 = 320 for 151 real tokens: a group of its own
    assert groups == [[0, 5, 2, 7, 3, 6, 1], [4]]
    assert _scan_groups(list(range(len(lengths))), lengths, cpu.SCAN_PAD_FACTOR) == [[i] for i in (0, 5, 2, 7, 3, 6, 1, 4)]


# Kimi Delta Attention (models/kda.py): the delta rule with a decay per key channel.
def _kda_inputs(seed: int, heads: int, length: int, dk: int, dv: int):
    state, q, k, v, _, beta = _inputs(seed, heads, length, dk, dv)
    g = -torch.rand(heads, length, dk, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) * 2
    return state, q, k, v, g, beta


def _kda_by_definition(state, q, k, v, g, beta):
    """S_t = Diag(e^g_t) S_{t-1} + k_t u_t^T with u_t = beta_t (v_t - (Diag(e^g_t) S_{t-1})^T k_t); o_t = S_t^T q_t."""
    s, out = state.clone(), []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[..., None]
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hkv,hk->hv", s, k[:, t]))
        s = s + k[:, t, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", s, q[:, t]))
    return torch.stack(out, dim=1), s


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
       chunk=st.sampled_from([1, 4, 32]))
def test_kda_chunks_padding_and_captures_equal_the_definition(seed, lengths, chunk):
    from r3srv.models.kda import chunked_kda, kda_step

    width = max(lengths)
    seqs = [_kda_inputs(seed + i, 2, n, 4, 3) for i, n in enumerate(lengths)]

    def pad(x, n):  # tokens on dim 1
        return torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, width - n))

    state = torch.stack([s[0] for s in seqs])
    args = [torch.stack([pad(s[j], n) for s, n in zip(seqs, lengths)]) for j in range(1, 6)]
    g = torch.Generator().manual_seed(seed)
    positions = [int(torch.randint(1, n + 1, (1,), generator=g)) for n in lengths]
    targets = [torch.empty_like(state[0]) for _ in lengths]
    out = chunked_kda(state, *args, chunk=chunk, captures=[(b, p, t) for b, (p, t) in enumerate(zip(positions, targets))])
    for b, (s, n, p) in enumerate(zip(seqs, lengths, positions)):
        ref_out, ref_state = _kda_by_definition(*s)
        torch.testing.assert_close(out[b, :, :n], ref_out, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(state[b], ref_state, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(targets[b], _kda_by_definition(s[0], *(x[:, :p] for x in s[1:]))[1],
                                   atol=1e-10, rtol=1e-10)
    # one decode step of every sequence at once
    first = torch.stack([s[0] for s in seqs])
    step = kda_step(first, *(torch.stack([x[:, 0] for x in [s[j] for s in seqs]]) for j in range(1, 6)))
    for b, s in enumerate(seqs):
        ref_out, ref_state = _kda_by_definition(s[0], *(x[:, :1] for x in s[1:]))
        torch.testing.assert_close(step[b], ref_out[:, 0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(first[b], ref_state, atol=1e-12, rtol=1e-12)
