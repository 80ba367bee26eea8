"""Offline, reproducible data for clover: stdlib corpus, verifiable tasks,
tokenizer training and the packed training stream.

Submodules: :mod:`.corpus`, :mod:`.tasks`, :mod:`.tokenizer`, :mod:`.mix`
(``mix`` imports torch; it is not imported here).
"""

from .corpus import heldout_functions, read_text, stdlib_files
from .tasks import (
    HELDOUT_SEED,
    TRAIN_SEED,
    Task,
    check_answer,
    generate_tasks,
    heldout_tasks,
    task_line,
    train_tasks,
)

__all__ = [
    "HELDOUT_SEED",
    "TRAIN_SEED",
    "Task",
    "check_answer",
    "generate_tasks",
    "heldout_functions",
    "heldout_tasks",
    "read_text",
    "stdlib_files",
    "task_line",
    "train_tasks",
]
