"""The sampler on hand-made logits: filters that must collapse to greedy, seeds, the distribution, penalties."""

from __future__ import annotations

import pytest
import torch

from inference.engine.sampler import apply_penalties, sample
from inference.engine.api import SamplingParams
from inference.engine.sequence import Sequence
from tests.engine.tiny import one_thread

assert one_thread  # an autouse fixture: importing it is what applies it here

VOCAB = 50


def seq_with(params: SamplingParams, prompt=(1, 2, 3), output=(), seed_generator: bool = True) -> Sequence:
    seq = Sequence(request_id="r", prompt_token_ids=list(prompt), params=params, arrival_time=0.0)
    for t in output:
        seq.append_token(t)
    if params.seed is not None and seed_generator:
        seq.generator = torch.Generator().manual_seed(params.seed)
    return seq


def random_logits(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize(
    "filters",
    [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"top_k": 1, "top_p": 0.5, "min_p": 0.3}],
    ids=["top_k=1", "top_p=tiny", "min_p=1", "all-three"],
)
def test_filters_that_keep_one_token_equal_greedy(filters):
    logits = random_logits(16, seed=0)
    seqs = [seq_with(SamplingParams(temperature=1.5, **filters)) for _ in range(16)]
    tokens, _ = sample(logits.clone(), seqs, torch.Generator().manual_seed(0))
    assert tokens == logits.argmax(-1).tolist()


def test_temperature_zero_is_argmax_and_draws_nothing():
    logits = random_logits(8, seed=1)
    gen = torch.Generator().manual_seed(5)
    state = gen.get_state()
    tokens, logprobs = sample(logits.clone(), [seq_with(SamplingParams(temperature=0)) for _ in range(8)], gen)
    assert tokens == logits.argmax(-1).tolist()
    assert logprobs == [None] * 8
    assert torch.equal(gen.get_state(), state)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = random_logits(1, seed=2)

    def draws(seed: int, neighbours: int) -> list[int]:
        me = seq_with(SamplingParams(temperature=1.0, seed=seed))
        out = []
        for step in range(30):
            others = [seq_with(SamplingParams(temperature=0.7)) for _ in range(neighbours)]
            batch = torch.cat([random_logits(neighbours, seed=100 + step), logits])
            tokens, _ = sample(batch, others + [me], torch.Generator().manual_seed(step))
            out.append(tokens[-1])
        return out

    alone = draws(seed=42, neighbours=0)
    assert draws(seed=42, neighbours=0) == alone
    assert draws(seed=42, neighbours=5) == alone
    assert draws(seed=43, neighbours=0) != alone
    assert len(set(alone)) > 3  # it really samples


def test_unseeded_rows_follow_the_engine_generator():
    logits = random_logits(4, seed=3)

    def run(seed):
        return sample(logits.clone(), [seq_with(SamplingParams(temperature=1.0)) for _ in range(4)], torch.Generator().manual_seed(seed))[0]

    assert run(0) == run(0)
    assert any(run(0) != run(s) for s in range(1, 5))


def _frequencies(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    seqs = [seq_with(params) for _ in range(n)]
    tokens, _ = sample(logits_row.repeat(n, 1), seqs, torch.Generator().manual_seed(1234))
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[0]).float() / n


LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), LOGITS.softmax(-1)),
        (SamplingParams(temperature=0.5), (LOGITS / 0.5).softmax(-1)),
        (SamplingParams(temperature=2.0), (LOGITS / 2.0).softmax(-1)),
        # top-k 2 keeps tokens 4 and 0 and renormalises.
        (SamplingParams(temperature=1.0, top_k=2), LOGITS.exp() * torch.tensor([1.0, 0, 0, 0, 1, 0])),
    ],
    ids=["t=1", "t=0.5", "t=2", "top_k=2"],
)
def test_draws_follow_the_softmax(params, expected):
    expected = expected / expected.sum()
    freq = _frequencies(LOGITS, params)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_a_token_of_zero_probability_is_never_drawn_even_at_the_edges_of_the_vocabulary():
    # A 49,152-token vocabulary (SmolLM2's) whose first and last tokens are filtered out, with
    # almost all the mass on them before the filter: an off-by-one at either end of the
    # cumulative sum would draw them.
    vocab, n = 49_152, 200
    logits = torch.full((vocab,), -30.0)
    logits[0] = logits[-1] = 10.0
    logits[1] = logits[-2] = 5.0
    logits[vocab // 2] = 4.0
    tokens, _ = sample(logits.repeat(n, 1), [seq_with(SamplingParams(temperature=1.0, min_p=0.5)) for _ in range(n)],
                       torch.Generator().manual_seed(7))
    assert set(tokens) == {0, vocab - 1}  # min_p 0.5 keeps the two best
    logits[0] = logits[-1] = -1e9  # now filtered: only the middle three may come out
    tokens, _ = sample(logits.repeat(n, 1), [seq_with(SamplingParams(temperature=1.0, top_k=3)) for _ in range(n)],
                       torch.Generator().manual_seed(8))
    assert set(tokens) == {1, vocab - 2, vocab // 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)  # sorted: token 4 (0.52), 0 (0.19), 1 (0.12), 2 (0.07), ...
    order = probs.argsort(descending=True)
    top_p = float(probs[order[:2]].sum()) - 0.01  # needs tokens 4 and 0; token 1 is not needed
    freq = _frequencies(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))
    kept = probs * 0
    kept[order[:2]] = probs[order[:2]]
    assert torch.allclose(freq, kept / kept.sum(), atol=0.03), freq


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    probs = LOGITS.softmax(-1)
    freq = _frequencies(LOGITS, SamplingParams(temperature=1.0, min_p=0.3))
    keep = probs >= 0.3 * probs.max()
    assert keep.sum() == 2  # tokens 4 and 0
    assert torch.allclose(freq, probs * keep / (probs * keep).sum(), atol=0.03), freq


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    seq = seq_with(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2, 3, 3])
    apply_penalties(logits, [seq])
    # Prompt and output tokens alike, once each however often they occur; token 4 and 5 untouched.
    assert logits.tolist() == [[1.0, -4.0, 0.5, -2.0, 0.5, 3.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(1, 6)
    seq = seq_with(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[0, 1], output=[1, 2, 2, 2])
    apply_penalties(logits, [seq])
    assert logits.tolist() == [[0.0, -0.75, -1.25, 0.0, 0.0, 0.0]]


def test_penalties_touch_only_the_rows_that_ask():
    logits = torch.ones(2, 6)
    plain = seq_with(SamplingParams(), output=[1, 1])
    penalised = seq_with(SamplingParams(frequency_penalty=1.0), output=[1, 1])
    apply_penalties(logits, [plain, penalised])
    assert logits[0].tolist() == [1.0] * 6
    assert logits[1].tolist() == [1.0, -1.0, 1.0, 1.0, 1.0, 1.0]


def test_greedy_with_a_penalty_avoids_the_repeated_token():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    seq = seq_with(SamplingParams(temperature=0, frequency_penalty=2.0), output=[0])
    tokens, _ = sample(logits, [seq], torch.Generator())
    assert tokens == [1]


def test_logprobs_are_of_the_penalised_distribution_before_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    seq = seq_with(SamplingParams(temperature=0.5, seed=0, logprobs=3, presence_penalty=1.0), output=[0])
    tokens, logprobs = sample(logits.clone(), [seq], torch.Generator())
    expected = torch.tensor([1.0, 1.0, 0.0, -1.0]).log_softmax(-1)
    (lp,) = logprobs
    assert lp.token_id == tokens[0]
    assert lp.logprob == pytest.approx(expected[tokens[0]].item(), abs=1e-6)
    assert [i for i, _ in lp.top][2] == 2
    assert [v for _, v in lp.top] == pytest.approx(sorted(expected.tolist(), reverse=True)[:3], abs=1e-6)


def test_a_seeded_draw_holds_when_its_probabilities_move_by_rounding():
    # A seeded request whose prompt is cached the second time, or that lands in another batch
    # size, gets logits that differ in their last bits (bf16 matmuls of another shape). Its
    # tokens must not: the inverse-CDF draw moved 62 of these 200 to another token.
    vocab, n = 49_152, 200
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(vocab, generator=g) * 2
    moved = logits * (1 + 1e-3 * torch.randn(vocab, generator=g))

    def draws(row: torch.Tensor) -> list[int]:
        seqs = [seq_with(SamplingParams(temperature=1.0, seed=seed)) for seed in range(n)]
        return sample(row.repeat(n, 1), seqs, torch.Generator().manual_seed(0))[0]

    before, after = draws(logits), draws(moved)
    assert len(set(before)) > n // 2  # it really samples, from a flat distribution
    assert sum(a != b for a, b in zip(before, after)) <= 2
