"""When does a lake warm start learn to read the board? Teacher-forced reading probes during the warm start.

The ``rows-`` reasoning styles make the warm start copy the board's rows above and below the player
(``Above: _O__.``) and name the cells around it (``Up hole.``, ``Down Left frozen.``). Whether the
tiny model learns this is a sudden transition somewhere in the warm start, or never
(bench/RESULTS.md, "Whole-word tokens"). This runs a preset's warm start (its demonstrations, its
supervised steps) and every ``--every`` steps scores the model on fresh demonstration episodes,
teacher-forced (the model's most likely next token against the demonstration's):

- ``rows``: the copied row after ``Above:`` / ``Below:`` (a row of the board, not ``wall``);
- ``holes out``: the word ``hole.`` of a cell above or below the player's row (``Up hole.``,
  ``Down Left hole.``): the reading the failed warm starts lacked;
- each split into the episode's first turn and its later turns (the later ones have earlier boards
  in their context);
- ``loss``: the mean training loss per demonstrated token over the last ``--every`` steps.

The warm start is the library's (``training.warm_start.warm_start``), as the preset and ``--set``
make it: ``warm_start.turn_steps`` steps on turn segments (each demonstrated turn with its own
observation only, one board in its context), then ``warm_start.steps`` on whole episodes.

Usage::

    python bench/reading_transition.py frozenlake-long --set model.name_or_path=tiny-rows-words \\
        --set warm_start.turn_steps=1500 --set warm_start.steps=1500 --seed 0 --every 250
"""

from __future__ import annotations

import argparse
import time

import torch
from demo_loss import FRESH_SEED_OFFSET  # bench/demo_loss.py (this folder is sys.path[0])

from ragen_tasks.data.token_batch import collate
from ragen_tasks.data.trajectory import Trajectory
from ragen_tasks.models.loading import load_policy
from ragen_tasks.presets import load_config
from ragen_tasks.training.warm_start import demonstrations, warm_start

PROBE_EPISODES = 256
ROW_COPY = {"Above:", "Below:"}
VERTICAL = {"Up", "Down"}


def probe_positions(episode: Trajectory, tokens: list[str]) -> dict[str, list[int]]:
    """Positions of the probed target tokens in ``episode``, by probe name (``rows first``, ...)."""
    found: dict[str, list[int]] = {}
    for turn, (start, end) in enumerate(zip(episode.turn_starts, episode.turn_ends, strict=True)):
        when = "first" if turn == 0 else "later"
        sentence: list[str] = []
        for position in range(start, end):
            word = tokens[position].replace("\u0120", "")  # BPE's leading-space mark
            if word == "</think>":
                break
            previous = sentence[-1] if sentence else ""
            if previous in ROW_COPY and word == "":
                sentence.append(previous)  # the space before a copied row: the row is the next token
                continue
            if previous in ROW_COPY and word != "wall.":
                found.setdefault(f"rows {when}", []).append(position)
            if word == "hole." and sentence and sentence[0] in VERTICAL:
                found.setdefault(f"holes out {when}", []).append(position)
            sentence.append(word)
            if word.endswith("."):
                sentence = []
    return found


@torch.no_grad()
def reading(model: torch.nn.Module, tokenizer: object, episodes: list[Trajectory]) -> dict[str, float]:
    """Teacher-forced accuracy of each probe over ``episodes``: {probe name: share right}."""
    model.eval()
    right: dict[str, list[int]] = {}
    pad_id = tokenizer.pad_token_id or 0  # type: ignore[attr-defined]
    for first in range(0, len(episodes), 32):
        chunk = episodes[first : first + 32]
        batch = collate(chunk, pad_id=pad_id)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # (b, T, V)
        guesses = logits.argmax(-1)  # (b, T): position t's guess for token t + 1
        for row, episode in enumerate(chunk):
            tokens = tokenizer.convert_ids_to_tokens(episode.input_ids)  # type: ignore[attr-defined]
            for name, positions in probe_positions(episode, tokens).items():
                hits = right.setdefault(name, [0, 0])
                for position in positions:
                    hits[0] += int(guesses[row, position - 1].item() == episode.input_ids[position])
                    hits[1] += 1
    model.train()
    return {name: hits[0] / hits[1] for name, hits in sorted(right.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--seed", type=int, default=0, help="the run's seed (the warm start's demonstrations and order)"
    )
    parser.add_argument("--every", type=int, default=200, help="steps between two probes")
    args = parser.parse_args()

    config = load_config(args.preset, [*args.overrides, f"seed={args.seed}"])
    ws = config.warm_start
    model, tokenizer = load_policy(config.model.name_or_path)
    fresh = demonstrations(
        tokenizer, config, seed=ws.seed_for(config.seed) + FRESH_SEED_OFFSET, episodes=PROBE_EPISODES
    )
    header: list[str] = []
    window: list[float] = []  # the training losses since the last probe
    started = time.perf_counter()

    def report(step: int) -> None:
        scores = reading(model, tokenizer, fresh)
        if not header:
            header.extend(scores)
            print("| step | phase | loss | " + " | ".join(header) + " | min |", flush=True)
            print("|---" * (len(header) + 4) + "|", flush=True)
        phase = "turns" if step <= ws.turn_steps and ws.turn_steps else "episodes"
        loss = sum(window) / len(window) if window else float("nan")
        cells = " | ".join(f"{scores.get(name, float('nan')):.3f}" for name in header)
        print(f"| {step} | {phase} | {loss:.4f} | {cells} | {(time.perf_counter() - started) / 60:.1f} |", flush=True)
        window.clear()

    def on_step(step: int, loss: float) -> None:  # step counts both phases of the warm start
        window.append(loss)
        if (step + 1) % args.every == 0:
            report(step + 1)

    report(0)
    warm_start(model, tokenizer, config, progress=on_step)


if __name__ == "__main__":
    main()
