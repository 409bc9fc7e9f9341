"""A plain PyTorch training loop that shares its GPU through nodeagent.

It takes turns at the device with other sessions (``yield_point()`` after
every step) and, when asked for the whole device, parks the model and the
optimizer in host memory, frees the device memory, and carries on bit for bit
after the resume. Start a daemon, run this, and from another shell:

    nodeagent serve &
    python examples/train_loop.py --steps 2000
    python -c "import client_lib as c; print(c.suspend_session('SESSION'))"   # the id it printed
    python -c "import client_lib as c; c.resume_session('SESSION')"

``NODEAGENT_ENDPOINT`` picks another daemon. With ``--device cpu`` (what
``auto`` picks without CUDA) the "device" is host memory and the same code runs.

Order matters: the Client comes before anything touches CUDA, including
``torch.cuda.is_available()``, which initialises the driver. On a device with
MPS the welcome carries the process's MPS share, which CUDA reads only when it
initialises; a client that finds CUDA already started raises
``CudaTooEarlyError`` rather than run outside its partition.
"""

from __future__ import annotations

import argparse

from client_lib import Client


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--device", default="auto", help="cuda, cpu, or auto: cuda when there is one")
    ap.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    args = ap.parse_args()
    # A first line at once: torch takes seconds to import, and a silent start looks hung.
    print("train_loop: loading torch ...", flush=True)
    import torch
    from client_lib.torch import Yielder

    # The session first: the daemon may hand over settings (an MPS share) that
    # CUDA reads only when it initialises.
    with Client("examples/train_loop", workload="training") as client:
        if args.device == "auto":  # only now may CUDA start: the session's MPS settings are in place
            # The session's GPU, found by its UUID ("cuda:N"; "cpu" on a cpu daemon).
            args.device = client.cuda_device if torch.cuda.is_available() else "cpu"
        torch.manual_seed(0)
        device = torch.device(args.device)
        model = torch.nn.Sequential(torch.nn.Linear(256, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, 10)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        yielder = Yielder(client, modules=[model], optimizers=[opt])
        print(f"session {client.session_id} on device {client.device}; suspend it with "
              f"client_lib.suspend_session({client.session_id!r})", flush=True)
        with client.slice():  # hold the token; yield_point() hands it over when others wait
            for step in range(args.steps):
                x = torch.randn(64, 256, device=device)
                y = torch.randint(0, 10, (64,), device=device)
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if step % 100 == 0:
                    print(f"step {step} loss {loss.item():.4f}", flush=True)
                del loss  # nothing of this step's graph stays alive across the yield point
                seen = client.last_suspend
                client.yield_point()  # returns at once unless the daemon asked for something
                if client.last_suspend is not seen:
                    parked, suspend_ms, resume_ms = client.last_suspend
                    kept_mib = yielder.host_buffer.numel() / 2**20
                    print(f"step {step}: was suspended; parked {parked / 2**20:.1f} MiB in {suspend_ms:.1f} ms, "
                          f"back in {resume_ms:.1f} ms (host buffer of {kept_mib:.1f} MiB kept for next time)",
                          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
