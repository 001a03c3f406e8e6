"""Training stoker's own small models: corpus, tokenizer, Llama pretraining and draft distillation.

`scripts/train_default_model.py` builds the bundled `models/stoker-tiny` (target) and
`models/stoker-tiny-draft` from scratch; `stoker train-draft` (`train_draft.main`) distils a
speculative-decoding draft for any Llama-family target folder.
"""
