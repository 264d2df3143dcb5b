"""A user's script that trains with Hugging Face's Trainer (used by tests/test_real_code.py and
tests/test_integrations.py; imports mpdiag only to add its callback when asked).

Usage: python hf_trainer.py OUT_DIR [--bf16] [--mpdiag-callback STORE]
A 1-layer GPT-2 built from a config (no download) on random tokens, on the CPU, one log entry per step; the
Trainer clips through Accelerate and steps an AcceleratedOptimizer wrapping AdamW. Writes the Trainer's own
log history to OUT_DIR/log_history.json.
"""

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int, vocab: int):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (count, length), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main(out_dir: str, bf16: bool, callback_store: str | None = None) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=out_dir, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=bf16,
                             gradient_accumulation_steps=2, max_grad_norm=0.05, seed=0, disable_tqdm=True)
    callbacks = []
    if callback_store:
        from mpdiag.integrations.huggingface import MpdiagTrainerCallback

        callbacks.append(MpdiagTrainerCallback(store=callback_store, name="trainer callback"))
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(64, 16, 64), callbacks=callbacks)
    trainer.train()
    with open(os.path.join(out_dir, "log_history.json"), "w") as f:
        json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    options = sys.argv[2:]
    store = options[options.index("--mpdiag-callback") + 1] if "--mpdiag-callback" in options else None
    main(sys.argv[1], "--bf16" in options, store)
