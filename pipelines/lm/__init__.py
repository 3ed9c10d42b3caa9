"""The bilinear LM: building, saving and loading it (`model`, the one module that makes
TransformerLens configs), training it (`training`), its behaviour on the lexicon
(`behaviour`) and converting the paper authors' checkpoints (`convert`).
"""
