"""Tests for the sampler's draw (branchreplay.decode.draw `draw`, `filter_logits`): top-k then top-p
filtering, the inverse-transform draw against the filtered softmax's frequencies, its two levels against one
cumulative sum, non-finite rows, the ends of the unit interval. Split out of test_decode_loop.py."""

import pytest
import torch

from branchreplay.decode.config import SamplingConfig
from branchreplay.decode.draw import filter_logits


def test_filter_logits_top_k_then_top_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    def kept(**kw):
        return torch.isfinite(filter_logits(logits, **kw))[0].tolist()

    assert kept(top_k=0, top_p=1.0) == [True, True, True, True]
    assert kept(top_k=3, top_p=1.0) == [True, True, True, False]
    assert kept(top_k=0, top_p=0.75) == [True, True, False, False]
    assert kept(top_k=0, top_p=0.85) == [True, True, True, False]
    assert kept(top_k=2, top_p=0.85) == [True, True, False, False]
    assert kept(top_k=0, top_p=0.4) == [True, False, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("block", [1024, 16])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("filters", [{}, dict(top_k=5), dict(top_p=0.5)])
def test_draws_follow_the_filtered_softmax(filters, dtype, block, monkeypatch):
    """The inverse-transform draw (`draw.draw`) against the filtered softmax itself: 200,000 draws of 64 ids
    (in one block of the two-level sum, or in four), every frequency within 5 standard errors of its probability,
    filtered ids never drawn, and each draw's logprob the unfiltered log_softmax's. Drawing from softmax(logits)
    without the temperature fails it."""
    import branchreplay.decode.draw as sampling
    from branchreplay.decode.draw import draw

    monkeypatch.setattr(sampling, "DRAW_BLOCK", block)

    logits = (torch.randn(1, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    config = SamplingConfig(temperature=0.9, **filters)
    probs = filter_logits(logits / 0.9, config.top_k, config.top_p).softmax(-1)[0].double()
    generator, n = torch.Generator().manual_seed(1), 200_000
    draws = [draw(logits.expand(10_000, -1), config, generator) for _ in range(n // 10_000)]
    ids = torch.cat([tokens for tokens, _ in draws])[:, 0]
    freq = torch.bincount(ids, minlength=64).double() / n
    assert (freq[probs == 0] == 0).all()
    assert ((freq - probs).abs() <= 5 * (probs * (1 - probs) / n).sqrt() + 1e-12).all()
    reference = (logits / 0.9).log_softmax(-1)[0]
    assert torch.equal(torch.cat([lp for _, lp in draws]), reference[ids])


@pytest.mark.parametrize("filters", [{}, dict(top_p=0.9)])
def test_the_two_level_draw_is_the_one_level_cumulative_sum_draw(filters):
    """4,096 rows of a 3,000-id vocabulary (two full blocks of 1,024 and a ragged one): `draw`'s token is, for the
    same uniform numbers, the first whose float64 cumulative probability over the whole row exceeds u times the
    total (the draw before the sum was split in blocks). An off-by-one inside or across blocks fails it."""
    from branchreplay.decode.draw import draw

    logits = torch.randn(4096, 3000, generator=torch.Generator().manual_seed(0)) * 4
    config = SamplingConfig(temperature=0.8, **filters)
    tokens, _ = draw(logits, config, torch.Generator().manual_seed(1))
    cdf = filter_logits(logits / 0.8, 0, config.top_p).softmax(-1).double().cumsum(-1)
    u = torch.rand((4096, 1), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    assert (tokens // 1024).unique().tolist() == [0, 1, 2]
    assert torch.equal(tokens, expected)


def test_a_row_without_finite_probabilities_raises_by_name():
    """NaN or inf logits (a diverged policy) raise a RuntimeError that says so, as torch.multinomial did, not an
    index out of the vocabulary."""
    from branchreplay.decode.draw import draw

    for bad in [float("nan"), float("inf")]:
        logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, bad, 1.0]])
        with pytest.raises(RuntimeError, match="no finite probabilities"):
            draw(logits, SamplingConfig(), None)


def test_draws_at_the_ends_of_the_unit_interval_stay_on_kept_ids(monkeypatch):
    """u = 0 draws the first id of positive probability, u just below 1 the last one, and u * total rounded up to
    the total (u = 1 here) still the last kept id, never a filtered id nor an index past the vocabulary."""
    import branchreplay.decode.draw as sampling

    logits = torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]], dtype=torch.float64)
    for u, expected in [(0.0, 1), (1 - 2**-53, 2), (1.0, 2)]:
        monkeypatch.setattr(sampling.torch, "rand", lambda *a, u=u, **k: torch.full(a[0], u, dtype=torch.float64))
        tokens, _ = sampling.draw(logits, SamplingConfig(), None)
        assert tokens.tolist() == [[expected]]
