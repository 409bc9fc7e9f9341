"""The framework examples and callbacks against a real daemon (cpu backend).

Each test runs where its framework is installed (lightning or pytorch_lightning;
transformers with accelerate) and is skipped elsewhere. The programs run in
child processes: a suspend that missed its deadline would SIGSTOP the process
that holds the session, and that must never be pytest's own."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading

import pytest

from client_lib import resume_session, suspend_session
from tests.conftest import REPO

EXAMPLES = REPO / "examples"


def _need_lightning() -> None:
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            importlib.import_module(name)
            return
        except ImportError:
            continue
    pytest.skip("PyTorch Lightning is not installed (pip install lightning)")


def _need_transformers() -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer refuses to run without it


NEEDS = {"lightning": _need_lightning, "huggingface": _need_transformers}


def _env(endpoint: str) -> dict[str, str]:
    return {**os.environ, "NODEAGENT_ENDPOINT": endpoint, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.slow
@pytest.mark.parametrize("framework, script, steps", [
    ("lightning", "lightning_yield.py", 5),
    ("huggingface", "hf_trainer_yield.py", 4),
])
def test_the_example_trains_a_few_steps_through_the_daemon(request, framework, script, steps):
    NEEDS[framework]()
    daemon = request.getfixturevalue("daemon")  # after the skip: a skipped test starts no daemon
    done = subprocess.run([sys.executable, str(EXAMPLES / script), "--steps", str(steps)], cwd=REPO,
                          env=_env(daemon.endpoint), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.strip().splitlines()[-1]
    name = script.removesuffix(".py")
    assert summary.startswith(f"{name}: session s-") and f"trained {steps} steps on cpu" in summary, done.stdout
    assert "never suspended" in summary
    session = summary.split()[2]
    assert f"[session] open session={session} name=examples/{name} " in daemon.log()  # through this daemon


# A training program that waits, before it starts to train, until the daemon has
# asked it to suspend; every use of the model before the end of the first step
# notes whether that suspend had already been honoured (parked, waited, resumed).
_SUSPEND_BEFORE_TRAINING = r"""
import json, sys, time
import torch
from client_lib import Client

framework, hold_token = sys.argv[1], sys.argv[2] == "hold"
client = Client("suspend-before-training", workload="training")
print(client.session_id, flush=True)
deadline = time.monotonic() + 60
while not client.suspend_requested:
    if time.monotonic() > deadline:
        sys.exit("no suspend notice within 60 s")
    time.sleep(0.01)
uses = []  # (what, honoured already)

def note(what):
    uses.append((what, client.last_suspend is not None))

x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
if framework == "lightning":
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    from client_lib.integrations.lightning import NodeAgentCallback

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):
            note("train")
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def validation_step(self, batch, batch_idx):
            note("sanity-check")  # Lightning validates before training starts

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                         limit_val_batches=1, callbacks=[NodeAgentCallback(client, hold_token=hold_token)])
    trainer.fit(Module(), loader, loader)
else:
    import tempfile
    import transformers
    from client_lib.integrations.huggingface import NodeAgentTrainerCallback

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 2)

        def forward(self, x, labels):
            note("train")
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    data = [{"x": x[i], "labels": y[i]} for i in range(16)]
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=2, per_device_train_batch_size=4, report_to="none", save_strategy="no",
            logging_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
        transformers.Trainer(model=Model(), args=args, train_dataset=data,
                             callbacks=[NodeAgentTrainerCallback(client, hold_token=hold_token)]).train()
print(json.dumps({"uses": uses}), flush=True)
client.close()
"""


@pytest.mark.slow
@pytest.mark.parametrize("framework, hold", [
    ("lightning", "hold"),  # before: honoured at on_train_start, after the sanity check had used the model
    ("lightning", "no-hold"),
    ("huggingface", "no-hold"),  # before: honoured only at the end of the first step
    ("huggingface", "hold"),  # already right before: taking the token at on_train_begin handles it
])
def test_a_suspend_asked_for_before_training_is_honoured_before_the_model_is_used(request, framework, hold):
    NEEDS[framework]()
    daemon = request.getfixturevalue("daemon")  # after the skip: a skipped test starts no daemon
    proc = subprocess.Popen([sys.executable, "-c", _SUSPEND_BEFORE_TRAINING, framework, hold], cwd=REPO,
                            env=_env(daemon.endpoint), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        session = proc.stdout.readline().strip()
        assert session.startswith("s-"), proc.stderr.read()
        outcome: dict = {}
        # A deadline far beyond the test's: the session must park by itself, never be SIGSTOPped.
        asking = threading.Thread(target=lambda: outcome.update(result=suspend_session(
            session, deadline_ms=120_000, endpoint=daemon.endpoint, timeout=150)))
        asking.start()
        asking.join(150)
        assert outcome.get("result") is not None and outcome["result"].outcome == "suspended", outcome
        resume_session(session, endpoint=daemon.endpoint)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, out + err
    uses = json.loads(out.strip().splitlines()[-1])["uses"]
    assert uses and uses[0][0] == ("sanity-check" if framework == "lightning" else "train"), uses
    assert all(honoured for _, honoured in uses), f"the model was used before the suspend was honoured: {uses}"
