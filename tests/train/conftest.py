"""Fixtures of the training tests: a small multi-document corpus."""

import pytest

CORPUS = "\n\n".join(f"Scene {i}. " + "To be, or not to be, that is the question. " * (3 + i % 4) +
                     "Whether 'tis nobler in the mind to suffer the slings and arrows. " * (i % 3 + 1)
                     for i in range(40))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small multi-document corpus directory (one document per file) and a tokenizer cache."""
    root = tmp_path_factory.mktemp("corpus")
    for i, doc in enumerate(CORPUS.split("\n\n")):
        (root / f"doc{i:02d}.txt").write_text(doc)
    return root
