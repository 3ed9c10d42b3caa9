"""The valence probe scores a model by the ground truth of the built-in corpus."""

import pytest
import torch

from pipelines.corpus import stories_frame
from pipelines.data import pack_corpus
from pipelines.stories import POSITIVE, StoryConfig, generate_stories
from pipelines.tokenizer import TokenizerConfig, train_tokenizer
from pipelines.valence import valence_accuracy, word_ids


class AlwaysPositive:
    """A stand-in LM whose every prediction favours the positive words."""

    def __init__(self, vocab: int, positive: list[int]):
        self.bias = torch.zeros(vocab)
        self.bias[positive] = 5.0

    def __call__(self, tokens):
        return self.bias.expand(*tokens.shape, -1)


def test_accuracy_of_a_constant_model_is_the_share_of_positive_words():
    stories = generate_stories(StoryConfig(n_stories=300, seed=9))
    tok = train_tokenizer([s.text for s in stories], TokenizerConfig(vocab_size=500))
    rows = pack_corpus(stories_frame(stories), tok, n_ctx=64)
    model = AlwaysPositive(tok.get_vocab_size(), word_ids(tok, POSITIVE))
    scores = valence_accuracy(model, rows, tok)

    nxt = rows.labels["sentiment"][:, 1:].long()
    ctx = rows.labels["context"][:, 1:].long()
    negated = (nxt != 0) & (nxt == -ctx)
    plain = (nxt != 0) & ~negated
    assert scores["negated_count"] == int(negated.sum()) > 50
    assert scores["plain_count"] == int(plain.sum()) > 50
    assert scores["plain_accuracy"] == pytest.approx((nxt[plain] == 1).double().mean().item())
    assert scores["negated_accuracy"] == pytest.approx((nxt[negated] == 1).double().mean().item())
