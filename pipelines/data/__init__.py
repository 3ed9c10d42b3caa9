"""Text in, token rows out: the built-in stories, corpus readers, labels, the tokenizer and
the packed token store.

- `stories`: the seeded story generator with negation ground truth;
- `corpus`: reading any corpus in batches of documents (and writing the built-in one);
- `labels`: token labels from a corpus's spans and a lexicon;
- `tokenizer`: training and loading the tokenizer;
- `tokens`: packing a corpus into train and held-out rows on disk.
"""
