"""Chat instructions made offline, for self-distilling an instruction-tuned model (its AR greedy
answers become the targets) and a question set with known answers to measure it on.

Instructions come from templates over small word lists (facts, arithmetic, lists, writing, code),
from the code-shaped tasks (`clover.data.tasks`) and from function headers of the Python standard
library (`clover.data.corpus`). Every instruction has a split fixed by a hash of its text: one in
ten is held out and never reaches a training stream (`instructions("train")` excludes it). The
question set (`questions`) is drawn from held-out instructions only; each question has its answer.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from . import corpus, tasks

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Canada": "Ottawa", "Greece": "Athens",
    "Portugal": "Lisbon", "Austria": "Vienna", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki",
    "Poland": "Warsaw", "Ireland": "Dublin", "Kenya": "Nairobi", "Peru": "Lima", "Cuba": "Havana",
    "Thailand": "Bangkok", "Denmark": "Copenhagen", "Hungary": "Budapest", "Argentina": "Buenos Aires",
    "England": "London", "South Korea": "Seoul", "India": "New Delhi", "Mexico": "Mexico City",
}
FACTS = [
    ("What color is the sky on a clear day?", "blue"), ("How many days are in a week?", "seven|7"),
    ("How many legs does a spider have?", "eight|8"), ("What is the largest planet in the solar system?", "Jupiter"),
    ("What gas do plants absorb from the air?", "carbon dioxide|CO2"), ("What is frozen water called?", "ice"),
    ("How many months are in a year?", "twelve|12"), ("What is the opposite of hot?", "cold"),
    ("Which planet is known as the Red Planet?", "Mars"), ("What is the boiling point of water in Celsius?", "100"),
    ("How many continents are there?", "seven|7"), ("What animal says moo?", "cow"),
    ("Who wrote Romeo and Juliet?", "Shakespeare"), ("What is the chemical symbol for gold?", "Au"),
    ("How many sides does a triangle have?", "three|3"), ("What is the closest star to Earth?", "Sun"),
]
TOPICS = ["the ocean", "autumn", "a cat", "coffee", "the moon", "friendship", "rain", "mountains", "a city at night",
          "learning to code", "trees", "the wind", "music", "winter", "a garden", "stars"]
WRITING = ["Write a short poem about {t}.", "Write one sentence about {t}.", "Give me three facts about {t}.",
           "Describe {t} in two sentences.", "Write a haiku about {t}.", "Tell me a short story about {t}."]
ADVICE = ["How can I sleep better?", "Give me a tip for learning Python.", "How do I make a cup of tea?",
          "What should I pack for a beach trip?", "How can I stay focused while studying?",
          "Give me an idea for a weekend project.", "How do I write a good email?", "What is a healthy breakfast?",
          "How do I start running?", "Suggest a name for a pet goldfish.", "What are the benefits of reading?",
          "Explain what a computer is to a child.", "What is machine learning?", "What is the internet?",
          "Why is exercise important?", "What is photosynthesis?", "Explain gravity in simple words.",
          "What is a prime number?", "What does a CPU do?", "What is an API?"]
CODE = ["reverses a string", "checks if a number is prime", "returns the largest item of a list",
        "counts the vowels in a string", "computes the factorial of n", "sums a list of numbers",
        "checks if a word is a palindrome", "returns the n-th Fibonacci number", "removes duplicates from a list",
        "converts Celsius to Fahrenheit", "merges two sorted lists", "counts words in a sentence",
        "flattens a nested list", "returns the average of a list", "finds the index of an item in a list"]
CATEGORIES = ["fruits", "colors", "animals", "countries in Europe", "programming languages", "vegetables",
              "musical instruments", "sports", "planets", "birds"]


@dataclass(frozen=True)
class Question:
    prompt: str  # the user message
    answers: tuple[str, ...]  # accepted answers (any one, case-insensitive, found in the reply)
    kind: str

    def check(self, reply: str) -> bool:
        low = reply.lower()
        return any(a.lower() in low for a in self.answers)


def split_of(text: str) -> str:
    """"heldout" for one instruction in ten (by a hash of its text), else "train"."""
    return "heldout" if hashlib.sha256(text.encode()).digest()[0] % 10 == 0 else "train"


def _arith(rng: random.Random) -> Question:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    op = rng.choice(["+", "-", "*"])
    value = a + b if op == "+" else a - b if op == "-" else a * b
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    form = rng.choice([f"What is {a} {op} {b}?", f"What is {a} {word} {b}?", f"Compute {a} {op} {b}."])
    return Question(form, (str(value),), "arithmetic")


def _list(rng: random.Random) -> Question:
    xs = [rng.randint(1, 50) for _ in range(rng.randint(3, 5))]
    kind = rng.choice(["sort", "max", "min", "len"])
    if kind == "sort":
        return Question(f"Sort these numbers in ascending order: {', '.join(map(str, xs))}.",
                        (", ".join(map(str, sorted(xs))),), "lists")
    if kind == "max":
        return Question(f"What is the largest number in this list: {', '.join(map(str, xs))}?", (str(max(xs)),), "lists")
    if kind == "min":
        return Question(f"What is the smallest number in this list: {', '.join(map(str, xs))}?", (str(min(xs)),), "lists")
    return Question(f"How many numbers are in this list: {', '.join(map(str, xs))}?", (str(len(xs)),), "lists")


def _code_assert(rng: random.Random) -> Question:
    t = next(tasks.iter_tasks(rng, exclude_heldout=False))
    return Question(f"Complete this Python line with the right value:\n{t.prompt.rstrip()}", (t.answer,), "code")


def _fact(rng: random.Random) -> Question:
    if rng.random() < 0.6:
        country = rng.choice(sorted(CAPITALS))
        form = rng.choice(["What is the capital of {c}?", "Name the capital city of {c}.", "Which city is the capital of {c}?"])
        return Question(form.format(c=country), (CAPITALS[country],), "facts")
    q, a = rng.choice(FACTS)
    return Question(q, tuple(a.split("|")), "facts")


QUESTION_KINDS = {"facts": _fact, "arithmetic": _arith, "lists": _list, "code": _code_assert}


def _open_instruction(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.3:
        return rng.choice(WRITING).format(t=rng.choice(TOPICS))
    if r < 0.5:
        return rng.choice(ADVICE)
    if r < 0.7:
        return f"Write a Python function that {rng.choice(CODE)}."
    if r < 0.85:
        return f"List {rng.choice(['three', 'four', 'five'])} {rng.choice(CATEGORIES)}."
    return ""  # a stdlib function: filled in by the caller


FUNCTION_POOL = 120  # stdlib functions the instructions draw from: fixed, so that fewer is a prefix of more


def instructions(split: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct user messages of `split` ("train" or "heldout"): half open instructions
    (writing, advice, code, lists, stdlib functions to explain or complete), half questions.
    The first `n` of a longer list (same split and seed) are this list."""
    rng = random.Random(f"clover-instructions:{seed}")
    funcs = corpus.functions("train" if split == "train" else "heldout", FUNCTION_POOL, seed=seed)
    out: list[str] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n and tries < 200 * n:
        tries += 1
        if rng.random() < 0.5:
            text = QUESTION_KINDS[rng.choice(sorted(QUESTION_KINDS))](rng).prompt
        else:
            text = _open_instruction(rng)
            if not text:
                header = rng.choice(funcs)[0].strip()
                text = rng.choice(["Explain what this Python function does:\n", "Complete this Python function:\n"]) + header
        if text in seen or split_of(text) != split:
            continue
        seen.add(text)
        out.append(text)
    return out


def questions(n: int, seed: int = 0) -> list[Question]:
    """`n` held-out questions with known answers, balanced over `QUESTION_KINDS`."""
    rng = random.Random(f"clover-questions:{seed}")
    out: list[Question] = []
    seen: set[str] = set()
    kinds = sorted(QUESTION_KINDS)
    tries = 0
    while len(out) < n and tries < 1000 * n:
        tries += 1
        q = QUESTION_KINDS[kinds[tries % len(kinds)]](rng)
        if q.prompt in seen or split_of(q.prompt) != "heldout":
            continue
        seen.add(q.prompt)
        out.append(q)
    return out
