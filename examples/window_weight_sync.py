"""RL-style weight sync with a one-sided window: one trainer publishes, readers pull.

    torchrun --nproc-per-node 3 examples/window_weight_sync.py

Rank 0 trains a small model.  After every step it writes the flattened weights (and the
step number, in the last element) into its own window buffer (a plain in-place copy: the
registered tensor is the window) and signals each reader.  A reader (every other rank)
waits for that signal, ``get``s the weights straight out of the trainer's window (no
participation of the trainer's code: on another host its window server answers), loads
them into its own copy of the model and signals back, so the trainer never overwrites
weights that are still being read.  At the end a broadcast from the trainer checks that
every reader holds exactly the trainer's weights.
"""

from __future__ import annotations

import torch

from torchcomms import new_comm

STEPS = 5


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load(model: torch.nn.Module, values: torch.Tensor) -> None:
    at = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(values[at : at + p.numel()].view_as(p))
            at += p.numel()


def main() -> None:
    comm = new_comm("gloo", torch.device("cpu"), name="weight_sync")
    rank, size = comm.get_rank(), comm.get_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    numel = sum(p.numel() for p in model.parameters())
    # The trainer's window holds the weights plus a version slot; readers register a stub.
    buf = torch.zeros(numel + 1 if rank == 0 else 1)
    win = comm.new_window(buf)
    comm.barrier(False)
    readers = range(1, size)

    if rank == 0:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(256, 16)
        y = x.sum(dim=1, keepdim=True).sin()
        for step in range(1, STEPS + 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            buf[:numel] = flat(model)  # publish: write into the own window
            buf[numel] = step
            for r in readers:
                win.signal(r, False)  # "version `step` is ready"
            for r in readers:
                win.wait_signal(r, False)  # r has pulled it; safe to overwrite next step
            print(f"trainer: step {step} loss {loss.item():.4f} published to {size - 1} readers")
    else:
        pulled = torch.empty(numel + 1)
        for step in range(1, STEPS + 1):
            win.wait_signal(0, False)
            win.get(pulled, 0, 0, False)  # one-sided read of the trainer's window
            assert int(pulled[numel].item()) == step, (pulled[numel], step)
            load(model, pulled[:numel])
            win.signal(0, False)
    final = flat(model)
    reference = final.clone()
    comm.broadcast(reference, 0, False)
    assert torch.equal(final, reference), "a reader's weights differ from the trainer's"
    win.tensor_deregister()
    comm.barrier(False)
    if rank == 0:
        print(
            f"window_weight_sync OK: {size - 1} readers hold the trainer's weights after "
            f"{STEPS} steps"
        )
    comm.finalize()


if __name__ == "__main__":
    main()
