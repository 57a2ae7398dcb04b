"""Scoring a model: validation loss during training, decoding, and word error rates.

- ``validation``: the loss over a whole split, apart from training's position and random state;
- ``decode``: greedy decoding with a KV cache, of transcripts or of answers to prompts;
- ``normalizers``, ``wer``: what references and hypotheses become before scoring, and the rates
  in counts that shards add up exactly.

``python -m train.evaluate`` (train/evaluate.py) is the command built on them.
"""
