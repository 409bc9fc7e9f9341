"""A Hugging Face ``transformers.Trainer`` taking turns at its device through nodeagent.

``NodeAgentTrainerCallback`` (``client_lib.integrations.huggingface``) holds
the device's token during ``train()``, calls ``yield_point()`` after every
optimizer step, and, when the daemon asks for the whole device, parks the
model and optimizer in host memory until the resume. A tiny BERT with random
weights (built from a config: nothing is downloaded) trains for a few steps
on random tokens; start a daemon first:

    nodeagent serve &
    python examples/hf_trainer_yield.py --steps 500   # suspend it from another shell:
    python -c "import client_lib as c; print(c.suspend_session('SESSION'))"   # the id it printed
    python -c "import client_lib as c; c.resume_session('SESSION')"

Needs ``pip install transformers accelerate``: the Trainer requires
``accelerate``. ``NODEAGENT_ENDPOINT`` picks another daemon; on a cpu daemon
the model trains on the CPU.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from client_lib import Client


class RandomTokens(torch.utils.data.Dataset):
    """Random token ids with random labels: what the Trainer's default collator stacks."""

    def __init__(self, n: int, vocab: int, length: int = 16, classes: int = 2) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()

    # The session before anything touches CUDA: the welcome may carry an MPS share.
    with Client("examples/hf_trainer_yield", workload="training") as client:
        on_gpu = client.welcome.backend == "cuda"
        if on_gpu:  # the Trainer uses every GPU it can see (DataParallel): show it only this session's
            os.environ["CUDA_VISIBLE_DEVICES"] = client.device_uuid
        import transformers  # after the environment is set: it may initialise CUDA
        from client_lib.integrations.huggingface import NodeAgentTrainerCallback

        transformers.set_seed(0)
        config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=32, num_labels=2)
        model = transformers.BertForSequenceClassification(config)
        data = RandomTokens(args.steps * args.batch_size, config.vocab_size)
        print(f"session {client.session_id} on {'cuda' if on_gpu else 'cpu'}; suspend it with "
              f"client_lib.suspend_session({client.session_id!r})", flush=True)
        with tempfile.TemporaryDirectory(prefix="hf_trainer_yield-") as out:
            training = transformers.TrainingArguments(
                output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
                learning_rate=1e-3, use_cpu=not on_gpu, report_to="none", save_strategy="no",
                logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0)
            trainer = transformers.Trainer(model=model, args=training, train_dataset=data,
                                           callbacks=[NodeAgentTrainerCallback(client)])
            result = trainer.train()
        suspended = "never suspended" if client.last_suspend is None else \
            f"last suspend parked {client.last_suspend[0] / 2**20:.1f} MiB"
        print(f"hf_trainer_yield: session {client.session_id} trained {result.global_step} steps on "
              f"{'cuda' if on_gpu else 'cpu'}, loss {result.training_loss:.4f}, {suspended}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
