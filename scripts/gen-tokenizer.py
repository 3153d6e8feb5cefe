#!/usr/bin/env python3
"""Regenerates src/sim/assets/tokenizer.json, the simulator's tokenizer.

The recipe is the one ../shared/tools/real-vllm/make_tiny.py uses for the tiny Llama that the
real vLLM captures were made with: a byte-level BPE of 2,000 tokens trained with the
`tokenizers` package 0.23.3 on CPython 3.11.7's LICENSE.txt and its first 120 stdlib modules.
The same tokenizer means `switchyard sim` counts the same prompt tokens as the real engine for
the same request, which the wire-fidelity tests check against the captures.

    python3 -m venv /tmp/tok && /tmp/tok/bin/pip install tokenizers==0.23.3
    /tmp/tok/bin/python scripts/gen-tokenizer.py /root/.pyenv/versions/3.11.7/lib/python3.11
"""
import glob
import json
import os
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

lib = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
    os.path.dirname(__file__), "..", "src", "sim", "assets", "tokenizer.json")
files = [f"{lib}/LICENSE.txt"] + sorted(glob.glob(f"{lib}/*.py"))[:120]

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIAL,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                              show_progress=False)
tok.train(files, trainer)
tok.post_processor = processors.ByteLevel(trim_offsets=False)
tok.save(out)
print("wrote", out, "vocab", tok.get_vocab_size())
