"""Synthetic verifiable tasks for the embedded RL demo, with a character tokenizer we own.

Tasks (fixed-length answers, exact-match reward):
  add:     "042+917=" -> "0959"   (3-digit addition, zero padded)
  add5:    "04213+91777=" -> "095990" (5-digit addition: harder, for models that saturate on add)
  reverse: "31415>"   -> "51413"  (reverse a 5-digit string)
A noisy-label SFT set (a share of wrong labels: carries dropped / one swapped pair) gives a warm start
with non-trivial but improvable reward, so RL has something to show (reference/RL_DEMO_PROBE.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..rollout.base import is_int, is_real


class CharTokenizer:
    """Characters ``0-9 + = >`` plus PAD (0), BOS, EOS."""

    SPECIALS = ("<pad>", "<bos>", "<eos>")
    CHARS = "0123456789+=>"

    def __init__(self):
        self.itos = list(self.SPECIALS) + list(self.CHARS)
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        bad = sorted({c for c in text if c not in self.stoi})
        if bad:
            raise ValueError(f"characters {bad} are not in the vocabulary {self.CHARS!r}")
        ids = [self.stoi[c] for c in text]
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids, *, strict: bool = False) -> str:
        """The text up to the first EOS; other special tokens are dropped, or with ``strict`` kept as their names
        (``<bos>``), so that a response holding one never equals an answer: the reward's decode."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()  # (an integer tensor's ids as ints; a float tensor's as floats, refused below)
        if isinstance(ids, str | bytes):  # (each character was taken as an id: "345" decoded as "012")
            raise ValueError(f"ids={ids!r} must be token ids (ints), not text")
        out = []
        for i in ids:
            if not is_int(i):  # (int() took 3.9 as the id 3 and True as BOS, silently)
                raise ValueError(f"token id {i!r} ({type(i).__name__}) is not an int")
            i = int(i)
            if not 0 <= i < len(self.itos):  # (a negative id decoded as a character from the end: -1 as ">")
                raise ValueError(f"token id {i} is outside the vocabulary [0, {len(self.itos)}) of {self.itos}")
            if i == self.eos_id:
                break
            if i >= len(self.SPECIALS) or strict:
                out.append(self.itos[i])
        return "".join(out)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task:
    name: str
    answer_len: int

    def sample(self, g: torch.Generator) -> Problem:
        raise NotImplementedError

    def noisy_answer(self, p: Problem, g: torch.Generator) -> str:
        raise NotImplementedError

    def reward(self, p: Problem, response: str) -> float:
        """1.0 for an exact answer, else 0.0. ``response``: the decoded text (token ids: ``response_rewards``)."""
        if not isinstance(response, str):  # (token ids never equal the answer: every reward was 0)
            raise TypeError(f"Task.reward takes the decoded response text, got {type(response).__name__} "
                            f"{response!r:.60}: score token ids with response_rewards")
        return float(response == p.answer)


def _digits(g: torch.Generator, n: int) -> str:
    return "".join(str(int(d)) for d in torch.randint(0, 10, (n,), generator=g))


class AdditionTask(Task):
    """``digits``-digit addition, operands and sum zero padded (sum: ``digits + 1`` characters)."""

    def __init__(self, digits: int = 3):
        if not is_int(digits) or digits < 1:  # (0 and 2.0 failed deep in sample: int(''), randint's arguments)
            raise ValueError(f"digits={digits!r} must be an int >= 1")
        self.digits, self.answer_len = digits, digits + 1
        self.name = "add" if digits == 3 else f"add{digits}"

    def sample(self, g):
        d = self.digits
        a, b = int(_digits(g, d)), int(_digits(g, d))
        return Problem(f"{a:0{d}d}+{b:0{d}d}=", f"{a + b:0{d + 1}d}")

    def noisy_answer(self, p, g):
        d = self.digits
        a, b = p.prompt[:d], p.prompt[d + 1 : 2 * d + 1]
        no_carry = "".join(str((int(x) + int(y)) % 10) for x, y in zip(a, b))
        return "0" + no_carry


class ReverseTask(Task):
    name, answer_len = "reverse", 5

    def sample(self, g):
        s = _digits(g, 5)
        return Problem(f"{s}>", s[::-1])

    def noisy_answer(self, p, g):
        r = list(p.answer)
        i = int(torch.randint(0, 4, (1,), generator=g))
        r[i], r[i + 1] = r[i + 1], r[i]
        return "".join(r)


TASKS = {"add": AdditionTask, "add5": lambda: AdditionTask(5), "reverse": ReverseTask}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task={name!r} is not one of {sorted(TASKS)}")
    return TASKS[name]()


def response_rewards(task: Task, tok: CharTokenizer, problems, responses) -> list[float]:
    """Each response's reward; a special token other than the closing EOS (a sampled BOS or PAD, which a lax decode
    drops) makes it wrong."""
    problems, responses = list(problems), list(responses)
    if len(problems) != len(responses):  # (zip dropped the extra ones: fewer rewards than responses, no word)
        raise ValueError(f"{len(problems)} problems for {len(responses)} responses: one problem per response (a "
                         "group's problem repeated group_size times)")
    return [task.reward(p, tok.decode(r, strict=True)) for p, r in zip(problems, responses)]


def sft_batch(task: Task, tok: CharTokenizer, n: int, g: torch.Generator, noise: float):
    """Token ids [n, L] (BOS prompt answer EOS) and a loss mask over the answer + EOS positions."""
    if not is_int(n) or n < 1:  # (0 and -3 gave an empty batch [0])
        raise ValueError(f"n={n!r} must be an int >= 1 (sequences in the batch)")
    if not is_real(noise) or not 0 <= noise <= 1:  # (NaN drew no wrong label, 2 only wrong ones)
        raise ValueError(f"noise={noise!r} must be a number in [0, 1] (the share of wrong labels)")
    seqs, masks = [], []
    for _ in range(n):
        p = task.sample(g)
        wrong = float(torch.rand((), generator=g)) < noise
        ans = task.noisy_answer(p, g) if wrong else p.answer
        prompt = tok.encode(p.prompt, bos=True)
        full = prompt + tok.encode(ans, eos=True)
        seqs.append(full)
        masks.append([0] * len(prompt) + [1] * (len(full) - len(prompt)))
    return torch.tensor(seqs), torch.tensor(masks, dtype=torch.bool)
