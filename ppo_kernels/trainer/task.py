"""The embedded task: add two decimal amounts given as strings exactly, with a calculator tool.

In the spirit of the seed document's running example ("0.10" + "0.20" must print 0.30): the
calculator works in binary floating point, so for 0.10+0.20 it answers 0.30000000000000004 and the
Actor has to format that to two decimals. One episode, in characters:

    0.10+0.20={0.10+0.20}0.30000000000000004|0.30$
    ---prompt-|--action--|------tool (mask 0)-|act-|

The Actor may also answer without the tool ("0.10+0.20=0.30$"), which a tiny model does badly.
The verifier gives 1.0 when the final answer equals the exact Decimal sum printed with two decimals,
else 0.0. The SFT demonstrations mix three behaviours (answer directly; call the tool and copy its
float verbatim, execution B of the seed; call the tool and format it, execution A), so the SFT
model is only partly right and RL has something to learn: use the tool, and format its output.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from decimal import Decimal

TOOL_OPEN, TOOL_CLOSE, TOOL_END, EOS = "{", "}", "|", "$"


class CharTokenizer:
    """One id per character, plus pad / bos / eos, inside a vocabulary of `vocab_size` ids: the
    ids past the task's characters are tokens the task never needs (as in any real LM, whose
    vocabulary is far larger than what one task uses); they decode to a character outside the
    task's alphabet. Enough of the HF tokenizer API for the trainer."""

    chars = "0123456789.+=" + TOOL_OPEN + TOOL_CLOSE + TOOL_END + "eor"  # "error" from the tool
    unused = "\N{REPLACEMENT CHARACTER}"  # what an unused id decodes to

    def __init__(self, vocab_size: int | None = None):
        self.pad_token, self.bos_token, self.eos_token = "_", "^", EOS
        self.vocab = [self.pad_token, self.bos_token, self.eos_token] + list(self.chars)
        self.index = {c: i for i, c in enumerate(self.vocab)}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self.vocab_size = len(self.vocab) if vocab_size is None else vocab_size
        if self.vocab_size < len(self.vocab):
            raise ValueError(f"vocab_size: the task needs at least {len(self.vocab)} ids, got "
                             f"{vocab_size}")

    def __len__(self):
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            ids = [self.index[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer: character {e.args[0]!r} is not in the vocabulary "
                             f"{''.join(self.vocab)!r}") from None
        return ([self.bos_token_id] + ids) if add_special_tokens else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if skip_special_tokens and i in (self.pad_token_id, self.bos_token_id):
                continue
            out.append(self.vocab[i] if i < len(self.vocab) else self.unused)
        return "".join(out)

    def save_pretrained(self, path):
        import os
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "char_tokenizer.json"), "w") as f:
            json.dump({"vocab": self.vocab, "vocab_size": self.vocab_size}, f)


@dataclass(frozen=True)
class Problem:
    a: str
    b: str

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        """The exact sum, printed with two decimals (what the verifier wants)."""
        return f"{Decimal(self.a) + Decimal(self.b):.2f}"


def calculator(expression: str) -> str:
    """The tool: evaluates `x+y` in binary floating point and prints Python's repr of the float."""
    parts = expression.split("+")
    if len(parts) != 2:
        return "error"
    try:
        return repr(float(parts[0]) + float(parts[1]))
    except ValueError:
        return "error"


def format_two_decimals(float_text: str) -> str:
    """Execution A: round the calculator's output to cents (what the SFT demonstrations teach)."""
    return f"{Decimal(float_text).quantize(Decimal('0.01')):.2f}"


class DecimalAdditionTask:
    """Prompts, the tool environment, the verifier, demonstrations and preference pairs."""

    def __init__(self, p_tool: float = 0.5, p_format: float = 0.5):
        self.p_tool, self.p_format = p_tool, p_format

    # -- prompts -------------------------------------------------------------------------------
    @staticmethod
    def sample_problem(rng: random.Random) -> Problem:
        def amount():
            return f"{rng.randint(1, 999) / 100:.2f}"  # "0.01" .. "9.99", always d.dd
        return Problem(amount(), amount())

    def problems(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        return [self.sample_problem(rng) for _ in range(n)]

    # -- environment ---------------------------------------------------------------------------
    @staticmethod
    def tool_response(response_so_far: str) -> str | None:
        """Text the environment appends (mask 0) when the response just closed a tool call."""
        if not response_so_far.endswith(TOOL_CLOSE):
            return None
        start = response_so_far.rfind(TOOL_OPEN)
        if start < 0:
            return None
        return calculator(response_so_far[start + 1:-1]) + TOOL_END

    @staticmethod
    def final_answer(response: str) -> str | None:
        """The text after the last tool output (or the whole response) up to the end marker."""
        if EOS not in response:
            return None  # truncated: no answer
        body = response[:response.index(EOS)]
        if TOOL_END in body:
            body = body[body.rindex(TOOL_END) + 1:]
        return body

    def verify(self, problem: Problem, response: str) -> float:
        return 1.0 if self.final_answer(response) == problem.answer else 0.0

    # -- demonstrations (SFT) and preferences (RM, DPO) ------------------------------------------
    @staticmethod
    def segments(problem: Problem, kind: str) -> list[tuple[str, bool]]:
        """Response as (text, is_action) segments. kind: direct | copy (B) | format (A)."""
        if kind == "direct":
            return [(problem.answer + EOS, True)]
        call = f"{TOOL_OPEN}{problem.a}+{problem.b}{TOOL_CLOSE}"
        out = calculator(f"{problem.a}+{problem.b}")
        final = out if kind == "copy" else format_two_decimals(out)
        return [(call, True), (out + TOOL_END, False), (final + EOS, True)]

    def demonstration(self, problem: Problem, rng: random.Random) -> list[tuple[str, bool]]:
        if rng.random() >= self.p_tool:
            return self.segments(problem, "direct")
        return self.segments(problem, "format" if rng.random() < self.p_format else "copy")

    def preference_pair(self, problem: Problem, rng: random.Random):
        """(chosen, rejected) segments. Chosen: A (tool + formatted answer). Rejected, one of: the
        float copied verbatim (execution B, when that is wrong), a direct answer off by a cent or
        a dime, the tool's output formatted to a wrong value, or A cut off before it finished (an
        RM must not reward unfinished work, or PPO learns to never stop)."""
        chosen = self.segments(problem, "format")
        copied = calculator(f"{problem.a}+{problem.b}")
        off = f"{Decimal(problem.answer) + Decimal(rng.choice(['0.01', '-0.01', '0.10'])):.2f}"
        kind = rng.choice(["copy", "direct", "tool_wrong", "unfinished"])
        if kind == "copy" and copied != problem.answer:
            rejected = self.segments(problem, "copy")
        elif kind == "tool_wrong":
            rejected = chosen[:2] + [(off + EOS, True)]
        elif kind == "unfinished":
            text = "".join(t for t, _ in chosen)
            cut = rng.randint(1, len(text) - 1)
            rejected, pos = [], 0
            for t, a in chosen:  # keep the segments' action flags up to the cut
                if pos < cut:
                    rejected.append((t[:cut - pos], a))
                pos += len(t)
        else:
            rejected = [(off + EOS, True)]
        return chosen, rejected
