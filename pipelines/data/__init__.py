"""Text in, token rows out: the built-in stories, corpus readers, labels, the tokenizer and
the packed token store.

- `stories`: the seeded story generator with negation ground truth;
- `story_corpus`: the built-in corpus's files, its lexicon and its gate tag (the negation gate);
- `corpus`: reading any corpus in batches of documents;
- `labels`: token labels from a corpus's spans and a lexicon;
- `tags`: label-based gate tags, the plug-in a corpus supplies to the verdicts;
- `tokenizer`: training and loading the tokenizer;
- `tokens`: packing a corpus into train and held-out rows on disk.
"""
