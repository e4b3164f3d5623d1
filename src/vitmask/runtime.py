"""Device and randomness, decided once per process."""

import random

import torch

from vitmask.errors import UserError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu. Asking for cuda without one is a user error."""
    if name not in DEVICES:
        raise UserError(f"unknown device '{name}'; use one of {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA GPU here; use --device cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too


def rng_state() -> dict:
    """The global RNG states, as plain data for a checkpoint."""
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_pos": random.getstate()[2]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
