"""Rank 0's console: a tqdm progress bar on a terminal, else one concise line
per log interval (loss, learning rate, tokens/s, elapsed and remaining)."""

from __future__ import annotations

import os
import sys
import time


class Console:
    """Rank 0's output: a tqdm bar on a terminal, else one line per interval."""

    def __init__(self, enabled: bool, first: int, last: int, log_every: int):
        self.enabled = enabled
        self.first, self.last, self.log_every = first, last, log_every
        self.t0 = time.monotonic()
        self.bar = None
        if enabled and last >= first and _terminal_width(sys.stderr) >= 40:
            from tqdm import tqdm

            self.bar = tqdm(total=last, initial=first - 1, unit="step", dynamic_ncols=True, file=sys.stderr)

    def say(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def step(self, rec: dict) -> None:
        if not self.enabled:
            return
        s = rec["step"]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}",
                                 tok_s=f"{rec['tokens_per_s']:.0f}", refresh=False)
            return
        if s % self.log_every == 0 or s in (self.first, self.last):
            elapsed = time.monotonic() - self.t0
            left = elapsed / (s - self.first + 1) * (self.last - s)
            print(f"step {s:>{len(str(self.last))}}/{self.last} | loss {rec['loss']:.4f} | "
                  f"lr {rec['lr']:.2e} | {rec['tokens_per_s']:,.0f} tok/s | "
                  f"{_clock(elapsed)} elapsed, {_clock(left)} left", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _terminal_width(stream) -> int:
    """Columns of the terminal ``stream`` writes to; 0 if it is not one."""
    try:
        return os.get_terminal_size(stream.fileno()).columns if stream.isatty() else 0
    except (AttributeError, OSError, ValueError):
        return 0


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"
